//! weftcc's pure core: data types and reduction kernels, the shape rules of every call, the
//! algorithm schedules and an in-memory simulator that runs them.
//!
//! Nothing here performs I/O: no sockets, files, threads, clocks, environment or randomness
//! (a Cargo fact: the crate depends on no I/O crate). The runtime (`weftcc-comm`) executes these
//! schedules over the transports; the CUDA path (`weftcc-cuda`) executes the same schedules on
//! GPUs; the C ABI validates calls with the same [`call`] rules.

#![forbid(unsafe_code)]

pub mod algorithm;
#[macro_use]
mod codes;
pub mod call;
pub mod dtype;
mod half_simd;
pub mod header;
pub mod name;
pub mod op;
pub mod reduce;
pub mod schedule;
#[doc(hidden)]
pub mod testing;
pub mod tiers;

pub use algorithm::Algorithm;
pub use call::{CallError, RawOp};
pub use dtype::{DataType, Element};
/// The half-precision types [`half::f16`] and [`half::bf16`] (for [`with_element!`]).
pub use half;
pub use header::{OpDesc, HEADER_LEN};
pub use name::UnknownName;
pub use op::{Combiner, OpKind, ReduceOp};
