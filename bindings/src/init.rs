//! Creating communicators: the unique id of a job's bootstrap, and a rank made from one (or from
//! the launcher's environment).

use std::ffi::{c_char, c_int};
use std::str::FromStr;

use weftcc_comm::{CommConfig, Communicator, Error, UniqueId};

use crate::boundary::{entry, write_out, Outcome};
use crate::codes::{weftInternalError, weftResult_t};
use crate::errors::{bad_arg, fail, lib_fail};
use crate::handle::{weftComm, weftComm_t};

/// Bytes of a [`weftUniqueId`].
pub const WEFT_UNIQUE_ID_BYTES: usize = 256;

/// Identifies a job's bootstrap: made by [`weftGetUniqueId`] on one process and given, by the
/// program's own means, to every rank (a NUL-terminated text inside).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct weftUniqueId {
    pub internal: [c_char; WEFT_UNIQUE_ID_BYTES],
}

/// Creates a new unique id and starts the job's bootstrap store in this process: call it on the
/// process that will be rank 0, then give the id to the other ranks.
///
/// # Safety
/// `id` is null or points to writable memory for one [`weftUniqueId`].
#[no_mangle]
pub unsafe extern "C" fn weftGetUniqueId(id: *mut weftUniqueId) -> weftResult_t {
    entry(|| {
        let out = id_to_c(&UniqueId::new().map_err(|e| lib_fail(&e))?)?;
        // SAFETY: per the contract.
        unsafe { write_out(id, out, "weftGetUniqueId") }
    })
}

/// A unique id as C carries it (its text, NUL-terminated).
pub(crate) fn id_to_c(uid: &UniqueId) -> Result<weftUniqueId, weftResult_t> {
    let uid = uid.to_string();
    if uid.len() >= WEFT_UNIQUE_ID_BYTES {
        let msg = format!("unique id of {} bytes does not fit", uid.len());
        return Err(fail(weftInternalError, &msg));
    }
    let mut out = weftUniqueId {
        internal: [0; WEFT_UNIQUE_ID_BYTES],
    };
    for (dst, &b) in out.internal.iter_mut().zip(uid.as_bytes()) {
        *dst = b as c_char;
    }
    Ok(out)
}

/// The unique id a C caller passed.
pub(crate) fn id_from_c(id: &weftUniqueId) -> Result<UniqueId, Error> {
    let bytes: Vec<u8> = id
        .internal
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    std::str::from_utf8(&bytes)
        .map_err(|_| Error::Config("unique id is not text".into()))
        .and_then(UniqueId::from_str)
}

/// Creates a communicator with `make` and stores it in `*comm` (checked first, so a bad
/// pointer does not join the job).
///
/// # Safety
/// `comm` is null or writable.
pub(crate) unsafe fn publish(
    comm: *mut weftComm_t,
    make: impl FnOnce() -> Result<Communicator, Error>,
    call: &str,
) -> Outcome {
    if comm.is_null() {
        return Err(bad_arg(format!("{call}: null communicator pointer")));
    }
    let handle = weftComm::into_handle(make().map_err(|e| lib_fail(&e))?);
    // SAFETY: per the contract.
    unsafe { write_out(comm, handle, call) }
}

/// Creates rank `rank` of `nranks` from a unique id (blocks until every rank joined or the
/// timeout passes).
///
/// # Safety
/// `comm` is null or points to writable memory for one handle.
#[no_mangle]
pub unsafe extern "C" fn weftCommInitRank(
    comm: *mut weftComm_t,
    nranks: c_int,
    id: weftUniqueId,
    rank: c_int,
) -> weftResult_t {
    entry(|| {
        let config = CommConfig::from_env().map_err(|e| lib_fail(&e))?;
        // SAFETY: per the contract.
        unsafe { init_rank(comm, nranks, id, rank, config, "weftCommInitRank") }
    })
}

/// The body of [`weftCommInitRank`] and [`weftCommInitRankConfig`].
///
/// # Safety
/// `comm` is null or writable.
pub(crate) unsafe fn init_rank(
    comm: *mut weftComm_t,
    nranks: c_int,
    id: weftUniqueId,
    rank: c_int,
    config: CommConfig,
    call: &str,
) -> Outcome {
    let bad = || bad_arg(format!("{call}: rank {rank} of {nranks}"));
    let n = usize::try_from(nranks).map_err(|_| bad())?;
    let r = usize::try_from(rank).map_err(|_| bad())?;
    if n == 0 || r >= n {
        return Err(bad());
    }
    let make = || id_from_c(&id).and_then(|uid| Communicator::init_with(r, n, &uid, config));
    // SAFETY: per the contract.
    unsafe { publish(comm, make, call) }
}

/// Creates this process's communicator from the launcher's environment (`WEFT_RANK`/`RANK`,
/// `WEFT_WORLD_SIZE`/`WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT` or `WEFT_UNIQUE_ID`, SLURM).
///
/// # Safety
/// `comm` is null or points to writable memory for one handle.
#[no_mangle]
pub unsafe extern "C" fn weftCommInitFromEnv(comm: *mut weftComm_t) -> weftResult_t {
    // SAFETY: per the contract.
    entry(|| unsafe { publish(comm, Communicator::from_env, "weftCommInitFromEnv") })
}
