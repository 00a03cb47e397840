//! `weft doctor --device cuda`: every pair measured over the device communicator
//! (`weftcc_cuda::DeviceComm`: CUDA IPC between the GPUs of a host, staged through pinned host
//! memory otherwise) with device buffers, each rank on GPU `local rank mod device count` as in
//! `weft perf --device cuda` (found in the topology by its PCI bus id). Each pair is compared with the topology's rate for its path
//! ([`weftcc_topology::Topology::gpu_pair_path`]: the pair's NVLink or PCIe class over CUDA IPC,
//! a GPU's PCIe link when staged, and the host's own limits on the way).

use weftcc::comm::doctor::{diagnose_over, Options, PairPath, PathModel, Report};
use weftcc::Communicator;
use weftcc_cuda::{Context, CudaError, DeviceBuffer, DeviceComm, Stream, Transport};
use weftcc_topology::LinkSpeeds;

/// Measures every pair of `comm`'s ranks over their GPUs (collective: every rank calls it).
pub(super) fn diagnose(comm: Communicator, options: &Options) -> Result<Report, CudaError> {
    let ndev = weftcc_cuda::device_count()?;
    if ndev == 0 {
        return Err(CudaError::Other("no CUDA device visible".into()));
    }
    let device = crate::perf::cuda::local_rank(&comm) % ndev;
    let ctx = Context::new(device)?;
    let dcomm = DeviceComm::new(comm, ctx.clone())?;
    let stream = ctx.stream()?;
    let host = dcomm.host();
    let n = host.size();
    // Every rank's GPU, as the topology numbers it (found by PCI bus id: the driver's ordinals
    // follow CUDA_VISIBLE_DEVICES; u64::MAX where not found), and host (hashed id).
    let topology = weftcc_topology::discover::discover().topology;
    let bus = weftcc_cuda::device_info(device)?.pci_bus_id;
    let mine = topology.gpu_by_bus_id(&bus).map_or(u64::MAX, |g| g as u64);
    let mut devs = vec![0u64; n];
    host.all_gather(&[mine][..], &mut devs[..])?;
    let mut hosts = vec![0u64; n];
    host.all_gather(&[host_hash()][..], &mut hosts[..])?;
    let me = host.rank();
    let speeds = LinkSpeeds::default();
    let models: Vec<(&'static str, PathModel)> = (0..n)
        .map(|peer| {
            let local = hosts[peer] == hosts[me];
            let ipc = match dcomm.transport() {
                Transport::Ipc => true,
                Transport::Hierarchical => local,
                Transport::Staged => false,
            };
            let (ours, theirs) = (devs[me], devs[peer]);
            if ipc && (theirs == ours || ours == u64::MAX || theirs == u64::MAX) {
                // One GPU shared by both ranks, or a GPU the topology does not list: no
                // topology figure to compare with.
                ("cuda-ipc", model(f64::NAN, f64::NAN))
            } else if ipc {
                let p = topology.gpu_pair_path(ours as usize, theirs as usize, &speeds);
                ("cuda-ipc", model(p.gbps, p.latency_us))
            } else {
                let (gbps, lat) = speeds.staged();
                ("staged", model(gbps, lat))
            }
        })
        .collect();
    let bytes = options.bytes.max(1);
    let mut path = DevicePath {
        comm: &dcomm,
        stream: &stream,
        small: ctx.alloc_zeroed(8)?,
        big: ctx.alloc_zeroed(bytes)?,
        sink: ctx.alloc_zeroed(bytes)?,
        models,
    };
    diagnose_over(dcomm.host(), options, &mut path)
}

fn model(gbps: f64, latency_us: f64) -> PathModel {
    PathModel {
        limit_gbps: gbps,
        predicted_gbps: gbps,
        predicted_latency_us: latency_us,
    }
}

/// This rank's host id (as the transports see it), hashed to a word.
fn host_hash() -> u64 {
    weftcc_topology::host_id()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// The device communicator's path: every message enqueued on the rank's stream and waited for.
struct DevicePath<'a> {
    comm: &'a DeviceComm,
    stream: &'a Stream,
    small: DeviceBuffer<u8>,
    big: DeviceBuffer<u8>,
    sink: DeviceBuffer<u8>,
    models: Vec<(&'static str, PathModel)>,
}

impl PairPath for DevicePath<'_> {
    type Error = CudaError;
    fn transport(&self, peer: usize) -> Option<&'static str> {
        self.models.get(peer).map(|(t, _)| *t)
    }
    fn send(&mut self, peer: usize, big: bool) -> Result<(), CudaError> {
        let buf = if big { &self.big } else { &self.small };
        self.comm.send(buf, peer, self.stream)?;
        self.comm.synchronize(self.stream)
    }
    fn recv(&mut self, peer: usize, big: bool) -> Result<(), CudaError> {
        let buf = if big { &mut self.sink } else { &mut self.small };
        self.comm.recv(buf, peer, self.stream)?;
        self.comm.synchronize(self.stream)
    }
    fn big_bytes(&self) -> usize {
        self.big.len()
    }
    fn model(&self, peer: usize) -> Option<PathModel> {
        self.models.get(peer).map(|(_, m)| *m)
    }
}
