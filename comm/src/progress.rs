//! This rank's own progress: its thread stores a few atomics per operation; the failure watcher
//! publishes the record ([`crate::records::progress::ProgressRecord`]) to the bootstrap store
//! when it changed (at most every [`crate::failure::WATCH_PERIOD`]), so nothing is sent per
//! message.

use crate::records::progress::{now_ms, op_word, word_op, ProgressRecord};
use std::sync::atomic::{AtomicU64, Ordering};
use weftcc_collectives::OpKind;

/// A rank's own progress, stored by its operations and read by its watcher.
#[derive(Debug)]
pub(crate) struct Progress {
    entered: AtomicU64,
    completed: AtomicU64,
    at_ms: AtomicU64,
    /// Bumped on every change, so the watcher publishes only what moved.
    version: AtomicU64,
}

/// No operation yet (a word with no kind: [`word_op`] reads it as `None`).
const NONE: u64 = u64::MAX;

impl Default for Progress {
    fn default() -> Self {
        Progress {
            entered: AtomicU64::new(NONE),
            completed: AtomicU64::new(NONE),
            at_ms: AtomicU64::new(now_ms()),
            version: AtomicU64::new(0),
        }
    }
}

impl Progress {
    /// The rank entered collective `kind` #`seq` at `at_ms` (the caller's clock reading, which
    /// its flight recorder entry shares: one reading per event on the small-message path).
    /// Called, as [`Progress::completed`], under the communicator's state lock.
    pub(crate) fn entered(&self, kind: OpKind, seq: u64, at_ms: u64) {
        self.entered.store(op_word(kind, seq), Ordering::Relaxed);
        self.touch(at_ms);
    }

    /// The rank completed `kind` #`seq` at `at_ms`.
    pub(crate) fn completed(&self, kind: OpKind, seq: u64, at_ms: u64) {
        self.completed.store(op_word(kind, seq), Ordering::Relaxed);
        self.touch(at_ms);
    }

    /// Callers hold the communicator's state lock, so there is one writer at a time and the
    /// version is bumped without a locked instruction (two fewer per operation).
    fn touch(&self, at_ms: u64) {
        self.at_ms.store(at_ms, Ordering::Relaxed);
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v.wrapping_add(1), Ordering::Release);
    }

    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub(crate) fn record(&self) -> ProgressRecord {
        ProgressRecord {
            entered: word_op(self.entered.load(Ordering::Relaxed)),
            completed: word_op(self.completed.load(Ordering::Relaxed)),
            at_ms: self.at_ms.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_records_what_it_was_told() {
        let p = Progress::default();
        let v = p.version();
        assert_eq!(p.record().entered, None);
        p.entered(OpKind::Broadcast, 1, now_ms());
        p.completed(OpKind::Broadcast, 1, now_ms());
        assert!(p.version() > v);
        let r = p.record();
        assert_eq!(r.entered, Some((OpKind::Broadcast, 1)));
        assert_eq!(r.completed, Some((OpKind::Broadcast, 1)));
    }
}
