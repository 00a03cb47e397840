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
//! The crates behind this facade: [`collectives`] (the pure core: types, reductions, call
//! shapes, schedules and their simulator), [`comm`] (the runtime: the communicator and its
//! configuration, bootstrap, failure protocol and tuner), [`transports`] (the `Connection`
//! trait, shared memory, TCP), [`store`] (the bootstrap key-value store), [`topology`] and
//! [`cuda`] (device buffers, NVRTC kernels and CUDA IPC; builds and runs without CUDA).

#![forbid(unsafe_code)]

pub use weftcc_collectives as collectives;
pub use weftcc_collectives::{
    Algorithm, CallError, Combiner, DataType, Element, OpDesc, OpKind, RawOp, ReduceOp, HEADER_LEN,
};
pub use weftcc_comm as comm;
pub use weftcc_comm::{
    AbortCause, Agreement, Behind, CommConfig, Communicator, Error, Group, Handle, LaunchInfo,
    Result, SeenBy, Tuner, UniqueId,
};
pub use weftcc_cuda as cuda;
pub use weftcc_settings as settings;
pub use weftcc_store as store;
pub use weftcc_topology as topology;
pub use weftcc_topology::tuner::{Protocol, Selection};
pub use weftcc_transports as transports;
