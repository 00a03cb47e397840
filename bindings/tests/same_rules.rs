//! Host, device and C ABI reject the same invalid calls with the same reason: the core's
//! `CallError` (`weftcc_collectives::call`), which all three paths use. Each case runs through
//! the host communicator's public API, the C functions (as C calls them) and, where a GPU and
//! its driver exist, the device communicator; the reasons must be equal.

use std::ffi::{c_void, CStr};
use weft::{
    weftBroadcast, weftCommDestroy, weftCommInitRank, weftComm_t, weftFloat32, weftGetLastError,
    weftGetUniqueId, weftInvalidArgument, weftReduce, weftSend, weftSum, weftUniqueId,
};
use weftcc_collectives::{CallError, DataType, ReduceOp};
use weftcc_comm::{Communicator, Error};

/// A one-rank communicator through the C ABI.
fn c_comm() -> weftComm_t {
    let mut id = weftUniqueId {
        internal: [0; weft::WEFT_UNIQUE_ID_BYTES],
    };
    let mut comm: weftComm_t = std::ptr::null_mut();
    // SAFETY: `id` and `comm` are writable out-parameters.
    unsafe {
        assert_eq!(weftGetUniqueId(&mut id), 0);
        assert_eq!(weftCommInitRank(&mut comm, 1, id, 0), 0);
    }
    comm
}

fn c_last_error(comm: weftComm_t) -> String {
    // SAFETY: weftGetLastError returns a NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(weftGetLastError(comm)) }
        .to_string_lossy()
        .into_owned()
}

fn host_reason(r: weftcc_comm::Result<()>) -> CallError {
    match r {
        Err(Error::InvalidArgument { reason, .. }) => reason,
        other => panic!("host: expected an invalid argument, got {other:?}"),
    }
}

/// What the device path says about the same call, when a GPU is here.
fn device_reason(
    call: impl FnOnce(&weftcc_cuda::DeviceComm) -> weftcc_cuda::Result<()>,
) -> Option<CallError> {
    if !weftcc_cuda::driver::driver_present()
        || weftcc_cuda::driver::device_count().unwrap_or(0) == 0
    {
        return None;
    }
    let host = Communicator::init(0, 1, &weftcc_comm::UniqueId::new().ok()?).ok()?;
    let ctx = weftcc_cuda::Context::new(0).ok()?;
    let dev = weftcc_cuda::DeviceComm::new(host, ctx).ok()?;
    match call(&dev) {
        Err(weftcc_cuda::CudaError::InvalidArgument {
            reason: weftcc_cuda::DeviceArgError::Call(r),
            ..
        }) => Some(r),
        other => panic!("device: expected an invalid argument, got {other:?}"),
    }
}

#[test]
fn host_device_and_c_abi_give_the_same_reasons() {
    let host = Communicator::init(0, 1, &weftcc_comm::UniqueId::new().unwrap()).unwrap();
    let comm = c_comm();
    let (x, mut y) = ([1.0f32; 4], [0.0f32; 4]);
    let (xp, yp) = (x.as_ptr().cast::<c_void>(), y.as_mut_ptr().cast::<c_void>());
    let mut gpu_checked = 0;

    // Root out of range (broadcast and reduce).
    let want = CallError::RootOutOfRange { root: 3, nranks: 1 };
    assert_eq!(host_reason(host.broadcast(&x, &mut y, 3)), want);
    // SAFETY: buffers of 4 floats, a live communicator.
    let rc = unsafe { weftBroadcast(xp, yp, 4, weftFloat32, 3, comm, std::ptr::null_mut()) };
    assert_eq!(rc, weftInvalidArgument);
    assert!(
        c_last_error(comm).ends_with(&want.to_string()),
        "{}",
        c_last_error(comm)
    );
    assert_eq!(host_reason(host.reduce(&x, &mut y, ReduceOp::Sum, 3)), want);
    // SAFETY: as above.
    let rc = unsafe {
        weftReduce(
            xp,
            yp,
            4,
            weftFloat32,
            weftSum,
            3,
            comm,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, weftInvalidArgument);
    assert!(c_last_error(comm).ends_with(&want.to_string()));
    if let Some(r) = device_reason(|d| {
        let ctx = d.context();
        let (s, mut r) = (ctx.alloc_zeroed::<f32>(4)?, ctx.alloc_zeroed::<f32>(4)?);
        d.broadcast(&s, &mut r, 3, &ctx.stream()?)
    }) {
        assert_eq!(r, want);
        gpu_checked += 1;
    }

    // Point-to-point partner out of range, and this rank itself.
    for (peer, want) in [
        (1, CallError::PeerOutOfRange { peer: 1, nranks: 1 }),
        (0, CallError::SelfPeer { peer: 0 }),
    ] {
        assert_eq!(host_reason(host.send(&x, peer)), want);
        // SAFETY: a buffer of 4 floats, a live communicator.
        let rc = unsafe { weftSend(xp, 4, weftFloat32, peer as i32, comm, std::ptr::null_mut()) };
        assert_eq!(rc, weftInvalidArgument);
        assert!(
            c_last_error(comm).ends_with(&want.to_string()),
            "{}",
            c_last_error(comm)
        );
        if let Some(r) = device_reason(|d| {
            let ctx = d.context();
            let s = ctx.alloc_zeroed::<f32>(4)?;
            d.send(&s, peer, &ctx.stream()?)
        }) {
            assert_eq!(r, want);
            gpu_checked += 1;
        }
    }

    // Lengths: only the typed APIs have them (C passes a count); host and device alike.
    let want = CallError::RecvLength {
        got: 16,
        expected: 12,
        dtype: DataType::Float32,
    };
    assert_eq!(
        host_reason(host.all_reduce(&x[..3], &mut y, ReduceOp::Sum)),
        want
    );
    if let Some(r) = device_reason(|d| {
        let ctx = d.context();
        let (s, mut r) = (ctx.alloc_zeroed::<f32>(3)?, ctx.alloc_zeroed::<f32>(4)?);
        d.all_reduce(&s, &mut r, ReduceOp::Sum, &ctx.stream()?)
    }) {
        assert_eq!(r, want);
        gpu_checked += 1;
    }

    // SAFETY: a live communicator, destroyed once.
    unsafe { weftCommDestroy(comm) };
    if gpu_checked == 0 {
        println!("device path: not run (no CUDA driver or GPU here); host and C ABI checked");
    }
}

/// `weftErrorInfo_t::op` uses the core's operation codes: each C constant is its kind's code.
#[test]
fn error_info_op_codes_are_the_cores() {
    use weftcc_collectives::OpKind;
    let c = [
        (weft::weftOpAllReduce, OpKind::AllReduce),
        (weft::weftOpReduce, OpKind::Reduce),
        (weft::weftOpBroadcast, OpKind::Broadcast),
        (weft::weftOpAllGather, OpKind::AllGather),
        (weft::weftOpReduceScatter, OpKind::ReduceScatter),
        (weft::weftOpAllToAll, OpKind::AllToAll),
        (weft::weftOpSendRecv, OpKind::SendRecv),
        (weft::weftOpBarrier, OpKind::Barrier),
    ];
    assert_eq!(c.len(), OpKind::ALL.len());
    for (code, kind) in c {
        assert_eq!(code, i32::from(kind as u8), "{kind}");
    }
    assert!(OpKind::from_code(weft::weftOpNone as u8).is_none());
}
