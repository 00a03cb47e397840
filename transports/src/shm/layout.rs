//! Where everything lies in a shared-memory object: header and ring-control offsets, the
//! low-latency slot geometry, and the sizes of one object ([`Layout`]).

use crate::conn::FAREWELL_MAX;

pub(super) const MAGIC: u64 = 0x5745_4654_5348_4d31; // "WEFTSHM1"
pub(super) const VERSION: u32 = 5;
pub(super) const MAX_SLOTS: usize = 1 << 16;

// Header offsets.
pub(super) const H_MAGIC: usize = 0;
pub(super) const H_VERSION: usize = 8;
pub(super) const H_NSLOTS: usize = 12;
pub(super) const H_CAPACITY: usize = 16;
pub(super) const H_HEADER_SIZE: usize = 24;
pub(super) const H_CTRL_SIZE: usize = 32;
pub(super) const H_TOTAL: usize = 40;
pub(super) const H_PID: usize = 48;
pub(super) const H_RANK: usize = 52;
pub(super) const H_DOORBELL: usize = 64;
pub(super) const H_SLEEPING: usize = 68;
/// Address, in the owner's process, of [`CMA_COOKIE`] (peers read it to test cross-memory attach).
pub(super) const H_CMA_PROBE: usize = 72;
pub(super) const H_SLOTS: usize = 128;

// Ring control offsets.
pub(super) const R_HEAD: usize = 0;
pub(super) const R_TAIL: usize = 64;
pub(super) const R_SENDER_CLOSED: usize = 128;
pub(super) const R_RECEIVER_CLOSED: usize = 192;
pub(super) const R_CMA_OK: usize = 256;
pub(super) const R_REF_HEAD: usize = 320;
pub(super) const R_REF_TAIL: usize = 384;
pub(super) const R_REF_COPIED: usize = 448;
pub(super) const R_REFS: usize = 512;
pub(super) const REF_SLOT_BYTES: usize = 32;
pub(super) const REF_SLOTS: u64 = 4;
pub(super) const R_LL_DONE: usize = 640;
pub(super) const R_LL: usize = 1024;
/// The sender's farewell note: its length (u64, stored last with Release), then its bytes as
/// little-endian words.
pub(super) const R_FAREWELL_LEN: usize = R_LL + LL_SLOTS as usize * LL_SLOT_BYTES;
pub(super) const R_FAREWELL: usize = R_FAREWELL_LEN + 8;
/// Bytes the ring control region needs (rounded up to whole pages in the layout).
pub(super) const CTRL_BYTES: usize = R_FAREWELL + FAREWELL_MAX;

pub(super) const LL_LINE: usize = 64;
pub(super) const LL_SLOT_LINES: usize = 8;
pub(super) const LL_SLOT_BYTES: usize = LL_LINE * LL_SLOT_LINES;
pub(super) const LL_SLOTS: u64 = 8;
/// Data bytes in the first line of a slot (after them: ring position, length, flag).
pub(super) const LL_FIRST_DATA: usize = 48;
/// Data bytes in every further line (after them: the flag).
pub(super) const LL_LINE_DATA: usize = 56;
pub(super) const LL_FLAG: usize = 56;
/// Largest write sent as a low-latency message: 440 bytes (one slot).
pub const LL_MAX: usize = LL_FIRST_DATA + (LL_SLOT_LINES - 1) * LL_LINE_DATA;

/// The host's page size (at least 4 KiB).
pub fn page_size() -> usize {
    // SAFETY: sysconf takes an integer constant and touches no memory.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 && (p as usize).is_power_of_two() {
        (p as usize).max(4096)
    } else {
        4096
    }
}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// Sizes of one segment, computed from its slot count and ring capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// Rings in the segment (one per peer slot).
    pub(super) nslots: usize,
    /// Bytes of each ring's data area.
    pub(super) capacity: usize,
    /// The segment header (slot table included), rounded to pages.
    pub(super) header_size: usize,
    /// Each ring's control page(s) before its data.
    pub(super) ctrl_size: usize,
    /// A doorbell's one-shot outbox after its header ([`super::outbox`]; 0 in ring objects).
    pub(super) outbox_size: usize,
    /// The whole segment.
    pub(super) total: usize,
}

impl Layout {
    pub(super) fn new(nslots: usize, capacity: usize) -> Option<Layout> {
        let page = page_size();
        let header_size = round_up(H_SLOTS + 4 * nslots, page)?;
        let ctrl_size = round_up(CTRL_BYTES, page)?;
        let per = ctrl_size.checked_add(capacity)?;
        let outbox_size = if nslots == 0 {
            round_up(super::outbox::OUTBOX_BYTES, page)?
        } else {
            0
        };
        let total = header_size
            .checked_add(per.checked_mul(nslots)?)?
            .checked_add(outbox_size)?;
        Some(Layout {
            nslots,
            capacity,
            header_size,
            ctrl_size,
            outbox_size,
            total,
        })
    }

    pub(super) fn ring_offset(&self, slot: usize) -> usize {
        self.header_size + slot * (self.ctrl_size + self.capacity)
    }
}

/// The bytes one segment needs for `peers` incoming rings of `capacity` bytes each.
pub fn segment_size(peers: usize, capacity: usize) -> Option<usize> {
    Layout::new(peers, capacity).map(|l| l.total)
}
