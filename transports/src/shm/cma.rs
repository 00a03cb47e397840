//! Single copy by cross-memory attach: the pieces of a write sent by reference (module docs of
//! [`super`]).

use super::layout::MAGIC;
use crate::error::Result;
use nix::errno::Errno;
use weftcc_settings::{SHM_CMA, SHM_CMA_MIN};

/// What peers read out of this process to prove that `process_vm_readv` works.
pub(super) static CMA_COOKIE: u64 = MAGIC ^ 0x00c0_ffee_00c0_ffee;
/// Default smallest write sent by reference (`WEFT_SHM_CMA_MIN`).
pub const DEFAULT_CMA_MIN: usize = 64 << 10;
/// Staging for references the receiver lends to a reduction (one slice's worth).
pub(super) const CMA_STAGE_BYTES: usize = 256 << 10;

/// Smallest write sent by reference instead of through the ring: `WEFT_SHM_CMA_MIN` bytes
/// (default [`DEFAULT_CMA_MIN`]); `None` when `WEFT_SHM_CMA=0` disables single copy.
pub fn cma_min_bytes() -> Result<Option<usize>> {
    if !SHM_CMA.flag_or(true)? {
        return Ok(None);
    }
    Ok(Some(SHM_CMA_MIN.size()?.unwrap_or(DEFAULT_CMA_MIN).max(8)))
}
/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst`; returns how many were copied.
pub(super) fn cma_read(pid: i32, addr: u64, dst: &mut [u8]) -> std::result::Result<usize, Errno> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    use std::io::IoSliceMut;
    let len = dst.len();
    let remote = [RemoteIoVec {
        base: addr as usize,
        len,
    }];
    crate::util::retry_interrupted(|| {
        process_vm_readv(
            nix::unistd::Pid::from_raw(pid),
            &mut [IoSliceMut::new(&mut *dst)],
            &remote,
        )
    })
}
/// A write being sent by reference.
#[derive(Debug, Clone, Copy)]
pub(super) struct OutRef {
    /// The write's first byte in this process, and its bytes sent by reference.
    pub(super) addr: usize,
    pub(super) len: usize,
    /// Bytes of the write after the reference (fewer than 8; they follow through the ring).
    pub(super) tail: usize,
    /// Bytes already reported accepted to the caller.
    pub(super) reported: usize,
    /// The peer's all-references copy counter when this reference's first byte is copied.
    pub(super) base: u64,
}

/// A reference as the receiver reads it.
#[derive(Debug, Clone, Copy)]
pub(super) struct InRef {
    pub(super) ring_pos: u64,
    pub(super) addr: u64,
    pub(super) len: u64,
}
