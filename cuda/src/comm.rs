//! [`DeviceComm`]: collectives on device buffers, with NCCL's stream semantics.
//!
//! A call checks its arguments, enqueues the collective on the caller's [`Stream`] and returns;
//! work enqueued on that stream afterwards sees the result, as if the collective were a kernel.
//! [`DeviceComm::synchronize`] waits for a stream (within the communicator's timeout) and
//! reports errors.
//!
//! Two transports, chosen at creation by all ranks together:
//! * [`Transport::Ipc`] (all ranks on one host, every pair of GPUs able to reach each other's
//!   memory per `cuDeviceCanAccessPeer`, or sharing a GPU; stream memory operations available):
//!   the schedules of `weftcc-collectives` run on the GPUs, peer copies through CUDA IPC
//!   mappings, reductions by the NVRTC kernels, all stream-ordered (see `ipc.rs`).
//! * [`Transport::Staged`] (otherwise, e.g. ranks on several hosts): a proxy thread per
//!   communicator waits for an event recorded on the caller's stream, copies the input to
//!   pinned host memory, runs the host communicator's collective (`execute_raw`: shared memory
//!   or TCP), copies the result back, and releases the caller's stream, which was told with
//!   `cuStreamWaitValue32` to wait for a host-mapped flag. If the driver offers no stream
//!   memory operations, the enqueue waits for the caller's stream and the operation instead
//!   (correct, but not asynchronous).
//!
//! Over IPC, every collective's operation header (kind, type, count, reduction, root, sequence:
//! `OpDesc`) is all-gathered over the host communicator and compared before the call is
//! enqueued (`headers.rs`): ranks that called different collectives all fail with
//! `weftcc_comm::Error::Mismatch` (inside [`CudaError::Host`]), with nothing of the call
//! enqueued; a send/recv group exchanges each pair's headers with that peer the same way. The
//! staged transport's host collectives check their own headers.
//!
//! Errors poison the communicator (every later call fails with the first error), as for the
//! host communicator. After a failure the caller's stream is always released (the staged
//! proxy still raises the flag; the IPC path raises its own flags), so no stream hangs
//! forever: the failed operation's output is garbage and [`DeviceComm::error`] says why.
//!
//! Buffers must stay alive until the stream has passed the operation (as with NCCL).

mod direct;

use direct::{gdr_ring, GDR_SCRATCH};

use crate::driver::{check, has_symbol};
use crate::error::DeviceArgError;
use crate::error::{CudaError, Result};
use crate::gdr::{exchange_over, CudaDevice, GdrPath, GdrRing, GdrSetup};
use crate::group::DeviceGroup;
use crate::headers;
use crate::ipc::{BufferMap, IpcPeers};
use crate::memory::DeviceAllocation;
use crate::memory::{Context, DeviceBuffer, Event, PinnedBuffer, Stream};
use crate::proxy::{Direct, Job, Outcome, ProxyThread, Ready, StagingMemory};
use crate::staged::{self, Side, StagingStream};
use crate::tiered::Tiers;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::Duration;
use weftcc_collectives::call::{self, Plan};
use weftcc_collectives::schedule::hierarchical::HostLayout;
use weftcc_collectives::schedule::p2p;
use weftcc_collectives::{
    schedule, Algorithm, Combiner, DataType, Element, OpKind, RawOp, ReduceOp,
};
use weftcc_comm::{AbortCause, Communicator};
use weftcc_transports::lock;

/// How a device communicator moves data between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// CUDA IPC peer copies and GPU reduction kernels (ranks on one host).
    Ipc,
    /// Staging through pinned host memory into the host communicator.
    Staged,
    /// Ranks on several hosts: CUDA IPC between the ranks of a host, staged through pinned host
    /// memory into the host network between hosts, hierarchical collectives (`tiered.rs`).
    Hierarchical,
}

// `WEFT_CUDA_IPC=0` forces the staged transport.
// (Read through `weftcc_settings::CUDA_IPC`.)
// `WEFT_CUDA_HIERARCHICAL=0` stages every operation of ranks on several hosts instead of
// using CUDA IPC inside each host.
// (Read through `weftcc_settings::CUDA_HIERARCHICAL`.)
// `WEFT_CUDA_CHECK_HEADERS=0` skips the IPC path's operation-header exchange (`headers.rs`):
// enqueueing then never waits for the other ranks' CPUs, and mismatched collectives or
// send/recv sizes between the GPUs of one host go undetected (NCCL's behaviour). Default 1; if any rank sets 0, no
// rank checks (they must agree, or the checking ones would wait in the exchange).
// (Read through `weftcc_settings::CUDA_CHECK_HEADERS`.)
// Bytes per chunk of a staged all-reduce, broadcast or reduce (`staged.rs`): a larger call
// runs as one host operation per chunk, so the GPU's copy of one chunk to or from pinned
// memory overlaps the host network's work on another. 0 stages each call whole. Default
// [`DEFAULT_STAGE_CHUNK`]; the smallest of the ranks' settings is used (they must cut alike),
// and 0 when any rank's GPU lacks stream memory operations.
// (Read through `weftcc_settings::CUDA_STAGE_CHUNK`.)
/// Default of `WEFT_CUDA_STAGE_CHUNK`: off. An earlier version of the chunked path measured
/// 1.25–1.32× faster at 64–256 MiB (2 ranks staged, H200); this one has not run on a GPU yet.
pub const DEFAULT_STAGE_CHUNK: usize = 0;
// Bytes per IPC slot (the largest message of a pipelined transfer); default
// [`DEFAULT_SLOT_BYTES`].
// (Read through `weftcc_settings::CUDA_SLOT_BYTES`.)
// Slots per peer (messages in flight per pair); default [`DEFAULT_DEPTH`].
// (Read through `weftcc_settings::CUDA_DEPTH`.)
/// Default IPC slot size. Every message costs a few stream operations (wait, copy or kernel,
/// flag write) of some 15 µs together, so large slots carry the bandwidth: on an H100, 2-rank
/// all-reduce of 512 MiB reached 63 GB/s bus bandwidth with 1 MiB slots, 306 with 16 MiB
/// (docs/gpu-results.md).
pub const DEFAULT_SLOT_BYTES: usize = 16 << 20;
/// Default slots per peer: two let a copy into one slot overlap the reduction out of the other
/// (4 measured within 5 % of 2 with 16 MiB slots, for twice the memory). The inbox holds
/// `(ranks - 1) × depth × slot` bytes: 32 MiB per peer by default.
pub const DEFAULT_DEPTH: usize = 2;
// Largest all-reduce (bytes) that runs recursive doubling instead of the ring over IPC; 0
// always uses the ring. Default [`DEFAULT_RD_MAX`].
// (Read through `weftcc_settings::CUDA_RD_MAX`.)
// Smallest all-reduce (bytes) of the hierarchical transport that is sharded across hosts
// (reduce-scatter inside the host, all-reduce of each shard across, all-gather); smaller ones
// reduce to local rank 0, all-reduce among local ranks 0, broadcast inside the host. 0 always
// shards. Default `weftcc_collectives::tiers::DEFAULT_SHARD_MIN` (128 KiB).
// (Read through `weftcc_settings::CUDA_SHARD_MIN`.)
/// Default of `WEFT_CUDA_RD_MAX`. Each message on the IPC path costs a fixed ~15–20 µs of stream
/// operations, and the ring's `2 (n - 1)` dependent steps pay it in series where recursive
/// doubling's `log2 n` rounds (two more when `n` is not a power of two) move the whole buffer
/// each: fewer, larger messages win until bandwidth dominates. On an H100 (ranks sharing it,
/// MPS) recursive doubling was faster up to 2 MiB with 2 ranks (8 B 31–39 vs 45–48 µs) and up
/// to 16 MiB with 4 (70 vs 122–215 µs below 2 MiB), the ring from 16 MiB and 128 MiB.
pub const DEFAULT_RD_MAX: usize = 4 << 20;

/// Whether `cuStreamWaitValue32_v2`/`cuStreamWriteValue32_v2` exist and work on this device.
fn stream_mem_ops(ctx: &Context) -> bool {
    if !has_symbol("cuStreamWaitValue32_v2") || !has_symbol("cuStreamWriteValue32_v2") {
        return false;
    }
    let probe = || -> Result<()> {
        let flag = PinnedBuffer::new(ctx, 4)?;
        let dptr = flag.device_ptr()?;
        let s = ctx.stream()?;
        // SAFETY: `dptr` maps the 4 pinned bytes of `flag`, alive until after the sync below.
        check("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(
                s.as_raw(),
                dptr,
                0,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })?;
        s.synchronize(Duration::from_secs(10))
    };
    probe().is_ok()
}

/// The device path's settings, read once when a device communicator is made. A value that
/// does not parse fails the creation on every rank: it is checked with the others, like every
/// choice made there (a rank that gave up alone would leave the others waiting).
struct DeviceSettings {
    gdr_level: weftcc_topology::PathClass,
    ipc: bool,
    hierarchical: bool,
    check_headers: bool,
    stage_chunk: usize,
    slot_bytes: usize,
    depth: usize,
    rd_max: usize,
    shard_min: usize,
}

impl DeviceSettings {
    fn read() -> Result<DeviceSettings> {
        use weftcc_settings as s;
        let host = |e: weftcc_settings::SettingError| CudaError::Host(e.into());
        Ok(DeviceSettings {
            gdr_level: weftcc_topology::netpath::gdr_level_from_env()
                .map_err(|e| CudaError::Other(e.to_string()))?,
            ipc: s::CUDA_IPC.flag_or(true).map_err(host)?,
            hierarchical: s::CUDA_HIERARCHICAL.flag_or(true).map_err(host)?,
            check_headers: s::CUDA_CHECK_HEADERS.flag_or(true).map_err(host)?,
            stage_chunk: (s::CUDA_STAGE_CHUNK.size().map_err(host)?).unwrap_or(DEFAULT_STAGE_CHUNK),
            slot_bytes: (s::CUDA_SLOT_BYTES.size().map_err(host)?)
                .unwrap_or(DEFAULT_SLOT_BYTES)
                .next_multiple_of(16),
            depth: (s::CUDA_DEPTH.number().map_err(host)?).map_or(DEFAULT_DEPTH, |d| d as usize),
            rd_max: (s::CUDA_RD_MAX.size().map_err(host)?).unwrap_or(DEFAULT_RD_MAX),
            shard_min: (s::CUDA_SHARD_MIN.size().map_err(host)?)
                .unwrap_or(weftcc_collectives::tiers::DEFAULT_SHARD_MIN),
        })
    }
}

/// A device buffer argument, untyped: address and bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DevSpan {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

/// What a staged job moves.
#[derive(Debug)]
pub(crate) enum Work {
    Collective {
        op: RawOp,
        send: Option<DevSpan>,
        recv: DevSpan,
    },
    /// Grouped sends and receives (peer, buffer), each staged end to end.
    Group {
        sends: Vec<(usize, DevSpan)>,
        recvs: Vec<(usize, DevSpan)>,
    },
}

impl Work {
    pub(crate) fn kind(&self) -> OpKind {
        match self {
            Work::Collective { op, .. } => op.kind,
            Work::Group { .. } => OpKind::SendRecv,
        }
    }

    /// Bytes of pinned input and output staging the job needs.
    pub(crate) fn staged_bytes(&self) -> (usize, usize) {
        let total = |v: &[(usize, DevSpan)]| v.iter().map(|(_, s)| s.bytes).sum();
        match self {
            Work::Collective { send, recv, .. } => (send.map_or(0, |s| s.bytes), recv.bytes),
            Work::Group { sends, recvs } => (total(sends), total(recvs)),
        }
    }
}

/// The staged transport: its proxy thread (`proxy.rs`), the release counter the caller's
/// streams wait on, and the staging buffers.
struct Proxy {
    thread: ProxyThread,
    /// The release counter (host-mapped, pinned), as the GPU addresses it.
    flag_dev: u64,
    /// Tickets and staging, taken for a whole enqueue: tickets reach the proxy in order.
    staging: Mutex<Staging>,
    mem_ops: bool,
}

/// Shared between the communicator and its proxy thread.
pub(crate) struct Shared {
    rank: usize,
    error: Mutex<Option<CudaError>>,
    /// Aborted at this communicator's first failure: for a tier of a hierarchical
    /// communicator, its flat host communicator. A tier's failure (a mismatch or a lost peer in
    /// the cross-host tier, say) reaches only that tier's ranks by itself; the ranks of the
    /// other tiers would finish the operation on partial data and never hear of it.
    abort_on_failure: OnceLock<Arc<Communicator>>,
}

impl Shared {
    pub(crate) fn new(rank: usize) -> Shared {
        Shared {
            rank,
            error: Mutex::new(None),
            abort_on_failure: OnceLock::new(),
        }
    }

    pub(crate) fn poison(&self, e: &CudaError) {
        let mut g = lock(&self.error);
        if g.is_none() {
            *g = Some(e.clone());
            drop(g);
            if let Some(flat) = self.abort_on_failure.get() {
                // The other ranks learn this tier's failure itself (cause, operation).
                let facts = e.facts();
                let cause = if headers::is_mismatch(e) {
                    AbortCause::Mismatch
                } else {
                    AbortCause::Failed
                };
                flat.abort_because(e.to_string(), cause, facts.op.zip(facts.seq));
            }
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let g = lock(&self.error);
        match &*g {
            Some(e) => Err(CudaError::Poisoned {
                rank: self.rank,
                first: e.to_string(),
            }),
            None => Ok(()),
        }
    }
}

/// A communicator for device buffers, built on a host [`Communicator`].
pub struct DeviceComm {
    host: Arc<Communicator>,
    ctx: Context,
    transport: Transport,
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
    /// IPC state (shared with the host communicator's failure hook).
    ipc: Option<Arc<Mutex<IpcPeers>>>,
    /// All-reduces of at most this many bytes use recursive doubling on the IPC path.
    rd_max: usize,
    proxy: Option<Proxy>,
    /// The hierarchical transport's tiers (shared with the host communicator's failure hook).
    tiers: Option<Arc<Tiers>>,
    seq: AtomicU64,
    /// IPC: the counters the operation headers are numbered by. Held from the header exchange
    /// to the end of the enqueue, so that header order and enqueue order agree.
    headers: Mutex<HeaderSeqs>,
    /// IPC: whether collectives and send/recv groups exchange and compare their headers
    /// ([`weftcc_settings::CUDA_CHECK_HEADERS`]).
    check_headers: bool,
    /// Staged: bytes per chunk of element-wise collectives ([`weftcc_settings::CUDA_STAGE_CHUNK`], agreed).
    stage_chunk: usize,
    /// Wire code of the last operation enqueued (named in timeouts).
    last_op: AtomicU8,
    /// Staged: the proxy owns a GPUDirect RDMA ring with this much scratch per rank (0: none);
    /// the all-reduces that fit run on it (`enqueue_direct`).
    gdr_scratch: usize,
}

/// What the IPC path's operation headers are numbered by.
#[derive(Default)]
struct HeaderSeqs {
    /// The last collective's (collectives only, from 1, as the host communicator counts them).
    collectives: u64,
    /// Messages sent to and received from each peer in send/recv groups so far (the pair's
    /// message sequence numbers, as the host engine counts them).
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.ctx.ordinal())
            .field("transport", &self.transport)
            .finish()
    }
}

static SHARED_GPU_WARNING: Once = Once::new();

/// What each rank tells the others at creation.
const REC: usize = 128;

fn hostname() -> String {
    weftcc_settings::HOST_ID.value().unwrap_or_else(|| {
        nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown".into())
    })
}

impl DeviceComm {
    /// Creates the device communicator of this rank (collective: every rank of `host` calls
    /// it). `ctx` is this rank's GPU. Loads the kernels, chooses the transport with the other
    /// ranks, and sets it up.
    pub fn new(host: Communicator, ctx: Context) -> Result<DeviceComm> {
        let (rank, size) = (host.rank(), host.size());
        // Checked with the other ranks: a rank that gave up alone would leave them waiting.
        let settings = DeviceSettings::read();
        ctx.bind()?;
        // Local facts: host, GPU, and whether this rank can take part in IPC.
        let info = crate::driver::device_info(ctx.ordinal())?;
        let mem_ops = stream_mem_ops(&ctx);
        let ipc_allowed = settings.as_ref().is_ok_and(|s| s.ipc);
        let kernels_ok = ctx.load_kernels();
        let mut mine = [0u8; REC];
        let h = hostname();
        let hb = &h.as_bytes()[..h.len().min(64)];
        mine[..hb.len()].copy_from_slice(hb);
        let bus = info.pci_bus_id.as_bytes();
        let bus = &bus[..bus.len().min(48)];
        mine[64..64 + bus.len()].copy_from_slice(bus);
        mine[120] = u8::from(mem_ops && ipc_allowed);
        mine[121] = u8::from(kernels_ok.is_ok());
        mine[122] = u8::from(settings.is_ok());
        let mut all = vec![0u8; REC * size];
        host.all_gather(&mine[..], &mut all[..])?;
        let field = |r: usize, a: usize, b: usize| {
            let s = &all[r * REC + a..r * REC + b];
            let end = s.iter().position(|&c| c == 0).unwrap_or(s.len());
            String::from_utf8_lossy(&s[..end]).into_owned()
        };
        if let Some(bad) = (0..size).find(|&r| all[r * REC + 122] == 0) {
            return Err(match settings {
                Err(e) if bad == rank => e,
                _ => CudaError::Other(format!(
                    "rank {bad}: one of its WEFT_* settings does not parse (its own error names it)"
                )),
            });
        }
        let settings = settings?;
        let gdr_level = settings.gdr_level;
        let hosts: Vec<String> = (0..size).map(|r| field(r, 0, 64)).collect();
        let layout = HostLayout::from_labels(&hosts);
        let one_host = layout.hosts() == 1;
        let own_hosts = layout.max_local() == 1;
        let my_bus = info.pci_bus_id.clone();
        let mut sharing = false;
        // Whether this GPU reaches the GPUs of every other rank, and of every rank of its host.
        let (mut p2p_ok, mut p2p_host_ok) = (true, true);
        for r in 0..size {
            if r == rank {
                continue;
            }
            let bus = field(r, 64, 112);
            let reachable = bus.eq_ignore_ascii_case(&my_bus) || peer_reachable(&ctx, &bus);
            if bus.eq_ignore_ascii_case(&my_bus) && hosts[r] == hosts[rank] {
                sharing = true;
            }
            p2p_ok &= reachable;
            if hosts[r] == hosts[rank] {
                p2p_host_ok &= reachable;
            }
        }
        if sharing {
            SHARED_GPU_WARNING.call_once(|| {
                // Measured on an H100: ~4 ms per operation of any size without MPS (the driver
                // time-slices the processes' contexts), 31 µs at 8 B with it.
                eprintln!(
                    "weftcc: warning: several ranks share GPU {my_bus}; correct, but unless MPS \
                     runs (nvidia-cuda-mps-control -d) every operation waits for time slices (~4 ms)"
                );
                tracing::warn!(
                    target: "weftcc::cuda",
                    "several ranks share GPU {my_bus}: correct, but unless MPS runs every operation waits for time slices (fine for tests, slow for training)"
                );
            });
        }
        let all_flags = (0..size).all(|r| all[r * REC + 120] == 1 && all[r * REC + 121] == 1);
        // Hierarchical only where some host has several ranks (else it is staging with extra
        // steps; it also keeps the tiers, made by this function, from recursing).
        let tiers_allowed = settings.hierarchical;
        let mut vote = [
            u8::from(one_host && p2p_ok && all_flags),
            u8::from(
                // The tiers regroup the fold: deterministic mode stages (the host's order).
                !one_host
                    && layout.max_local() > 1
                    && p2p_host_ok
                    && all_flags
                    && tiers_allowed
                    && !host.deterministic(),
            ),
        ];
        host.all_reduce_in_place(&mut vote[..], ReduceOp::Min)?;
        // Kernels are needed by the IPC path and by nothing else; report them only then.
        let transport = if vote[0] == 1 || (size == 1 && kernels_ok.is_ok()) {
            Transport::Ipc
        } else if vote[1] == 1 {
            Transport::Hierarchical
        } else {
            Transport::Staged
        };
        // The tiers are communicators of their own, split from the host one (collective: every
        // rank makes its host's first, then its local index's).
        let tiers = match transport {
            Transport::Hierarchical => {
                let (h, l) = layout
                    .host_of(rank)
                    .zip(layout.local_index(rank))
                    .ok_or_else(|| CudaError::Other("rank outside its own layout".into()))?;
                let split = |color: usize, key: usize| -> Result<Communicator> {
                    host.split(Some(color as u32), key as i64)?
                        .ok_or_else(|| CudaError::Other("split without a communicator".into()))
                };
                let local_host = split(h, rank)?;
                let cross_host = split(l, h)?;
                let local = DeviceComm::new(local_host, ctx.clone())?;
                let cross = DeviceComm::new(cross_host, ctx.clone())?;
                log_paths(rank, &layout, &local, &cross, gdr_level);
                // Every rank must shard the same calls (the plans differ otherwise): the
                // smallest of the ranks' settings.
                let mut shard_min = [settings.shard_min as u64];
                host.all_reduce_in_place(&mut shard_min[..], ReduceOp::Min)?;
                let shard_min = usize::try_from(shard_min[0]).unwrap_or(usize::MAX);
                Some(Arc::new(Tiers::new(layout, local, cross, shard_min)))
            }
            _ => None,
        };
        let host = Arc::new(host);
        if let Some(t) = &tiers {
            for tier in [&t.local, &t.cross] {
                let _ = tier.shared.abort_on_failure.set(host.clone());
            }
            // And the other way: when the whole communicator fails (a tier's failure on some
            // rank, a lost rank, an abort), every tier here ends, so that no operation of a
            // tier waits on for a rank that stopped in another tier.
            let tiers = Arc::downgrade(t);
            host.on_failure(move |e| {
                if let Some(t) = tiers.upgrade() {
                    t.end(e);
                }
            });
        }
        let shared = Arc::new(Shared::new(rank));
        let mut check_headers = false;
        let mut stage_chunk = 0;
        let mut gdr_scratch = 0;
        let (ipc, proxy) = match transport {
            Transport::Ipc => {
                let mut check = [u8::from(settings.check_headers)];
                host.all_reduce_in_place(&mut check[..], ReduceOp::Min)?;
                check_headers = check[0] == 1;
                let (slot, depth) = (settings.slot_bytes, settings.depth);
                let peers = Arc::new(Mutex::new(IpcPeers::connect(&host, &ctx, slot, depth)?));
                // When the host communicator fails (a rank died, timed out or aborted; another
                // rank's failure as the watcher learns it), every GPU wait of ours is released
                // at once instead of at this rank's timeout.
                let (shared, ipc) = (Arc::downgrade(&shared), Arc::downgrade(&peers));
                host.on_failure(move |e| {
                    if let Some(shared) = shared.upgrade() {
                        // After a mismatch no rank enqueued any of the mismatched call (the
                        // checks run first): the operations still on the GPU must finish with
                        // their data. (A rank whose own send/recv pairs agreed may still wait
                        // for a mismatched pair's rank until its timeout.)
                        let release = e.abort_cause() != AbortCause::Mismatch;
                        end_because(&shared, ipc.upgrade().as_deref(), e, release);
                    }
                });
                (Some(peers), None)
            }
            Transport::Staged | Transport::Hierarchical => {
                // Every rank must cut staged calls into the same chunks.
                // Chunks only where every stream waits for the proxy by itself (stream memory
                // operations): without, each piece would be waited for on the host.
                let wanted = if mem_ops { settings.stage_chunk } else { 0 };
                let mut chunk = [wanted as u64];
                host.all_reduce_in_place(&mut chunk[..], ReduceOp::Min)?;
                stage_chunk = usize::try_from(chunk[0]).unwrap_or(usize::MAX);
                let gdr = match transport {
                    Transport::Staged => gdr_ring(&host, &ctx, own_hosts, &my_bus, gdr_level)?,
                    _ => None,
                };
                gdr_scratch = if gdr.is_some() { GDR_SCRATCH } else { 0 };
                (
                    None,
                    Some(Proxy::start(&ctx, &host, &shared, mem_ops, gdr)?),
                )
            }
        };
        tracing::info!(target: "weftcc::cuda", rank, size, device = ctx.ordinal(), ?transport, "device communicator ready");
        Ok(DeviceComm {
            host,
            ctx,
            transport,
            rank,
            size,
            shared,
            ipc,
            rd_max: settings.rd_max,
            proxy,
            tiers,
            seq: AtomicU64::new(0),
            headers: Mutex::new(HeaderSeqs {
                sent: vec![0; size],
                received: vec![0; size],
                ..HeaderSeqs::default()
            }),
            check_headers,
            stage_chunk,
            last_op: AtomicU8::new(OpKind::AllReduce as u8),
            gdr_scratch,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The transport chosen at creation.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// This rank's context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The host communicator underneath (do not run host collectives on it from another thread
    /// while device operations are enqueued: the staged proxy runs every staged operation on
    /// it, and the IPC transport exchanges every collective's operation header over it).
    pub fn host(&self) -> &Communicator {
        &self.host
    }

    /// The first fatal error, if any (a tier's included).
    pub fn error(&self) -> Option<CudaError> {
        self.tier_failure();
        lock(&self.shared.error).clone()
    }

    /// Poisons this communicator with the first error of a tier, if one failed, or else with
    /// the flat host communicator's (a tier that failed on other ranks aborted it).
    fn tier_failure(&self) {
        let Some(tiers) = &self.tiers else { return };
        let e = match (tiers.error(), self.host.error()) {
            (Some(detail), _) => CudaError::Collective {
                rank: self.rank,
                op: self.last_kind(),
                seq: self.seq.load(Ordering::Relaxed).saturating_sub(1),
                detail,
            },
            (None, Some(host)) => CudaError::Host(host),
            (None, None) => return,
        };
        self.shared.poison(&e);
    }

    fn last_kind(&self) -> OpKind {
        OpKind::from_code(self.last_op.load(Ordering::Relaxed)).unwrap_or(OpKind::AllReduce)
    }

    /// Waits for everything enqueued on `stream` (at most the host communicator's timeout) and
    /// reports the first error of this communicator. On a timeout the communicator is aborted
    /// (see [`DeviceComm::abort`]).
    pub fn synchronize(&self, stream: &Stream) -> Result<()> {
        let timeout = self.host.timeout();
        if let Err(e) = stream.synchronize(timeout) {
            tracing::error!(target: "weftcc::cuda", rank = self.rank, "{e}");
            let e = CudaError::Timeout {
                rank: self.rank,
                op: self.last_kind(),
                seq: self.seq.load(Ordering::Relaxed).saturating_sub(1),
                after: timeout,
            };
            self.shared.poison(&e);
            self.abort();
            return Err(e);
        }
        self.tier_failure();
        self.shared.check()
    }

    /// Makes the communicator unusable and releases every stream waiting on it (the data of
    /// operations in flight is garbage). The host communicator is aborted too, so the other
    /// ranks learn of it.
    pub fn abort(&self) {
        let e = CudaError::Other(format!("rank {}: device communicator aborted", self.rank));
        poison_and_release(&self.shared, self.ipc.as_deref(), &e);
        if let Some(t) = &self.tiers {
            t.abort();
        }
        self.host.abort();
    }

    /// Ends this tier communicator because the communicator it is a tier of failed with `e`
    /// ([`end_because`]), and aborts its host communicator with that cause: a host operation of
    /// this tier waiting for a rank that stopped elsewhere fails now, and the staged proxy
    /// releases its stream.
    pub(crate) fn end_as_tier(&self, e: &weftcc_comm::Error) {
        // Released whatever the cause: the stages after a failing one (a mismatch found by the
        // cross tier's proxy, say) are already on the streams, waiting for each other.
        end_because(&self.shared, self.ipc.as_deref(), e, true);
        let facts = e.facts();
        self.host.abort_because(
            format!("the communicator it is a tier of failed: {e}"),
            e.abort_cause(),
            facts.op.zip(facts.seq),
        );
    }

    pub(crate) fn invalid(&self, op: OpKind, reason: impl Into<DeviceArgError>) -> CudaError {
        CudaError::InvalidArgument {
            rank: self.rank,
            op,
            reason: reason.into(),
        }
    }

    pub(crate) fn span<T: Element>(&self, op: OpKind, b: &DeviceBuffer<T>) -> Result<DevSpan> {
        if b.context().ordinal() != self.ctx.ordinal() {
            return Err(self.invalid(
                op,
                DeviceArgError::BufferDevice {
                    buffer: b.context().ordinal(),
                    comm: self.ctx.ordinal(),
                },
            ));
        }
        Ok(DevSpan {
            ptr: b.device_ptr(),
            bytes: b.byte_len(),
        })
    }

    /// Enqueues `call` with raw device addresses.
    ///
    /// # Safety
    /// `send` (if any) and `recv` must be device memory of this communicator's device, valid for
    /// the given number of bytes until `stream` has passed the operation, and `stream` must be
    /// the caller's stream of this context.
    pub unsafe fn enqueue_raw(
        &self,
        call: RawOp,
        send: Option<(u64, usize)>,
        recv: (u64, usize),
        stream: &Stream,
    ) -> Result<()> {
        self.enqueue(
            call,
            send.map(|(ptr, bytes)| DevSpan { ptr, bytes }),
            DevSpan {
                ptr: recv.0,
                bytes: recv.1,
            },
            stream,
        )
    }

    /// Enqueues a group of sends and receives with raw device addresses: `(peer, address,
    /// bytes)` each, run like [`DeviceGroup::run`].
    ///
    /// # Safety
    /// Every address is device memory of this communicator's device, valid for its bytes until
    /// `stream` has passed the group (receive buffers written, and not overlapping any other
    /// buffer of the group); `stream` is a stream of this context.
    pub unsafe fn enqueue_group_raw(
        &self,
        sends: &[(usize, u64, usize)],
        recvs: &[(usize, u64, usize)],
        stream: &Stream,
    ) -> Result<()> {
        let spans = |list: &[(usize, u64, usize)]| -> Vec<(usize, DevSpan)> {
            list.iter()
                .map(|&(peer, ptr, bytes)| (peer, DevSpan { ptr, bytes }))
                .collect()
        };
        self.enqueue_group(spans(sends), spans(recvs), stream)
    }

    pub(crate) fn enqueue(
        &self,
        call: RawOp,
        send: Option<DevSpan>,
        recv: DevSpan,
        stream: &Stream,
    ) -> Result<()> {
        self.shared.check()?;
        if stream.context().ordinal() != self.ctx.ordinal() {
            return Err(self.invalid(call.kind, DeviceArgError::StreamDevice));
        }
        if matches!(call.kind, OpKind::Barrier | OpKind::SendRecv) {
            return Err(self.invalid(call.kind, DeviceArgError::NotDeviceCollective));
        }
        let plan = call
            .plan(self.rank, self.size, send.map(|s| s.bytes), recv.bytes)
            .map_err(|r| self.invalid(call.kind, r))?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.last_op.store(call.kind as u8, Ordering::Relaxed);
        let r = match (self.transport, &self.tiers) {
            (Transport::Hierarchical, Some(t)) => {
                self.enqueue_tiered(t, seq, &call, send, recv, stream)
            }
            (Transport::Ipc, _) => self.enqueue_ipc(&call, send, recv, &plan, stream),
            _ => self.enqueue_staged(
                seq,
                Work::Collective {
                    op: call,
                    send,
                    recv,
                },
                stream,
            ),
        };
        r.map_err(|e| self.failed(call.kind, seq, e))
    }

    /// Names the operation in an enqueue failure and, unless the arguments were wrong (nothing
    /// was enqueued), poisons the communicator and releases every GPU wait of ours.
    ///
    /// A header mismatch (IPC) stays `CudaError::Host(Error::Mismatch)` and poisons without
    /// releasing anything: every rank found it before enqueuing any of the call, so the earlier
    /// operations still on the GPU are whole on every rank and must complete with their data
    /// (raising our flags would let our waits for them pass early).
    fn failed(&self, kind: OpKind, seq: u64, e: CudaError) -> CudaError {
        if headers::is_mismatch(&e) {
            self.shared.poison(&e);
            if kind == OpKind::SendRecv {
                // Only the two ends of a pair found it (every rank finds a collective's): the
                // others learn it through the host communicator, and fail their next call at
                // once instead of waiting for these two in its header exchange.
                let facts = e.facts();
                self.host.abort_because(
                    e.to_string(),
                    AbortCause::Mismatch,
                    facts.op.zip(facts.seq),
                );
            }
            return e;
        }
        let e = match e {
            e @ (CudaError::InvalidArgument { .. } | CudaError::Poisoned { .. }) => e,
            other => CudaError::Collective {
                rank: self.rank,
                op: kind,
                seq,
                detail: other.to_string(),
            },
        };
        if !matches!(e, CudaError::InvalidArgument { .. }) {
            poison_and_release(&self.shared, self.ipc.as_deref(), &e);
            // Stages already enqueued may wait for peers that wait for the stage that failed
            // (a flat stage too: the host communicator is aborted with the tiers).
            if let Some(t) = &self.tiers {
                t.abort();
                self.host.abort();
            }
        }
        e
    }

    /// Starts a group of sends and receives on device buffers, enqueued together by
    /// [`DeviceGroup::run`] (NCCL's `ncclGroupStart`/`ncclSend`/`ncclRecv`/`ncclGroupEnd`).
    pub fn group(&self) -> DeviceGroup<'_> {
        DeviceGroup::new(self)
    }

    /// Sends `buf` to `peer`, which must enqueue a matching [`DeviceComm::recv`] of the same
    /// size. Enqueued on `stream` like a collective.
    pub fn send<T: Element>(
        &self,
        buf: &DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.group().send(buf, peer).run(stream)
    }

    /// Receives into `buf` from `peer` (enqueued on `stream`).
    pub fn recv<T: Element>(
        &self,
        buf: &mut DeviceBuffer<T>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        self.group().recv(buf, peer).run(stream)
    }

    /// Enqueues a group's sends and receives (checked here, as the host communicator does).
    pub(crate) fn enqueue_group(
        &self,
        sends: Vec<(usize, DevSpan)>,
        recvs: Vec<(usize, DevSpan)>,
        stream: &Stream,
    ) -> Result<()> {
        let kind = OpKind::SendRecv;
        self.shared.check()?;
        if stream.context().ordinal() != self.ctx.ordinal() {
            return Err(self.invalid(kind, DeviceArgError::StreamDevice));
        }
        for &(peer, _) in sends.iter().chain(recvs.iter()) {
            call::check_peer(self.rank, self.size, peer).map_err(|e| self.invalid(kind, e))?;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.last_op.store(kind as u8, Ordering::Relaxed);
        let r = match (self.transport, &self.tiers) {
            (Transport::Hierarchical, Some(t)) => {
                self.enqueue_group_tiered(t, seq, sends, recvs, stream)
            }
            (Transport::Ipc, _) => self.enqueue_group_ipc(&sends, &recvs, stream),
            _ => self.enqueue_staged(seq, Work::Group { sends, recvs }, stream),
        };
        r.map_err(|e| self.failed(kind, seq, e))
    }

    /// The IPC state (present exactly when the transport is IPC).
    fn ipc_state(&self) -> Result<std::sync::MutexGuard<'_, IpcPeers>> {
        self.ipc
            .as_ref()
            .map(|m| lock(m))
            .ok_or_else(|| CudaError::Other("IPC transport without IPC state".into()))
    }

    fn enqueue_group_ipc(
        &self,
        sends: &[(usize, DevSpan)],
        recvs: &[(usize, DevSpan)],
        stream: &Stream,
    ) -> Result<()> {
        // Lock order as for collectives: headers, then the IPC state, which is not held during
        // the host exchange (a host failure there runs the hook that takes it).
        let mut seqs = lock(&self.headers);
        let slot_bytes = self.ipc_state()?.slot_bytes;
        let spans = |list: &[(usize, DevSpan)]| -> Vec<(usize, u64, usize)> {
            list.iter().map(|(p, s)| (*p, s.ptr, s.bytes)).collect()
        };
        let group = p2p::group_schedule(&spans(sends), &spans(recvs), slot_bytes);
        // Each pair's headers, checked by both ends before anything is enqueued: mismatched
        // sizes would otherwise leave a stream waiting on flags, or shift the message counters
        // so that a later group reads another message's bytes.
        let HeaderSeqs { sent, received, .. } = &mut *seqs;
        let pairs = p2p::pair_headers(&group, sent, received);
        if self.check_headers && !pairs.is_empty() {
            headers::exchange_pairs(&self.host, &pairs)?;
        }
        let mut ipc = self.ipc_state()?;
        // A failure during the exchange may have released our flags already.
        self.shared.check()?;
        let (sched, bufs) = (group.schedule, group.buffers);
        if sched.steps.is_empty() {
            return Ok(());
        }
        ipc.after_previous(stream)?;
        ipc.enqueue(&sched, DataType::Uint8, Combiner::Sum, &bufs, stream)
    }

    /// The IPC path of a collective. With `WEFT_CUDA_CHECK_HEADERS` the operation header is
    /// first exchanged with every rank and checked on the host (`headers.rs`), so a mismatched
    /// call fails on every rank with `Error::Mismatch` and leaves no stream waiting.
    fn enqueue_ipc(
        &self,
        call: &RawOp,
        send: Option<DevSpan>,
        recv: DevSpan,
        plan: &Plan,
        stream: &Stream,
    ) -> Result<()> {
        // Held until the call is enqueued, so headers are numbered in enqueue order.
        let _numbering = if self.check_headers {
            let mut seqs = lock(&self.headers);
            seqs.collectives += 1;
            headers::exchange(&self.host, &headers::desc(call, seqs.collectives))?;
            Some(seqs)
        } else {
            None
        };
        let (r, n, count) = (self.rank, self.size, call.count);
        if count == 0 {
            return Ok(());
        }
        let mut ipc = self.ipc_state()?;
        let es = call.dtype.size();
        let slice = (ipc.slot_bytes / es).max(1);
        let in_place = send.is_none();
        let mut input = match send {
            Some(s) => s.ptr,
            None => recv.ptr + plan.input_offset as u64,
        };
        let output = recv.ptr + plan.output_offset as u64;
        let kernels = self.ctx.kernels()?;
        ipc.after_previous(stream)?;
        // PreMulSum: scale this rank's input once, into a buffer of our own.
        if let ReduceOp::PreMulSum(factor) = call.op {
            if call.has_reduction() {
                let elems = plan.input_len / es;
                let scaled = ipc.prescale_buffer(plan.input_len)?;
                kernels.scale(call.dtype, scaled, input, factor, elems, stream.as_raw())?;
                input = scaled;
            }
        }
        if matches!(call.kind, OpKind::Barrier | OpKind::SendRecv) {
            return Err(self.invalid(call.kind, DeviceArgError::NotDeviceCollective));
        }
        // Deterministic mode: the rank-order fold, as on the host (the same bits). Otherwise
        // recursive doubling for small all-reduces, the ring and chain schedules.
        let algorithm = if self.host.deterministic() && call.order_sensitive() {
            Algorithm::Ordered
        } else if call.kind == OpKind::AllReduce && count.saturating_mul(es) <= self.rd_max {
            Algorithm::Rd
        } else {
            Algorithm::Ring
        };
        let collective = call.collective(r, n, slice, in_place);
        let sched = schedule::select(&collective, algorithm, None)
            .map_err(|e| self.invalid(call.kind, e))?;
        ipc.enqueue(
            &sched,
            call.dtype,
            call.op.combiner(),
            &BufferMap::fixed(input, output, None),
            stream,
        )?;
        // Avg: divide the reduced result once.
        if call.op == ReduceOp::Avg && call.has_reduction() {
            let out_elems = match call.kind {
                OpKind::Reduce if call.root != r => 0,
                _ => count,
            };
            kernels.divide(call.dtype, output, n, out_elems, stream.as_raw())?;
        }
        Ok(())
    }

    /// Stages `work` through pinned host memory. Every GPU step is on the caller's stream:
    /// copies into pinned memory, an event the proxy waits for, a wait for the proxy's release
    /// flag, copies back. The proxy only runs the host collective: no GPU work of this context
    /// ever waits behind a stream that waits for the proxy (the CUDA driver does not see that
    /// dependency, and under MPS such a pair deadlocked on an H200).
    pub(crate) fn enqueue_staged(&self, seq: u64, work: Work, stream: &Stream) -> Result<()> {
        let proxy = self
            .proxy
            .as_ref()
            .ok_or_else(|| CudaError::Other("staged transport without proxy".into()))?;
        if let Work::Collective { op, send, recv } = work {
            if self.gdr_fits(&op) {
                return self.enqueue_direct(proxy, seq, op, send, recv, stream);
            }
        }
        let mut staging = lock(&proxy.staging);
        let pieces = staged::pieces(work, self.rank, self.stage_chunk);
        let (in_bytes, out_bytes) = staged::staging_bytes(&pieces);
        staging.reserve(&self.ctx, in_bytes, out_bytes)?;
        // The previous staged operation must be done with the pinned buffers.
        if let Some(prev) = &staging.done {
            stream.wait_event(prev)?;
        }
        let (gpu, input, output) = self.gpu_staging(proxy, &staging, stream);
        staged::enqueue(
            &gpu,
            &proxy.thread,
            seq,
            pieces,
            &input,
            &output,
            self.host.timeout() * 2,
        )?;
        let finished = self.ctx.event(false)?;
        finished.record(stream)?;
        staging.done = Some(finished);
        if !proxy.mem_ops {
            // Not asynchronous without stream memory operations: as before, the call returns
            // once the operation is complete.
            stream.synchronize(self.host.timeout())?;
        }
        Ok(())
    }
}

impl DeviceComm {
    /// The caller's stream as the proxy's jobs drive it, and the staging buffers as the jobs
    /// hold them.
    fn gpu_staging<'a>(
        &'a self,
        proxy: &'a Proxy,
        staging: &'a Staging,
        stream: &'a Stream,
    ) -> (
        GpuStaging<'a>,
        Arc<dyn StagingMemory>,
        Arc<dyn StagingMemory>,
    ) {
        let gpu = GpuStaging {
            ctx: &self.ctx,
            stream,
            input: &staging.input,
            output: &staging.output,
            flag_dev: proxy.mem_ops.then_some(proxy.flag_dev),
        };
        (gpu, staging.input.clone(), staging.output.clone())
    }
}

/// Says at INFO (`WEFT_DEBUG=INFO`) how this rank reaches each peer of a hierarchical
/// communicator.
fn log_paths(
    rank: usize,
    layout: &HostLayout,
    local: &DeviceComm,
    cross: &DeviceComm,
    gdr_level: weftcc_topology::PathClass,
) {
    let gdr = if gdr_level == weftcc_topology::PathClass::Loc {
        "off (WEFT_NET_GDR_LEVEL=LOC)"
    } else {
        "the cross tier's all-reduces where its ring connects (GDRDMA per peer)"
    };
    let host = layout.host_of(rank);
    let (near, far): (Vec<usize>, Vec<usize>) = (0..layout.nranks())
        .filter(|&q| q != rank)
        .partition(|&q| layout.host_of(q) == host);
    tracing::info!(
        target: "weftcc::cuda",
        rank,
        hosts = layout.hosts(),
        host = ?host,
        local_rank = ?layout.local_index(rank),
        "hierarchical: ranks {near:?} of this host over {:?} (CUDA IPC), ranks {far:?} of other hosts staged through pinned host memory over the host network ({:?}; GPUDirect RDMA: {gdr}); across hosts as rank {} of {}",
        local.transport(),
        cross.transport(),
        cross.rank(),
        cross.size()
    );
}

/// Checks that a GPU with PCI bus id `bus` can be reached from `ctx`'s GPU by peer access.
fn peer_reachable(ctx: &Context, bus: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(bus) else {
        return false;
    };
    let mut dev: sys::CUdevice = 0;
    // SAFETY: driver initialised (a Context exists); `c` is NUL-terminated; `dev` is an out
    // pointer.
    let r = unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, c.as_ptr()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return false;
    }
    crate::driver::p2p_link(ctx.device(), dev).is_ok_and(|l| l.access)
}

/// Ends a device communicator because a host communicator it depends on failed with `e`:
/// poisoned with that cause and, if `release`, every GPU wait of ours on the IPC flags released
/// (the data of operations in flight is then garbage). Runs in a host communicator's failure
/// hook: callers never hold the IPC lock while they run a host operation.
fn end_because(
    shared: &Shared,
    ipc: Option<&Mutex<IpcPeers>>,
    e: &weftcc_comm::Error,
    release: bool,
) {
    let e = CudaError::Host(e.clone());
    if release {
        poison_and_release(shared, ipc, &e);
    } else {
        shared.poison(&e);
    }
}

/// Poisons a device communicator with `e` and releases every GPU wait of ours on the IPC flags
/// (the data of operations in flight is then garbage).
fn poison_and_release(shared: &Shared, ipc: Option<&Mutex<IpcPeers>>, e: &CudaError) {
    shared.poison(e);
    if let Some(ipc) = ipc {
        let _ = lock(ipc).release_all();
    }
}

impl Proxy {
    fn start(
        ctx: &Context,
        host: &Arc<Communicator>,
        shared: &Arc<Shared>,
        mem_ops: bool,
        gdr: Option<Box<GdrRing>>,
    ) -> Result<Proxy> {
        let flag = Arc::new(PinnedBuffer::new(ctx, 64)?);
        let flag_dev = flag.device_ptr()?;
        let bind_ctx = ctx.clone();
        let thread = ProxyThread::start(
            move || bind_ctx.bind(),
            host.clone(),
            shared.clone(),
            flag,
            gdr,
        )?;
        Ok(Proxy {
            thread,
            flag_dev,
            staging: Mutex::new(Staging::new(ctx)?),
            mem_ops,
        })
    }
}

/// The staged transport's pinned buffers, filled and emptied by the caller's stream.
///
/// Outgrown buffers are kept until the communicator is dropped instead of being freed:
/// `cuMemFreeHost` waits for the context's streams, and a caller's stream may be waiting for
/// the proxy (seen as a deadlock on an H100 when the proxy freed them). Sizes grow by powers of
/// two, so what is kept is less than the current buffers.
struct Staging {
    input: Arc<PinnedBuffer>,
    output: Arc<PinnedBuffer>,
    outgrown: Vec<Arc<PinnedBuffer>>,
    /// Recorded after the last operation's copies back: the next may reuse the buffers.
    done: Option<Event>,
}

impl Staging {
    const INITIAL_BYTES: usize = 1 << 20;

    fn new(ctx: &Context) -> Result<Staging> {
        let pinned = || -> Result<Arc<PinnedBuffer>> {
            Ok(Arc::new(PinnedBuffer::new(ctx, Self::INITIAL_BYTES)?))
        };
        Ok(Staging {
            input: pinned()?,
            output: pinned()?,
            outgrown: Vec::new(),
            done: None,
        })
    }

    /// Makes the input hold `input` bytes and the output `output` bytes.
    fn reserve(&mut self, ctx: &Context, input: usize, output: usize) -> Result<()> {
        for (buf, bytes) in [(&mut self.input, input), (&mut self.output, output)] {
            if buf.len() < bytes {
                let size = bytes.checked_next_power_of_two().unwrap_or(bytes);
                let fresh = Arc::new(PinnedBuffer::new(ctx, size)?);
                self.outgrown.push(std::mem::replace(buf, fresh));
            }
        }
        Ok(())
    }
}

/// Which way a staging copy goes between device memory and a pinned buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Toward {
    /// Device memory into the pinned buffer.
    Pinned,
    /// The pinned buffer into device memory.
    Device,
}

/// Whether a copy of `bytes` at byte `at` of a `len`-byte staging buffer has anything to do
/// (not when empty); an error where it does not fit.
fn staging_fits(len: usize, at: usize, bytes: usize) -> Result<bool> {
    if bytes == 0 {
        return Ok(false);
    }
    if at.checked_add(bytes).is_none_or(|end| end > len) {
        return Err(CudaError::Other("staging buffer too small".into()));
    }
    Ok(true)
}

/// Enqueues a copy between device memory `dev` and the pinned `pinned` from byte `at`, the way
/// `dir` says.
fn copy_pinned(
    dir: Toward,
    dev: DevSpan,
    pinned: &PinnedBuffer,
    at: usize,
    stream: &Stream,
) -> Result<()> {
    if !staging_fits(pinned.len(), at, dev.bytes)? {
        return Ok(());
    }
    // SAFETY: `pinned` holds at least at + dev.bytes bytes of pinned memory (checked), kept
    // alive by `Staging` (current or outgrown buffers are freed only when the communicator is
    // dropped); `dev` is device memory valid per the enqueue contract.
    unsafe {
        let host = pinned.host_ptr().add(at).cast();
        match dir {
            Toward::Pinned => check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(host, dev.ptr, dev.bytes, stream.as_raw()),
            ),
            Toward::Device => check(
                "cuMemcpyHtoDAsync",
                sys::cuMemcpyHtoDAsync_v2(dev.ptr, host, dev.bytes, stream.as_raw()),
            ),
        }
    }
}

/// The caller's stream as the staged transport drives it (`staged.rs`).
struct GpuStaging<'a> {
    ctx: &'a Context,
    stream: &'a Stream,
    input: &'a PinnedBuffer,
    output: &'a PinnedBuffer,
    /// The release counter as the GPU addresses it, where the stream can wait on it (stream
    /// memory operations).
    flag_dev: Option<u64>,
}

impl StagingStream for GpuStaging<'_> {
    fn copy_in(&self, src: DevSpan, to: Side, at: usize) -> Result<()> {
        let buf = match to {
            Side::Input => self.input,
            Side::Output => self.output,
        };
        copy_pinned(Toward::Pinned, src, buf, at, self.stream)
    }

    fn mark(&self) -> Result<Box<dyn Ready>> {
        let ready = self.ctx.event(false)?;
        ready.record(self.stream)?;
        Ok(Box::new(ready))
    }

    fn wait_release(&self, ticket: u32) -> Result<bool> {
        let Some(flag_dev) = self.flag_dev else {
            return Ok(false);
        };
        // SAFETY: flag_dev maps the pinned release counter, alive as long as the proxy thread
        // (whose drop releases every ticket issued before the counter is freed).
        check("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(
                self.stream.as_raw(),
                flag_dev,
                ticket,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })?;
        Ok(true)
    }

    fn copy_back(&self, at: usize, dst: DevSpan) -> Result<()> {
        copy_pinned(Toward::Device, dst, self.output, at, self.stream)
    }
}

impl Drop for DeviceComm {
    fn drop(&mut self) {
        // Stops the proxy thread after its queued jobs and releases every stream still
        // waiting on it (`ProxyThread`'s drop), before the staging buffers go.
        drop(self.proxy.take());
    }
}

macro_rules! collective {
    ($(#[$m:meta])* $name:ident, $ip:ident, $kind:expr $(, $arg:ident : $ty:ty => $set:ident)*) => {
        $(#[$m])*
        pub fn $name<T: Element>(
            &self,
            send: &DeviceBuffer<T>,
            recv: &mut DeviceBuffer<T>,
            $($arg: $ty,)*
            stream: &Stream,
        ) -> Result<()> {
            let call = RawOp::from_lengths($kind, T::DTYPE, self.size, Some(send.len()), recv.len())
                $(.$set($arg))*;
            let (s, r) = (self.span(call.kind, send)?, self.span(call.kind, recv)?);
            self.enqueue(call, Some(s), r, stream)
        }

        /// In-place form of the collective above (NCCL's in-place layout: all-gather and
        /// reduce-scatter use block `rank` of the buffer).
        pub fn $ip<T: Element>(
            &self,
            buf: &mut DeviceBuffer<T>,
            $($arg: $ty,)*
            stream: &Stream,
        ) -> Result<()> {
            let call = RawOp::from_lengths($kind, T::DTYPE, self.size, None, buf.len())$(.$set($arg))*;
            let b = self.span(call.kind, buf)?;
            self.enqueue(call, None, b, stream)
        }
    };
}

impl DeviceComm {
    collective!(
        /// All-reduce: every rank's `recv` holds the reduction of all `send`s.
        all_reduce, all_reduce_in_place, OpKind::AllReduce, op: ReduceOp => with_op
    );
    collective!(
        /// Reduce: `root`'s `recv` holds the reduction (others' `recv` is not written).
        reduce, reduce_in_place, OpKind::Reduce, op: ReduceOp => with_op, root: usize => with_root
    );
    collective!(
        /// Broadcast of `root`'s `send` into every `recv`.
        broadcast, broadcast_in_place, OpKind::Broadcast, root: usize => with_root
    );
    collective!(
        /// All-gather: `recv` (n × count) holds every rank's `send` (count) in rank order.
        all_gather, all_gather_in_place, OpKind::AllGather
    );
    collective!(
        /// Reduce-scatter: `recv` (count) holds block `rank` of the reduction of the `send`s
        /// (n × count).
        reduce_scatter, reduce_scatter_in_place, OpKind::ReduceScatter, op: ReduceOp => with_op
    );
    collective!(
        /// All-to-all: block j of `send` goes to rank j, block i of `recv` comes from rank i.
        all_to_all, all_to_all_in_place, OpKind::AllToAll
    );

    /// The data type of a call (for callers working with raw buffers).
    pub fn dtype_of<T: Element>() -> DataType {
        T::DTYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staging_copy_must_fit_its_buffer() {
        assert!(!staging_fits(0, 0, 0).unwrap(), "nothing to copy");
        assert!(!staging_fits(8, 100, 0).unwrap(), "empty: not checked");
        assert!(staging_fits(16, 8, 8).unwrap());
        assert!(staging_fits(16, 0, 16).unwrap());
        assert!(staging_fits(16, 9, 8).is_err());
        assert!(staging_fits(16, usize::MAX, 1).is_err(), "overflow");
    }
}
