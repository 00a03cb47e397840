//! The hierarchical transport ([`crate::Transport::Hierarchical`]): ranks on several hosts, CUDA
//! IPC between the GPUs of one host, the host network between hosts.
//!
//! A device communicator of this kind holds two more: `local` (the ranks of this host, over
//! CUDA IPC) and `cross` (the ranks with this rank's local index, one per host, staged through
//! pinned host memory into the host network), and its own staging proxy over the whole
//! communicator (`flat`). A call becomes the stages of `weftcc_collectives::tiers::plan` (the
//! plan checked in memory by that crate's tests), each enqueued on the caller's stream in turn:
//! the host is never waited for, every stage is stream-ordered after the one before it. Sends
//! and receives go to each peer over its own tier (`tiers::route`): the local group first, then
//! the other hosts' through the proxy.

use crate::comm::{DevSpan, DeviceComm, Work};
use crate::error::{CudaError, Result};
use crate::ipc::copy_d2d;
use crate::memory::{Context, DeviceBuffer, Event, Stream};
use std::sync::Mutex;
use weftcc_collectives::schedule::hierarchical::HostLayout;
use weftcc_collectives::tiers::{self, Buf, Region, Stage, Tier};
use weftcc_collectives::RawOp;
use weftcc_transports::lock;

/// The two tiers of a hierarchical device communicator.
pub(crate) struct Tiers {
    pub(crate) layout: HostLayout,
    /// All-reduces of at least this many bytes are sharded across hosts.
    shard_min: usize,
    /// The ranks of this host (CUDA IPC).
    pub(crate) local: DeviceComm,
    /// One rank per host, this rank's local index (staged over the host network).
    pub(crate) cross: DeviceComm,
    state: Mutex<TierState>,
}

/// Scratch memory of the plans, and the end of the previous operation (the next one may be on
/// another stream and must not reuse the scratch before it is done).
struct TierState {
    scratch: Option<DeviceBuffer<u8>>,
    /// Outgrown scratch, kept until the communicator is dropped: a stream may still use it.
    outgrown: Vec<DeviceBuffer<u8>>,
    done: Option<Event>,
}

impl Tiers {
    pub(crate) fn new(
        layout: HostLayout,
        local: DeviceComm,
        cross: DeviceComm,
        shard_min: usize,
    ) -> Tiers {
        Tiers {
            layout,
            shard_min,
            local,
            cross,
            state: Mutex::new(TierState {
                scratch: None,
                outgrown: Vec::new(),
                done: None,
            }),
        }
    }

    /// The first error of either tier, naming the tier.
    pub(crate) fn error(&self) -> Option<String> {
        [
            ("inside the host", &self.local),
            ("across hosts", &self.cross),
        ]
        .into_iter()
        .find_map(|(what, c)| c.error().map(|e| format!("{what} ({}): {e}", ranks_of(c))))
    }

    /// Aborts both tiers (their host communicators too), releasing every stream waiting on them.
    pub(crate) fn abort(&self) {
        self.local.abort();
        self.cross.abort();
    }

    /// Ends both tiers because the whole communicator failed with `e`
    /// ([`DeviceComm::end_as_tier`]).
    pub(crate) fn end(&self, e: &weftcc_comm::Error) {
        self.local.end_as_tier(e);
        self.cross.end_as_tier(e);
    }

    fn tier(&self, tier: Tier) -> Option<&DeviceComm> {
        match tier {
            Tier::Local => Some(&self.local),
            Tier::Cross => Some(&self.cross),
            Tier::Flat => None,
        }
    }
}

fn ranks_of(c: &DeviceComm) -> String {
    format!("rank {} of {}", c.rank(), c.size())
}

/// Resolves the plan's regions to device addresses.
struct Buffers {
    send: Option<DevSpan>,
    recv: DevSpan,
    scratch: u64,
    scratch_bytes: usize,
}

impl Buffers {
    fn span(&self, r: Region) -> Result<DevSpan> {
        let (base, len) = match r.buf {
            Buf::Send => {
                let s = self.send.ok_or_else(|| {
                    CudaError::Other("plan reads a send buffer it has not".into())
                })?;
                (s.ptr, s.bytes)
            }
            Buf::Recv => (self.recv.ptr, self.recv.bytes),
            Buf::Scratch => (self.scratch, self.scratch_bytes),
        };
        if r.offset.checked_add(r.len).is_none_or(|end| end > len) {
            return Err(CudaError::Other(format!(
                "plan region {r:?} outside its buffer of {len} bytes"
            )));
        }
        Ok(DevSpan {
            ptr: base + r.offset as u64,
            bytes: r.len,
        })
    }

    fn spans(&self, list: &[(usize, Region)]) -> Result<Vec<(usize, DevSpan)>> {
        list.iter().map(|&(p, r)| Ok((p, self.span(r)?))).collect()
    }
}

impl DeviceComm {
    /// Enqueues a collective's plan stage by stage on `stream`.
    pub(crate) fn enqueue_tiered(
        &self,
        tiers: &Tiers,
        seq: u64,
        call: &RawOp,
        send: Option<DevSpan>,
        recv: DevSpan,
        stream: &Stream,
    ) -> Result<()> {
        let plan = tiers::plan(
            &tiers.layout,
            self.rank(),
            call,
            send.is_none(),
            tiers.shard_min,
        );
        if plan.stages.is_empty() {
            return Ok(());
        }
        let mut state = lock(&tiers.state);
        if let Some(prev) = &state.done {
            stream.wait_event(prev)?;
        }
        let scratch = state.reserve(self.context(), plan.scratch_bytes)?;
        let bufs = Buffers {
            send,
            recv,
            scratch,
            scratch_bytes: plan.scratch_bytes,
        };
        for stage in &plan.stages {
            self.run_stage(tiers, seq, stage, &bufs, stream)?;
        }
        let done = self.context().event(false)?;
        done.record(stream)?;
        state.done = Some(done);
        Ok(())
    }

    fn run_stage(
        &self,
        tiers: &Tiers,
        seq: u64,
        stage: &Stage,
        bufs: &Buffers,
        stream: &Stream,
    ) -> Result<()> {
        match stage {
            Stage::Collective {
                tier,
                op,
                send,
                recv,
            } => {
                let send = send.map(|s| bufs.span(s)).transpose()?;
                let recv = bufs.span(*recv)?;
                match tiers.tier(*tier) {
                    Some(c) => c
                        .enqueue(*op, send, recv, stream)
                        .map_err(|e| tier_error(c, e)),
                    None => self.enqueue_staged(
                        seq,
                        Work::Collective {
                            op: *op,
                            send,
                            recv,
                        },
                        stream,
                    ),
                }
            }
            Stage::Group { tier, sends, recvs } => {
                let (sends, recvs) = (bufs.spans(sends)?, bufs.spans(recvs)?);
                self.enqueue_routed_group(tiers, *tier, seq, sends, recvs, stream)
            }
            Stage::Copy { src, dst } => {
                let (src, dst) = (bufs.span(*src)?, bufs.span(*dst)?);
                if src.bytes > 0 {
                    copy_d2d(stream, dst.ptr, src.ptr, src.bytes)?;
                }
                Ok(())
            }
            Stage::Divide { region, dtype, by } => {
                let r = bufs.span(*region)?;
                let elems = r.bytes / dtype.size();
                self.context()
                    .kernels()?
                    .divide(*dtype, r.ptr, *by, elems, stream.as_raw())
            }
        }
    }

    /// Enqueues sends and receives already routed to `tier` (peers as ranks of that tier).
    fn enqueue_routed_group(
        &self,
        tiers: &Tiers,
        tier: Tier,
        seq: u64,
        sends: Vec<(usize, DevSpan)>,
        recvs: Vec<(usize, DevSpan)>,
        stream: &Stream,
    ) -> Result<()> {
        match tiers.tier(tier) {
            Some(c) => c
                .enqueue_group(sends, recvs, stream)
                .map_err(|e| tier_error(c, e)),
            None => self.enqueue_staged(seq, Work::Group { sends, recvs }, stream),
        }
    }

    /// A group of sends and receives: peers on this host over CUDA IPC, the others staged.
    pub(crate) fn enqueue_group_tiered(
        &self,
        tiers: &Tiers,
        seq: u64,
        sends: Vec<(usize, DevSpan)>,
        recvs: Vec<(usize, DevSpan)>,
        stream: &Stream,
    ) -> Result<()> {
        let routed = tiers::route(&tiers.layout, self.rank(), sends, recvs);
        for (tier, ops) in [(Tier::Local, routed.local), (Tier::Flat, routed.flat)] {
            if !ops.is_empty() {
                self.enqueue_routed_group(tiers, tier, seq, ops.sends, ops.recvs, stream)?;
            }
        }
        Ok(())
    }
}

/// An error of a tier's communicator, as a fact of this one (the tier's ranks are not ours).
fn tier_error(c: &DeviceComm, e: CudaError) -> CudaError {
    CudaError::Other(format!("tier communicator, {}: {e}", ranks_of(c)))
}

impl TierState {
    /// Scratch of at least `bytes` (0 when none is needed).
    fn reserve(&mut self, ctx: &Context, bytes: usize) -> Result<u64> {
        if bytes == 0 {
            return Ok(0);
        }
        if self.scratch.as_ref().is_none_or(|s| s.byte_len() < bytes) {
            let size = bytes.checked_next_power_of_two().unwrap_or(bytes);
            let fresh = ctx.alloc::<u8>(size)?;
            if let Some(old) = self.scratch.replace(fresh) {
                self.outgrown.push(old);
            }
        }
        Ok(self.scratch.as_ref().map_or(0, DeviceBuffer::device_ptr))
    }
}
