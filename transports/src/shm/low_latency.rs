//! Low-latency messages: the pieces of a small write carried in a slot of flagged cache lines
//! (module docs of [`super`]).

use super::layout::{LL_FIRST_DATA, LL_LINE_DATA, LL_MAX};
use crate::error::Result;
use weftcc_settings::SHM_LL_MAX;

/// Largest write a sender posts as a low-latency message: `WEFT_SHM_LL_MAX` bytes, clamped to
/// [`LL_MAX`] (the default); 0 sends every write through the ring. Receivers always accept them.
pub fn ll_max_bytes() -> Result<usize> {
    Ok(SHM_LL_MAX.size()?.map_or(LL_MAX, |v| v.min(LL_MAX)))
}

/// Lines a low-latency message of `len` bytes occupies.
pub(super) fn ll_lines(len: usize) -> usize {
    1 + len.saturating_sub(LL_FIRST_DATA).div_ceil(LL_LINE_DATA)
}

/// Where line `line` of a low-latency message of `len` bytes starts in the message, and how
/// many of its bytes it carries.
pub(super) fn ll_line_span(line: usize, len: usize) -> (usize, usize) {
    let (start, room) = if line == 0 {
        (0, LL_FIRST_DATA)
    } else {
        (LL_FIRST_DATA + (line - 1) * LL_LINE_DATA, LL_LINE_DATA)
    };
    (start, room.min(len - start))
}

pub(super) const LL_STAGE_WORDS: usize = LL_MAX.div_ceil(8);

/// The next low-latency message, as the receiver sees it in its slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct LlFront {
    pub(super) ring_pos: u64,
    pub(super) len: usize,
    /// Every line of it has arrived (the sender may still be writing the others).
    pub(super) complete: bool,
}
