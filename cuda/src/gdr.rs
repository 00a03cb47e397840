//! GPUDirect RDMA between hosts: the NIC reads and writes device memory, without staging
//! through pinned host memory.
//!
//! [`GdrRing::connect`] decides, with every rank of a ring, whether the ring's links run
//! directly on device memory: the GPU–NIC path must be within `WEFT_NET_GDR_LEVEL`
//! ([`GdrPath`]), and the NIC must register the rank's device memory (its dmabuf, else its
//! address through `nvidia-peermem`: [`RegistrationCache::lease_device`]). Every rank
//! publishes its verdict; the ring is direct only if every rank's is, and otherwise every rank
//! stages (each says why, per peer, at `WEFT_DEBUG=INFO`: `GDRDMA` where it is used).
//!
//! An all-reduce on the ring ([`GdrRing::all_reduce_in_place`]) is NCCL's ring: a reduce-scatter
//! whose steps write a chunk of the caller's device buffer straight from that buffer into the
//! next rank's registered device scratch, then an all-gather writing the reduced chunks straight
//! into the next rank's buffer. The ordering step before the GPU reads what the NIC wrote: the
//! sender writes the step's flag into the receiver's control words only once the data's writes
//! completed (a completed write is a placed one, whatever order the NIC places writes in), and
//! the receiver's device side waits for the flag before it reads ([`DeviceSide::consume`], which
//! also runs the reduction on the device). Before each operation a rank posts its buffer's
//! address and key to the rank that writes into it; that post is also the sender's permission to
//! reuse the scratch, as the receiver finished the previous operation.
//!
//! A failure (a write completing with an error, a device error, nothing within the timeout)
//! ends the operation with a typed [`GdrError`] naming rank, operation and sequence number, and
//! the failing rank writes an abort word into both neighbours' control words; every rank that
//! finds it passes it on and fails too ([`GdrError::PeerFailed`], naming the rank where it
//! started). The ring is unusable afterwards.
//!
//! Without a GPU the same code runs on [`HostDevice`]: host memory behind a memfd standing in
//! for device memory (the memfd is the dmabuf), and the reduction on the CPU.

use crate::driver::{check, has_symbol};
use crate::error::{CudaError, Result as CudaResult};
use crate::memory::{Context, PinnedBuffer, Stream};
use cudarc::driver::sys;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weftcc_collectives::{Combiner, DataType, OpKind};
use weftcc_topology::netpath::gdr_allowed;
use weftcc_topology::PathClass;
use weftcc_transports::net::device::{DeviceMemory, MemfdDevice};
use weftcc_transports::net::regcache::{
    DeviceRefused, DeviceRegistration, Lease, RegistrationCache,
};
use weftcc_transports::net::{
    Completion, Endpoint, Memory, NetError, Posted, Provider, Region, RemoteRegion, Target,
};

/// The rank's device as the ring uses it: memory the NIC reaches and the consumer of what the
/// NIC wrote.
pub trait DeviceSide: Send {
    /// `len` bytes of device memory (the scratch the previous rank writes into).
    fn alloc(&self, len: usize) -> CudaResult<Box<dyn DeviceMemory>>;
    /// `len` bytes of host memory the NIC writes control words into and the device reads
    /// them from (GPU: pinned, device-mapped).
    fn control(&self, len: usize) -> CudaResult<Control>;
    /// The ordering step and the consumer: waits until the data flag of `control` (the word the
    /// previous rank's NIC writes after the data's writes completed) reaches `value`, then, if
    /// `reduce` is given, runs `dst = dst ⊕ src` on the device and returns once it is done.
    fn consume(&self, control: &Control, value: u64, reduce: Option<Reduce>) -> CudaResult<()>;
}

/// Control words: host memory the NIC writes and the device reads.
pub struct Control {
    /// The memory as the host (and the NIC's registration) sees it.
    pub memory: Arc<Memory>,
    /// Its address for the device (GPU: the device-mapped address of the pinned pages).
    pub device_address: u64,
    /// Whatever owns the pages (dropped after every registration of `memory`, which the ring
    /// drops first).
    _owner: Option<Box<dyn Send + Sync>>,
}

/// A reduction of `count` elements at device address `src` into device address `dst`.
#[derive(Debug, Clone, Copy)]
pub struct Reduce {
    /// Element type.
    pub dtype: DataType,
    /// Operation.
    pub comb: Combiner,
    /// Destination (and first operand).
    pub dst: u64,
    /// Second operand.
    pub src: u64,
    /// Elements.
    pub count: usize,
}

/// Host memory standing in for a device ([`MemfdDevice`] allocations, reductions on the
/// CPU): the GDR path without a GPU.
pub struct HostDevice {
    /// What [`DeviceMemory::peer_memory`] of its allocations answers.
    pub peer_memory: bool,
}

impl DeviceSide for HostDevice {
    fn alloc(&self, len: usize) -> CudaResult<Box<dyn DeviceMemory>> {
        MemfdDevice::new(len, self.peer_memory)
            .map(|d| Box::new(d) as Box<dyn DeviceMemory>)
            .map_err(|e| CudaError::Other(format!("memfd device memory: {e}")))
    }

    fn control(&self, len: usize) -> CudaResult<Control> {
        let memory = Memory::new(len).ok_or_else(|| CudaError::Other("host memory".into()))?;
        Ok(Control {
            device_address: memory.as_ptr() as u64,
            memory: Arc::new(memory),
            _owner: None,
        })
    }

    fn consume(&self, control: &Control, value: u64, reduce: Option<Reduce>) -> CudaResult<()> {
        // The device's wait: an acquire load, which orders the reads below after it.
        let seen = control.memory.word(DATA_FLAG).load(Ordering::Acquire);
        if seen < value {
            return Err(CudaError::Other(format!(
                "flag {seen} below {value} when consumed"
            )));
        }
        let Some(r) = reduce else { return Ok(()) };
        let bytes = r.count * r.dtype.size();
        // SAFETY: the shared-memory edge: `dst` and `src` are the addresses of live mappings of
        // [`MemfdDevice`]s (the caller's buffer and the scratch) of at least `bytes` bytes past
        // them (the ring's chunks lie inside the buffers). The protocol gives this rank the two
        // ranges alone now: the NIC wrote `src` before the flag (its writes completed) and
        // writes no more of it before this rank posts the next operation; nothing writes `dst`
        // during the reduce-scatter but this rank.
        let (dst, src) = unsafe {
            (
                std::slice::from_raw_parts_mut(r.dst as *mut u8, bytes),
                std::slice::from_raw_parts(r.src as *const u8, bytes),
            )
        };
        weftcc_collectives::reduce::reduce_in_place(r.dtype, r.comb, dst, src)
            .map_err(|e| CudaError::Other(format!("reduction: {e}")))
    }
}

/// The GPU as the ring's device side: scratch from `cuMemAlloc`, control words in pinned,
/// device-mapped host memory, the flag waited for on a stream (`cuStreamWaitValue64`), writes
/// the NIC made flushed to the GPU (`cuFlushGPUDirectRDMAWrites`), the reduction with the
/// NVRTC kernel. Compiled, not run: no machine of this project has had a GPU beside an RDMA
/// NIC (docs/gpu-results.md).
pub struct CudaDevice {
    ctx: Context,
    stream: Stream,
    timeout: Duration,
}

impl CudaDevice {
    /// The device of `ctx`, consuming on a stream of its own; each consumption waits at most
    /// `timeout`.
    pub fn new(ctx: &Context, timeout: Duration) -> CudaResult<CudaDevice> {
        Ok(CudaDevice {
            ctx: ctx.clone(),
            stream: ctx.stream()?,
            timeout,
        })
    }
}

impl DeviceSide for CudaDevice {
    fn alloc(&self, len: usize) -> CudaResult<Box<dyn DeviceMemory>> {
        // Whole pages: a dmabuf export covers page-aligned ranges (cuMemAlloc aligns the start).
        let b = self
            .ctx
            .alloc_zeroed::<u8>(len.max(1).next_multiple_of(PAGE))?;
        Ok(Box::new(b))
    }

    fn control(&self, len: usize) -> CudaResult<Control> {
        let pinned = PinnedBuffer::new(&self.ctx, len.max(1).next_multiple_of(PAGE))?;
        let device_address = pinned.device_ptr()?;
        let ptr = NonNull::new(pinned.host_ptr())
            .ok_or_else(|| CudaError::Other("pinned memory at NULL".into()))?;
        // SAFETY: the pinned pages live as long as `_owner`, which the ring drops after the
        // registration of this `Memory` and after its last use.
        let memory = unsafe { Memory::borrowed(ptr, len) };
        Ok(Control {
            memory: Arc::new(memory),
            device_address,
            _owner: Some(Box::new(pinned)),
        })
    }

    fn consume(&self, control: &Control, value: u64, reduce: Option<Reduce>) -> CudaResult<()> {
        self.ctx.bind()?;
        // SAFETY: the address maps the pinned control words (`control`, alive for the call and
        // until the synchronization below ends the stream's use of it).
        check("cuStreamWaitValue64", unsafe {
            sys::cuStreamWaitValue64_v2(
                self.stream.as_raw(),
                control.device_address + DATA_FLAG as u64,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })?;
        // The flush is not ordered with the stream: it is right here only because the ring
        // waited for the data flag on the host before calling `consume`.
        if has_symbol("cuFlushGPUDirectRDMAWrites") {
            // SAFETY: a context is current (bound above); the call takes no pointers.
            check("cuFlushGPUDirectRDMAWrites", unsafe {
                sys::cuFlushGPUDirectRDMAWrites(
                    sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                    sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
                )
            })?;
        }
        if let Some(r) = reduce {
            let k = self.ctx.kernels()?;
            k.reduce(
                r.comb,
                r.dtype,
                r.dst,
                r.dst,
                r.src,
                r.count,
                self.stream.as_raw(),
            )?;
        }
        self.stream.synchronize(self.timeout)
    }
}

const PAGE: usize = 4096;

/// The GPU–NIC path of this rank, judged against `WEFT_NET_GDR_LEVEL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrPath {
    /// The path class between the rank's GPU and its NIC (topology).
    pub class: PathClass,
    /// The farthest class GPUDirect RDMA may cross (`WEFT_NET_GDR_LEVEL`).
    pub level: PathClass,
}

/// Why a ring stages through host memory instead of GPUDirect RDMA.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NoGdr {
    /// The NIC is farther from the GPU than the level allows (or the level is `LOC`).
    #[error("the NIC is {class} from the GPU, beyond WEFT_NET_GDR_LEVEL={level}")]
    Level {
        /// The GPU–NIC path.
        class: PathClass,
        /// The level.
        level: PathClass,
    },
    /// The NIC did not register this rank's device memory.
    #[error("{0}")]
    Refused(DeviceRefused),
    /// This rank could not make its part of the ring (device memory, endpoints, connecting).
    #[error("set-up failed: {0}")]
    Setup(String),
    /// Another rank of the ring cannot.
    #[error("rank {rank} cannot ({why})")]
    Peer {
        /// That rank.
        rank: usize,
        /// Its reason.
        why: NoGdrKind,
    },
}

/// The kind of a [`NoGdr`], as ranks tell each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoGdrKind {
    /// Beyond `WEFT_NET_GDR_LEVEL`.
    Level,
    /// No dmabuf (nor peer-memory) registration.
    Registration,
    /// Its set-up failed.
    Setup,
}

impl std::fmt::Display for NoGdrKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NoGdrKind::Level => "topology: beyond WEFT_NET_GDR_LEVEL",
            NoGdrKind::Registration => "no dmabuf registration",
            NoGdrKind::Setup => "its set-up failed",
        })
    }
}

/// A failure of the GPUDirect RDMA path.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GdrError {
    /// A write to `peer` failed, or posting it did.
    #[error("rank {rank}: GDR {op} #{seq}: write to rank {peer} failed: {source}")]
    Net {
        /// This rank.
        rank: usize,
        /// The operation.
        op: OpKind,
        /// Its sequence number on the ring.
        seq: u64,
        /// The rank written to.
        peer: usize,
        /// The provider's error (its status names the remote access error).
        source: NetError,
    },
    /// Rank `origin` failed this operation and told the ring.
    #[error("rank {rank}: GDR {op} #{seq}: rank {origin} failed its operation #{origin_seq}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The operation.
        op: OpKind,
        /// Its sequence number here.
        seq: u64,
        /// Where the failure started.
        origin: usize,
        /// The operation's sequence number there (low 32 bits).
        origin_seq: u64,
    },
    /// Nothing came from `peer` within the timeout.
    #[error("rank {rank}: GDR {op} #{seq}: no {waiting_for} from rank {peer} within {after:?}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The operation.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// The rank waited for.
        peer: usize,
        /// What was awaited ("data flag", "buffer post").
        waiting_for: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The device side failed (its wait, its reduction).
    #[error("rank {rank}: GDR {op} #{seq}: device: {source}")]
    Device {
        /// This rank.
        rank: usize,
        /// The operation.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// The device's error.
        source: Box<CudaError>,
    },
    /// The caller's buffer could not be registered (it is not device memory the NIC takes).
    #[error("rank {rank}: GDR {op} #{seq}: the buffer is not registered: {source}")]
    Buffer {
        /// This rank.
        rank: usize,
        /// The operation.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// Why.
        source: DeviceRefused,
    },
    /// Connecting the ring failed.
    #[error("rank {rank}: GDR set-up failed: {detail}")]
    Setup {
        /// This rank.
        rank: usize,
        /// What failed.
        detail: String,
    },
    /// The ring failed earlier.
    #[error("rank {rank}: GDR ring unusable after an earlier failure")]
    Broken {
        /// This rank.
        rank: usize,
    },
}

impl GdrError {
    /// The failure's facts as typed fields (the peer: the rank written to or waited for, or
    /// where a failure started).
    pub fn facts(&self) -> weftcc_comm::ErrorFacts {
        let (rank, op, seq, peer) = match self {
            GdrError::Net {
                rank,
                op,
                seq,
                peer,
                ..
            }
            | GdrError::Timeout {
                rank,
                op,
                seq,
                peer,
                ..
            } => (*rank, Some(*op), Some(*seq), Some(*peer)),
            GdrError::PeerFailed {
                rank,
                op,
                seq,
                origin,
                ..
            } => (*rank, Some(*op), Some(*seq), Some(*origin)),
            GdrError::Device { rank, op, seq, .. } | GdrError::Buffer { rank, op, seq, .. } => {
                (*rank, Some(*op), Some(*seq), None)
            }
            GdrError::Setup { rank, .. } | GdrError::Broken { rank } => (*rank, None, None, None),
        };
        weftcc_comm::ErrorFacts {
            rank: Some(rank),
            peer,
            op,
            seq,
        }
    }
}

/// Exchanges one record per rank with every rank of the ring (an all-gather of bytes; the
/// host communicator, or the tests' in-process one).
pub type Exchange<'a> = &'a dyn Fn(Vec<u8>) -> Result<Vec<Vec<u8>>, String>;

/// Most bytes of one rank's record in [`exchange_over`].
const RECORD: usize = 512;

/// An [`Exchange`] over a host communicator: each record framed in [`RECORD`] bytes and
/// all-gathered (every rank of the communicator must call it alike).
pub fn exchange_over(
    host: &weftcc_comm::Communicator,
) -> impl Fn(Vec<u8>) -> Result<Vec<Vec<u8>>, String> + '_ {
    move |mine: Vec<u8>| {
        if mine.len() + 4 > RECORD {
            return Err(format!("a record of {} bytes exceeds {RECORD}", mine.len()));
        }
        let mut framed = vec![0u8; RECORD];
        framed[..4].copy_from_slice(&(mine.len() as u32).to_le_bytes());
        framed[4..4 + mine.len()].copy_from_slice(&mine);
        let mut all = vec![0u8; RECORD * host.size()];
        host.all_gather(&framed, &mut all)
            .map_err(|e| e.to_string())?;
        all.chunks(RECORD)
            .map(|r| {
                let n = u32::from_le_bytes([r[0], r[1], r[2], r[3]]) as usize;
                r.get(4..4 + n)
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| format!("a peer's record claims {n} bytes"))
            })
            .collect()
    }
}

/// One all-reduce as [`GdrRing::all_reduce_in_place`] was called.
#[derive(Clone, Copy)]
struct RingCall<'a> {
    buf: &'a dyn DeviceMemory,
    offset: usize,
    count: usize,
    dtype: DataType,
    comb: Combiner,
}

/// Control words a rank's neighbours write (offsets in its control region).
const DATA_FLAG: usize = 0; // data steps landed from the previous rank
const ABORT: usize = 8; // a failure somewhere in the ring
const POST: usize = 16; // the next rank's buffer: base, key, len
const POSTED: usize = 40; // the operation (1-based) the post is for, written after it
const CONTROL_LEN: usize = 64;
const ABORT_BIT: u64 = 1 << 63;
/// Largest single data write.
const PIECE: usize = 1 << 20;

/// One endpoint and its outgoing word slots.
struct Link {
    ep: Box<dyn Endpoint>,
    /// Registered host memory the control words are written from.
    out: Region,
    peer: usize,
    next_id: u64,
}

/// Posts `count` work requests with `post` (retrying while the queue is full) and polls until
/// all completed: a completed write is a placed one.
fn complete(
    ep: &mut dyn Endpoint,
    next_id: &mut u64,
    mut post: impl FnMut(&mut dyn Endpoint, u64) -> Result<Posted, NetError>,
    count: usize,
    deadline: Instant,
) -> Result<(), NetError> {
    let mut done = Vec::<Completion>::new();
    let (mut outstanding, mut posted) = (0usize, 0usize);
    while posted < count || outstanding > 0 {
        if posted < count && outstanding < ep.max_outstanding() {
            *next_id += 1;
            if post(ep, *next_id)? == Posted::Yes {
                posted += 1;
                outstanding += 1;
                continue;
            }
        }
        ep.poll(&mut done)?;
        for c in done.drain(..) {
            outstanding = outstanding.saturating_sub(1);
            c.result?;
        }
        if outstanding > 0 && Instant::now() > deadline {
            return Err(NetError::WorkFailed {
                provider: "gdr",
                wr_id: *next_id,
                status: -1,
                detail: "no completion within the timeout".into(),
            });
        }
    }
    Ok(())
}

impl Link {
    /// Writes `words` (at most 8) to `at` of the peer's control region and waits for the
    /// write's completion.
    fn words(
        &mut self,
        words: &[u64],
        control: RemoteRegion,
        at: usize,
        deadline: Instant,
    ) -> Result<(), NetError> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        // SAFETY: the slot area is this link's alone, and no write out of it is outstanding
        // (`complete` returned only once the previous one completed).
        unsafe { self.out.memory.write(0, &bytes) };
        let (out, len) = (&self.out, bytes.len());
        complete(
            self.ep.as_mut(),
            &mut self.next_id,
            |ep, id| ep.write(out.range(0, len), control.at(at as u64), id),
            1,
            deadline,
        )
    }
}

/// What [`GdrRing::connect`] decided.
pub enum GdrSetup {
    /// Every link of the ring runs on device memory.
    Direct(Box<GdrRing>),
    /// The ring stages through host memory, and why.
    Staged(NoGdr),
}

/// A ring of ranks whose links write device memory directly.
pub struct GdrRing {
    rank: usize,
    nranks: usize,
    to_next: Link,
    to_prev: Link,
    next_control: RemoteRegion,
    next_scratch: RemoteRegion,
    prev_control: RemoteRegion,
    /// The registration of the words neighbours write (held, and dropped before their
    /// memory).
    _control_region: Region,
    control: Control,
    scratch_lease: Lease,
    // Declared after the lease: the memory goes after its registration.
    scratch: Box<dyn DeviceMemory>,
    cache: Arc<RegistrationCache>,
    device: Box<dyn DeviceSide>,
    /// Operations started.
    ops: u64,
    /// Data steps sent to the next rank and awaited from the previous one.
    sent: u64,
    received: u64,
    broken: bool,
    timeout: Duration,
}

fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// Reads a peer's record: u64 words, then two length-prefixed addresses.
struct Record {
    code: u64,
    control: RemoteRegion,
    scratch: RemoteRegion,
    to_next: Vec<u8>,
    to_prev: Vec<u8>,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        for x in [
            self.code,
            self.control.base,
            self.control.key,
            self.control.len,
            self.scratch.base,
            self.scratch.key,
            self.scratch.len,
            self.to_next.len() as u64,
        ] {
            put_u64(&mut v, x);
        }
        v.extend_from_slice(&self.to_next);
        put_u64(&mut v, self.to_prev.len() as u64);
        v.extend_from_slice(&self.to_prev);
        v
    }

    fn decode(b: &[u8]) -> Option<Record> {
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
        };
        let region = |at: usize| -> Option<RemoteRegion> {
            Some(RemoteRegion {
                base: word(at)?,
                key: word(at + 8)?,
                len: word(at + 16)?,
            })
        };
        let n1 = usize::try_from(word(56)?).ok()?;
        let to_next = b.get(64..64usize.checked_add(n1)?)?.to_vec();
        let at = 64 + n1;
        let n2 = usize::try_from(word(at)?).ok()?;
        let to_prev = b.get(at + 8..(at + 8).checked_add(n2)?)?.to_vec();
        Some(Record {
            code: word(0)?,
            control: region(8)?,
            scratch: region(32)?,
            to_next,
            to_prev,
        })
    }
}

/// A rank's own resources for a ring, made before the ranks compare verdicts. Fields drop
/// in order: endpoints, then registrations, then the memory under them.
struct Parts {
    to_next: Box<dyn Endpoint>,
    to_prev: Box<dyn Endpoint>,
    next_address: Vec<u8>,
    prev_address: Vec<u8>,
    /// Registered slots the control words are written from, one per link.
    out_next: Region,
    out_prev: Region,
    control_region: Region,
    control: Control,
    scratch: Box<dyn DeviceMemory>,
}

impl Parts {
    fn open(
        provider: &Arc<dyn Provider>,
        device: &dyn DeviceSide,
        scratch_bytes: usize,
    ) -> Result<Parts, String> {
        let scratch = device
            .alloc(scratch_bytes.max(1))
            .map_err(|e| format!("scratch: {e}"))?;
        let control = device
            .control(CONTROL_LEN)
            .map_err(|e| format!("control words: {e}"))?;
        let net = |e: NetError| e.to_string();
        let control_region = provider
            .register(Arc::clone(&control.memory))
            .map_err(net)?;
        let slots = || -> Result<Region, String> {
            let m = Memory::new(64).ok_or("host memory")?;
            provider.register(Arc::new(m)).map_err(net)
        };
        let (to_next, to_prev) = (
            provider.endpoint().map_err(net)?,
            provider.endpoint().map_err(net)?,
        );
        Ok(Parts {
            scratch,
            control,
            control_region,
            next_address: to_next.address().map_err(net)?,
            prev_address: to_prev.address().map_err(net)?,
            to_next,
            to_prev,
            out_next: slots()?,
            out_prev: slots()?,
        })
    }
}

impl GdrRing {
    /// Decides with every rank whether the ring runs on device memory and, if so, connects it.
    /// `scratch_bytes` bounds the chunk an operation's step may carry: operations on buffers
    /// of at most `scratch_bytes × nranks / (nranks − 1)` bytes fit.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        rank: usize,
        nranks: usize,
        provider: &Arc<dyn Provider>,
        device: Box<dyn DeviceSide>,
        path: GdrPath,
        scratch_bytes: usize,
        exchange: Exchange<'_>,
        timeout: Duration,
    ) -> Result<GdrSetup, GdrError> {
        let setup = |detail: String| GdrError::Setup { rank, detail };
        let next = (rank + 1) % nranks;
        let prev = (rank + nranks - 1) % nranks;
        let cache = RegistrationCache::of(provider);
        // This rank's verdict. A local failure is one too: every rank must reach the exchange
        // (the others wait there), and then every rank stages.
        let mut mine = (!gdr_allowed(path.class, path.level)).then_some(NoGdr::Level {
            class: path.class,
            level: path.level,
        });
        let mut parts = match Parts::open(provider, device.as_ref(), scratch_bytes) {
            Ok(p) => Some(p),
            Err(detail) => {
                mine = mine.or(Some(NoGdr::Setup(detail)));
                None
            }
        };
        let mut lease = None;
        if let (None, Some(p)) = (&mine, &parts) {
            match cache.lease_device(p.scratch.as_ref()) {
                Ok(l) => lease = Some(l),
                Err(e) => mine = Some(NoGdr::Refused(e)),
            }
        }
        let record = Record {
            code: match &mine {
                None => 0,
                Some(NoGdr::Level { .. }) => 1,
                Some(NoGdr::Setup(_)) => 3,
                Some(_) => 2,
            },
            control: parts
                .as_ref()
                .map(|p| p.control_region.remote())
                .unwrap_or_default(),
            scratch: lease.as_ref().map(Lease::remote).unwrap_or_default(),
            to_next: parts
                .as_ref()
                .map(|p| p.next_address.clone())
                .unwrap_or_default(),
            to_prev: parts
                .as_ref()
                .map(|p| p.prev_address.clone())
                .unwrap_or_default(),
        };
        let all = exchange(record.encode()).map_err(setup)?;
        let records = all
            .iter()
            .map(|b| Record::decode(b))
            .collect::<Option<Vec<_>>>()
            .filter(|r| r.len() == nranks)
            .ok_or_else(|| setup("malformed records from the ring".into()))?;
        let mut why = records.iter().enumerate().find_map(|(r, rec)| {
            let why = match rec.code {
                0 => return None,
                1 => NoGdrKind::Level,
                3 => NoGdrKind::Setup,
                _ => NoGdrKind::Registration,
            };
            Some(NoGdr::Peer { rank: r, why })
        });
        // Connect, then tell every rank whether it worked (nothing is written before every
        // queue pair is ready to receive).
        if why.is_none() {
            if let Some(p) = parts.as_mut() {
                let connected = p
                    .to_next
                    .connect(&records[next].to_prev)
                    .and_then(|()| p.to_prev.connect(&records[prev].to_next));
                if let Err(e) = connected {
                    mine = Some(NoGdr::Setup(e.to_string()));
                }
            }
            let all = exchange(vec![u8::from(mine.is_none())]).map_err(setup)?;
            why = all
                .iter()
                .position(|v| v.first() != Some(&1))
                .map(|r| NoGdr::Peer {
                    rank: r,
                    why: NoGdrKind::Setup,
                });
        }
        let peers = if next == prev {
            vec![next]
        } else {
            vec![next, prev]
        };
        let (Some(parts), Some(scratch_lease), None) = (parts, lease, why.clone()) else {
            let reason = mine.or(why).unwrap_or(NoGdr::Peer {
                rank,
                why: NoGdrKind::Registration,
            });
            for p in peers {
                tracing::info!(target: "weftcc::net", rank, peer = p, "no GDRDMA to rank {p} \
                    (staged through host memory): {reason}");
            }
            return Ok(GdrSetup::Staged(reason));
        };
        let how = scratch_lease.device().unwrap_or(DeviceRegistration::Dmabuf);
        for p in peers {
            tracing::info!(target: "weftcc::net", rank, peer = p, "GDRDMA to rank {p} via NET/{} \
                (device memory registered by {how})", provider.name());
        }
        Ok(GdrSetup::Direct(Box::new(GdrRing {
            rank,
            nranks,
            to_next: Link {
                ep: parts.to_next,
                out: parts.out_next,
                peer: next,
                next_id: 0,
            },
            to_prev: Link {
                ep: parts.to_prev,
                out: parts.out_prev,
                peer: prev,
                next_id: 0,
            },
            next_control: records[next].control,
            next_scratch: records[next].scratch,
            prev_control: records[prev].control,
            _control_region: parts.control_region,
            control: parts.control,
            scratch_lease,
            scratch: parts.scratch,
            cache,
            device,
            ops: 0,
            sent: 0,
            received: 0,
            broken: false,
            timeout,
        })))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How the NIC took this rank's device memory.
    pub fn registration(&self) -> Option<DeviceRegistration> {
        self.scratch_lease.device()
    }

    /// `buf = buf₀ ⊕ … ⊕ buf_{n−1}` element-wise over the ring, on device memory: `count`
    /// elements of `dtype` at byte `offset` of the device allocation `buf` (registered whole).
    pub fn all_reduce_in_place(
        &mut self,
        buf: &dyn DeviceMemory,
        offset: usize,
        count: usize,
        dtype: DataType,
        comb: Combiner,
    ) -> Result<(), GdrError> {
        let seq = self.ops;
        self.ops += 1;
        if self.broken {
            return Err(GdrError::Broken { rank: self.rank });
        }
        let call = RingCall {
            buf,
            offset,
            count,
            dtype,
            comb,
        };
        let r = self.all_reduce(seq, call);
        if let Err(e) = &r {
            self.broken = true;
            let origin = match e {
                GdrError::PeerFailed { origin, .. } => *origin,
                _ => self.rank,
            };
            self.abort(origin, seq);
        }
        r
    }

    fn all_reduce(&mut self, seq: u64, call: RingCall<'_>) -> Result<(), GdrError> {
        let RingCall {
            buf,
            offset,
            count,
            dtype,
            comb,
        } = call;
        let (rank, n) = (self.rank, self.nranks);
        let op = OpKind::AllReduce;
        let size = dtype.size();
        if n == 1 || count == 0 {
            return Ok(());
        }
        let per = count.div_ceil(n);
        let fits = offset
            .checked_add(count * size)
            .is_some_and(|end| end <= buf.len());
        if (per * size) * (n - 1) > self.scratch.len() || !fits {
            return Err(GdrError::Setup {
                rank,
                detail: format!(
                    "{count} elements of {dtype:?} at {offset} exceed the buffer ({} bytes) or \
                     the scratch ({} bytes for {} ranks)",
                    buf.len(),
                    self.scratch.len(),
                    n
                ),
            });
        }
        let lease = self
            .cache
            .lease_device(buf)
            .map_err(|source| GdrError::Buffer {
                rank,
                op,
                seq,
                source,
            })?;
        let deadline = Instant::now() + self.timeout;
        let net = |peer: usize| {
            move |source: NetError| GdrError::Net {
                rank,
                op,
                seq,
                peer,
                source,
            }
        };
        // Tell the previous rank where this operation's bytes go: the post, then (once it
        // landed) its number.
        let mine = lease.remote();
        let prev = self.to_prev.peer;
        let post = [mine.base + offset as u64, mine.key, (count * size) as u64];
        self.to_prev
            .words(&post, self.prev_control, POST, deadline)
            .map_err(net(prev))?;
        self.to_prev
            .words(&[seq + 1], self.prev_control, POSTED, deadline)
            .map_err(net(prev))?;
        self.wait(
            POSTED,
            seq + 1,
            seq,
            "buffer post",
            self.to_next.peer,
            deadline,
        )?;
        let word = |at: usize| self.control.memory.word(at).load(Ordering::Acquire);
        let next_buf = RemoteRegion {
            base: word(POST),
            key: word(POST + 8),
            len: word(POST + 16),
        };
        let chunk = |c: usize| {
            let start = (c * per).min(count);
            (
                start * size,
                ((c + 1) * per).min(count) * size - start * size,
            )
        };
        let slot = per * size;
        // Reduce-scatter, then all-gather.
        for s in 0..2 * (n - 1) {
            let gather = s >= n - 1;
            let (c_send, c_recv) = match gather {
                false => ((rank + n - s) % n, (rank + 2 * n - s - 1) % n),
                true => {
                    let g = s - (n - 1);
                    ((rank + 1 + n - g) % n, (rank + 2 * n - g) % n)
                }
            };
            let (at, len) = chunk(c_send);
            let target = match gather {
                false => self.next_scratch.at((s * slot) as u64),
                true => next_buf.at(at as u64),
            };
            self.send(&lease, offset + at, len, target, deadline)
                .map_err(net(self.to_next.peer))?;
            self.sent += 1;
            let flag = [self.sent];
            self.to_next
                .words(&flag, self.next_control, DATA_FLAG, deadline)
                .map_err(net(self.to_next.peer))?;
            self.received += 1;
            let from = self.to_prev.peer;
            self.wait(DATA_FLAG, self.received, seq, "data flag", from, deadline)?;
            let (rat, rlen) = chunk(c_recv);
            let reduce = (!gather && rlen > 0).then_some(Reduce {
                dtype,
                comb,
                dst: buf.address() + (offset + rat) as u64,
                src: self.scratch.address() + (s * slot) as u64,
                count: rlen / size,
            });
            self.device
                .consume(&self.control, self.received, reduce)
                .map_err(|source| GdrError::Device {
                    rank,
                    op,
                    seq,
                    source: Box::new(source),
                })?;
        }
        self.cache.release(lease);
        Ok(())
    }

    /// Writes `len` bytes at `at` of the leased buffer to `target`, in pieces, and returns once
    /// every piece completed.
    fn send(
        &mut self,
        lease: &Lease,
        at: usize,
        len: usize,
        target: Target,
        deadline: Instant,
    ) -> Result<(), NetError> {
        if len == 0 {
            return Ok(());
        }
        let pieces = len.div_ceil(PIECE);
        let mut k = 0;
        let region = lease.region();
        let base = lease.offset() + at;
        let link = &mut self.to_next;
        complete(
            link.ep.as_mut(),
            &mut link.next_id,
            |ep, id| {
                let off = k * PIECE;
                let l = PIECE.min(len - off);
                let posted = ep.write(
                    region.range(base + off, l),
                    target.region.at(target.offset + off as u64),
                    id,
                )?;
                if posted == Posted::Yes {
                    k += 1;
                }
                Ok(posted)
            },
            pieces,
            deadline,
        )
    }

    /// Waits until control word `at` reaches `value`, polling both endpoints, watching the
    /// abort word.
    fn wait(
        &mut self,
        at: usize,
        value: u64,
        seq: u64,
        waiting_for: &'static str,
        peer: usize,
        deadline: Instant,
    ) -> Result<(), GdrError> {
        let (rank, op) = (self.rank, OpKind::AllReduce);
        let mut done = Vec::new();
        loop {
            let abort = self.control.memory.word(ABORT).load(Ordering::Acquire);
            if abort & ABORT_BIT != 0 {
                return Err(GdrError::PeerFailed {
                    rank,
                    op,
                    seq,
                    origin: ((abort >> 32) & 0x7fff_ffff) as usize,
                    origin_seq: abort & 0xffff_ffff,
                });
            }
            if self.control.memory.word(at).load(Ordering::Acquire) >= value {
                return Ok(());
            }
            for link in [&mut self.to_next, &mut self.to_prev] {
                let p = link.peer;
                let fail = |source| GdrError::Net {
                    rank,
                    op,
                    seq,
                    peer: p,
                    source,
                };
                link.ep.poll(&mut done).map_err(fail)?;
                for c in done.drain(..) {
                    c.result.map_err(fail)?;
                }
            }
            if Instant::now() > deadline {
                return Err(GdrError::Timeout {
                    rank,
                    op,
                    seq,
                    peer,
                    waiting_for,
                    after: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Tells both neighbours (best effort: a link may be broken) that `origin` failed
    /// operation `seq`.
    fn abort(&mut self, origin: usize, seq: u64) {
        let word = ABORT_BIT | ((origin as u64 & 0x7fff_ffff) << 32) | (seq & 0xffff_ffff);
        let deadline = Instant::now() + Duration::from_millis(500).min(self.timeout);
        let (next, prev) = (self.next_control, self.prev_control);
        let _ = self.to_next.words(&[word], next, ABORT, deadline);
        let _ = self.to_prev.words(&[word], prev, ABORT, deadline);
    }
}

impl Drop for GdrRing {
    fn drop(&mut self) {
        // The scratch is freed with the ring: forget its registration first.
        self.cache
            .invalidate(self.scratch.address(), self.scratch.len());
    }
}

#[cfg(test)]
mod tests {
    //! The GDR ring on the emulated RDMA device (`WEFT_IB_LIBRARY` = the emulator) with
    //! [`HostDevice`]: every rank a thread and a host of its own, sharing the process's
    //! emulated NIC. The fault knobs are read when a process opens the device, so the fault
    //! tests run in a child process of this binary.
    use super::*;
    use std::sync::{Barrier, Mutex};

    /// Set in the child processes of the fault tests.
    const CHILD: &str = "WEFT_GDR_TEST_CHILD";

    fn provider() -> Option<Arc<dyn Provider>> {
        let p = weftcc_transports::net::verbs::emulated_for_tests(14, 7)?;
        Some(Arc::new(p))
    }

    /// An all-gather of byte records between the threads of one test.
    struct Hub {
        slots: Mutex<Vec<Vec<u8>>>,
        barrier: Barrier,
    }

    impl Hub {
        fn new(n: usize) -> Hub {
            Hub {
                slots: Mutex::new(vec![Vec::new(); n]),
                barrier: Barrier::new(n),
            }
        }

        fn exchange(&self, rank: usize, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
            self.slots.lock().unwrap()[rank] = mine;
            self.barrier.wait();
            let all = self.slots.lock().unwrap().clone();
            self.barrier.wait();
            Ok(all)
        }
    }

    const PATH: GdrPath = GdrPath {
        class: PathClass::Pix,
        level: PathClass::Pxb,
    };

    /// Runs `f(rank, setup)` on `n` threads, each connecting its ring first.
    fn ring<R: Send>(
        p: &Arc<dyn Provider>,
        n: usize,
        path: GdrPath,
        peer_memory: bool,
        f: impl Fn(usize, GdrSetup) -> R + Sync,
    ) -> Vec<R> {
        ring_of(p, n, |_| (path, Box::new(HostDevice { peer_memory })), f)
    }

    /// Runs `f(rank, setup)` on `n` threads, rank `r` connecting with `of(r)`'s path and
    /// device.
    fn ring_of<R: Send>(
        p: &Arc<dyn Provider>,
        n: usize,
        of: impl Fn(usize) -> (GdrPath, Box<dyn DeviceSide>) + Sync,
        f: impl Fn(usize, GdrSetup) -> R + Sync,
    ) -> Vec<R> {
        let hub = Hub::new(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let (hub, f, of) = (&hub, &f, &of);
                    s.spawn(move || {
                        let (path, device) = of(rank);
                        let setup = GdrRing::connect(
                            rank,
                            n,
                            p,
                            device,
                            path,
                            1 << 20,
                            &|mine| hub.exchange(rank, mine),
                            Duration::from_secs(30),
                        )
                        .expect("a verdict, not an error");
                        f(rank, setup)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every rank's reason to stage (`of` gives each rank's path and device).
    fn verdicts(
        p: &Arc<dyn Provider>,
        n: usize,
        of: impl Fn(usize) -> (GdrPath, Box<dyn DeviceSide>) + Sync,
    ) -> Vec<NoGdr> {
        ring_of(p, n, of, |_, setup| staged(setup))
    }

    fn staged(setup: GdrSetup) -> NoGdr {
        match setup {
            GdrSetup::Staged(why) => why,
            GdrSetup::Direct(_) => panic!("direct"),
        }
    }

    fn direct(setup: GdrSetup) -> Box<GdrRing> {
        match setup {
            GdrSetup::Direct(r) => r,
            GdrSetup::Staged(why) => panic!("staged: {why}"),
        }
    }

    /// A device buffer of `count` i32 holding `value(i)`.
    fn buffer(count: usize, value: impl Fn(usize) -> i32) -> MemfdDevice {
        buffer_with(false, count, value)
    }

    fn buffer_with(peer_memory: bool, count: usize, value: impl Fn(usize) -> i32) -> MemfdDevice {
        let d = MemfdDevice::new(count * 4, peer_memory).unwrap();
        let bytes: Vec<u8> = (0..count).flat_map(|i| value(i).to_le_bytes()).collect();
        // SAFETY: the buffer is this thread's alone before the operation.
        unsafe { d.host().write(0, &bytes) };
        d
    }

    fn values(d: &MemfdDevice, count: usize) -> Vec<i32> {
        // SAFETY: the operation that wrote it returned.
        unsafe {
            d.host().read(0, count * 4, |b| {
                b.chunks(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            })
        }
    }

    #[test]
    fn rings_of_two_and_three_ranks_all_reduce_in_device_memory_written_by_the_nic() {
        let Some(p) = provider() else { return };
        for n in [2, 3] {
            let wrong = ring(&p, n, PATH, false, |rank, setup| {
                let mut ring = direct(setup);
                assert_eq!(ring.registration(), Some(DeviceRegistration::Dmabuf));
                let mut wrong = Vec::new();
                // Uneven chunks, then a buffer used twice (its registration cached), then
                // another buffer.
                for (round, count) in [(0, 1001), (1, 4096), (2, 4096), (3, 70_000)] {
                    let b = buffer(count, |i| (i as i32) * (rank as i32 + 1) + round);
                    ring.all_reduce_in_place(&b, 0, count, DataType::Int32, Combiner::Sum)
                        .expect("all-reduce");
                    let sum = (n * (n + 1) / 2) as i32;
                    let got = values(&b, count);
                    let bad = (0..count)
                        .filter(|&i| got[i] != (i as i32) * sum + n as i32 * round)
                        .count();
                    if bad > 0 {
                        wrong.push(format!("rank {rank} round {round}: {bad} wrong"));
                    }
                }
                wrong
            });
            let wrong: Vec<_> = wrong.into_iter().flatten().collect();
            assert!(wrong.is_empty(), "{n} ranks: {wrong:?}");
        }
    }

    #[test]
    fn beyond_the_gdr_level_every_rank_stages_and_says_why() {
        let Some(p) = provider() else { return };
        // Rank 1's NIC is behind the host bridge; the level allows PXB.
        let whys = verdicts(&p, 2, |rank| {
            let class = [PathClass::Pix, PathClass::Phb][rank];
            let device = HostDevice { peer_memory: false };
            (
                GdrPath { class, ..PATH },
                Box::new(device) as Box<dyn DeviceSide>,
            )
        });
        assert_eq!(
            whys[0],
            NoGdr::Peer {
                rank: 1,
                why: NoGdrKind::Level
            }
        );
        assert_eq!(
            whys[1],
            NoGdr::Level {
                class: PathClass::Phb,
                level: PathClass::Pxb
            }
        );
    }

    /// A device whose allocations fail.
    struct NoMemory;

    impl DeviceSide for NoMemory {
        fn alloc(&self, _: usize) -> CudaResult<Box<dyn DeviceMemory>> {
            Err(CudaError::Other("out of device memory".into()))
        }
        fn control(&self, len: usize) -> CudaResult<Control> {
            HostDevice { peer_memory: false }.control(len)
        }
        fn consume(&self, _: &Control, _: u64, _: Option<Reduce>) -> CudaResult<()> {
            Ok(())
        }
    }

    #[test]
    fn a_rank_whose_set_up_fails_makes_every_rank_stage_without_waiting() {
        let Some(p) = provider() else { return };
        let whys = verdicts(&p, 3, |rank| {
            let device: Box<dyn DeviceSide> = match rank {
                2 => Box::new(NoMemory),
                _ => Box::new(HostDevice { peer_memory: false }),
            };
            (PATH, device)
        });
        assert!(
            matches!(&whys[2], NoGdr::Setup(d) if d.contains("out of device memory")),
            "{:?}",
            whys[2]
        );
        for why in &whys[..2] {
            assert_eq!(
                why,
                &NoGdr::Peer {
                    rank: 2,
                    why: NoGdrKind::Setup
                }
            );
        }
    }

    /// Runs test `name` of this binary in a child process with `env`; its stderr.
    fn child(name: &str, env: &[(&str, &str)]) -> Option<String> {
        provider()?;
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .envs(env.iter().copied())
            .output()
            .expect("run the child");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "child {name}: {}\n{stdout}\n{stderr}",
            out.status
        );
        Some(stderr)
    }

    #[test]
    fn a_refused_dmabuf_registration_stages_logged_or_falls_back_to_peer_memory() {
        let name = "gdr::tests::refused_dmabuf_child";
        let env = [("WEFT_IBEMU_REFUSE_DMABUF", "1"), ("WEFT_DEBUG", "INFO")];
        let Some(log) = child(name, &env) else { return };
        for rank in 0..2 {
            let peer = 1 - rank;
            let line = log
                .lines()
                .find(|l| l.contains(&format!("rank={rank}")) && l.contains("no GDRDMA"))
                .unwrap_or_else(|| panic!("no line for rank {rank} in {log}"));
            assert!(
                line.contains(&format!("no GDRDMA to rank {peer}"))
                    && line.contains("dmabuf registration refused")
                    && line.contains("ibv_reg_dmabuf_mr"),
                "{line}"
            );
        }
        assert!(
            log.contains("GDRDMA to rank 1 via NET/IB")
                && log.contains("registered by nvidia-peermem"),
            "the peer-memory fallback is logged as GDRDMA: {log}"
        );
    }

    #[test]
    fn refused_dmabuf_child() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        weftcc_comm::init_logging();
        let p = provider().expect("the emulator");
        let whys = ring(&p, 2, PATH, false, |_, setup| staged(setup));
        for (rank, why) in whys.iter().enumerate() {
            match why {
                NoGdr::Refused(DeviceRefused {
                    dmabuf: NetError::Call { call, code, .. },
                    peer_memory: None,
                }) => assert_eq!((*call, *code), ("ibv_reg_dmabuf_mr", -95), "rank {rank}"),
                other => panic!("rank {rank}: {other:?}"),
            }
        }
        // Where nvidia-peermem would take the device address, the ring is direct anyway.
        let sums = ring(&p, 2, PATH, true, |rank, setup| {
            let mut ring = direct(setup);
            assert_eq!(ring.registration(), Some(DeviceRegistration::PeerMemory));
            let b = buffer_with(true, 5000, |i| i as i32 + rank as i32);
            ring.all_reduce_in_place(&b, 0, 5000, DataType::Int32, Combiner::Sum)
                .expect("all-reduce");
            values(&b, 5000)
        });
        for got in sums {
            assert!(got.iter().enumerate().all(|(i, &v)| v == 2 * i as i32 + 1));
        }
    }

    #[test]
    fn a_remote_access_error_mid_transfer_fails_every_rank_naming_the_operation() {
        // Two ranks, two 8 KiB data writes each per operation: the sixth received is the
        // second operation's (#1) second.
        let name = "gdr::tests::remote_access_error_child";
        let _ = child(name, &[("WEFT_IBEMU_REM_ACCESS_AFTER", "6")]);
    }

    #[test]
    fn remote_access_error_child() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        let p = provider().expect("the emulator");
        let errors = ring(&p, 2, PATH, false, |rank, setup| {
            let mut ring = direct(setup);
            let b = buffer(4096, |i| i as i32);
            for _ in 0..4 {
                if let Err(e) =
                    ring.all_reduce_in_place(&b, 0, 4096, DataType::Int32, Combiner::Sum)
                {
                    // The ring stays failed.
                    let again =
                        ring.all_reduce_in_place(&b, 0, 4096, DataType::Int32, Combiner::Sum);
                    assert_eq!(again, Err(GdrError::Broken { rank }));
                    return e;
                }
            }
            panic!("rank {rank}: no failure in four operations");
        });
        let origin = errors
            .iter()
            .position(|e| {
                matches!(
                    e,
                    GdrError::Net {
                        seq: 1,
                        op: OpKind::AllReduce,
                        source: NetError::WorkFailed { status: 10, .. },
                        ..
                    }
                )
            })
            .unwrap_or_else(|| panic!("no remote access error: {errors:?}"));
        match &errors[1 - origin] {
            GdrError::PeerFailed {
                rank,
                seq: 1,
                origin: o,
                origin_seq: 1,
                op: OpKind::AllReduce,
            } => assert_eq!((*rank, *o), (1 - origin, origin)),
            other => panic!("the other rank: {other:?}"),
        }
        eprintln!("errors: {errors:?}");
    }
}
