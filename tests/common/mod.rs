//! Shared helpers for integration tests: run N ranks as threads of this process.
#![allow(dead_code)]

use std::time::Duration;
use weftcc::{CommConfig, Communicator, UniqueId};

/// Which transport the ranks use between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Shm,
    Tcp,
}

pub fn config(wire: Wire) -> CommConfig {
    let mut c = CommConfig::from_env().expect("config from env");
    c.shm_disable = wire == Wire::Tcp;
    c.timeout = Duration::from_secs(120);
    c.host_id = "test-host".into();
    c
}

/// Creates `n` communicators (one per thread), runs `body(rank, &comm)` on each and returns
/// their results in rank order. Panics from a rank are re-raised with the rank named.
pub fn with_ranks<R: Send>(
    n: usize,
    wire: Wire,
    body: impl Fn(usize, &Communicator) -> R + Sync,
) -> Vec<R> {
    with_ranks_config(n, config(wire), body)
}

pub fn with_ranks_config<R: Send>(
    n: usize,
    cfg: CommConfig,
    body: impl Fn(usize, &Communicator) -> R + Sync,
) -> Vec<R> {
    with_ranks_configs(n, |_| cfg.clone(), body)
}

/// Like [`with_ranks_config`] with a configuration per rank (e.g. a host id per rank, so that
/// ranks of different "hosts" use TCP between them and shared memory inside).
pub fn with_ranks_configs<R: Send>(
    n: usize,
    cfg: impl Fn(usize) -> CommConfig + Sync,
    body: impl Fn(usize, &Communicator) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::new().expect("unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let id = id.clone();
                let cfg = cfg(rank);
                let body = &body;
                s.spawn(move || {
                    let comm = Communicator::init_with(rank, n, &id, cfg)
                        .unwrap_or_else(|e| panic!("rank {rank}: init failed: {e}"));
                    body(rank, &comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.join() {
                Ok(r) => r,
                Err(p) => std::panic::resume_unwind(Box::new(format!(
                    "rank {rank} panicked: {:?}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                ))),
            })
            .collect()
    })
}
