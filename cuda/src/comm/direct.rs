//! The device communicator's GPUDirect RDMA path (docs/network.md): whether a staged
//! communicator uses the ring of [`GdrRing`] (every rank votes; the GPU–NIC path and the NIC's
//! registration decide), and its direct all-reduces. Compiled, not run: no GPU beside an RDMA
//! NIC has been lent (docs/gpu-results.md).

use super::*;

impl DeviceComm {
    /// Whether `op` runs on the GPUDirect RDMA ring: an all-reduce with a plain reduction (Avg
    /// and PreMulSum scale, which the ring does not) whose chunks fit the scratch.
    pub(super) fn gdr_fits(&self, op: &weftcc_collectives::RawOp) -> bool {
        let n = self.size;
        self.gdr_scratch > 0
            && op.kind == OpKind::AllReduce
            && matches!(
                op.op,
                ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Min | ReduceOp::Max
            )
            && op.count > 0
            && n > 1
            && op.count.div_ceil(n) * op.dtype.size() * (n - 1) <= self.gdr_scratch
    }

    /// An all-reduce on the GPUDirect RDMA ring: out of place, the stream first copies the
    /// input into the output; then the proxy runs the ring on the output, in place, in device
    /// memory (the NIC writes from and into it, the GPU reduces), and the stream waits for its
    /// release as for a staged job. Compiled, not run.
    pub(super) fn enqueue_direct(
        &self,
        proxy: &Proxy,
        seq: u64,
        op: weftcc_collectives::RawOp,
        send: Option<DevSpan>,
        recv: DevSpan,
        stream: &Stream,
    ) -> Result<()> {
        let (alloc, offset) = DeviceAllocation::containing(&self.ctx, recv.ptr)?;
        // Held across ticket and submit (tickets reach the proxy in order).
        let staging = lock(&proxy.staging);
        if let Some(s) = send.filter(|s| s.ptr != recv.ptr && s.bytes > 0) {
            self.ctx.bind()?;
            // SAFETY: both spans lie inside live device allocations of this context (the
            // call's checks); the copy is ordered on the caller's stream.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(recv.ptr, s.ptr, recv.bytes, stream.as_raw())
            })?;
        }
        let (gpu, input, output) = self.gpu_staging(proxy, &staging, stream);
        let ready = gpu.mark()?;
        let ticket = proxy.thread.next_ticket();
        let done = Arc::new(Outcome::default());
        proxy.thread.submit(Job {
            seq,
            ticket,
            work: Work::Collective { op, send, recv },
            input_at: 0,
            output_at: 0,
            ready,
            input,
            output,
            done: done.clone(),
            direct: Some(Direct {
                buf: Arc::new(alloc),
                offset,
                comb: op.op.combiner(),
            }),
        })?;
        if !gpu.wait_release(ticket)? {
            match done.wait(self.host.timeout() * 2) {
                Some(r) => r?,
                None => return Err(CudaError::Other("proxy did not answer".into())),
            }
            stream.synchronize(self.host.timeout())?;
        }
        Ok(())
    }
}

/// Device scratch of a GPUDirect RDMA ring per rank: all-reduces of up to
/// `GDR_SCRATCH × n / (n − 1)` bytes run on it, larger ones stage.
pub(super) const GDR_SCRATCH: usize = 64 << 20;

/// The GPUDirect RDMA ring of a staged communicator whose ranks are each on a host of their
/// own, where a network provider is open and `WEFT_NET_GDR_LEVEL` is not `LOC`: every rank
/// votes, then [`GdrRing::connect`] decides with the GPU–NIC path and the NIC's registration
/// (logging `GDRDMA` or why not, per peer). `None`: stage. Compiled, not run (no GPU beside an
/// RDMA NIC has been lent).
pub(super) fn gdr_ring(
    host: &Communicator,
    ctx: &Context,
    own_hosts: bool,
    my_bus: &str,
    level: weftcc_topology::PathClass,
) -> Result<Option<Box<GdrRing>>> {
    use weftcc_transports::net::{select, NetChoice};
    let rank = host.rank();
    let provider = NetChoice::from_env()
        .ok()
        .and_then(|c| select::open(&c).ok().flatten());
    let why_not = if level == weftcc_topology::PathClass::Loc {
        Some("WEFT_NET_GDR_LEVEL=LOC")
    } else if provider.is_none() {
        Some("no network provider (TCP between hosts)")
    } else if !own_hosts || host.size() < 2 {
        Some("not every rank on a host of its own")
    } else {
        None
    };
    let mut vote = [u8::from(why_not.is_none())];
    host.all_reduce_in_place(&mut vote[..], ReduceOp::Min)?;
    let (Some(provider), 1) = (provider, vote[0]) else {
        let why = why_not.unwrap_or("another rank cannot");
        tracing::info!(target: "weftcc::net", rank, "no GDRDMA (staged through host memory): {why}");
        return Ok(None);
    };
    let device = CudaDevice::new(ctx, host.timeout())?;
    let path = GdrPath {
        class: gpu_nic_class(my_bus, level),
        level,
    };
    let setup = GdrRing::connect(
        rank,
        host.size(),
        &provider,
        Box::new(device),
        path,
        GDR_SCRATCH,
        &exchange_over(host),
        host.timeout(),
    )
    .map_err(|e| CudaError::Gdr(Box::new(e)))?;
    Ok(match setup {
        GdrSetup::Direct(ring) => Some(ring),
        GdrSetup::Staged(_) => None,
    })
}

/// The PCI path class between the GPU with bus id `bus` and the NIC its traffic takes
/// (topology discovery), `N/A` where it is not found (GDR then stays off, logged).
fn gpu_nic_class(bus: &str, level: weftcc_topology::PathClass) -> weftcc_topology::PathClass {
    let topo = weftcc_topology::discover::discover().topology;
    let me = topo.gpu_by_bus_id(bus);
    weftcc_topology::netpath::nic_pairs(&topo, level)
        .into_iter()
        .find(|p| Some(p.gpu) == me)
        .map_or(weftcc_topology::PathClass::Na, |p| p.class)
}
