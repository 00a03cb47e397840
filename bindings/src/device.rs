//! Device buffers and streams (`weftStream_t`, a `cudaStream_t`): the device communicator made
//! by the first call with a stream, the checks that buffers and stream belong to its GPU, and
//! the enqueueing of a collective.

use std::ffi::c_void;
use std::sync::Arc;

use weftcc_collectives::{OpKind, RawOp};
use weftcc_comm::Communicator;
use weftcc_cuda::{Context, CudaError, DeviceComm, Stream};

use crate::boundary::Outcome;
use crate::codes::{weftAborted, weftInternalError, weftResult_t, weftSuccess};
use crate::errors::{bad_arg, code_of, cuda_fail, fail, lib_fail, record};
use crate::handle::weftComm;

/// A `cudaStream_t` (equally a driver `CUstream`) of the buffers' device. NULL: the buffers are
/// host memory and the call returns once the operation completed on this rank. Otherwise the
/// buffers are device memory and the call enqueues the operation on the stream and returns
/// (NCCL's semantics): work enqueued on the stream afterwards sees the result; errors of the
/// operation itself are reported by [`weftCommGetAsyncError`].
pub type weftStream_t = *mut c_void;

/// A device call's failure on `h`: `weftAborted` after `weftCommAbort` here (the device
/// communicator only knows it was poisoned), else the device error's own code.
pub(crate) fn device_fail(h: &weftComm, e: &CudaError) -> weftResult_t {
    match h.comm.error() {
        Some(host) if code_of(&host) == weftAborted => {
            record(weftAborted, &e.to_string(), e.facts())
        }
        _ => cuda_fail(e),
    }
}

/// The device communicator of `h`, made by the first call with a stream (collective: every
/// rank's first device call is the same call, as for any collective) on the device that
/// `buffer` lies on: a split of the host communicator, so that host and device calls never
/// share a sequence of operations.
fn device_comm(h: &weftComm, kind: OpKind, buffer: u64) -> Result<Arc<DeviceComm>, weftResult_t> {
    let mut slot = h.device.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = &*slot {
        return Ok(d.clone());
    }
    let c = &h.comm;
    let ordinal = device_of(c, kind, buffer)?;
    let ctx = Context::new(ordinal).map_err(|e| cuda_fail(&e))?;
    let own = c
        .split(Some(0), c.rank() as i64)
        .map_err(|e| lib_fail(&e))?
        .ok_or_else(|| {
            fail(
                weftInternalError,
                "split with a colour gave no communicator",
            )
        })?;
    let d = Arc::new(DeviceComm::new(own, ctx).map_err(|e| cuda_fail(&e))?);
    *slot = Some(d.clone());
    Ok(d)
}

/// The GPU that `buffer` lies on; an invalid argument if it is not device memory.
fn device_of(c: &Communicator, kind: OpKind, buffer: u64) -> Result<usize, weftResult_t> {
    weftcc_cuda::device_of(buffer)
        .map_err(|e| cuda_fail(&e))?
        .ok_or_else(|| {
            bad_arg(format!(
                "rank {}: invalid argument to {kind}: a stream was given but the buffer at \
                 {buffer:#x} is not device memory",
                c.rank()
            ))
        })
}

/// Checks that every non-empty buffer of a device call lies on `d`'s GPU (a host pointer
/// handed to the GPU would fault there, not fail here).
pub(crate) fn check_on_device(
    h: &weftComm,
    d: &DeviceComm,
    kind: OpKind,
    buffers: &[(u64, usize)],
) -> Result<(), weftResult_t> {
    let mine = d.context().ordinal();
    for &(ptr, _) in buffers.iter().filter(|b| b.1 > 0) {
        let on = device_of(&h.comm, kind, ptr)?;
        if on != mine {
            return Err(bad_arg(format!(
                "rank {}: invalid argument to {kind}: the buffer at {ptr:#x} is on GPU {on}, \
                 the communicator's device calls use GPU {mine}",
                h.comm.rank()
            )));
        }
    }
    Ok(())
}

/// Refuses device memory given without a stream (the host path would read it from the CPU and
/// crash): NCCL programs pass 0 for the default stream, which here means host buffers.
pub(crate) fn refuse_device_memory(
    c: &Communicator,
    kind: OpKind,
    buffers: &[(u64, usize)],
) -> Result<(), weftResult_t> {
    if !weftcc_cuda::driver_present() {
        return Ok(());
    }
    for &(ptr, _) in buffers.iter().filter(|b| b.0 != 0 && b.1 > 0) {
        if let Ok(Some(gpu)) = weftcc_cuda::device_of(ptr) {
            return Err(bad_arg(format!(
                "rank {}: invalid argument to {kind}: the buffer at {ptr:#x} is memory of GPU \
                 {gpu} but no stream was given (NULL means host buffers; pass the cudaStream_t \
                 to enqueue on)",
                c.rank()
            )));
        }
    }
    Ok(())
}

/// The caller's stream, borrowed for one call; an invalid argument if it is not a stream of the
/// device communicator's GPU (its primary context, where the CUDA runtime makes streams).
///
/// # Safety
/// `stream` is a live stream.
pub(crate) unsafe fn borrow_stream(
    h: &weftComm,
    d: &DeviceComm,
    kind: OpKind,
    stream: weftStream_t,
) -> Result<Stream, weftResult_t> {
    // SAFETY: per the contract; the value lives only for the call.
    unsafe { Stream::borrow_checked(d.context(), stream.cast()) }.map_err(|e| {
        bad_arg(format!(
            "rank {}: invalid argument to {kind}: {e}",
            h.comm.rank()
        ))
    })
}

/// Enqueues a checked collective on device buffers (`send: None` in place).
///
/// # Safety
/// As [`collective`] with a stream.
pub(crate) unsafe fn device_collective(
    h: &weftComm,
    op: RawOp,
    send: Option<(u64, usize)>,
    recv: (u64, usize),
    stream: weftStream_t,
) -> Outcome {
    if recv.1 == 0 && send.is_none_or(|s| s.1 == 0) {
        // Nothing to move (NCCL allows null buffers here), and no device to learn it from.
        return Ok(weftSuccess);
    }
    // A reduce's non-root may pass no receive buffer: learn the device from the send buffer.
    let probe = if recv.0 != 0 {
        recv.0
    } else {
        send.map_or(0, |s| s.0)
    };
    let d = device_comm(h, op.kind, probe)?;
    // A reduce's non-root and a broadcast's non-root pass buffers nobody reads or writes.
    let used_send = send.filter(|_| !(op.kind == OpKind::Broadcast && op.root != h.comm.rank()));
    let used_recv = Some(recv).filter(|_| !(op.kind == OpKind::Reduce && op.root != h.comm.rank()));
    let buffers: Vec<(u64, usize)> = used_send.into_iter().chain(used_recv).collect();
    check_on_device(h, &d, op.kind, &buffers)?;
    // SAFETY: per the contract.
    let s = unsafe { borrow_stream(h, &d, op.kind, stream) }?;
    // SAFETY: device buffers valid until the stream passed the call, per the contract.
    unsafe { d.enqueue_raw(op, send, recv, &s) }
        .map(|()| weftSuccess)
        .map_err(|e| device_fail(h, &e))
}
