//! A connection's endpoints and what their completions tell ([`EndpointState`]), and the
//! process-wide progress of every live one ([`progress_all`], [`NetWaiter`]).

use super::layout::{
    counter_pair, DIRECT_IN, HEAD_IN, NET_POLL_SLICE, TAIL_IN, WORD_SLOT, WORD_SLOTS,
};
use crate::conn::{IdleWaiter, Interest};
use crate::error::Result;
use crate::net::{Completion, Endpoint, NetError, Posted, Region, RemoteRegion};
use crate::util::lock;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// An endpoint and the facts its completions established; locked by its connection's calls
/// and, when free, by [`progress_all`].
pub(super) struct EndpointState {
    /// Declared first so that it closes before the regions below are deregistered: a
    /// provider may still read the staging mirror or place bytes in the landing ring until
    /// then, and [`progress_all`] may hold this state after the connection is gone.
    pub(super) eps: Vec<Box<dyn Endpoint>>,
    pub(super) _regions: [Arc<Region>; 2],
    /// Registered sources for control words on endpoints whose inline writes are too small
    /// (some providers have none): [`WORD_SLOTS`] slots of 16 bytes, each with the work
    /// request reading it while one does.
    pub(super) words: Arc<Region>,
    pub(super) slots: [Option<u64>; WORD_SLOTS],
    /// Work requests posted and not completed, per endpoint.
    pub(super) outstanding: Vec<usize>,
    /// One endpoint whose writes are placed in order ([`Endpoint::placement_ordered`]): the
    /// head may follow its data at once. Otherwise the head covers only data whose writes
    /// completed.
    pub(super) ordered: bool,
    /// The endpoint the next data write goes to (round robin).
    pub(super) rr: usize,
    pub(super) next_wr: u64,
    /// Head writes posted and not completed: (work request, head value), in posting order.
    pub(super) heads: VecDeque<(u64, u64)>,
    /// The largest head whose write completed: every byte before it has left this process.
    pub(super) head_done: u64,
    /// Data writes posted: (work request, stream position after it, completed), in posting
    /// order; completed ones leave from the front.
    pub(super) data: VecDeque<(u64, u64, bool)>,
    /// Every data byte before this stream position was written out of the staging mirror
    /// (its write completed): the mirror may be refilled up to here (a device may re-read a
    /// source until its write completes, so the peer's tail alone is not enough).
    pub(super) data_done: u64,
    /// Direct (rendezvous) writes posted: (work request, stream position after it, completed),
    /// in posting order, and the stream position before which all of them completed.
    pub(super) direct: VecDeque<(u64, u64, bool)>,
    pub(super) direct_done: u64,
    /// `direct` word writes posted and not completed: (work request, value); and the largest
    /// value whose write completed (the peer knows every direct byte before it).
    pub(super) direct_words: VecDeque<(u64, u64)>,
    pub(super) direct_word_done: u64,
    /// The write of this side's promise, while in flight (its source is busy until then).
    pub(super) promise_wr: Option<u64>,
    /// Registered bounce buffer of the direct writes ([`BOUNCE_SLOTS`] × [`STRIPE`] bytes),
    /// made when this side first takes a promise.
    pub(super) bounce: Option<Arc<Region>>,
    pub(super) failed: Option<NetError>,
    pub(super) done: Vec<Completion>,
    /// The peer's landing region and ring size, and the queue bound, for the control words.
    pub(super) remote: RemoteRegion,
    pub(super) remote_cap: usize,
    pub(super) max_outstanding: usize,
    /// Head and tail the connection wants the peer to know, and the values last posted:
    /// whoever polls this state posts what is pending ([`progress_all`] too), so bytes a
    /// plain `try_send` accepted leave even if their connection is never called again.
    pub(super) head_want: u64,
    pub(super) head_posted: u64,
    pub(super) tail_want: u64,
    pub(super) tail_posted: u64,
    pub(super) direct_want: u64,
    pub(super) direct_posted: u64,
}

impl EndpointState {
    /// Polls completions into the counters; the first failure is kept.
    pub(super) fn poll(&mut self) {
        if self.failed.is_some() {
            return;
        }
        self.done.clear();
        for (ep, outstanding) in self.eps.iter_mut().zip(self.outstanding.iter_mut()) {
            let before = self.done.len();
            if let Err(e) = ep.poll(&mut self.done) {
                self.failed = Some(e);
                return;
            }
            *outstanding = outstanding.saturating_sub(self.done.len() - before);
        }
        for c in &self.done {
            if let Some(slot) = self.slots.iter_mut().find(|s| **s == Some(c.wr_id)) {
                *slot = None;
            }
            if self.promise_wr == Some(c.wr_id) {
                self.promise_wr = None;
            }
            if let Err(e) = &c.result {
                self.failed.get_or_insert_with(|| e.clone());
            }
            if let Some(i) = self.heads.iter().position(|&(id, _)| id == c.wr_id) {
                let (_, head) = self.heads.remove(i).unwrap_or_default();
                self.head_done = self.head_done.max(head);
            } else if let Some(i) = self.direct_words.iter().position(|&(id, _)| id == c.wr_id) {
                let (_, end) = self.direct_words.remove(i).unwrap_or_default();
                self.direct_word_done = self.direct_word_done.max(end);
            } else if let Some(w) = self.data.iter_mut().find(|w| w.0 == c.wr_id) {
                w.2 = true;
            } else if let Some(w) = self.direct.iter_mut().find(|w| w.0 == c.wr_id) {
                w.2 = true;
            }
        }
        while let Some(&(_, end, true)) = self.data.front() {
            self.data_done = end;
            self.data.pop_front();
        }
        while let Some(&(_, end, true)) = self.direct.front() {
            self.direct_done = end;
            self.direct.pop_front();
        }
        // Direct writes go to the destination on any endpoint: the `direct` word covers only
        // bytes whose writes completed.
        self.direct_want = self.direct_want.max(self.direct_done);
        if !self.ordered {
            // Writes on different endpoints, or on one whose placement is relaxed, land in no
            // particular order: the head covers only bytes whose writes completed.
            self.head_want = self.head_want.max(self.data_done);
        }
    }

    /// Whether a word for the peer waits for a later poll (see [`progress_all`]).
    pub(super) fn owes_words(&self) -> bool {
        self.failed.is_none()
            && (!self.data.is_empty()
                || self.head_want != self.head_posted
                || self.tail_want != self.tail_posted
                || self.direct_pending())
    }

    pub(super) fn total_outstanding(&self) -> usize {
        self.outstanding.iter().sum()
    }

    /// Whether direct writes, or the `direct` word after them, have yet to go out.
    pub(super) fn direct_pending(&self) -> bool {
        !self.direct.is_empty() || self.direct_posted != self.direct_want
    }

    /// Closes every endpoint now, so that nothing more is placed in this side's memory (a
    /// promised destination) nor read from it, and fails the connection.
    pub(super) fn close_endpoints(&mut self) {
        self.eps.clear();
        self.failed
            .get_or_insert(NetError::Abandoned { provider: "net" });
    }

    /// Posts the head and tail the peer has not been sent yet (a full queue leaves them for
    /// the next call).
    pub(super) fn flush_words(&mut self) {
        if self.failed.is_some() {
            return;
        }
        for at in [HEAD_IN, TAIL_IN, DIRECT_IN] {
            let (want, posted) = match at {
                HEAD_IN => (self.head_want, self.head_posted),
                TAIL_IN => (self.tail_want, self.tail_posted),
                _ => (self.direct_want, self.direct_posted),
            };
            if want == posted {
                continue;
            }
            let offset = (self.remote_cap + at) as u64;
            let pair = counter_pair(want);
            match self.post_small(0, &pair, offset) {
                Ok(Some(id)) => match at {
                    HEAD_IN => {
                        self.heads.push_back((id, want));
                        self.head_posted = want;
                    }
                    TAIL_IN => self.tail_posted = want,
                    _ => {
                        self.direct_words.push_back((id, want));
                        self.direct_posted = want;
                    }
                },
                Ok(None) => {}
                Err(e) => self.failed = Some(e),
            }
        }
    }

    /// Writes `bytes` (a control word, at most 16) to `offset` of the peer's landing region on
    /// endpoint `e`: inline where the endpoint takes that many bytes inline, else from a free
    /// registered slot. The id if it was posted.
    pub(super) fn post_small(
        &mut self,
        e: usize,
        bytes: &[u8],
        offset: u64,
    ) -> std::result::Result<Option<u64>, NetError> {
        let remote = self.remote;
        if bytes.len() <= self.eps[e].inline_max() {
            return self.post(e, |ep, id| ep.write_inline(bytes, remote.at(offset), id));
        }
        let Some(slot) = self.slots.iter().position(Option::is_none) else {
            return Ok(None);
        };
        // SAFETY: no posted write reads this slot (its last one completed: the slot is free).
        unsafe { self.words.memory.write(slot * WORD_SLOT, bytes) };
        let words = Arc::clone(&self.words);
        let posted = self.post(e, |ep, id| {
            ep.write(
                words.range(slot * WORD_SLOT, bytes.len()),
                remote.at(offset),
                id,
            )
        })?;
        if let Some(id) = posted {
            self.slots[slot] = Some(id);
        }
        Ok(posted)
    }

    /// Posts on endpoint `e` with a fresh work-request id; the id if it was taken.
    pub(super) fn post(
        &mut self,
        e: usize,
        post: impl FnOnce(&mut dyn Endpoint, u64) -> std::result::Result<Posted, NetError>,
    ) -> std::result::Result<Option<u64>, NetError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.outstanding[e] >= self.max_outstanding {
            return Ok(None);
        }
        let id = self.next_wr;
        match post(self.eps[e].as_mut(), id)? {
            Posted::Yes => {
                self.next_wr += 1;
                self.outstanding[e] += 1;
                Ok(Some(id))
            }
            Posted::Full => Ok(None),
        }
    }
}

/// Every live network connection's endpoint in this process, so that any of them waiting
/// makes all of them progress (libfabric's tcp provider moves bytes only when polled: a
/// tail written by a rank that then left the connection alone must still leave).
pub(super) fn registry() -> &'static Mutex<Vec<Weak<Mutex<EndpointState>>>> {
    static LIVE: OnceLock<Mutex<Vec<Weak<Mutex<EndpointState>>>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(Vec::new()))
}

/// Polls every network endpoint of this process that nobody else is polling right now.
/// Returns whether one of them still owes its peer a word that only a later poll posts: a
/// head that waits for its data's completion (relaxed placement, several endpoints), or a
/// tail or direct word a full queue held back. Whoever waits must then poll again soon even
/// if it waits for other peers: the owed peer may be waiting for that word.
pub fn progress_all() -> bool {
    let live: Vec<Arc<Mutex<EndpointState>>> = {
        let mut reg = lock(registry());
        reg.retain(|w| w.strong_count() > 0);
        reg.iter().filter_map(Weak::upgrade).collect()
    };
    let mut owed = false;
    for st in live {
        match st.try_lock() {
            Ok(mut st) => {
                st.poll();
                st.flush_words();
                owed |= st.owes_words();
            }
            // Someone else polls it now; it may owe: look again soon.
            Err(_) => owed = true,
        }
    }
    owed
}
/// Sleeps in short slices: a network connection moves only when polled, and the caller polls
/// again after every return (spurious returns are allowed by [`IdleWaiter`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct NetWaiter;

impl IdleWaiter for NetWaiter {
    fn wait(&mut self, _interest: &[Interest], max: Duration) -> Result<()> {
        let _ = progress_all();
        std::thread::sleep(max.min(NET_POLL_SLICE));
        Ok(())
    }
}
