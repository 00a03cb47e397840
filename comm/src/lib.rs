//! weftcc's runtime: the [`Communicator`], which executes the pure schedules of
//! `weftcc-collectives` over the transports of `weftcc-transports`.
//!
//! One module per concept:
//!
//! | module | what |
//! |---|---|
//! | [`bootstrap`] | unique ids, rank 0's bootstrap store and how long it stays up |
//! | [`config`] | settings from `WEFT_*` variables |
//! | [`env`] | rank, size and rendezvous from the launcher (weft run, torchrun, SLURM, Open MPI) |
//! | `communicator` | construction, the blocking API, split |
//! | `handle` | the asynchronous API and its handles |
//! | `ordering` | issue order: tickets, the operation running now |
//! | `cache` | the tuner's choice and the prepared schedule of each call shape |
//! | `group` | grouped sends and receives |
//! | `failure` | poison, the job-wide failure protocol and its typed note |
//! | `engine` | executes one schedule over the connections (poll loop, no threads) |
//! | [`tuning`] | per-call algorithm choice from the cost model |
//! | [`error`] | the error type |
//! | [`progress`] | where each rank is, and who is behind when a collective times out |
//! | [`status`] | a running job read from outside its ranks (`weft status`) |
//! | `local` | [`run_ranks`]: ranks as threads of one process |
//! | `logging` | `WEFT_DEBUG` |

// One exception, in `engine`: a pinned receive lends the caller's buffer to the transport (a
// network peer may write it directly), which `Inner::execute` ends before the buffer goes back.
#![deny(unsafe_code)]

pub mod bootstrap;
mod cache;
mod communicator;
pub mod config;
mod engine;
pub mod env;
pub mod error;
mod failure;
mod group;
mod handle;
mod local;
mod logging;
mod ordering;
pub mod progress;
pub mod status;
pub mod trace;
pub mod trace_merge;
pub mod tuning;

pub use bootstrap::{join_host_port, UniqueId};
pub use communicator::Communicator;
pub use config::{Backoff, CommConfig};
pub use env::LaunchInfo;
pub use error::{AbortCause, Error, ErrorFacts, Result, SeenBy};
pub use group::Group;
pub use handle::Handle;
pub use local::run_ranks;
pub use progress::Behind;
pub use tuning::Tuner;

pub(crate) use weftcc_transports::lock;
