//! The C ABI of weftcc: `libweftcc.so` / `libweftcc.a` and the header `include/weftcc.h`
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
//! Buffers are host memory and calls block until the operation completed on this rank (the
//! host communicator's semantics). Device buffers are served by the Rust API of
//! `weftcc-cuda`; they have no C entry points yet.
//!
//! Every entry point checks its pointers and arguments and returns `weftInvalidArgument`
//! instead of crashing; a Rust panic never crosses the boundary (it becomes
//! `weftInternalError`).

// The exported names are C's (NCCL's style): `weftResult_t`, `weftSuccess`, `weftAllReduce`.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::str::FromStr;
use weftcc_collectives::{Communicator, DataType, Error, OpKind, RawOp, ReduceOp, UniqueId};

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
/// Another rank failed, died or called a different collective.
pub const weftRemoteError: weftResult_t = 6;
pub const weftInProgress: weftResult_t = 7;
/// An operation made no progress within the timeout (`WEFT_TIMEOUT`).
pub const weftTimeout: weftResult_t = 8;
/// The communicator was aborted (`weftCommAbort` here or on another rank).
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
}

/// Handle to a communicator.
pub type weftComm_t = *mut weftComm;

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
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
}

fn set_last_error(msg: &str) {
    let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

fn fail(code: weftResult_t, msg: &str) -> weftResult_t {
    set_last_error(msg);
    code
}

/// The result code of a library error.
fn code_of(e: &Error) -> weftResult_t {
    match e {
        Error::InvalidArgument { .. } | Error::Config(_) => weftInvalidArgument,
        Error::Timeout { .. } => weftTimeout,
        Error::Aborted { .. } => weftAborted,
        Error::PeerLost { .. } | Error::Mismatch { .. } => weftRemoteError,
        Error::Transport { .. } | Error::Bootstrap { .. } => weftSystemError,
        Error::Internal { .. } => weftInternalError,
    }
}

fn from_lib(r: Result<(), Error>) -> weftResult_t {
    match r {
        Ok(()) => weftSuccess,
        Err(e) => fail(code_of(&e), &e.to_string()),
    }
}

/// Runs `f`, turning a panic into `weftInternalError` (unwinding into C is undefined).
fn guarded(f: impl FnOnce() -> weftResult_t) -> weftResult_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => fail(
            weftInternalError,
            "internal error: a panic was caught at the C boundary",
        ),
    }
}

fn dtype_of(t: c_int) -> Option<DataType> {
    u8::try_from(t).ok().and_then(DataType::from_code)
}

fn op_of(op: c_int) -> Option<ReduceOp> {
    Some(match op {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => return None,
    })
}

/// The communicator behind a handle.
///
/// # Safety
/// `comm` is null or a handle from `weftCommInit*` not yet destroyed.
unsafe fn comm_ref<'a>(comm: weftComm_t) -> Result<&'a Communicator, weftResult_t> {
    if comm.is_null() {
        return Err(fail(weftInvalidArgument, "null communicator"));
    }
    // SAFETY: non-null, and valid per the caller's contract.
    Ok(unsafe { &(*comm).comm })
}

fn bad_arg(msg: String) -> weftResult_t {
    fail(weftInvalidArgument, &msg)
}

/// Bytes of `count` elements of `dtype`, or an error naming the call.
fn byte_len(count: usize, dtype: DataType, what: &str) -> Result<usize, weftResult_t> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| bad_arg(format!("{what}: {count} elements overflow")))
}

/// Creates a new unique id: starts the bootstrap store in this process (which must stay alive
/// while ranks initialise; it becomes rank 0's, or any rank's, store).
///
/// # Safety
/// `id` is null or points to writable memory for one [`weftUniqueId`].
#[no_mangle]
pub unsafe extern "C" fn weftGetUniqueId(id: *mut weftUniqueId) -> weftResult_t {
    guarded(|| {
        if id.is_null() {
            return bad_arg("weftGetUniqueId: null id".into());
        }
        let uid = match UniqueId::new() {
            Ok(u) => u.to_string(),
            Err(e) => return fail(code_of(&e), &e.to_string()),
        };
        if uid.len() >= WEFT_UNIQUE_ID_BYTES {
            return fail(
                weftInternalError,
                &format!("unique id of {} bytes does not fit", uid.len()),
            );
        }
        let mut out = weftUniqueId {
            internal: [0; WEFT_UNIQUE_ID_BYTES],
        };
        for (dst, &b) in out.internal.iter_mut().zip(uid.as_bytes()) {
            *dst = b as c_char;
        }
        // SAFETY: `id` is non-null and writable per the contract.
        unsafe { id.write(out) };
        weftSuccess
    })
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
    guarded(|| {
        if comm.is_null() {
            return bad_arg("weftCommInitRank: null communicator pointer".into());
        }
        let (Ok(n), Ok(r)) = (usize::try_from(nranks), usize::try_from(rank)) else {
            return bad_arg(format!("weftCommInitRank: rank {rank} of {nranks}"));
        };
        if n == 0 || r >= n {
            return bad_arg(format!("weftCommInitRank: rank {rank} of {nranks}"));
        }
        let bytes: Vec<u8> = id
            .internal
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let parsed = std::str::from_utf8(&bytes)
            .map_err(|_| Error::Config("unique id is not text".into()))
            .and_then(UniqueId::from_str);
        let made = parsed.and_then(|uid| Communicator::init(r, n, &uid));
        match made {
            // SAFETY: `comm` is non-null and writable per the contract.
            Ok(c) => unsafe {
                comm.write(Box::into_raw(Box::new(weftComm { comm: c })));
                weftSuccess
            },
            Err(e) => fail(code_of(&e), &e.to_string()),
        }
    })
}

/// Creates this process's communicator from the launcher's environment (`WEFT_RANK`/`RANK`,
/// `WEFT_WORLD_SIZE`/`WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT` or `WEFT_UNIQUE_ID`, SLURM).
///
/// # Safety
/// `comm` is null or points to writable memory for one handle.
#[no_mangle]
pub unsafe extern "C" fn weftCommInitFromEnv(comm: *mut weftComm_t) -> weftResult_t {
    guarded(|| {
        if comm.is_null() {
            return bad_arg("weftCommInitFromEnv: null communicator pointer".into());
        }
        match Communicator::from_env() {
            // SAFETY: `comm` is non-null and writable per the contract.
            Ok(c) => unsafe {
                comm.write(Box::into_raw(Box::new(weftComm { comm: c })));
                weftSuccess
            },
            Err(e) => fail(code_of(&e), &e.to_string()),
        }
    })
}

/// Destroys a communicator (null is accepted and ignored). Pending group calls of it are
/// dropped.
///
/// # Safety
/// `comm` is null or a live handle, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn weftCommDestroy(comm: weftComm_t) -> weftResult_t {
    guarded(|| {
        if !comm.is_null() {
            GROUP.with(|g| g.borrow_mut().ops.retain(|op| op.comm != comm));
            // SAFETY: made by Box::into_raw in weftCommInit*, destroyed once per the contract.
            drop(unsafe { Box::from_raw(comm) });
        }
        weftSuccess
    })
}

/// Aborts a communicator: calls blocked in it (on any thread) return `weftAborted` and other
/// ranks are told. The handle must still be destroyed.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftCommAbort(comm: weftComm_t) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        match unsafe { comm_ref(comm) } {
            Ok(c) => {
                c.abort();
                weftSuccess
            }
            Err(code) => code,
        }
    })
}

/// The number of ranks.
///
/// # Safety
/// `comm` is null or a live handle; `count` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommCount(comm: weftComm_t, count: *mut c_int) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let c = match unsafe { comm_ref(comm) } {
            Ok(c) => c,
            Err(code) => return code,
        };
        if count.is_null() {
            return bad_arg("weftCommCount: null output".into());
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { count.write(c.size() as c_int) };
        weftSuccess
    })
}

/// This process's rank.
///
/// # Safety
/// `comm` is null or a live handle; `rank` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn weftCommUserRank(comm: weftComm_t, rank: *mut c_int) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let c = match unsafe { comm_ref(comm) } {
            Ok(c) => c,
            Err(code) => return code,
        };
        if rank.is_null() {
            return bad_arg("weftCommUserRank: null output".into());
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { rank.write(c.rank() as c_int) };
        weftSuccess
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
    guarded(|| {
        // SAFETY: per the contract.
        let c = match unsafe { comm_ref(comm) } {
            Ok(c) => c,
            Err(code) => return code,
        };
        if result.is_null() {
            return bad_arg("weftCommGetAsyncError: null output".into());
        }
        let r = match c.error() {
            Some(e) => fail(code_of(&e), &e.to_string()),
            None => weftSuccess,
        };
        // SAFETY: non-null and writable per the contract.
        unsafe { result.write(r) };
        weftSuccess
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

/// Runs a collective on raw host buffers. The call is in place when `send` sits at
/// `in_place_offset` bytes into `recv` (NCCL's in-place layout; `None`: never in place).
///
/// # Safety
/// `send` is readable for `send_bytes` and `recv` writable for `recv_bytes` (unless null with
/// zero bytes); `comm` is null or live.
unsafe fn collective(
    comm: weftComm_t,
    call: RawOp,
    send: *const c_void,
    send_bytes: usize,
    recv: *mut c_void,
    recv_bytes: usize,
    in_place_offset: Option<usize>,
) -> weftResult_t {
    // SAFETY: per the contract.
    let c = match unsafe { comm_ref(comm) } {
        Ok(c) => c,
        Err(code) => return code,
    };
    let name = call.kind;
    if (send.is_null() && send_bytes > 0) || (recv.is_null() && recv_bytes > 0) {
        return bad_arg(format!("{name}: null buffer"));
    }
    let (s, r) = (send as usize, recv as usize);
    let in_place = in_place_offset.is_some_and(|o| s == r.wrapping_add(o)) && recv_bytes > 0;
    let overlap = s < r.saturating_add(recv_bytes) && r < s.saturating_add(send_bytes);
    if !in_place && overlap {
        return bad_arg(format!(
            "{name}: send and receive buffers overlap other than in NCCL's in-place layout"
        ));
    }
    let recv_slice: &mut [u8] = if recv_bytes == 0 {
        &mut []
    } else {
        // SAFETY: non-null, writable for recv_bytes per the contract.
        unsafe { std::slice::from_raw_parts_mut(recv.cast::<u8>(), recv_bytes) }
    };
    if in_place {
        return from_lib(c.execute_raw(call, None, recv_slice));
    }
    let send_slice: &[u8] = if send_bytes == 0 {
        &[]
    } else {
        // SAFETY: non-null, readable for send_bytes per the contract, disjoint from recv
        // (checked above).
        unsafe { std::slice::from_raw_parts(send.cast::<u8>(), send_bytes) }
    };
    from_lib(c.execute_raw(call, Some(send_slice), recv_slice))
}

/// Checked type and op of a call.
fn call_of(
    kind: OpKind,
    count: usize,
    datatype: c_int,
    op: Option<c_int>,
) -> Result<(RawOp, DataType), weftResult_t> {
    let dtype =
        dtype_of(datatype).ok_or_else(|| bad_arg(format!("{kind}: data type {datatype}")))?;
    let mut call = RawOp::new(kind, dtype, count);
    if let Some(op) = op {
        call = call.with_op(op_of(op).ok_or_else(|| bad_arg(format!("{kind}: reduction {op}")))?);
    }
    Ok((call, dtype))
}

fn root_of(kind: OpKind, root: c_int) -> Result<usize, weftResult_t> {
    usize::try_from(root).map_err(|_| bad_arg(format!("{kind}: root {root}")))
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
) -> weftResult_t {
    guarded(|| {
        let kind = OpKind::AllReduce;
        let (call, dt) = match call_of(kind, count, datatype, Some(op)) {
            Ok(x) => x,
            Err(code) => return code,
        };
        let bytes = match byte_len(count, dt, "all-reduce") {
            Ok(b) => b,
            Err(code) => return code,
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, sendbuff, bytes, recvbuff, bytes, Some(0)) }
    })
}

/// Broadcast of `count` elements from `root`'s `sendbuff` into every `recvbuff` (`sendbuff` is
/// read on the root only; in place when equal).
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
) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let me = match unsafe { comm_ref(comm) } {
            Ok(c) => c.rank(),
            Err(code) => return code,
        };
        let kind = OpKind::Broadcast;
        let (call, dt) = match call_of(kind, count, datatype, None) {
            Ok(x) => x,
            Err(code) => return code,
        };
        let (root, bytes) = match (root_of(kind, root), byte_len(count, dt, "broadcast")) {
            (Ok(r), Ok(b)) => (r, b),
            (Err(code), _) | (_, Err(code)) => return code,
        };
        // Only the root reads `sendbuff` (others may pass anything, NULL included).
        let (send, send_bytes) = if me == root {
            (sendbuff, bytes)
        } else {
            (std::ptr::null(), 0)
        };
        let call = call.with_root(root);
        // SAFETY: per the contract.
        unsafe { collective(comm, call, send, send_bytes, recvbuff, bytes, Some(0)) }
    })
}

/// Reduce of `count` elements into `root`'s `recvbuff` (not written elsewhere).
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
) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let me = match unsafe { comm_ref(comm) } {
            Ok(c) => c.rank(),
            Err(code) => return code,
        };
        let kind = OpKind::Reduce;
        let (call, dt) = match call_of(kind, count, datatype, Some(op)) {
            Ok(x) => x,
            Err(code) => return code,
        };
        let (root, bytes) = match (root_of(kind, root), byte_len(count, dt, "reduce")) {
            (Ok(r), Ok(b)) => (r, b),
            (Err(code), _) | (_, Err(code)) => return code,
        };
        let call = call.with_root(root);
        if me != root && !std::ptr::eq(sendbuff, recvbuff) {
            // Only the root writes `recvbuff` (others may pass anything, NULL included).
            // SAFETY: per the contract.
            return unsafe {
                collective(comm, call, sendbuff, bytes, std::ptr::null_mut(), 0, None)
            };
        }
        // SAFETY: per the contract.
        unsafe { collective(comm, call, sendbuff, bytes, recvbuff, bytes, Some(0)) }
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
) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let c = match unsafe { comm_ref(comm) } {
            Ok(c) => c,
            Err(code) => return code,
        };
        let kind = OpKind::AllGather;
        let (call, dt) = match call_of(kind, sendcount, datatype, None) {
            Ok(x) => x,
            Err(code) => return code,
        };
        let (n, me) = (c.size(), c.rank());
        let (block, all) = match byte_len(sendcount, dt, "all-gather")
            .and_then(|b| Ok((b, byte_len(sendcount * n, dt, "all-gather")?)))
        {
            Ok(x) => x,
            Err(code) => return code,
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, sendbuff, block, recvbuff, all, Some(me * block)) }
    })
}

/// Reduce-scatter: rank r's `recvbuff` (`recvcount`) holds block r of the reduction of every
/// `sendbuff` (nranks × `recvcount`); in place when `recvbuff == sendbuff + rank × recvcount`
/// elements (pass `sendbuff` as both pointers' base, as NCCL does).
///
/// # Safety
/// `sendbuff` readable for nranks × `recvcount` elements, `recvbuff` writable for `recvcount`.
#[no_mangle]
pub unsafe extern "C" fn weftReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: weftDataType_t,
    op: weftRedOp_t,
    comm: weftComm_t,
) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let c = match unsafe { comm_ref(comm) } {
            Ok(c) => c,
            Err(code) => return code,
        };
        let kind = OpKind::ReduceScatter;
        let (call, dt) = match call_of(kind, recvcount, datatype, Some(op)) {
            Ok(x) => x,
            Err(code) => return code,
        };
        let (n, me) = (c.size(), c.rank());
        let (block, all) = match byte_len(recvcount, dt, "reduce-scatter")
            .and_then(|b| Ok((b, byte_len(recvcount * n, dt, "reduce-scatter")?)))
        {
            Ok(x) => x,
            Err(code) => return code,
        };
        if recvbuff as usize == (sendbuff as usize).wrapping_add(me * block) && block > 0 {
            // In place: the whole buffer starts at sendbuff.
            let whole = sendbuff as *mut c_void;
            // SAFETY: per the contract, sendbuff is the whole in-place buffer, writable.
            return unsafe { collective(comm, call, whole, all, whole, all, Some(0)) };
        }
        // SAFETY: per the contract.
        unsafe { collective(comm, call, sendbuff, all, recvbuff, block, None) }
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
) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        let c = match unsafe { comm_ref(comm) } {
            Ok(c) => c,
            Err(code) => return code,
        };
        let kind = OpKind::AllToAll;
        let (call, dt) = match call_of(kind, count, datatype, None) {
            Ok(x) => x,
            Err(code) => return code,
        };
        let all = match byte_len(count.saturating_mul(c.size()), dt, "all-to-all") {
            Ok(b) => b,
            Err(code) => return code,
        };
        // SAFETY: per the contract.
        unsafe { collective(comm, call, sendbuff, all, recvbuff, all, Some(0)) }
    })
}

/// Blocks until every rank called it.
///
/// # Safety
/// `comm` is null or a live handle.
#[no_mangle]
pub unsafe extern "C" fn weftBarrier(comm: weftComm_t) -> weftResult_t {
    guarded(|| {
        // SAFETY: per the contract.
        match unsafe { comm_ref(comm) } {
            Ok(c) => from_lib(c.barrier()),
            Err(code) => code,
        }
    })
}

/// Starts (or nests) a group: `weftSend`/`weftRecv` calls are collected until the matching
/// `weftGroupEnd`, which runs them together (so ranks can exchange without deadlock).
#[no_mangle]
pub extern "C" fn weftGroupStart() -> weftResult_t {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    weftSuccess
}

/// Ends a group; the outermost one runs the collected sends and receives, one group per
/// communicator, and returns when they completed.
#[no_mangle]
pub extern "C" fn weftGroupEnd() -> weftResult_t {
    guarded(|| {
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
        let Some(ops) = ops else {
            return fail(weftInvalidUsage, "weftGroupEnd without weftGroupStart");
        };
        let mut comms: Vec<weftComm_t> = Vec::new();
        for op in &ops {
            if !comms.contains(&op.comm) {
                comms.push(op.comm);
            }
        }
        for comm in comms {
            // SAFETY: the handles were live when the calls were collected, and a destroyed
            // communicator's calls were dropped from the group (weftCommDestroy).
            let r = unsafe { run_group(comm, ops.iter().filter(|op| op.comm == comm)) };
            if r != weftSuccess {
                return r;
            }
        }
        weftSuccess
    })
}

/// Runs one communicator's collected point-to-point calls as one group.
///
/// # Safety
/// `comm` is live; every op's pointer is valid for its bytes (read for sends, written for
/// receives) and receive buffers do not overlap anything else in the group.
unsafe fn run_group<'a>(comm: weftComm_t, ops: impl Iterator<Item = &'a P2p>) -> weftResult_t {
    // SAFETY: per the contract.
    let c = match unsafe { comm_ref(comm) } {
        Ok(c) => c,
        Err(code) => return code,
    };
    let ops: Vec<&P2p> = ops.collect();
    // A receive buffer may share no byte with any other buffer of the group (Rust slices of
    // them would alias); sends may share with each other.
    for (i, a) in ops.iter().enumerate() {
        for b in &ops[i + 1..] {
            let overlap =
                a.ptr < b.ptr.saturating_add(b.bytes) && b.ptr < a.ptr.saturating_add(a.bytes);
            if overlap && (!a.send || !b.send) && a.bytes > 0 && b.bytes > 0 {
                return bad_arg(format!(
                    "{}: a receive buffer overlaps another buffer of the group",
                    OpKind::SendRecv
                ));
            }
        }
    }
    let mut group = c.group();
    for op in ops {
        if op.bytes == 0 {
            group = if op.send {
                group.send::<u8>(&[], op.peer)
            } else {
                group.recv::<u8>(&mut [], op.peer)
            };
            continue;
        }
        group = if op.send {
            // SAFETY: readable for op.bytes per the contract.
            let s = unsafe { std::slice::from_raw_parts(op.ptr as *const u8, op.bytes) };
            group.send(s, op.peer)
        } else {
            // SAFETY: writable for op.bytes and not aliased per the contract.
            let r = unsafe { std::slice::from_raw_parts_mut(op.ptr as *mut u8, op.bytes) };
            group.recv(r, op.peer)
        };
    }
    from_lib(group.run())
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
) -> weftResult_t {
    // SAFETY: per the contract.
    unsafe { point_to_point(true, sendbuff as *mut c_void, count, datatype, peer, comm) }
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
) -> weftResult_t {
    // SAFETY: per the contract.
    unsafe { point_to_point(false, recvbuff, count, datatype, peer, comm) }
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
) -> weftResult_t {
    guarded(|| {
        let kind = OpKind::SendRecv;
        // SAFETY: per the contract.
        if let Err(code) = unsafe { comm_ref(comm) } {
            return code;
        }
        let Some(dt) = dtype_of(datatype) else {
            return bad_arg(format!("{kind}: data type {}", datatype));
        };
        let bytes = match byte_len(count, dt, "send/recv") {
            Ok(b) => b,
            Err(code) => return code,
        };
        if buf.is_null() && bytes > 0 {
            return bad_arg(format!("{kind}: null buffer"));
        }
        let Ok(peer) = usize::try_from(peer) else {
            return bad_arg(format!("{kind}: peer {peer}"));
        };
        let op = P2p {
            comm,
            send,
            ptr: buf as usize,
            bytes,
            peer,
        };
        let grouped = GROUP.with(move |g| {
            let mut g = g.borrow_mut();
            if g.depth > 0 {
                g.ops.push(op);
                None
            } else {
                Some(op)
            }
        });
        match grouped {
            None => weftSuccess,
            // SAFETY: per the contract.
            Some(op) => unsafe { run_group(comm, std::iter::once(&op)) },
        }
    })
}
