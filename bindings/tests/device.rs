//! The C ABI with device buffers and streams (NCCL's `cudaStream_t` argument). Without a CUDA
//! driver (or device) the test prints "skipped: no CUDA driver" and passes (the driverless error
//! path is checked by `c/ranks.c`); with one, rank processes (this binary, re-started with the
//! ignored `child` test) call every collective and a send/recv group through the C entry points
//! on device buffers, enqueued on a stream, and check the results: on one host (CUDA IPC) and
//! on two "hosts" (`WEFT_HOST_ID`: CUDA IPC inside, staged between).

use std::process::{Command, Stdio};
use std::ptr::null_mut;
use std::time::Duration;
use weft::*;
use weftcc_cuda::{Context, DeviceBuffer, Stream};
use weftcc_testkit::ranks::{wait_ranks, Finished};

const CHILD: &str = "WEFT_DEVICE_TEST_CHILD";

fn skip() -> bool {
    weftcc_cuda::testing::skip_without_device()
}

/// Runs the child on one process per entry of `hosts` (rank r on host `hosts[r]`).
fn run_ranks_on(hosts: &[usize]) {
    let n = hosts.len();
    let exe = std::env::current_exe().expect("test binary");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            let kid = Command::new(&exe)
                .args(["child", "--exact", "--ignored", "--nocapture"])
                .env(CHILD, "1")
                .env("WEFT_RANK", r.to_string())
                .env("WEFT_WORLD_SIZE", n.to_string())
                .env("WEFT_MASTER_ADDR", "127.0.0.1")
                .env("WEFT_MASTER_PORT", port.to_string())
                .env("WEFT_JOB_TOKEN", format!("weft-device-abi-{port}"))
                .env("WEFT_HOST_ID", format!("abi-host-{}", hosts[r]))
                .env("WEFT_TIMEOUT", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank");
            (r, kid)
        })
        .collect();
    let Finished { failed, report } = wait_ranks(kids, Duration::from_secs(240));
    assert!(
        failed.is_empty(),
        "hosts {hosts:?}: ranks {failed:?} failed\n{report}"
    );
    println!("C ABI device calls on hosts {hosts:?}: ok");
}

#[test]
fn device_buffers_through_the_c_abi() {
    if skip() {
        return;
    }
    run_ranks_on(&[0, 0]);
    run_ranks_on(&[0, 0, 1, 1]);
}

fn ok(what: &str, rc: weftResult_t, comm: weftComm_t) {
    // SAFETY: weftGetLastError returns a NUL-terminated string valid until the next call.
    let message = unsafe { std::ffi::CStr::from_ptr(weftGetLastError(comm)) };
    assert_eq!(rc, weftSuccess, "{what}: {rc}: {message:?}");
}

/// Checks a call's result, then waits for its stream.
fn synced(what: &str, rc: weftResult_t, comm: weftComm_t, stream: &Stream) {
    ok(what, rc, comm);
    stream.synchronize(Duration::from_secs(60)).expect("sync");
}

fn ptr<T: weftcc_collectives::Element>(b: &DeviceBuffer<T>) -> *mut std::ffi::c_void {
    b.device_ptr() as *mut std::ffi::c_void
}

#[test]
#[ignore = "entry point of the rank processes of device_buffers_through_the_c_abi"]
fn child() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let mut comm: weftComm_t = null_mut();
    // SAFETY: a writable handle slot.
    ok("init", unsafe { weftCommInitFromEnv(&mut comm) }, comm);
    let (mut n, mut me) = (0, 0);
    // SAFETY: a live handle and writable outputs.
    unsafe {
        ok("count", weftCommCount(comm, &mut n), comm);
        ok("rank", weftCommUserRank(comm, &mut me), comm);
    }
    let (n, me) = (n as usize, me as usize);
    let ctx = Context::new(0).expect("context");
    let stream: Stream = ctx.stream().expect("stream");
    let s = stream.as_raw() as weftStream_t;
    let len = 1037usize;
    let mine: Vec<f32> = (0..len).map(|i| (me * 3 + i % 7) as f32).collect();
    let of = |r: usize, i: usize| (r * 3 + i % 7) as f32;
    let send = ctx.upload(&mine).expect("upload");
    let mut recv = ctx.alloc::<f32>(len).expect("alloc");
    let all = ctx.alloc::<f32>(len * n).expect("alloc");
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe { weftAllReduce(ptr(&send), ptr(&recv), len, weftFloat32, weftSum, comm, s) };
    synced("all-reduce", rc, comm, &stream);
    let want: Vec<f32> = (0..len).map(|i| (0..n).map(|r| of(r, i)).sum()).collect();
    assert_eq!(
        recv.to_vec().expect("download"),
        want,
        "rank {me}: all-reduce"
    );
    // In place, Avg.
    recv.copy_from_device(&send, &stream).expect("copy");
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe { weftAllReduce(ptr(&recv), ptr(&recv), len, weftFloat32, weftAvg, comm, s) };
    synced("all-reduce avg", rc, comm, &stream);
    let got = recv.to_vec().expect("download");
    for (i, g) in got.iter().enumerate() {
        assert!(
            (g - want[i] / n as f32).abs() < 1e-5,
            "rank {me}: avg element {i}: {g}"
        );
    }
    // Broadcast from the last rank, all-gather, reduce to rank 0 (others pass no receive
    // buffer), reduce-scatter, all-to-all.
    let root = n - 1;
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe {
        weftBroadcast(
            ptr(&send),
            ptr(&recv),
            len,
            weftFloat32,
            root as i32,
            comm,
            s,
        )
    };
    synced("broadcast", rc, comm, &stream);
    let want: Vec<f32> = (0..len).map(|i| of(root, i)).collect();
    assert_eq!(
        recv.to_vec().expect("download"),
        want,
        "rank {me}: broadcast"
    );
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe { weftAllGather(ptr(&send), ptr(&all), len, weftFloat32, comm, s) };
    synced("all-gather", rc, comm, &stream);
    let want: Vec<f32> = (0..n)
        .flat_map(|r| (0..len).map(move |i| of(r, i)))
        .collect();
    assert_eq!(
        all.to_vec().expect("download"),
        want,
        "rank {me}: all-gather"
    );
    let out = if me == 0 { ptr(&recv) } else { null_mut() };
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe { weftReduce(ptr(&send), out, len, weftFloat32, weftMax, 0, comm, s) };
    synced("reduce", rc, comm, &stream);
    if me == 0 {
        let want: Vec<f32> = (0..len).map(|i| of(n - 1, i)).collect();
        assert_eq!(recv.to_vec().expect("download"), want, "rank 0: reduce max");
    }
    // all holds every rank's block now; reduce-scatter it (block me = n × block me).
    let block = len;
    let part = ctx.alloc::<f32>(block).expect("alloc");
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc =
        unsafe { weftReduceScatter(ptr(&all), ptr(&part), block, weftFloat32, weftSum, comm, s) };
    synced("reduce-scatter", rc, comm, &stream);
    let want: Vec<f32> = (0..block).map(|i| of(me, i) * n as f32).collect();
    assert_eq!(
        part.to_vec().expect("download"),
        want,
        "rank {me}: reduce-scatter"
    );
    let a2a: Vec<f32> = (0..n * 5).map(|i| (me * 100 + i) as f32).collect();
    let a2a_send = ctx.upload(&a2a).expect("upload");
    let a2a_recv = ctx.alloc::<f32>(n * 5).expect("alloc");
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe { weftAllToAll(ptr(&a2a_send), ptr(&a2a_recv), 5, weftFloat32, comm, s) };
    synced("all-to-all", rc, comm, &stream);
    let want: Vec<f32> = (0..n)
        .flat_map(|r| (0..5).map(move |j| (r * 100 + me * 5 + j) as f32))
        .collect();
    assert_eq!(
        a2a_recv.to_vec().expect("download"),
        want,
        "rank {me}: all-to-all"
    );
    // A ring shift in one group.
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let inbox = ctx.alloc::<f32>(len).expect("alloc");
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    unsafe {
        ok("group start", weftGroupStart(), comm);
        ok(
            "send",
            weftSend(ptr(&send), len, weftFloat32, next as i32, comm, s),
            comm,
        );
        ok(
            "recv",
            weftRecv(ptr(&inbox), len, weftFloat32, prev as i32, comm, s),
            comm,
        );
        ok("group end", weftGroupEnd(), comm);
    }
    stream.synchronize(Duration::from_secs(60)).expect("sync");
    let want: Vec<f32> = (0..len).map(|i| of(prev, i)).collect();
    assert_eq!(
        inbox.to_vec().expect("download"),
        want,
        "rank {me}: ring shift"
    );
    // A host pointer with a stream is refused, nothing sent; host calls still work beside.
    let host = vec![0f32; len];
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    let rc = unsafe {
        weftAllReduce(
            host.as_ptr().cast(),
            ptr(&recv),
            len,
            weftFloat32,
            weftSum,
            comm,
            s,
        )
    };
    assert_eq!(
        rc, weftInvalidArgument,
        "rank {me}: host buffer with a stream"
    );
    let mut async_rc = weftInternalError;
    // SAFETY: device buffers of the stated lengths, alive until the stream is synchronised; a
    // live communicator and stream.
    unsafe {
        ok(
            "async error",
            weftCommGetAsyncError(comm, &mut async_rc),
            comm,
        );
        ok("host barrier", weftBarrier(comm), comm);
    }
    assert_eq!(async_rc, weftSuccess, "rank {me}: asynchronous error");
    drop((send, recv, all, part, a2a_send, a2a_recv, inbox));
    // SAFETY: the handle is not used again.
    unsafe { ok("destroy", weftCommDestroy(comm), null_mut()) };
    println!("rank {me}: every C ABI device call right");
}
