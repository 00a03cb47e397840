//! weftcc: collective communication for training on many processes, GPUs and machines — an
//! alternative to NCCL that also runs well on plain CPUs.
//!
//! ```no_run
//! use weftcc::{Communicator, ReduceOp};
//! # fn main() -> weftcc::Result<()> {
//! // Started by `weft run -n 4 -- prog`, torchrun, srun or mpirun:
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
//! # Ok(())
//! # }
//! ```
//!
//! The crates behind this facade: [`collectives`] (types, reductions, schedules, the
//! communicator), [`transports`] (the `Connection` trait, shared memory, TCP, bootstrap) and
//! [`cuda`] (device buffers, NVRTC kernels and CUDA IPC; builds and runs without CUDA).

pub use weftcc_collectives as collectives;
pub use weftcc_collectives::*;
pub use weftcc_cuda as cuda;
pub use weftcc_transports as transports;
