//! What is done with a communicator once made: split, finalize, destroy, abort, and its size,
//! rank, device and asynchronous error.

use std::ffi::c_int;

use weft::{
    weftCommAbort, weftCommCount, weftCommGetAsyncError, weftCommRevoke, weftCommShrink,
    weftCommSplit, weftCommUserRank, weftComm_t, weftResult_t, weftSuccess,
};

use crate::errors::{bad_arg, bad_usage, check, nccl_code, run, DONE};
use crate::group::{forget, submit};
use crate::handle::{comm_arc, ncclComm, ncclComm_t, take, Raw, State};
use crate::init::{settings_of, Settings};
use crate::types::*;

/// Splits `comm` (collective over it): ranks with the same non-negative `color` form a new
/// communicator ranked by (`key`, old rank); [`NCCL_SPLIT_NOCOLOR`] gets NULL. `config` null:
/// the parent's blocking mode. The split itself runs at once (or at the group's end) in both
/// modes.
///
/// # Safety
/// `comm` is null or live; `newcomm` is null or writable until the call (or its group) ends;
/// `config` is null or a readable `ncclConfig_t`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    let call = "ncclCommSplit";
    run(|| {
        // SAFETY: per the contract.
        let parent = unsafe { comm_arc(comm, call) }?;
        if newcomm.is_null() {
            return Err(bad_arg("ncclCommSplit: null output"));
        }
        let s = if config.is_null() {
            Settings {
                blocking: parent.blocking,
                split_share: None,
            }
        } else {
            // SAFETY: per the contract.
            unsafe { settings_of(config, call) }?
        };
        let (blocking, device, out) = (s.blocking, parent.device, newcomm as usize);
        submit(
            parent,
            call,
            Box::new(move |w: weftComm_t| {
                let mut made: weftComm_t = std::ptr::null_mut();
                // SAFETY: `w` is live (held by the job's reference); `made` a local.
                let r = unsafe { weftCommSplit(w, color, key, &mut made) };
                if r != weftSuccess {
                    return r;
                }
                let handle = if made.is_null() {
                    std::ptr::null_mut()
                } else {
                    ncclComm::publish(ncclComm::new(State::Ready(Raw(made)), blocking, device))
                };
                // SAFETY: writable until the call or its group ended, per the contract.
                unsafe { (out as *mut ncclComm_t).write(handle) };
                weftSuccess
            }),
        )
    })
}

/// Revokes `comm` on every rank (weftcc's `weftCommRevoke`): pending and later operations
/// fail; the communicator stays for `ncclCommShrink`. `revokeFlags` must be
/// `NCCL_REVOKE_DEFAULT` (0).
///
/// # Safety
/// `comm` is null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, "ncclCommRevoke") }?;
        // SAFETY: live while `c` holds it.
        check(unsafe { weftCommRevoke(c.weft("ncclCommRevoke")?, revokeFlags) })
    })
}

/// The communicator of every rank of `comm` except `excludeRanksList`, numbered in order
/// (weftcc's `weftCommShrink`; `NCCL_SHRINK_ABORT` revokes `comm` first). Called by the ranks
/// that stay. `config` null: the parent's blocking mode.
///
/// # Safety
/// `comm` is null or live; `excludeRanksList` is null (with a count of 0) or holds
/// `excludeRanksCount` ints; `newcomm` is null or writable until the call (or its group) ends;
/// `config` is null or a readable `ncclConfig_t`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *mut c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    let call = "ncclCommShrink";
    run(|| {
        // SAFETY: per the contract.
        let parent = unsafe { comm_arc(comm, call) }?;
        if newcomm.is_null() {
            return Err(bad_arg("ncclCommShrink: null output"));
        }
        let n = usize::try_from(excludeRanksCount)
            .map_err(|_| bad_arg("ncclCommShrink: negative exclude count"))?;
        if excludeRanksList.is_null() && n > 0 {
            return Err(bad_arg("ncclCommShrink: null exclude list"));
        }
        let excluded: Vec<c_int> = if n == 0 {
            Vec::new()
        } else {
            // SAFETY: non-null and holding `excludeRanksCount` ints per the contract.
            unsafe { std::slice::from_raw_parts(excludeRanksList, n) }.to_vec()
        };
        let blocking = if config.is_null() {
            parent.blocking
        } else {
            // SAFETY: per the contract.
            unsafe { settings_of(config, call) }?.blocking
        };
        let (device, out) = (parent.device, newcomm as usize);
        submit(
            parent,
            call,
            Box::new(move |w: weftComm_t| {
                let mut made: weftComm_t = std::ptr::null_mut();
                // SAFETY: `w` is live (held by the job's reference); the list and `made` are
                // locals.
                let r = unsafe {
                    weftCommShrink(w, excluded.as_ptr(), n as c_int, &mut made, shrinkFlags)
                };
                if r != weftSuccess {
                    return r;
                }
                let handle =
                    ncclComm::publish(ncclComm::new(State::Ready(Raw(made)), blocking, device));
                // SAFETY: writable until the call or its group ended, per the contract.
                unsafe { (out as *mut ncclComm_t).write(handle) };
                weftSuccess
            }),
        )
    })
}

/// Ends the communicator's work: waits for an init in progress (host operations are complete
/// when their call returns).
///
/// # Safety
/// `comm` is null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, "ncclCommFinalize") }?;
        c.wait_settled();
        DONE
    })
}

/// Destroys a communicator (NULL is accepted): waits for an init in progress; weftcc's
/// communicator goes when no call holds it any more.
///
/// # Safety
/// `comm` is null or live, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        if let Some(c) = unsafe { take(comm) } {
            forget(&c);
            c.wait_settled();
        }
        DONE
    })
}

/// Aborts and frees a communicator: calls blocked in it on other threads return, the other
/// ranks learn of it (`ncclRemoteError` there). An init in progress is left to finish and
/// then destroyed.
///
/// # Safety
/// `comm` is null or live, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        let Some(c) = (unsafe { take(comm) }) else {
            return DONE;
        };
        forget(&c);
        if let Ok(Some(w)) = c.poll() {
            // SAFETY: live while `c` holds it.
            check(unsafe { weftCommAbort(w) })?;
        }
        DONE
    })
}

/// The communicator's error: `ncclInProgress` while a non-blocking init goes on, the init's
/// failure, or weftcc's asynchronous error (`ncclSuccess` while healthy); its message is
/// `ncclGetLastError`'s.
///
/// # Safety
/// `comm` is null or live; `asyncError` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: ncclComm_t,
    asyncError: *mut ncclResult_t,
) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, "ncclCommGetAsyncError") }?;
        if asyncError.is_null() {
            return Err(bad_arg("ncclCommGetAsyncError: null output"));
        }
        let code = match c.poll() {
            Ok(None) => ncclInProgress,
            Ok(Some(w)) => {
                let mut r: weftResult_t = weftSuccess;
                // SAFETY: live while `c` holds it; `r` a local.
                check(unsafe { weftCommGetAsyncError(w, &mut r) })?;
                nccl_code(r)
            }
            Err(failed) => nccl_code(failed),
        };
        // SAFETY: non-null and writable per the contract.
        unsafe { asyncError.write(code) };
        DONE
    })
}

/// The number of ranks.
///
/// # Safety
/// `comm` is null or live; `count` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, "ncclCommCount") }?;
        // SAFETY: live while `c` holds it; `count` per the contract (weftcc checks null).
        check(unsafe { weftCommCount(c.weft("ncclCommCount")?, count) })
    })
}

/// This process's rank.
///
/// # Safety
/// `comm` is null or live; `rank` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, "ncclCommUserRank") }?;
        // SAFETY: live while `c` holds it; `rank` per the contract (weftcc checks null).
        check(unsafe { weftCommUserRank(c.weft("ncclCommUserRank")?, rank) })
    })
}

/// The CUDA device of a communicator made by `ncclCommInitAll` (its `devlist` entry). Others
/// are bound to a device by their first call with a stream, which this call does not know:
/// `ncclInvalidUsage` saying so.
///
/// # Safety
/// `comm` is null or live; `device` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    let call = "ncclCommCuDevice";
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, call) }?;
        c.weft(call)?;
        if device.is_null() {
            return Err(bad_arg("ncclCommCuDevice: null output"));
        }
        let Some(d) = c.device else {
            return Err(bad_usage(
                "ncclCommCuDevice: not known for a communicator made by ncclCommInitRank* or \
                 split from one (weftcc binds its device at the first call with a stream)",
            ));
        };
        // SAFETY: non-null and writable per the contract.
        unsafe { device.write(d) };
        DONE
    })
}
