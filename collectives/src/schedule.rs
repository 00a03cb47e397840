//! Algorithms as pure schedules.
//!
//! A [`Schedule`] is what one rank does for one collective: a list of [`Step`]s (send a region,
//! receive a region and copy or reduce it in, copy locally) with explicit dependencies. It is
//! computed from (rank, nranks, count, slice size) alone and performs no I/O, so tests execute
//! schedules of every rank in memory (see [`crate::sim`]) and the communicator's engine executes
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
