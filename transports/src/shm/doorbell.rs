//! Doorbells: how a side wakes its peer ([`Mapping::ring_doorbell`]) and how an idle rank
//! sleeps until woken ([`ShmWaiter`]).

use super::layout::{H_DOORBELL, H_SLEEPING};
use super::segment::Mapping;
use crate::conn::{IdleWaiter, Interest};
use crate::error::Result;
use crate::util::{futex_wait, futex_wake};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

impl Mapping {
    pub(super) fn doorbell(&self) -> &AtomicU32 {
        self.u32_at(H_DOORBELL)
    }

    pub(super) fn sleeping(&self) -> &AtomicU32 {
        self.u32_at(H_SLEEPING)
    }

    /// Rings only when the owner sleeps, or is about to ([`Outbox::sleep_unless`]): call after
    /// storing what the owner waits for. Either this sees the owner's sleeping count, or the
    /// owner (which raises the count before it checks its condition) sees the store. Costs a
    /// read of a line that stays in this core's cache while nobody sleeps, where a ring is a
    /// locked write to the owner's line.
    ///
    /// [`Outbox::sleep_unless`]: super::Outbox::sleep_unless
    pub(super) fn wake_if_sleeping(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping().load(Ordering::SeqCst) != 0 {
            self.ring_doorbell();
        }
    }

    /// Sleeps on this segment's doorbell (its owner's) for at most `max` unless `ready()`, which
    /// is checked after the sleeping count is raised (see [`Mapping::wake_if_sleeping`]).
    pub(super) fn sleep_unless(&self, max: Duration, ready: &dyn Fn() -> bool) {
        let bell = self.doorbell();
        let sleeping = self.sleeping();
        // A count rather than a flag, so that several waiters on one segment stay correct.
        sleeping.fetch_add(1, Ordering::SeqCst);
        let cur = bell.load(Ordering::SeqCst);
        if !ready() {
            futex_wait(bell, cur, max);
        }
        sleeping.fetch_sub(1, Ordering::SeqCst);
    }

    /// Signals the owner of this segment: new data or freed space.
    pub(super) fn ring_doorbell(&self) {
        self.doorbell().fetch_add(1, Ordering::SeqCst);
        if self.sleeping().load(Ordering::SeqCst) != 0 {
            futex_wake(self.doorbell());
        }
    }
}

/// [`IdleWaiter`] for shared-memory connections: sleeps on this rank's doorbell futex.
pub struct ShmWaiter {
    pub(super) map: Arc<Mapping>,
    pub(super) last: u32,
}

impl ShmWaiter {
    /// Waits for at most `max` unless the doorbell was rung since the previous return; returns
    /// whether it was (a ring during this call counts).
    pub fn wait_doorbell(&mut self, max: Duration) -> bool {
        let bell = self.map.doorbell();
        let last = self.last;
        self.map
            .sleep_unless(max, &|| bell.load(Ordering::SeqCst) != last);
        let now = bell.load(Ordering::SeqCst);
        let rung = now != self.last;
        self.last = now;
        rung
    }

    /// True (and acknowledged) if the doorbell was rung since the previous return; never sleeps.
    pub fn poll_doorbell(&mut self) -> bool {
        let now = self.map.doorbell().load(Ordering::SeqCst);
        let rung = now != self.last;
        self.last = now;
        rung
    }
}

impl IdleWaiter for ShmWaiter {
    fn wait(&mut self, _interest: &[Interest], max: Duration) -> Result<()> {
        self.wait_doorbell(max);
        Ok(())
    }
}
