//! Errors of the CUDA layer. Driver failures name the driver call; collective failures name the
//! rank, the operation and its sequence number, as the host communicator's errors do.

use std::time::Duration;
use weftcc_collectives::OpKind;

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
        reason: String,
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
    Host(#[from] weftcc_collectives::Error),
    /// An earlier fatal error left this device communicator unusable.
    #[error("rank {rank}: device communicator unusable after an earlier error: {first}")]
    Poisoned { rank: usize, first: String },
    /// A waiting operation's timeout or a limit that is not an argument error.
    #[error("{0}")]
    Other(String),
}

impl CudaError {
    /// True when the error only means "there is no CUDA here" (driver or NVRTC missing).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, CudaError::NoDriver(_) | CudaError::NoNvrtc(_))
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CudaError>;
