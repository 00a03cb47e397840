//! Groups and point-to-point: `weftSend`/`weftRecv`, run at once or collected between
//! `weftGroupStart` and `weftGroupEnd` and run together, on host buffers or on a stream.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};

use weftcc_collectives::{CallError, OpKind};

use crate::boundary::{
    byte_len, comm_ref, dtype_of, entry, from_lib, handle_ref, rank_of, Outcome,
};
use crate::codes::{weftDataType_t, weftInvalidUsage, weftResult_t, weftSuccess};
use crate::device::{
    borrow_stream, check_on_device, device_fail, refuse_device_memory, weftStream_t,
};
use crate::errors::{arg_error, fail};
use crate::handle::weftComm_t;

thread_local! {
    /// Point-to-point calls collected between weftGroupStart and weftGroupEnd.
    static GROUP: RefCell<Nesting<Vec<P2p>>> = RefCell::new(Nesting::default());
}

/// A thread's open groups (NCCL's semantics: groups nest, calls inside one are collected, the
/// outermost end runs them) and what they collected. The NCCL drop-in keeps its groups in one too.
#[derive(Default)]
pub struct Nesting<T> {
    depth: usize,
    collected: T,
}

impl<T: Default> Nesting<T> {
    /// A group start.
    pub fn start(&mut self) {
        self.depth += 1;
    }

    /// A group end: `None` without an open group; else what was collected at the outermost end
    /// (nothing, `T::default()`, at an inner one).
    pub fn end(&mut self) -> Option<T> {
        self.depth = self.depth.checked_sub(1)?;
        Some(match self.depth {
            0 => std::mem::take(&mut self.collected),
            _ => T::default(),
        })
    }

    /// What the open group collected, to add to; `None` outside any group.
    pub fn open(&mut self) -> Option<&mut T> {
        (self.depth > 0).then_some(&mut self.collected)
    }
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

/// Drops the calls of `comm` collected in this thread's group (the communicator is being
/// destroyed).
pub(crate) fn drop_calls_of(comm: weftComm_t) {
    GROUP.with(|g| g.borrow_mut().collected.retain(|op| op.comm != comm));
}

/// Starts (or nests) a group: `weftSend`/`weftRecv` calls are collected until the matching
/// `weftGroupEnd`, which runs them together (so ranks can exchange without deadlock).
#[no_mangle]
pub extern "C" fn weftGroupStart() -> weftResult_t {
    GROUP.with(|g| g.borrow_mut().start());
    weftSuccess
}

/// Ends a group; the outermost one runs the collected sends and receives, one group per
/// communicator, and returns when they completed (at the first failure, the remaining
/// communicators' calls are dropped).
#[no_mangle]
pub extern "C" fn weftGroupEnd() -> weftResult_t {
    entry(|| {
        let ops = GROUP.with(|g| g.borrow_mut().end());
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
    let now = GROUP.with(move |g| match g.borrow_mut().open() {
        Some(ops) => {
            ops.push(op);
            None
        }
        None => Some(op),
    });
    match now {
        None => Ok(weftSuccess),
        // SAFETY: per the contract.
        Some(op) => unsafe { run_group(comm, &[&op]) },
    }
}
