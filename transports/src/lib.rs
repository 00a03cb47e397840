//! Transports for weftcc: how bytes move between two ranks.
//!
//! * [`Connection`] is the one trait every transport implements: a reliable, ordered, non-blocking
//!   byte stream to one peer, in both directions. The collectives engine drives it by polling
//!   ([`Connection::try_send`], [`Connection::try_recv`]) and sleeps through [`IdleWaiter`] when no
//!   connection can make progress.
//! * [`shm`]: ranks on the same host, through rings in shared memory with futex doorbells.
//! * [`tcp`]: ranks on different hosts (or with `WEFT_SHM_DISABLE=1`), through socket2 streams.
//! * [`mem`]: an in-process transport for tests (threads standing in for ranks).
//! * [`store`]: the bootstrap key-value store served by rank 0, and its client.
//! * [`mesh`]: connects every pair of ranks of a communicator, choosing the transport per pair.
//!
//! `unsafe` in this crate is confined to shared-memory mapping, atomics in shared memory and
//! futex/pidfd system calls; each block carries a `// SAFETY:` comment.

pub mod conn;
pub mod error;

pub use conn::{Connection, IdleWaiter, Interest};
pub use error::TransportError;
