//! The collectives, sends and receives (each becoming its `weft*` call, now or at the group's
//! end) and the pre-multiplied-sum reductions.

use std::ffi::{c_int, c_void};

use weft::{
    weftAllGather, weftAllReduce, weftAllToAll, weftBroadcast, weftComm_t, weftRecv,
    weftRedOpCreatePreMulSum, weftRedOpDestroy, weftReduce, weftReduceScatter, weftSend,
};

use crate::errors::{check, run, Outcome};
use crate::group::submit;
use crate::handle::{comm_arc, ncclComm_t};
use crate::types::*;

/// Runs `job` with weftcc's handle of `comm` now or at the group's end; the pointers the job
/// uses travel as addresses (valid until the call or its group ended: NCCL's contract).
///
/// # Safety
/// `comm` is null or live.
unsafe fn on(
    comm: ncclComm_t,
    call: &'static str,
    job: impl FnOnce(weftComm_t) -> weft::weftResult_t + Send + 'static,
) -> Outcome {
    // SAFETY: per the contract.
    let c = unsafe { comm_arc(comm, call) }?;
    submit(c, call, Box::new(job))
}

/// All-reduce of `count` elements; in place when `sendbuff == recvbuff`.
///
/// # Safety
/// NCCL's: buffers of `count` elements valid until the call (host) or the stream (device)
/// completed; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, r, st) = (sendbuff as usize, recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclAllReduce", move |w| {
            weftAllReduce(s as _, r as _, count, datatype, op, w, st as _)
        })
    })
}

/// Broadcast from `root`; in place when equal.
///
/// # Safety
/// As [`ncclAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, r, st) = (sendbuff as usize, recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclBroadcast", move |w| {
            weftBroadcast(s as _, r as _, count, datatype, root, w, st as _)
        })
    })
}

/// NCCL's in-place broadcast (legacy form).
///
/// # Safety
/// As [`ncclAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (b, st) = (buff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclBcast", move |w| {
            weftBroadcast(b as _, b as _, count, datatype, root, w, st as _)
        })
    })
}

/// Reduce into `root`'s `recvbuff`.
///
/// # Safety
/// As [`ncclAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, r, st) = (sendbuff as usize, recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclReduce", move |w| {
            weftReduce(s as _, r as _, count, datatype, op, root, w, st as _)
        })
    })
}

/// All-gather of `sendcount` elements per rank.
///
/// # Safety
/// As [`ncclAllReduce`], `recvbuff` of nranks × `sendcount`.
#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, r, st) = (sendbuff as usize, recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclAllGather", move |w| {
            weftAllGather(s as _, r as _, sendcount, datatype, w, st as _)
        })
    })
}

/// Reduce-scatter into `recvcount` elements per rank.
///
/// # Safety
/// As [`ncclAllReduce`], `sendbuff` of nranks × `recvcount`.
#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, r, st) = (sendbuff as usize, recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclReduceScatter", move |w| {
            weftReduceScatter(s as _, r as _, recvcount, datatype, op, w, st as _)
        })
    })
}

/// All-to-all of `count` elements per pair of ranks (NCCL 2.28).
///
/// # Safety
/// As [`ncclAllReduce`], both buffers of nranks × `count`.
#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, r, st) = (sendbuff as usize, recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclAlltoAll", move |w| {
            weftAllToAll(s as _, r as _, count, datatype, w, st as _)
        })
    })
}

/// Sends `count` elements to `peer` (in a group, with the group's other calls).
///
/// # Safety
/// As [`ncclAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (s, st) = (sendbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclSend", move |w| {
            weftSend(s as _, count, datatype, peer, w, st as _)
        })
    })
}

/// Receives `count` elements from `peer`.
///
/// # Safety
/// As [`ncclAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let (r, st) = (recvbuff as usize, stream as usize);
    // SAFETY: per the contract, passed on to weftcc's call.
    run(|| unsafe {
        on(comm, "ncclRecv", move |w| {
            weftRecv(r as _, count, datatype, peer, w, st as _)
        })
    })
}

/// A reduction multiplying each input by `*scalar` before summing (host-immediate scalars).
///
/// # Safety
/// `op` null or writable; `scalar` null or one readable element; `comm` null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut ncclRedOp_t,
    scalar: *mut c_void,
    datatype: ncclDataType_t,
    residence: ncclScalarResidence_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    let call = "ncclRedOpCreatePreMulSum";
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, call) }?;
        // SAFETY: per the contract, passed on (weftcc checks the arguments).
        check(unsafe { weftRedOpCreatePreMulSum(op, scalar, datatype, residence, c.weft(call)?) })
    })
}

/// Destroys a reduction made by [`ncclRedOpCreatePreMulSum`].
///
/// # Safety
/// `comm` null or live.
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
    let call = "ncclRedOpDestroy";
    run(|| {
        // SAFETY: per the contract.
        let c = unsafe { comm_arc(comm, call) }?;
        // SAFETY: live while `c` holds it.
        check(unsafe { weftRedOpDestroy(op, c.weft(call)?) })
    })
}
