//! Per-communicator settings from C (`weftConfig_t`, NCCL's `ncclConfig_t` shape) and the init
//! call that takes them.

use std::ffi::c_int;

use weftcc_comm::CommConfig;

use crate::boundary::entry;
use crate::codes::weftResult_t;
use crate::errors::{bad_arg, lib_fail};
use crate::handle::weftComm_t;
use crate::init::{init_rank, weftUniqueId};

/// [`weftConfig_t::magic`]: says the struct was set up with `WEFT_CONFIG_INITIALIZER`.
pub const WEFT_CONFIG_MAGIC: u32 = 0x7765_6674;
/// [`weftConfig_t::version`] of this header.
pub const WEFT_CONFIG_VERSION: u32 = 2;
/// A config field left undefined: the `WEFT_*` variable (or the built-in default) decides.
pub const WEFT_CONFIG_UNDEF_INT: i64 = i64::MIN;

/// Settings of one communicator (NCCL's `ncclConfig_t` shape): start from
/// `weftConfig_t config = WEFT_CONFIG_INITIALIZER;` and set what you need; a field left
/// [`WEFT_CONFIG_UNDEF_INT`] keeps the environment's value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct weftConfig_t {
    /// `sizeof(weftConfig_t)` as the program was compiled: later versions append fields.
    pub size: usize,
    /// [`WEFT_CONFIG_MAGIC`].
    pub magic: u32,
    /// [`WEFT_CONFIG_VERSION`].
    pub version: u32,
    /// Per-operation timeout in milliseconds (`WEFT_TIMEOUT`), at least 1.
    pub timeoutMs: i64,
    /// 1: communicators split from this one share its connections (`WEFT_SPLIT_SHARE`).
    pub splitShare: i64,
    /// 1: deterministic reductions (`WEFT_DETERMINISTIC`): floating-point all-reduce, reduce and
    /// reduce-scatter fold every element in rank order, so results are bitwise identical
    /// whatever the algorithm, slice size, host layout, transport or device. Version 2.
    pub deterministic: i64,
}

/// The size of a version-1 [`weftConfig_t`] (before `deterministic`): programs built against
/// that header keep working.
const CONFIG_V1_BYTES: usize = std::mem::offset_of!(weftConfig_t, deterministic);

/// The communicator settings of `config` (null: the environment's).
///
/// # Safety
/// `config` is null or points to a readable [`weftConfig_t`] of at least the size it states.
unsafe fn config_of(config: *const weftConfig_t) -> Result<CommConfig, weftResult_t> {
    let mut out = CommConfig::from_env().map_err(|e| lib_fail(&e))?;
    if config.is_null() {
        return Ok(out);
    }
    let bad = |what: String| bad_arg(format!("weftConfig_t: {what}"));
    // SAFETY: non-null; the header fields are readable per the contract.
    let (size, magic, version) = unsafe { ((*config).size, (*config).magic, (*config).version) };
    if magic != WEFT_CONFIG_MAGIC {
        return Err(bad(
            "not initialised with WEFT_CONFIG_INITIALIZER (wrong magic)".into(),
        ));
    }
    if version == 0 || version > WEFT_CONFIG_VERSION {
        return Err(bad(format!(
            "version {version}; this library knows 1..={WEFT_CONFIG_VERSION}"
        )));
    }
    let needed = match version {
        1 => CONFIG_V1_BYTES,
        _ => std::mem::size_of::<weftConfig_t>(),
    };
    if size < needed {
        return Err(bad(format!(
            "size {size} is smaller than version {version}'s {needed}"
        )));
    }
    // SAFETY: the version-1 fields are readable (size checked above, per the contract); the
    // fields are read one by one, never beyond what the stated version has.
    let (timeout_ms, split_share) = unsafe { ((*config).timeoutMs, (*config).splitShare) };
    let deterministic = if version >= 2 {
        // SAFETY: version 2 and size at least this struct's: the field is readable.
        unsafe { (*config).deterministic }
    } else {
        WEFT_CONFIG_UNDEF_INT
    };
    let c = weftConfig_t {
        size,
        magic,
        version,
        timeoutMs: timeout_ms,
        splitShare: split_share,
        deterministic,
    };
    if c.timeoutMs != WEFT_CONFIG_UNDEF_INT {
        let ms = u64::try_from(c.timeoutMs)
            .ok()
            .filter(|ms| *ms >= 1)
            .ok_or_else(|| bad(format!("timeoutMs {} is not a positive count", c.timeoutMs)))?;
        out.timeout = std::time::Duration::from_millis(ms);
    }
    match c.splitShare {
        WEFT_CONFIG_UNDEF_INT => {}
        0 | 1 => out.split_share = c.splitShare == 1,
        v => return Err(bad(format!("splitShare {v} is neither 0 nor 1"))),
    }
    match c.deterministic {
        WEFT_CONFIG_UNDEF_INT => {}
        0 | 1 => out.deterministic = c.deterministic == 1,
        v => return Err(bad(format!("deterministic {v} is neither 0 nor 1"))),
    }
    Ok(out)
}

/// [`weftCommInitRank`] with per-communicator settings (`config` null: the environment's).
///
/// # Safety
/// `comm` is null or writable; `config` is null or a readable [`weftConfig_t`].
#[no_mangle]
pub unsafe extern "C" fn weftCommInitRankConfig(
    comm: *mut weftComm_t,
    nranks: c_int,
    id: weftUniqueId,
    rank: c_int,
    config: *const weftConfig_t,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let config = unsafe { config_of(config) }?;
        // SAFETY: per the contract.
        unsafe { init_rank(comm, nranks, id, rank, config, "weftCommInitRankConfig") }
    })
}
