//! Issue order is execution order: every call takes a ticket, and tickets execute one at a time
//! (blocking calls on the caller's thread, async calls on the communicator's worker thread).

use crate::error::Result;
use crate::records::progress::{op_word, word_op};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;
use weftcc_collectives::OpKind;
use weftcc_transports::lock;

/// Issue order of operations: the next ticket to hand out, which ticket executes now, and how
/// many callers wait for their turn. Atomics, so that a caller whose turn it already is (a
/// single thread issuing blocking calls, the common case) takes no lock; the mutex and
/// condition variable only serve waiters.
#[derive(Default)]
pub(crate) struct Turns {
    next_ticket: AtomicU64,
    now: AtomicU64,
    waiters: AtomicU64,
    lock: Mutex<()>,
    changed: Condvar,
}

impl Turns {
    /// Wakes every waiter. Taking the lock first means a waiter that saw the old state is
    /// already inside `wait_timeout` (it checks the state while holding the lock).
    pub(crate) fn wake_all(&self) {
        drop(lock(&self.lock));
        self.changed.notify_all();
    }

    /// Whether a call must take a ticket of its own: some other call holds or waits for one.
    /// When every ticket taken so far has finished (`now` caught up with `next_ticket`, read in
    /// that order), every call issued before this one is done, and the state lock alone orders
    /// this call against one issued meanwhile from another thread (the two are concurrent:
    /// neither order is promised). That saves the two locked instructions of a ticket on the
    /// common path, a single thread issuing blocking calls.
    pub(crate) fn busy(&self) -> bool {
        self.next_ticket.load(Ordering::SeqCst) != self.now.load(Ordering::SeqCst)
    }

    pub(crate) fn take_ticket(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    /// Waits until `ticket` is the next to execute, or `check` fails (the communicator was
    /// aborted or poisoned).
    pub(crate) fn wait_turn(&self, ticket: u64, check: &dyn Fn() -> Result<()>) -> Result<()> {
        if self.now.load(Ordering::SeqCst) == ticket {
            return Ok(());
        }
        self.wait_turn_slow(ticket, Some(check))
    }

    pub(crate) fn end_turn(&self, ticket: u64) {
        // A caller that failed before its turn must still pass the turn on, in order.
        if self.now.load(Ordering::SeqCst) != ticket {
            let _ = self.wait_turn_slow(ticket, None);
        }
        self.now.store(ticket + 1, Ordering::SeqCst);
        // Waking is a system call: skip it on the common path where nobody waits. The store
        // above and the waiter's increment are both SeqCst, so either the waiter sees the new
        // turn or this load sees the waiter.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.wake_all();
        }
    }

    /// Sleeps until `now` reaches `ticket`; with `check`, fails early when that fails.
    fn wait_turn_slow(&self, ticket: u64, check: Option<&dyn Fn() -> Result<()>>) -> Result<()> {
        let mut guard = lock(&self.lock);
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if self.now.load(Ordering::SeqCst) == ticket {
                break Ok(());
            }
            if let Some(check) = check {
                if let Err(e) = check() {
                    break Err(e);
                }
            }
            // The timeout bounds how late a poison raised without a wake-up is noticed.
            guard = match self.changed.wait_timeout(guard, Duration::from_millis(50)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

/// Kind and sequence number of the operation running now, readable without a lock by the
/// threads that report failures: one word (kind in the top byte), so a reader never pairs one
/// operation's kind with another's sequence number.
#[derive(Default)]
pub(crate) struct CurrentOp(AtomicU64);

/// The sequence-number bits of an operation word ([`op_word`]).
const SEQ_MASK: u64 = (1 << 56) - 1;

impl CurrentOp {
    pub(crate) fn set(&self, kind: OpKind, seq: u64) {
        self.0.store(op_word(kind, seq), Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> (OpKind, u64) {
        let word = self.0.load(Ordering::Relaxed);
        word_op(word).unwrap_or((OpKind::Barrier, word & SEQ_MASK))
    }
}

thread_local! {
    /// The ticket a worker job holds while it runs (so its nested blocking call reuses it).
    pub(crate) static TICKET: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
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

/// The ticket protocol under every interleaving: threads issue calls through `run_blocking`
/// (its ticket-free fast path when nobody holds or waits for a ticket) or with a ticket of their
/// own (`take_ticket`, `wait_turn`, `end_turn`), and each step below mirrors one atomic action
/// of that code, the turn lock and its condition variable included (waits without the 50 ms
/// timeout, so a missed wake-up shows as a stuck state instead of a delay). The checks: a
/// ticket's call runs only on its turn, in ticket order, and nobody waits forever.
#[cfg(test)]
mod model {
    use weftcc_testkit::model::{explore, Faulty, Model, Violation};

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Pc {
        /// `run_blocking`: `next_ticket` is read next (then `now`, for the fast path).
        Blocking,
        FastNow {
            next: u64,
        },
        /// `take_ticket` next.
        Take,
        /// `wait_turn`'s lock-free check.
        Check(u64),
        /// `wait_turn_slow`: lock, `waiters += 1`, the loop, `waiters -= 1`, unlock.
        SlowLock(u64),
        SlowCount(u64),
        SlowLook(u64),
        /// In `Condvar::wait` (the turn lock released) until notified.
        Parked(u64),
        Relock(u64),
        SlowUncount(u64),
        SlowUnlock(u64),
        /// The call itself, under the state lock (`None`: the fast path, no ticket).
        Call(Option<u64>),
        Return(Option<u64>),
        /// `end_turn`: store `now`, read `waiters`, then `wake_all` (lock, unlock, notify).
        Store(u64),
        LookWaiters,
        WakeLock,
        WakeUnlock,
        Notify,
        Done,
    }

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct Tickets {
        now: u64,
        next_ticket: u64,
        waiters: u64,
        /// Owners of the turn lock and of the communicator's state lock.
        turn_lock: Option<usize>,
        state_lock: Option<usize>,
        /// Ticketed calls completed, in order.
        ran: u64,
        pcs: Vec<Pc>,
        broken: Option<&'static str>,
    }

    impl Tickets {
        fn new(pcs: Vec<Pc>) -> Self {
            Tickets {
                now: 0,
                next_ticket: 0,
                waiters: 0,
                turn_lock: None,
                state_lock: None,
                ran: 0,
                pcs,
                broken: None,
            }
        }
    }

    impl Model for Tickets {
        fn threads(&self) -> usize {
            self.pcs.len()
        }

        fn steps(&self, t: usize) -> Vec<Self> {
            let mut s = self.clone();
            let free = |lock: Option<usize>| lock.is_none();
            s.pcs[t] = match self.pcs[t] {
                Pc::Done | Pc::Parked(_) => return Vec::new(),
                Pc::Blocking => Pc::FastNow {
                    next: s.next_ticket,
                },
                Pc::FastNow { next } if next == s.now => Pc::Call(None),
                Pc::FastNow { .. } => Pc::Take,
                Pc::Take => {
                    s.next_ticket += 1;
                    Pc::Check(s.next_ticket - 1)
                }
                Pc::Check(k) if s.now == k => Pc::Call(Some(k)),
                Pc::Check(k) => Pc::SlowLock(k),
                Pc::SlowLock(_) | Pc::Relock(_) if !free(s.turn_lock) => return Vec::new(),
                Pc::SlowLock(k) => {
                    s.turn_lock = Some(t);
                    Pc::SlowCount(k)
                }
                Pc::SlowCount(k) => {
                    s.waiters += 1;
                    Pc::SlowLook(k)
                }
                Pc::SlowLook(k) if s.now == k => Pc::SlowUncount(k),
                Pc::SlowLook(k) => {
                    s.turn_lock = None;
                    Pc::Parked(k)
                }
                Pc::Relock(k) => {
                    s.turn_lock = Some(t);
                    Pc::SlowLook(k)
                }
                Pc::SlowUncount(k) => {
                    s.waiters -= 1;
                    Pc::SlowUnlock(k)
                }
                Pc::SlowUnlock(k) => {
                    s.turn_lock = None;
                    Pc::Call(Some(k))
                }
                Pc::Call(_) if !free(s.state_lock) => return Vec::new(),
                Pc::Call(ticket) => {
                    s.state_lock = Some(t);
                    if let Some(k) = ticket {
                        if s.now != k || s.ran != k {
                            s.broken = Some("a ticket's call ran out of its turn");
                        }
                    }
                    Pc::Return(ticket)
                }
                Pc::Return(ticket) => {
                    s.state_lock = None;
                    match ticket {
                        Some(k) => {
                            s.ran += 1;
                            Pc::Store(k)
                        }
                        None => Pc::Done,
                    }
                }
                Pc::Store(k) => {
                    s.now = k + 1;
                    Pc::LookWaiters
                }
                Pc::LookWaiters if s.waiters > 0 => Pc::WakeLock,
                Pc::LookWaiters => Pc::Done,
                Pc::WakeLock if !free(s.turn_lock) => return Vec::new(),
                Pc::WakeLock => {
                    s.turn_lock = Some(t);
                    Pc::WakeUnlock
                }
                Pc::WakeUnlock => {
                    s.turn_lock = None;
                    Pc::Notify
                }
                Pc::Notify => {
                    for pc in &mut s.pcs {
                        if let Pc::Parked(k) = *pc {
                            *pc = Pc::Relock(k);
                        }
                    }
                    Pc::Done
                }
            };
            vec![s]
        }

        fn finished(&self) -> bool {
            self.pcs.iter().all(|&pc| pc == Pc::Done)
        }

        fn check(&self) -> Result<(), &'static str> {
            self.broken.map_or(Ok(()), Err)
        }
    }

    #[test]
    fn tickets_run_in_order_and_nobody_sleeps_through_a_turn() {
        for pcs in [
            vec![Pc::Take, Pc::Take, Pc::Take],
            vec![Pc::Blocking, Pc::Take, Pc::Take],
            vec![Pc::Blocking, Pc::Blocking, Pc::Take],
            vec![Pc::Blocking, Pc::Take, Pc::Take, Pc::Blocking],
        ] {
            let explored = explore(Tickets::new(pcs), 5_000_000).unwrap_or_else(|v| panic!("{v}"));
            assert!(explored.states > 100, "{explored:?}");
        }
    }

    #[test]
    fn a_turn_passed_on_without_waking_is_found() {
        // `end_turn` that skips the wake-up although somebody waits: a parked ticket never runs.
        let no_wake = Faulty {
            model: Tickets::new(vec![Pc::Take, Pc::Take]),
            fault: |before, t, after| {
                if before.pcs[t] == Pc::LookWaiters {
                    after.pcs[t] = Pc::Done;
                }
            },
        };
        let result = explore(no_wake, 1_000_000);
        assert!(matches!(result, Err(Violation::Stuck { .. })), "{result:?}");
    }
}
