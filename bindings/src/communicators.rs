//! What is done with a communicator once made: split, destroy, abort, and its size, rank and
//! asynchronous error.

use std::ffi::c_int;

use crate::boundary::{comm_ref, entry, handle_ref, write_out};
use crate::codes::{weftResult_t, weftSuccess};
use crate::errors::{bad_arg, cuda_fail, lib_fail};
use crate::groups::drop_calls_of;
use crate::handle::{weftComm, weftComm_t};

/// The `color` that takes part in [`weftCommSplit`] without joining a new communicator.
pub const WEFT_SPLIT_NOCOLOR: c_int = -1;

/// Splits `comm` (collective over it): ranks passing the same non-negative `color` form a new
/// communicator, ranked by (`key`, old rank); a rank passing [`WEFT_SPLIT_NOCOLOR`] gets NULL.
///
/// # Safety
/// `comm` is null or a live handle; `newcomm` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommSplit(
    comm: weftComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut weftComm_t,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        if newcomm.is_null() {
            return Err(bad_arg("weftCommSplit: null output".into()));
        }
        let color = match color {
            WEFT_SPLIT_NOCOLOR => None,
            c => Some(u32::try_from(c).map_err(|_| bad_arg(format!("weftCommSplit: color {c}")))?),
        };
        let made = c.split(color, i64::from(key)).map_err(|e| lib_fail(&e))?;
        let handle = made.map_or(std::ptr::null_mut(), weftComm::into_handle);
        // SAFETY: per the contract.
        unsafe { write_out(newcomm, handle, "weftCommSplit") }
    })
}

/// Destroys a communicator (null is accepted and ignored). Pending group calls of it are
/// dropped.
///
/// # Safety
/// `comm` is null or a live handle, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn weftCommDestroy(comm: weftComm_t) -> weftResult_t {
    entry(|| {
        if !comm.is_null() {
            drop_calls_of(comm);
            // SAFETY: made by Box::into_raw in weftCommInit*, destroyed once per the contract.
            drop(unsafe { Box::from_raw(comm) });
        }
        Ok(weftSuccess)
    })
}

/// Aborts a communicator: calls blocked in it (on any thread) and every later call return
/// `weftAborted`; the other ranks' calls return `weftRemoteError` naming this rank. The handle
/// must still be destroyed.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftCommAbort(comm: weftComm_t) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        // The host communicator first: a device communicator being made (holding the lock)
        // then fails at once instead of holding up this abort.
        h.comm.abort();
        if let Ok(slot) = h.device.try_lock() {
            if let Some(d) = &*slot {
                d.abort();
            }
        }
        Ok(weftSuccess)
    })
}

/// The number of ranks.
///
/// # Safety
/// `comm` is null or a live handle; `count` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommCount(comm: weftComm_t, count: *mut c_int) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let n = unsafe { comm_ref(comm) }?.size() as c_int;
        // SAFETY: per the contract.
        unsafe { write_out(count, n, "weftCommCount") }
    })
}

/// This process's rank.
///
/// # Safety
/// `comm` is null or a live handle; `rank` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommUserRank(comm: weftComm_t, rank: *mut c_int) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let me = unsafe { comm_ref(comm) }?.rank() as c_int;
        // SAFETY: per the contract.
        unsafe { write_out(rank, me, "weftCommUserRank") }
    })
}

/// The error that broke the communicator (`weftSuccess` while it is healthy), like NCCL's
/// `ncclCommGetAsyncError`; its message is then `weftGetLastError`'s.
///
/// # Safety
/// `comm` is null or a live handle; `result` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommGetAsyncError(
    comm: weftComm_t,
    result: *mut weftResult_t,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        // Not waiting for a device communicator being made (it has no error of its own yet).
        let device = h.device.try_lock().ok().and_then(|d| d.clone());
        let code = match (h.comm.error(), device.and_then(|d| d.error())) {
            (Some(e), _) => lib_fail(&e),
            (None, Some(e)) => cuda_fail(&e),
            (None, None) => weftSuccess,
        };
        // SAFETY: per the contract.
        unsafe { write_out(result, code, "weftCommGetAsyncError") }
    })
}
