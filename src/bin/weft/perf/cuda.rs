//! `weft perf --device cuda`: the same sweeps as the host benchmark, on GPU buffers, through
//! `weftcc_cuda::DeviceComm` (CUDA IPC between the ranks of one host, staged through pinned
//! host memory otherwise). Each rank uses GPU `local rank mod device count`. Operations are
//! enqueued on one stream per rank and timed like nccl-tests: wall time of `-n` enqueued calls
//! plus the final stream synchronisation.

use std::time::Instant;

use weftcc::collectives::with_element;
use weftcc::{Communicator, Element, ReduceOp};
use weftcc_cuda::{Context, CudaError, DeviceBuffer, DeviceComm, Stream};

use super::spec::{self, Collective};
use super::{Options, Outputs, PerfArgs, Row, SizePlan};

/// Entry point of `weft perf --device cuda` (after the options were parsed).
pub(super) fn main(args: &PerfArgs, opts: &Options, outputs: &Outputs<'_>) -> i32 {
    if let Err(e) = weftcc_cuda::ensure_driver() {
        super::say(&format!("--device cuda: {e}"));
        return 1;
    }
    if !super::started_by_launcher() {
        let np = args.np as usize;
        if let Err(e) = super::check_ranks(opts, np) {
            super::say(&e);
            return 2;
        }
        return super::self_launch(np);
    }
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            super::say(&format!("cannot create the communicator: {e}"));
            return 1;
        }
    };
    if let Err(e) = super::check_ranks(opts, comm.size()) {
        if comm.rank() == 0 {
            super::say(&e);
        }
        return 2;
    }
    match run(comm, opts, outputs) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            super::say(&e.to_string());
            1
        }
    }
}

/// This rank's index on its host, as its launcher says (a job of one: its rank).
fn local_rank(comm: &Communicator) -> usize {
    weftcc::LaunchInfo::from_env().map_or(comm.rank(), |i| i.local_rank)
}

fn run(comm: Communicator, opts: &Options, outputs: &Outputs<'_>) -> Result<bool, CudaError> {
    let ndev = weftcc_cuda::device_count()?;
    if ndev == 0 {
        return Err(CudaError::Other("no CUDA device visible".into()));
    }
    let device = local_rank(&comm) % ndev;
    let ranks = super::gather_ranks(&comm)?;
    let ctx = Context::new(device)?;
    let dcomm = DeviceComm::new(comm, ctx.clone())?;
    let stream = ctx.stream()?;
    let host = dcomm.host();
    let (me, n) = (dcomm.rank(), dcomm.size());
    // Device ordinals of every rank, for the header.
    let mut devs = vec![0u64; n];
    host.all_gather(&[device as u64][..], &mut devs[..])?;
    let mut out = std::io::stdout().lock();
    if me == 0 {
        let info = weftcc_cuda::device_info(device)?;
        let title = format!(
            "# weft perf {} --device cuda: weftcc {}, {n} ranks, transport {:?}, driver {}\n",
            opts.collective.name(),
            env!("CARGO_PKG_VERSION"),
            dcomm.transport(),
            weftcc_cuda::driver_version()?
        );
        let lines = ranks
            .iter()
            .enumerate()
            .map(|(r, (pid, _local, hostname))| {
                spec::rank_line(r, *pid, hostname, devs[r])
                    .replace("[cpu] host memory", &format!("[gpu] {}", info.name))
            });
        super::print_header(&mut out, opts, title, lines);
    }
    let rows = super::sweep(opts, me, &mut out, |dtype, op, size| {
        with_element!(dtype, |T| bench_size::<T>(
            &dcomm, &ctx, &stream, opts, op, size
        ))
    })?;
    let wrong = super::wrong_values(&rows);
    if me == 0 {
        super::finish(&mut out, opts, host.size(), &rows, outputs)
            .map_err(|e| CudaError::Other(e.to_string()))?;
    }
    host.barrier()?;
    Ok(wrong == 0)
}

/// Out-of-place call on device buffers.
fn run_oop<T: Element>(
    c: &DeviceComm,
    coll: Collective,
    op: ReduceOp,
    root: usize,
    send: &DeviceBuffer<T>,
    recv: &mut DeviceBuffer<T>,
    s: &Stream,
) -> Result<(), CudaError> {
    match coll {
        Collective::AllReduce => c.all_reduce(send, recv, op, s),
        Collective::Reduce => c.reduce(send, recv, op, root, s),
        Collective::Broadcast => c.broadcast(send, recv, root, s),
        Collective::AllGather => c.all_gather(send, recv, s),
        Collective::ReduceScatter => c.reduce_scatter(send, recv, op, s),
        Collective::AllToAll => c.all_to_all(send, recv, s),
        Collective::SendRecv => {
            let (me, n) = (c.rank(), c.size());
            c.group()
                .send(send, (me + 1) % n)
                .recv(recv, (me + n - 1) % n)
                .run(s)
        }
    }
}

/// In-place call on a device buffer.
fn run_ip<T: Element>(
    c: &DeviceComm,
    coll: Collective,
    op: ReduceOp,
    root: usize,
    buf: &mut DeviceBuffer<T>,
    s: &Stream,
) -> Result<(), CudaError> {
    match coll {
        Collective::AllReduce => c.all_reduce_in_place(buf, op, s),
        Collective::Reduce => c.reduce_in_place(buf, op, root, s),
        Collective::Broadcast => c.broadcast_in_place(buf, root, s),
        Collective::AllGather => c.all_gather_in_place(buf, s),
        Collective::ReduceScatter => c.reduce_scatter_in_place(buf, op, s),
        Collective::AllToAll => c.all_to_all_in_place(buf, s),
        Collective::SendRecv => {
            // As on the host: send the first half of the buffer, receive into the second.
            let (me, n, half) = (c.rank(), c.size(), buf.len() / 2);
            let len = buf.len();
            c.group()
                .send_recv_parts(buf, 0..half, (me + 1) % n, half..len, (me + n - 1) % n)
                .run(s)
        }
    }
}

/// Seconds per call: `warmup` calls, a barrier, then `iters` enqueued calls and one
/// synchronisation of the stream.
fn time_loop(
    c: &DeviceComm,
    s: &Stream,
    warmup: u64,
    iters: u64,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    for _ in 0..warmup {
        f()?;
    }
    c.synchronize(s)?;
    c.host().barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    c.synchronize(s)?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

fn upload<T: Element>(ctx: &Context, v: &[T]) -> Result<DeviceBuffer<T>, CudaError> {
    ctx.upload(v)
}

/// One size of one (type, op) combination, as the host benchmark's `bench_size`.
fn bench_size<T: Element>(
    c: &DeviceComm,
    ctx: &Context,
    s: &Stream,
    opts: &Options,
    op: Option<ReduceOp>,
    size: u64,
) -> Result<Option<Row>, CudaError> {
    let Some(p) = SizePlan::new(opts, T::DTYPE, op, size, c.rank(), c.size()) else {
        return Ok(None);
    };
    let (coll, rop, root) = (p.coll, p.rop, p.root);

    let send = upload(ctx, &p.send::<T>())?;
    let mut recv = upload(ctx, &vec![T::from_f64(0.0); p.recv_len])?;
    let oop_s = time_loop(c, s, opts.warmup, opts.iters, || {
        run_oop(c, coll, rop, root, &send, &mut recv, s)
    })?;
    let mut buf = upload(ctx, &p.timed_in_place::<T>())?;
    let ip_s = time_loop(c, s, opts.warmup, opts.iters, || {
        run_ip(c, coll, rop, root, &mut buf, s)
    })?;

    let host = c.host();
    let times = super::aggregate_times(host, opts.average, [oop_s, ip_s])?;

    let wrong = if opts.check {
        recv.copy_from_host(&p.sentinels::<T>())?;
        run_oop(c, coll, rop, root, &send, &mut recv, s)?;
        c.synchronize(s)?;
        let oop_wrong = p.oop_wrong(&recv.to_vec()?);
        buf.copy_from_host(&p.in_place_inputs::<T>())?;
        run_ip(c, coll, rop, root, &mut buf, s)?;
        c.synchronize(s)?;
        let mut w = [oop_wrong, p.ip_wrong(&buf.to_vec()?)];
        host.all_reduce_in_place(&mut w[..], ReduceOp::Sum)?;
        Some(w)
    } else {
        None
    };
    Ok(Some(p.row(times, wrong)))
}
