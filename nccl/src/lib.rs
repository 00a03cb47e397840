//! weftcc as an NCCL drop-in: `libnccl.so.2`, exporting NCCL's C API (as of 2.2x, and the
//! later calls as "not implemented") over weftcc's C ABI (`weftcc-bindings`), so that programs
//! and frameworks that call `nccl*` (PyTorch's ProcessGroupNCCL, JAX/XLA, `cudarc::nccl`,
//! nccl-tests) run on weftcc when this library is found first (`LD_LIBRARY_PATH`,
//! `LD_PRELOAD`). docs/nccl-dropin.md is the user's guide and lists every symbol's status.
//!
//! This crate is the one home of the translation, and only translates: NCCL's handle, unique
//! id, config and result codes to weftcc's, and NCCL's group semantics (collectives, sends and
//! receives, inits and splits collected between `ncclGroupStart` and `ncclGroupEnd`, one
//! communicator per thread at the end so that one process can drive several ranks). Every
//! check of arguments (types, operations, ranks, buffers) is weftcc's, through the `weft*`
//! call each `nccl*` call becomes; this layer checks only what is its own (the config struct,
//! the handle's state).
//!
//! Host buffers work as in weftcc's C ABI (a NULL `cudaStream_t`: the call returns when the
//! operation completed on this rank); with a stream, the call enqueues on it (weftcc's device
//! path). Errors never crash: a failure is a result code and `ncclGetLastError`'s message, and
//! a call this library does not implement returns `ncclInvalidUsage` naming the call.
//!
//! `NCCL_*` environment variables with a `WEFT_*` twin are honoured in processes that use this
//! library (`weftcc_settings::honour_nccl_twins`), the `WEFT_*` one winning.

// The exported names are C's (NCCL's): `ncclResult_t`, `ncclSuccess`, `ncclAllReduce`.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

mod comm;
mod errors;
mod extras;
mod group;
mod handle;
mod init;
mod ops;
mod types;

pub use comm::*;
pub use errors::*;
pub use extras::*;
pub use group::*;
pub use handle::{ncclComm, ncclComm_t};
pub use init::*;
pub use ops::*;
pub use types::*;
