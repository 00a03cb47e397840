//! Buffer registration (accepted: weftcc needs none), and NCCL's calls this library does not
//! implement: each returns `ncclInvalidUsage` with a message naming it, never a crash.

use std::ffi::{c_char, c_int, c_void};

use crate::errors::{bad_arg, bad_usage, run, DONE};
use crate::handle::{comm_arc, ncclComm_t};
use crate::types::*;

/// Registers a buffer with the communicator: accepted, nothing to do (weftcc registers what it
/// needs itself); `*handle` is set to `buff`.
///
/// # Safety
/// `comm` null or live; `handle` null or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    let call = "ncclCommRegister";
    let _ = size;
    run(|| {
        // SAFETY: per the contract.
        unsafe { comm_arc(comm, call) }?.weft(call)?;
        if handle.is_null() {
            return Err(bad_arg("ncclCommRegister: null handle output"));
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { handle.write(buff) };
        DONE
    })
}

/// Deregisters a buffer registered by [`ncclCommRegister`]: accepted.
///
/// # Safety
/// `comm` null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    let call = "ncclCommDeregister";
    let _ = handle;
    run(|| {
        // SAFETY: per the contract.
        unsafe { comm_arc(comm, call) }?.weft(call)?;
        DONE
    })
}

/// The failure of a call this library does not implement.
fn not_implemented(call: &str) -> ncclResult_t {
    run(|| {
        Err(bad_usage(&format!(
            "{call} is not implemented by weftcc's libnccl.so.2 (see docs/nccl-dropin.md)"
        )))
    })
}

/// Declares NCCL calls that are not implemented, with NCCL's signatures.
macro_rules! not_implemented {
    ($( $(#[$doc:meta])* fn $name:ident( $($arg:ident : $ty:ty),* ); )*) => {
        $(
            $(#[$doc])*
            #[no_mangle]
            pub extern "C" fn $name($($arg: $ty),*) -> ncclResult_t {
                $(let _ = $arg;)*
                not_implemented(stringify!($name))
            }
        )*
    };
}

not_implemented! {
    /// NCCL's allocator for registered device memory: allocate with `cudaMalloc` instead.
    fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize);
    /// See [`ncclMemAlloc`].
    fn ncclMemFree(ptr: *mut c_void);
    /// NCCL 2.28's gather.
    fn ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t);
    /// NCCL 2.28's scatter.
    fn ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize,
        datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t);
    /// NCCL 2.29's id for growing a communicator.
    fn ncclCommGetUniqueId(comm: ncclComm_t, uniqueId: *mut ncclUniqueId);
    /// NCCL 2.29's grow.
    fn ncclCommGrow(comm: ncclComm_t, nRanks: c_int, uniqueId: *const ncclUniqueId, rank: c_int,
        newcomm: *mut ncclComm_t, config: *mut ncclConfig_t);
    /// NCCL 2.29's memory suspension.
    fn ncclCommSuspend(comm: ncclComm_t, flags: c_int);
    /// See [`ncclCommSuspend`].
    fn ncclCommResume(comm: ncclComm_t);
    /// NCCL 2.29's memory statistics.
    fn ncclCommMemStats(comm: ncclComm_t, stat: c_int, value: *mut u64);
    /// NCCL 2.27's symmetric-memory windows.
    fn ncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize,
        win: *mut *mut c_void, winFlags: c_int);
    /// See [`ncclCommWindowRegister`].
    fn ncclCommWindowDeregister(comm: ncclComm_t, win: *mut c_void);
    /// See [`ncclCommWindowRegister`].
    fn ncclWinGetUserPtr(comm: ncclComm_t, win: *mut c_void, outUserPtr: *mut *mut c_void);
    /// NCCL 2.29's one-sided put with signal.
    fn ncclPutSignal(localbuff: *const c_void, count: usize, datatype: ncclDataType_t,
        peer: c_int, peerWin: *mut c_void, peerWinOffset: usize, sigIdx: c_int, ctx: c_int,
        flags: u32, comm: ncclComm_t, stream: cudaStream_t);
    /// See [`ncclPutSignal`].
    fn ncclSignal(peer: c_int, sigIdx: c_int, ctx: c_int, flags: u32, comm: ncclComm_t,
        stream: cudaStream_t);
    /// See [`ncclPutSignal`].
    fn ncclWaitSignal(nDesc: c_int, signalDescs: *mut c_void, comm: ncclComm_t,
        stream: cudaStream_t);
    /// NCCL's group simulation (tuning estimates).
    fn ncclGroupSimulateEnd(simInfo: *mut c_void);
    /// NCCL 2.30's parameter queries.
    fn ncclParamBind(out: *mut *mut c_void, key: *const c_char);
    /// See [`ncclParamBind`].
    fn ncclParamGetI8(h: *mut c_void, out: *mut i8);
    /// See [`ncclParamBind`].
    fn ncclParamGetI16(h: *mut c_void, out: *mut i16);
    /// See [`ncclParamBind`].
    fn ncclParamGetI32(h: *mut c_void, out: *mut i32);
    /// See [`ncclParamBind`].
    fn ncclParamGetI64(h: *mut c_void, out: *mut i64);
    /// See [`ncclParamBind`].
    fn ncclParamGetU8(h: *mut c_void, out: *mut u8);
    /// See [`ncclParamBind`].
    fn ncclParamGetU16(h: *mut c_void, out: *mut u16);
    /// See [`ncclParamBind`].
    fn ncclParamGetU32(h: *mut c_void, out: *mut u32);
    /// See [`ncclParamBind`].
    fn ncclParamGetU64(h: *mut c_void, out: *mut u64);
    /// See [`ncclParamBind`].
    fn ncclParamGetStr(h: *mut c_void, out: *mut *const c_char);
    /// See [`ncclParamBind`].
    fn ncclParamGet(h: *mut c_void, out: *mut c_void, maxLen: c_int, len: *mut c_int);
    /// See [`ncclParamBind`].
    fn ncclParamGetParameter(key: *const c_char, value: *mut *const c_char, valueLen: *mut c_int);
    /// See [`ncclParamBind`].
    fn ncclParamGetAllParameterKeys(table: *mut *mut *const c_char, tableLen: *mut c_int);
}
