//! weftcc's safe core: data types and reductions, algorithm schedules, and the communicator that
//! executes them over the transports of `weftcc-transports`.
//!
//! This crate contains no `unsafe` and performs no system calls of its own: every byte that
//! leaves the process goes through the [`weftcc_transports::Connection`] trait.

#![forbid(unsafe_code)]

pub mod comm;
pub mod dtype;
pub mod engine;
pub mod env;
pub mod error;
mod half_simd;
pub mod header;
pub mod hierarchical;
pub mod logging;
pub mod op;
pub mod reduce;
pub mod schedule;
pub mod sim;
pub mod tree;
pub mod tuning;

pub use comm::{CommConfig, Communicator, Group, Handle, RawOp, UniqueId};
pub use dtype::{DataType, Element};
pub use env::LaunchInfo;
pub use error::{Error, Result};
pub use header::{OpDesc, HEADER_LEN};
pub use op::{Combiner, OpKind, ReduceOp};
pub use tuning::{Choice, Tuner};
pub use weftcc_topology::tuner::{Algorithm, Protocol, Selection};
