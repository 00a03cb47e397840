//! Surviving a lost rank without a restart, with real processes: ranks all-reduce in a loop; a
//! rank is killed (SIGKILL) or revokes; the survivors agree on the failed set, shrink, check
//! every later result against their new size, and finish. Also: two ranks killed at once, a
//! rank killed during the agreement and during the shrink, and a newcomer admitted by grow.
//! The job's store runs in this test process, as `weft run`'s launcher serves it. This binary
//! re-executes itself in the rank's role.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use weftcc::{Communicator, Error, ReduceOp};

const ROLE: &str = "WEFT_TEST_RECOVERY_ROLE";
/// Membership changes (shrinks and grows) a rank sees before it finishes.
const CHANGES: &str = "WEFT_TEST_CHANGES";
/// Communicator size a rank must reach before it finishes.
const FINAL_SIZE: &str = "WEFT_TEST_FINAL_SIZE";
/// `rank:step`: that rank revokes the communicator before that step.
const REVOKE_AT: &str = "WEFT_TEST_REVOKE_AT";
/// `agree` or `shrink`: this rank dies (SIGKILL) in that step of its first recovery.
const DIE_IN: &str = "WEFT_TEST_DIE_IN";
/// Steps every rank runs after its last membership change before it finishes.
const STEPS_AFTER: u64 = 100;
/// Elements of each all-reduce.
const COUNT: usize = 2048;

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn die() -> ! {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    std::process::abort()
}

/// Microseconds since the UNIX epoch (the ranks share this host's clock).
fn unix_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// A rank list as one word: `1,2`, or `-` for none.
fn list(ranks: &[usize]) -> String {
    if ranks.is_empty() {
        return "-".into();
    }
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// After a change of membership: every rank continues from the earliest step any rank
/// completed (a rank may have completed the step in which another saw the failure).
fn resync(comm: &Communicator, step: u64) -> weftcc::Result<u64> {
    let mut s = [step];
    comm.all_reduce_in_place(&mut s, ReduceOp::Min)?;
    Ok(s[0])
}

/// Agrees and shrinks until a shrink succeeds (a rank dying meanwhile fails it on every
/// survivor: agree again). Returns the new communicator and the failed set it excluded.
fn recover(comm: &Communicator) -> weftcc::Result<(Communicator, Vec<usize>)> {
    let die_in = std::env::var(DIE_IN).unwrap_or_default();
    for _ in 0..5 {
        let t0 = Instant::now();
        let agreed = comm.agree_on_failures()?;
        let agree_us = t0.elapsed().as_micros();
        if die_in == "agree" {
            die();
        }
        if die_in == "shrink" {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(3));
                die()
            });
        }
        let t1 = Instant::now();
        match comm.shrink(&agreed.failed) {
            Ok(c) => {
                println!(
                    "TIMES agree_us={agree_us} shrink_us={}",
                    t1.elapsed().as_micros()
                );
                return Ok((c, agreed.failed));
            }
            Err(e @ (Error::Bootstrap { .. } | Error::PeerLost { .. } | Error::Timeout { .. })) => {
                println!("RETRY {e}");
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::Config("no shrink succeeded in 5 rounds".into()))
}

/// A rank's role: all-reduce ones in a loop (each result must equal the size), recover from
/// failures, admit newcomers, finish `STEPS_AFTER` steps after the expected changes.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let want_changes = env_usize(CHANGES, 1);
    let final_size = env_usize(FINAL_SIZE, 0);
    let revoke_at: Option<(usize, u64)> = std::env::var(REVOKE_AT).ok().and_then(|v| {
        let (r, s) = v.split_once(':')?;
        Some((r.parse().ok()?, s.parse().ok()?))
    });
    let (mut comm, mut changes, mut step) = if role == "newcomer" {
        let id = weftcc::UniqueId {
            addr: std::env::var("WEFT_STORE").unwrap(),
            token: std::env::var("WEFT_JOB_TOKEN").unwrap(),
        };
        let comm = Communicator::join_grown(&id, weftcc::CommConfig::from_env().unwrap())
            .expect("newcomer joins");
        let step = resync(&comm, u64::MAX).expect("newcomer resync");
        println!(
            "RECOVERED epoch={} size={} rank={} failed=- ms=0",
            comm.epoch(),
            comm.size(),
            comm.rank()
        );
        (comm, want_changes, step)
    } else {
        (Communicator::from_env().expect("join"), 0, 0)
    };
    let mut since_change = 0u64;
    let mut resync_due = false;
    let mut ready = false;
    let mut buf = vec![1.0f64; COUNT];
    loop {
        if changes >= want_changes && comm.size() >= final_size && since_change >= STEPS_AFTER {
            if let Ok(dir) = std::env::var("WEFT_TRACE_DUMP_DIR") {
                comm.dump_trace(std::path::Path::new(&dir)).expect("dump");
            }
            println!(
                "DONE size={} epoch={} rank={}",
                comm.size(),
                comm.epoch(),
                comm.rank()
            );
            return;
        }
        if revoke_at == Some((comm.rank(), step)) && comm.epoch() == 0 {
            println!("REVOKE at_us={}", unix_us());
            comm.revoke();
        }
        if resync_due {
            // A failure here is handled as any other: recover again.
            match resync(&comm, step) {
                Ok(s) => {
                    step = s;
                    resync_due = false;
                    since_change = 0;
                    continue;
                }
                Err(e) => {
                    println!("ERROR {} {e}", e.kind_name());
                    match recover(&comm) {
                        Ok((new, failed)) => {
                            drop(std::mem::replace(&mut comm, new));
                            println!(
                                "RECOVERED epoch={} size={} rank={} failed={} ms=0",
                                comm.epoch(),
                                comm.size(),
                                comm.rank(),
                                list(&failed)
                            );
                            continue;
                        }
                        Err(e) => {
                            println!("FAILED {e}");
                            return;
                        }
                    }
                }
            }
        }
        buf.fill(1.0);
        let done = comm
            .all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .and_then(|()| {
                // After a shrink, newcomers may wait.
                if changes > 0 && comm.size() < final_size {
                    let waiting = comm.joiners_waiting()?;
                    if waiting > 0 {
                        return Err(Error::Config(format!("grow {waiting}")));
                    }
                }
                Ok(())
            });
        match done {
            Ok(()) => {
                let size = comm.size() as f64;
                assert!(
                    buf.iter().all(|&x| x == size),
                    "step {step}: sum {} on {} ranks",
                    buf[0],
                    comm.size()
                );
                step += 1;
                since_change += 1;
                if !ready {
                    println!("READY");
                    ready = true;
                }
            }
            Err(Error::Config(grow)) if grow.starts_with("grow ") => {
                let joining: usize = grow[5..].parse().unwrap();
                println!("GROWING {joining}");
                let started = Instant::now();
                match comm.grow(joining) {
                    Ok(grown) => comm = grown,
                    // A newcomer that died: the set-up ends on every member, which go on as
                    // they were and admit the next one.
                    Err(e) => {
                        println!("GROW_FAILED ms={} {e}", started.elapsed().as_millis());
                        continue;
                    }
                }
                changes += 1;
                resync_due = true;
                println!(
                    "RECOVERED epoch={} size={} rank={} failed=- ms=0",
                    comm.epoch(),
                    comm.size(),
                    comm.rank()
                );
            }
            Err(e) => {
                let failed_at = Instant::now();
                let variant = e.kind_name();
                println!("ERROR_AT at_us={}", unix_us());
                println!("ERROR {variant} {e}");
                let (new, failed) = match recover(&comm) {
                    Ok(r) => r,
                    Err(e) => {
                        println!("FAILED {e}");
                        return;
                    }
                };
                drop(std::mem::replace(&mut comm, new));
                changes += 1;
                resync_due = true;
                println!(
                    "RECOVERED epoch={} size={} rank={} failed={} ms={}",
                    comm.epoch(),
                    comm.size(),
                    comm.rank(),
                    list(&failed),
                    failed_at.elapsed().as_millis()
                );
            }
        }
    }
}

/// A job of child processes meeting at a store this test serves.
struct Job {
    children: Vec<Option<Child>>,
    lines: mpsc::Receiver<(usize, String)>,
    tx: mpsc::Sender<(usize, String)>,
    store: weftcc::store::StoreServer,
    token: String,
}

impl Job {
    fn start(n: usize, env_of: impl Fn(usize) -> Vec<(&'static str, String)>) -> Job {
        let token = format!("recovery-{}-{}", std::process::id(), rand_suffix());
        let store = weftcc::comm::serve_store("127.0.0.1:0", &token).expect("store");
        let (tx, lines) = mpsc::channel();
        let mut job = Job {
            children: Vec::new(),
            lines,
            tx,
            store,
            token,
        };
        for rank in 0..n {
            let mut env = vec![
                (ROLE, "rank".to_string()),
                ("WEFT_RANK", rank.to_string()),
                ("WEFT_WORLD_SIZE", n.to_string()),
            ];
            env.extend(env_of(rank));
            job.spawn(env);
        }
        job
    }

    /// Starts a child with `env`; its lines arrive numbered by its index.
    fn spawn(&mut self, env: Vec<(&'static str, String)>) {
        let index = self.children.len();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "child_role",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env("WEFT_STORE", self.store.local_addr().to_string())
        .env("WEFT_JOB_TOKEN", &self.token)
        .env("WEFT_TIMEOUT", "20")
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("WEFT_TEST_VERBOSE").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((index, line));
            }
        });
        self.children.push(Some(child));
    }

    fn kill(&mut self, index: usize) {
        if let Some(c) = self.children[index].as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children[index] = None;
    }

    /// The next line of any child, within `limit`.
    fn next(&self, limit: Duration) -> (usize, String) {
        self.lines
            .recv_timeout(limit)
            .expect("no line from the ranks in time")
    }

    /// Waits for READY from each child of `which`.
    fn wait_ready(&self, which: &[usize]) {
        let mut left: Vec<usize> = which.to_vec();
        while !left.is_empty() {
            let (i, line) = self.next(Duration::from_secs(30));
            assert!(!line.starts_with("FAILED"), "child {i}: {line}");
            if line == "READY" {
                left.retain(|&r| r != i);
            }
        }
    }

    /// Collects every line until each child of `which` printed DONE (or FAILED: a test
    /// failure); returns them by child.
    fn until_done(&self, which: &[usize], limit: Duration) -> Vec<Vec<String>> {
        let deadline = Instant::now() + limit;
        let mut lines: Vec<Vec<String>> = vec![Vec::new(); self.children.len().max(8)];
        let mut left: Vec<usize> = which.to_vec();
        while !left.is_empty() {
            let now = Instant::now();
            assert!(now < deadline, "not done in {limit:?}: {left:?} {lines:?}");
            let Ok((i, line)) = self.lines.recv_timeout(deadline - now) else {
                panic!("not done in {limit:?}: {left:?} {lines:?}");
            };
            assert!(!line.starts_with("FAILED"), "child {i}: {line} ({lines:?})");
            if line.starts_with("DONE") {
                left.retain(|&r| r != i);
            }
            if i >= lines.len() {
                lines.resize(i + 1, Vec::new());
            }
            lines[i].push(line);
        }
        lines
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish()
}

/// The value of `key=` in a line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

fn done_line(lines: &[String]) -> &str {
    lines
        .iter()
        .find(|l| l.starts_with("DONE"))
        .expect("a DONE line")
}

/// Kills `victims` of `n` ranks at once; the survivors recover and finish at size
/// `n - victims`, numbered 0.. in order; returns each survivor's milliseconds from its error
/// to its recovered communicator.
fn kill_and_survive(n: usize, victims: &[usize]) -> Vec<u64> {
    let mut job = Job::start(n, |_| Vec::new());
    let all: Vec<usize> = (0..n).collect();
    job.wait_ready(&all);
    for &v in victims {
        job.kill(v);
    }
    let survivors: Vec<usize> = all
        .iter()
        .copied()
        .filter(|r| !victims.contains(r))
        .collect();
    let lines = job.until_done(&survivors, Duration::from_secs(60));
    let mut new_ranks = Vec::new();
    let mut ms = Vec::new();
    for &s in &survivors {
        let done = done_line(&lines[s]);
        assert_eq!(
            field(done, "size"),
            (n - victims.len()).to_string(),
            "{done}"
        );
        new_ranks.push(field(done, "rank").parse::<usize>().unwrap());
        let recovered = lines[s]
            .iter()
            .find(|l| l.starts_with("RECOVERED"))
            .unwrap();
        ms.push(field(recovered, "ms").parse().unwrap());
        assert!(
            lines[s].iter().any(|l| l.starts_with("ERROR peer-lost")
                || l.starts_with("ERROR aborted")
                || l.starts_with("ERROR revoked")),
            "{:?}",
            lines[s]
        );
    }
    // Renumbered in order.
    assert_eq!(new_ranks, (0..survivors.len()).collect::<Vec<_>>());
    eprintln!("killed {victims:?} of {n}: recovery ms per survivor {ms:?}");
    ms
}

/// Kills rank 2 of 4: the survivors finish at size 3; their error and the shrink are in their
/// flight recorders, and `weft status` follows the job to the survivors' communicator.
#[test]
fn a_killed_rank_leaves_the_others_running() {
    let dir = std::env::temp_dir().join(format!("weft-recovery-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut job = Job::start(4, |_| {
        vec![("WEFT_TRACE_DUMP_DIR", dir.display().to_string())]
    });
    job.wait_ready(&[0, 1, 2, 3]);
    job.kill(2);
    let lines = job.until_done(&[0, 1, 3], Duration::from_secs(60));
    for s in [0, 1, 3] {
        assert_eq!(field(done_line(&lines[s]), "size"), "3", "{:?}", lines[s]);
    }
    // Each survivor: the failure dump of the first communicator names the lost peer; the dump
    // of the shrunk one carries the shrink.
    let dumps: Vec<weftcc::comm::records::trace::TraceDump> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path()).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect();
    let failures: Vec<_> = dumps.iter().filter(|d| d.namespace == "c").collect();
    assert_eq!(failures.len(), 3, "{dumps:?}");
    for d in &failures {
        assert!(
            d.error.as_ref().unwrap().contains("peer rank 2 lost"),
            "{d:?}"
        );
        assert!(!d.entries.is_empty(), "{d:?}");
    }
    let shrunk: Vec<_> = dumps.iter().filter(|d| d.namespace != "c").collect();
    assert_eq!(shrunk.len(), 3, "{dumps:?}");
    for d in &shrunk {
        assert_eq!(d.nranks, 3);
        assert_eq!(d.lineage.len(), 1, "{d:?}");
        assert_eq!(d.lineage[0].failed, [2]);
        assert_eq!(d.lineage[0].epoch, 1);
        assert!(d.lineage[0].error.as_ref().unwrap().contains("lost"));
    }
    let _ = std::fs::remove_dir_all(&dir);
    // `weft status` from outside: the survivors' communicator, reached through the shrink.
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["status", "--addr"])
        .arg(job.store.local_addr().to_string())
        .args(["--token", &job.token])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("· 3 ranks"), "{text}");
    assert!(
        text.contains("recovered: epoch 1: 4 -> 3 ranks, shrunk without ranks [2]"),
        "{text}"
    );
}

#[test]
fn a_killed_rank_zero_leaves_the_others_running() {
    kill_and_survive(4, &[0]);
}

#[test]
fn two_ranks_killed_at_once() {
    kill_and_survive(4, &[1, 3]);
}

/// A rank that revokes: every rank's call fails with `Revoked`, they agree that nobody failed,
/// shrink to all of them and go on.
#[test]
fn revoke_stops_every_rank_and_the_communicator_shrinks_to_everyone() {
    let job = Job::start(3, |_| vec![(REVOKE_AT, "1:40".to_string())]);
    let lines = job.until_done(&[0, 1, 2], Duration::from_secs(60));
    let at = |l: &[String], word: &str| -> u128 {
        let line = l.iter().find(|x| x.starts_with(word)).expect(word);
        field(line, "at_us").parse().unwrap()
    };
    let revoked = at(&lines[1], "REVOKE");
    let learnt: Vec<u128> = [0, 2]
        .iter()
        .map(|&r| at(&lines[r], "ERROR_AT").saturating_sub(revoked) / 1000)
        .collect();
    eprintln!("revoke: the other ranks' calls failed {learnt:?} ms after it");
    assert!(learnt.iter().all(|&ms| ms < 1_000), "{learnt:?}");
    for (r, l) in lines.iter().enumerate().take(3) {
        assert!(
            l.iter().any(|x| x.starts_with("ERROR revoked")),
            "rank {r}: {l:?}"
        );
        let recovered = l.iter().find(|x| x.starts_with("RECOVERED")).unwrap();
        assert_eq!(field(recovered, "failed"), "-");
        assert_eq!(field(recovered, "epoch"), "1");
        assert_eq!(field(done_line(l), "size"), "3");
        assert_eq!(field(done_line(l), "rank"), r.to_string());
    }
}

/// A rank that dies right after the agreement (which then lacks it) fails the shrink on every
/// survivor; they agree again, now on both, and finish.
#[test]
fn a_rank_killed_during_the_agreement() {
    let mut job = Job::start(4, |r| match r {
        2 => vec![(DIE_IN, "agree".to_string())],
        _ => Vec::new(),
    });
    job.wait_ready(&[0, 1, 2, 3]);
    job.kill(1);
    let lines = job.until_done(&[0, 3], Duration::from_secs(60));
    for s in [0, 3] {
        assert_eq!(field(done_line(&lines[s]), "size"), "2", "{:?}", lines[s]);
        let recovered = lines[s]
            .iter()
            .find(|l| l.starts_with("RECOVERED"))
            .unwrap();
        assert_eq!(field(recovered, "failed"), "1,2", "{:?}", lines[s]);
        // The shrink that still counted rank 2 ended on its death (the survivors watch each
        // other's sessions while they set up), not at the set-up's 20 s timeout.
        let ms: u64 = field(recovered, "ms").parse().unwrap();
        assert!(ms < 5_000, "{:?}", lines[s]);
    }
}

/// A rank that dies while the survivors set up their shrunk communicator.
#[test]
fn a_rank_killed_during_the_shrink() {
    let mut job = Job::start(4, |r| match r {
        3 => vec![(DIE_IN, "shrink".to_string())],
        _ => Vec::new(),
    });
    job.wait_ready(&[0, 1, 2, 3]);
    job.kill(1);
    let lines = job.until_done(&[0, 2], Duration::from_secs(60));
    for s in [0, 2] {
        assert_eq!(field(done_line(&lines[s]), "size"), "2", "{:?}", lines[s]);
        // Ended by the death, named, not by the set-up's 20 s timeout.
        let ms: u64 = lines[s]
            .iter()
            .filter(|l| l.starts_with("RECOVERED"))
            .map(|l| field(l, "ms").parse::<u64>().unwrap())
            .sum();
        assert!(ms < 5_000, "{:?}", lines[s]);
    }
}

/// A killed rank's replacement joins by grow: the job ends with as many ranks as it began with.
#[test]
fn a_newcomer_joins_by_grow_after_a_shrink() {
    let n = 3;
    let mut job = Job::start(n, |_| {
        vec![(CHANGES, "2".to_string()), (FINAL_SIZE, n.to_string())]
    });
    job.wait_ready(&[0, 1, 2]);
    job.kill(1);
    // The replacement asks for a place; the survivors see it wait and grow.
    job.spawn(vec![
        (ROLE, "newcomer".to_string()),
        (CHANGES, "2".to_string()),
        (FINAL_SIZE, n.to_string()),
    ]);
    let lines = job.until_done(&[0, 2, 3], Duration::from_secs(60));
    let mut ranks: Vec<String> = [0, 2, 3]
        .iter()
        .map(|&s| {
            let done = done_line(&lines[s]);
            assert_eq!(field(done, "size"), n.to_string(), "{:?}", lines[s]);
            field(done, "rank").to_string()
        })
        .collect();
    ranks.sort();
    assert_eq!(ranks, ["0", "1", "2"]);
    // The newcomer took the last rank.
    assert_eq!(field(done_line(&lines[3]), "rank"), "2");
}

/// How long recovery takes at a larger size: `WEFT_TEST_RANKS` ranks (default 64), one killed;
/// prints each survivor's time from its error to its shrunk communicator, and the agreement's
/// and the shrink's own times (medians and maxima). Run by `benches/recovery.sh`.
#[test]
#[ignore = "a benchmark: benches/recovery.sh"]
fn recovery_time_at_scale() {
    let n = env_usize("WEFT_TEST_RANKS", 64);
    let mut job = Job::start(n, |_| Vec::new());
    let all: Vec<usize> = (0..n).collect();
    job.wait_ready(&all);
    let victim = n / 2;
    job.kill(victim);
    let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
    let lines = job.until_done(&survivors, Duration::from_secs(300));
    let mut total = Vec::new();
    let mut agree = Vec::new();
    let mut shrink = Vec::new();
    for &s in &survivors {
        let recovered = lines[s]
            .iter()
            .find(|l| l.starts_with("RECOVERED"))
            .unwrap();
        total.push(field(recovered, "ms").parse::<f64>().unwrap());
        let times = lines[s].iter().find(|l| l.starts_with("TIMES")).unwrap();
        agree.push(field(times, "agree_us").parse::<f64>().unwrap() / 1000.0);
        shrink.push(field(times, "shrink_us").parse::<f64>().unwrap() / 1000.0);
        assert_eq!(field(done_line(&lines[s]), "size"), (n - 1).to_string());
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (t_med, t_max) = stats(&mut total);
    let (a_med, a_max) = stats(&mut agree);
    let (s_med, s_max) = stats(&mut shrink);
    eprintln!("survivor {}: {:?}", survivors[0], lines[survivors[0]]);
    println!(
        "RESULT ranks={n} killed={victim} error_to_shrunk_ms median={t_med:.1} max={t_max:.1} \
         agree_ms median={a_med:.2} max={a_max:.2} shrink_ms median={s_med:.1} max={s_max:.1}"
    );
}

/// A newcomer killed while the survivors grow: their grow fails on each of them at once (rank 0
/// watches the sessions of the newcomers it admits), they go on at their size, and admit the
/// next newcomer.
#[test]
fn a_newcomer_killed_during_the_grow() {
    let n = 3;
    let env = || vec![(CHANGES, "2".to_string()), (FINAL_SIZE, n.to_string())];
    let mut job = Job::start(n, |_| env());
    job.wait_ready(&[0, 1, 2]);
    job.kill(1);
    let mut newcomer = env();
    newcomer.push((ROLE, "newcomer".to_string()));
    job.spawn(newcomer.clone());
    // Killed once a survivor starts growing.
    let mut seen = Vec::new();
    loop {
        let (i, line) = job.next(Duration::from_secs(30));
        assert!(!line.starts_with("FAILED"), "child {i}: {line}");
        let growing = line.starts_with("GROWING");
        seen.push((i, line));
        if growing {
            break;
        }
    }
    job.kill(3);
    job.spawn(newcomer);
    let lines = job.until_done(&[0, 2, 4], Duration::from_secs(60));
    for s in [0, 2] {
        let failed = lines[s]
            .iter()
            .chain(seen.iter().filter(|(i, _)| *i == s).map(|(_, l)| l))
            .find(|l| l.starts_with("GROW_FAILED"));
        let failed =
            failed.unwrap_or_else(|| panic!("survivor {s}: no failed grow: {:?}", lines[s]));
        // Ended by the newcomer's death, not the set-up's 20 s timeout.
        let ms: u64 = field(failed, "ms").parse().unwrap();
        assert!(ms < 5_000, "{failed}");
        assert_eq!(
            field(done_line(&lines[s]), "size"),
            n.to_string(),
            "{:?}",
            lines[s]
        );
    }
    assert_eq!(field(done_line(&lines[4]), "rank"), "2");
}
