//! Algorithms as pure schedules.
//!
//! A [`Schedule`] is what one rank does for one collective: a list of [`Step`]s (send a region,
//! receive a region and copy or reduce it in, copy locally) with explicit dependencies. It is
//! computed from (rank, nranks, count, slice size) alone and performs no I/O, so tests execute
//! schedules of every rank in memory (see [`sim`]) and the communicator's engine executes
//! the same schedule over real transports.
//!
//! Execution rules (the engine and the simulator both follow them):
//! * A step may start once every step in its `deps` has completed.
//! * Sends to one peer go out in step order; receives from one peer are matched in step order:
//!   the k-th `Send` to peer p on rank r carries the bytes of the k-th `Recv*` from r on rank p,
//!   and both have the same length.
//! * A send completes once its bytes are handed to the transport (the source may then change).
//! * Regions are counted in elements of the operation's data type. The engine maps
//!   [`BufId::Input`] and [`BufId::Output`] onto user memory (the same memory for in-place
//!   operations, possibly at different offsets) and [`BufId::Scratch`] onto a per-communicator
//!   buffer of `scratch_elems` elements.

pub mod hierarchical;
pub mod layout;
pub mod p2p;
pub mod sim;
pub mod tree;

/// A logical buffer a step addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The caller's send buffer.
    Input,
    /// The caller's receive buffer.
    Output,
    /// Temporary space owned by the communicator.
    Scratch,
}

/// A contiguous run of elements in one logical buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    pub buf: BufId,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl Region {
    /// A region of `len` elements at `offset` in `buf`.
    pub const fn new(buf: BufId, offset: usize, len: usize) -> Self {
        Region { buf, offset, len }
    }

    /// One past the last element.
    pub const fn end(&self) -> usize {
        self.offset + self.len
    }
}

/// What a step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Send the elements of `src` to `peer`.
    Send { peer: usize, src: Region },
    /// Receive `dst.len` elements from `peer` and store them in `dst`.
    RecvCopy { peer: usize, dst: Region },
    /// Receive `dst.len` elements from `peer` and store `local ⊕ received` in `dst`
    /// (`local` and `dst` have the same length; they may be the same region).
    RecvReduce {
        peer: usize,
        local: Region,
        dst: Region,
    },
    /// Copy `src` to `dst` locally (same length; skipped when both resolve to the same memory).
    Copy { src: Region, dst: Region },
}

/// Index of a step within its schedule.
pub type StepId = usize;

/// One step and the steps it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub action: Action,
    /// Steps (indices into [`Schedule::steps`], all smaller than this step's own index) that
    /// must complete first.
    pub deps: Vec<StepId>,
}

/// Everything one rank does for one collective.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Schedule {
    pub steps: Vec<Step>,
    /// Peers this rank sends to in this operation, even when no data flows (count 0). The engine
    /// sends each of them the operation header first, so mismatched calls are detected.
    pub send_peers: Vec<usize>,
    /// Peers this rank receives from in this operation (each sends us a header first).
    pub recv_peers: Vec<usize>,
    /// Elements of scratch space the schedule needs.
    pub scratch_elems: usize,
}

// ---------------------------------------------------------------------------------------------
// Builders.

/// Why a schedule could not be built, or why [`Schedule::check`] rejected one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `nranks` was zero.
    #[error("a communicator needs at least one rank")]
    NoRanks,
    /// `rank >= nranks`.
    #[error("rank {rank} is out of range for {nranks} ranks")]
    RankOutOfRange { rank: usize, nranks: usize },
    /// `root >= nranks`.
    #[error("root {root} is out of range for {nranks} ranks")]
    RootOutOfRange { root: usize, nranks: usize },
    /// `nranks > MAX_RANKS`.
    #[error("{nranks} ranks is more than the supported {max}")]
    TooManyRanks { nranks: usize, max: usize },
    /// A buffer of `count * nranks` elements does not fit in `usize`.
    #[error("{count} elements per rank times {nranks} ranks overflows")]
    CountOverflow { count: usize, nranks: usize },
    /// A step depends on itself or on a later step.
    #[error("step {step} depends on step {dep}, which is not an earlier step")]
    BadDep { step: StepId, dep: StepId },
    /// A step names a peer outside the communicator.
    #[error("step {step} names peer {peer}, out of range for {nranks} ranks")]
    BadPeer {
        step: StepId,
        peer: usize,
        nranks: usize,
    },
    /// A step talks to a peer missing from `send_peers`/`recv_peers`.
    #[error("step {step} talks to peer {peer}, which is not in the schedule's peer lists")]
    PeerNotListed { step: StepId, peer: usize },
    /// A step moves no data.
    #[error("step {step} has zero length")]
    EmptyStep { step: StepId },
    /// The two regions of a `Copy` or `RecvReduce` differ in length.
    #[error("step {step} has regions of different lengths")]
    RegionLengthMismatch { step: StepId },
    /// A region's end does not fit in `usize`.
    #[error("step {step} has a region whose end overflows")]
    RegionOverflow { step: StepId },
    /// The algorithm needs a power-of-two number of ranks.
    #[error("{nranks} ranks is not a power of two")]
    NotPowerOfTwo { nranks: usize },
}

impl Schedule {
    /// Checks the structural rules every builder guarantees: deps point to earlier steps, peers
    /// are in range and listed in `send_peers`/`recv_peers`, no step is empty, paired regions
    /// have equal lengths and region ends do not overflow.
    pub fn check(&self, nranks: usize) -> Result<(), ScheduleError> {
        for (step, s) in self.steps.iter().enumerate() {
            if let Some(&dep) = s.deps.iter().find(|&&d| d >= step) {
                return Err(ScheduleError::BadDep { step, dep });
            }
            let (peer, listed, regions): (Option<usize>, bool, [Option<Region>; 2]) = match s.action
            {
                Action::Send { peer, src } => (
                    Some(peer),
                    self.send_peers.contains(&peer),
                    [Some(src), None],
                ),
                Action::RecvCopy { peer, dst } => (
                    Some(peer),
                    self.recv_peers.contains(&peer),
                    [Some(dst), None],
                ),
                Action::RecvReduce { peer, local, dst } => (
                    Some(peer),
                    self.recv_peers.contains(&peer),
                    [Some(local), Some(dst)],
                ),
                Action::Copy { src, dst } => (None, true, [Some(src), Some(dst)]),
            };
            if let Some(peer) = peer {
                if peer >= nranks {
                    return Err(ScheduleError::BadPeer { step, peer, nranks });
                }
                if !listed {
                    return Err(ScheduleError::PeerNotListed { step, peer });
                }
            }
            let [a, b] = regions;
            if let (Some(a), Some(b)) = (a, b) {
                if a.len != b.len {
                    return Err(ScheduleError::RegionLengthMismatch { step });
                }
            }
            for r in [a, b].into_iter().flatten() {
                if r.len == 0 {
                    return Err(ScheduleError::EmptyStep { step });
                }
                if r.offset.checked_add(r.len).is_none() {
                    return Err(ScheduleError::RegionOverflow { step });
                }
            }
        }
        Ok(())
    }
}

/// The largest communicator the builders accept (keeps all rank arithmetic far from overflow).
pub const MAX_RANKS: usize = 1 << 24;

pub(crate) fn check_rank(rank: usize, nranks: usize) -> Result<(), ScheduleError> {
    if nranks == 0 {
        Err(ScheduleError::NoRanks)
    } else if nranks > MAX_RANKS {
        Err(ScheduleError::TooManyRanks {
            nranks,
            max: MAX_RANKS,
        })
    } else if rank >= nranks {
        Err(ScheduleError::RankOutOfRange { rank, nranks })
    } else {
        Ok(())
    }
}

pub(crate) fn check_root(root: usize, nranks: usize) -> Result<(), ScheduleError> {
    if root >= nranks {
        Err(ScheduleError::RootOutOfRange { root, nranks })
    } else {
        Ok(())
    }
}

/// `count * nranks`, or an error when it overflows.
/// Recursive doubling and halving pair ranks by `rank ^ 2^k`: they need a power of two.
fn check_power_of_two(nranks: usize) -> Result<(), ScheduleError> {
    if nranks.is_power_of_two() {
        Ok(())
    } else {
        Err(ScheduleError::NotPowerOfTwo { nranks })
    }
}

fn total(count: usize, nranks: usize) -> Result<usize, ScheduleError> {
    count
        .checked_mul(nranks)
        .ok_or(ScheduleError::CountOverflow { count, nranks })
}

/// `(rank + n - back) % n` for `back <= n` (the ring position `back` places before `rank`).
pub(crate) fn before(rank: usize, back: usize, n: usize) -> usize {
    // rank < n <= MAX_RANKS and back <= n: no overflow or underflow (saturating regardless).
    (rank.saturating_add(n).saturating_sub(back)) % n.max(1)
}

/// The `[start, end)` of chunk `i` of `count` elements split as evenly as possible into `n`.
pub(crate) fn even_chunk(i: usize, count: usize, n: usize) -> (usize, usize) {
    let n = n.max(1) as u128;
    let at = |j: usize| ((j as u128 * count as u128) / n) as usize;
    let start = at(i);
    (start, at(i + 1).saturating_sub(start))
}

/// Splits `len` elements at `offset` into messages of at most `slice` elements (0 means 1):
/// `(offset, len)` pairs, none empty. Both ends of a transfer compute the same split.
pub(crate) fn slices(
    offset: usize,
    len: usize,
    slice: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let slice = slice.max(1);
    (0..len.div_ceil(slice)).map(move |k| {
        let start = k * slice;
        (offset + start, slice.min(len - start))
    })
}

/// Which step last wrote which elements of one buffer, for schedules whose reads do not line up
/// with earlier writes' slices (recursive doubling and halving): a read waits for every write
/// it overlaps. Writes recorded at the same start replace each other.
#[derive(Default)]
struct Writes(std::collections::BTreeMap<usize, (usize, StepId)>);

impl Writes {
    fn record(&mut self, start: usize, len: usize, step: StepId) {
        self.0.insert(start, (start + len, step));
    }

    /// The steps whose writes overlap `start .. start + len` (writes do not overlap each other).
    fn overlapping(&self, start: usize, len: usize) -> Vec<StepId> {
        self.0
            .range(..start + len)
            .rev()
            .take_while(|(_, &(end, _))| end > start)
            .map(|(_, &(_, step))| step)
            .collect()
    }
}

/// Accumulates steps.
#[derive(Default)]
pub(crate) struct Builder {
    pub(crate) steps: Vec<Step>,
}

impl Builder {
    pub(crate) fn push(&mut self, action: Action, deps: Vec<StepId>) -> StepId {
        let id = self.steps.len();
        self.steps.push(Step { action, deps });
        id
    }

    pub(crate) fn send(&mut self, peer: usize, src: Region, deps: Vec<StepId>) -> StepId {
        self.push(Action::Send { peer, src }, deps)
    }

    pub(crate) fn recv_copy(&mut self, peer: usize, dst: Region, deps: Vec<StepId>) -> StepId {
        self.push(Action::RecvCopy { peer, dst }, deps)
    }

    pub(crate) fn recv_reduce(
        &mut self,
        peer: usize,
        local: Region,
        dst: Region,
        deps: Vec<StepId>,
    ) -> StepId {
        self.push(Action::RecvReduce { peer, local, dst }, deps)
    }

    /// A local copy of `len` elements, omitted when empty.
    pub(crate) fn copy(&mut self, src: Region, dst: Region) -> Option<StepId> {
        (src.len > 0).then(|| self.push(Action::Copy { src, dst }, Vec::new()))
    }

    pub(crate) fn finish(
        self,
        send_peers: Vec<usize>,
        recv_peers: Vec<usize>,
        scratch_elems: usize,
    ) -> Schedule {
        Schedule {
            steps: self.steps,
            send_peers,
            recv_peers,
            scratch_elems,
        }
    }
}

/// The dependency list "slice `k` of the previous transfer", empty when there is none.
pub(crate) fn dep_at(ids: &[StepId], k: usize) -> Vec<StepId> {
    ids.get(k).copied().into_iter().collect()
}

/// Ring all-reduce (reduce-scatter then all-gather around the ring `rank -> rank + 1`).
///
/// Input and Output hold `count` elements each and may be the same memory. The buffer is split
/// into `nranks` chunks as evenly as possible; in the reduce-scatter phase each rank receives
/// and reduces one chunk per step (`RecvReduce` of its Input chunk into its Output chunk), so
/// after `nranks - 1` steps it holds the fully reduced chunk `rank + 1`; the all-gather phase
/// then passes the reduced chunks around. Every transfer is split into messages of at most
/// `slice_elems` elements, each send of a received slice depending only on that slice.
pub fn ring_all_reduce(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    if n == 1 {
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        return Ok(b.finish(Vec::new(), Vec::new(), 0));
    }
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);

    // Receive steps of the previous ring step, slice by slice: the chunk they filled is the one
    // sent at the current ring step.
    let mut prev_recv: Vec<StepId> = Vec::new();
    // Send steps of each reduce-scatter step; the all-gather receive of the same chunk
    // overwrites what they read (in place even the Input), so it waits for them.
    let mut rs_sends: Vec<Vec<StepId>> = Vec::with_capacity(n - 1);

    for s in 0..n - 1 {
        let (so, sl) = even_chunk(before(rank, s, n), count, n);
        let (ro, rl) = even_chunk(before(rank, s + 1, n), count, n);
        let src_buf = if s == 0 { BufId::Input } else { BufId::Output };
        let send_slices: Vec<_> = slices(so, sl, slice_elems).collect();
        let recv_slices: Vec<_> = slices(ro, rl, slice_elems).collect();
        let mut sends = Vec::with_capacity(send_slices.len());
        let mut recvs = Vec::with_capacity(recv_slices.len());
        for k in 0..send_slices.len().max(recv_slices.len()) {
            if let Some(&(o, l)) = send_slices.get(k) {
                let deps = if s == 0 {
                    Vec::new()
                } else {
                    dep_at(&prev_recv, k)
                };
                sends.push(b.send(next, Region::new(src_buf, o, l), deps));
            }
            if let Some(&(o, l)) = recv_slices.get(k) {
                recvs.push(b.recv_reduce(
                    prev,
                    Region::new(BufId::Input, o, l),
                    Region::new(BufId::Output, o, l),
                    Vec::new(),
                ));
            }
        }
        rs_sends.push(sends);
        prev_recv = recvs;
    }

    for t in 0..n - 1 {
        // Chunk rank + 1 - t is sent, chunk rank - t received.
        let (so, sl) = even_chunk((rank + 1 + n - t) % n, count, n);
        let (ro, rl) = even_chunk(before(rank, t, n), count, n);
        let send_slices: Vec<_> = slices(so, sl, slice_elems).collect();
        let recv_slices: Vec<_> = slices(ro, rl, slice_elems).collect();
        let overwritten = rs_sends.get(t).map(Vec::as_slice).unwrap_or(&[]);
        let mut recvs = Vec::with_capacity(recv_slices.len());
        for k in 0..send_slices.len().max(recv_slices.len()) {
            if let Some(&(o, l)) = send_slices.get(k) {
                b.send(
                    next,
                    Region::new(BufId::Output, o, l),
                    dep_at(&prev_recv, k),
                );
            }
            if let Some(&(o, l)) = recv_slices.get(k) {
                recvs.push(b.recv_copy(
                    prev,
                    Region::new(BufId::Output, o, l),
                    dep_at(overwritten, k),
                ));
            }
        }
        prev_recv = recvs;
    }
    Ok(b.finish(vec![next], vec![prev], 0))
}

/// Ring reduce-scatter.
///
/// Input holds `nranks * count` elements (block `i` is `[i * count, (i + 1) * count)`), Output
/// holds `count`: block `rank` reduced over all ranks. Output may be block `rank` of Input (in
/// place): that block is read only by the final reduction, which writes it.
///
/// At step `s` a rank sends its partial sum of block `rank - s - 1` and receives the partial sum
/// of block `rank - s - 2`, which it combines with its own Input block into Scratch slot `s % 2`
/// (into Output at the last step). A receive into a slot waits for the send that read the slot's
/// previous contents, slice by slice. `scratch_elems` is `min(nranks - 2, 2) * count`.
pub fn ring_reduce_scatter(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    total(count, n)?;
    let mut b = Builder::default();
    if n == 1 {
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        return Ok(b.finish(Vec::new(), Vec::new(), 0));
    }
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
    let block_slices: Vec<_> = slices(0, count, slice_elems).collect();
    // Where the partial sum written at step s lives.
    let slot = |s: usize| Region::new(BufId::Scratch, (s % 2) * count, count);

    let mut prev_recv: Vec<StepId> = Vec::new();
    let mut prev_send: Vec<StepId> = Vec::new();
    for s in 0..n - 1 {
        let last = s == n - 2;
        let send_block = before(rank, s + 1, n);
        let recv_block = before(rank, s + 2, n);
        let src = if s == 0 {
            Region::new(BufId::Input, send_block * count, count)
        } else {
            slot(s - 1)
        };
        let dst = if last {
            Region::new(BufId::Output, 0, count)
        } else {
            slot(s)
        };
        let mut sends = Vec::with_capacity(block_slices.len());
        let mut recvs = Vec::with_capacity(block_slices.len());
        for (k, &(o, l)) in block_slices.iter().enumerate() {
            let send_deps = if s == 0 {
                Vec::new()
            } else {
                dep_at(&prev_recv, k)
            };
            sends.push(b.send(next, Region::new(src.buf, src.offset + o, l), send_deps));
            // The slot written now was last read by the previous step's send (from s = 2 on).
            let recv_deps = if !last && s >= 2 {
                dep_at(&prev_send, k)
            } else {
                Vec::new()
            };
            recvs.push(b.recv_reduce(
                prev,
                Region::new(BufId::Input, recv_block * count + o, l),
                Region::new(dst.buf, dst.offset + o, l),
                recv_deps,
            ));
        }
        prev_recv = recvs;
        prev_send = sends;
    }
    let scratch = (n - 2).min(2) * count;
    Ok(b.finish(vec![next], vec![prev], scratch))
}

/// Recursive-halving reduce-scatter for a power-of-two number of ranks: `log2 n` exchange
/// rounds instead of the ring's `n - 1` dependent steps, the better choice where latency
/// dominates.
///
/// Input holds `nranks * count` elements, Output `count`. A rank starts responsible for all `n`
/// blocks; in round `k` (`d = n/2, n/4, …, 1`) it and its partner `r ^ d` split the window of
/// blocks both are responsible for: each sends the half that holds the partner's block and
/// reduces the partner's copy of the other half with its own. Partial sums live in Scratch, laid
/// out like Input; the last round (the window is then this rank's block) reduces into Output.
/// Every step that reads partial sums waits for the previous round's steps that wrote them.
pub fn recursive_halving_reduce_scatter(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    check_power_of_two(nranks)?;
    let n = nranks;
    let all = total(count, n)?;
    if n == 1 {
        // One rank: the ring's schedule, a copy of Input into Output.
        return ring_reduce_scatter(rank, n, count, slice_elems);
    }
    let mut b = Builder::default();
    // The previous round's writes to Scratch. Each round reads only inside the window the
    // previous one wrote, so older writes never matter.
    let mut written = Writes::default();
    let mut peers = Vec::new();
    let (mut window, mut d) = (0usize, n / 2);
    while d >= 1 {
        let partner = rank ^ d;
        peers.push(partner);
        let (first, last) = (d == n / 2, d == 1);
        // Blocks [window, window + 2d) split in two halves of d blocks.
        let (keep, give) = if rank & d == 0 {
            (window, window + d)
        } else {
            (window + d, window)
        };
        let partial = if first { BufId::Input } else { BufId::Scratch };
        for (o, l) in slices(0, d * count, slice_elems) {
            let start = give * count + o;
            let deps = written.overlapping(start, l);
            b.send(partner, Region::new(partial, start, l), deps);
        }
        let mut now_written = Writes::default();
        for (o, l) in slices(0, d * count, slice_elems) {
            let start = keep * count + o;
            let deps = written.overlapping(start, l);
            let dst = if last {
                Region::new(BufId::Output, o, l)
            } else {
                Region::new(BufId::Scratch, start, l)
            };
            let step = b.recv_reduce(partner, Region::new(partial, start, l), dst, deps);
            now_written.record(start, l, step);
        }
        written = now_written;
        window = keep;
        d /= 2;
    }
    Ok(b.finish(peers.clone(), peers, if n > 2 { all } else { 0 }))
}

/// Ring all-gather.
///
/// Input holds `count` elements, Output `nranks * count`; block `rank` of Output receives this
/// rank's Input (a local copy, skipped by the engine when Input is that block, i.e. in place).
/// At step `t` a rank sends block `rank - t` (its Input at `t = 0`) and receives block
/// `rank - t - 1` into Output; forwarding a slice waits for its receipt.
pub fn ring_all_gather(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    total(count, n)?;
    let mut b = Builder::default();
    b.copy(
        Region::new(BufId::Input, 0, count),
        Region::new(BufId::Output, rank * count, count),
    );
    if n == 1 {
        return Ok(b.finish(Vec::new(), Vec::new(), 0));
    }
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
    let block_slices: Vec<_> = slices(0, count, slice_elems).collect();
    let mut prev_recv: Vec<StepId> = Vec::new();
    for t in 0..n - 1 {
        let send_block = before(rank, t, n);
        let recv_block = before(rank, t + 1, n);
        let mut recvs = Vec::with_capacity(block_slices.len());
        for (k, &(o, l)) in block_slices.iter().enumerate() {
            if t == 0 {
                b.send(next, Region::new(BufId::Input, o, l), Vec::new());
            } else {
                b.send(
                    next,
                    Region::new(BufId::Output, send_block * count + o, l),
                    dep_at(&prev_recv, k),
                );
            }
            recvs.push(b.recv_copy(
                prev,
                Region::new(BufId::Output, recv_block * count + o, l),
                Vec::new(),
            ));
        }
        prev_recv = recvs;
    }
    Ok(b.finish(vec![next], vec![prev], 0))
}

/// Recursive-doubling all-gather for a power-of-two number of ranks: `log2 n` exchange rounds
/// instead of the ring's `n - 1` dependent steps, the better choice where latency dominates.
///
/// Input holds `count` elements, Output `nranks * count`; block `rank` of Output receives this
/// rank's Input (a local copy, skipped by the engine in place). In round `k` (`d = 2^k`) rank `r`
/// and its partner `r ^ d` exchange the `d` blocks each holds, the aligned group starting at
/// block `r & !(d - 1)`: contiguous in Output, so one transfer each way, split into slices. Each
/// sent slice waits for the steps that wrote its elements (the copy, earlier receives).
pub fn recursive_doubling_all_gather(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    check_power_of_two(nranks)?;
    let n = nranks;
    total(count, n)?;
    let mut b = Builder::default();
    // Who wrote which elements of Output.
    let mut writers = Writes::default();
    if let Some(c) = b.copy(
        Region::new(BufId::Input, 0, count),
        Region::new(BufId::Output, rank * count, count),
    ) {
        writers.record(rank * count, count, c);
    }
    let mut peers = Vec::new();
    let mut d = 1usize;
    while d < n {
        let partner = rank ^ d;
        let mine = (rank & !(d - 1)) * count;
        let theirs = (partner & !(d - 1)) * count;
        peers.push(partner);
        let mut received = Vec::new();
        for (o, l) in slices(0, d * count, slice_elems) {
            if d == 1 {
                b.send(partner, Region::new(BufId::Input, o, l), Vec::new());
            } else {
                let deps = writers.overlapping(mine + o, l);
                b.send(partner, Region::new(BufId::Output, mine + o, l), deps);
            }
            let r = b.recv_copy(
                partner,
                Region::new(BufId::Output, theirs + o, l),
                Vec::new(),
            );
            received.push((theirs + o, l, r));
        }
        for (start, len, step) in received {
            writers.record(start, len, step);
        }
        match d.checked_mul(2) {
            Some(x) => d = x,
            None => break,
        }
    }
    Ok(b.finish(peers.clone(), peers, 0))
}

/// Pipelined chain broadcast along `root -> root + 1 -> ... -> root + nranks - 1`.
///
/// The root copies Input to Output (skipped in place) and sends Input slice by slice; every
/// other rank receives each slice into Output and, unless it is last in the chain, forwards it
/// from Output as soon as it has arrived. Only the root's Input is read.
pub fn chain_broadcast(
    rank: usize,
    nranks: usize,
    root: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    check_root(root, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
    let pos = before(rank, root, n);
    if rank == root {
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        if n > 1 {
            for (o, l) in slices(0, count, slice_elems) {
                b.send(next, Region::new(BufId::Input, o, l), Vec::new());
            }
        }
    } else {
        for (o, l) in slices(0, count, slice_elems) {
            let r = b.recv_copy(prev, Region::new(BufId::Output, o, l), Vec::new());
            if pos + 1 < n {
                b.send(next, Region::new(BufId::Output, o, l), vec![r]);
            }
        }
    }
    let send_peers = if pos + 1 < n { vec![next] } else { Vec::new() };
    let recv_peers = if pos > 0 { vec![prev] } else { Vec::new() };
    Ok(b.finish(send_peers, recv_peers, 0))
}

/// Pipelined chain reduce toward `root`, along `root + 1 -> root + 2 -> ... -> root`.
///
/// The first rank of the chain sends its Input; each middle rank combines every received slice
/// with its Input slice into Scratch and forwards it; the root combines into Output. Non-root
/// ranks never write Output. Middle ranks need `scratch_elems = count`.
pub fn chain_reduce(
    rank: usize,
    nranks: usize,
    root: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    check_root(root, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    if n == 1 {
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        return Ok(b.finish(Vec::new(), Vec::new(), 0));
    }
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
    // Position in the chain: 0 is root + 1, n - 1 is the root.
    let pos = before(rank, root + 1, n);
    let mut scratch = 0;
    for (o, l) in slices(0, count, slice_elems) {
        let input = Region::new(BufId::Input, o, l);
        if pos == 0 {
            b.send(next, input, Vec::new());
        } else if pos + 1 < n {
            let partial = Region::new(BufId::Scratch, o, l);
            let r = b.recv_reduce(prev, input, partial, Vec::new());
            b.send(next, partial, vec![r]);
            scratch = count;
        } else {
            b.recv_reduce(prev, input, Region::new(BufId::Output, o, l), Vec::new());
        }
    }
    let send_peers = if pos + 1 < n { vec![next] } else { Vec::new() };
    let recv_peers = if pos > 0 { vec![prev] } else { Vec::new() };
    Ok(b.finish(send_peers, recv_peers, scratch))
}

/// Pairwise all-to-all: at round `k = 1..nranks` a rank sends Input block `rank + k` to rank
/// `rank + k` and receives Output block `rank - k` from rank `rank - k`; its own block is copied
/// locally. Input and Output hold `nranks * count` elements.
///
/// With `in_place` (Input and Output are the same memory) every block that leaves (all but the
/// rank's own) is first copied slice by slice to the same place in Scratch
/// (`scratch_elems = nranks * count`); sends read Scratch, and the receive into a slice waits
/// for that slice's copy. The own block stays where it is.
pub fn pairwise_all_to_all(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
    in_place: bool,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    let all = total(count, n)?;
    let mut b = Builder::default();
    // In place: the staging copy of each outgoing slice, by (block, slice index).
    let mut staged: Vec<Vec<Vec<StepId>>> = vec![Vec::new(); n];
    let (src_buf, scratch) = if in_place {
        for (block, slots) in staged.iter_mut().enumerate() {
            if block == rank {
                continue;
            }
            for (o, l) in slices(0, count, slice_elems) {
                let at = block * count + o;
                let c = b.copy(
                    Region::new(BufId::Output, at, l),
                    Region::new(BufId::Scratch, at, l),
                );
                slots.push(c.into_iter().collect());
            }
        }
        (BufId::Scratch, all)
    } else {
        b.copy(
            Region::new(BufId::Input, rank * count, count),
            Region::new(BufId::Output, rank * count, count),
        );
        (BufId::Input, 0)
    };
    let staged_dep = |block: usize, k: usize| staged[block].get(k).cloned().unwrap_or_default();
    let mut send_peers = Vec::with_capacity(n.saturating_sub(1));
    let mut recv_peers = Vec::with_capacity(n.saturating_sub(1));
    for k in 1..n {
        let to = (rank + k) % n;
        let from = before(rank, k, n);
        send_peers.push(to);
        recv_peers.push(from);
        for (i, (o, l)) in slices(0, count, slice_elems).enumerate() {
            b.send(
                to,
                Region::new(src_buf, to * count + o, l),
                staged_dep(to, i),
            );
            b.recv_copy(
                from,
                Region::new(BufId::Output, from * count + o, l),
                staged_dep(from, i),
            );
        }
    }
    Ok(b.finish(send_peers, recv_peers, scratch))
}

/// Dissemination barrier: in round `k` (while `d = 2^k < nranks`) a rank sends one element from
/// Scratch\[0\] to `rank + d` and receives one into Scratch\[1\] from `rank - d`. A round's send and
/// receive wait for the previous round's receive. `scratch_elems = 2` (0 for one rank).
pub fn dissemination_barrier(rank: usize, nranks: usize) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    let mut send_peers = Vec::new();
    let mut recv_peers = Vec::new();
    let mut prev_recv: Vec<StepId> = Vec::new();
    let mut d = 1usize;
    while d < n {
        let to = (rank + d) % n;
        let from = before(rank, d, n);
        send_peers.push(to);
        recv_peers.push(from);
        b.send(to, Region::new(BufId::Scratch, 0, 1), prev_recv.clone());
        let r = b.recv_copy(from, Region::new(BufId::Scratch, 1, 1), prev_recv);
        prev_recv = vec![r];
        match d.checked_mul(2) {
            Some(x) => d = x,
            None => break,
        }
    }
    let scratch = if n > 1 { 2 } else { 0 };
    Ok(b.finish(send_peers, recv_peers, scratch))
}

/// Latency-optimal all-reduce for small messages: recursive doubling (⌈log2 n⌉ exchange rounds,
/// each exchanging the whole vector), with the usual fold-in/fold-out for ranks beyond the largest
/// power of two.
///
/// Input and Output hold `count` elements each and may be the same memory (in place). Let `p` be
/// the largest power of two `<= nranks`:
/// * A rank `r >= p` sends its Input to `r - p` and receives the final result from it into
///   Output (each slice of the result only after the same slice of its Input has gone out).
/// * A rank `r < nranks - p` first receives the Input of `r + p` and combines it with its own
///   Input (the fold-in); it is the only rank that computes that combination.
/// * In round `k` (`d = 2^k < p`) ranks `r` and `r ^ d` exchange their accumulators and both
///   combine them (`a ⊕ b` on one side, `b ⊕ a` on the other). The combiners are commutative, so
///   after round `k` every group of `2^(k+1)` aligned ranks holds bitwise identical values, and
///   after the last round all ranks `< p` do (floating-point sums included). The folding ranks
///   then send the result to `r + p`, which copy it, so every rank ends with the same bits.
///   (This needs `⊕` to be commutative bit for bit, which holds for integers and for float sums
///   and products without NaNs; float `Min`/`Max` of `-0.0` and `+0.0`, or NaNs with different
///   payloads, may leave different bits on the two sides of an exchange.)
///
/// A round reads its accumulator `X` (for its send and as the local operand) and writes
/// `X ⊕ received` into the other of Output and Scratch, so a round's receive never writes what
/// the same round's send reads; the next round's receive, which writes `X`'s buffer again, waits
/// for this round's send and receive of the same slice. Round 0 of a non-folding rank reads its
/// Input and therefore writes Scratch (in place, Output is the Input still being sent). The
/// folding ranks place their fold-in so that the last round writes Output; the others copy the
/// result from Scratch to Output when the number of rounds is odd. Every transfer is split into
/// messages of at most `slice_elems` elements with per-slice deps. Ranks `< p` need
/// `scratch_elems = count`; ranks `>= p` and a single rank need none.
pub fn recursive_doubling_all_reduce(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    if n == 1 {
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        return Ok(b.finish(Vec::new(), Vec::new(), 0));
    }
    // n >= 2, so p >= 2 and there is at least one round.
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p;
    let parts: Vec<(usize, usize)> = slices(0, count, slice_elems).collect();
    let at = |buf: BufId, (o, l): (usize, usize)| Region::new(buf, o, l);
    let other = |buf: BufId| {
        if buf == BufId::Output {
            BufId::Scratch
        } else {
            BufId::Output
        }
    };

    if rank >= p {
        let q = rank - p;
        for &s in &parts {
            let sent = b.send(q, at(BufId::Input, s), Vec::new());
            // In place, this Output slice is the Input slice being sent.
            b.recv_copy(q, at(BufId::Output, s), vec![sent]);
        }
        return Ok(b.finish(vec![q], vec![q], 0));
    }

    let rounds = p.trailing_zeros() as usize;
    let folds = rank < extra;
    let mut send_peers = Vec::with_capacity(rounds + 1);
    let mut recv_peers = Vec::with_capacity(rounds + 1);

    // Steps that wrote the current accumulator, slice by slice (none while it is the Input), and
    // the sends of the previous round (which read the buffer the current round writes).
    let mut prev_recv: Vec<StepId> = Vec::new();
    let mut prev_send: Vec<StepId> = Vec::new();
    // Buffers of the current accumulator X and of the next one Y.
    let (mut x, mut y) = if folds {
        // Y of round k is Output when rounds - 1 - k is even: the last round writes Output.
        let first_y = if (rounds - 1).is_multiple_of(2) {
            BufId::Output
        } else {
            BufId::Scratch
        };
        let acc = other(first_y);
        let hi = rank + p;
        recv_peers.push(hi);
        for &s in &parts {
            prev_recv.push(b.recv_reduce(hi, at(BufId::Input, s), at(acc, s), Vec::new()));
        }
        (acc, first_y)
    } else {
        (BufId::Input, BufId::Scratch)
    };

    let mut d = 1usize;
    while d < p {
        let partner = rank ^ d;
        send_peers.push(partner);
        recv_peers.push(partner);
        let mut sends = Vec::with_capacity(parts.len());
        let mut recvs = Vec::with_capacity(parts.len());
        for (k, &s) in parts.iter().enumerate() {
            let ready = dep_at(&prev_recv, k);
            sends.push(b.send(partner, at(x, s), ready.clone()));
            let mut deps = ready;
            deps.extend(dep_at(&prev_send, k));
            recvs.push(b.recv_reduce(partner, at(x, s), at(y, s), deps));
        }
        prev_send = sends;
        prev_recv = recvs;
        (x, y) = (y, other(y));
        d <<= 1;
    }

    if folds {
        // x is Output here (see above).
        let hi = rank + p;
        send_peers.push(hi);
        for (k, &s) in parts.iter().enumerate() {
            b.send(hi, at(x, s), dep_at(&prev_recv, k));
        }
    } else if x == BufId::Scratch {
        // Output was last read by the final round (its Input, in place, when there is one round).
        for (k, &s) in parts.iter().enumerate() {
            let mut deps = dep_at(&prev_recv, k);
            deps.extend(dep_at(&prev_send, k));
            b.push(
                Action::Copy {
                    src: at(BufId::Scratch, s),
                    dst: at(BufId::Output, s),
                },
                deps,
            );
        }
    }
    Ok(b.finish(send_peers, recv_peers, count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Elements of Input, Output and Scratch a rank's schedule may address.
    struct Sizes {
        input: usize,
        output: usize,
    }

    fn region_fits(r: &Region, sizes: &Sizes, scratch: usize) -> bool {
        let cap = match r.buf {
            BufId::Input => sizes.input,
            BufId::Output => sizes.output,
            BufId::Scratch => scratch,
        };
        r.offset + r.len <= cap
    }

    /// Checks the structural rules over the schedules of all ranks of one collective.
    fn check_all(scheds: &[Schedule], sizes: &[Sizes], slice: usize, all_peers_talk: bool) {
        let n = scheds.len();
        let slice = slice.max(1);
        // (from, to) -> lengths of the sends in order, and of the receives in order.
        let mut sent: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
        let mut recvd: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
        for (r, s) in scheds.iter().enumerate() {
            s.check(n).unwrap_or_else(|e| panic!("rank {r}: {e}"));
            for (i, step) in s.steps.iter().enumerate() {
                assert!(step.deps.iter().all(|&d| d < i), "rank {r} step {i}");
                let regions: Vec<Region> = match step.action {
                    Action::Send { peer, src } => {
                        assert!(src.len <= slice, "rank {r} step {i} too long");
                        sent.entry((r, peer)).or_default().push(src.len);
                        vec![src]
                    }
                    Action::RecvCopy { peer, dst } => {
                        assert!(dst.len <= slice, "rank {r} step {i} too long");
                        recvd.entry((peer, r)).or_default().push(dst.len);
                        vec![dst]
                    }
                    Action::RecvReduce { peer, local, dst } => {
                        assert!(dst.len <= slice, "rank {r} step {i} too long");
                        assert_eq!(local.len, dst.len);
                        recvd.entry((peer, r)).or_default().push(dst.len);
                        vec![local, dst]
                    }
                    Action::Copy { src, dst } => {
                        assert_eq!(src.len, dst.len);
                        vec![src, dst]
                    }
                };
                for reg in regions {
                    assert!(reg.len > 0, "rank {r} step {i} empty");
                    assert!(
                        region_fits(&reg, &sizes[r], s.scratch_elems),
                        "rank {r} step {i} region {reg:?} out of bounds"
                    );
                }
            }
            for &p in &s.send_peers {
                assert!(
                    scheds[p].recv_peers.contains(&r),
                    "{r} -> {p} not in recv_peers"
                );
            }
            for &p in &s.recv_peers {
                assert!(
                    scheds[p].send_peers.contains(&r),
                    "{p} -> {r} not in send_peers"
                );
            }
            if all_peers_talk && n > 1 {
                assert!(!s.send_peers.is_empty() && !s.recv_peers.is_empty());
            }
        }
        for (pair, lens) in &sent {
            assert_eq!(Some(lens), recvd.get(pair), "channel {pair:?}");
        }
        for (pair, lens) in &recvd {
            assert_eq!(Some(lens), sent.get(pair), "channel {pair:?}");
        }
    }

    const COUNTS: [usize; 9] = [0, 1, 2, 3, 5, 7, 16, 33, 100];
    const SLICES: [usize; 5] = [0, 1, 3, 8, 1000];

    fn grid(mut f: impl FnMut(usize, usize, usize)) {
        for n in 1..=9 {
            for count in COUNTS {
                for slice in SLICES {
                    f(n, count, slice);
                }
            }
        }
    }

    #[test]
    fn ring_all_reduce_structure() {
        grid(|n, count, slice| {
            let s: Vec<_> = (0..n)
                .map(|r| ring_all_reduce(r, n, count, slice).unwrap())
                .collect();
            let sizes: Vec<_> = (0..n)
                .map(|_| Sizes {
                    input: count,
                    output: count,
                })
                .collect();
            check_all(&s, &sizes, slice, true);
        });
    }

    /// [`check_all`] on every rank's reduce-scatter schedule from `build`; returns them.
    fn check_reduce_scatter_shape(
        build: fn(usize, usize, usize, usize) -> Result<Schedule, ScheduleError>,
        n: usize,
        count: usize,
        slice: usize,
        all_peers_talk: bool,
    ) -> Vec<Schedule> {
        let s: Vec<_> = (0..n).map(|r| build(r, n, count, slice).unwrap()).collect();
        let sizes: Vec<_> = (0..n)
            .map(|_| Sizes {
                input: n * count,
                output: count,
            })
            .collect();
        check_all(&s, &sizes, slice, all_peers_talk);
        s
    }

    #[test]
    fn ring_reduce_scatter_structure() {
        grid(|n, count, slice| {
            for sched in check_reduce_scatter_shape(ring_reduce_scatter, n, count, slice, true) {
                assert!(sched.scratch_elems <= 2 * count);
            }
        });
    }

    /// For a builder of power-of-two rank counts only: whether `n` is one, after checking that
    /// any other count is refused.
    fn power_of_two_or_refused(
        build: fn(usize, usize, usize, usize) -> Result<Schedule, ScheduleError>,
        n: usize,
        count: usize,
        slice: usize,
    ) -> bool {
        if n.is_power_of_two() {
            return true;
        }
        assert_eq!(
            build(0, n, count, slice),
            Err(ScheduleError::NotPowerOfTwo { nranks: n })
        );
        false
    }

    #[test]
    fn recursive_halving_reduce_scatter_structure() {
        grid(|n, count, slice| {
            if !power_of_two_or_refused(recursive_halving_reduce_scatter, n, count, slice) {
                return;
            }
            let s = check_reduce_scatter_shape(
                recursive_halving_reduce_scatter,
                n,
                count,
                slice,
                false,
            );
            for (r, sched) in s.iter().enumerate() {
                // One partner per round: rank ^ n/2, rank ^ n/4, …, rank ^ 1.
                let partners: Vec<_> = (0..n.ilog2()).rev().map(|k| r ^ (1 << k)).collect();
                assert_eq!(sched.send_peers, partners, "n {n} rank {r}");
                assert!(sched.scratch_elems <= n * count);
            }
        });
    }

    /// [`check_all`] on every rank's all-gather schedule from `build`.
    fn check_all_gather_shape(
        build: fn(usize, usize, usize, usize) -> Result<Schedule, ScheduleError>,
        n: usize,
        count: usize,
        slice: usize,
        all_peers_talk: bool,
    ) {
        let s: Vec<_> = (0..n).map(|r| build(r, n, count, slice).unwrap()).collect();
        let sizes: Vec<_> = (0..n)
            .map(|_| Sizes {
                input: count,
                output: n * count,
            })
            .collect();
        check_all(&s, &sizes, slice, all_peers_talk);
    }

    #[test]
    fn ring_all_gather_structure() {
        grid(|n, count, slice| check_all_gather_shape(ring_all_gather, n, count, slice, true));
    }

    #[test]
    fn recursive_doubling_all_gather_structure() {
        grid(|n, count, slice| {
            if power_of_two_or_refused(recursive_doubling_all_gather, n, count, slice) {
                check_all_gather_shape(recursive_doubling_all_gather, n, count, slice, false);
            }
        });
    }

    #[test]
    fn chain_structure() {
        grid(|n, count, slice| {
            for root in 0..n {
                let sizes: Vec<_> = (0..n)
                    .map(|_| Sizes {
                        input: count,
                        output: count,
                    })
                    .collect();
                let s: Vec<_> = (0..n)
                    .map(|r| chain_broadcast(r, n, root, count, slice).unwrap())
                    .collect();
                check_all(&s, &sizes, slice, false);
                let s: Vec<_> = (0..n)
                    .map(|r| chain_reduce(r, n, root, count, slice).unwrap())
                    .collect();
                check_all(&s, &sizes, slice, false);
                for (r, sched) in s.iter().enumerate() {
                    if r != root {
                        let writes_output = sched.steps.iter().any(|st| {
                            matches!(
                                st.action,
                                Action::RecvCopy { dst, .. }
                                    | Action::RecvReduce { dst, .. }
                                    | Action::Copy { dst, .. } if dst.buf == BufId::Output
                            )
                        });
                        assert!(!writes_output, "non-root {r} writes Output");
                    }
                }
            }
        });
    }

    #[test]
    fn all_to_all_and_barrier_structure() {
        grid(|n, count, slice| {
            for in_place in [false, true] {
                let s: Vec<_> = (0..n)
                    .map(|r| pairwise_all_to_all(r, n, count, slice, in_place).unwrap())
                    .collect();
                let sizes: Vec<_> = (0..n)
                    .map(|_| Sizes {
                        input: n * count,
                        output: n * count,
                    })
                    .collect();
                check_all(&s, &sizes, slice, true);
                for sched in &s {
                    assert_eq!(sched.send_peers.len(), n - 1);
                }
            }
        });
        for n in 1..=40 {
            let s: Vec<_> = (0..n)
                .map(|r| dissemination_barrier(r, n).unwrap())
                .collect();
            let sizes: Vec<_> = (0..n)
                .map(|_| Sizes {
                    input: 0,
                    output: 0,
                })
                .collect();
            check_all(&s, &sizes, 1, true);
            let rounds = (usize::BITS - (n - 1).leading_zeros()) as usize;
            assert_eq!(s[0].send_peers.len(), if n == 1 { 0 } else { rounds });
        }
    }

    #[test]
    fn slicing_and_chunks() {
        assert_eq!(
            slices(10, 7, 3).collect::<Vec<_>>(),
            [(10, 3), (13, 3), (16, 1)]
        );
        assert_eq!(slices(0, 2, 0).collect::<Vec<_>>(), [(0, 1), (1, 1)]);
        assert_eq!(slices(5, 0, 4).count(), 0);
        let chunks: Vec<_> = (0..4).map(|i| even_chunk(i, 10, 4)).collect();
        assert_eq!(chunks, [(0, 2), (2, 3), (5, 2), (7, 3)]);
        assert_eq!(even_chunk(2, usize::MAX, 3).1, usize::MAX / 3);
    }

    #[test]
    fn count_zero_keeps_peers_and_emits_no_steps() {
        for n in 2..=5 {
            for r in 0..n {
                for s in [
                    ring_all_reduce(r, n, 0, 4).unwrap(),
                    ring_reduce_scatter(r, n, 0, 4).unwrap(),
                    ring_all_gather(r, n, 0, 4).unwrap(),
                    pairwise_all_to_all(r, n, 0, 4, true).unwrap(),
                ] {
                    assert!(s.steps.is_empty());
                    assert!(!s.send_peers.is_empty() && !s.recv_peers.is_empty());
                }
            }
        }
        let s = ring_all_reduce(0, 1, 0, 4).unwrap();
        assert!(s.steps.is_empty() && s.send_peers.is_empty());
    }

    #[test]
    fn invalid_arguments_are_errors() {
        assert_eq!(ring_all_reduce(0, 0, 5, 1), Err(ScheduleError::NoRanks));
        assert_eq!(
            ring_reduce_scatter(3, 3, 5, 1),
            Err(ScheduleError::RankOutOfRange { rank: 3, nranks: 3 })
        );
        assert_eq!(
            chain_broadcast(0, 3, 3, 5, 1),
            Err(ScheduleError::RootOutOfRange { root: 3, nranks: 3 })
        );
        assert_eq!(
            chain_reduce(0, 2, 7, 5, 1),
            Err(ScheduleError::RootOutOfRange { root: 7, nranks: 2 })
        );
        assert_eq!(
            ring_all_gather(0, 4, usize::MAX / 2, 1),
            Err(ScheduleError::CountOverflow {
                count: usize::MAX / 2,
                nranks: 4
            })
        );
        assert_eq!(
            pairwise_all_to_all(0, 3, usize::MAX / 2, 1, false),
            Err(ScheduleError::CountOverflow {
                count: usize::MAX / 2,
                nranks: 3
            })
        );
        assert!(matches!(
            dissemination_barrier(0, usize::MAX),
            Err(ScheduleError::TooManyRanks { .. })
        ));
        assert_eq!(
            dissemination_barrier(1, 1),
            Err(ScheduleError::RankOutOfRange { rank: 1, nranks: 1 })
        );
        // Huge counts with one rank are fine (a single copy).
        assert_eq!(ring_all_reduce(0, 1, usize::MAX, 0).unwrap().steps.len(), 1);
    }

    #[test]
    fn check_rejects_malformed_schedules() {
        let send = |peer, len| Step {
            action: Action::Send {
                peer,
                src: Region::new(BufId::Input, 0, len),
            },
            deps: Vec::new(),
        };
        let mut s = Schedule {
            steps: vec![send(1, 1)],
            send_peers: vec![1],
            recv_peers: Vec::new(),
            scratch_elems: 0,
        };
        assert_eq!(s.check(2), Ok(()));
        assert_eq!(
            s.check(1),
            Err(ScheduleError::BadPeer {
                step: 0,
                peer: 1,
                nranks: 1
            })
        );
        s.steps[0].deps = vec![0];
        assert_eq!(s.check(2), Err(ScheduleError::BadDep { step: 0, dep: 0 }));
        s.steps = vec![send(1, 0)];
        assert_eq!(s.check(2), Err(ScheduleError::EmptyStep { step: 0 }));
        s.send_peers.clear();
        s.steps = vec![send(1, 1)];
        assert_eq!(
            s.check(2),
            Err(ScheduleError::PeerNotListed { step: 0, peer: 1 })
        );
        s.steps = vec![Step {
            action: Action::Copy {
                src: Region::new(BufId::Input, 0, 2),
                dst: Region::new(BufId::Output, 0, 3),
            },
            deps: Vec::new(),
        }];
        assert_eq!(
            s.check(2),
            Err(ScheduleError::RegionLengthMismatch { step: 0 })
        );
        s.steps = vec![Step {
            action: Action::Copy {
                src: Region::new(BufId::Input, usize::MAX, 2),
                dst: Region::new(BufId::Output, 0, 2),
            },
            deps: Vec::new(),
        }];
        assert_eq!(s.check(2), Err(ScheduleError::RegionOverflow { step: 0 }));
    }

    #[test]
    fn ring_all_reduce_shape() {
        // 4 ranks, 8 elements, slices of 1: chunks of 2 elements, 2 slices per chunk,
        // 3 reduce-scatter + 3 all-gather steps, each 2 sends + 2 receives.
        let s = ring_all_reduce(1, 4, 8, 1).unwrap();
        assert_eq!(s.steps.len(), 6 * 4);
        assert_eq!(
            (s.send_peers.clone(), s.recv_peers.clone()),
            (vec![2], vec![0])
        );
        // Step 0 sends chunk 1 (elements 2..4) from Input.
        assert_eq!(
            s.steps[0].action,
            Action::Send {
                peer: 2,
                src: Region::new(BufId::Input, 2, 1)
            }
        );
        // The first receive reduces chunk 0 into Output.
        assert_eq!(
            s.steps[1].action,
            Action::RecvReduce {
                peer: 0,
                local: Region::new(BufId::Input, 0, 1),
                dst: Region::new(BufId::Output, 0, 1)
            }
        );
        // The second step's sends forward chunk 0 from Output, each after its slice arrived.
        assert_eq!(
            s.steps[4],
            Step {
                action: Action::Send {
                    peer: 2,
                    src: Region::new(BufId::Output, 0, 1)
                },
                deps: vec![1]
            }
        );
    }

    #[test]
    fn recursive_doubling_all_reduce_structure() {
        for n in 1..=16 {
            for count in COUNTS {
                for slice in SLICES {
                    let s: Vec<_> = (0..n)
                        .map(|r| recursive_doubling_all_reduce(r, n, count, slice).unwrap())
                        .collect();
                    let sizes: Vec<_> = (0..n)
                        .map(|_| Sizes {
                            input: count,
                            output: count,
                        })
                        .collect();
                    check_all(&s, &sizes, slice, true);
                    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
                    for (r, sched) in s.iter().enumerate() {
                        let want = if n > 1 && r < p { count } else { 0 };
                        assert_eq!(sched.scratch_elems, want, "n {n} rank {r}");
                        // Input is only ever read.
                        assert!(sched.steps.iter().all(|st| !matches!(
                            st.action,
                            Action::RecvCopy { dst, .. }
                                | Action::RecvReduce { dst, .. }
                                | Action::Copy { dst, .. } if dst.buf == BufId::Input
                        )));
                    }
                }
            }
        }
    }

    /// Sorted copies of a schedule's peer lists.
    fn peers(s: &Schedule) -> (Vec<usize>, Vec<usize>) {
        let (mut a, mut b) = (s.send_peers.clone(), s.recv_peers.clone());
        a.sort_unstable();
        b.sort_unstable();
        (a, b)
    }

    #[test]
    fn recursive_doubling_all_reduce_peers() {
        for count in [0, 5] {
            let rd = |r, n| recursive_doubling_all_reduce(r, n, count, 2).unwrap();
            // Two ranks: one round.
            assert_eq!(peers(&rd(0, 2)), (vec![1], vec![1]));
            assert_eq!(peers(&rd(1, 2)), (vec![0], vec![0]));
            // Four ranks: partners r ^ 1 and r ^ 2.
            let four = [vec![1, 2], vec![0, 3], vec![0, 3], vec![1, 2]];
            for (r, want) in four.iter().enumerate() {
                assert_eq!(peers(&rd(r, 4)), (want.clone(), want.clone()), "rank {r}");
            }
            // Six ranks: 4 and 5 fold into 0 and 1, which then run the four-rank rounds.
            let six = [
                vec![1, 2, 4],
                vec![0, 3, 5],
                vec![0, 3],
                vec![1, 2],
                vec![0],
                vec![1],
            ];
            for (r, want) in six.iter().enumerate() {
                assert_eq!(peers(&rd(r, 6)), (want.clone(), want.clone()), "rank {r}");
            }
        }
        let one = recursive_doubling_all_reduce(0, 1, 5, 2).unwrap();
        assert!(one.send_peers.is_empty() && one.recv_peers.is_empty());
        assert_eq!(one.scratch_elems, 0);
        assert_eq!(
            one.steps,
            [Step {
                action: Action::Copy {
                    src: Region::new(BufId::Input, 0, 5),
                    dst: Region::new(BufId::Output, 0, 5)
                },
                deps: Vec::new()
            }]
        );
        assert!(recursive_doubling_all_reduce(0, 1, 0, 2)
            .unwrap()
            .steps
            .is_empty());
        for n in 2..=9 {
            for r in 0..n {
                assert!(recursive_doubling_all_reduce(r, n, 0, 3)
                    .unwrap()
                    .steps
                    .is_empty());
            }
        }
    }

    #[test]
    fn recursive_doubling_all_reduce_shape() {
        // Two ranks, 4 elements, slices of 2: send Input, combine into Scratch (in place, Output
        // is the Input being sent), then copy each slice once it is combined and sent.
        let s = recursive_doubling_all_reduce(1, 2, 4, 2).unwrap();
        let send = |o| Action::Send {
            peer: 0,
            src: Region::new(BufId::Input, o, 2),
        };
        let recv = |o| Action::RecvReduce {
            peer: 0,
            local: Region::new(BufId::Input, o, 2),
            dst: Region::new(BufId::Scratch, o, 2),
        };
        let copy = |o| Action::Copy {
            src: Region::new(BufId::Scratch, o, 2),
            dst: Region::new(BufId::Output, o, 2),
        };
        let step = |action, deps: &[StepId]| Step {
            action,
            deps: deps.to_vec(),
        };
        assert_eq!(
            s.steps,
            [
                step(send(0), &[]),
                step(recv(0), &[]),
                step(send(2), &[]),
                step(recv(2), &[]),
                step(copy(0), &[1, 0]),
                step(copy(2), &[3, 2]),
            ]
        );
        // Three ranks: rank 0 folds rank 2 in (into Scratch, so its single round writes Output)
        // and sends the result from Output; rank 2 receives each slice after sending it.
        let s = recursive_doubling_all_reduce(0, 3, 2, 0).unwrap();
        assert_eq!(s.scratch_elems, 2);
        let region = |buf, o| Region::new(buf, o, 1);
        assert_eq!(
            s.steps[0].action,
            Action::RecvReduce {
                peer: 2,
                local: region(BufId::Input, 0),
                dst: region(BufId::Scratch, 0)
            }
        );
        assert_eq!(
            s.steps[2],
            step(
                Action::Send {
                    peer: 1,
                    src: region(BufId::Scratch, 0)
                },
                &[0]
            )
        );
        assert_eq!(
            s.steps[3],
            step(
                Action::RecvReduce {
                    peer: 1,
                    local: region(BufId::Scratch, 0),
                    dst: region(BufId::Output, 0)
                },
                &[0]
            )
        );
        assert_eq!(
            s.steps[6],
            step(
                Action::Send {
                    peer: 2,
                    src: region(BufId::Output, 0)
                },
                &[3]
            )
        );
        let s = recursive_doubling_all_reduce(2, 3, 2, 0).unwrap();
        assert_eq!(s.scratch_elems, 0);
        assert_eq!(
            s.steps[1],
            step(
                Action::RecvCopy {
                    peer: 0,
                    dst: region(BufId::Output, 0)
                },
                &[0]
            )
        );
    }

    #[test]
    fn recursive_doubling_all_reduce_invalid_arguments() {
        assert_eq!(
            recursive_doubling_all_reduce(0, 0, 5, 1),
            Err(ScheduleError::NoRanks)
        );
        assert_eq!(
            recursive_doubling_all_reduce(4, 4, 5, 1),
            Err(ScheduleError::RankOutOfRange { rank: 4, nranks: 4 })
        );
        assert!(matches!(
            recursive_doubling_all_reduce(0, usize::MAX, 5, 1),
            Err(ScheduleError::TooManyRanks { .. })
        ));
        // Large communicators and huge counts with few slices are fine.
        let s = recursive_doubling_all_reduce(MAX_RANKS - 1, MAX_RANKS, 3, 1).unwrap();
        assert_eq!(s.send_peers.len(), 24);
        let s = recursive_doubling_all_reduce(3, 5, usize::MAX, usize::MAX).unwrap();
        assert_eq!(s.steps.len(), 2 * 2);
        s.check(5).unwrap();
        let s = recursive_doubling_all_reduce(5, 6, usize::MAX, usize::MAX).unwrap();
        assert_eq!(s.steps.len(), 2);
    }
}
