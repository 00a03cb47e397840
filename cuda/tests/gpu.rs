//! GPU tests. Without a CUDA driver (or device) every test prints "skipped: no CUDA driver" and
//! passes. With one, they run:
//! * every reduction kernel (all types × sum/prod/min/max, scale, divide) on the device against
//!   the CPU kernels of weftcc-collectives, bit for bit;
//! * the correctness matrix over CUDA IPC: collectives × data types × reductions × in/out of
//!   place × sizes (single element, odd, several IPC slots), 2, 3 and 4 ranks as processes
//!   sharing the visible GPUs (rank r uses GPU r mod count), each result checked against a
//!   host reference computed with the CPU kernels;
//! * the same matrix (smaller) over the staged transport (`WEFT_CUDA_IPC=0`);
//! * stream semantics: results visible to later work on the same stream without a host
//!   synchronisation, and many operations in flight back to back;
//! * mismatched collectives over CUDA IPC (different counts, different kinds): every rank gets
//!   `Error::Mismatch` naming both calls, its stream drains, and the operation before keeps its
//!   correct result.
//!
//! The rank processes are this test binary itself, started with the ignored `child` test
//! selected and the case named in `WEFT_CUDA_TEST_CHILD`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use weftcc_collectives::reduce;
use weftcc_collectives::testing::{
    buffer_counts, data_collectives, every_op, expected_recv, noise, same_value as same,
    small_input, to_bytes,
};
use weftcc_collectives::{Combiner, DataType, Element, OpKind, RawOp, ReduceOp};
use weftcc_comm::{Communicator, Error, UniqueId};
use weftcc_cuda::kernels::{divide_on_device, reduce_on_device, scale_on_device};
use weftcc_cuda::{Context, CudaError, DeviceBuffer, DeviceComm, Stream, Transport};
use weftcc_testkit::ranks::{wait_ranks, Finished};

const CHILD: &str = "WEFT_CUDA_TEST_CHILD";

fn skip() -> bool {
    weftcc_cuda::testing::skip_without_device()
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

/// Runs `case` on `n` rank processes and fails if any of them fails.
fn run_ranks(case: &str, n: usize, env: &[(&str, &str)]) {
    run_ranks_on(case, &vec![0; n], env)
}

/// Runs `case` on one rank process per entry of `hosts`, rank r on the "host" `hosts[r]`
/// (`WEFT_HOST_ID`: ranks of one host reach each other by CUDA IPC and shared memory, others by
/// TCP, as between machines), and fails if any of them fails; skipped without a device.
fn run_ranks_on(case: &str, hosts: &[usize], env: &[(&str, &str)]) {
    if skip() {
        return;
    }
    let n = hosts.len();
    let exe = std::env::current_exe().expect("test binary");
    let addr = format!("127.0.0.1:{}", free_port());
    let kids: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args(["child", "--exact", "--ignored", "--nocapture"])
                .env(CHILD, case)
                .env("WEFT_TEST_RANK", r.to_string())
                .env("WEFT_TEST_SIZE", n.to_string())
                .env("WEFT_TEST_ADDR", &addr)
                .env("WEFT_HOST_ID", format!("gpu-test-host-{}", hosts[r]))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            (r, c.spawn().expect("spawn a rank"))
        })
        .collect();
    let Finished { failed, report } = wait_ranks(kids, Duration::from_secs(600));
    assert!(
        failed.is_empty(),
        "{case} with {n} ranks on hosts {hosts:?}: ranks {failed:?} failed\n{report}"
    );
    // What the failure cases measured (how long each survivor took to get its error).
    for line in report
        .lines()
        .filter(|l| l.contains("failed after") || l.contains("exiting"))
    {
        println!("{line}");
    }
    println!("{case} with {n} ranks on hosts {hosts:?}: ok");
}

#[test]
#[ignore = "entry point of the rank processes the GPU tests start; does nothing on its own"]
fn child() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let rank: usize = var("WEFT_TEST_RANK").parse().expect("rank");
    let size: usize = var("WEFT_TEST_SIZE").parse().expect("size");
    let addr = var("WEFT_TEST_ADDR");
    // One token per run: the token names the shared-memory segments, and the tests run in
    // parallel (a shared token made concurrent cases collide on an H100 machine).
    let token = format!("weft-cuda-test-{}", addr.replace(['.', ':'], "-"));
    let id = UniqueId { addr, token };
    let host = Communicator::init(rank, size, &id).expect("host communicator");
    let ndev = weftcc_cuda::device_count().expect("devices");
    let ctx = Context::new(rank % ndev).expect("context");
    let comm = DeviceComm::new(host, ctx.clone()).expect("device communicator");
    let stream = ctx.stream().expect("stream");
    match case.as_str() {
        "ipc-matrix" => {
            assert_eq!(
                comm.transport(),
                Transport::Ipc,
                "expected the IPC transport"
            );
            matrix(&comm, &ctx, &stream, true);
        }
        "staged-matrix" => {
            assert_eq!(comm.transport(), Transport::Staged);
            matrix(&comm, &ctx, &stream, false);
        }
        "hier-matrix" => {
            assert_eq!(
                comm.transport(),
                Transport::Hierarchical,
                "expected the hierarchical transport"
            );
            matrix(
                &comm,
                &ctx,
                &stream,
                std::env::var("WEFT_TEST_FULL").is_ok(),
            );
        }
        "hier-kill" | "ipc-kill" => {
            let want = match case.as_str() {
                "hier-kill" => Transport::Hierarchical,
                _ => Transport::Ipc,
            };
            assert_eq!(comm.transport(), want);
            // Returns without the final barrier: the job has lost a rank.
            return rank_killed_mid_operation(&comm, &ctx, &stream);
        }
        "stream-order" => stream_order(&comm, &ctx, &stream),
        "deterministic" => deterministic_bits(&comm, &ctx, &stream),
        "p2p" => p2p(&comm, &ctx, &stream),
        "mismatch" => mismatch(&comm, &ctx, &stream),
        "hier-mismatch" => {
            // Returns without the final barrier: the failure may have aborted the host one.
            return hierarchical_mismatch(&comm, &ctx, &stream);
        }
        other => panic!("unknown case {other}"),
    }
    comm.host().barrier().expect("final barrier");
}

// ---------------------------------------------------------------------------------------------
// The matrix.

fn matrix(comm: &DeviceComm, ctx: &Context, stream: &Stream, full: bool) {
    let n = comm.size();
    let me = comm.rank();
    let mut cases = 0usize;
    for kind in data_collectives() {
        let ops: Vec<ReduceOp> = if kind.has_reduction() {
            every_op(me)
        } else {
            vec![ReduceOp::Sum]
        };
        let types: Vec<DataType> = if full {
            DataType::ALL.to_vec()
        } else {
            vec![DataType::Int8, DataType::Float32, DataType::Bfloat16]
        };
        for &t in &types {
            for &op in &ops {
                // One element, an odd count, and (for the common types) several IPC slots of
                // the default 1 MiB per rank's block.
                let mut counts = vec![1usize, 1037];
                if matches!(t, DataType::Float32 | DataType::Int8) && op == ReduceOp::Sum {
                    counts.push((3 << 20) / t.size() + 5);
                }
                for &count in &counts {
                    for in_place in [false, true] {
                        let root = n - 1;
                        one_case(comm, ctx, stream, kind, t, op, count, root, in_place);
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("rank {me}: {cases} cases right");
}

macro_rules! typed {
    ($t:expr, $f:ident($($a:expr),*)) => {
        match $t {
            DataType::Int8 => $f::<i8>($($a),*),
            DataType::Uint8 => $f::<u8>($($a),*),
            DataType::Int32 => $f::<i32>($($a),*),
            DataType::Uint32 => $f::<u32>($($a),*),
            DataType::Int64 => $f::<i64>($($a),*),
            DataType::Uint64 => $f::<u64>($($a),*),
            DataType::Float16 => $f::<half::f16>($($a),*),
            DataType::Float32 => $f::<f32>($($a),*),
            DataType::Float64 => $f::<f64>($($a),*),
            DataType::Bfloat16 => $f::<half::bf16>($($a),*),
        }
    };
}

#[allow(clippy::too_many_arguments)]
fn one_case(
    comm: &DeviceComm,
    ctx: &Context,
    stream: &Stream,
    kind: OpKind,
    t: DataType,
    op: ReduceOp,
    count: usize,
    root: usize,
    in_place: bool,
) {
    typed!(
        t,
        run_case(comm, ctx, stream, kind, op, count, root, in_place)
    )
}

fn upload<T: Element>(ctx: &Context, bytes: &[u8]) -> DeviceBuffer<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    ctx.upload(&v).expect("upload")
}

fn download<T: Element>(b: &DeviceBuffer<T>) -> Vec<u8> {
    bytemuck::cast_slice(&b.to_vec().expect("download")).to_vec()
}

#[allow(clippy::too_many_arguments)]
fn run_case<T: Element>(
    comm: &DeviceComm,
    ctx: &Context,
    stream: &Stream,
    kind: OpKind,
    op: ReduceOp,
    count: usize,
    root: usize,
    in_place: bool,
) {
    let (n, me) = (comm.size(), comm.rank());
    let t = T::DTYPE;
    let es = t.size();
    let all = count * n;
    let (send_len, recv_len) = buffer_counts(kind, count, n);
    let what = format!(
        "{kind} {t} {op} count {count} {}",
        if in_place { "in place" } else { "out of place" }
    );
    // A sentinel the results never take (they are small non-negative integers or wrap).
    let sentinel = to_bytes(t, 99.0);
    let mine = small_input(t, op, me, send_len);
    let got = if in_place {
        let whole = match kind {
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => all,
            _ => count,
        };
        let mut init: Vec<u8> = sentinel.repeat(whole);
        match kind {
            OpKind::AllGather => {
                init[me * count * es..(me + 1) * count * es].copy_from_slice(&mine)
            }
            _ => init.copy_from_slice(&mine),
        }
        let mut buf = upload::<T>(ctx, &init);
        let r = match kind {
            OpKind::AllReduce => comm.all_reduce_in_place(&mut buf, op, stream),
            OpKind::Reduce => comm.reduce_in_place(&mut buf, op, root, stream),
            OpKind::Broadcast => comm.broadcast_in_place(&mut buf, root, stream),
            OpKind::AllGather => comm.all_gather_in_place(&mut buf, stream),
            OpKind::ReduceScatter => comm.reduce_scatter_in_place(&mut buf, op, stream),
            _ => comm.all_to_all_in_place(&mut buf, stream),
        };
        r.and_then(|_| comm.synchronize(stream))
            .unwrap_or_else(|e| panic!("rank {me}: {what}: {e}"));
        let b = download(&buf);
        match kind {
            OpKind::ReduceScatter => b[me * count * es..(me + 1) * count * es].to_vec(),
            // Reduce in place on a non-root: the buffer is the input, unchanged.
            OpKind::Reduce if me != root => {
                assert_eq!(b, mine, "rank {me}: {what}: non-root buffer changed");
                return;
            }
            _ => b,
        }
    } else {
        let send = upload::<T>(ctx, &mine);
        let mut recv = upload::<T>(ctx, &sentinel.repeat(recv_len));
        let r = match kind {
            OpKind::AllReduce => comm.all_reduce(&send, &mut recv, op, stream),
            OpKind::Reduce => comm.reduce(&send, &mut recv, op, root, stream),
            OpKind::Broadcast => comm.broadcast(&send, &mut recv, root, stream),
            OpKind::AllGather => comm.all_gather(&send, &mut recv, stream),
            OpKind::ReduceScatter => comm.reduce_scatter(&send, &mut recv, op, stream),
            _ => comm.all_to_all(&send, &mut recv, stream),
        };
        r.and_then(|_| comm.synchronize(stream))
            .unwrap_or_else(|e| panic!("rank {me}: {what}: {e}"));
        download(&recv)
    };
    let call = RawOp::new(kind, t, count).with_op(op).with_root(root);
    match expected_recv(&call, n, me) {
        Some(want) => {
            if got != want {
                let bad = got
                    .chunks(es)
                    .zip(want.chunks(es))
                    .position(|(g, w)| g != w)
                    .unwrap_or(0);
                panic!(
                    "rank {me}: {what}: element {bad} is {:?}, expected {:?}",
                    &got[bad * es..(bad + 1) * es],
                    &want[bad * es..(bad + 1) * es]
                );
            }
        }
        None => assert_eq!(
            got,
            sentinel.repeat(recv_len),
            "rank {me}: {what}: receive buffer of a non-root was written"
        ),
    }
}

/// Results are visible to later work on the same stream with no host synchronisation between,
/// and many operations can be in flight at once.
fn stream_order(comm: &DeviceComm, ctx: &Context, stream: &Stream) {
    let (n, me) = (comm.size(), comm.rank());
    let len = (5 << 20) / 4 + 3;
    let x: Vec<f32> = (0..len).map(|i| ((i + me) % 3) as f32).collect();
    let mut buf = ctx.upload(&x).expect("upload");
    let mut copy = ctx.alloc::<f32>(len).expect("alloc");
    const ROUNDS: usize = 6;
    for _ in 0..ROUNDS {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, stream)
            .expect("enqueue");
    }
    // Ordered after the collectives by the stream alone.
    copy.copy_from_device(&buf, stream).expect("enqueue copy");
    comm.synchronize(stream).expect("synchronize");
    let got = copy.to_vec().expect("download");
    for (i, g) in got.iter().enumerate() {
        let base: f32 = (0..n).map(|r| ((i + r) % 3) as f32).sum();
        let want = base * (n as f32).powi(ROUNDS as i32 - 1);
        assert_eq!(*g, want, "rank {me}: element {i}");
    }
}

/// Checks that `e` is the mismatch rank `me` must see: `ours` (kind, count) against the first
/// rank whose call differs, `peer`, which called `theirs`.
fn expect_mismatch(
    e: &CudaError,
    me: usize,
    peer: usize,
    ours: (OpKind, u64),
    theirs: (OpKind, u64),
) {
    match e {
        CudaError::Host(Error::Mismatch {
            rank,
            peer: p,
            ours: o,
            theirs: t,
        }) => {
            assert_eq!((*rank, *p), (me, peer), "rank {me}: {e}");
            assert_eq!((o.kind, o.count), ours, "rank {me}: {e}");
            assert_eq!((t.kind, t.count), theirs, "rank {me}: {e}");
            assert_eq!(o.seq, t.seq, "rank {me}: {e}");
        }
        other => panic!("rank {me}: expected a mismatch, got {other}"),
    }
}

/// Ranks that call different collectives over CUDA IPC (rank 0 one call, the others another):
/// first different counts, right behind a matching all-reduce still in flight, then (on a
/// fresh device communicator, the first being poisoned) different kinds. Every rank's enqueue
/// fails with `Error::Mismatch` naming both calls, the stream drains (no wait on a flag nobody
/// raises), the all-reduce before keeps its correct result, later calls fail at once, and the
/// host communicator stays usable.
fn mismatch(comm: &DeviceComm, ctx: &Context, stream: &Stream) {
    assert_eq!(
        comm.transport(),
        Transport::Ipc,
        "expected the IPC transport"
    );
    let (n, me) = (comm.size(), comm.rank());
    let peer = if me == 0 { 1 } else { 0 };
    let t0 = Instant::now();
    // A matching all-reduce (several slots with small slots), left in flight.
    let len = (3 << 20) / 4 + 5;
    let mut good = ctx.upload(&vec![(me + 1) as f32; len]).expect("upload");
    comm.all_reduce_in_place(&mut good, ReduceOp::Sum, stream)
        .expect("matching all-reduce");
    // Different counts.
    let count_of = |r: usize| if r == 0 { 1000 } else { 1001 };
    let send = ctx.upload(&vec![1.0f32; count_of(me)]).expect("upload");
    let mut recv = ctx.alloc::<f32>(count_of(me)).expect("alloc");
    let e = comm
        .all_reduce(&send, &mut recv, ReduceOp::Sum, stream)
        .expect_err("all-reduces of different counts");
    println!(
        "rank {me}: different counts failed after {:.1?}: {e}",
        t0.elapsed()
    );
    let ar = OpKind::AllReduce;
    expect_mismatch(
        &e,
        me,
        peer,
        (ar, count_of(me) as u64),
        (ar, count_of(peer) as u64),
    );
    // The stream drains; the all-reduce before the mismatch completed with its data.
    match comm.synchronize(stream) {
        Err(CudaError::Poisoned { .. }) => {}
        other => panic!("rank {me}: synchronize after the mismatch gave {other:?}"),
    }
    let want = (n * (n + 1) / 2) as f32;
    let got = good.to_vec().expect("download");
    if let Some(i) = got.iter().position(|&g| g != want) {
        panic!(
            "rank {me}: the all-reduce before the mismatch: element {i} is {}, not {want}",
            got[i]
        );
    }
    assert!(
        matches!(comm.error(), Some(CudaError::Host(Error::Mismatch { .. }))),
        "rank {me}: error() is {:?}",
        comm.error()
    );
    assert!(
        matches!(
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream),
            Err(CudaError::Poisoned { .. })
        ),
        "rank {me}: a call after the mismatch must fail at once"
    );
    // Different kinds, on a fresh device communicator over a split of the host one.
    let host = comm
        .host()
        .split(Some(0), me as i64)
        .expect("split")
        .expect("a communicator");
    let fresh = DeviceComm::new(host, ctx.clone()).expect("device communicator");
    assert_eq!(fresh.transport(), Transport::Ipc);
    let count = 256;
    let send = ctx.upload(&vec![me as f32; count]).expect("upload");
    let mut recv = ctx.alloc::<f32>(n * count).expect("alloc");
    let kind_of = |r: usize| {
        if r == 0 {
            OpKind::AllReduce
        } else {
            OpKind::AllGather
        }
    };
    let mut small = ctx.alloc::<f32>(count).expect("alloc");
    let t1 = Instant::now();
    let e = match kind_of(me) {
        OpKind::AllReduce => fresh.all_reduce(&send, &mut small, ReduceOp::Sum, stream),
        _ => fresh.all_gather(&send, &mut recv, stream),
    }
    .expect_err("all-reduce against all-gather");
    println!(
        "rank {me}: different kinds failed after {:.1?}: {e}",
        t1.elapsed()
    );
    expect_mismatch(
        &e,
        me,
        peer,
        (kind_of(me), count as u64),
        (kind_of(peer), count as u64),
    );
    assert!(
        matches!(fresh.synchronize(stream), Err(CudaError::Poisoned { .. })),
        "rank {me}: synchronize after the mismatch"
    );
    fresh.host().barrier().expect("host communicator usable");
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(30), "rank {me}: took {took:?}");
}

/// Two hosts whose ranks call all-reduces of different counts (host 0's ranks `count`, host 1's
/// `count + 1`; below and above the sharding threshold): every rank, the ranks whose own tier
/// never meets the other host's call included, must learn of a failure (the enqueue, the
/// stream's synchronisation or the communicator's error) within a bound, and its stream must
/// drain.
fn hierarchical_mismatch(comm: &DeviceComm, ctx: &Context, stream: &Stream) {
    assert_eq!(comm.transport(), Transport::Hierarchical);
    let me = comm.rank();
    let on_host_1 = std::env::var("WEFT_HOST_ID").is_ok_and(|h| h.ends_with("-1"));
    let count: usize = std::env::var("WEFT_TEST_COUNT")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1000)
        + usize::from(on_host_1);
    let t0 = Instant::now();
    let send = ctx.upload(&vec![1.0f32; count]).expect("upload");
    let mut recv = ctx.alloc::<f32>(count).expect("alloc");
    let enqueued = comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream);
    let synced = enqueued
        .as_ref()
        .map_or(Ok(()), |_| comm.synchronize(stream).map(|_| ()));
    let mut error = enqueued.err().or(synced.err());
    while error.is_none() && t0.elapsed() < Duration::from_secs(30) {
        error = comm.error();
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = t0.elapsed();
    match error {
        Some(e) => println!("rank {me}: count {count}: failed after {took:.1?}: {e}"),
        None => panic!("rank {me}: count {count}: no error within {took:?} (the other host called another count)"),
    }
    // The stream drains.
    if let Err(e) = stream.synchronize(Duration::from_secs(30)) {
        panic!("rank {me}: the stream did not drain after the failure: {e}");
    }
}

/// The last rank exits in the middle of its fourth all-reduce (no destructor runs: to its peers
/// it is a killed process); every other rank must get an error, not a stream that never
/// drains, well before its own timeout (WEFT_TIMEOUT=10): the store sees the rank's session close,
/// every host communicator fails, and its failure hook releases the GPU waits.
fn rank_killed_mid_operation(comm: &DeviceComm, ctx: &Context, stream: &Stream) {
    let (n, me) = (comm.size(), comm.rank());
    let mut buf = ctx.upload(&vec![1.0f32; 1 << 20]).expect("upload");
    let t0 = Instant::now();
    for i in 0..100 {
        let r = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, stream);
        if me == n - 1 && i == 3 {
            println!("rank {me}: exiting in the middle of all-reduce {i}");
            std::process::exit(0);
        }
        if let Err(e) = r.and_then(|_| comm.synchronize(stream)) {
            let took = t0.elapsed();
            println!("rank {me}: all-reduce {i} failed after {took:.1?}: {e}");
            assert!(
                took < Duration::from_secs(5),
                "rank {me}: the error took {took:?} (WEFT_TIMEOUT is 10 s: released by the timeout, not by the failure)"
            );
            assert!(
                comm.error().is_some(),
                "rank {me}: error() is empty after a failure"
            );
            return;
        }
    }
    panic!("rank {me}: 100 all-reduces with a dead rank and no error");
}

/// Deterministic mode (`WEFT_DETERMINISTIC=1`) on the GPU: all-reduce and reduce-scatter of
/// floats whose sums depend on the order give the CPU's rank-order fold, bit for bit, over
/// whichever transport the communicator chose (never the hierarchical one, which would regroup
/// the fold).
fn deterministic_bits(comm: &DeviceComm, ctx: &Context, stream: &Stream) {
    use weftcc_collectives::testing::{order_sensitive_value, rank_order_fold};
    assert!(comm.host().deterministic(), "WEFT_DETERMINISTIC=1 expected");
    assert_ne!(comm.transport(), Transport::Hierarchical);
    let (n, me) = (comm.size(), comm.rank());
    for t in [DataType::Float32, DataType::Bfloat16] {
        for (kind, count) in [
            (OpKind::AllReduce, 300_007),
            (OpKind::ReduceScatter, 70_001),
        ] {
            let elems = if kind == OpKind::ReduceScatter {
                count * n
            } else {
                count
            };
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    (0..elems)
                        .flat_map(|i| to_bytes(t, order_sensitive_value(r, i)))
                        .collect()
                })
                .collect();
            let want = rank_order_fold(t, ReduceOp::Sum, &inputs, &[]);
            let es = t.size();
            let want = match kind {
                OpKind::ReduceScatter => want[me * count * es..(me + 1) * count * es].to_vec(),
                _ => want,
            };
            let got = typed!(
                t,
                deterministic_case(comm, ctx, stream, kind, &inputs[me], count)
            );
            assert!(
                got == want,
                "rank {me}: {kind} {t} differs from the rank-order fold"
            );
        }
    }
}

fn deterministic_case<T: Element>(
    comm: &DeviceComm,
    ctx: &Context,
    stream: &Stream,
    kind: OpKind,
    mine: &[u8],
    count: usize,
) -> Vec<u8> {
    let send = upload::<T>(ctx, mine);
    let mut recv = ctx.alloc::<T>(count).expect("alloc");
    let r = match kind {
        OpKind::ReduceScatter => comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum, stream),
        _ => comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream),
    };
    r.and_then(|_| comm.synchronize(stream))
        .expect("deterministic case");
    download(&recv)
}

/// Distinct values for (rank, message, element).
fn p2p_values(rank: usize, msg: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (rank * 1_000_003 + msg * 7_919 + i) as u32)
        .collect()
}

/// Send/recv on device buffers: a ring shift in one group (two messages to the same peer, kept
/// in order), from empty to larger than a peer's inbox (the send lane waits for the receiver
/// while the receive lane runs); single `send`/`recv` calls of `f64` between ranks 0 and 1; and
/// the in-place form.
fn p2p(comm: &DeviceComm, ctx: &Context, stream: &Stream) {
    let (n, me) = (comm.size(), comm.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    for len in [0usize, 1, 1037, (40 << 20) / 4 + 3] {
        let short = len / 2 + 1;
        let a = ctx.upload(&p2p_values(me, 1, len)).expect("upload");
        let b = ctx.upload(&p2p_values(me, 2, short)).expect("upload");
        let mut ra = ctx.alloc::<u32>(len).expect("alloc");
        let mut rb = ctx.alloc::<u32>(short).expect("alloc");
        comm.group()
            .send(&a, next)
            .send(&b, next)
            .recv(&mut ra, prev)
            .recv(&mut rb, prev)
            .run(stream)
            .expect("enqueue the group");
        comm.synchronize(stream).expect("synchronize");
        if len > 0 {
            let got = ra.to_vec().expect("download");
            assert!(
                got == p2p_values(prev, 1, len),
                "rank {me}: first message of {len} elements from {prev} differs"
            );
        }
        let got = rb.to_vec().expect("download");
        assert!(
            got == p2p_values(prev, 2, short),
            "rank {me}: second message of {short} elements from {prev} differs"
        );
    }
    if me < 2 {
        let x: Vec<f64> = (0..3000).map(|i| i as f64 * 0.5 - 7.0).collect();
        if me == 0 {
            let buf = ctx.upload(&x).expect("upload");
            comm.send(&buf, 1, stream).expect("send");
            comm.synchronize(stream).expect("synchronize");
        } else {
            let mut buf = ctx.alloc::<f64>(x.len()).expect("alloc");
            comm.recv(&mut buf, 0, stream).expect("recv");
            comm.synchronize(stream).expect("synchronize");
            assert_eq!(
                buf.to_vec().expect("download"),
                x,
                "rank 1: f64 from rank 0"
            );
        }
    }
    // In place: send the first half, receive the peer's first half into the second.
    let half = 5000;
    let mut v = p2p_values(me, 3, half);
    v.extend(std::iter::repeat_n(u32::MAX, half));
    let mut buf = ctx.upload(&v).expect("upload");
    comm.group()
        .send_recv_parts(&mut buf, 0..half, next, half..2 * half, prev)
        .run(stream)
        .expect("enqueue the in-place group");
    comm.synchronize(stream).expect("synchronize");
    let got = buf.to_vec().expect("download");
    assert!(
        got[..half] == p2p_values(me, 3, half)[..],
        "rank {me}: sent half changed"
    );
    assert!(
        got[half..] == p2p_values(prev, 3, half)[..],
        "rank {me}: received half from {prev} differs"
    );
}

// ---------------------------------------------------------------------------------------------
// The tests.

#[test]
fn kernels_match_the_cpu_kernels_on_the_device() {
    if skip() {
        return;
    }
    let ctx = Context::new(0).expect("context");
    let stream = ctx.stream().expect("stream");
    for t in DataType::ALL {
        typed!(t, kernel_case(&ctx, &stream));
    }
}

fn kernel_case<T: Element>(ctx: &Context, stream: &Stream) {
    let t = T::DTYPE;
    let es = t.size();
    let n = 100_003;
    let a = noise(3 + t.code() as u64, n * es);
    let b = noise(5 + t.code() as u64, n * es);
    let (da, db) = (upload::<T>(ctx, &a), upload::<T>(ctx, &b));
    let mut out = ctx.alloc::<T>(n).expect("alloc");
    let check = |what: &str, got: Vec<u8>, want: Vec<u8>| {
        for (i, (g, w)) in got.chunks(es).zip(want.chunks(es)).enumerate() {
            assert!(
                same(t, g, w),
                "{t} {what} element {i}: GPU {g:?}, CPU {w:?}"
            );
        }
    };
    for comb in [Combiner::Sum, Combiner::Prod, Combiner::Min, Combiner::Max] {
        reduce_on_device(comb, &mut out, &da, &db, stream).expect("launch");
        stream.synchronize(Duration::from_secs(60)).expect("sync");
        let mut want = vec![0u8; n * es];
        reduce::reduce_into(t, comb, &mut want, &a, &b).expect("cpu");
        check(&format!("{comb:?}"), download(&out), want);
    }
    scale_on_device(&mut out, &da, -2.5, stream).expect("launch");
    stream.synchronize(Duration::from_secs(60)).expect("sync");
    let mut want = vec![0u8; n * es];
    reduce::scale_into(t, &mut want, &a, -2.5).expect("cpu");
    check("scale", download(&out), want);
    let mut buf = upload::<T>(ctx, &a);
    divide_on_device(&mut buf, 3, stream).expect("launch");
    stream.synchronize(Duration::from_secs(60)).expect("sync");
    let mut want = a.clone();
    reduce::divide_in_place(t, &mut want, 3).expect("cpu");
    check("divide", download(&buf), want);
}

#[test]
fn ipc_matrix_2_ranks() {
    // 1 MiB slots, 4 deep (the defaults are 16 MiB × 2, which the 3- and 4-rank runs use):
    // the largest case spans several slots in every type.
    run_ranks(
        "ipc-matrix",
        2,
        &[("WEFT_CUDA_SLOT_BYTES", "1M"), ("WEFT_CUDA_DEPTH", "4")],
    );
}

#[test]
fn ipc_matrix_3_and_4_ranks() {
    run_ranks("ipc-matrix", 3, &[]);
    run_ranks("ipc-matrix", 4, &[]);
}

#[test]
fn ipc_matrix_small_slots_deep_pipeline() {
    // 4 KiB slots, 2 deep: many messages per operation, slots reused constantly; all-reduce
    // always by the ring (the other runs use recursive doubling up to 4 MiB).
    run_ranks(
        "ipc-matrix",
        2,
        &[
            ("WEFT_CUDA_SLOT_BYTES", "4K"),
            ("WEFT_CUDA_DEPTH", "2"),
            ("WEFT_CUDA_RD_MAX", "0"),
        ],
    );
}

#[test]
fn send_recv_ipc_and_staged() {
    run_ranks("p2p", 2, &[]);
    run_ranks("p2p", 3, &[]);
    run_ranks("p2p", 2, &[("WEFT_CUDA_SLOT_BYTES", "1M")]);
    run_ranks("p2p", 3, &[("WEFT_CUDA_IPC", "0")]);
}

#[test]
fn staged_matrix_2_and_3_ranks() {
    run_ranks("staged-matrix", 2, &[("WEFT_CUDA_IPC", "0")]);
    run_ranks("staged-matrix", 3, &[("WEFT_CUDA_IPC", "0")]);
}

#[test]
fn results_follow_stream_order() {
    run_ranks("stream-order", 2, &[]);
    run_ranks("stream-order", 3, &[("WEFT_CUDA_IPC", "0")]);
}

/// Ranks calling different collectives over CUDA IPC (counts, then kinds): every rank gets the
/// mismatch error, its stream drains and the operation before keeps its result (2 ranks with
/// 1 MiB slots, so the earlier all-reduce spans several; 3 ranks with the defaults).
#[test]
fn mismatched_collectives_over_ipc_fail_on_every_rank() {
    run_ranks(
        "mismatch",
        2,
        &[("WEFT_TIMEOUT", "20"), ("WEFT_CUDA_SLOT_BYTES", "1M")],
    );
    run_ranks("mismatch", 3, &[("WEFT_TIMEOUT", "20")]);
}

/// All-reduces of different counts on the two hosts of a hierarchical communicator (one
/// exchange below the sharding threshold, sharded above it): every rank learns of it.
#[test]
fn hierarchical_mismatch_across_hosts_fails_every_rank() {
    for count in ["1000", "1000000"] {
        run_ranks_on(
            "hier-mismatch",
            &[0, 0, 1, 1],
            &[("WEFT_TIMEOUT", "10"), ("WEFT_TEST_COUNT", count)],
        );
    }
}

/// Two "hosts" of two ranks each (ranks 0, 1 on one, 2, 3 on the other): CUDA IPC inside each,
/// TCP between them; every collective, type and reduction, in and out of place.
#[test]
fn hierarchical_matrix_two_hosts() {
    run_ranks_on("hier-matrix", &[0, 0, 1, 1], &[("WEFT_TEST_FULL", "1")]);
}

/// Other layouts, fewer types: ranks dealt over the hosts in turn, a host with three ranks
/// beside one with one (not uniform: reduce, broadcast, all-gather and reduce-scatter run on
/// the whole communicator, all-reduce by local rank 0), three hosts; send/recv and stream order
/// across hosts.
#[test]
fn hierarchical_other_layouts_send_recv_and_stream_order() {
    run_ranks_on("hier-matrix", &[0, 1, 0, 1], &[]);
    run_ranks_on("hier-matrix", &[0, 0, 0, 1], &[]);
    run_ranks_on(
        "hier-matrix",
        &[0, 1, 2, 0, 1, 2],
        &[("WEFT_CUDA_SLOT_BYTES", "1M")],
    );
    run_ranks_on("p2p", &[0, 0, 1, 1], &[]);
    run_ranks_on("stream-order", &[0, 1, 1, 0], &[]);
}

/// Deterministic mode on the device: the CPU's rank-order fold, over CUDA IPC (2 and 3 ranks),
/// staged, and with ranks on two hosts (staged: the hierarchical transport is off in this mode).
#[test]
fn deterministic_mode_gives_the_cpu_bits() {
    let det = ("WEFT_DETERMINISTIC", "1");
    run_ranks("deterministic", 2, &[det]);
    run_ranks("deterministic", 3, &[det, ("WEFT_CUDA_SLOT_BYTES", "1M")]);
    run_ranks("deterministic", 3, &[det, ("WEFT_CUDA_IPC", "0")]);
    run_ranks_on("deterministic", &[0, 0, 1, 1], &[det]);
}

/// A rank killed mid-operation: every other rank's stream drains and each gets an error.
#[test]
fn hierarchical_rank_killed_mid_operation() {
    run_ranks_on("hier-kill", &[0, 0, 1, 1], &[("WEFT_TIMEOUT", "10")]);
}

/// The same on one host over CUDA IPC: the ranks waiting on the dead rank's flags are released
/// by their host communicator's failure, not at their timeout.
#[test]
fn ipc_rank_killed_mid_operation() {
    run_ranks_on("ipc-kill", &[0, 0, 0], &[("WEFT_TIMEOUT", "10")]);
}

/// Device memory exported as a dmabuf (what `ibv_reg_dmabuf_mr` registers for GPUDirect RDMA;
/// the registration itself needs an RDMA device).
#[test]
fn dmabuf_export_of_device_memory() {
    if skip() {
        return;
    }
    let support = weftcc_cuda::gdr_support(0).expect("attributes");
    println!("device 0: {support:?}");
    let ctx = Context::new(0).expect("context");
    let buf = ctx.alloc::<u8>(4 << 20).expect("alloc");
    match buf.export_dmabuf() {
        Ok(fd) => {
            use std::os::fd::AsRawFd;
            let st = nix::sys::stat::fstat(fd.as_raw_fd()).expect("fstat of the dmabuf");
            println!(
                "dmabuf fd {} of 4 MiB: st_size {}",
                fd.as_raw_fd(),
                st.st_size
            );
            assert!(support.dmabuf);
        }
        Err(e) => {
            assert!(
                !support.dmabuf,
                "dmabuf export failed on a device that supports it: {e}"
            );
            println!("skipped: this device exports no dmabuf ({e})");
        }
    }
}

#[test]
fn device_communicator_without_a_driver_is_a_clean_error() {
    if weftcc_cuda::driver_present() {
        println!("driver present: the no-driver path is covered by the unit test with the forced-absent probe");
        return;
    }
    println!("skipped: no CUDA driver (checking the error path instead)");
    match Context::new(0) {
        Err(CudaError::NoDriver(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
        other => panic!("expected NoDriver, got {other:?}"),
    }
    assert!(matches!(
        weftcc_cuda::p2p_report(),
        Err(CudaError::NoDriver(_))
    ));
}

/// GPUDirect RDMA on a real GPU and RDMA NIC: two ranks (threads sharing GPU 0 and the NIC's
/// first active port, each its own "host") run the GDR ring's all-reduce on device buffers the
/// NIC writes (dmabuf registration, else nvidia-peermem), the flag waited for on a stream and
/// the reduction on the GPU. Skips without a GPU, without an RDMA device, or where the NIC takes
/// no device memory (it then says which registration was refused).
#[test]
fn gdr_ring_all_reduce_on_device_memory() {
    use std::sync::{Arc, Barrier, Mutex};
    use weftcc_cuda::gdr::{CudaDevice, GdrPath, GdrRing, GdrSetup};
    use weftcc_transports::net::verbs::{VerbsConfig, VerbsProvider};
    use weftcc_transports::net::Provider;
    if skip() {
        return;
    }
    let provider: Arc<dyn Provider> = match VerbsProvider::open(&VerbsConfig::default()) {
        Ok(p) => Arc::new(p),
        Err(e) => {
            println!("skipped: no RDMA device for GPUDirect RDMA ({e})");
            return;
        }
    };
    let ctx = Context::new(0).expect("context");
    let (slots, barrier) = (Mutex::new(vec![Vec::new(); 2]), Barrier::new(2));
    let exchange = |rank: usize, mine: Vec<u8>| -> Result<Vec<Vec<u8>>, String> {
        slots.lock().unwrap()[rank] = mine;
        barrier.wait();
        let all = slots.lock().unwrap().clone();
        barrier.wait();
        Ok(all)
    };
    let n = 1 << 20;
    let results: Vec<Option<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (ctx, provider, exchange) = (&ctx, &provider, &exchange);
                s.spawn(move || {
                    let device = CudaDevice::new(ctx, Duration::from_secs(30)).expect("device");
                    let path = GdrPath {
                        class: weftcc_topology::PathClass::Pix,
                        level: weftcc_topology::PathClass::Sys,
                    };
                    let setup = GdrRing::connect(
                        rank,
                        2,
                        provider,
                        Box::new(device),
                        path,
                        4 << 20,
                        &|mine| exchange(rank, mine),
                        Duration::from_secs(30),
                    )
                    .expect("set-up");
                    let mut ring = match setup {
                        GdrSetup::Direct(r) => r,
                        GdrSetup::Staged(why) => {
                            println!("skipped: rank {rank} stages: {why}");
                            return None;
                        }
                    };
                    let data: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + rank as f32).collect();
                    let buf = ctx.upload(&data).expect("upload");
                    ring.all_reduce_in_place(&buf, 0, n, DataType::Float32, Combiner::Sum)
                        .expect("all-reduce");
                    let mut out = vec![0f32; n];
                    buf.copy_to_host(&mut out).expect("download");
                    Some(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Some(out) = r else { continue };
        let wrong = (0..n)
            .filter(|&i| out[i] != 2.0 * (i % 1000) as f32 + 1.0)
            .count();
        assert_eq!(wrong, 0, "rank {rank}: {wrong} of {n} wrong");
    }
}
