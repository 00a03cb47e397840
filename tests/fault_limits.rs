//! A resource limit reached in the middle of a job, in a process of its own (the test changes
//! this process's open-files limit, and counts what the job leaves behind, so it is the only
//! test here): descriptors run out when an operation needs a new connection.

mod common;

use common::{held, held_again};
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use std::fs::File;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weftcc::{CommConfig, Communicator, Error, ReduceOp, UniqueId};

/// Four ranks (threads of this process, TCP, connections made when first needed) all-reduce
/// over a ring; then the process's descriptors are used up but `spare` (a leak elsewhere in the
/// program, as it looks to weftcc) and every rank runs `op`, which needs connections the ring
/// did not make. Returns each rank's result and how long `op` took; asserts that no rank
/// panicked and that, once the descriptors are given back and the communicators dropped, the
/// process holds what it held before.
fn out_of_descriptors(
    spare: usize,
    op: fn(usize, &Communicator) -> weftcc::Result<()>,
) -> Vec<(weftcc::Result<()>, Duration)> {
    let before = held();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let id = UniqueId::new().expect("id");
    let mut config = CommConfig::from_env().expect("config");
    config.shm_disable = true;
    config.timeout = Duration::from_secs(3);
    config.algo = weftcc::Selection::parse("ring").expect("ring");
    let n = 4;
    // Ranks: all-reduce, `ready`, (main: use the descriptors up), `exhausted`, `op`, `called`,
    // (main: give them back).
    let ready = Arc::new(Barrier::new(n + 1));
    let exhausted = Arc::new(Barrier::new(n + 1));
    let called = Arc::new(Barrier::new(n + 1));
    let ranks: Vec<_> = (0..n)
        .map(|rank| {
            let (id, config) = (id.clone(), config.clone());
            let (ready, exhausted, called) = (ready.clone(), exhausted.clone(), called.clone());
            std::thread::spawn(move || {
                let comm = Communicator::init_with(rank, n, &id, config).expect("init");
                let mut buf = vec![1.0f32; 1024];
                comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                    .expect("the ring's all-reduce");
                ready.wait();
                exhausted.wait();
                let start = Instant::now();
                let result = op(rank, &comm);
                let took = start.elapsed();
                called.wait();
                (result, took)
            })
        })
        .collect();
    ready.wait();
    let limit = (held().0 as u64 + 64).min(soft);
    setrlimit(Resource::RLIMIT_NOFILE, limit, hard).expect("lower the soft limit");
    let mut hog: Vec<File> = Vec::new();
    while let Ok(f) = File::open("/dev/null") {
        hog.push(f);
    }
    hog.truncate(hog.len().saturating_sub(spare));
    exhausted.wait();
    called.wait();
    drop(hog);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("restore the limit");
    let results: Vec<_> = ranks
        .into_iter()
        .map(|t| t.join().expect("no rank panicked"))
        .collect();
    for (rank, (result, took)) in results.iter().enumerate() {
        eprintln!("rank {rank} after {took:?}: {result:?}");
    }
    assert_eq!(
        held_again(before, held, Duration::from_secs(10)),
        before,
        "(descriptors, threads, /dev/shm entries) before and after"
    );
    results
}

fn says_why(e: &Error) -> bool {
    let text = e.to_string();
    text.contains("Too many open files") || text.contains("os error 24")
}

/// No descriptor left: the all-to-all's first dial cannot open a socket. Every rank fails at
/// once (well within the 3 s timeout), each naming itself, and the job's error says why.
///
/// Then one, then two descriptors left for a send from rank 0 to rank 2 (both ranks dial): one
/// dial opens its socket and the other cannot; or both do, and neither acceptor can take the
/// other's dial. Both ranks fail at once with the reason: a rank whose acceptor cannot accept
/// says so instead of waiting out its timeout, and a dialer waiting for an answer gives up as
/// soon as the job has failed (before: both waited their 3 s, and the job learnt only that a
/// handshake timed out).
#[test]
fn descriptors_used_up_mid_job_fail_the_ranks_at_once_with_the_reason() {
    let results = out_of_descriptors(0, |rank, comm| {
        let send = vec![rank as f32; 16];
        let mut recv = vec![0f32; 16];
        comm.all_to_all(&send, &mut recv)
    });
    for (rank, (result, took)) in results.iter().enumerate() {
        let e = result
            .as_ref()
            .expect_err("an all-to-all without descriptors");
        assert!(
            *took < Duration::from_millis(2500),
            "rank {rank} after {took:?}: {e}"
        );
        assert!(e.to_string().starts_with(&format!("rank {rank}: ")), "{e}");
        assert!(says_why(e), "rank {rank}: {e}");
    }

    for spare in [1, 2] {
        let results = out_of_descriptors(spare, |rank, comm| match rank {
            0 => comm.send(&[1.0f32; 64], 2),
            2 => comm.recv(&mut [0f32; 64], 0),
            _ => Ok(()),
        });
        // With spare descriptors the dials usually open their sockets and an acceptor cannot
        // take the other's (each rank then names its own acceptor); a descriptor another thread
        // gives back meanwhile can let a side through (seen with one spare), which is no
        // failure either. A side that fails must fail at once and say why.
        for rank in [0, 2] {
            let (result, took) = &results[rank];
            let Err(e) = result else { continue };
            assert!(
                *took < Duration::from_millis(2500),
                "rank {rank} after {took:?}: {e}"
            );
            assert!(says_why(e), "rank {rank}: {e}");
        }
    }
}
