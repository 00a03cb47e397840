//! Transports for weftcc: how bytes move between two ranks.
//!
//! * [`Connection`] is the one trait every transport implements: a reliable, ordered, non-blocking
//!   byte stream to one peer, in both directions. The collectives engine drives it by polling
//!   ([`Connection::try_send`], [`Connection::try_recv`]) and sleeps through [`IdleWaiter`] when no
//!   connection can make progress.
//! * [`shm`]: ranks on the same host, through rings in shared memory with futex doorbells.
//! * [`tcp`]: ranks on different hosts (or with `WEFT_SHM_DISABLE=1`), through socket2 streams.
//! * [`mem`]: an in-process transport for tests (threads standing in for ranks).
//! * [`mesh`]: connects the ranks of a communicator when they first need each other, choosing
//!   the transport per pair; splits share their parent's connections. The ranks find each other
//!   through the bootstrap store (`weftcc-store`, a crate of its own below this one).
//! * [`mux`]: several communicators over one connection (frames per communicator).
//!
//! Settings read by this crate (through `weftcc-settings`, the one table of `WEFT_*`
//! variables): `WEFT_SOCKET_FAMILY` ([`tcp::Family::from_env`], read by
//! [`mesh::Mesh::establish`]), the shared-memory knobs (`WEFT_SHM_CMA*`, `WEFT_SHM_LL_MAX`),
//! the TCP striping ([`tcp_stripes::StripePlan::from_env`]) and the network choice
//! ([`net::NetChoice::from_env`]). The runtime reads the rest of the configuration
//! ([`MeshConfig`]) and passes it in.
//!
//! * [`limits`]: the open-files limit a rank's connections need, checked and raised.
//!
//! `unsafe` in this crate is confined to shared-memory mapping, atomics in shared memory and
//! futex/pidfd system calls; each block carries a `// SAFETY:` comment. (The launcher's signal
//! handler and pre-exec hook live with `weft run`, in the CLI binary.)

pub mod conn;
pub mod dial;
pub mod error;
pub mod host_table;
pub mod limits;
pub mod mem;
pub mod mesh;
pub mod mux;
pub mod net;
pub mod ring;
pub mod shm;
mod socket;
pub mod tcp;
pub mod tcp_stripes;
mod util;

pub use conn::{Connection, IdleWaiter, Interest, FAREWELL_MAX};
pub use error::TransportError;
pub use mesh::{ConnectError, ConnectMode, Mesh, MeshConfig};
pub use util::{fnv1a64, lock};
pub use weftcc_base::Deadline;
pub use weftcc_settings::{parse_size, InvalidSize};

/// A fresh random job token (32 hex characters) for launchers that start all ranks themselves.
pub fn random_token() -> error::Result<String> {
    util::random_hex(16)
}
