//! The few helpers that both the bootstrap store (`weftcc-store`) and the transports
//! (`weftcc-transports`) need, in one place below both: the poison-tolerant [`lock`], the
//! [`Deadline`] an operation gives up at, and plain listening TCP sockets ([`socket`]).
//!
//! Errors are typed but small: [`OsError`] (a failed system call and what was being done) and
//! [`TimedOut`] (what was waited for, and for how long); each crate above turns them into its own
//! error type through `From`.

#![forbid(unsafe_code)]

pub mod socket;

use std::time::{Duration, Instant};

/// Locks a mutex, recovering from poisoning: a panic on another thread must not cascade into
/// every thread that touches the same state (weftcc's state stays consistent across a panic:
/// counters are updated after the work they count). The one such helper of every weftcc crate.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An operating-system call that failed, and what was being done.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct OsError {
    /// What was being done.
    pub what: String,
    /// The system's error.
    pub source: std::io::Error,
}

impl OsError {
    /// `source`, while doing `what`.
    pub fn new(what: impl Into<String>, source: std::io::Error) -> Self {
        OsError {
            what: what.into(),
            source,
        }
    }
}

/// A wait that ran out: what was waited for, and the limit that expired.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("timed out after {after:?} while {what}")]
pub struct TimedOut {
    /// What was being waited for.
    pub what: String,
    /// The limit that expired.
    pub after: Duration,
}

/// A point in time after which an operation gives up.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    end: Option<Instant>,
    total: Duration,
}

impl Deadline {
    /// The deadline `total` from now.
    pub fn after(total: Duration) -> Self {
        Deadline {
            end: Instant::now().checked_add(total),
            total,
        }
    }

    /// Time left (zero once expired). A duration too large to represent never expires.
    pub fn remaining(&self) -> Duration {
        match self.end {
            Some(end) => end.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(u64::from(u32::MAX)),
        }
    }

    /// Whether no time is left.
    pub fn expired(&self) -> bool {
        self.remaining().is_zero()
    }

    /// The error of a wait for `what` that ran out: [`TimedOut`] with this deadline's length, as
    /// the caller's error type.
    pub fn timeout_error<E: From<TimedOut>>(&self, what: impl Into<String>) -> E {
        E::from(TimedOut {
            what: what.into(),
            after: self.total,
        })
    }
}
