//! Errors of the CUDA layer. Driver failures name the driver call; collective failures name the
//! rank, the operation and its sequence number, as the host communicator's errors do.

use std::ops::Range;
use std::time::Duration;
use weftcc_collectives::schedule::ScheduleError;
use weftcc_collectives::{CallError, OpKind};
use weftcc_comm::ErrorFacts;

/// Why a device call's arguments are wrong: the shape rules every path shares
/// ([`CallError`]), or what only device buffers can get wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceArgError {
    /// The call's shape (lengths, root, peer), as the host and the C ABI check it.
    #[error(transparent)]
    Call(#[from] CallError),
    /// A buffer lives on another GPU than the communicator's.
    #[error("buffer on device {buffer} but the communicator uses device {comm}")]
    BufferDevice { buffer: usize, comm: usize },
    /// The stream belongs to another GPU than the communicator's.
    #[error("stream of another device")]
    StreamDevice,
    /// The kind has no device implementation (barrier: use the host communicator).
    #[error("not a device collective")]
    NotDeviceCollective,
    /// `send_recv_parts` ranges out of bounds or overlapping.
    #[error(
        "parts {send:?} and {recv:?} of a buffer of {len} elements must be in bounds and disjoint"
    )]
    Parts {
        send: Range<usize>,
        recv: Range<usize>,
        len: usize,
    },
    /// No schedule exists for the call.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

/// A failure of the CUDA layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no NVIDIA driver on this
    /// machine, or it is not on the loader's path. Nothing was called.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The NVRTC library could not be loaded, so the reduction kernels cannot be compiled.
    #[error("no NVRTC library (needed to compile weftcc's reduction kernels): {0}")]
    NoNvrtc(String),
    /// A driver call failed.
    #[error("CUDA driver call {call} failed: {name} ({code})")]
    Driver {
        call: &'static str,
        code: i32,
        name: String,
    },
    /// NVRTC rejected the kernel source (a bug in weftcc): the compiler's log.
    #[error("NVRTC could not compile weftcc's kernels: {0}")]
    Compile(String),
    /// Wrong arguments (lengths, devices, roots); nothing was enqueued.
    #[error("rank {rank}: invalid argument to {op}: {reason}")]
    InvalidArgument {
        rank: usize,
        op: OpKind,
        reason: DeviceArgError,
    },
    /// A device operation did not finish within the timeout.
    #[error("rank {rank}: {op} #{seq} on the GPU did not finish within {after:?}")]
    Timeout {
        rank: usize,
        op: OpKind,
        seq: u64,
        after: Duration,
    },
    /// A collective failed (the host communicator's error, or a driver error on the proxy or
    /// executor), with the rank, operation and sequence number of the device call.
    #[error("rank {rank}: {op} #{seq} failed: {detail}")]
    Collective {
        rank: usize,
        op: OpKind,
        seq: u64,
        detail: String,
    },
    /// The host communicator failed (setup, handle exchange).
    #[error(transparent)]
    Host(#[from] weftcc_comm::Error),
    /// An earlier fatal error left this device communicator unusable.
    #[error("rank {rank}: device communicator unusable after an earlier error: {first}")]
    Poisoned { rank: usize, first: String },
    /// The GPUDirect RDMA ring failed (naming rank, operation and sequence number).
    #[error(transparent)]
    Gdr(Box<crate::gdr::GdrError>),
    /// A waiting operation's timeout or a limit that is not an argument error.
    #[error("{0}")]
    Other(String),
}

impl CudaError {
    /// True when the error only means "there is no CUDA here" (driver or NVRTC missing).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, CudaError::NoDriver(_) | CudaError::NoNvrtc(_))
    }

    /// The error's facts as typed fields (see [`weftcc_comm::Error::facts`]).
    pub fn facts(&self) -> ErrorFacts {
        match self {
            CudaError::InvalidArgument { rank, op, .. } => ErrorFacts {
                rank: Some(*rank),
                op: Some(*op),
                ..ErrorFacts::default()
            },
            CudaError::Timeout { rank, op, seq, .. }
            | CudaError::Collective { rank, op, seq, .. } => ErrorFacts {
                rank: Some(*rank),
                op: Some(*op),
                seq: Some(*seq),
                peer: None,
            },
            CudaError::Host(e) => e.facts(),
            CudaError::Gdr(e) => e.facts(),
            CudaError::Poisoned { rank, .. } => ErrorFacts {
                rank: Some(*rank),
                ..ErrorFacts::default()
            },
            CudaError::NoDriver(_)
            | CudaError::NoNvrtc(_)
            | CudaError::Driver { .. }
            | CudaError::Compile(_)
            | CudaError::Other(_) => ErrorFacts::default(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CudaError>;
