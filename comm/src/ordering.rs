//! Issue order is execution order: every call takes a ticket, and tickets execute one at a time
//! (blocking calls on the caller's thread, async calls on the communicator's worker thread).

use crate::communicator::{Inner, State};
use crate::error::Result;
use crate::lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;
use weftcc_collectives::OpKind;

/// Issue order of operations: which ticket executes now, and how many callers wait for their
/// turn. Atomics, so that a caller whose turn it already is (a single thread issuing blocking
/// calls, the common case) takes no lock; the mutex and condition variable only serve waiters.
#[derive(Default)]
pub(crate) struct Turn {
    pub(crate) now: AtomicU64,
    pub(crate) waiters: AtomicU64,
    pub(crate) lock: Mutex<()>,
    pub(crate) changed: Condvar,
}

impl Turn {
    /// Wakes every waiter. Taking the lock first means a waiter that saw the old state is
    /// already inside `wait_timeout` (it checks the state while holding the lock).
    pub(crate) fn wake_all(&self) {
        drop(lock(&self.lock));
        self.changed.notify_all();
    }
}

/// Kind and sequence number of the operation running now, readable without a lock by the
/// threads that report failures: one word (kind in the top byte), so a reader never pairs one
/// operation's kind with another's sequence number.
#[derive(Default)]
pub(crate) struct CurrentOp(AtomicU64);

impl CurrentOp {
    const SEQ_BITS: u32 = 56;

    pub(crate) fn set(&self, kind: OpKind, seq: u64) {
        let word = (u64::from(kind as u8) << Self::SEQ_BITS) | (seq & ((1 << Self::SEQ_BITS) - 1));
        self.0.store(word, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> (OpKind, u64) {
        let word = self.0.load(Ordering::Relaxed);
        let kind = OpKind::from_code((word >> Self::SEQ_BITS) as u8).unwrap_or(OpKind::Barrier);
        (kind, word & ((1 << Self::SEQ_BITS) - 1))
    }
}

thread_local! {
    /// The ticket a worker job holds while it runs (so its nested blocking call reuses it).
    pub(crate) static TICKET: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

impl Inner {
    pub(crate) fn take_ticket(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    /// Waits until `ticket` is the next to execute (or the communicator is aborted/poisoned).
    pub(crate) fn wait_turn(&self, ticket: u64) -> Result<()> {
        if self.turn.now.load(Ordering::SeqCst) == ticket {
            return Ok(());
        }
        self.wait_turn_slow(ticket, true)
    }

    pub(crate) fn end_turn(&self, ticket: u64) {
        // A caller that failed before its turn must still pass the turn on, in order.
        if self.turn.now.load(Ordering::SeqCst) != ticket {
            let _ = self.wait_turn_slow(ticket, false);
        }
        self.turn.now.store(ticket + 1, Ordering::SeqCst);
        // Waking is a system call: skip it on the common path where nobody waits. The store
        // above and the waiter's increment are both SeqCst, so either the waiter sees the new
        // turn or this load sees the waiter.
        if self.turn.waiters.load(Ordering::SeqCst) > 0 {
            self.turn.wake_all();
        }
    }

    /// Sleeps until `now` reaches `ticket`; with `check`, fails early when poisoned.
    pub(crate) fn wait_turn_slow(&self, ticket: u64, check: bool) -> Result<()> {
        let mut guard = lock(&self.turn.lock);
        self.turn.waiters.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if self.turn.now.load(Ordering::SeqCst) == ticket {
                break Ok(());
            }
            if check {
                if let Err(e) = self.check() {
                    break Err(e);
                }
            }
            // The timeout bounds how late a poison raised without a wake-up is noticed.
            guard = match self
                .turn
                .changed
                .wait_timeout(guard, Duration::from_millis(50))
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        self.turn.waiters.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Runs `f` in issue order. Inside a worker job the job's ticket is reused.
    pub(crate) fn run_blocking<R>(
        &self,
        kind: OpKind,
        f: impl FnOnce(&Inner, &mut State) -> Result<R>,
    ) -> Result<R> {
        let held = TICKET.with(|t| t.get());
        // A ticket of our own only when some other call holds or waits for one. When every
        // ticket taken so far has finished (`now` caught up with `next_ticket`, read in that
        // order), every call issued before this one is done, and the state lock alone orders
        // this call against one issued meanwhile from another thread (the two are concurrent:
        // neither order is promised). That saves the two locked instructions of a ticket on
        // the common path, a single thread issuing blocking calls.
        let own_ticket = if held.is_none()
            && self.next_ticket.load(Ordering::SeqCst) != self.turn.now.load(Ordering::SeqCst)
        {
            let t = self.take_ticket();
            if let Err(e) = self.wait_turn(t) {
                self.end_turn(t);
                return Err(e);
            }
            Some(t)
        } else {
            None
        };
        let result = (|| {
            self.check()?;
            let mut st = lock(&self.state);
            f(self, &mut st)
        })();
        if let Some(t) = own_ticket {
            self.end_turn(t);
        }
        if let Err(e) = &result {
            if e.is_fatal() {
                self.fail(e.clone());
                self.leave_farewell();
                // Once poisoned, the first error is the one to report: a peer that closed its
                // connections because this rank aborted is a consequence, not the cause.
                if let Some(first) = self.poisoned() {
                    return Err(first);
                }
            }
        }
        tracing::debug!(target: "weftcc::op", rank = self.rank, %kind, ok = result.is_ok());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_op_keeps_kind_and_sequence_together() {
        let current = CurrentOp::default();
        assert_eq!(current.get(), (OpKind::Barrier, 0));
        for kind in OpKind::ALL {
            for seq in [1, 77, (1 << 56) - 1] {
                current.set(kind, seq);
                assert_eq!(current.get(), (kind, seq));
            }
        }
    }
}
