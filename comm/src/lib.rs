//! weftcc's runtime: the [`Communicator`], which executes the pure schedules of
//! `weftcc-collectives` over the transports of `weftcc-transports`.
//!
//! One module per concept, in layers: each module imports only from the layers below it.
//!
//! | layer | module | what |
//! |---|---|---|
//! | records | [`records`] | store key names and record formats (progress, failure notes, identities, trace dumps): pure, shared with the readers in `weft status` / `weft trace` |
//! | settings | [`config`], [`env`], `logging` | settings from `WEFT_*` variables; rank, size and rendezvous from the launcher; `WEFT_DEBUG` |
//! | base | [`error`], [`tuning`], [`bootstrap`], `agreement`, `background` | the error type; per-call algorithm choice; unique ids and rank 0's store; the ranks' consistency check at set-up; helper threads stopped by their owner's drop |
//! | executor | `executor`, `one_shot` | runs one prepared schedule over the connections (poll loop, no threads; knows no communicator); runs a small collective among ranks that share memory through their outboxes |
//! | concerns | `ordering`, `cache`, `failure`, `progress`, [`trace`], `worker`, `lineage` | each owns its state: issue order (tickets), prepared schedules, the failure protocol, this rank's progress, the flight recorder, the async worker thread, the epoch and the shrinks and grows made so far |
//! | composition | `inner` | what a communicator shares with its threads, and one call's path through the concerns |
//! | threads | `watcher` | the failure watcher: publishes progress, reads the job's failures, answers dump requests |
//! | API | `communicator`, `group`, `handle`, `local`, `recovery` | construction, the blocking API and split; grouped sends and receives; the asynchronous API; [`run_ranks`] (ranks as threads); revoke, agreement, shrink and grow |
//! | over the API | [`doctor`] | every pair of ranks measured against its prediction and limits, with a verdict (`weft doctor`; `WEFT_RUN_DIAGNOSTICS` at set-up) |

// One exception, in `executor`: a pinned receive lends the caller's buffer to the transport (a
// network peer may write it directly), which `Inner::execute` ends before the buffer goes back.
#![deny(unsafe_code)]

mod agreement;
mod background;
pub mod bootstrap;
mod cache;
mod communicator;
pub mod config;
pub mod doctor;
pub mod env;
pub mod error;
mod executor;
mod failure;
mod group;
mod handle;
mod inner;
mod lineage;
mod local;
mod logging;
mod one_shot;
mod ordering;
mod progress;
pub mod records;
mod recovery;
pub mod trace;
pub mod tuning;
mod watcher;
mod worker;

pub use bootstrap::{join_host_port, serve_store, UniqueId};
pub use communicator::Communicator;
pub use config::{Backoff, CommConfig};
pub use env::LaunchInfo;
pub use error::{Error, ErrorFacts, Result, SeenBy};
pub use group::Group;
pub use handle::Handle;
pub use local::run_ranks;
/// Installs the `WEFT_DEBUG` logger (a communicator does when it is created; code that logs
/// before one exists, or without one, calls it itself).
pub use logging::init as init_logging;
pub use records::agreement::Disagreement;
pub use records::note::AbortCause;
pub use records::progress::Behind;
pub use records::recovery::{RecoveryEvent, RecoveryKind};
pub use recovery::Agreement;
pub use tuning::Tuner;
