//! `weft perf --device cuda`: the same sweeps as the host benchmark, on GPU buffers, through
//! `weftcc_cuda::DeviceComm` (CUDA IPC between the ranks of one host, staged through pinned
//! host memory otherwise). Each rank uses GPU `local rank mod device count`. Operations are
//! enqueued on one stream per rank and timed like nccl-tests: wall time of `-n` enqueued calls
//! plus the final stream synchronisation.

use std::borrow::Cow;

use weftcc::collectives::with_element;
use weftcc::{Communicator, Element};
use weftcc_cuda::{Context, CudaError, DeviceBuffer, DeviceComm, Stream};

use super::spec::{self, Collective};
use super::{bench_size, Bench, Options, Outputs, PerfArgs, SizePlan};

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

/// This rank's index on its host, as its launcher says (a job of one: its rank); its GPU is
/// `local rank mod device count` (here and in `weft doctor --device cuda`).
pub(crate) fn local_rank(comm: &Communicator) -> usize {
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
    let device = Device {
        comm: &dcomm,
        ctx: &ctx,
        stream: &stream,
    };
    let rows = super::sweep(opts, me, &mut out, |dtype, op, size| {
        with_element!(dtype, |T| bench_size::<_, T>(&device, opts, op, size))
    })?;
    let wrong = super::wrong_values(&rows);
    if me == 0 {
        super::finish(&mut out, opts, host.size(), &rows, outputs)
            .map_err(|e| CudaError::Other(e.to_string()))?;
    }
    host.barrier()?;
    Ok(wrong == 0)
}

/// A rank's GPU, its device communicator and the stream its calls are enqueued on.
struct Device<'a> {
    comm: &'a DeviceComm,
    ctx: &'a Context,
    stream: &'a Stream,
}

impl Bench for Device<'_> {
    type Buf<T: Element> = DeviceBuffer<T>;
    type Error = CudaError;

    fn host(&self) -> &Communicator {
        self.comm.host()
    }

    fn buffer<T: Element>(&self, v: Vec<T>) -> Result<DeviceBuffer<T>, CudaError> {
        self.ctx.upload(&v)
    }

    fn fill<T: Element>(&self, b: &mut DeviceBuffer<T>, v: &[T]) -> Result<(), CudaError> {
        b.copy_from_host(v)
    }

    fn read<'b, T: Element>(&self, b: &'b DeviceBuffer<T>) -> Result<Cow<'b, [T]>, CudaError> {
        self.settle()?;
        Ok(Cow::Owned(b.to_vec()?))
    }

    fn settle(&self) -> Result<(), CudaError> {
        self.comm.synchronize(self.stream)
    }

    fn run_oop<T: Element>(
        &self,
        p: &SizePlan,
        send: &DeviceBuffer<T>,
        recv: &mut DeviceBuffer<T>,
    ) -> Result<(), CudaError> {
        let (c, s, op, root) = (self.comm, self.stream, p.rop, p.root);
        match p.coll {
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

    fn run_ip<T: Element>(&self, p: &SizePlan, buf: &mut DeviceBuffer<T>) -> Result<(), CudaError> {
        let (c, s, op, root) = (self.comm, self.stream, p.rop, p.root);
        match p.coll {
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
}
