//! Networks with one-sided writes (RDMA): the provider trait, its providers, and the
//! [`Connection`](crate::Connection) the engine drives over them.
//!
//! The layers, bottom up:
//! * [`Provider`]: one opened network device (an InfiniBand HCA port, a libfabric domain). It
//!   registers memory ([`Provider::register`] gives a [`Region`] with the keys a peer needs to
//!   write into it) and makes [`Endpoint`]s. An endpoint is connected to one peer's endpoint by
//!   exchanging [`Endpoint::address`]es out of band, posts one-sided writes (from a registered
//!   region, or a few bytes inline) and reports their completions when polled. Progress is
//!   manual: nothing moves unless someone polls (libfabric's tcp provider needs it, and it costs
//!   hardware nothing).
//! * Providers: [`verbs`] (InfiniBand and RoCE through rdma-core: reliable-connection queue
//!   pairs), [`ofi`] (libfabric: its `tcp;ofi_rxm` provider runs on any machine, `verbs`, `efa`
//!   and `cxi` on clusters), [`loopback`] (in memory, with fault injection, for tests).
//! * [`stream`]: [`stream::NetConnection`], the byte stream of the [`Connection`](crate::Connection)
//!   trait as a ring in the receiver's registered memory that the sender fills with RDMA writes
//!   (the data, then the new head), and whose tail the receiver writes back the same way. The
//!   receiver reduces straight out of its ring. The TCP connection that carried the handshake
//!   stays open beside it: it tells a peer that died from one that is merely quiet.
//! * [`regcache`]: registrations of callers' memory (rendezvous destinations), made once per
//!   page range and reused, and of device memory (GPUDirect RDMA), kept until it is freed.
//! * [`device`]: device memory as the NIC sees it ([`device::DeviceMemory`]: its address and a
//!   dmabuf of it), and the stand-in the tests use without a GPU ([`device::MemfdDevice`]).
//! * [`select`]: which network a rank uses (`WEFT_NET`, `WEFT_IB_DISABLE`, `WEFT_OFI_PROVIDER`)
//!   and the process-wide cache of opened providers.
//!
//! `unsafe` here is confined to registered memory ([`memory`]: an allocation a device or a peer
//! writes into behind the compiler's back) and the C interfaces of libfabric ([`ofi`]) and
//! libibverbs ([`verbs`]).

pub mod device;
pub mod loopback;
pub mod memory;
pub mod ofi;
pub mod regcache;
pub mod select;
pub mod stream;
pub mod verbs;

pub use memory::Memory;
pub use select::{NetChoice, NetKind};
pub use stream::{NetConnection, NetWaiter};

use std::sync::Arc;

/// A failure of a network provider: opening it, registering memory, posting or completing work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    /// The provider cannot be used on this machine (no device, no library, not compiled in).
    #[error("{provider}: not available: {detail}")]
    Unavailable {
        /// The provider ("OFI", "IB", "loopback").
        provider: &'static str,
        /// Why.
        detail: String,
    },
    /// A call into the provider's library failed.
    #[error("{provider}: {call} failed: {detail} (code {code})")]
    Call {
        /// The provider.
        provider: &'static str,
        /// The library call.
        call: &'static str,
        /// Its return code (negative errno-style for libfabric).
        code: i64,
        /// The library's description of the code.
        detail: String,
    },
    /// A posted write completed with an error (the peer is gone, or the remote key is bad).
    #[error("{provider}: write {wr_id} failed: {detail} (status {status})")]
    WorkFailed {
        /// The provider.
        provider: &'static str,
        /// The work request's id.
        wr_id: u64,
        /// The provider's status code.
        status: i64,
        /// Its description.
        detail: String,
    },
    /// A write was asked of memory outside the regions the endpoint may use.
    #[error("{provider}: write of {len} bytes at offset {offset} outside a {region}-byte region")]
    OutOfBounds {
        /// The provider.
        provider: &'static str,
        /// Offset of the write in the region.
        offset: u64,
        /// Bytes.
        len: usize,
        /// The region's length.
        region: usize,
    },
    /// The connection's endpoints were closed because an operation gave up a receive whose
    /// destination the peer may write (the caller's memory must not be written after that).
    #[error("{provider}: connection closed: an operation gave up a receive into its memory")]
    Abandoned {
        /// The provider.
        provider: &'static str,
    },
    /// The endpoint was asked to write before it was connected to a peer.
    #[error("{provider}: endpoint not connected")]
    NotConnected {
        /// The provider.
        provider: &'static str,
    },
}

/// Result alias for provider calls.
pub type NetResult<T> = std::result::Result<T, NetError>;

/// The rule every provider checks before posting a write: `len` bytes at `offset` lie inside a
/// `region`-byte range (a registered source, a peer's region, an endpoint's inline payload).
fn within(provider: &'static str, offset: u64, len: usize, region: u64) -> NetResult<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= region => Ok(()),
        _ => Err(NetError::OutOfBounds {
            provider,
            offset,
            len,
            region: region as usize,
        }),
    }
}

/// The same rule for an inline payload of `len` bytes where the endpoint takes at most
/// `inline_max`.
pub fn check_inline(provider: &'static str, len: usize, inline_max: usize) -> NetResult<()> {
    within(provider, 0, len, inline_max as u64)
}

/// What [`Endpoint::write`] sends: `len` bytes at `offset` of a registered region
/// ([`Region::range`]).
#[derive(Clone, Copy)]
pub struct Source<'a> {
    /// The registered region.
    pub region: &'a Region,
    /// The first byte's offset in it.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Source<'_> {
    /// Checks that the range lies inside the region (every provider does before posting).
    pub fn check(&self, provider: &'static str) -> NetResult<()> {
        within(
            provider,
            self.offset as u64,
            self.len,
            self.region.memory.len() as u64,
        )
    }
}

/// Where a write lands: `offset` bytes into a peer's region ([`RemoteRegion::at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The peer's region.
    pub region: RemoteRegion,
    /// The offset in it.
    pub offset: u64,
}

impl Target {
    /// Checks that a write of `len` bytes here lies inside the peer's region (every provider
    /// does before posting). Returns the address to write to.
    pub fn address(&self, provider: &'static str, len: usize) -> NetResult<u64> {
        within(provider, self.offset, len, self.region.len)?;
        Ok(self.region.base.wrapping_add(self.offset))
    }
}

/// What a peer needs to write into a region: the address its offset 0 has in the writer's
/// requests (a virtual address, or 0 where the provider addresses regions by offset) and the
/// remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteRegion {
    /// Address of the region's first byte in write requests.
    pub base: u64,
    /// The key that grants remote writes.
    pub key: u64,
    /// The region's length in bytes.
    pub len: u64,
}

impl RemoteRegion {
    /// The target of a write to `offset` of this region.
    pub fn at(self, offset: u64) -> Target {
        Target {
            region: self,
            offset,
        }
    }
}

/// A dmabuf range to register ([`Provider::register_dmabuf`]).
#[derive(Debug, Clone, Copy)]
pub struct Dmabuf<'a> {
    /// The exporter's descriptor (borrowed for the call: the registration holds its own
    /// reference to the buffer).
    pub fd: std::os::fd::BorrowedFd<'a>,
    /// The range's offset in the dmabuf.
    pub offset: u64,
    /// The CUDA device owning the memory: providers that name device memory by address and
    /// device rather than by dmabuf (libfabric's `FI_HMEM_CUDA` before 1.20) use it.
    pub device: i32,
}

/// What a provider keeps for a registration until it is dropped (deregisters on drop).
pub trait Registration: Send + Sync {
    /// The descriptor local writes name their source by (libfabric's `fi_mr_desc`, a verbs
    /// lkey), as an opaque integer.
    fn local_descriptor(&self) -> u64;
    /// What a peer needs to write into the region.
    fn remote(&self) -> RemoteRegion;
}

/// Registered memory: the allocation, kept alive as long as the registration.
pub struct Region {
    /// The registration. Declared first: fields drop in order, so it is deregistered before
    /// this `Region`'s reference to the memory goes.
    pub registration: Box<dyn Registration>,
    /// The memory (shared with the provider, which may copy into it on a peer's behalf).
    pub memory: Arc<Memory>,
}

impl Region {
    /// What a peer needs to write into this region.
    pub fn remote(&self) -> RemoteRegion {
        self.registration.remote()
    }

    /// The source of a write of `len` bytes at `offset` of this region.
    pub fn range(&self, offset: usize, len: usize) -> Source<'_> {
        Source {
            region: self,
            offset,
            len,
        }
    }
}

/// The result of posting a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posted {
    /// Posted: exactly one [`Completion`] with its id will follow.
    Yes,
    /// The provider's queue is full: poll completions and post again.
    Full,
}

/// A finished work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The id it was posted with.
    pub wr_id: u64,
    /// Success, or why it failed.
    pub result: std::result::Result<(), NetError>,
}

/// One opened network device: registers memory and makes endpoints.
pub trait Provider: Send + Sync {
    /// For logs: `OFI/tcp;ofi_rxm`, `IB/mlx5_0:1`, `loopback`.
    fn name(&self) -> String;
    /// Ranks whose providers have equal ids can connect through them (a different id, or none,
    /// means TCP): `ofi:<provider>`, `ib:<link layer>`. Never contains `/`.
    fn id(&self) -> String;
    /// Registers `memory` for local writes out of it and remote writes into it.
    fn register(&self, memory: Arc<Memory>) -> NetResult<Region>;
    /// Registers device memory exported as a dmabuf (`ibv_reg_dmabuf_mr`): `memory` names the
    /// range by its device address (the I/O virtual address work requests use, never
    /// dereferenced by the host), `dmabuf` is the exporter's descriptor and the range's offset
    /// in it. Providers without dmabuf support refuse ([`NetError::Unavailable`]); libfabric
    /// registers the device address with `FI_HMEM_CUDA` where its domain has `FI_HMEM`.
    fn register_dmabuf(&self, memory: Arc<Memory>, dmabuf: Dmabuf<'_>) -> NetResult<Region> {
        let _ = (memory, dmabuf);
        Err(NetError::Unavailable {
            provider: "net",
            detail: format!("{} registers no dmabuf", self.name()),
        })
    }
    /// A new endpoint, not connected yet.
    fn endpoint(&self) -> NetResult<Box<dyn Endpoint>>;
    /// Whether a registration keeps naming whatever memory is mapped at its addresses (a
    /// software provider that copies through the addresses at write time), so that an idle
    /// one may be cached after the caller's buffer went ([`regcache`]). False where the
    /// device pinned the pages at registration (verbs).
    fn registrations_follow_remapping(&self) -> bool {
        false
    }
}

/// One end of a reliable connection to one peer's endpoint.
///
/// Writes posted on one endpoint arrive in the order they were posted; whether they are also
/// placed in that order is [`Endpoint::placement_ordered`]: where it is, the stream protocol
/// writes the data and then the head at once, and elsewhere the head only once the data's
/// writes completed.
pub trait Endpoint: Send {
    /// This endpoint's address, for the peer's [`Endpoint::connect`].
    fn address(&self) -> NetResult<Vec<u8>>;
    /// Connects to the peer endpoint whose address is `peer`.
    fn connect(&mut self, peer: &[u8]) -> NetResult<()>;
    /// Most work requests this endpoint takes before their completions are polled.
    fn max_outstanding(&self) -> usize;
    /// Largest payload [`Endpoint::write_inline`] takes.
    fn inline_max(&self) -> usize;
    /// Whether a reader of the peer's memory sees this endpoint's writes placed in the order
    /// they were posted. Verbs does not promise it (the InfiniBand specification orders
    /// write-after-write on the wire, not their placement as a polling CPU sees it: relaxed
    /// ordering, adaptive routing), so a flag behind its data must wait for the data's
    /// completion there; libfabric's `FI_ORDER_RMA_WAW` does promise it.
    fn placement_ordered(&self) -> bool {
        true
    }
    /// Posts a write of the registered `src` range to `dst` of the peer's region. The source
    /// must stay unchanged until the write completes.
    fn write(&mut self, src: Source<'_>, dst: Target, wr_id: u64) -> NetResult<Posted>;
    /// Posts a write of `data` (at most [`Endpoint::inline_max`] bytes), copied before this
    /// returns, to `dst` of the peer's region.
    fn write_inline(&mut self, data: &[u8], dst: Target, wr_id: u64) -> NetResult<Posted>;
    /// Makes progress and appends the completions that are ready to `done`.
    fn poll(&mut self, done: &mut Vec<Completion>) -> NetResult<()>;
}
