//! The CUDA IPC transport and the device executor of weftcc's pure schedules.
//!
//! Setup: every rank allocates an inbox (for each sender, `depth` slots of `slot_bytes`) and a
//! flag page (`filled[p]`, written by sender `p`; `freed[p]`, written by receiver `p`) in device
//! memory, exports both with `cuIpcGetMemHandle`, and the handles are all-gathered over the host
//! communicator; each rank opens its peers' handles with lazy peer access (the driver enables
//! NVLink/PCIe peer access where it is possible).
//!
//! Execution: the schedule of `weftcc_collectives::schedule` (ring all-reduce, ring
//! reduce-scatter/all-gather, chains, pairwise all-to-all) is enqueued step by step, entirely on
//! GPU streams, with no host thread in the loop:
//! * the k-th message to peer `p` waits (`cuStreamWaitValue32`, GEQ) until `p` freed slot
//!   `k mod depth`, is copied with `cuMemcpyDtoDAsync` straight into `p`'s inbox through the
//!   IPC mapping (the NVLink/PCIe peer copy), then raises `p`'s `filled[me]` to `k + 1` with
//!   `cuStreamWriteValue32` (which fences the copy);
//! * the k-th receive from `p` waits until `filled[p] ≥ k + 1`, copies or reduces the slot into
//!   place with the NVRTC kernels, then raises `p`'s `freed[me]`;
//! * sends to one peer, receives from one peer and local copies each run on their own stream (so
//!   per-peer order is the schedule's order), and a step's dependencies on other streams become
//!   events; the user's stream forks into these streams and joins them again, so the collective
//!   is ordered with the caller's work exactly as a kernel launch would be.
//!
//! Before a collective's schedule is enqueued here, the ranks have exchanged and compared its
//! operation header on the host (`headers.rs`, called by `DeviceComm`): the schedules enqueued
//! are those of one call on every rank, so the per-peer message counts agree. Send/recv groups
//! likewise: each pair of ranks exchanges the group's headers for both directions (the pair's
//! message number, bytes, a fingerprint of the sizes) before either enqueues anything.
//!
//! Message counters continue across operations (wrapping u32; GEQ compares cyclically), so no
//! flag needs resetting between operations. A counter or slot is never reused before its
//! consumer has released it, so pipelining depth is `depth` messages per peer. Operations of
//! one communicator run one after the other on the GPU (each waits for the previous one's
//! completion event), as their scratch and lanes are shared.

use crate::driver::check;
use crate::error::{CudaError, Result};
use crate::memory::{raw_alloc, raw_free, Context, Event, Stream};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::time::Duration;
use weftcc_collectives::schedule::{Action, BufId, Region, Schedule};
use weftcc_collectives::{Combiner, DataType};
use weftcc_comm::Communicator;

/// Which of our streams runs a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Lane {
    Send(usize),
    Recv(usize),
    Local,
}

/// Where a schedule's `Input` and `Output` live on the device: addresses (the core's map, one
/// buffer for a collective, one per send or receive of a group laid end to end).
pub(crate) type BufferMap = weftcc_collectives::schedule::layout::BufferMap<u64>;

/// Device address of `r`'s first element (`Scratch` at `scratch`).
fn address(bufs: &BufferMap, r: &Region, es: u64, scratch: u64) -> u64 {
    match r.buf {
        BufId::Scratch => scratch + r.offset as u64 * es,
        buf => bufs
            .locate(buf, r.offset)
            .map_or(0, |(ptr, i)| ptr + i as u64 * es),
    }
}

/// IPC state of one device communicator.
pub(crate) struct IpcPeers {
    ctx: Context,
    rank: usize,
    nranks: usize,
    pub(crate) slot_bytes: usize,
    depth: usize,
    inbox: u64,
    flags: u64,
    peer_inbox: Vec<u64>,
    peer_flags: Vec<u64>,
    sent: Vec<u32>,
    recvd: Vec<u32>,
    lanes: HashMap<Lane, Stream>,
    /// Stream for aborting (memsets of our own flags), never blocked by our waits.
    ctl: Stream,
    events: Vec<Event>,
    scratch: (u64, usize),
    prescaled: (u64, usize),
    retired: Vec<u64>,
    /// Recorded on the caller's stream after the previous operation joined it.
    done: Option<Event>,
}

// SAFETY: the raw device addresses are plain numbers; all driver handles inside are Send.
unsafe impl Send for IpcPeers {}

const HANDLE: usize = 64;

fn mem_handle(ptr: u64) -> Result<[u8; HANDLE]> {
    let mut h = sys::CUipcMemHandle {
        reserved: [0; HANDLE],
    };
    // SAFETY: `ptr` is the base of a cuMemAlloc allocation of the current context; `h` is an
    // out pointer of the right type.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, ptr)
    })?;
    Ok(h.reserved.map(|c| c as u8))
}

fn open_handle(bytes: &[u8]) -> Result<u64> {
    let mut h = sys::CUipcMemHandle {
        reserved: [0; HANDLE],
    };
    for (d, s) in h.reserved.iter_mut().zip(bytes) {
        *d = *s as std::ffi::c_char;
    }
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: the handle bytes came from cuIpcGetMemHandle in a peer process (exchanged over
    // the host communicator); a context is current; `ptr` is an out pointer.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    Ok(ptr)
}

/// `cuStreamWaitValue32_v2` with GEQ (cyclic).
fn wait_geq(stream: &Stream, addr: u64, value: u32) -> Result<()> {
    // SAFETY: `addr` is a flag word inside our flag page (device memory of the current
    // context); the stream is alive.
    check("cuStreamWaitValue32", unsafe {
        sys::cuStreamWaitValue32_v2(
            stream.as_raw(),
            addr,
            value,
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    })
}

/// `cuStreamWriteValue32_v2` with the default memory barrier (prior work's writes are visible
/// before the flag is).
fn write_flag(stream: &Stream, addr: u64, value: u32) -> Result<()> {
    // SAFETY: `addr` is a flag word of a peer's flag page mapped through IPC (or ours); the
    // stream is alive.
    check("cuStreamWriteValue32", unsafe {
        sys::cuStreamWriteValue32_v2(
            stream.as_raw(),
            addr,
            value,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    })
}

pub(crate) fn copy_d2d(stream: &Stream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    // SAFETY: callers resolve both addresses from regions checked against the buffers' sizes
    // (user buffers, scratch, our inbox or a peer's IPC-mapped inbox slot).
    check("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.as_raw())
    })
}

impl IpcPeers {
    /// Allocates and exchanges the inboxes and flag pages (collective over `host`).
    pub(crate) fn connect(
        host: &Communicator,
        ctx: &Context,
        slot_bytes: usize,
        depth: usize,
    ) -> Result<IpcPeers> {
        let (rank, nranks) = (host.rank(), host.size());
        let inbox_bytes = nranks
            .checked_mul(depth)
            .and_then(|x| x.checked_mul(slot_bytes))
            .ok_or_else(|| CudaError::Other("IPC inbox size overflows".into()))?;
        let inbox = raw_alloc(ctx, inbox_bytes)?;
        let flags = raw_alloc(ctx, 8 * nranks)?;
        let ctl = ctx.stream()?;
        // SAFETY: the flag page holds 2 * nranks u32 words; the stream is alive.
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(flags, 0, 2 * nranks, ctl.as_raw())
        })?;
        ctl.synchronize(Duration::from_secs(60))?;
        let mut mine = [0u8; 2 * HANDLE];
        mine[..HANDLE].copy_from_slice(&mem_handle(inbox)?);
        mine[HANDLE..].copy_from_slice(&mem_handle(flags)?);
        let mut all = vec![0u8; 2 * HANDLE * nranks];
        host.all_gather(&mine[..], &mut all[..])?;
        let mut me = IpcPeers {
            ctx: ctx.clone(),
            rank,
            nranks,
            slot_bytes,
            depth,
            inbox,
            flags,
            peer_inbox: vec![0; nranks],
            peer_flags: vec![0; nranks],
            sent: vec![0; nranks],
            recvd: vec![0; nranks],
            lanes: HashMap::new(),
            ctl,
            events: Vec::new(),
            scratch: (0, 0),
            prescaled: (0, 0),
            retired: Vec::new(),
            done: None,
        };
        for p in 0..nranks {
            if p == rank {
                me.peer_inbox[p] = inbox;
                me.peer_flags[p] = flags;
                continue;
            }
            let rec = &all[p * 2 * HANDLE..(p + 1) * 2 * HANDLE];
            me.peer_inbox[p] = open_handle(&rec[..HANDLE])?;
            me.peer_flags[p] = open_handle(&rec[HANDLE..])?;
        }
        // Nobody may write into a peer's inbox before that peer has opened everything.
        host.barrier()?;
        Ok(me)
    }

    fn filled(&self, base: u64, p: usize) -> u64 {
        base + 4 * p as u64
    }

    fn freed(&self, base: u64, p: usize) -> u64 {
        base + 4 * (self.nranks + p) as u64
    }

    fn lane(&mut self, l: Lane) -> Result<&Stream> {
        if !self.lanes.contains_key(&l) {
            let s = self.ctx.stream()?;
            self.lanes.insert(l, s);
        }
        self.lanes
            .get(&l)
            .ok_or_else(|| CudaError::Other("lane vanished".into()))
    }

    fn event(&mut self, i: usize) -> Result<&Event> {
        while self.events.len() <= i {
            let e = self.ctx.event(false)?;
            self.events.push(e);
        }
        Ok(&self.events[i])
    }

    /// Device memory of at least `bytes` in `slot` (grown, never shrunk; the old allocation is
    /// freed when the communicator is dropped, since queued work may still use it).
    fn ensure(
        ctx: &Context,
        slot: &mut (u64, usize),
        retired: &mut Vec<u64>,
        bytes: usize,
    ) -> Result<u64> {
        if slot.1 < bytes {
            let p = raw_alloc(ctx, bytes)?;
            if slot.0 != 0 {
                retired.push(slot.0);
            }
            *slot = (p, bytes);
        }
        Ok(slot.0)
    }

    /// Orders the next operation after the previous one, whatever streams they were enqueued
    /// on: scratch, the PreMulSum buffer and the lanes are reused, and a lane of the previous
    /// operation may still be running (e.g. a send held back by flow control) when another lane
    /// has moved on.
    pub(crate) fn after_previous(&self, user: &Stream) -> Result<()> {
        match &self.done {
            Some(e) => user.wait_event(e),
            None => Ok(()),
        }
    }

    /// A device buffer for PreMulSum's scaled input.
    pub(crate) fn prescale_buffer(&mut self, bytes: usize) -> Result<u64> {
        Self::ensure(&self.ctx, &mut self.prescaled, &mut self.retired, bytes)
    }

    /// Enqueues `sched` after the work already on `user`, and makes `user` wait for it.
    pub(crate) fn enqueue(
        &mut self,
        sched: &Schedule,
        dtype: DataType,
        comb: Combiner,
        bufs: &BufferMap,
        user: &Stream,
    ) -> Result<()> {
        sched
            .check(self.nranks)
            .map_err(|e| CudaError::Other(format!("bad schedule: {e}")))?;
        let es = dtype.size() as u64;
        let scratch_bytes = sched.scratch_elems.saturating_mul(dtype.size());
        let scratch = Self::ensure(
            &self.ctx,
            &mut self.scratch,
            &mut self.retired,
            scratch_bytes,
        )?;
        let addr = |r: &Region| -> u64 { address(bufs, r, es, scratch) };
        let lane_of = |a: &Action| match *a {
            Action::Send { peer, .. } => Lane::Send(peer),
            Action::RecvCopy { peer, .. } | Action::RecvReduce { peer, .. } => Lane::Recv(peer),
            Action::Copy { .. } => Lane::Local,
        };
        let lanes: Vec<Lane> = sched.steps.iter().map(|s| lane_of(&s.action)).collect();
        // Steps whose completion another lane waits for get an event.
        let mut needs_event = vec![false; sched.steps.len()];
        for (i, s) in sched.steps.iter().enumerate() {
            for &d in &s.deps {
                if lanes[d] != lanes[i] {
                    needs_event[d] = true;
                }
            }
        }
        let mut used: Vec<Lane> = Vec::new();
        for l in &lanes {
            if !used.contains(l) {
                used.push(*l);
            }
        }
        if used.is_empty() {
            return Ok(());
        }
        // Fork: every lane starts after the work already on the user's stream.
        let fork = self.ctx.event(false)?;
        fork.record(user)?;
        for &l in &used {
            self.lane(l)?.wait_event(&fork)?;
        }
        let ctx = self.ctx.clone();
        let kernels = ctx.kernels()?;
        // Events are numbered per step; event i of this operation may reuse one recorded by an
        // earlier operation: every wait on the old recording was enqueued already.
        let mut event_of: Vec<Option<usize>> = vec![None; sched.steps.len()];
        let mut next_event = 0usize;
        for (i, step) in sched.steps.iter().enumerate() {
            let lane = lanes[i];
            for &d in &step.deps {
                if lanes[d] != lane {
                    let e = event_of[d].ok_or_else(|| CudaError::Other("missing event".into()))?;
                    let ev = &self.events[e];
                    self.lanes[&lane].wait_event(ev)?;
                }
            }
            self.lane(lane)?;
            let s = &self.lanes[&lane];
            match step.action {
                Action::Send { peer, src } => {
                    let bytes = src.len as u64 * es;
                    let slot = self.slot_for(bytes)?;
                    let k = self.sent[peer];
                    self.sent[peer] = k.wrapping_add(1);
                    let free_at = k.wrapping_add(1).wrapping_sub(self.depth as u32);
                    wait_geq(s, self.freed(self.flags, peer), free_at)?;
                    let dst = self.peer_inbox[peer]
                        + ((self.rank * self.depth + (k as usize % self.depth)) * slot) as u64;
                    copy_d2d(s, dst, addr(&src), bytes as usize)?;
                    write_flag(
                        s,
                        self.filled(self.peer_flags[peer], self.rank),
                        k.wrapping_add(1),
                    )?;
                }
                Action::RecvCopy { peer, dst } | Action::RecvReduce { peer, dst, .. } => {
                    let bytes = dst.len as u64 * es;
                    let slot = self.slot_for(bytes)?;
                    let k = self.recvd[peer];
                    self.recvd[peer] = k.wrapping_add(1);
                    wait_geq(s, self.filled(self.flags, peer), k.wrapping_add(1))?;
                    let src = self.inbox
                        + ((peer * self.depth + (k as usize % self.depth)) * slot) as u64;
                    match step.action {
                        Action::RecvReduce { local, .. } => kernels.reduce(
                            comb,
                            dtype,
                            addr(&dst),
                            addr(&local),
                            src,
                            dst.len,
                            s.as_raw(),
                        )?,
                        _ => copy_d2d(s, addr(&dst), src, bytes as usize)?,
                    }
                    write_flag(
                        s,
                        self.freed(self.peer_flags[peer], self.rank),
                        k.wrapping_add(1),
                    )?;
                }
                Action::Copy { src, dst } => {
                    let (from, to) = (addr(&src), addr(&dst));
                    if from != to {
                        copy_d2d(s, to, from, (src.len as u64 * es) as usize)?;
                    }
                }
            }
            if needs_event[i] {
                let e = next_event;
                next_event += 1;
                self.event(e)?;
                self.events[e].record(&self.lanes[&lane])?;
                event_of[i] = Some(e);
            }
        }
        // Join: the user's stream continues once every lane has finished its part.
        for &l in &used {
            let e = next_event;
            next_event += 1;
            self.event(e)?;
            self.events[e].record(&self.lanes[&l])?;
            user.wait_event(&self.events[e])?;
        }
        let done = self.ctx.event(false)?;
        done.record(user)?;
        self.done = Some(done);
        Ok(())
    }

    /// The slot size, checking that a message of `bytes` fits.
    fn slot_for(&self, bytes: u64) -> Result<usize> {
        if bytes as usize > self.slot_bytes {
            return Err(CudaError::Other(format!(
                "message of {bytes} bytes exceeds the IPC slot of {} bytes",
                self.slot_bytes
            )));
        }
        Ok(self.slot_bytes)
    }

    /// Waits (at most `timeout`) for all lanes to drain.
    pub(crate) fn synchronize(&self, timeout: Duration) -> Result<()> {
        for s in self.lanes.values() {
            s.synchronize(timeout)?;
        }
        Ok(())
    }

    /// Releases every wait of ours on the GPU (after a failure): raises our flags far beyond any
    /// counter a pending wait can ask for. The data of the failed operation is garbage.
    pub(crate) fn release_all(&self) -> Result<()> {
        self.ctx.bind()?;
        for p in 0..self.nranks {
            for (addr, v) in [
                (
                    self.filled(self.flags, p),
                    self.recvd[p].wrapping_add(1 << 20),
                ),
                (
                    self.freed(self.flags, p),
                    self.sent[p].wrapping_add(1 << 20),
                ),
            ] {
                // SAFETY: the word lies in our flag page; ctl is a non-blocking stream.
                check("cuMemsetD32Async", unsafe {
                    sys::cuMemsetD32Async(addr, v, 1, self.ctl.as_raw())
                })?;
            }
        }
        Ok(())
    }
}

impl Drop for IpcPeers {
    fn drop(&mut self) {
        let _ = self.synchronize(Duration::from_secs(10));
        if self.ctx.bind().is_ok() {
            for p in 0..self.nranks {
                if p != self.rank {
                    for ptr in [self.peer_inbox[p], self.peer_flags[p]] {
                        if ptr != 0 {
                            // SAFETY: opened by cuIpcOpenMemHandle in connect, closed once.
                            let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
                        }
                    }
                }
            }
        }
        for ptr in [self.inbox, self.flags, self.scratch.0, self.prescaled.0]
            .into_iter()
            .chain(self.retired.drain(..))
        {
            if ptr != 0 {
                raw_free(&self.ctx, ptr);
            }
        }
    }
}

/// The CUDA IPC handle of a device buffer, for another process of the same host
/// (`cuIpcGetMemHandle`): 64 opaque bytes plus the buffer's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle {
    /// The driver's handle bytes.
    pub bytes: [u8; HANDLE],
    /// Bytes the mapping may address.
    pub len: usize,
}

impl IpcHandle {
    /// Exports `buf` (which must be a whole allocation, as every [`crate::DeviceBuffer`] is).
    pub fn export<T: weftcc_collectives::Element>(
        buf: &crate::DeviceBuffer<T>,
    ) -> Result<IpcHandle> {
        buf.context().bind()?;
        Ok(IpcHandle {
            bytes: mem_handle(buf.device_ptr())?,
            len: buf.byte_len(),
        })
    }

    /// Hex text (`len:hex`), for passing through an environment variable or a pipe.
    pub fn to_text(&self) -> String {
        let hex: String = self.bytes.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}:{hex}", self.len)
    }

    /// Parses [`IpcHandle::to_text`].
    pub fn from_text(s: &str) -> Option<IpcHandle> {
        let (len, hex) = s.split_once(':')?;
        if hex.len() != 2 * HANDLE {
            return None;
        }
        let mut bytes = [0u8; HANDLE];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(IpcHandle {
            bytes,
            len: len.parse().ok()?,
        })
    }
}

/// Another process's device buffer mapped into this one (`cuIpcOpenMemHandle`, with peer
/// access enabled by the driver where the GPUs allow it). Closed on drop.
pub struct IpcMapping {
    ctx: Context,
    ptr: u64,
    len: usize,
}

impl IpcMapping {
    /// Maps `handle` into `ctx`.
    pub fn open(ctx: &Context, handle: &IpcHandle) -> Result<IpcMapping> {
        ctx.bind()?;
        Ok(IpcMapping {
            ctx: ctx.clone(),
            ptr: open_handle(&handle.bytes)?,
            len: handle.len,
        })
    }

    /// The mapped address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Enqueues a peer copy of `src` into the mapped memory at byte `offset` (the NVLink/PCIe
    /// path between GPUs, or a device copy when both share one GPU).
    pub fn copy_from<T: weftcc_collectives::Element>(
        &self,
        offset: usize,
        src: &crate::DeviceBuffer<T>,
        stream: &Stream,
    ) -> Result<()> {
        if offset
            .checked_add(src.byte_len())
            .is_none_or(|end| end > self.len)
        {
            return Err(CudaError::Other("copy beyond the IPC mapping".into()));
        }
        self.ctx.bind()?;
        copy_d2d(
            stream,
            self.ptr + offset as u64,
            src.device_ptr(),
            src.byte_len(),
        )
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: opened by cuIpcOpenMemHandle in `open`, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_text_round_trips() {
        let mut bytes = [0u8; HANDLE];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        let h = IpcHandle { bytes, len: 12345 };
        assert_eq!(IpcHandle::from_text(&h.to_text()), Some(h));
        assert_eq!(IpcHandle::from_text("12:00"), None);
        assert_eq!(IpcHandle::from_text("x"), None);
    }
}
