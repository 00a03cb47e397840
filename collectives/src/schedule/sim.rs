//! In-memory execution of the schedules of all ranks of one collective, for tests.
//!
//! [`run`] follows the execution rules of [`crate::schedule`]:
//! * a step starts once its deps have completed;
//! * sends to one peer go out in step order, receives from one peer are matched in step order,
//!   and the k-th send to a peer must have the length of that peer's k-th receive from us;
//! * each ordered pair of ranks has a FIFO byte channel. A send copies its source bytes into the
//!   channel when it runs; with a bounded capacity it may be accepted partially and continue
//!   later. A receive consumes bytes in order and may consume part of a message (a reduction is
//!   applied to each whole element as soon as its bytes are there);
//! * any number of steps may be part-way through at the same time, which is what lets bounded
//!   channels make progress.
//!
//! Which ready action runs next is chosen by the caller's `order` function, so tests can explore
//! random interleavings. Besides wrong results (which the caller checks), the simulator reports
//! deadlocks, length mismatches between matched sends and receives, out-of-bounds and illegally
//! overlapping regions, and data races: two steps of one rank that are in progress at the same
//! time while one writes memory the other touches.

use super::layout::Placement;
use super::{Action, BufId, Region, Schedule, ScheduleError, StepId};
use crate::dtype::DataType;
use crate::op::Combiner;
use crate::reduce::{self, KernelError};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;

/// The memory of one rank: one or more byte areas holding its Input and Output (which may
/// overlap, to express in-place operations), plus its scratch space.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankMemory {
    /// The rank's user memory.
    pub areas: Vec<Vec<u8>>,
    /// Where [`BufId::Input`] lives, and its bytes.
    pub input: (Placement, usize),
    /// Where [`BufId::Output`] lives, and its bytes.
    pub output: (Placement, usize),
    /// Scratch space. [`run`] replaces it with `scratch_elems` elements of filler bytes (`0xA5`)
    /// before executing and leaves it for inspection afterwards.
    pub scratch: Vec<u8>,
}

impl RankMemory {
    /// Memory with the given areas and placements.
    pub fn new(areas: Vec<Vec<u8>>, input: (Placement, usize), output: (Placement, usize)) -> Self {
        RankMemory {
            areas,
            input,
            output,
            scratch: Vec::new(),
        }
    }

    /// Out of place: Input is the whole of area 0, Output the whole of area 1.
    pub fn separate(input: Vec<u8>, output: Vec<u8>) -> Self {
        let (il, ol) = (input.len(), output.len());
        RankMemory::new(
            vec![input, output],
            (Placement::new(0, 0), il),
            (Placement::new(1, 0), ol),
        )
    }

    /// One area `buf` holding both buffers: Input is `input.1` bytes at byte `input.0`, Output
    /// `output.1` bytes at byte `output.0`. Equal ranges give an in-place all-reduce; Output
    /// inside Input an in-place reduce-scatter; Input inside Output an in-place all-gather.
    pub fn shared(buf: Vec<u8>, input: (usize, usize), output: (usize, usize)) -> Self {
        RankMemory::new(
            vec![buf],
            (Placement::new(0, input.0), input.1),
            (Placement::new(0, output.0), output.1),
        )
    }

    /// The current bytes of Input, if its placement is within its area.
    pub fn input(&self) -> Option<&[u8]> {
        self.placed(self.input)
    }

    /// The current bytes of Output, if its placement is within its area.
    pub fn output(&self) -> Option<&[u8]> {
        self.placed(self.output)
    }

    fn placed(&self, (p, len): (Placement, usize)) -> Option<&[u8]> {
        let end = p.offset.checked_add(len)?;
        self.areas.get(p.area)?.get(p.offset..end)
    }

    /// Area `a`, where index `areas.len()` is the scratch space.
    fn area(&self, a: usize) -> Option<&Vec<u8>> {
        if a == self.areas.len() {
            Some(&self.scratch)
        } else {
            self.areas.get(a)
        }
    }

    fn area_mut(&mut self, a: usize) -> Option<&mut Vec<u8>> {
        if a == self.areas.len() {
            Some(&mut self.scratch)
        } else {
            self.areas.get_mut(a)
        }
    }
}

/// Unfinished steps of one rank when the simulation deadlocked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stuck {
    pub rank: usize,
    /// How many steps had not completed.
    pub unfinished: usize,
    /// The first few of them.
    pub first: Vec<StepId>,
}

fn describe(stuck: &[Stuck]) -> String {
    let mut s = String::new();
    for (i, st) in stuck.iter().enumerate() {
        if i > 0 {
            s.push_str("; ");
        }
        let _ = write!(
            s,
            "rank {} has {} unfinished steps (first {:?})",
            st.rank, st.unfinished, st.first
        );
    }
    s
}

/// Why a simulation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// `schedules` and `mem` have different lengths.
    #[error("{schedules} schedules but {memories} rank memories")]
    RankCountMismatch { schedules: usize, memories: usize },
    /// A FIFO capacity of zero bytes can carry nothing.
    #[error("FIFO capacity must be at least one byte")]
    ZeroCapacity,
    /// A schedule broke a structural rule.
    #[error("rank {rank}: invalid schedule: {source}")]
    InvalidSchedule {
        rank: usize,
        #[source]
        source: ScheduleError,
    },
    /// A peer list names a rank that does not exist.
    #[error("rank {rank} lists peer {peer}, out of range")]
    PeerOutOfRange { rank: usize, peer: usize },
    /// `sender` lists `receiver` in `send_peers` but not the reverse, or vice versa.
    #[error(
        "peer lists disagree: rank {sender} sending to rank {receiver} is listed by only one side"
    )]
    PeerListMismatch { sender: usize, receiver: usize },
    /// Input or Output is placed outside its area.
    #[error("rank {rank}: {buf:?} is placed outside its memory area")]
    PlacementOutOfBounds { rank: usize, buf: BufId },
    /// The schedule needs more scratch than can be allocated.
    #[error("rank {rank}: scratch of {elems} elements is too large")]
    ScratchTooLarge { rank: usize, elems: usize },
    /// A region does not fit in its buffer.
    #[error("rank {rank} step {step}: region {region:?} is out of bounds")]
    RegionOutOfBounds {
        rank: usize,
        step: StepId,
        region: Region,
    },
    /// The two regions of a `Copy` or `RecvReduce` overlap without being the same memory.
    #[error("rank {rank} step {step}: source and destination overlap partially")]
    Overlap { rank: usize, step: StepId },
    /// Two steps of one rank were in progress together while one wrote memory the other uses.
    #[error("rank {rank}: steps {first} and {second} were in progress together with conflicting accesses")]
    Race {
        rank: usize,
        first: StepId,
        second: StepId,
    },
    /// A send and the receive it is matched with differ in length.
    #[error("rank {sender} step {send_step} sends {send_bytes} bytes but rank {receiver} step {recv_step} receives {recv_bytes}")]
    LengthMismatch {
        sender: usize,
        send_step: StepId,
        send_bytes: usize,
        receiver: usize,
        recv_step: StepId,
        recv_bytes: usize,
    },
    /// No rank could progress but steps remained.
    #[error("deadlock: {}", describe(.stuck))]
    Deadlock { stuck: Vec<Stuck> },
    /// All steps completed but a channel still held data.
    #[error("rank {from} sent {bytes} bytes in {messages} messages that rank {to} never received")]
    Unconsumed {
        from: usize,
        to: usize,
        bytes: usize,
        messages: usize,
    },
    /// A reduction kernel refused its arguments.
    #[error("rank {rank} step {step}: {source}")]
    Kernel {
        rank: usize,
        step: StepId,
        #[source]
        source: KernelError,
    },
}

/// A resolved region: `len` bytes at byte `start` of area `area` (scratch is area
/// `areas.len()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    area: usize,
    start: usize,
    len: usize,
}

impl Span {
    fn overlaps(&self, o: &Span) -> bool {
        self.area == o.area
            && self.len > 0
            && o.len > 0
            && self.start < o.start.saturating_add(o.len)
            && o.start < self.start.saturating_add(self.len)
    }

    /// The sub-span of `len` bytes at `at` bytes into this one.
    fn sub(&self, at: usize, len: usize) -> Span {
        Span {
            area: self.area,
            start: self.start.saturating_add(at),
            len,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Send { src: Span },
    Recv { dst: Span, local: Option<Span> },
    Copy { src: Span, dst: Span },
}

#[derive(Debug)]
struct StepInfo {
    op: Op,
    /// Bytes moved.
    bytes: usize,
    /// Memory touched, and whether it is written.
    accesses: Vec<(Span, bool)>,
}

/// Execution state of one rank (the peers of sends and receives are the keys of their queues).
struct RankState {
    steps: Vec<StepInfo>,
    /// Deps not yet completed, per step.
    waiting_on: Vec<usize>,
    dependents: Vec<Vec<StepId>>,
    /// Bytes transferred so far, per step.
    progress: Vec<usize>,
    started: Vec<bool>,
    /// Received bytes not yet applied (an incomplete element), per step.
    pending: Vec<Vec<u8>>,
    /// Sends per peer in step order (peer, queue).
    sendq: Vec<(usize, VecDeque<StepId>)>,
    /// Receives per peer in step order.
    recvq: Vec<(usize, VecDeque<StepId>)>,
    /// Copies whose deps have completed.
    ready_copies: Vec<StepId>,
    /// Started, unfinished sends and receives.
    active: Vec<StepId>,
    /// Steps not yet completed.
    left: usize,
    done: Vec<bool>,
}

/// The bytes in flight from one rank to another.
#[derive(Default)]
struct Channel {
    bytes: VecDeque<u8>,
    /// (send step, length) of every message whose send has started and whose receive has not.
    decls: VecDeque<(StepId, usize)>,
}

#[derive(Debug, Clone, Copy)]
enum Cand {
    Copy { rank: usize, slot: usize },
    Send { rank: usize, queue: usize },
    Recv { rank: usize, queue: usize },
}

/// Executes `schedules[r]` on `mem[r]` for every rank `r` until all steps complete.
///
/// `dtype` and `comb` define the elements and the reduction of `RecvReduce` steps. `order` is
/// called with the number of ready actions (at least 1) and returns which to run (taken modulo
/// that number). `fifo_capacity_bytes` bounds each channel (`None`: unbounded).
pub fn run(
    dtype: DataType,
    comb: Combiner,
    schedules: &[Schedule],
    mem: &mut [RankMemory],
    order: &mut dyn FnMut(usize) -> usize,
    fifo_capacity_bytes: Option<usize>,
) -> Result<(), SimError> {
    if schedules.len() != mem.len() {
        return Err(SimError::RankCountMismatch {
            schedules: schedules.len(),
            memories: mem.len(),
        });
    }
    if fifo_capacity_bytes == Some(0) {
        return Err(SimError::ZeroCapacity);
    }
    let n = schedules.len();
    check_peer_lists(schedules)?;
    let elem = dtype.size();

    let mut states = Vec::with_capacity(n);
    for (rank, (sched, m)) in schedules.iter().zip(mem.iter_mut()).enumerate() {
        sched
            .check(n)
            .map_err(|source| SimError::InvalidSchedule { rank, source })?;
        let scratch_bytes =
            sched
                .scratch_elems
                .checked_mul(elem)
                .ok_or(SimError::ScratchTooLarge {
                    rank,
                    elems: sched.scratch_elems,
                })?;
        m.scratch = vec![0xA5; scratch_bytes];
        states.push(prepare(rank, sched, m, elem)?);
    }

    let mut channels: BTreeMap<(usize, usize), Channel> = BTreeMap::new();
    let mut cands: Vec<Cand> = Vec::new();
    loop {
        if states.iter().all(|s| s.left == 0) {
            break;
        }
        cands.clear();
        for (rank, st) in states.iter().enumerate() {
            collect_candidates(rank, st, &channels, fifo_capacity_bytes, &mut cands);
        }
        if cands.is_empty() {
            return Err(deadlock(&states));
        }
        let pick = order(cands.len()) % cands.len();
        let Some(&cand) = cands.get(pick) else {
            continue;
        };
        match cand {
            Cand::Copy { rank, slot } => {
                let (Some(st), Some(m)) = (states.get_mut(rank), mem.get_mut(rank)) else {
                    continue;
                };
                run_copy(rank, st, m, slot)?;
            }
            Cand::Send { rank, queue } => {
                let (Some(st), Some(m)) = (states.get_mut(rank), mem.get_mut(rank)) else {
                    continue;
                };
                run_send(rank, st, m, queue, &mut channels, fifo_capacity_bytes)?;
            }
            Cand::Recv { rank, queue } => {
                let (Some(st), Some(m)) = (states.get_mut(rank), mem.get_mut(rank)) else {
                    continue;
                };
                run_recv(rank, st, m, queue, &mut channels, dtype, comb)?;
            }
        }
    }

    for (&(from, to), ch) in &channels {
        if !ch.bytes.is_empty() || !ch.decls.is_empty() {
            return Err(SimError::Unconsumed {
                from,
                to,
                bytes: ch.bytes.len(),
                messages: ch.decls.len(),
            });
        }
    }
    Ok(())
}

/// Every `send_peers` entry must be matched by a `recv_peers` entry of the peer, and vice versa.
fn check_peer_lists(schedules: &[Schedule]) -> Result<(), SimError> {
    let n = schedules.len();
    for (rank, s) in schedules.iter().enumerate() {
        for &peer in s.send_peers.iter().chain(&s.recv_peers) {
            if peer >= n {
                return Err(SimError::PeerOutOfRange { rank, peer });
            }
        }
    }
    // Every (sender, receiver) pair either side lists must be listed by the other side too.
    let sends = |a: usize, b: usize| schedules[a].send_peers.contains(&b);
    let recvs = |a: usize, b: usize| schedules[a].recv_peers.contains(&b);
    for (rank, s) in schedules.iter().enumerate() {
        let listed = s.send_peers.iter().map(|&p| (rank, p));
        for (sender, receiver) in listed.chain(s.recv_peers.iter().map(|&p| (p, rank))) {
            if !(sends(sender, receiver) && recvs(receiver, sender)) {
                return Err(SimError::PeerListMismatch { sender, receiver });
            }
        }
    }
    Ok(())
}

/// Resolves `r` to bytes of rank memory `m`, or `None` when it does not fit.
fn resolve(m: &RankMemory, r: &Region, elem: usize) -> Option<Span> {
    let (area, base, cap) = match r.buf {
        BufId::Input => (m.input.0.area, m.input.0.offset, m.input.1),
        BufId::Output => (m.output.0.area, m.output.0.offset, m.output.1),
        BufId::Scratch => (m.areas.len(), 0, m.scratch.len()),
    };
    let off = r.offset.checked_mul(elem)?;
    let len = r.len.checked_mul(elem)?;
    if off.checked_add(len)? > cap {
        return None;
    }
    Some(Span {
        area,
        start: base.checked_add(off)?,
        len,
    })
}

/// Validates one rank's memory and steps and builds its execution state.
fn prepare(
    rank: usize,
    sched: &Schedule,
    m: &RankMemory,
    elem: usize,
) -> Result<RankState, SimError> {
    for (buf, (p, len)) in [(BufId::Input, m.input), (BufId::Output, m.output)] {
        let fits = p
            .offset
            .checked_add(len)
            .zip(m.areas.get(p.area))
            .is_some_and(|(end, a)| end <= a.len());
        if !fits {
            return Err(SimError::PlacementOutOfBounds { rank, buf });
        }
    }
    let count = sched.steps.len();
    let mut steps = Vec::with_capacity(count);
    let mut waiting_on = Vec::with_capacity(count);
    let mut dependents: Vec<Vec<StepId>> = vec![Vec::new(); count];
    let mut sendq: BTreeMap<usize, VecDeque<StepId>> = BTreeMap::new();
    let mut recvq: BTreeMap<usize, VecDeque<StepId>> = BTreeMap::new();
    let mut ready_copies = Vec::new();
    for (step, s) in sched.steps.iter().enumerate() {
        let res = |r: &Region| {
            resolve(m, r, elem).ok_or(SimError::RegionOutOfBounds {
                rank,
                step,
                region: *r,
            })
        };
        // A pair of regions must be the same memory or not overlap at all.
        let pair_ok = |a: &Span, b: &Span| a == b || !a.overlaps(b);
        let info = match s.action {
            Action::Send { peer, src } => {
                let src = res(&src)?;
                sendq.entry(peer).or_default().push_back(step);
                StepInfo {
                    op: Op::Send { src },
                    bytes: src.len,
                    accesses: vec![(src, false)],
                }
            }
            Action::RecvCopy { peer, dst } => {
                let dst = res(&dst)?;
                recvq.entry(peer).or_default().push_back(step);
                StepInfo {
                    op: Op::Recv { dst, local: None },
                    bytes: dst.len,
                    accesses: vec![(dst, true)],
                }
            }
            Action::RecvReduce { peer, local, dst } => {
                let (local, dst) = (res(&local)?, res(&dst)?);
                if !pair_ok(&local, &dst) {
                    return Err(SimError::Overlap { rank, step });
                }
                recvq.entry(peer).or_default().push_back(step);
                StepInfo {
                    op: Op::Recv {
                        dst,
                        local: Some(local),
                    },
                    bytes: dst.len,
                    accesses: vec![(local, false), (dst, true)],
                }
            }
            Action::Copy { src, dst } => {
                let (src, dst) = (res(&src)?, res(&dst)?);
                if !pair_ok(&src, &dst) {
                    return Err(SimError::Overlap { rank, step });
                }
                // A copy onto itself is skipped and touches nothing.
                let accesses = if src == dst {
                    Vec::new()
                } else {
                    vec![(src, false), (dst, true)]
                };
                StepInfo {
                    op: Op::Copy { src, dst },
                    bytes: dst.len,
                    accesses,
                }
            }
        };
        let mut deps = s.deps.clone();
        deps.sort_unstable();
        deps.dedup();
        for &d in &deps {
            if let Some(list) = dependents.get_mut(d) {
                list.push(step);
            }
        }
        if deps.is_empty() && matches!(info.op, Op::Copy { .. }) {
            ready_copies.push(step);
        }
        waiting_on.push(deps.len());
        steps.push(info);
    }
    Ok(RankState {
        steps,
        waiting_on,
        dependents,
        progress: vec![0; count],
        started: vec![false; count],
        pending: vec![Vec::new(); count],
        sendq: sendq.into_iter().collect(),
        recvq: recvq.into_iter().collect(),
        ready_copies,
        active: Vec::new(),
        left: count,
        done: vec![false; count],
    })
}

fn collect_candidates(
    rank: usize,
    st: &RankState,
    channels: &BTreeMap<(usize, usize), Channel>,
    cap: Option<usize>,
    out: &mut Vec<Cand>,
) {
    out.extend((0..st.ready_copies.len()).map(|slot| Cand::Copy { rank, slot }));
    let ready = |h: StepId| st.waiting_on.get(h) == Some(&0);
    for (queue, (peer, q)) in st.sendq.iter().enumerate() {
        let Some(&h) = q.front() else { continue };
        if !ready(h) {
            continue;
        }
        let used = channels.get(&(rank, *peer)).map_or(0, |c| c.bytes.len());
        let space = cap.map_or(usize::MAX, |c| c.saturating_sub(used));
        let started = st.started.get(h).copied().unwrap_or(true);
        let remaining = remaining(st, h);
        if (!started && remaining == 0) || (remaining > 0 && space > 0) {
            out.push(Cand::Send { rank, queue });
        }
    }
    for (queue, (peer, q)) in st.recvq.iter().enumerate() {
        let Some(&h) = q.front() else { continue };
        if !ready(h) {
            continue;
        }
        let Some(ch) = channels.get(&(*peer, rank)) else {
            continue;
        };
        let started = st.started.get(h).copied().unwrap_or(true);
        if (!started && !ch.decls.is_empty()) || (started && !ch.bytes.is_empty()) {
            out.push(Cand::Recv { rank, queue });
        }
    }
}

fn remaining(st: &RankState, h: StepId) -> usize {
    let total = st.steps.get(h).map_or(0, |s| s.bytes);
    total.saturating_sub(st.progress.get(h).copied().unwrap_or(0))
}

fn deadlock(states: &[RankState]) -> SimError {
    let stuck = states
        .iter()
        .enumerate()
        .filter(|(_, s)| s.left > 0)
        .map(|(rank, s)| Stuck {
            rank,
            unfinished: s.left,
            first: s
                .done
                .iter()
                .enumerate()
                .filter(|(_, d)| !**d)
                .map(|(i, _)| i)
                .take(8)
                .collect(),
        })
        .collect();
    SimError::Deadlock { stuck }
}

/// Marks step `h` as begun, checking it against the steps already in progress.
fn begin(rank: usize, st: &mut RankState, h: StepId, stays_active: bool) -> Result<(), SimError> {
    let Some(mine) = st.steps.get(h) else {
        return Ok(());
    };
    for &other in &st.active {
        let Some(theirs) = st.steps.get(other) else {
            continue;
        };
        for (a, wa) in &mine.accesses {
            for (b, wb) in &theirs.accesses {
                if (*wa || *wb) && a.overlaps(b) {
                    return Err(SimError::Race {
                        rank,
                        first: other.min(h),
                        second: other.max(h),
                    });
                }
            }
        }
    }
    if let Some(s) = st.started.get_mut(h) {
        *s = true;
    }
    if stays_active {
        st.active.push(h);
    }
    Ok(())
}

/// Marks step `h` complete and releases the steps waiting for it.
fn complete(st: &mut RankState, h: StepId) {
    if let Some(d) = st.done.get_mut(h) {
        *d = true;
    }
    st.left = st.left.saturating_sub(1);
    st.active.retain(|&a| a != h);
    let released = st.dependents.get(h).cloned().unwrap_or_default();
    for d in released {
        if let Some(w) = st.waiting_on.get_mut(d) {
            *w = w.saturating_sub(1);
            if *w == 0 && matches!(st.steps.get(d).map(|s| s.op), Some(Op::Copy { .. })) {
                st.ready_copies.push(d);
            }
        }
    }
}

fn read(m: &RankMemory, span: Span) -> Option<Vec<u8>> {
    let end = span.start.checked_add(span.len)?;
    m.area(span.area)?.get(span.start..end).map(<[u8]>::to_vec)
}

fn write(m: &mut RankMemory, span: Span, data: &[u8]) -> Option<()> {
    let end = span.start.checked_add(data.len())?;
    m.area_mut(span.area)?
        .get_mut(span.start..end)?
        .copy_from_slice(data);
    Some(())
}

/// An access outside memory after validation (cannot happen; reported rather than panicking).
fn oob(rank: usize, step: StepId) -> SimError {
    SimError::RegionOutOfBounds {
        rank,
        step,
        region: Region::new(BufId::Scratch, 0, 0),
    }
}

fn run_copy(
    rank: usize,
    st: &mut RankState,
    m: &mut RankMemory,
    slot: usize,
) -> Result<(), SimError> {
    if slot >= st.ready_copies.len() {
        return Ok(());
    }
    let h = st.ready_copies.swap_remove(slot);
    begin(rank, st, h, false)?;
    if let Some(Op::Copy { src, dst }) = st.steps.get(h).map(|s| s.op) {
        if src != dst {
            let data = read(m, src).ok_or_else(|| oob(rank, h))?;
            write(m, dst, &data).ok_or_else(|| oob(rank, h))?;
        }
    }
    complete(st, h);
    Ok(())
}

/// The peer of queue `queue` and the step at its front, if any.
fn front(queues: &[(usize, VecDeque<StepId>)], queue: usize) -> Option<(usize, StepId)> {
    let (peer, steps) = queues.get(queue)?;
    steps.front().map(|&h| (*peer, h))
}

fn run_send(
    rank: usize,
    st: &mut RankState,
    m: &mut RankMemory,
    queue: usize,
    channels: &mut BTreeMap<(usize, usize), Channel>,
    cap: Option<usize>,
) -> Result<(), SimError> {
    let Some((peer, h)) = front(&st.sendq, queue) else {
        return Ok(());
    };
    let Some(Op::Send { src, .. }) = st.steps.get(h).map(|s| s.op) else {
        return Ok(());
    };
    let ch = channels.entry((rank, peer)).or_default();
    if !st.started.get(h).copied().unwrap_or(true) {
        begin(rank, st, h, true)?;
        ch.decls.push_back((h, src.len));
    }
    let done = st.progress.get(h).copied().unwrap_or(0);
    let space = cap.map_or(usize::MAX, |c| c.saturating_sub(ch.bytes.len()));
    let n = src.len.saturating_sub(done).min(space);
    let data = read(m, src.sub(done, n)).ok_or_else(|| oob(rank, h))?;
    ch.bytes.extend(data);
    let now = done + n;
    if let Some(p) = st.progress.get_mut(h) {
        *p = now;
    }
    if now >= src.len {
        if let Some((_, q)) = st.sendq.get_mut(queue) {
            q.pop_front();
        }
        complete(st, h);
    }
    Ok(())
}

fn run_recv(
    rank: usize,
    st: &mut RankState,
    m: &mut RankMemory,
    queue: usize,
    channels: &mut BTreeMap<(usize, usize), Channel>,
    dtype: DataType,
    comb: Combiner,
) -> Result<(), SimError> {
    let Some((peer, h)) = front(&st.recvq, queue) else {
        return Ok(());
    };
    let Some(Op::Recv { dst, local, .. }) = st.steps.get(h).map(|s| s.op) else {
        return Ok(());
    };
    let Some(ch) = channels.get_mut(&(peer, rank)) else {
        return Ok(());
    };
    if !st.started.get(h).copied().unwrap_or(true) {
        let Some((send_step, send_bytes)) = ch.decls.pop_front() else {
            return Ok(());
        };
        if send_bytes != dst.len {
            return Err(SimError::LengthMismatch {
                sender: peer,
                send_step,
                send_bytes,
                receiver: rank,
                recv_step: h,
                recv_bytes: dst.len,
            });
        }
        begin(rank, st, h, true)?;
    }
    let done = st.progress.get(h).copied().unwrap_or(0);
    let n = dst.len.saturating_sub(done).min(ch.bytes.len());
    let Some(pending) = st.pending.get_mut(h) else {
        return Ok(());
    };
    pending.extend(ch.bytes.drain(..n));
    let now = done + n;
    if let Some(p) = st.progress.get_mut(h) {
        *p = now;
    }
    // Byte offset within the message of the first pending byte.
    let at = now.saturating_sub(pending.len());
    let usable = match local {
        None => pending.len(),
        Some(_) => pending.len() / dtype.size() * dtype.size(),
    };
    let chunk: Vec<u8> = pending.drain(..usable).collect();
    match local {
        None => {
            write(m, dst.sub(at, usable), &chunk).ok_or_else(|| oob(rank, h))?;
        }
        Some(local) => {
            let mine = read(m, local.sub(at, usable)).ok_or_else(|| oob(rank, h))?;
            let mut out = vec![0u8; usable];
            reduce::reduce_into(dtype, comb, &mut out, &mine, &chunk).map_err(|source| {
                SimError::Kernel {
                    rank,
                    step: h,
                    source,
                }
            })?;
            write(m, dst.sub(at, usable), &out).ok_or_else(|| oob(rank, h))?;
        }
    }
    if now >= dst.len {
        if let Some((_, q)) = st.recvq.get_mut(queue) {
            q.pop_front();
        }
        complete(st, h);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs byte schedules (sum), steps in the order they become ready.
    fn run_bytes(scheds: &[Schedule], mem: &mut [RankMemory]) -> Result<(), SimError> {
        run(
            DataType::Uint8,
            Combiner::Sum,
            scheds,
            mem,
            &mut |_| 0,
            None,
        )
    }
    use crate::schedule::Step;

    fn step(action: Action, deps: Vec<StepId>) -> Step {
        Step { action, deps }
    }

    fn input(offset: usize, len: usize) -> Region {
        Region::new(BufId::Input, offset, len)
    }

    fn output(offset: usize, len: usize) -> Region {
        Region::new(BufId::Output, offset, len)
    }

    fn sched(steps: Vec<Step>, send_peers: Vec<usize>, recv_peers: Vec<usize>) -> Schedule {
        Schedule {
            steps,
            send_peers,
            recv_peers,
            scratch_elems: 0,
        }
    }

    /// Two ranks that each send a message and then receive one (or reduce it).
    fn exchange(len: usize, reduce: bool) -> Vec<Schedule> {
        (0..2)
            .map(|r| {
                let peer = 1 - r;
                let recv = if reduce {
                    Action::RecvReduce {
                        peer,
                        local: input(0, len),
                        dst: output(0, len),
                    }
                } else {
                    Action::RecvCopy {
                        peer,
                        dst: output(0, len),
                    }
                };
                sched(
                    vec![
                        step(
                            Action::Send {
                                peer,
                                src: input(0, len),
                            },
                            vec![],
                        ),
                        step(recv, vec![]),
                    ],
                    vec![peer],
                    vec![peer],
                )
            })
            .collect()
    }

    fn two_ranks(len_bytes: usize) -> Vec<RankMemory> {
        (0..2u8)
            .map(|r| {
                let data: Vec<u8> = (0..len_bytes)
                    .map(|i| (i as u8).wrapping_mul(3) ^ r)
                    .collect();
                RankMemory::separate(data, vec![0xEE; len_bytes])
            })
            .collect()
    }

    #[test]
    fn bounded_fifos_carry_partial_messages_and_elements() {
        for cap in [None, Some(1), Some(3), Some(7), Some(1000)] {
            for first in [true, false] {
                // int32 sum over 100 elements, with capacities that split elements.
                let scheds = exchange(100, true);
                let mut mem = two_ranks(400);
                let inputs: Vec<Vec<u8>> =
                    mem.iter().map(|m| m.input().unwrap().to_vec()).collect();
                let mut order = |k: usize| if first { 0 } else { k - 1 };
                let mut sum = |dtype, scheds: &[Schedule], mem: &mut [RankMemory]| {
                    run(dtype, Combiner::Sum, scheds, mem, &mut order, cap)
                };
                sum(DataType::Int32, &scheds, &mut mem).unwrap();
                let mut want = vec![0u8; 400];
                reduce::reduce_into(
                    DataType::Int32,
                    Combiner::Sum,
                    &mut want,
                    &inputs[0],
                    &inputs[1],
                )
                .unwrap();
                for m in &mem {
                    assert_eq!(m.output().unwrap(), &want[..], "cap {cap:?}");
                }
                // Plain copies too.
                let scheds = exchange(100, false);
                let mut mem = two_ranks(100);
                let inputs: Vec<Vec<u8>> =
                    mem.iter().map(|m| m.input().unwrap().to_vec()).collect();
                sum(DataType::Uint8, &scheds, &mut mem).unwrap();
                assert_eq!(mem[0].output().unwrap(), &inputs[1][..]);
                assert_eq!(mem[1].output().unwrap(), &inputs[0][..]);
            }
        }
    }

    #[test]
    fn deadlock_is_reported() {
        // Both ranks receive before they send.
        let scheds: Vec<Schedule> = (0..2)
            .map(|r| {
                let peer = 1 - r;
                sched(
                    vec![
                        step(
                            Action::RecvCopy {
                                peer,
                                dst: output(0, 4),
                            },
                            vec![],
                        ),
                        step(
                            Action::Send {
                                peer,
                                src: input(0, 4),
                            },
                            vec![0],
                        ),
                    ],
                    vec![peer],
                    vec![peer],
                )
            })
            .collect();
        let mut mem = two_ranks(4);
        let err = run_bytes(&scheds, &mut mem).unwrap_err();
        let SimError::Deadlock { stuck } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(stuck.len(), 2);
        assert_eq!(stuck[0].first, vec![0, 1]);
        assert!(err.to_string().contains("rank 1 has 2 unfinished steps"));
    }

    #[test]
    fn length_mismatch_is_reported() {
        let mut scheds = exchange(4, false);
        scheds[1].steps[1].action = Action::RecvCopy {
            peer: 0,
            dst: output(0, 3),
        };
        let mut mem = two_ranks(4);
        let err = run_bytes(&scheds, &mut mem).unwrap_err();
        assert_eq!(
            err,
            SimError::LengthMismatch {
                sender: 0,
                send_step: 0,
                send_bytes: 4,
                receiver: 1,
                recv_step: 1,
                recv_bytes: 3
            }
        );
    }

    #[test]
    fn race_is_reported() {
        // Rank 1 receives into Output while an independent copy reads Output.
        let scheds = vec![
            sched(
                vec![step(
                    Action::Send {
                        peer: 1,
                        src: input(0, 8),
                    },
                    vec![],
                )],
                vec![1],
                vec![],
            ),
            Schedule {
                steps: vec![
                    step(
                        Action::RecvCopy {
                            peer: 0,
                            dst: output(0, 8),
                        },
                        vec![],
                    ),
                    step(
                        Action::Copy {
                            src: output(0, 8),
                            dst: Region::new(BufId::Scratch, 0, 8),
                        },
                        vec![],
                    ),
                ],
                send_peers: vec![],
                recv_peers: vec![0],
                scratch_elems: 8,
            },
        ];
        // Send 4 bytes, receive them (the receive is now in progress), then run the copy.
        let scripted = |scheds: &[Schedule]| {
            let mut mem = two_ranks(8);
            let mut script = [0usize, 1, 1].into_iter();
            let mut order = |_: usize| script.next().unwrap_or(0);
            let sim = run(
                DataType::Uint8,
                Combiner::Sum,
                scheds,
                &mut mem,
                &mut order,
                Some(4),
            );
            sim.map(|()| mem)
        };
        let err = scripted(&scheds).unwrap_err();
        assert_eq!(
            err,
            SimError::Race {
                rank: 1,
                first: 0,
                second: 1
            }
        );
        // With the dependency the copy waits for the receive.
        let mut scheds = scheds;
        scheds[1].steps[1].deps = vec![0];
        let mem = scripted(&scheds).unwrap();
        assert_eq!(mem[1].scratch, mem[0].input().unwrap());
    }

    #[test]
    fn invalid_setups_are_reported() {
        let ok = exchange(4, false);
        let run1 = |scheds: &[Schedule], mem: &mut [RankMemory], cap| {
            run(DataType::Uint8, Combiner::Sum, scheds, mem, &mut |_| 0, cap)
        };
        assert_eq!(
            run1(&ok, &mut two_ranks(4)[..1], None),
            Err(SimError::RankCountMismatch {
                schedules: 2,
                memories: 1
            })
        );
        assert_eq!(
            run1(&ok, &mut two_ranks(4), Some(0)),
            Err(SimError::ZeroCapacity)
        );

        let mut bad = ok.clone();
        bad[0].steps[0].deps = vec![1];
        assert!(matches!(
            run1(&bad, &mut two_ranks(4), None),
            Err(SimError::InvalidSchedule { rank: 0, .. })
        ));

        let mut bad = ok.clone();
        bad[1].recv_peers.clear();
        bad[1].steps.truncate(1);
        assert_eq!(
            run1(&bad, &mut two_ranks(4), None),
            Err(SimError::PeerListMismatch {
                sender: 0,
                receiver: 1
            })
        );

        let mut bad = ok.clone();
        bad[0].send_peers.push(5);
        assert_eq!(
            run1(&bad, &mut two_ranks(4), None),
            Err(SimError::PeerOutOfRange { rank: 0, peer: 5 })
        );

        // A message nobody receives.
        let mut bad = ok.clone();
        bad[1].steps.truncate(1);
        assert_eq!(
            run1(&bad, &mut two_ranks(4), None),
            Err(SimError::Unconsumed {
                from: 0,
                to: 1,
                bytes: 4,
                messages: 1
            })
        );

        let mut bad = ok.clone();
        bad[0].steps[0].action = Action::Send {
            peer: 1,
            src: input(2, 4),
        };
        assert!(matches!(
            run1(&bad, &mut two_ranks(4), None),
            Err(SimError::RegionOutOfBounds {
                rank: 0,
                step: 0,
                ..
            })
        ));

        // Input and Output share memory; a copy between partially overlapping ranges.
        let overlap = vec![sched(
            vec![step(
                Action::Copy {
                    src: input(0, 4),
                    dst: output(0, 4),
                },
                vec![],
            )],
            vec![],
            vec![],
        )];
        let mut mem = vec![RankMemory::shared(vec![0; 8], (0, 4), (2, 4))];
        assert_eq!(
            run1(&overlap, &mut mem, None),
            Err(SimError::Overlap { rank: 0, step: 0 })
        );
        // The same copy onto the same memory is skipped.
        let mut mem = vec![RankMemory::shared(vec![7; 8], (0, 4), (0, 4))];
        run1(&overlap, &mut mem, None).unwrap();
        assert_eq!(mem[0].output().unwrap(), &[7; 4]);

        let mut mem = vec![RankMemory::shared(vec![0; 8], (6, 4), (0, 4))];
        assert_eq!(
            run1(&overlap, &mut mem, None),
            Err(SimError::PlacementOutOfBounds {
                rank: 0,
                buf: BufId::Input
            })
        );
    }
}
