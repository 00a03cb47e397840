//! A communicator's place in its lineage: the epoch it is at (agreements count), the shrinks and
//! grows made from it, and the events that made it from the job's first communicators. Owned by
//! the communicator; read and advanced by recovery (`crate::recovery`).

use crate::records::recovery::RecoveryEvent;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use weftcc_transports::lock;

/// A communicator's place in its lineage: the epoch it started at, and the agreements, shrinks
/// and grows made from it so far (every member counts the same, as they call them together).
#[derive(Debug, Default)]
pub(crate) struct Lineage {
    /// The latest epoch: the one it started at, or its latest agreement's.
    epoch: AtomicU64,
    /// Shrinks and grows made from it so far (they number the relatives' namespaces).
    pub(crate) shrinks: AtomicU64,
    pub(crate) grows: AtomicU64,
    /// How this communicator came from the job's first ones, oldest first.
    pub(crate) events: Mutex<Vec<RecoveryEvent>>,
}

impl Lineage {
    pub(crate) fn events(&self) -> Vec<RecoveryEvent> {
        lock(&self.events).clone()
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    pub(crate) fn start_at(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::SeqCst);
    }

    pub(crate) fn next_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst) + 1
    }
}
