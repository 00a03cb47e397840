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

/// The arguments every collective entry point takes ([`Args::new`] takes them in the C order;
/// the reduction and the root, which only some take, go to [`Args::run`]).
struct Args {
    /// Where the call runs.
    comm: weftComm_t,
    stream: weftStream_t,
    /// What it runs on.
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: weftDataType_t,
}

/// A collective's checked arguments, which the layout of its buffers depends on.
struct Sizes {
    /// This rank.
    rank: usize,
    /// The root of broadcast and reduce (0 for the others).
    root: usize,
    /// `count` elements, in bytes.
    bytes: usize,
    /// nranks × `count` elements, in bytes (0 for the collectives whose buffers are not
    /// nranks blocks).
    all: usize,
}

impl Call {
    /// The call with no send buffer (a rank that reads none).
    fn without_send(self) -> Self {
        Call {
            send: std::ptr::null(),
            send_bytes: 0,
            ..self
        }
    }

    /// The call with no receive buffer (a rank that writes none).
    fn without_recv(self) -> Self {
        Call {
            recv: std::ptr::null_mut(),
            recv_bytes: 0,
            ..self
        }
    }
}

impl Args {
    const fn new(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: weftDataType_t,
        comm: weftComm_t,
        stream: weftStream_t,
    ) -> Self {
        Args {
            comm,
            stream,
            send,
            recv,
            count,
            datatype,
        }
    }

    /// An entry point's body: the handle, the data type, the sizes, the root and the reduction
    /// are checked in that order; `layout` turns the call of `count` elements on each side, in
    /// place when the buffers are equal, into the collective's own, which [`collective`] runs.
    ///
    /// # Safety
    /// As [`collective`], for the buffers `layout` returns.
    unsafe fn run(
        self,
        kind: OpKind,
        op: Option<weftRedOp_t>,
        root: Option<c_int>,
        layout: impl FnOnce(Call, Sizes) -> Call,
    ) -> Outcome {
        // SAFETY: per the contract.
        let h = unsafe { handle_ref(self.comm) }?;
        let c = &h.comm;
        let dt = dtype_of(c, kind, self.datatype)?;
        let bytes = byte_len(c, kind, self.count, dt)?;
        let all = if matches!(
            kind,
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll
        ) {
            byte_len(c, kind, self.count.saturating_mul(c.size()), dt)?
        } else {
            0
        };
        let mut raw = RawOp::new(kind, dt, self.count);
        let root = match root {
            Some(root) => rank_of(c, kind, "root", root)?,
            None => 0,
        };
        raw = raw.with_root(root);
        if let Some(op) = op {
            raw = raw.with_op(op_of(h, kind, op)?);
        }
        let call = Call {
            op: raw,
            send: self.send,
            send_bytes: bytes,
            recv: self.recv,
            recv_bytes: bytes,
            in_place_offset: Some(0),
        };
        let sizes = Sizes {
            rank: c.rank(),
            root,
            bytes,
            all,
        };
        // SAFETY: per the contract.
        unsafe { collective(self.comm, layout(call, sizes), self.stream) }
    }
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
    let args = Args::new(sendbuff, recvbuff, count, datatype, comm, stream);
    // SAFETY: per the contract.
    entry(|| unsafe { args.run(OpKind::AllReduce, Some(op), None, |call, _| call) })
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
    let args = Args::new(sendbuff, recvbuff, count, datatype, comm, stream);
    // SAFETY: per the contract.
    entry(|| unsafe {
        args.run(OpKind::Broadcast, None, Some(root), |call, s| {
            // Only the root reads its send buffer.
            if s.rank == s.root {
                call
            } else {
                call.without_send()
            }
        })
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
    let args = Args::new(sendbuff, recvbuff, count, datatype, comm, stream);
    // SAFETY: per the contract.
    entry(|| unsafe {
        args.run(OpKind::Reduce, Some(op), Some(root), |call, s| {
            // Only the root writes its receive buffer (which in place is the send buffer).
            if s.rank == s.root || std::ptr::eq(call.send, call.recv) {
                call
            } else {
                call.without_recv()
            }
        })
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
    let args = Args::new(sendbuff, recvbuff, sendcount, datatype, comm, stream);
    // SAFETY: per the contract.
    entry(|| unsafe {
        args.run(OpKind::AllGather, None, None, |call, s| Call {
            recv_bytes: s.all,
            in_place_offset: Some(s.rank * s.bytes),
            ..call
        })
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
    let args = Args::new(sendbuff, recvbuff, recvcount, datatype, comm, stream);
    // SAFETY: per the contract.
    entry(|| unsafe {
        args.run(OpKind::ReduceScatter, Some(op), None, |call, s| {
            let (block, all) = (s.bytes, s.all);
            let in_place = call.recv as usize == (call.send as usize).wrapping_add(s.rank * block);
            if in_place && block > 0 {
                // The whole in-place buffer starts at sendbuff.
                let whole = call.send as *mut c_void;
                Call {
                    send: whole,
                    send_bytes: all,
                    recv: whole,
                    recv_bytes: all,
                    ..call
                }
            } else {
                Call {
                    send_bytes: all,
                    recv_bytes: block,
                    in_place_offset: None,
                    ..call
                }
            }
        })
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
    let args = Args::new(sendbuff, recvbuff, count, datatype, comm, stream);
    // SAFETY: per the contract.
    entry(|| unsafe {
        args.run(OpKind::AllToAll, None, None, |call, s| Call {
            send_bytes: s.all,
            recv_bytes: s.all,
            ..call
        })
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
