//! Failures: each thread's last error (message and facts), the result codes of the library's
//! errors, and the calls that read them.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};

use weftcc_collectives::{CallError, OpKind};
use weftcc_comm::{Communicator, Error, ErrorFacts, SeenBy};
use weftcc_cuda::CudaError;

use crate::codes::{
    weftAborted, weftInProgress, weftInternalError, weftInvalidArgument, weftInvalidUsage,
    weftOpKind_t, weftOpNone, weftRemoteError, weftResult_t, weftSuccess, weftSystemError,
    weftTimeout, weftUnhandledCudaError,
};
use crate::handle::weftComm_t;

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

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The facts of this thread's last failed call.
    static LAST_INFO: std::cell::Cell<weftErrorInfo_t> = const { std::cell::Cell::new(NO_ERROR_INFO) };
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
pub(crate) fn record(code: weftResult_t, msg: &str, facts: ErrorFacts) -> weftResult_t {
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
pub(crate) fn fail(code: weftResult_t, msg: &str) -> weftResult_t {
    record(code, msg, ErrorFacts::default())
}

/// Records a failure found by a layer built on this ABI (Rust only, not in the header):
/// weftcc-nccl's `libnccl.so.2` reports its own checks here, so that one thread has one last
/// error whichever layer found it. Returns `code`.
pub fn record_failure(code: weftResult_t, msg: &str) -> weftResult_t {
    fail(code, msg)
}

/// A library error: its code, message and facts.
pub(crate) fn lib_fail(e: &Error) -> weftResult_t {
    record(code_of(e), &e.to_string(), e.facts())
}

/// The result code of a library error.
pub(crate) fn code_of(e: &Error) -> weftResult_t {
    match e {
        Error::InvalidArgument { .. } | Error::Config(_) | Error::Setting(_) => weftInvalidArgument,
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
        Error::Transport { .. }
        | Error::Bootstrap { .. }
        | Error::StoreLost { .. }
        | Error::Diagnostics { .. } => weftSystemError,
        Error::Internal { .. } => weftInternalError,
        Error::Inconsistent { .. } => weftInvalidUsage,
        // An operation on a communicator this rank revoked, or a shrink that excludes the caller.
        Error::Revoked { by: None, .. } | Error::Excluded { .. } => weftInvalidUsage,
        Error::Revoked { .. } => weftRemoteError,
    }
}

/// The result code of a device-path error.
fn cuda_code(e: &CudaError) -> weftResult_t {
    match e {
        CudaError::InvalidArgument { .. } => weftInvalidArgument,
        CudaError::Host(e) => code_of(e),
        CudaError::Timeout { .. } => weftTimeout,
        // The first failure of the communicator (a peer's included) or an operation's.
        CudaError::Poisoned { .. } | CudaError::Collective { .. } | CudaError::Gdr(_) => {
            weftRemoteError
        }
        CudaError::NoDriver(_)
        | CudaError::NoNvrtc(_)
        | CudaError::Driver { .. }
        | CudaError::Compile(_) => weftUnhandledCudaError,
        CudaError::Other(_) => weftInternalError,
    }
}

pub(crate) fn cuda_fail(e: &CudaError) -> weftResult_t {
    record(cuda_code(e), &e.to_string(), e.facts())
}

/// An invalid argument of operation `kind` on `c`, reported in the core's form (rank, operation,
/// typed reason) like the errors the core finds itself.
pub(crate) fn arg_error(c: &Communicator, kind: OpKind, reason: CallError) -> weftResult_t {
    let e = Error::InvalidArgument {
        rank: c.rank(),
        op: kind,
        reason,
    };
    lib_fail(&e)
}

pub(crate) fn bad_arg(msg: String) -> weftResult_t {
    fail(weftInvalidArgument, &msg)
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
