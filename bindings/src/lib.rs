//! The C ABI of weftcc: `libweft.so` / `libweft.a` and the header `include/weftcc.h`
//! (generated from this crate by cbindgen, starting at this file; `tests/header.rs` fails when it
//! is stale).
//!
//! It follows NCCL's API shape so that porting is a rename: an opaque communicator created from
//! a unique id (`weftGetUniqueId` on one process, shared by the program, then
//! `weftCommInitRank` on every rank) or from the launcher's environment (`weftCommInitFromEnv`:
//! `weft run`, torchrun, SLURM); collectives with NCCL's argument order and in-place
//! conventions; `weftSend`/`weftRecv` between `weftGroupStart`/`weftGroupEnd`; a result code
//! per call and `weftGetLastError` for the message. Data types and reduction operations use
//! NCCL's numbering.
//!
//! Every collective and send/recv takes a last `weftStream_t` (NCCL's `cudaStream_t`): NULL for
//! host buffers, the call then blocking until the operation completed on this rank (the host
//! communicator's semantics); a stream for device buffers, the call enqueuing the operation on
//! it (`weftcc-cuda`'s `DeviceComm`, made by the first such call on the buffer's GPU, over CUDA
//! IPC, staged, or both across hosts). The library always has the device path: libcuda is
//! loaded at run time, and without it a call with a stream returns `weftUnhandledCudaError`.
//!
//! Every entry point rejects null pointers, unknown types, operations and ranks, and
//! overlapping buffers with `weftInvalidArgument` instead of crashing; a Rust panic never
//! crosses the boundary (it becomes `weftInternalError`).

// The exported names are C's (NCCL's style): `weftResult_t`, `weftSuccess`, `weftAllReduce`.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

// cbindgen writes constants and functions in the order it reads them, module by module in the
// order declared here: this order (kept from rustfmt's sorting by the blank lines) is the
// header's. Moving a module changes include/weftcc.h.

mod codes;

mod version;

mod init;

mod config;

mod redops;

mod communicators;

mod recovery;

mod errors;

mod collectives;

mod groups;

// No constants or functions of the header (its types go where cbindgen finds them used).
mod boundary;
mod device;
mod handle;

pub use boundary::guarded;
pub use codes::*;
pub use collectives::*;
pub use communicators::*;
pub use config::*;
pub use device::*;
pub use errors::*;
pub use groups::*;
pub use handle::*;
pub use init::*;
pub use recovery::*;
pub use redops::*;
pub use version::*;
