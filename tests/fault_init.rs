//! Faults at set-up, each in a process of its own (this test binary holds nothing else, so what
//! a failed set-up leaves behind can be counted): a rank that never arrives.

mod common;

use common::{held, held_again};
use std::time::{Duration, Instant};
use weftcc::Error;

/// A rank that never arrives: every rank that did fails within the set-up timeout with the
/// missing rank named (a typed field), and leaves no descriptor, thread or segment behind.
#[test]
fn a_rank_that_never_arrives_is_named_by_every_rank_that_did() {
    // Threads of other tests come and go: compare with what is held right before and after.
    let before = held();
    let id = weftcc::UniqueId::new().expect("id");
    let mut config = weftcc::CommConfig::from_env().expect("config");
    config.timeout = Duration::from_millis(1500);
    let start = Instant::now();
    let results: Vec<_> = (0..3)
        .map(|rank| {
            let (id, config) = (id.clone(), config.clone());
            std::thread::spawn(move || {
                weftcc::Communicator::init_with(rank, 4, &id, config).map(|_| ())
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| (t.join().expect("rank thread"), start.elapsed()))
        .collect();
    for (rank, (r, took)) in results.iter().enumerate() {
        match r {
            Err(Error::Bootstrap {
                source:
                    weftcc::transports::TransportError::NotJoined {
                        missing, nranks: 4, ..
                    },
                ..
            }) if missing == &[3] => {}
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(
            *took < Duration::from_secs(10),
            "rank {rank} after {took:?}"
        );
    }
    let msg = results[0].0.as_ref().unwrap_err().to_string();
    assert!(msg.contains("ranks [3] of 4 did not join within"), "{msg}");
    // What the three ranks held is gone (threads end shortly after their communicator).
    assert_eq!(
        held_again(before, held, Duration::from_secs(10)),
        before,
        "(descriptors, threads, /dev/shm entries) before and after"
    );
}
