//! The C boundary: how an entry point's body runs (a panic caught, a result code returned) and
//! how it reads its arguments and writes its outputs.

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

use weftcc_collectives::{CallError, DataType, OpKind};
use weftcc_comm::{Communicator, Error};

use crate::codes::{weftInternalError, weftResult_t, weftSuccess};
use crate::errors::{arg_error, bad_arg, fail, lib_fail};
use crate::handle::{weftComm, weftComm_t};

/// What an entry point's body returns: `Err` carries a failure code whose message is already
/// recorded, so bodies can use `?`.
pub(crate) type Outcome = Result<weftResult_t, weftResult_t>;

/// Runs an entry point's body: a panic becomes `weftInternalError` (unwinding into C is
/// undefined), an `Err` its code.
pub(crate) fn entry(f: impl FnOnce() -> Outcome) -> weftResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code) | Err(code)) => code,
        Err(_) => fail(
            weftInternalError,
            "internal error: a panic was caught at the C boundary",
        ),
    }
}

/// Runs the body of an entry point of a layer built on this ABI (Rust only, not in the header):
/// a panic becomes `weftInternalError` with the same message as here.
pub fn guarded(f: impl FnOnce() -> weftResult_t) -> weftResult_t {
    entry(|| Ok(f()))
}

pub(crate) fn from_lib(r: Result<(), Error>) -> Outcome {
    r.map(|()| weftSuccess).map_err(|e| lib_fail(&e))
}

/// Writes `value` through an output pointer of `call`.
///
/// # Safety
/// `out` is null or writable.
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T, call: &str) -> Outcome {
    if out.is_null() {
        return Err(bad_arg(format!("{call}: null output")));
    }
    // SAFETY: non-null and writable per the caller's contract.
    unsafe { out.write(value) };
    Ok(weftSuccess)
}

pub(crate) fn dtype_of(c: &Communicator, kind: OpKind, t: c_int) -> Result<DataType, weftResult_t> {
    u8::try_from(t)
        .ok()
        .and_then(DataType::from_code)
        .ok_or_else(|| arg_error(c, kind, CallError::UnknownDataType { code: t.into() }))
}

/// A root or peer given as a C `int`.
pub(crate) fn rank_of(
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

/// Bytes of `count` elements of `dtype`.
pub(crate) fn byte_len(
    c: &Communicator,
    kind: OpKind,
    count: usize,
    dtype: DataType,
) -> Result<usize, weftResult_t> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| arg_error(c, kind, CallError::CountOverflow))
}

/// The communicator behind a handle.
///
/// # Safety
/// `comm` is null or a handle from `weftCommInit*` not yet destroyed.
pub(crate) unsafe fn comm_ref<'a>(comm: weftComm_t) -> Result<&'a Communicator, weftResult_t> {
    // SAFETY: per the caller's contract.
    Ok(&unsafe { handle_ref(comm) }?.comm)
}

/// The handle itself (the communicator and what the C layer keeps beside it).
///
/// # Safety
/// As [`comm_ref`].
pub(crate) unsafe fn handle_ref<'a>(comm: weftComm_t) -> Result<&'a weftComm, weftResult_t> {
    if comm.is_null() {
        return Err(bad_arg("null communicator".into()));
    }
    // SAFETY: non-null, and valid per the caller's contract.
    Ok(unsafe { &*comm })
}
