//! One-shot outboxes: the region after each rank's doorbell header where it posts the input of
//! a small collective for every other rank of its host to read in place.
//!
//! A small collective on one host costs little more than the cache lines its data fills, yet a
//! schedule over connections pays per message for headers, cursors and ring counters. With
//! outboxes a rank writes its contribution once into a slot of its own outbox, flags it with the
//! collective's sequence number, and reads the others' slots straight from their outboxes (the
//! peers' doorbell objects, mapped already by every shared-memory connection). The protocol that
//! decides who posts, who reads and when a slot may be written again lives in the runtime
//! (`weftcc-comm`'s `one_shot`); this module is the memory.
//!
//! ```text
//! outbox (after the doorbell header, page aligned):
//!   @0    done u64: the sequence number of the last one-shot collective the owner finished
//!   @64   slot k (k < OUTBOX_SLOTS), each SLOT_STRIDE bytes (whole cache lines):
//!           @0 posted u64 (sequence number, stored last with Release) |
//!           @8 the operation's header (OUTBOX_HEADER_MAX bytes, as 8-byte words) | @48 data
//! ```
//!
//! The flag, the header and the first 16 bytes of data share a cache line: a reader of an 8-byte
//! contribution waits for one line and finds everything in it. The length is not posted: a
//! reader knows it from its own call, whose header it checks first. A slot is written again only
//! once every other rank's `done` has reached the collective that last used it.
//!
//! Waking: a rank that waits on outboxes sleeps on its own doorbell, saying so first; a rank that
//! posts or finishes wakes the others only when they say they sleep, so neither writes another
//! rank's cache lines.

use super::segment::Mapping;
use crate::error::{Result, TransportError};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Slots per outbox, used in turn by consecutive one-shot collectives.
pub const OUTBOX_SLOTS: usize = 2;
/// Largest contribution one slot holds.
pub const OUTBOX_SLOT_BYTES: usize = 4096;

const LINE: usize = 64;
const O_DONE: usize = 0;
const O_SLOTS: usize = LINE;
const S_POSTED: usize = 0;
const S_DESC: usize = 8;
/// Longest operation header a slot carries.
pub const OUTBOX_HEADER_MAX: usize = 40;
const S_DATA: usize = S_DESC + OUTBOX_HEADER_MAX;
const SLOT_STRIDE: usize = (S_DATA + OUTBOX_SLOT_BYTES).div_ceil(LINE) * LINE;

/// Bytes of one outbox.
pub(super) const OUTBOX_BYTES: usize = O_SLOTS + OUTBOX_SLOTS * SLOT_STRIDE;

/// One rank's outbox, this rank's own or a peer's (mapped through its doorbell).
#[derive(Clone)]
pub struct Outbox {
    map: Arc<Mapping>,
    base: usize,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("owner", &self.map.owner_rank())
            .finish()
    }
}

impl Outbox {
    /// The outbox of a doorbell object; `None` for an object without one.
    pub(super) fn of(map: &Arc<Mapping>) -> Option<Outbox> {
        let layout = map.layout;
        (layout.nslots == 0 && layout.outbox_size >= OUTBOX_BYTES).then(|| Outbox {
            map: Arc::clone(map),
            base: layout.header_size,
        })
    }

    fn slot(k: usize) -> usize {
        O_SLOTS + (k % OUTBOX_SLOTS) * SLOT_STRIDE
    }

    /// The slot a collective with sequence number `seq` uses.
    pub fn slot_of(seq: u64) -> usize {
        (seq % OUTBOX_SLOTS as u64) as usize
    }

    /// The sequence number of the last one-shot collective the owner finished.
    pub fn done(&self) -> u64 {
        self.map.u64_at(self.base + O_DONE).load(Ordering::SeqCst)
    }

    /// For the owner: marks collective `seq` finished (its slot may be written again as far as
    /// this rank is concerned); then [`Outbox::wake`] the others.
    pub fn finish(&self, seq: u64) {
        self.map
            .u64_at(self.base + O_DONE)
            .store(seq, Ordering::SeqCst);
    }

    /// The sequence number slot `k` was last posted with (0: never).
    pub fn posted(&self, k: usize) -> u64 {
        self.map
            .u64_at(self.base + Self::slot(k) + S_POSTED)
            .load(Ordering::Acquire)
    }

    /// Writes `data` with the operation's header into slot `k` and flags it with `seq`. The
    /// caller owns the outbox and knows every reader finished with the slot's last use.
    pub fn post(&self, k: usize, seq: u64, desc: &[u8], data: &[u8]) -> Result<()> {
        if data.len() > OUTBOX_SLOT_BYTES || desc.len() > OUTBOX_HEADER_MAX {
            return Err(TransportError::Config(format!(
                "{} bytes and a header of {} do not fit a one-shot slot of {OUTBOX_SLOT_BYTES} \
                 and {OUTBOX_HEADER_MAX}",
                data.len(),
                desc.len()
            )));
        }
        let at = self.base + Self::slot(k);
        let start = at + S_DATA;
        debug_assert!(start + data.len() <= self.map.raw.len());
        // SAFETY: `start..start + data.len()` lies inside the mapping (the layout holds
        // OUTBOX_BYTES after the header, checked in `of`, and the length was checked above); no
        // reader looks at these bytes until the Release store of `posted` below publishes them,
        // and none still reads the slot's previous contents (the caller's precondition). `data`
        // is caller memory, never the shared mapping, so the regions do not overlap.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.raw.as_mut_ptr().add(start),
                data.len(),
            );
        }
        let mut words = [0u8; OUTBOX_HEADER_MAX];
        words[..desc.len()].copy_from_slice(desc);
        for (i, w) in words.chunks_exact(8).enumerate() {
            let word = u64::from_le_bytes(w.try_into().unwrap_or_default());
            self.map
                .u64_at(at + S_DESC + 8 * i)
                .store(word, Ordering::Relaxed);
        }
        self.map.u64_at(at + S_POSTED).store(seq, Ordering::Release);
        Ok(())
    }

    /// The operation header posted in slot `k` (zero-padded). Call after [`Outbox::posted`]
    /// returned the sequence number expected (its Acquire orders these reads).
    pub fn header(&self, k: usize) -> [u8; OUTBOX_HEADER_MAX] {
        let at = self.base + Self::slot(k);
        let mut words = [0u8; OUTBOX_HEADER_MAX];
        for (i, w) in words.chunks_exact_mut(8).enumerate() {
            let word = self.map.u64_at(at + S_DESC + 8 * i).load(Ordering::Relaxed);
            w.copy_from_slice(&word.to_le_bytes());
        }
        words
    }

    /// Lends the first `len` bytes posted in slot `k` to `read` (at most a slot's). Call after
    /// [`Outbox::posted`] returned the sequence number expected, and before this rank marks that
    /// collective finished.
    pub fn read<R>(&self, k: usize, len: usize, read: impl FnOnce(&[u8]) -> R) -> R {
        let at = self.base + Self::slot(k);
        let len = len.min(OUTBOX_SLOT_BYTES);
        debug_assert!(at + S_DATA + len <= self.map.raw.len());
        // SAFETY: the range lies inside the mapping (length clamped to the slot). Its owner wrote
        // it before the Release store of `posted` that the caller's Acquire load saw, and does
        // not write the slot again until this rank's `done` reaches that sequence number, which
        // this rank stores only after `read` returns: the bytes do not change while lent, and
        // the slice does not outlive this call.
        #[allow(unsafe_code)]
        let bytes =
            unsafe { std::slice::from_raw_parts(self.map.raw.as_ptr().add(at + S_DATA), len) };
        read(bytes)
    }

    /// Wakes the owner if it sleeps, or is about to, in [`Outbox::sleep_unless`]: call after
    /// posting or finishing.
    pub fn wake(&self) {
        self.map.wake_if_sleeping();
    }

    /// For the owner: sleeps for at most `max` unless `ready()`, checked after the owner said it
    /// sleeps, so a post or finish followed by [`Outbox::wake`] is never missed.
    pub fn sleep_unless(&self, max: std::time::Duration, ready: &dyn Fn() -> bool) {
        self.map.sleep_unless(max, ready);
    }
}

/// This rank's outbox and, once connected over shared memory, each peer's; `written[k]` is the
/// sequence number this rank last posted in slot `k`, `seen_done[p]` the latest `done` read from
/// peer `p` (read again only when a slot needs a later one: the line moves on every collective).
#[derive(Debug)]
pub struct Outboxes {
    pub mine: Outbox,
    pub peers: Vec<Option<Outbox>>,
    pub written: [u64; OUTBOX_SLOTS],
    pub seen_done: Vec<u64>,
}

impl Outboxes {
    /// This rank's outbox in a communicator of `nranks`, no peer's yet.
    pub fn new(mine: Outbox, nranks: usize) -> Outboxes {
        Outboxes {
            mine,
            peers: vec![None; nranks],
            written: [0; OUTBOX_SLOTS],
            seen_done: vec![0; nranks],
        }
    }

    /// Whether every rank other than `rank` has its outbox here.
    pub fn complete(&self, rank: usize) -> bool {
        self.peers
            .iter()
            .enumerate()
            .all(|(p, o)| p == rank || o.is_some())
    }
}
