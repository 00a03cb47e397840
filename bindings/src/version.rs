//! The C API's version.

use std::ffi::c_int;

use crate::boundary::{entry, write_out};
use crate::codes::weftResult_t;

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
