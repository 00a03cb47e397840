//! The collectives: their C arguments checked and turned into one operation, run on host
//! buffers or enqueued on a stream.

use std::ffi::{c_int, c_void};

use weftcc_collectives::{CallError, OpKind, RawOp};

use crate::boundary::{
    byte_len, comm_ref, dtype_of, entry, from_lib, handle_ref, rank_of, Outcome,
};
use crate::codes::{weftDataType_t, weftRedOp_t, weftResult_t};
use crate::device::{device_collective, refuse_device_memory, weftStream_t};
use crate::errors::arg_error;
use crate::handle::weftComm_t;
use crate::redops::op_of;

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
