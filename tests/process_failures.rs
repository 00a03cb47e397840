//! Failures of whole processes: a rank killed with SIGKILL must become `PeerLost` on every other
//! rank within 2 s; a rank stopped with SIGSTOP must become a timeout (or an abort naming the
//! rank that timed out) on the others. Ranks are real processes: this test binary re-executes
//! itself in a child role.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const ROLE: &str = "WEFT_TEST_CHILD_ROLE";

/// Child role: join the job from the environment and all-reduce in a loop, printing one line
/// per event on stdout ("READY", then "ERROR <variant> <peer> <message>").
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let comm = match weftcc::Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("ERROR init - {e}");
            return;
        }
    };
    let mut buf = vec![1.0f32; 1 << 18];
    let mut ready = false;
    loop {
        match comm.all_reduce_in_place(&mut buf, weftcc::ReduceOp::Max) {
            Ok(()) => {
                if !ready {
                    println!("READY");
                    ready = true;
                }
            }
            Err(e) => {
                let (variant, peer) = match &e {
                    weftcc::Error::PeerLost { peer, .. } => ("PeerLost", peer.to_string()),
                    weftcc::Error::Timeout { .. } => ("Timeout", "-".into()),
                    weftcc::Error::Aborted { by, .. } => ("Aborted", format!("{by:?}")),
                    _ => ("Other", "-".into()),
                };
                println!("ERROR {variant} {peer} {e}");
                let _ = role;
                return;
            }
        }
    }
}

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, Instant, String)>,
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start(n: usize, extra_env: &[(&str, &str)]) -> Job {
    let exe = std::env::current_exe().unwrap();
    let port = free_port().to_string();
    let (tx, rx) = mpsc::channel();
    let mut children = Vec::new();
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "child_role",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(ROLE, "allreduce-loop")
        .env("WEFT_RANK", rank.to_string())
        .env("WEFT_WORLD_SIZE", n.to_string())
        .env("WEFT_MASTER_ADDR", "127.0.0.1")
        .env("WEFT_MASTER_PORT", &port)
        .env("WEFT_JOB_TOKEN", format!("process-failures-{port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.starts_with("READY") || line.starts_with("ERROR") {
                    let _ = tx.send((rank, Instant::now(), line));
                }
            }
        });
        children.push(child);
    }
    Job {
        children,
        lines: rx,
    }
}

/// Waits until every rank printed READY.
fn wait_ready(job: &Job, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ready = vec![false; n];
    while !ready.iter().all(|&r| r) {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, _, line) = job
            .lines
            .recv_timeout(left)
            .expect("ranks did not become ready");
        assert!(
            line.starts_with("READY"),
            "rank {rank} before ready: {line}"
        );
        ready[rank] = true;
    }
}

/// Collects one ERROR line from each rank in `ranks`, within `limit` of `since`.
fn collect_errors(
    job: &Job,
    ranks: &[usize],
    since: Instant,
    limit: Duration,
) -> Vec<(usize, Duration, String)> {
    let mut got = Vec::new();
    let deadline = since + limit + Duration::from_secs(5);
    while got.len() < ranks.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        match job.lines.recv_timeout(left) {
            Ok((rank, at, line)) if ranks.contains(&rank) && line.starts_with("ERROR") => {
                got.push((rank, at.duration_since(since), line))
            }
            Ok(_) => {}
            Err(_) => panic!(
                "only {} of {:?} reported an error: {got:?}",
                got.len(),
                ranks
            ),
        }
    }
    got
}

fn kill_one(n: usize, victim: usize, env: &[(&str, &str)]) {
    let mut job = start(n, env);
    wait_ready(&job, n);
    let killed = Instant::now();
    job.children[victim].kill().unwrap(); // SIGKILL
    let _ = job.children[victim].wait();
    let others: Vec<usize> = (0..n).filter(|&r| r != victim).collect();
    let mut errors = collect_errors(&job, &others, killed, Duration::from_secs(2));
    errors.sort_by_key(|e| e.1);
    // Every survivor reports a lost peer: the victim, or a survivor that reported before it and
    // then left (each child exits on its first error). With the bootstrap store on the victim
    // there is no store to spread the first error, so a survivor may see another survivor's
    // connections close before it sees the victim die; that rank is gone too, and the first
    // report must still name the victim.
    let mut departed: Vec<usize> = Vec::new();
    for (rank, after, line) in &errors {
        eprintln!("kill -9 rank {victim}: rank {rank} after {after:?}: {line}");
        let named_ok = std::iter::once(victim)
            .chain(departed.iter().copied())
            .any(|p| line.starts_with(&format!("ERROR PeerLost {p} ")));
        assert!(
            named_ok,
            "rank {rank}: {line} (departed before it: {departed:?})"
        );
        assert!(
            *after <= Duration::from_secs(2),
            "rank {rank} noticed after {after:?}: {line}"
        );
        departed.push(*rank);
    }
    assert!(
        errors[0]
            .2
            .starts_with(&format!("ERROR PeerLost {victim} ")),
        "the first report must name the victim: {errors:?}"
    );
}

#[test]
fn sigkill_of_a_rank_is_peer_lost_everywhere_within_2s_shm() {
    kill_one(4, 2, &[]);
}

#[test]
fn sigkill_of_a_rank_is_peer_lost_everywhere_within_2s_tcp() {
    kill_one(4, 1, &[("WEFT_SHM_DISABLE", "1")]);
}

#[test]
fn sigkill_of_rank_0_which_serves_the_store_is_peer_lost_everywhere() {
    kill_one(3, 0, &[]);
}

#[test]
fn sigstop_of_a_rank_becomes_a_timeout_on_the_others() {
    let n = 3;
    let job = start(n, &[("WEFT_TIMEOUT", "1.5")]);
    wait_ready(&job, n);
    let victim = 1;
    let pid = nix::unistd::Pid::from_raw(job.children[victim].id() as i32);
    let stopped = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let errors = collect_errors(&job, &[0, 2], stopped, Duration::from_secs(4));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    let mut timeouts = 0;
    for (rank, after, line) in errors {
        assert!(
            after < Duration::from_secs(5),
            "rank {rank} after {after:?}"
        );
        if line.starts_with("ERROR Timeout") {
            timeouts += 1;
            assert!(line.contains("all-reduce #"), "{line}");
        } else {
            assert!(line.starts_with("ERROR Aborted"), "rank {rank}: {line}");
        }
    }
    assert!(timeouts >= 1);
}
