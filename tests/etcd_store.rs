//! A job whose store is an etcd cluster (`weft1@etcd://HOST:PORT#TOKEN`): it sets up and runs
//! with no rank serving the store; a rank killed with SIGKILL is `PeerLost` naming it on every
//! survivor within the lease's lifetime, published by the survivors' watchers (etcd runs no
//! session hook); `weft status` reads the job's progress over etcd. Ranks are real processes:
//! this test binary re-executes itself in a child role. Skips without `etcd`, except where
//! `WEFT_REQUIRE_ETCD=1` (CI).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use weftcc_testkit::etcd::Etcd;

const ROLE: &str = "WEFT_TEST_ETCD_ROLE";

/// Child role: join the job of `WEFT_TEST_ETCD_ID` as `WEFT_TEST_RANK` of 4, all-reduce once
/// ("READY"), then call nothing more: the only way it can learn of a peer's death is its
/// failure watcher. Prints "ERROR <variant> <peer> <message>" once the communicator has failed.
#[test]
fn etcd_child_role() {
    let Ok(id) = std::env::var(ROLE) else {
        return;
    };
    let rank: usize = std::env::var("WEFT_TEST_RANK").unwrap().parse().unwrap();
    let id: weftcc::UniqueId = id.parse().expect("unique id");
    let comm = match weftcc::Communicator::init(rank, 4, &id) {
        Ok(c) => c,
        Err(e) => {
            println!("ERROR init - {e}");
            return;
        }
    };
    let mut buf = vec![1.0f32; 1024];
    if let Err(e) = comm.all_reduce_in_place(&mut buf, weftcc::ReduceOp::Sum) {
        println!("ERROR first - {e}");
        return;
    }
    assert_eq!(buf[0], 4.0);
    println!("READY");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if let Some(e) = comm.error() {
            let peer = match &e {
                weftcc::Error::PeerLost { peer, .. } => peer.to_string(),
                _ => "-".into(),
            };
            let variant = format!("{e:?}");
            let variant = variant.split([' ', '{', '(']).next().unwrap_or("");
            println!("ERROR {variant} {peer} {e}");
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Ranks(Vec<std::process::Child>);

type Lines = mpsc::Sender<(usize, Instant, String)>;

/// Starts rank `rank` of the job `id` in [`etcd_child_role`]; its READY and ERROR lines go to
/// `lines`.
fn spawn_rank(id: &str, rank: usize, lines: &Lines) -> std::process::Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["etcd_child_role", "--exact", "--nocapture", "-q"])
        .env(ROLE, id)
        .env("WEFT_TEST_RANK", rank.to_string())
        .env("WEFT_TIMEOUT", "30")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let tx = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("READY") || line.starts_with("ERROR") {
                let _ = tx.send((rank, Instant::now(), line));
            }
        }
    });
    child
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_killed_rank_is_peer_lost_everywhere_over_etcd_and_weft_status_reads_the_job() {
    let Some(etcd) = Etcd::start("a_killed_rank_is_peer_lost_everywhere_over_etcd") else {
        return;
    };
    let token = format!("etcd-job-{}", std::process::id());
    let id = format!("weft1@{}#{token}", etcd.store_addr());
    let (tx, rx) = mpsc::channel();
    let mut ranks = Ranks(Vec::new());
    for rank in 0..4 {
        ranks.0.push(spawn_rank(&id, rank, &tx));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ready = 0;
    while ready < 4 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, _, line) = rx.recv_timeout(left).expect("ranks did not become ready");
        assert_eq!(line, "READY", "rank {rank}");
        ready += 1;
    }

    // `weft status` reads every rank's progress and session over etcd.
    let status = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(
                [
                    &["status", "--addr", &etcd.store_addr(), "--token", &token],
                    args,
                ]
                .concat(),
            )
            .output()
            .expect("weft status");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        eprintln!(
            "weft status -> {:?}\n{stdout}{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), stdout)
    };
    let (code, json) = status(&["--json"]);
    assert_eq!(code, Some(0), "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(v["nranks"], 4);
    assert_eq!(v["verdict"], "OK", "{json}");
    for (rank, child) in ranks.0.iter().enumerate() {
        assert_eq!(v["ranks"][rank]["pid"], child.id(), "{json}");
    }

    let victim = 2;
    ranks.0[victim].kill().unwrap(); // SIGKILL
    let _ = ranks.0[victim].wait();
    let limit = weftcc::store::ETCD_LEASE_TTL + Duration::from_secs(3);
    for (rank, line) in deaths(&rx, Instant::now(), limit, "kill -9 rank 2") {
        assert!(
            line.starts_with(&format!("ERROR PeerLost {victim} "))
                && line.contains("bootstrap store"),
            "rank {rank}: {line}"
        );
    }
    let (code, out) = status(&[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("DEAD") || out.contains("dead"), "{out}");
}

/// SIGKILL of rank 3 once its session is in etcd, while the others wait for it in set-up: the
/// others' set-up scans publish its death when its lease expires, and every other rank fails
/// naming it, within the lease's lifetime and a bound, not at the 30 s set-up timeout.
#[test]
fn a_rank_killed_during_set_up_is_named_everywhere_over_etcd() {
    let Some(etcd) = Etcd::start("a_rank_killed_during_set_up_is_named_everywhere_over_etcd")
    else {
        return;
    };
    let token = format!("etcd-setup-{}", std::process::id());
    let id = format!("weft1@{}#{token}", etcd.store_addr());
    let (tx, rx) = mpsc::channel();
    let mut ranks = Ranks(Vec::new());
    for rank in 0..3 {
        ranks.0.push(spawn_rank(&id, rank, &tx));
    }
    let mut store =
        weftcc::store::StoreClient::connect(&etcd.store_addr(), &token, Duration::from_secs(10))
            .expect("store");
    let named = |store: &mut weftcc::store::StoreClient, n: usize| {
        let start = Instant::now();
        while store.sessions("c/rank/").unwrap().len() < n {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "sessions never named"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    named(&mut store, 3);
    ranks.0.push(spawn_rank(&id, 3, &tx));
    named(&mut store, 4);
    ranks.0[3].kill().unwrap(); // SIGKILL
    let _ = ranks.0[3].wait();
    let limit = weftcc::store::ETCD_LEASE_TTL + Duration::from_secs(4);
    for (rank, line) in deaths(&rx, Instant::now(), limit, "kill -9 rank 3 in set-up") {
        assert!(
            line.contains("rank 3 died during set-up") || line.starts_with("ERROR PeerLost 3 "),
            "rank {rank}: {line}"
        );
    }
}

/// The first line other than READY of each of three ranks, every one within `limit` of
/// `killed` (READY: a rank through set-up before the kill, its error follows).
fn deaths(
    rx: &mpsc::Receiver<(usize, Instant, String)>,
    killed: Instant,
    limit: Duration,
    what: &str,
) -> Vec<(usize, String)> {
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let left =
            (killed + limit + Duration::from_secs(5)).saturating_duration_since(Instant::now());
        let (rank, at, line) = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("only {seen:?} reported the death"));
        if line == "READY" {
            continue;
        }
        let after = at.saturating_duration_since(killed);
        eprintln!("{what}: rank {rank} after {after:?}: {line}");
        assert!(after <= limit, "rank {rank} noticed after {after:?}");
        seen.push((rank, line));
    }
    seen
}
