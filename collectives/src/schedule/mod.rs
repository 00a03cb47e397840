//! Algorithms as pure schedules.
//!
//! A [`Schedule`] is what one rank does for one collective: a list of [`Step`]s (send a region,
//! receive a region and copy or reduce it in, copy locally) with explicit dependencies. It is
//! computed from a [`Part`] (rank, nranks, count, slice size) alone and performs no I/O, so tests execute
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
//!
//! The builders: the flat ones (`flat`: [`ring_all_reduce`] and the other ring schedules, the
//! chains of the rooted collectives, recursive doubling and halving, the dissemination barrier,
//! [`pairwise_all_to_all`]), [`tree`], [`hierarchical`],
//! point-to-point groups ([`p2p`]), the deterministic reductions ([`ordered`]); [`select`] maps an [`Algorithm`](crate::Algorithm) to them;
//! [`layout`] maps a schedule's buffers onto memory; [`sim`] executes schedules in memory.

mod build;
mod flat;
pub mod hierarchical;
pub mod layout;
pub mod ordered;
pub mod p2p;
pub mod select;
pub mod sim;
pub mod tree;

pub use flat::{
    chain_broadcast, chain_reduce, dissemination_barrier, pairwise_all_to_all,
    recursive_doubling_all_gather, recursive_doubling_all_reduce, recursive_halving_reduce_scatter,
    ring_all_gather, ring_all_reduce, ring_reduce_scatter,
};
pub use select::{select, Collective};

/// One rank's part in a collective: what every builder takes (the rooted ones take the root
/// beside it). Named fields, so the four counts cannot be swapped silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub rank: usize,
    pub nranks: usize,
    /// Elements per rank, as in the call.
    pub count: usize,
    /// The largest message, in elements.
    pub slice_elems: usize,
}

impl Part {
    /// `(rank, nranks, count, slice_elems)`, for a builder's body.
    pub(crate) const fn fields(self) -> (usize, usize, usize, usize) {
        (self.rank, self.nranks, self.count, self.slice_elems)
    }
}

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

    /// The `len` elements `offset` elements into this region.
    pub(crate) const fn part(self, offset: usize, len: usize) -> Self {
        Region::new(self.buf, self.offset + offset, len)
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
    /// Point-to-point calls have no collective schedule (see [`p2p`]).
    #[error("{kind} is not a collective")]
    NotCollective { kind: crate::op::OpKind },
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

#[cfg(test)]
mod tests;
