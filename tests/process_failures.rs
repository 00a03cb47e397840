//! Failures of whole processes: a rank killed with SIGKILL must become `PeerLost` on every other
//! rank within 2 s; a rank stopped with SIGSTOP must become a timeout on the others that names
//! it; `weft status` reads a hung or failed job from outside. Ranks are real processes: this test
//! binary re-executes itself in a child role.

mod common;

use common::held_by_process;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const ROLE: &str = "WEFT_TEST_CHILD_ROLE";

/// Child role: join the job from the environment and all-reduce in a loop, printing one line
/// per event on stdout ("READY", then "ERROR <variant> <peer> <message>", then, once the
/// communicator is dropped, "CLEAN" when the process's descriptors and threads are back to what
/// they were before it was made, else "LEAK ...").
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let before = held_by_process();
    let comm = match weftcc::Communicator::from_env() {
        Ok(c) => c,
        Err(weftcc::Error::Inconsistent { disagreements, .. }) => {
            let found = serde_json::to_string(&disagreements).expect("JSON");
            println!("ERROR Inconsistent {found}");
            common::report_clean(before, "");
            return;
        }
        Err(e) => {
            println!("ERROR init - {e}");
            common::report_clean(before, "");
            return;
        }
    };
    if role == "second-call" {
        return second_call(&comm);
    }
    let mut buf = vec![1.0f32; 1 << 18];
    let mut ready = false;
    // "pingpong": ranks 0 and 1 send to each other in turn; else every rank all-reduces.
    let step = |buf: &mut [f32]| match (role.as_str(), comm.rank()) {
        ("pingpong", 0) => comm.send(buf, 1).and_then(|()| comm.recv(buf, 1)),
        ("pingpong", _) => comm.recv(buf, 0).and_then(|()| comm.send(buf, 0)),
        _ => comm.all_reduce_in_place(buf, weftcc::ReduceOp::Max),
    };
    loop {
        match step(&mut buf) {
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
                    weftcc::Error::StoreLost { store, .. } => ("StoreLost", store.clone()),
                    _ => ("Other", "-".into()),
                };
                println!("ERROR {variant} {peer} {e}");
                drop(comm);
                common::report_clean(before, "");
                return;
            }
        }
    }
}

/// Waits until rank `rank`'s session (its failure watcher's store connection, named before the
/// rank joins the others) shows in the store of the job at `port`.
fn wait_for_session(port: &str, rank: usize) {
    let token = format!("process-failures-{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let key = format!("c/rank/{rank}");
    let mut store = None;
    while Instant::now() < deadline {
        // One connection, once the store is up (rank 0 starts it).
        if store.is_none() {
            store = weftcc::store::StoreClient::connect(
                &format!("127.0.0.1:{port}"),
                &token,
                Duration::from_millis(500),
            )
            .ok();
        }
        if let Some(s) = store.as_mut() {
            match s.sessions("c/rank/") {
                Ok(sessions) if sessions.iter().any(|s| s.key == key) => return,
                Ok(_) => {}
                Err(_) => store = None,
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("rank {rank} never named its session");
}

/// Child role for `weft status`: one all-reduce ("READY"), then the second call: rank
/// `WEFT_TEST_LATE` never makes it, rank `WEFT_TEST_ODD` calls a broadcast instead. After an error
/// ("ERROR ...") the rank stays (holding its communicator, and rank 0 the store) until killed, so
/// that the job can be looked at.
fn second_call(comm: &weftcc::Communicator) {
    let rank = comm.rank().to_string();
    let is = |var: &str| std::env::var(var).ok().as_deref() == Some(rank.as_str());
    let mut buf = vec![1.0f32; 1024];
    if let Err(e) = comm.all_reduce_in_place(&mut buf, weftcc::ReduceOp::Sum) {
        println!("ERROR first {e}");
        return;
    }
    println!("READY");
    let second = if is("WEFT_TEST_LATE") {
        std::thread::sleep(Duration::from_secs(600));
        Ok(())
    } else if is("WEFT_TEST_ODD") {
        comm.broadcast_in_place(&mut buf, 0)
    } else {
        comm.all_reduce_in_place(&mut buf, weftcc::ReduceOp::Sum)
    };
    if let Err(e) = second {
        println!("ERROR second {e}");
    }
    std::thread::sleep(Duration::from_secs(600));
}

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, Instant, String)>,
    /// Lines read while waiting for others (a rank's error that arrives before every other
    /// rank is ready), handed out first by [`Job::next_line`].
    pending: std::cell::RefCell<std::collections::VecDeque<(usize, Instant, String)>>,
}

impl Job {
    /// The next line any rank printed, waiting until `deadline`.
    fn next_line(&self, deadline: Instant) -> Option<(usize, Instant, String)> {
        if let Some(l) = self.pending.borrow_mut().pop_front() {
            return Some(l);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        self.lines.recv_timeout(left).ok()
    }
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
    start_role(n, "allreduce-loop", &free_port().to_string(), extra_env)
}

fn start_role(n: usize, role: &str, port: &str, extra_env: &[(&str, &str)]) -> Job {
    start_ranks(n, role, port, |_| {
        extra_env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    })
}

/// [`start_role`] with each rank's own extra environment.
fn start_ranks(
    n: usize,
    role: &str,
    port: &str,
    env_of: impl Fn(usize) -> Vec<(String, String)>,
) -> Job {
    let exe = std::env::current_exe().unwrap();
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
        .env(ROLE, role)
        .env("WEFT_RANK", rank.to_string())
        .env("WEFT_WORLD_SIZE", n.to_string())
        .env("WEFT_MASTER_ADDR", "127.0.0.1")
        .env("WEFT_MASTER_PORT", port)
        .env("WEFT_JOB_TOKEN", format!("process-failures-{port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        for (k, v) in env_of(rank) {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if ["READY", "ERROR", "CLEAN", "LEAK"]
                    .iter()
                    .any(|w| line.starts_with(w))
                {
                    let _ = tx.send((rank, Instant::now(), line));
                }
            }
        });
        children.push(child);
    }
    Job {
        children,
        lines: rx,
        pending: Default::default(),
    }
}

/// Waits until every rank printed READY.
fn wait_ready(job: &Job, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ready = vec![false; n];
    let mut later = Vec::new();
    while !ready.iter().all(|&r| r) {
        let (rank, at, line) = job.next_line(deadline).expect("ranks did not become ready");
        if ready[rank] {
            // A ready rank went on (an error of its next call): for the caller.
            later.push((rank, at, line));
            continue;
        }
        assert!(
            line.starts_with("READY"),
            "rank {rank} before ready: {line}"
        );
        ready[rank] = true;
    }
    job.pending.borrow_mut().extend(later);
}

/// Collects one ERROR line from each rank in `ranks`, within `limit` of `since`.
fn collect_errors(
    job: &Job,
    ranks: &[usize],
    since: Instant,
    limit: Duration,
) -> Vec<(usize, Duration, String)> {
    let mut got = Vec::new();
    let mut reports = Vec::new();
    let deadline = since + limit + Duration::from_secs(5);
    while got.len() < ranks.len() {
        match job.next_line(deadline) {
            Some((rank, at, line)) if ranks.contains(&rank) && line.starts_with("ERROR") => {
                got.push((rank, at.saturating_duration_since(since), line))
            }
            // For assert_survivors_clean.
            Some(l) if l.2.starts_with("CLEAN") || l.2.starts_with("LEAK") => reports.push(l),
            Some(_) => {}
            None => panic!(
                "only {} of {:?} reported an error: {got:?}",
                got.len(),
                ranks
            ),
        }
    }
    job.pending.borrow_mut().extend(reports);
    got
}

/// Waits for every rank in `ranks` to say whether dropping its communicator gave back every
/// descriptor and thread, and asserts it did; then that the job left nothing in /dev/shm.
fn assert_survivors_clean(job: &Job, ranks: &[usize], token: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen: Vec<usize> = Vec::new();
    while !ranks.iter().all(|r| seen.contains(r)) {
        match job.next_line(deadline) {
            Some((rank, _, line)) if line.starts_with("CLEAN") || line.starts_with("LEAK") => {
                assert!(line.starts_with("CLEAN"), "rank {rank}: {line}");
                seen.push(rank);
            }
            Some(_) => {}
            None => panic!("ranks {ranks:?}: only {seen:?} reported after dropping"),
        }
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(token))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

/// SIGKILL of rank `victim` in an all-reduce loop of `n` ranks: every survivor reports it within
/// 2 s, and each gives back every descriptor and thread when it drops its communicator.
fn kill_one(n: usize, victim: usize, env: &[(&str, &str)]) {
    kill_one_at(&free_port().to_string(), n, victim, env);
}

/// [`kill_one`] of the job at `port` (its token is `process-failures-<port>`).
fn kill_one_at(port: &str, n: usize, victim: usize, env: &[(&str, &str)]) {
    let mut job = start_role(n, "allreduce-loop", port, env);
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
    assert_survivors_clean(&job, &others, &format!("process-failures-{port}"));
}

#[test]
fn sigkill_of_a_rank_is_peer_lost_everywhere_within_2s_shm() {
    for victim in [2, 3] {
        kill_one(4, victim, &[]);
    }
}

#[test]
fn sigkill_of_a_rank_is_peer_lost_everywhere_within_2s_tcp() {
    kill_one(4, 1, &[("WEFT_SHM_DISABLE", "1")]);
}

#[test]
fn sigkill_of_rank_0_which_serves_the_store_is_peer_lost_everywhere() {
    kill_one(3, 0, &[]);
}

/// A `weft store serve` process serving the job at `port`'s token; killed when dropped.
struct StoreProcess {
    child: Child,
    addr: String,
}

impl StoreProcess {
    fn start(port: &str) -> StoreProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(["store", "serve", "--listen", "127.0.0.1:0", "--token"])
            .arg(format!("process-failures-{port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("weft store serve");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .expect("its first line");
        let addr = line
            .trim()
            .strip_prefix("WEFT_STORE=")
            .expect(&line)
            .to_string();
        StoreProcess { child, addr }
    }
}

impl Drop for StoreProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// With the store in a process of its own (`WEFT_STORE`), rank 0 is a rank like the others:
/// its death is PeerLost on every survivor, published by the store, which stays up.
#[test]
fn sigkill_of_rank_0_with_the_store_elsewhere_is_peer_lost_everywhere() {
    let port = free_port().to_string();
    let mut store = StoreProcess::start(&port);
    kill_one_at(&port, 3, 0, &[("WEFT_STORE", store.addr.as_str())]);
    assert!(
        store.child.try_wait().expect("store status").is_none(),
        "the store outlives rank 0"
    );
}

/// The store's process killed under a running job: every rank fails, naming the store's
/// address, within moments (its watcher sees the connection close).
#[test]
fn the_store_process_killed_is_an_error_naming_its_address_on_every_rank() {
    let n = 3;
    let port = free_port().to_string();
    let mut store = StoreProcess::start(&port);
    let job = start_role(
        n,
        "allreduce-loop",
        &port,
        &[("WEFT_STORE", store.addr.as_str())],
    );
    wait_ready(&job, n);
    let killed = Instant::now();
    store.child.kill().unwrap();
    let _ = store.child.wait();
    let all: Vec<usize> = (0..n).collect();
    let mut errors = collect_errors(&job, &all, killed, Duration::from_secs(3));
    errors.sort_by_key(|e| e.1);
    // Each rank exits on its first error: a rank still in its all-reduce may see one that
    // reported first leave before its own watcher sees the store go.
    let mut departed: Vec<usize> = Vec::new();
    for (rank, after, line) in &errors {
        eprintln!("store killed: rank {rank} after {after:?}: {line}");
        let store_named = line.starts_with(&format!("ERROR StoreLost {} ", store.addr));
        // Or the cause from a rank that failed first: its farewell, read while this rank
        // waits on it, carries the store's loss (`Aborted` naming that rank and the address).
        let departed_named = departed.iter().any(|p| {
            line.starts_with(&format!("ERROR PeerLost {p} "))
                || (line.starts_with(&format!("ERROR Aborted Some({p}) "))
                    && line.contains(&store.addr))
        });
        assert!(store_named || departed_named, "rank {rank}: {line}");
        assert!(
            *after < Duration::from_secs(3),
            "rank {rank} after {after:?}"
        );
        departed.push(*rank);
    }
    assert!(
        errors[0].2.starts_with("ERROR StoreLost "),
        "the first report names the store: {errors:?}"
    );
}

/// SIGKILL of the last rank while the job is being set up (at several moments: before it
/// reached the store, while joining, just after): every other rank fails within the set-up
/// timeout and a bound, naming it (as a rank that never joined, or as a lost peer), and gives
/// back its descriptors and threads.
#[test]
fn sigkill_during_set_up_is_an_error_naming_the_rank_everywhere() {
    let (n, victim) = (4, 3);
    // Milliseconds after the start; `None`: as soon as the victim's session shows in the store
    // (it names it before it joins the others).
    for delay_ms in [Some(0u64), Some(40), Some(300), None] {
        let port = free_port().to_string();
        let mut job = start_role(n, "allreduce-loop", &port, &[("WEFT_TIMEOUT", "3")]);
        match delay_ms {
            Some(ms) => std::thread::sleep(Duration::from_millis(ms)),
            None => wait_for_session(&port, victim),
        }
        let killed = Instant::now();
        job.children[victim].kill().unwrap();
        let _ = job.children[victim].wait();
        let others: Vec<usize> = (0..n).filter(|&r| r != victim).collect();
        // Ranks that got through set-up before the kill print READY first; skip those lines.
        let errors = collect_errors(&job, &others, killed, Duration::from_secs(8));
        for (rank, after, line) in &errors {
            eprintln!("kill -9 rank {victim} at {delay_ms:?}: rank {rank} after {after:?}: {line}");
            // Before it joined: named as missing; after: as lost; in between, set-up fails
            // with an error that names it.
            assert!(
                line.contains(&format!("ranks [{victim}] of {n} did not join"))
                    || line.starts_with(&format!("ERROR PeerLost {victim} "))
                    || (line.starts_with("ERROR init") && line.contains(&format!("rank {victim}"))),
                "rank {rank} (kill at {delay_ms:?}): {line}"
            );
            assert!(
                *after < Duration::from_secs(8),
                "rank {rank} (kill at {delay_ms:?}) after {after:?}: {line}"
            );
            // Once its session is in the store, its death is seen when its connection closes,
            // not at the set-up's 3 s timeout.
            if delay_ms.is_none() {
                assert!(
                    *after < Duration::from_millis(1500),
                    "rank {rank}: the death of rank {victim}, whose session the store held, \
                     took {after:?}: {line}"
                );
            }
        }
        assert_survivors_clean(&job, &others, &format!("process-failures-{port}"));
    }
}

/// Ranks started with a setting (or library version) that must agree and does not: `init`
/// fails on every rank, before any rank can hang, naming the setting and the odd rank, and
/// leaves nothing behind; a difference that is harmless (`WEFT_TIMEOUT`, another build id of
/// the same version, another network provider: its pairs take TCP) does not fail. What the
/// network settings resolved to is compared too: a rank listening on loopback (here
/// `WEFT_SOCKET_IFNAME=lo` where the others find an external interface) could not be reached
/// from another host.
#[test]
fn a_rank_started_with_a_setting_that_must_agree_fails_init_on_every_rank_naming_it() {
    let n = 4;
    let all: Vec<usize> = (0..n).collect();
    for (odd, var, value) in [
        (2, "WEFT_ALGO", "ring"),
        (1, "WEFT_DETERMINISTIC", "1"),
        (3, "WEFT_TEST_VERSION", "0.0.9"),
        (0, "WEFT_TIMEOUT", "31"),
        (2, "WEFT_TEST_BUILD_ID", "000000000000"),
        (3, "WEFT_TEST_NET_PROVIDER", "ib:roce"),
        (1, "WEFT_SOCKET_IFNAME", "lo"),
    ] {
        if var == "WEFT_SOCKET_IFNAME" && default_interface_is_loopback() {
            eprintln!("SKIPPED {var}={value}: this machine has no interface but loopback, so every rank resolves loopback");
            continue;
        }
        let port = free_port().to_string();
        let job = start_ranks(n, "allreduce-loop", &port, |rank| {
            let mut env = vec![("WEFT_TIMEOUT".to_string(), "30".to_string())];
            if rank == odd {
                env.push((var.to_string(), value.to_string()));
            }
            env
        });
        // Harmless differences (`Should`): a warning, and the job runs.
        if [
            "WEFT_TIMEOUT",
            "WEFT_TEST_BUILD_ID",
            "WEFT_TEST_NET_PROVIDER",
        ]
        .contains(&var)
        {
            wait_ready(&job, n);
            continue;
        }
        let errors = collect_errors(&job, &all, Instant::now(), Duration::from_secs(20));
        for (rank, _, line) in errors {
            let json = line
                .strip_prefix("ERROR Inconsistent ")
                .unwrap_or_else(|| panic!("{var}: rank {rank}: {line}"));
            let found: Vec<weftcc::comm::Disagreement> =
                serde_json::from_str(json).expect("disagreements");
            assert_eq!(found.len(), 1, "{var}: rank {rank}: {found:?}");
            let what = match var {
                "WEFT_TEST_VERSION" => "library version",
                "WEFT_SOCKET_IFNAME" => "network interface",
                _ => var,
            };
            assert_eq!(found[0].what, what, "rank {rank}");
            assert_eq!(found[0].odd_ranks(), [odd], "{var}: rank {rank}");
            assert_eq!(found[0].agreement, weftcc::settings::Agreement::Must);
        }
        assert_survivors_clean(&job, &all, &format!("process-failures-{port}"));
    }
}

/// The interface a rank without `WEFT_SOCKET_IFNAME` listens on is a loopback one.
fn default_interface_is_loopback() -> bool {
    weftcc::transports::tcp::select_interface(None, None).map_or(true, |i| i.loopback)
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
    // Every survivor reports the timeout, and the diagnosis names the stopped rank: its process
    // gives no sign of life (its last progress record, published at most every 100 ms, may
    // say it entered the all-reduce or not yet).
    for (rank, after, line) in errors {
        assert!(
            after < Duration::from_secs(5),
            "rank {rank} after {after:?}"
        );
        assert!(line.starts_with("ERROR Timeout"), "rank {rank}: {line}");
        assert!(
            line.contains("; rank 1 ") && line.contains("no sign of life"),
            "rank {rank}: {line}"
        );
    }
}

/// A rank stopped in a send/recv exchange: its peer's timeout names it as giving no sign of
/// life (point-to-point message numbers say nothing about who is behind; silence does).
#[test]
fn sigstop_of_a_send_recv_peer_is_named_in_the_timeout() {
    let n = 2;
    let port = free_port().to_string();
    let job = start_role(n, "pingpong", &port, &[("WEFT_TIMEOUT", "1.5")]);
    wait_ready(&job, n);
    let pid = nix::unistd::Pid::from_raw(job.children[1].id() as i32);
    let stopped = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let errors = collect_errors(&job, &[0], stopped, Duration::from_secs(4));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    let (_, after, line) = &errors[0];
    assert!(*after < Duration::from_secs(5), "after {after:?}: {line}");
    assert!(
        line.starts_with("ERROR Timeout")
            && line.contains("send/recv")
            && line.contains("rank 1, awaited here, its process has given no sign of life"),
        "{line}"
    );
}

/// `weft status` against this job (`args` after `status`): exit code and stdout.
fn weft_status(args: &[&str]) -> (i32, String) {
    weft(&[&["status"], args].concat())
}

/// `weft trace ...` (`args` after `trace`): exit code and stdout.
fn weft_trace(args: &[&str]) -> (i32, String) {
    weft(&[&["trace"], args].concat())
}

fn weft(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(args)
        .output()
        .expect("run weft");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "weft {args:?} -> {:?}\n{stdout}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), stdout)
}

/// A fresh directory for flight-recorder dumps, removed on drop.
struct DumpDir(std::path::PathBuf);

impl DumpDir {
    fn new(tag: &str) -> DumpDir {
        let dir = std::env::temp_dir().join(format!("weft-dumps-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        DumpDir(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 path")
    }

    /// Dumps written (renamed into place; temporary files do not count).
    fn files(&self) -> usize {
        std::fs::read_dir(&self.0).map_or(0, |d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    weftcc::comm::records::trace::TraceDump::is_dump_file(
                        &e.file_name().to_string_lossy(),
                    )
                })
                .count()
        })
    }
}

impl Drop for DumpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A 4-rank job hung because rank 1 never makes its second call: `weft status` says BEHIND and
/// names rank 1, from outside by address and token and through a rank's pid; with rank 2 stopped
/// it says NOT-RESPONDING; once rank 3 is killed, DEAD.
#[test]
fn weft_status_names_what_is_wrong_with_a_hung_job() {
    let n = 4;
    let port = free_port().to_string();
    let token = format!("process-failures-{port}");
    let mut job = start_role(
        n,
        "second-call",
        &port,
        &[("WEFT_TEST_LATE", "1"), ("WEFT_TIMEOUT", "120")],
    );
    wait_ready(&job, n);
    let addr = format!("127.0.0.1:{port}");
    let by_addr = ["--addr", addr.as_str(), "--token", token.as_str()];
    // Ranks 0, 2, 3 wait in all-reduce #2 for longer than BEHIND_AFTER.
    std::thread::sleep(Duration::from_millis(2500));
    let (code, out) = weft_status(&by_addr);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("verdict: BEHIND: ranks in all-reduce #2 have waited")
            && out.contains(
                "rank 1 has not called all-reduce #2; its last completed call is all-reduce #1"
            ),
        "{out}"
    );
    for (rank, child) in job.children.iter().enumerate() {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&rank.to_string()))
            .unwrap_or_else(|| panic!("no row for rank {rank}: {out}"));
        assert!(
            row.contains(&child.id().to_string()),
            "pid of rank {rank}: {row}"
        );
        let state = if rank == 1 {
            "idle"
        } else {
            "in all-reduce #2"
        };
        assert!(row.contains(state), "rank {rank}: {row}");
    }
    let pid2 = job.children[2].id().to_string();
    let (code, json) = weft_status(&["--pid", pid2.as_str(), "--json"]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(v["verdict"], "BEHIND");
    assert_eq!(v["nranks"], 4);
    assert_eq!(v["ranks"][1]["state"], "idle");

    // The flight recorders, asked for from outside while the job hangs: every rank answers
    // (its watcher writes the file while its rank waits in the all-reduce), and the merge
    // names rank 1.
    let dumps = DumpDir::new("hung");
    let dump_args = [&by_addr[..], &["--dir", dumps.path()]].concat();
    let (code, out) = weft_trace(&[&["dump"], &dump_args[..]].concat());
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("4 of 4 ranks of communicator c wrote"),
        "{out}"
    );
    let (code, out) = weft_trace(&["merge", dumps.path()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("furthest:  all-reduce float×1024 sum #2 entered by rank(s) 0,2-3; running on 0,2-3")
            && out.contains("rank 1 has not called #2; its last collective is all-reduce float×1024 sum #1, completed")
            && out.contains("verdict:   BEHIND [1]"),
        "{out}"
    );

    let stopped = nix::unistd::Pid::from_raw(job.children[2].id() as i32);
    nix::sys::signal::kill(stopped, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    std::thread::sleep(Duration::from_millis(1500));
    let (code, out) = weft_status(&by_addr);
    assert_eq!(code, 1);
    assert!(out.contains("verdict: NOT-RESPONDING: ranks [2]"), "{out}");
    // A stopped rank writes nothing, and the dump says which and why.
    let (code, dumped) = weft_trace(&[&["dump", "--timeout", "2.5"], &dump_args[..]].concat());
    let _ = nix::sys::signal::kill(stopped, nix::sys::signal::Signal::SIGCONT);
    assert_eq!(code, 1, "{dumped}");
    assert!(
        dumped.contains("rank 2: no dump (its process gives no sign of life)")
            && dumped.contains("3 of 4 ranks"),
        "{dumped}"
    );

    job.children[3].kill().unwrap();
    let _ = job.children[3].wait();
    let killed = Instant::now();
    collect_errors(&job, &[0, 2], killed, Duration::from_secs(5));
    let (code, out) = weft_status(&by_addr);
    assert_eq!(code, 1);
    assert!(out.contains("verdict: DEAD: rank 3 lost"), "{out}");
}

/// The verdicts of a failed job: a timeout names the late rank, a mismatch says MISMATCH.
#[test]
fn weft_status_reports_the_timeout_or_the_mismatch_the_job_failed_with() {
    // The timeout also bounds joining: 3 s leaves room for a machine busy with other tests.
    for (late_or_odd, timeout, word, detail) in [
        (
            "WEFT_TEST_LATE",
            "3",
            "TIMEOUT",
            "rank 1 has not called all-reduce #2",
        ),
        ("WEFT_TEST_ODD", "30", "MISMATCH", "mismatched collectives"),
    ] {
        let n = 3;
        let port = free_port().to_string();
        let token = format!("process-failures-{port}");
        let dumps = DumpDir::new(word);
        let job = start_role(
            n,
            "second-call",
            &port,
            &[
                (late_or_odd, "1"),
                ("WEFT_TIMEOUT", timeout),
                ("WEFT_TRACE_DUMP_DIR", dumps.path()),
            ],
        );
        wait_ready(&job, n);
        let waiting: Vec<usize> = if word == "TIMEOUT" {
            vec![0, 2]
        } else {
            vec![0, 1, 2]
        };
        collect_errors(&job, &waiting, Instant::now(), Duration::from_secs(10));
        let addr = format!("127.0.0.1:{port}");
        let (code, out) = weft_status(&["--addr", addr.as_str(), "--token", token.as_str()]);
        assert_eq!(code, 1, "{out}");
        let verdict = out.lines().last().unwrap_or_default();
        assert!(
            verdict.starts_with(&format!("verdict: {word}: ")) && verdict.contains(detail),
            "{out}"
        );
        // The failed ranks are still there: alive, not dead.
        assert!(!out.contains("dead"), "{out}");
        // Every rank wrote its flight recorder when the job failed (rank 1 too, which learnt
        // of the failure through the store); the merge says what went wrong.
        let deadline = Instant::now() + Duration::from_secs(5);
        while dumps.files() < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (code, out) = weft_trace(&["merge", dumps.path()]);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("dumps from 3 (on failure)"), "{out}");
        if word == "TIMEOUT" {
            assert!(
                out.contains("rank 1 has not called #2") && out.contains("BEHIND [1] FAILED"),
                "{out}"
            );
        } else {
            // Rank 0 (or 2, on a busy machine: it may not have reached its second call when the
            // failure arrived, and then reads as behind) called the all-reduce rank 1 did not.
            let verdict = out
                .lines()
                .find(|l| l.contains("verdict:"))
                .unwrap_or_default();
            assert!(
                out.contains("called all-reduce float×1024 sum; rank(s) 1 called broadcast float×1024 root 0")
                    && verdict.contains("DISAGREE")
                    && verdict.contains("FAILED"),
                "{out}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Faults of the emulated RDMA device: every rank a host of its own over the verbs provider.
// ---------------------------------------------------------------------------------------------

/// A rank's environment for the verbs provider on the emulated RDMA device (a host of its own;
/// 67 ms per ACK timeout, so that a silent peer fails its writes within about half a second).
fn verbs_rank_env(rank: usize) -> Vec<(String, String)> {
    let lib = weftcc::transports::net::verbs::EMULATOR.unwrap_or_default();
    [
        ("WEFT_NET", "ib".to_string()),
        ("WEFT_IB_LIBRARY", lib.to_string()),
        ("WEFT_IB_TIMEOUT", "14".to_string()),
        ("WEFT_HOST_ID", format!("verbs-host-{rank}")),
        ("WEFT_TIMEOUT", "60".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// `n` ranks all-reduce in a loop over the emulated device; rank `victim` runs with the fault
/// knob `knob`. Every rank in `reporting` must report `PeerLost` naming a peer (the victim, or
/// for the victim itself any peer) within `limit` of the others being ready; returns the job.
fn verbs_fault(
    n: usize,
    victim: usize,
    knob: (&str, &str),
    reporting: &[usize],
    limit: Duration,
) -> Job {
    if !common::wire_available(common::Wire::NetVerbs) {
        panic!("the emulated RDMA device is not built: nothing to test");
    }
    let port = free_port().to_string();
    let job = start_ranks(n, "allreduce-loop", &port, |rank| {
        let mut env = verbs_rank_env(rank);
        if rank == victim {
            env.push((knob.0.to_string(), knob.1.to_string()));
        }
        env
    });
    // The fault fires some hundreds of work requests in, after every rank's first all-reduce.
    wait_ready(&job, n);
    let since = Instant::now();
    let mut errors = collect_errors(&job, reporting, since, limit);
    errors.sort_by_key(|e| e.1);
    let mut departed: Vec<usize> = Vec::new();
    for (rank, after, line) in &errors {
        eprintln!(
            "{}={} on rank {victim}: rank {rank} after {after:?}: {line}",
            knob.0, knob.1
        );
        let named = |p: usize| line.starts_with(&format!("ERROR PeerLost {p} "));
        // The victim names the peer of its failed queue pair; another rank names the victim,
        // a rank that departed before it, or the peer the victim reported (the failure note
        // every rank reads says "reported by rank <victim>").
        let by_victim = line.contains(&format!("reported by rank {victim}"));
        let ok = (0..n).filter(|&p| p != *rank).any(|p| {
            named(p) && (*rank == victim || p == victim || departed.contains(&p) || by_victim)
        });
        assert!(ok, "rank {rank}: {line} (departed before it: {departed:?})");
        assert!(
            *after <= limit,
            "rank {rank} noticed after {after:?}: {line}"
        );
        departed.push(*rank);
    }
    job
}

/// A peer vanishing between a data write and its flag (the emulator exits the victim's process
/// at its first small write after 300 large ones): `PeerLost` naming it on every other rank,
/// within 5 s. (Data under relaxed placement is checked byte by byte in conformance.rs.)
#[test]
fn verbs_emulated_peer_vanishing_between_data_and_flag_is_peer_lost_everywhere() {
    let mut job = verbs_fault(
        3,
        1,
        ("WEFT_IBEMU_VANISH_AFTER", "300"),
        &[0, 2],
        Duration::from_secs(5),
    );
    let status = job.children[1].wait().unwrap();
    assert_eq!(
        status.code(),
        Some(41),
        "the victim exited through the knob"
    );
}

/// A queue pair forced to ERR mid-job (every queue pair of the victim at its 400th post): the
/// victim reports `PeerLost` naming the peer of the failed queue pair, the others report the
/// victim (their writes into its failed queue pairs exhaust their retries, or its connections
/// close), all within 5 s.
#[test]
fn verbs_emulated_queue_pair_forced_to_err_is_an_error_on_every_rank() {
    let _job = verbs_fault(
        3,
        2,
        ("WEFT_IBEMU_QP_ERR_AFTER", "400"),
        &[0, 1, 2],
        Duration::from_secs(5),
    );
}
