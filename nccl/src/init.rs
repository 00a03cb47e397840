//! Making communicators: the version, unique ids, `ncclConfig_t`, and the init calls.

use std::ffi::c_int;
use std::mem::{offset_of, size_of};

use weft::{
    weftCommInitRankConfig, weftComm_t, weftConfig_t, weftGetUniqueId, weftInternalError,
    weftUniqueId, WEFT_CONFIG_MAGIC, WEFT_CONFIG_UNDEF_INT, WEFT_CONFIG_VERSION,
    WEFT_UNIQUE_ID_BYTES,
};

use crate::errors::{bad_arg, check, fail, run, Failure, Outcome, DONE};
use crate::group::{in_group, submit_init, together, Make, Task};
use crate::handle::{ncclComm, ncclComm_t, Raw, State};
use crate::types::*;

/// Writes the NCCL version this library reports ([`NCCL_REPORTED_VERSION`]).
///
/// # Safety
/// `version` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    run(|| {
        if version.is_null() {
            return Err(bad_arg("ncclGetVersion: null pointer"));
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { version.write(NCCL_REPORTED_VERSION) };
        DONE
    })
}

/// A new unique id (weftcc's, as text), its bootstrap store started in this process: call it
/// on the process that will be rank 0.
///
/// # Safety
/// `uniqueId` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    run(|| {
        if uniqueId.is_null() {
            return Err(bad_arg("ncclGetUniqueId: null pointer"));
        }
        let mut weft_id = weftUniqueId {
            internal: [0; WEFT_UNIQUE_ID_BYTES],
        };
        // SAFETY: a local, writable.
        check(unsafe { weftGetUniqueId(&mut weft_id) })?;
        let len = weft_id.internal.iter().take_while(|&&c| c != 0).count();
        if len >= NCCL_UNIQUE_ID_BYTES {
            return Err(fail(
                weftInternalError,
                &format!(
                    "ncclGetUniqueId: weftcc's unique id of {len} bytes does not fit NCCL's 128"
                ),
            ));
        }
        let mut id = ncclUniqueId {
            internal: [0; NCCL_UNIQUE_ID_BYTES],
        };
        id.internal
            .copy_from_slice(&weft_id.internal[..NCCL_UNIQUE_ID_BYTES]);
        // SAFETY: non-null and writable per the contract.
        unsafe { uniqueId.write(id) };
        DONE
    })
}

/// What this library takes from an `ncclConfig_t`.
pub(crate) struct Settings {
    pub(crate) blocking: bool,
    pub(crate) split_share: Option<bool>,
}

/// Reads `config` (null: NCCL's defaults, blocking), each field only when the caller's struct
/// (its `size`, from an older or newer header) holds it.
///
/// # Safety
/// `config` is null or points to a readable `ncclConfig_t` of at least the size it states.
pub(crate) unsafe fn settings_of(
    config: *const ncclConfig_t,
    call: &str,
) -> Result<Settings, weft::weftResult_t> {
    let mut s = Settings {
        blocking: true,
        split_share: None,
    };
    if config.is_null() {
        return Ok(s);
    }
    let bad = |what: String| bad_arg(&format!("{call}: ncclConfig_t: {what}"));
    // SAFETY: non-null; `size` and `magic` lead every version of the struct.
    let (size, magic) = unsafe { ((*config).size, (*config).magic) };
    if magic != NCCL_API_MAGIC {
        return Err(bad(format!(
            "magic {magic:#x}, not set up with NCCL_CONFIG_INITIALIZER"
        )));
    }
    let holds = |offset: usize| offset + size_of::<c_int>() <= size;
    if !holds(offset_of!(ncclConfig_t, blocking)) {
        return Err(bad(format!(
            "size {size} is too small for any NCCL version"
        )));
    }
    // SAFETY: the struct holds `blocking` (checked above).
    let blocking = unsafe { (*config).blocking };
    s.blocking = match blocking {
        NCCL_CONFIG_UNDEF_INT | 1 => true,
        0 => false,
        v => return Err(bad(format!("blocking {v} is neither 0 nor 1"))),
    };
    if holds(offset_of!(ncclConfig_t, splitShare)) {
        // SAFETY: the struct holds `splitShare` (its size says so).
        s.split_share = match unsafe { (*config).splitShare } {
            NCCL_CONFIG_UNDEF_INT => None,
            0 => Some(false),
            1 => Some(true),
            v => return Err(bad(format!("splitShare {v} is neither 0 nor 1"))),
        };
    }
    Ok(s)
}

/// weftcc's unique id holding NCCL's.
fn weft_id(id: &ncclUniqueId) -> weftUniqueId {
    let mut w = weftUniqueId {
        internal: [0; WEFT_UNIQUE_ID_BYTES],
    };
    w.internal[..NCCL_UNIQUE_ID_BYTES].copy_from_slice(&id.internal);
    w
}

/// Makes rank `rank` of `nranks` (run now, in a group's end, or on an init thread).
fn make_rank(
    nranks: c_int,
    id: weftUniqueId,
    rank: c_int,
    split_share: Option<bool>,
    call: &'static str,
) -> Make {
    Box::new(move || {
        let config = weftConfig_t {
            size: size_of::<weftConfig_t>(),
            magic: WEFT_CONFIG_MAGIC,
            version: WEFT_CONFIG_VERSION,
            timeoutMs: WEFT_CONFIG_UNDEF_INT,
            splitShare: split_share.map_or(WEFT_CONFIG_UNDEF_INT, i64::from),
            deterministic: WEFT_CONFIG_UNDEF_INT,
        };
        let mut made: weftComm_t = std::ptr::null_mut();
        // SAFETY: `made` and `config` are locals.
        let r = unsafe { weftCommInitRankConfig(&mut made, nranks, id, rank, &config) };
        if r == weft::weftSuccess {
            Ok(Raw(made))
        } else {
            let f = Failure::here(r);
            Err(Failure {
                msg: format!("{call}: {}", f.msg),
                ..f
            })
        }
    })
}

/// The body of the init calls.
///
/// # Safety
/// `comm` is null or writable; `config` as [`settings_of`].
unsafe fn init(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    config: *const ncclConfig_t,
    call: &'static str,
) -> Outcome {
    if comm.is_null() {
        return Err(bad_arg(&format!("{call}: null communicator pointer")));
    }
    // SAFETY: per the contract.
    let s = unsafe { settings_of(config, call) }?;
    let handle = ncclComm::new(State::Pending, s.blocking, None);
    let make = make_rank(nranks, weft_id(id), rank, s.split_share, call);
    // Grouped or non-blocking: the handle exists before the communicator (NCCL's semantics).
    let early = in_group() || !s.blocking;
    if early {
        // SAFETY: non-null and writable per the contract.
        unsafe { comm.write(ncclComm::publish(handle.clone())) };
    }
    let made = submit_init(handle.clone(), make)?;
    if !early {
        // SAFETY: as above.
        unsafe { comm.write(ncclComm::publish(handle)) };
    }
    Ok(made)
}

/// Rank `rank` of `nranks` from a unique id (every rank calls it; blocks until all joined).
///
/// # Safety
/// `comm` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    let call = "ncclCommInitRank";
    // SAFETY: per the contract.
    run(|| unsafe { init(comm, nranks, &commId, rank, std::ptr::null(), call) })
}

/// [`ncclCommInitRank`] with a config (`blocking = 0`: returns `ncclInProgress` at once, the
/// communicator made on a thread of its own).
///
/// # Safety
/// `comm` is null or writable; `config` is null or a readable `ncclConfig_t`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    let call = "ncclCommInitRankConfig";
    // SAFETY: per the contract.
    run(|| unsafe { init(comm, nranks, &commId, rank, config, call) })
}

/// NCCL 2.23's init from several unique ids: weftcc needs one, the first (every rank passes
/// the same list).
///
/// # Safety
/// `newcomm` is null or writable; `commIds` null or `nId` readable ids; `config` as above.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    nId: c_int,
    commIds: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    let call = "ncclCommInitRankScalable";
    run(|| {
        if commIds.is_null() || nId < 1 {
            return Err(bad_arg(&format!("{call}: {nId} unique ids at {commIds:?}")));
        }
        // SAFETY: at least one readable id per the contract.
        let id = unsafe { *commIds };
        // SAFETY: per the contract.
        unsafe { init(newcomm, nranks, &id, myrank, config, call) }
    })
}

/// `ndev` ranks of a new job in this process, made together (rank i on `devlist[i]`, or
/// device i when `devlist` is null).
///
/// # Safety
/// `comm` is null or writable for `ndev` handles; `devlist` is null or readable for `ndev`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comm: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    let call = "ncclCommInitAll";
    run(|| {
        let n = usize::try_from(ndev).unwrap_or(0);
        if comm.is_null() || n == 0 {
            return Err(bad_arg(&format!("{call}: {ndev} devices into {comm:?}")));
        }
        let mut id = weftUniqueId {
            internal: [0; WEFT_UNIQUE_ID_BYTES],
        };
        // SAFETY: a local, writable.
        check(unsafe { weftGetUniqueId(&mut id) })?;
        let handles: Vec<_> = (0..ndev)
            .map(|i| {
                let device = if devlist.is_null() {
                    i
                } else {
                    // SAFETY: readable for ndev entries per the contract.
                    unsafe { *devlist.add(i as usize) }
                };
                ncclComm::new(State::Pending, true, Some(device))
            })
            .collect();
        let makes: Vec<Task> = handles
            .iter()
            .zip(0..)
            .map(|(h, rank)| -> Task {
                let h = h.clone();
                let make = make_rank(ndev, id, rank, None, call);
                Box::new(move || {
                    let made = crate::group::run_make(make);
                    let failed = made.as_ref().err().cloned();
                    h.settle(made);
                    failed
                })
            })
            .collect();
        let failures = together(makes);
        if let Some(f) = failures.into_iter().flatten().next() {
            // The ranks made are destroyed with their handles.
            return Err(f.raise());
        }
        for (i, h) in handles.into_iter().enumerate() {
            // SAFETY: writable for ndev handles per the contract.
            unsafe { comm.add(i).write(ncclComm::publish(h)) };
        }
        DONE
    })
}
