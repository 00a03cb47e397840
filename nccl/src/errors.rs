//! Result codes and messages: weftcc's codes as NCCL's, the failures this layer finds itself,
//! and the entry-point wrapper every `nccl*` call runs in.

use std::ffi::{c_char, CStr};

use weft::{
    weftAborted, weftGetLastError, weftInvalidArgument, weftInvalidUsage, weftResult_t,
    weftSuccess, weftTimeout,
};

use crate::handle::ncclComm_t;
use crate::types::*;

/// A `weft*` result as NCCL's code: 0–8 are the same; `weftAborted` (a call on, or blocked in,
/// a communicator aborted by this process) is `ncclInvalidUsage`.
pub(crate) fn nccl_code(r: weftResult_t) -> ncclResult_t {
    match r {
        weftSuccess..=weftTimeout => r,
        weftAborted => ncclInvalidUsage,
        _ => ncclInternalError,
    }
}

/// Runs the body of an `nccl*` entry point: NCCL's variables honoured (once), a panic caught,
/// the weftcc code translated.
pub(crate) fn run(f: impl FnOnce() -> Outcome) -> ncclResult_t {
    weftcc_settings::honour_nccl_twins();
    nccl_code(weft::guarded(|| match f() {
        Ok(code) | Err(code) => code,
    }))
}

/// What an entry point's body returns: `Ok` its code (`weftSuccess`, or `weftInProgress` for
/// work going on), `Err` a failure whose message is recorded.
pub(crate) type Outcome = Result<weftResult_t, weftResult_t>;

pub(crate) const DONE: Outcome = Ok(weftSuccess);

/// A failure this layer found: `code` with `msg` as this thread's last error.
pub(crate) fn fail(code: weftResult_t, msg: &str) -> weftResult_t {
    weft::record_failure(code, msg)
}

pub(crate) fn bad_arg(msg: &str) -> weftResult_t {
    fail(weftInvalidArgument, msg)
}

pub(crate) fn bad_usage(msg: &str) -> weftResult_t {
    fail(weftInvalidUsage, msg)
}

/// A `weft*` result as a `Result` (its message already recorded on this thread).
pub(crate) fn check(r: weftResult_t) -> Outcome {
    if r == weftSuccess {
        DONE
    } else {
        Err(r)
    }
}

/// A failure carried from the thread that met it (a group's or a non-blocking init's worker)
/// to the one that reports it.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) code: weftResult_t,
    pub(crate) msg: String,
}

impl Failure {
    /// The failure `code` just recorded on this thread.
    pub(crate) fn here(code: weftResult_t) -> Failure {
        let msg = last_error();
        Failure { code, msg }
    }

    /// Records it on this thread; returns its code.
    pub(crate) fn raise(&self) -> weftResult_t {
        fail(self.code, &self.msg)
    }
}

/// This thread's last error message.
fn last_error() -> String {
    // SAFETY: weftGetLastError returns a NUL-terminated string valid until this thread's next
    // weftcc call; it is copied at once.
    unsafe { CStr::from_ptr(weftGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned()
}

/// A static description of a result code, naming weftcc (its version) as the library.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    macro_rules! text {
        ($s:literal) => {
            concat!(
                $s,
                " (weftcc ",
                env!("CARGO_PKG_VERSION"),
                ", libnccl.so.2)\0"
            )
        };
    }
    let s: &'static str = match result {
        ncclSuccess => text!("no error"),
        ncclUnhandledCudaError => text!("unhandled cuda error"),
        ncclSystemError => text!("unhandled system error (sockets, shared memory, bootstrap)"),
        ncclInternalError => text!("internal error - please report this issue to weftcc"),
        ncclInvalidArgument => text!("invalid argument"),
        ncclInvalidUsage => text!("invalid usage"),
        ncclRemoteError => text!("remote process exited or there was a network error"),
        ncclInProgress => text!("NCCL operation in progress"),
        ncclTimeout => text!("timeout"),
        _ => text!("unknown result code"),
    };
    s.as_ptr().cast()
}

/// The message of this thread's last failed call (empty if none). `comm` is not used (the
/// message is this thread's, whichever communicator failed).
#[no_mangle]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    let _ = comm;
    weftGetLastError(std::ptr::null_mut())
}

/// Reloads the logging settings: a no-op (weftcc reads them when its first communicator is
/// made).
#[no_mangle]
pub extern "C" fn ncclResetDebugInit() {}
