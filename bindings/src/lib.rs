//! The C ABI of weftcc: `libweft.so` / `libweft.a` and the header `include/weftcc.h`
//! (generated from this file by cbindgen; `tests/header.rs` fails when it is stale).
//!
//! It follows NCCL's API shape so that porting is a rename: an opaque communicator created from
//! a unique id (`weftGetUniqueId` on one process, shared by the program, then
//! `weftCommInitRank` on every rank) or from the launcher's environment (`weftCommInitFromEnv`:
//! `weft run`, torchrun, SLURM); collectives with NCCL's argument order and in-place
//! conventions; `weftSend`/`weftRecv` between `weftGroupStart`/`weftGroupEnd`; a result code
//! per call and `weftGetLastError` for the message. Data types and reduction operations use
//! NCCL's numbering.
//!
//! Every collective and send/recv takes a last `weftStream_t` (NCCL's `cudaStream_t`): NULL for
//! host buffers, the call then blocking until the operation completed on this rank (the host
//! communicator's semantics); a stream for device buffers, the call enqueuing the operation on
//! it (`weftcc-cuda`'s `DeviceComm`, made by the first such call on the buffer's GPU, over CUDA
//! IPC, staged, or both across hosts). The library always has the device path: libcuda is
//! loaded at run time, and without it a call with a stream returns `weftUnhandledCudaError`.
//!
//! Every entry point rejects null pointers, unknown types, operations and ranks, and
//! overlapping buffers with `weftInvalidArgument` instead of crashing; a Rust panic never
//! crosses the boundary (it becomes `weftInternalError`).

// The exported names are C's (NCCL's style): `weftResult_t`, `weftSuccess`, `weftAllReduce`.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::str::FromStr;
use std::sync::Arc;
use weftcc_collectives::{CallError, DataType, OpKind, RawOp, ReduceOp};
use weftcc_comm::{CommConfig, Communicator, Error, ErrorFacts, SeenBy, UniqueId};
use weftcc_cuda::{Context, CudaError, DeviceComm, Stream};

/// Result of every call (NCCL's codes 0–7, then weftcc's own). The three enumerations are plain
/// `int`s with named values, so a value C passes in that is not one of them is an error, not
/// undefined behaviour.
pub type weftResult_t = c_int;
pub const weftSuccess: weftResult_t = 0;
pub const weftUnhandledCudaError: weftResult_t = 1;
/// The operating system or a transport failed (sockets, shared memory, bootstrap).
pub const weftSystemError: weftResult_t = 2;
/// A bug in weftcc (an invariant broke, or a panic was caught).
pub const weftInternalError: weftResult_t = 3;
/// A bad argument: null pointer, unknown type or operation, rank, root or peer out of range,
/// overlapping buffers. Nothing was sent; the communicator stays usable.
pub const weftInvalidArgument: weftResult_t = 4;
/// A call out of order (group calls unbalanced).
pub const weftInvalidUsage: weftResult_t = 5;
/// Another rank failed, died, timed out, aborted or called a different collective; this rank
/// learnt of it (the message names that rank and what happened there).
pub const weftRemoteError: weftResult_t = 6;
pub const weftInProgress: weftResult_t = 7;
/// An operation of this rank made no progress within the timeout (`WEFT_TIMEOUT`, or the
/// config's `timeoutMs`); the message names the ranks that are behind.
pub const weftTimeout: weftResult_t = 8;
/// `weftCommAbort` was called on this communicator (on this rank; another rank's abort is a
/// `weftRemoteError` here).
pub const weftAborted: weftResult_t = 9;

/// Element types (NCCL's numbering).
pub type weftDataType_t = c_int;
pub const weftInt8: weftDataType_t = 0;
pub const weftUint8: weftDataType_t = 1;
pub const weftInt32: weftDataType_t = 2;
pub const weftUint32: weftDataType_t = 3;
pub const weftInt64: weftDataType_t = 4;
pub const weftUint64: weftDataType_t = 5;
pub const weftFloat16: weftDataType_t = 6;
pub const weftFloat32: weftDataType_t = 7;
pub const weftFloat64: weftDataType_t = 8;
pub const weftBfloat16: weftDataType_t = 9;

/// Reduction operations (NCCL's numbering).
pub type weftRedOp_t = c_int;
pub const weftSum: weftRedOp_t = 0;
pub const weftProd: weftRedOp_t = 1;
pub const weftMax: weftRedOp_t = 2;
pub const weftMin: weftRedOp_t = 3;
pub const weftAvg: weftRedOp_t = 4;
/// The number of built-in reductions; [`weftRedOpCreatePreMulSum`] hands out codes from here.
pub const weftNumOps: weftRedOp_t = 5;

/// Operations named by [`weftErrorInfo_t::op`] (weftcc's wire codes; 0: none).
pub type weftOpKind_t = c_int;
pub const weftOpNone: weftOpKind_t = 0;
pub const weftOpAllReduce: weftOpKind_t = 1;
pub const weftOpReduce: weftOpKind_t = 2;
pub const weftOpBroadcast: weftOpKind_t = 3;
pub const weftOpAllGather: weftOpKind_t = 4;
pub const weftOpReduceScatter: weftOpKind_t = 5;
pub const weftOpAllToAll: weftOpKind_t = 6;
pub const weftOpSendRecv: weftOpKind_t = 7;
pub const weftOpBarrier: weftOpKind_t = 8;

/// The facts of this thread's last failed call as fields ([`weftGetLastErrorInfo`]), so a
/// program or a language binding need not parse [`weftGetLastError`]'s message. A field the
/// error does not say is -1 ([`weftOpNone`] for `op`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct weftErrorInfo_t {
    /// `sizeof(weftErrorInfo_t)` as the program was compiled: set it before the call (later
    /// versions append fields).
    pub size: usize,
    /// The failed call's result code (`weftSuccess` when this thread had no failure).
    pub result: weftResult_t,
    /// The rank that reported the error (this process's rank in that communicator).
    pub rank: c_int,
    /// The other rank the error is about: the peer lost, mismatched or failing on the wire, the
    /// rank that aborted or failed first, or (a timeout) the rank furthest behind.
    pub peer: c_int,
    /// The operation ([`weftOpKind_t`]).
    pub op: weftOpKind_t,
    /// The operation's sequence number on the communicator (point-to-point: between the pair).
    pub seq: i64,
}

/// Where a [`weftRedOpCreatePreMulSum`] scalar lives (NCCL's `ncclScalarResidence_t`).
pub type weftScalarResidence_t = c_int;
/// In device memory: read by the GPU when the operation runs (needs the CUDA path).
pub const weftScalarDevice: weftScalarResidence_t = 0;
/// In host memory, read once when the reduction is created.
pub const weftScalarHostImmediate: weftScalarResidence_t = 1;

/// The C API's version: 2 since every collective and `weftSend`/`weftRecv` take a trailing
/// [`weftStream_t`] (version 1 had none). A program checks that the library it runs with is the
/// one it was compiled for: `int v; weftGetVersion(&v); v == WEFT_API_VERSION`.
pub const WEFT_API_VERSION: c_int = 2;

/// Writes [`WEFT_API_VERSION`] of this library (NCCL's `ncclGetVersion`).
///
/// # Safety
/// `version` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftGetVersion(version: *mut c_int) -> weftResult_t {
    // SAFETY: per the contract.
    entry(|| unsafe { write_out(version, WEFT_API_VERSION, "weftGetVersion") })
}

/// Bytes of a [`weftUniqueId`].
pub const WEFT_UNIQUE_ID_BYTES: usize = 256;

/// Identifies a job's bootstrap: made by [`weftGetUniqueId`] on one process and given, by the
/// program's own means, to every rank (a NUL-terminated text inside).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct weftUniqueId {
    pub internal: [c_char; WEFT_UNIQUE_ID_BYTES],
}

/// A communicator (opaque).
pub struct weftComm {
    comm: Communicator,
    /// Scalars of the reductions made by [`weftRedOpCreatePreMulSum`], by `op - weftNumOps`;
    /// `None` once destroyed.
    premul: std::sync::Mutex<Vec<Option<f64>>>,
    /// The device communicator behind calls with a stream, made by the first of them.
    device: std::sync::Mutex<Option<Arc<DeviceComm>>>,
}

/// A `cudaStream_t` (equally a driver `CUstream`) of the buffers' device. NULL: the buffers are
/// host memory and the call returns once the operation completed on this rank. Otherwise the
/// buffers are device memory and the call enqueues the operation on the stream and returns
/// (NCCL's semantics): work enqueued on the stream afterwards sees the result; errors of the
/// operation itself are reported by [`weftCommGetAsyncError`].
pub type weftStream_t = *mut c_void;

/// Handle to a communicator.
pub type weftComm_t = *mut weftComm;

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The facts of this thread's last failed call.
    static LAST_INFO: std::cell::Cell<weftErrorInfo_t> = const { std::cell::Cell::new(NO_ERROR_INFO) };
    /// Point-to-point calls collected between weftGroupStart and weftGroupEnd.
    static GROUP: RefCell<GroupState> = RefCell::new(GroupState::default());
}

#[derive(Default)]
struct GroupState {
    depth: usize,
    ops: Vec<P2p>,
}

/// One deferred send or receive.
struct P2p {
    comm: weftComm_t,
    send: bool,
    ptr: usize,
    bytes: usize,
    peer: usize,
    /// The caller's `weftStream_t` (0: host buffers).
    stream: usize,
}

/// Bytes of the first [`weftErrorInfo_t`] (this header's): the least a caller may pass.
const ERROR_INFO_V1_BYTES: usize = std::mem::size_of::<weftErrorInfo_t>();

const NO_ERROR_INFO: weftErrorInfo_t = weftErrorInfo_t {
    size: std::mem::size_of::<weftErrorInfo_t>(),
    result: weftSuccess,
    rank: -1,
    peer: -1,
    op: weftOpNone,
    seq: -1,
};

/// Records a failure: its message and, as fields, its facts.
fn record(code: weftResult_t, msg: &str, facts: ErrorFacts) -> weftResult_t {
    let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
    let rank = |r: Option<usize>| r.and_then(|r| c_int::try_from(r).ok()).unwrap_or(-1);
    LAST_INFO.with(|i| {
        i.set(weftErrorInfo_t {
            result: code,
            rank: rank(facts.rank),
            peer: rank(facts.peer),
            op: facts.op.map_or(weftOpNone, |k| c_int::from(k as u8)),
            seq: facts.seq.and_then(|s| i64::try_from(s).ok()).unwrap_or(-1),
            ..NO_ERROR_INFO
        })
    });
    code
}

/// A failure found at the C boundary (its message says what it knows).
fn fail(code: weftResult_t, msg: &str) -> weftResult_t {
    record(code, msg, ErrorFacts::default())
}

/// A library error: its code, message and facts.
fn lib_fail(e: &Error) -> weftResult_t {
    record(code_of(e), &e.to_string(), e.facts())
}

/// The result code of a library error.
fn code_of(e: &Error) -> weftResult_t {
    match e {
        Error::InvalidArgument { .. } | Error::Config(_) => weftInvalidArgument,
        // What this rank saw itself, or weftCommAbort called here; another rank's failure, its
        // timeout or its abort, learnt through the job, is a remote error.
        Error::Timeout {
            seen_by: SeenBy::ThisRank | SeenBy::Watcher,
            ..
        } => weftTimeout,
        Error::Aborted { by: None, .. } => weftAborted,
        Error::Timeout { .. }
        | Error::Aborted { .. }
        | Error::PeerLost { .. }
        | Error::Mismatch { .. } => weftRemoteError,
        Error::Transport { .. } | Error::Bootstrap { .. } => weftSystemError,
        Error::Internal { .. } => weftInternalError,
    }
}

/// The result code of a device-path error.
fn cuda_code(e: &CudaError) -> weftResult_t {
    match e {
        CudaError::InvalidArgument { .. } => weftInvalidArgument,
        CudaError::Host(e) => code_of(e),
        CudaError::Timeout { .. } => weftTimeout,
        // The first failure of the communicator (a peer's included) or an operation's.
        CudaError::Poisoned { .. } | CudaError::Collective { .. } => weftRemoteError,
        CudaError::NoDriver(_)
        | CudaError::NoNvrtc(_)
        | CudaError::Driver { .. }
        | CudaError::Compile(_) => weftUnhandledCudaError,
        CudaError::Other(_) => weftInternalError,
    }
}

fn cuda_fail(e: &CudaError) -> weftResult_t {
    record(cuda_code(e), &e.to_string(), e.facts())
}

/// A device call's failure on `h`: `weftAborted` after `weftCommAbort` here (the device
/// communicator only knows it was poisoned), else the device error's own code.
fn device_fail(h: &weftComm, e: &CudaError) -> weftResult_t {
    match h.comm.error() {
        Some(host) if code_of(&host) == weftAborted => {
            record(weftAborted, &e.to_string(), e.facts())
        }
        _ => cuda_fail(e),
    }
}

fn from_lib(r: Result<(), Error>) -> Outcome {
    r.map(|()| weftSuccess).map_err(|e| lib_fail(&e))
}

/// What an entry point's body returns: `Err` carries a failure code whose message is already
/// recorded, so bodies can use `?`.
type Outcome = Result<weftResult_t, weftResult_t>;

/// Runs an entry point's body: a panic becomes `weftInternalError` (unwinding into C is
/// undefined), an `Err` its code.
fn entry(f: impl FnOnce() -> Outcome) -> weftResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code) | Err(code)) => code,
        Err(_) => fail(
            weftInternalError,
            "internal error: a panic was caught at the C boundary",
        ),
    }
}

/// An invalid argument of operation `kind` on `c`, reported in the core's form (rank, operation,
/// typed reason) like the errors the core finds itself.
fn arg_error(c: &Communicator, kind: OpKind, reason: CallError) -> weftResult_t {
    let e = Error::InvalidArgument {
        rank: c.rank(),
        op: kind,
        reason,
    };
    lib_fail(&e)
}

fn dtype_of(c: &Communicator, kind: OpKind, t: c_int) -> Result<DataType, weftResult_t> {
    u8::try_from(t)
        .ok()
        .and_then(DataType::from_code)
        .ok_or_else(|| arg_error(c, kind, CallError::UnknownDataType { code: t.into() }))
}

fn op_of(h: &weftComm, kind: OpKind, op: c_int) -> Result<ReduceOp, weftResult_t> {
    let c = &h.comm;
    Ok(match op {
        weftSum => ReduceOp::Sum,
        weftProd => ReduceOp::Prod,
        weftMax => ReduceOp::Max,
        weftMin => ReduceOp::Min,
        weftAvg => ReduceOp::Avg,
        _ => {
            let scalar = op
                .checked_sub(weftNumOps)
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| premul_table(h).get(i).copied().flatten());
            match scalar {
                Some(factor) => ReduceOp::PreMulSum(factor),
                None => {
                    let code = op.into();
                    return Err(arg_error(c, kind, CallError::UnknownReduction { code }));
                }
            }
        }
    })
}

fn premul_table(h: &weftComm) -> std::sync::MutexGuard<'_, Vec<Option<f64>>> {
    h.premul.lock().unwrap_or_else(|e| e.into_inner())
}

/// A root or peer given as a C `int`.
fn rank_of(
    c: &Communicator,
    kind: OpKind,
    what: &'static str,
    value: c_int,
) -> Result<usize, weftResult_t> {
    usize::try_from(value).map_err(|_| {
        let value = value.into();
        arg_error(c, kind, CallError::NegativeRank { what, value })
    })
}

/// The communicator behind a handle.
///
/// # Safety
/// `comm` is null or a handle from `weftCommInit*` not yet destroyed.
unsafe fn comm_ref<'a>(comm: weftComm_t) -> Result<&'a Communicator, weftResult_t> {
    // SAFETY: per the caller's contract.
    Ok(&unsafe { handle_ref(comm) }?.comm)
}

/// The handle itself (the communicator and what the C layer keeps beside it).
///
/// # Safety
/// As [`comm_ref`].
unsafe fn handle_ref<'a>(comm: weftComm_t) -> Result<&'a weftComm, weftResult_t> {
    if comm.is_null() {
        return Err(bad_arg("null communicator".into()));
    }
    // SAFETY: non-null, and valid per the caller's contract.
    Ok(unsafe { &*comm })
}

fn bad_arg(msg: String) -> weftResult_t {
    fail(weftInvalidArgument, &msg)
}

/// Writes `value` through an output pointer of `call`.
///
/// # Safety
/// `out` is null or writable.
unsafe fn write_out<T>(out: *mut T, value: T, call: &str) -> Outcome {
    if out.is_null() {
        return Err(bad_arg(format!("{call}: null output")));
    }
    // SAFETY: non-null and writable per the caller's contract.
    unsafe { out.write(value) };
    Ok(weftSuccess)
}

/// Bytes of `count` elements of `dtype`.
fn byte_len(
    c: &Communicator,
    kind: OpKind,
    count: usize,
    dtype: DataType,
) -> Result<usize, weftResult_t> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| arg_error(c, kind, CallError::CountOverflow))
}

/// Creates a new unique id and starts the job's bootstrap store in this process: call it on the
/// process that will be rank 0, then give the id to the other ranks.
///
/// # Safety
/// `id` is null or points to writable memory for one [`weftUniqueId`].
#[no_mangle]
pub unsafe extern "C" fn weftGetUniqueId(id: *mut weftUniqueId) -> weftResult_t {
    entry(|| {
        let uid = UniqueId::new().map_err(|e| lib_fail(&e))?.to_string();
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
        // SAFETY: per the contract.
        unsafe { write_out(id, out, "weftGetUniqueId") }
    })
}

/// Creates a communicator with `make` and stores it in `*comm` (checked first, so a bad
/// pointer does not join the job).
///
/// # Safety
/// `comm` is null or writable.
unsafe fn publish(
    comm: *mut weftComm_t,
    make: impl FnOnce() -> Result<Communicator, Error>,
    call: &str,
) -> Outcome {
    if comm.is_null() {
        return Err(bad_arg(format!("{call}: null communicator pointer")));
    }
    let c = make().map_err(|e| lib_fail(&e))?;
    let handle = Box::into_raw(Box::new(weftComm {
        comm: c,
        premul: Default::default(),
        device: Default::default(),
    }));
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
unsafe fn init_rank(
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
    let bytes: Vec<u8> = id
        .internal
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let make = || {
        std::str::from_utf8(&bytes)
            .map_err(|_| Error::Config("unique id is not text".into()))
            .and_then(UniqueId::from_str)
            .and_then(|uid| Communicator::init_with(r, n, &uid, config))
    };
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

/// Creates a reduction that multiplies each input by `*scalar` (of `datatype`) before summing
/// (NCCL's `ncclRedOpCreatePreMulSum`), valid on `comm` until [`weftRedOpDestroy`]. Only
/// [`weftScalarHostImmediate`] is supported: the scalar is read now.
///
/// # Safety
/// `op` is null or writable; `scalar` is null or points to one readable `datatype` element;
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftRedOpCreatePreMulSum(
    op: *mut weftRedOp_t,
    scalar: *const c_void,
    datatype: weftDataType_t,
    residence: weftScalarResidence_t,
    comm: weftComm_t,
) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let c = &h.comm;
        let kind = OpKind::AllReduce;
        let dt = dtype_of(c, kind, datatype)?;
        let call = "weftRedOpCreatePreMulSum";
        if residence != weftScalarHostImmediate {
            return Err(bad_arg(format!(
                "rank {}: {call}: residence {residence}: only weftScalarHostImmediate ({}) is \
                 supported (a device-resident scalar needs the CUDA path)",
                c.rank(),
                weftScalarHostImmediate
            )));
        }
        if scalar.is_null() {
            return Err(bad_arg(format!("rank {}: {call}: null scalar", c.rank())));
        }
        // SAFETY: `scalar` points to one readable element of `dt`, per the contract.
        let bytes = unsafe { std::slice::from_raw_parts(scalar.cast::<u8>(), dt.size()) };
        let factor = dt.decode_f64(bytes).ok_or_else(|| {
            bad_arg(format!(
                "rank {}: {call}: the scalar is not a {dt} value",
                c.rank()
            ))
        })?;
        let code = {
            let mut table = premul_table(h);
            let slot = match table.iter().position(Option::is_none) {
                Some(i) => i,
                None => {
                    table.push(None);
                    table.len() - 1
                }
            };
            let code = c_int::try_from(slot)
                .ok()
                .and_then(|s| s.checked_add(weftNumOps))
                .ok_or_else(|| bad_arg(format!("{call}: too many reductions")))?;
            table[slot] = Some(factor);
            code
        };
        // SAFETY: per the contract.
        unsafe { write_out(op, code, call) }
    })
}

/// Destroys a reduction made by [`weftRedOpCreatePreMulSum`] on `comm` (its code may be handed
/// out again). Built-in reductions cannot be destroyed.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftRedOpDestroy(op: weftRedOp_t, comm: weftComm_t) -> weftResult_t {
    entry(|| {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let mut table = premul_table(h);
        let slot = op
            .checked_sub(weftNumOps)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| table.get_mut(i))
            .filter(|s| s.is_some());
        match slot {
            Some(s) => {
                *s = None;
                Ok(weftSuccess)
            }
            None => Err(bad_arg(format!(
                "rank {}: weftRedOpDestroy: {op} is not a reduction created on this communicator",
                h.comm.rank()
            ))),
        }
    })
}

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
        let handle = made.map_or(std::ptr::null_mut(), |c| {
            Box::into_raw(Box::new(weftComm {
                comm: c,
                premul: Default::default(),
                device: Default::default(),
            }))
        });
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
            GROUP.with(|g| g.borrow_mut().ops.retain(|op| op.comm != comm));
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

/// A static description of a result code.
#[no_mangle]
pub extern "C" fn weftGetErrorString(result: weftResult_t) -> *const c_char {
    let s: &'static CStr = match result {
        weftSuccess => c"no error",
        weftUnhandledCudaError => c"unhandled CUDA error",
        weftSystemError => c"system error (sockets, shared memory, bootstrap)",
        weftInternalError => c"internal error (a bug in weftcc)",
        weftInvalidArgument => c"invalid argument",
        weftInvalidUsage => c"invalid usage",
        weftRemoteError => c"remote error (another rank failed or called a different operation)",
        weftInProgress => c"operation in progress",
        weftTimeout => c"timeout",
        weftAborted => c"communicator aborted",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The message of this thread's last failed call (empty if none), naming the rank, the
/// operation and its sequence number. Valid until this thread's next weftcc call.
/// `comm` is accepted for NCCL compatibility and not used.
#[no_mangle]
pub extern "C" fn weftGetLastError(comm: weftComm_t) -> *const c_char {
    let _ = comm;
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Writes the facts of this thread's last failed call (those of [`weftGetLastError`]'s message)
/// into `*info`, whose `size` the caller set to `sizeof(weftErrorInfo_t)` (`size` is left as
/// it is; a later, larger struct gets the fields this library knows). With no failure yet,
/// `result` is `weftSuccess` and the other fields -1.
///
/// # Safety
/// `info` is null or points to a [`weftErrorInfo_t`] whose `size` is readable and whose first
/// `size` bytes are writable.
#[no_mangle]
pub unsafe extern "C" fn weftGetLastErrorInfo(info: *mut weftErrorInfo_t) -> weftResult_t {
    if info.is_null() {
        // Not recorded: the caller's last failure must survive a mistaken query.
        return weftInvalidArgument;
    }
    // SAFETY: non-null; its `size` field is readable per the contract.
    let size = unsafe { std::ptr::addr_of!((*info).size).read() };
    if size < ERROR_INFO_V1_BYTES {
        return weftInvalidArgument;
    }
    // The caller's struct may be a later version's (larger: its extra fields are left alone)
    // or this one; `size` stays the caller's.
    let facts = weftErrorInfo_t {
        size,
        ..LAST_INFO.with(|i| i.get())
    };
    let n = size.min(std::mem::size_of::<weftErrorInfo_t>());
    // SAFETY: `facts` is a whole struct; the caller's first `size` ≥ `n` bytes are writable
    // per the contract, and the two do not overlap (`facts` is a local).
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::addr_of!(facts).cast::<u8>(), info.cast::<u8>(), n)
    };
    weftSuccess
}

/// One collective call from C: its buffers and how to recognise the in-place form.
struct Call {
    op: RawOp,
    send: *const c_void,
    send_bytes: usize,
    recv: *mut c_void,
    recv_bytes: usize,
    /// The call is in place when `send` sits this many bytes into `recv` (NCCL's in-place
    /// layout); `None`: never in place.
    in_place_offset: Option<usize>,
}

/// Runs a collective on raw host buffers (`stream` NULL) or enqueues it on `stream` (device
/// buffers).
///
/// # Safety
/// `call.send` is readable for `send_bytes` and `call.recv` writable for `recv_bytes` (unless
/// null with zero bytes), host memory without a stream, device memory of the stream's device
/// (valid until the stream passed the call) with one; `comm` is null or live.
unsafe fn collective(comm: weftComm_t, call: Call, stream: weftStream_t) -> Outcome {
    // SAFETY: per the contract.
    let h = unsafe { handle_ref(comm) }?;
    let c = &h.comm;
    let name = call.op.kind;
    let (send_bytes, recv_bytes) = (call.send_bytes, call.recv_bytes);
    if call.send.is_null() && send_bytes > 0 {
        return Err(arg_error(c, name, CallError::NullBuffer { which: "send" }));
    }
    if call.recv.is_null() && recv_bytes > 0 {
        return Err(arg_error(
            c,
            name,
            CallError::NullBuffer { which: "receive" },
        ));
    }
    let (s, r) = (call.send as usize, call.recv as usize);
    let in_place = call.in_place_offset.is_some_and(|o| s == r.wrapping_add(o)) && recv_bytes > 0;
    let overlap = s < r.saturating_add(recv_bytes) && r < s.saturating_add(send_bytes);
    if !in_place && overlap {
        return Err(arg_error(c, name, CallError::Overlap));
    }
    if !stream.is_null() {
        let send = (!in_place).then_some((call.send as u64, send_bytes));
        let recv = (call.recv as u64, recv_bytes);
        // SAFETY: per the contract.
        return unsafe { device_collective(h, call.op, send, recv, stream) };
    }
    refuse_device_memory(
        c,
        name,
        &[
            (call.send as u64, send_bytes),
            (call.recv as u64, recv_bytes),
        ],
    )?;
    let recv: &mut [u8] = if recv_bytes == 0 {
        &mut []
    } else {
        // SAFETY: non-null, writable for recv_bytes per the contract.
        unsafe { std::slice::from_raw_parts_mut(call.recv.cast::<u8>(), recv_bytes) }
    };
    if in_place {
        return from_lib(c.execute_raw(call.op, None, recv));
    }
    let send: &[u8] = if send_bytes == 0 {
        &[]
    } else {
        // SAFETY: non-null, readable for send_bytes per the contract, disjoint from recv
        // (checked above).
        unsafe { std::slice::from_raw_parts(call.send.cast::<u8>(), send_bytes) }
    };
    from_lib(c.execute_raw(call.op, Some(send), recv))
}

/// The device communicator of `h`, made by the first call with a stream (collective: every
/// rank's first device call is the same call, as for any collective) on the device that
/// `buffer` lies on: a split of the host communicator, so that host and device calls never
/// share a sequence of operations.
fn device_comm(h: &weftComm, kind: OpKind, buffer: u64) -> Result<Arc<DeviceComm>, weftResult_t> {
    let mut slot = h.device.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = &*slot {
        return Ok(d.clone());
    }
    let c = &h.comm;
    let ordinal = device_of(c, kind, buffer)?;
    let ctx = Context::new(ordinal).map_err(|e| cuda_fail(&e))?;
    let own = c
        .split(Some(0), c.rank() as i64)
        .map_err(|e| lib_fail(&e))?
        .ok_or_else(|| {
            fail(
                weftInternalError,
                "split with a colour gave no communicator",
            )
        })?;
    let d = Arc::new(DeviceComm::new(own, ctx).map_err(|e| cuda_fail(&e))?);
    *slot = Some(d.clone());
    Ok(d)
}

/// The GPU that `buffer` lies on; an invalid argument if it is not device memory.
fn device_of(c: &Communicator, kind: OpKind, buffer: u64) -> Result<usize, weftResult_t> {
    weftcc_cuda::device_of(buffer)
        .map_err(|e| cuda_fail(&e))?
        .ok_or_else(|| {
            bad_arg(format!(
                "rank {}: invalid argument to {kind}: a stream was given but the buffer at \
                 {buffer:#x} is not device memory",
                c.rank()
            ))
        })
}

/// Checks that every non-empty buffer of a device call lies on `d`'s GPU (a host pointer
/// handed to the GPU would fault there, not fail here).
fn check_on_device(
    h: &weftComm,
    d: &DeviceComm,
    kind: OpKind,
    buffers: &[(u64, usize)],
) -> Result<(), weftResult_t> {
    let mine = d.context().ordinal();
    for &(ptr, _) in buffers.iter().filter(|b| b.1 > 0) {
        let on = device_of(&h.comm, kind, ptr)?;
        if on != mine {
            return Err(bad_arg(format!(
                "rank {}: invalid argument to {kind}: the buffer at {ptr:#x} is on GPU {on}, \
                 the communicator's device calls use GPU {mine}",
                h.comm.rank()
            )));
        }
    }
    Ok(())
}

/// Refuses device memory given without a stream (the host path would read it from the CPU and
/// crash): NCCL programs pass 0 for the default stream, which here means host buffers.
fn refuse_device_memory(
    c: &Communicator,
    kind: OpKind,
    buffers: &[(u64, usize)],
) -> Result<(), weftResult_t> {
    if !weftcc_cuda::driver_present() {
        return Ok(());
    }
    for &(ptr, _) in buffers.iter().filter(|b| b.0 != 0 && b.1 > 0) {
        if let Ok(Some(gpu)) = weftcc_cuda::device_of(ptr) {
            return Err(bad_arg(format!(
                "rank {}: invalid argument to {kind}: the buffer at {ptr:#x} is memory of GPU \
                 {gpu} but no stream was given (NULL means host buffers; pass the cudaStream_t \
                 to enqueue on)",
                c.rank()
            )));
        }
    }
    Ok(())
}

/// The caller's stream, borrowed for one call; an invalid argument if it is not a stream of the
/// device communicator's GPU (its primary context, where the CUDA runtime makes streams).
///
/// # Safety
/// `stream` is a live stream.
unsafe fn borrow_stream(
    h: &weftComm,
    d: &DeviceComm,
    kind: OpKind,
    stream: weftStream_t,
) -> Result<Stream, weftResult_t> {
    // SAFETY: per the contract; the value lives only for the call.
    unsafe { Stream::borrow_checked(d.context(), stream.cast()) }.map_err(|e| {
        bad_arg(format!(
            "rank {}: invalid argument to {kind}: {e}",
            h.comm.rank()
        ))
    })
}

/// Enqueues a checked collective on device buffers (`send: None` in place).
///
/// # Safety
/// As [`collective`] with a stream.
unsafe fn device_collective(
    h: &weftComm,
    op: RawOp,
    send: Option<(u64, usize)>,
    recv: (u64, usize),
    stream: weftStream_t,
) -> Outcome {
    if recv.1 == 0 && send.is_none_or(|s| s.1 == 0) {
        // Nothing to move (NCCL allows null buffers here), and no device to learn it from.
        return Ok(weftSuccess);
    }
    // A reduce's non-root may pass no receive buffer: learn the device from the send buffer.
    let probe = if recv.0 != 0 {
        recv.0
    } else {
        send.map_or(0, |s| s.0)
    };
    let d = device_comm(h, op.kind, probe)?;
    // A reduce's non-root and a broadcast's non-root pass buffers nobody reads or writes.
    let used_send = send.filter(|_| !(op.kind == OpKind::Broadcast && op.root != h.comm.rank()));
    let used_recv = Some(recv).filter(|_| !(op.kind == OpKind::Reduce && op.root != h.comm.rank()));
    let buffers: Vec<(u64, usize)> = used_send.into_iter().chain(used_recv).collect();
    check_on_device(h, &d, op.kind, &buffers)?;
    // SAFETY: per the contract.
    let s = unsafe { borrow_stream(h, &d, op.kind, stream) }?;
    // SAFETY: device buffers valid until the stream passed the call, per the contract.
    unsafe { d.enqueue_raw(op, send, recv, &s) }
        .map(|()| weftSuccess)
        .map_err(|e| device_fail(h, &e))
}

/// All-reduce of `count` elements; in place when `sendbuff == recvbuff`.
///
/// # Safety
/// Buffers of `count` elements (send readable, receive writable); `comm` a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
    op: weftRedOp_t,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    entry(|| {
        let kind = OpKind::AllReduce;
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let c = &h.comm;
        let dt = dtype_of(c, kind, datatype)?;
        let bytes = byte_len(c, kind, count, dt)?;
        let op = RawOp::new(kind, dt, count).with_op(op_of(h, kind, op)?);
        let call = Call {
            op,
            send: sendbuff,
            send_bytes: bytes,
            recv: recvbuff,
            recv_bytes: bytes,
            in_place_offset: Some(0),
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, stream) }
    })
}

/// Broadcast of `count` elements from `root`'s `sendbuff` into every `recvbuff`; in place when
/// equal. Only the root reads `sendbuff` (others may pass anything, NULL included).
///
/// # Safety
/// As [`weftAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn weftBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
    root: c_int,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    entry(|| {
        let kind = OpKind::Broadcast;
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        let me = c.rank();
        let dt = dtype_of(c, kind, datatype)?;
        let bytes = byte_len(c, kind, count, dt)?;
        let root = rank_of(c, kind, "root", root)?;
        let (send, send_bytes) = if me == root {
            (sendbuff, bytes)
        } else {
            (std::ptr::null(), 0)
        };
        let call = Call {
            op: RawOp::new(kind, dt, count).with_root(root),
            send,
            send_bytes,
            recv: recvbuff,
            recv_bytes: bytes,
            in_place_offset: Some(0),
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, stream) }
    })
}

/// Reduce of `count` elements into `root`'s `recvbuff`; in place when equal. Only the root
/// writes `recvbuff` (others may pass anything, NULL included).
///
/// # Safety
/// As [`weftAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn weftReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
    op: weftRedOp_t,
    root: c_int,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    entry(|| {
        let kind = OpKind::Reduce;
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let c = &h.comm;
        let me = c.rank();
        let dt = dtype_of(c, kind, datatype)?;
        let bytes = byte_len(c, kind, count, dt)?;
        let root = rank_of(c, kind, "root", root)?;
        let op = RawOp::new(kind, dt, count)
            .with_op(op_of(h, kind, op)?)
            .with_root(root);
        let in_place = std::ptr::eq(sendbuff, recvbuff);
        let (recv, recv_bytes) = if me == root || in_place {
            (recvbuff, bytes)
        } else {
            (std::ptr::null_mut(), 0)
        };
        let call = Call {
            op,
            send: sendbuff,
            send_bytes: bytes,
            recv,
            recv_bytes,
            in_place_offset: Some(0),
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, stream) }
    })
}

/// All-gather: `recvbuff` (nranks × `sendcount`) holds every rank's `sendbuff` in rank order; in
/// place when `sendbuff == recvbuff + rank × sendcount` elements.
///
/// # Safety
/// `sendbuff` readable for `sendcount` elements, `recvbuff` writable for nranks × `sendcount`.
#[no_mangle]
pub unsafe extern "C" fn weftAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: weftDataType_t,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    entry(|| {
        let kind = OpKind::AllGather;
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        let dt = dtype_of(c, kind, datatype)?;
        let block = byte_len(c, kind, sendcount, dt)?;
        let all = byte_len(c, kind, sendcount.saturating_mul(c.size()), dt)?;
        let call = Call {
            op: RawOp::new(kind, dt, sendcount),
            send: sendbuff,
            send_bytes: block,
            recv: recvbuff,
            recv_bytes: all,
            in_place_offset: Some(c.rank() * block),
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, stream) }
    })
}

/// Reduce-scatter: rank r's `recvbuff` (`recvcount`) holds block r of the reduction of every
/// `sendbuff` (nranks × `recvcount`); in place when `recvbuff == sendbuff + rank × recvcount`
/// elements.
///
/// # Safety
/// `sendbuff` readable for nranks × `recvcount` elements (and writable, in place), `recvbuff`
/// writable for `recvcount`.
#[no_mangle]
pub unsafe extern "C" fn weftReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: weftDataType_t,
    op: weftRedOp_t,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    entry(|| {
        let kind = OpKind::ReduceScatter;
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(comm) }?;
        let c = &h.comm;
        let dt = dtype_of(c, kind, datatype)?;
        let block = byte_len(c, kind, recvcount, dt)?;
        let all = byte_len(c, kind, recvcount.saturating_mul(c.size()), dt)?;
        let op = RawOp::new(kind, dt, recvcount).with_op(op_of(h, kind, op)?);
        let in_place = recvbuff as usize == (sendbuff as usize).wrapping_add(c.rank() * block);
        let call = if in_place && block > 0 {
            // The whole in-place buffer starts at sendbuff.
            let whole = sendbuff as *mut c_void;
            Call {
                op,
                send: whole,
                send_bytes: all,
                recv: whole,
                recv_bytes: all,
                in_place_offset: Some(0),
            }
        } else {
            Call {
                op,
                send: sendbuff,
                send_bytes: all,
                recv: recvbuff,
                recv_bytes: block,
                in_place_offset: None,
            }
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, stream) }
    })
}

/// All-to-all: block j (`count` elements) of `sendbuff` goes to rank j, block i of `recvbuff`
/// comes from rank i; in place when equal.
///
/// # Safety
/// Both buffers of nranks × `count` elements.
#[no_mangle]
pub unsafe extern "C" fn weftAllToAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    entry(|| {
        let kind = OpKind::AllToAll;
        // SAFETY: per the contract.
        let c = unsafe { comm_ref(comm) }?;
        let dt = dtype_of(c, kind, datatype)?;
        let all = byte_len(c, kind, count.saturating_mul(c.size()), dt)?;
        let call = Call {
            op: RawOp::new(kind, dt, count),
            send: sendbuff,
            send_bytes: all,
            recv: recvbuff,
            recv_bytes: all,
            in_place_offset: Some(0),
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, stream) }
    })
}

/// Blocks until every rank called it.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftBarrier(comm: weftComm_t) -> weftResult_t {
    // SAFETY: per the contract.
    entry(|| from_lib(unsafe { comm_ref(comm) }?.barrier()))
}

/// Starts (or nests) a group: `weftSend`/`weftRecv` calls are collected until the matching
/// `weftGroupEnd`, which runs them together (so ranks can exchange without deadlock).
#[no_mangle]
pub extern "C" fn weftGroupStart() -> weftResult_t {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    weftSuccess
}

/// Ends a group; the outermost one runs the collected sends and receives, one group per
/// communicator, and returns when they completed (at the first failure, the remaining
/// communicators' calls are dropped).
#[no_mangle]
pub extern "C" fn weftGroupEnd() -> weftResult_t {
    entry(|| {
        let ops = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return None;
            }
            g.depth -= 1;
            Some(if g.depth == 0 {
                std::mem::take(&mut g.ops)
            } else {
                Vec::new()
            })
        });
        let ops =
            ops.ok_or_else(|| fail(weftInvalidUsage, "weftGroupEnd without weftGroupStart"))?;
        let mut comms: Vec<weftComm_t> = Vec::new();
        for op in &ops {
            if !comms.contains(&op.comm) {
                comms.push(op.comm);
            }
        }
        for comm in comms {
            let mine: Vec<&P2p> = ops.iter().filter(|op| op.comm == comm).collect();
            // SAFETY: the handles were live when the calls were collected, and a destroyed
            // communicator's calls were dropped from the group (weftCommDestroy).
            unsafe { run_group(comm, &mine) }?;
        }
        Ok(weftSuccess)
    })
}

/// Runs one communicator's collected point-to-point calls as one group.
///
/// # Safety
/// `comm` is live; every op's pointer is valid for its bytes (read for sends, written for
/// receives).
unsafe fn run_group(comm: weftComm_t, ops: &[&P2p]) -> Outcome {
    // SAFETY: per the contract.
    let c = unsafe { comm_ref(comm) }?;
    // A receive buffer may share no byte with any other buffer of the group (Rust slices of
    // them would alias); sends may share with each other.
    for (i, a) in ops.iter().enumerate() {
        for b in &ops[i + 1..] {
            let overlap =
                a.ptr < b.ptr.saturating_add(b.bytes) && b.ptr < a.ptr.saturating_add(a.bytes);
            if overlap && (!a.send || !b.send) && a.bytes > 0 && b.bytes > 0 {
                return Err(arg_error(c, OpKind::SendRecv, CallError::GroupOverlap));
            }
        }
    }
    if let Some(first) = ops.iter().find(|op| op.stream != 0) {
        // SAFETY: per the contract.
        return unsafe { run_device_group(comm, ops, first.stream) };
    }
    let buffers: Vec<(u64, usize)> = ops.iter().map(|op| (op.ptr as u64, op.bytes)).collect();
    refuse_device_memory(c, OpKind::SendRecv, &buffers)?;
    let mut group = c.group();
    for op in ops {
        group = match (op.send, op.bytes) {
            (true, 0) => group.send::<u8>(&[], op.peer),
            (false, 0) => group.recv::<u8>(&mut [], op.peer),
            // SAFETY: readable for op.bytes per the contract.
            (true, n) => group.send(
                unsafe { std::slice::from_raw_parts(op.ptr as *const u8, n) },
                op.peer,
            ),
            // SAFETY: writable for op.bytes and not aliased (checked above).
            (false, n) => group.recv(
                unsafe { std::slice::from_raw_parts_mut(op.ptr as *mut u8, n) },
                op.peer,
            ),
        };
    }
    from_lib(group.run())
}

/// Enqueues one communicator's collected sends and receives on device buffers on `stream`.
///
/// # Safety
/// As [`run_group`], with device buffers of the stream's device.
unsafe fn run_device_group(comm: weftComm_t, ops: &[&P2p], stream: usize) -> Outcome {
    // SAFETY: per the contract.
    let h = unsafe { handle_ref(comm) }?;
    if ops.iter().any(|op| op.stream != stream) {
        return Err(fail(
            weftInvalidUsage,
            &format!(
                "rank {}: the sends and receives of one communicator in a group must all use \
                 the same stream (or all none)",
                h.comm.rank()
            ),
        ));
    }
    if ops.iter().all(|op| op.bytes == 0) {
        return Ok(weftSuccess);
    }
    // Made by a collective only: every rank takes part in making it, and a send/recv has two.
    let existing = h.device.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let Some(d) = existing else {
        return Err(fail(
            weftInvalidUsage,
            &format!(
                "rank {}: the first call with a stream must be a collective (every rank makes \
                 it; the device communicator is set up then), not a send or receive",
                h.comm.rank()
            ),
        ));
    };
    let buffers: Vec<(u64, usize)> = ops.iter().map(|op| (op.ptr as u64, op.bytes)).collect();
    check_on_device(h, &d, OpKind::SendRecv, &buffers)?;
    let list = |send: bool| -> Vec<(usize, u64, usize)> {
        ops.iter()
            .filter(|op| op.send == send)
            .map(|op| (op.peer, op.ptr as u64, op.bytes))
            .collect()
    };
    // SAFETY: per the contract.
    let s = unsafe { borrow_stream(h, &d, OpKind::SendRecv, stream as weftStream_t) }?;
    // SAFETY: device buffers valid until the stream passed the group, receive buffers not
    // overlapping another (checked by run_group), per the contract.
    unsafe { d.enqueue_group_raw(&list(true), &list(false), &s) }
        .map(|()| weftSuccess)
        .map_err(|e| device_fail(h, &e))
}

/// Sends `count` elements to `peer`, which must post a matching `weftRecv`. Outside a group it
/// runs at once; inside one it runs at `weftGroupEnd`.
///
/// # Safety
/// `sendbuff` readable for `count` elements until the call (or its group) completed.
#[no_mangle]
pub unsafe extern "C" fn weftSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: weftDataType_t,
    peer: c_int,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    // SAFETY: per the contract.
    entry(|| unsafe {
        point_to_point(
            true,
            sendbuff as *mut c_void,
            count,
            datatype,
            peer,
            comm,
            stream,
        )
    })
}

/// Receives `count` elements from `peer` into `recvbuff` (see [`weftSend`]).
///
/// # Safety
/// `recvbuff` writable for `count` elements until the call (or its group) completed.
#[no_mangle]
pub unsafe extern "C" fn weftRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
    peer: c_int,
    comm: weftComm_t,
    stream: weftStream_t,
) -> weftResult_t {
    // SAFETY: per the contract.
    entry(|| unsafe { point_to_point(false, recvbuff, count, datatype, peer, comm, stream) })
}

/// # Safety
/// As weftSend / weftRecv.
unsafe fn point_to_point(
    send: bool,
    buf: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
    peer: c_int,
    comm: weftComm_t,
    stream: weftStream_t,
) -> Outcome {
    let kind = OpKind::SendRecv;
    // SAFETY: per the contract.
    let c = unsafe { comm_ref(comm) }?;
    let bytes = byte_len(c, kind, count, dtype_of(c, kind, datatype)?)?;
    if buf.is_null() && bytes > 0 {
        let which = if send { "send" } else { "receive" };
        return Err(arg_error(c, kind, CallError::NullBuffer { which }));
    }
    let peer = rank_of(c, kind, "peer", peer)?;
    let op = P2p {
        comm,
        send,
        ptr: buf as usize,
        bytes,
        peer,
        stream: stream as usize,
    };
    let now = GROUP.with(move |g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.ops.push(op);
            None
        } else {
            Some(op)
        }
    });
    match now {
        None => Ok(weftSuccess),
        // SAFETY: per the contract.
        Some(op) => unsafe { run_group(comm, &[&op]) },
    }
}
