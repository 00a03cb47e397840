//! Ranks as threads of one process, each with its own communicator (shared memory between
//! them, or TCP with `shm_disable`): for tests, examples and programs that drive several ranks
//! from one process.

use crate::bootstrap::UniqueId;
use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::error::Result;
use std::any::Any;

/// Runs `body(rank, communicator)` on `n` threads, rank `r`'s communicator built from
/// `config(r)`, and returns the results in rank order.
///
/// The first error creating a communicator (in rank order) is returned; the other ranks'
/// creation fails too, at their timeout at the latest. A panic on a rank is raised again here,
/// naming the rank.
pub fn run_ranks<R: Send>(
    n: usize,
    config: impl Fn(usize) -> CommConfig,
    body: impl Fn(usize, Communicator) -> R + Sync,
) -> Result<Vec<R>> {
    let id = UniqueId::new()?;
    std::thread::scope(|s| {
        let body = &body;
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                let (id, cfg) = (id.clone(), config(rank));
                s.spawn(move || Communicator::init_with(rank, n, &id, cfg).map(|c| body(rank, c)))
            })
            .collect();
        let mut results = Vec::with_capacity(n);
        let mut first_error = None;
        for (rank, thread) in ranks.into_iter().enumerate() {
            match thread.join() {
                Ok(Ok(r)) => results.push(r),
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(p) => std::panic::resume_unwind(Box::new(format!(
                    "rank {rank} panicked: {}",
                    panic_text(p.as_ref())
                ))),
            }
        }
        first_error.map_or(Ok(results), Err)
    })
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}
