//! Surviving a lost rank, in NCCL's shapes (`ncclCommRevoke`, `ncclCommShrink`,
//! `ncclCommGetUniqueId`, `ncclCommGrow`) plus the agreement NCCL leaves to the application:
//! revoke a communicator, agree on the failed ranks, shrink to the survivors, grow by newcomers.

use std::ffi::c_int;

use crate::boundary::{comm_ref, entry, write_out};
use crate::codes::{weftInvalidUsage, weftResult_t, weftSuccess};
use crate::errors::{bad_arg, fail, lib_fail};
use crate::handle::{weftComm, weftComm_t};
use crate::init::{id_from_c, id_to_c, publish, weftUniqueId};
use weftcc_comm::{CommConfig, Communicator};

/// `weftCommShrink` flags: shrink the communicator as it is (it may have failed or been revoked).
pub const WEFT_SHRINK_DEFAULT: c_int = 0;
/// `weftCommShrink` flags: revoke the communicator first (ending its operations on every rank).
pub const WEFT_SHRINK_ABORT: c_int = 1;
/// `weftCommRevoke` flags: the only value.
pub const WEFT_REVOKE_DEFAULT: c_int = 0;

/// Revokes `comm` on every rank: each pending and later operation returns an error
/// (`weftInvalidUsage` here, `weftRemoteError` on the others); the communicator stays for
/// `weftCommAgree` and `weftCommShrink`. `flags` must be `WEFT_REVOKE_DEFAULT`.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftCommRevoke(comm: weftComm_t, flags: c_int) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        if flags != WEFT_REVOKE_DEFAULT {
            return Err(bad_arg(format!("weftCommRevoke: flags {flags}")));
        }
        c.revoke();
        Ok(weftSuccess)
    })
}

/// Agrees with the other survivors of `comm` on its failed ranks: writes them (ascending) to
/// `failed` (room for `capacity`), their number to `*count` and the agreement's epoch to
/// `*epoch` (either may be null). Every survivor that calls it gets the same set. More failed
/// ranks than `capacity`: `weftInvalidArgument`, with `*count` set to the number needed.
///
/// # Safety
/// `comm` is null or a live handle; `failed` is null (with `capacity` 0) or has room for
/// `capacity` ints; `count` and `epoch` are null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommAgree(
    comm: weftComm_t,
    failed: *mut c_int,
    capacity: c_int,
    count: *mut c_int,
    epoch: *mut u64,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        let room = usize::try_from(capacity)
            .map_err(|_| bad_arg(format!("weftCommAgree: capacity {capacity}")))?;
        if failed.is_null() && room > 0 {
            return Err(bad_arg("weftCommAgree: null rank list".into()));
        }
        let agreed = c.agree_on_failures().map_err(|e| lib_fail(&e))?;
        let n = c_int::try_from(agreed.failed.len()).unwrap_or(c_int::MAX);
        if !count.is_null() {
            // SAFETY: per the contract.
            unsafe { write_out(count, n, "weftCommAgree") }?;
        }
        if !epoch.is_null() {
            // SAFETY: per the contract.
            unsafe { write_out(epoch, agreed.epoch, "weftCommAgree") }?;
        }
        if agreed.failed.len() > room {
            return Err(bad_arg(format!(
                "weftCommAgree: {} failed ranks, room for {room}",
                agreed.failed.len()
            )));
        }
        for (i, &r) in agreed.failed.iter().enumerate() {
            // SAFETY: i < capacity, and `failed` has room for `capacity` ints per the contract.
            unsafe {
                failed
                    .add(i)
                    .write(c_int::try_from(r).unwrap_or(c_int::MAX))
            };
        }
        Ok(weftSuccess)
    })
}

/// The communicator of every rank of `comm` except the `count` ranks of `exclude`, numbered in
/// order, in `*newcomm`; called by every rank not excluded (an excluded caller gets
/// `weftInvalidUsage`). `flags`: `WEFT_SHRINK_DEFAULT`, or `WEFT_SHRINK_ABORT` to revoke `comm`
/// first. A survivor dying meanwhile fails it on every survivor (`weftSystemError`): agree
/// again and shrink again.
///
/// # Safety
/// `comm` is null or a live handle; `exclude` is null (with `count` 0) or holds `count` ints;
/// `newcomm` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommShrink(
    comm: weftComm_t,
    exclude: *const c_int,
    count: c_int,
    newcomm: *mut weftComm_t,
    flags: c_int,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        let n = usize::try_from(count)
            .map_err(|_| bad_arg(format!("weftCommShrink: count {count}")))?;
        if exclude.is_null() && n > 0 {
            return Err(bad_arg("weftCommShrink: null exclude list".into()));
        }
        let ranks: &[c_int] = if n == 0 {
            &[]
        } else {
            // SAFETY: non-null and holding `count` ints per the contract.
            unsafe { std::slice::from_raw_parts(exclude, n) }
        };
        let excluded = ranks
            .iter()
            .map(|&r| usize::try_from(r).map_err(|_| bad_arg(format!("weftCommShrink: rank {r}"))))
            .collect::<Result<Vec<usize>, _>>()?;
        match flags {
            WEFT_SHRINK_DEFAULT => {}
            WEFT_SHRINK_ABORT => c.revoke(),
            other => return Err(bad_arg(format!("weftCommShrink: flags {other}"))),
        }
        // SAFETY: per the contract.
        unsafe { publish(newcomm, || c.shrink(&excluded), "weftCommShrink") }
    })
}

/// The id a newcomer passes to `weftCommGrow` to join `comm`'s job (its store's address and
/// token).
///
/// # Safety
/// `comm` is null or a live handle; `id` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommGetUniqueId(
    comm: weftComm_t,
    id: *mut weftUniqueId,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        let out = id_to_c(&c.unique_id())?;
        // SAFETY: per the contract.
        unsafe { write_out(id, out, "weftCommGetUniqueId") }
    })
}

/// Grows a communicator to `nranks` ranks, NCCL's way: every rank of `comm` calls it with
/// `rank` -1 (`id` ignored) and keeps its rank; each newcomer calls it with `comm` NULL, the id
/// from `weftCommGetUniqueId`, and the rank it expects (or -1 for the next place: newcomers take
/// the ranks after the existing ones in the order they asked). A newcomer whose place is not the
/// rank it passed gets `weftInvalidUsage`.
///
/// # Safety
/// `comm` is null or a live handle; `id` is null or readable; `newcomm` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommGrow(
    comm: weftComm_t,
    nranks: c_int,
    id: *const weftUniqueId,
    rank: c_int,
    newcomm: *mut weftComm_t,
) -> weftResult_t {
    entry(|| {
        if newcomm.is_null() {
            return Err(bad_arg("weftCommGrow: null output".into()));
        }
        if !comm.is_null() {
            // SAFETY: per the contract.
            let c = unsafe { comm_ref(comm) }?;
            let joining = usize::try_from(nranks)
                .ok()
                .and_then(|n| n.checked_sub(c.size()))
                .filter(|_| rank == -1)
                .ok_or_else(|| {
                    bad_arg(format!(
                        "weftCommGrow: {nranks} ranks, rank {rank} (existing ranks pass -1 and at least their {})",
                        c.size()
                    ))
                })?;
            // SAFETY: per the contract.
            return unsafe { publish(newcomm, || c.grow(joining), "weftCommGrow") };
        }
        if id.is_null() || rank < -1 {
            return Err(bad_arg(format!(
                "weftCommGrow: a newcomer needs the id and its rank or -1 (got rank {rank})"
            )));
        }
        // SAFETY: non-null and readable per the contract.
        let uid = id_from_c(unsafe { &*id }).map_err(|e| lib_fail(&e))?;
        let config = CommConfig::from_env().map_err(|e| lib_fail(&e))?;
        let made = Communicator::join_grown(&uid, config).map_err(|e| lib_fail(&e))?;
        let wrong = (rank >= 0 && usize::try_from(rank).ok() != Some(made.rank()))
            || usize::try_from(nranks).ok() != Some(made.size());
        if wrong {
            let msg = format!(
                "weftCommGrow: the newcomer's place is rank {} of {}, not rank {rank} of {nranks}",
                made.rank(),
                made.size()
            );
            return Err(fail(weftInvalidUsage, &msg));
        }
        // SAFETY: per the contract.
        unsafe { write_out(newcomm, weftComm::into_handle(made), "weftCommGrow") }
    })
}
