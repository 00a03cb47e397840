//! Errors of the communicator. Every message names this rank, the operation and its sequence
//! number, so a log line from any rank of a large job says where it came from.

use crate::records::agreement::Disagreement;
use crate::records::note::AbortCause;
use std::time::Duration;
use weftcc_collectives::{CallError, OpDesc, OpKind};
use weftcc_transports::TransportError;

/// A failure of a communicator or one of its operations.
///
/// Fatal errors (everything except [`Error::InvalidArgument`] and [`Error::Config`]) poison the
/// communicator: every later call fails at once with the same error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The call's arguments are wrong (buffer lengths, root or peer out of range, send to self).
    /// Nothing was sent; the communicator stays usable.
    #[error("rank {rank}: invalid argument to {op}: {reason}")]
    InvalidArgument {
        rank: usize,
        op: OpKind,
        reason: CallError,
    },
    /// An operation did not finish within the communicator's timeout.
    #[error(
        "rank {rank}: {seen_by}{op} #{seq} timed out after {after:?}; still waiting on ranks \
         {waiting_on:?}{}",
        behind.iter().map(|b| format!("; {}", b.describe(*op, *seq))).collect::<String>()
    )]
    Timeout {
        rank: usize,
        op: OpKind,
        seq: u64,
        /// The ranks the timed-out rank still had data to exchange with.
        waiting_on: Vec<usize>,
        after: Duration,
        /// The rank whose operation timed out: this one, or another whose report this rank
        /// adopted (`waiting_on` and `behind` are then that rank's).
        seen_by: SeenBy,
        /// For a collective: the ranks that had not entered it, furthest behind first (read
        /// from every rank's published progress, [`crate::progress`]).
        behind: Vec<crate::records::progress::Behind>,
    },
    /// Peer rank `peer` died or closed its connections.
    #[error("rank {rank}: peer rank {peer} lost during {op} #{seq}: {seen_by}{detail}")]
    PeerLost {
        rank: usize,
        peer: usize,
        op: OpKind,
        seq: u64,
        /// Who saw the loss: this rank, another rank (whose report this rank adopted), or
        /// this rank's watcher of the bootstrap store.
        seen_by: SeenBy,
        detail: String,
    },
    /// The job's bootstrap store, served apart from the ranks (by the launcher, `weft store
    /// serve` or an etcd cluster), could not be reached: the job's meeting point is gone. (Where
    /// rank 0 serves it, its loss is rank 0's: [`Error::PeerLost`] of rank 0.)
    #[error(
        "rank {rank}: the job's bootstrap store at {store} was lost during {op} #{seq}: {detail}"
    )]
    StoreLost {
        rank: usize,
        /// The store's address.
        store: String,
        op: OpKind,
        seq: u64,
        detail: String,
    },
    /// `abort()` was called on this communicator, or another rank failed and aborted the job.
    #[error("rank {rank}: communicator aborted: {}{reason}", by.map(|b| format!("rank {b} failed: ")).unwrap_or_default())]
    Aborted {
        rank: usize,
        /// The rank that aborted or failed first, when another rank did.
        by: Option<usize>,
        /// What happened (on rank `by`, when set: its error as it reported it).
        reason: String,
        /// Why: `abort()` was called, or rank `by` found mismatched collectives or failed
        /// otherwise.
        cause: AbortCause,
        /// The operation (kind, sequence number) in which the abort was called or rank `by`
        /// failed, when there was one.
        during: Option<(OpKind, u64)>,
    },
    /// The communicator was revoked ([`Communicator::revoke`](crate::Communicator::revoke)) on
    /// this rank or on rank `by`: every pending and later operation fails with this, and the
    /// communicator stays for [`Communicator::agree_on_failures`](crate::Communicator::agree_on_failures)
    /// and [`Communicator::shrink`](crate::Communicator::shrink).
    #[error("rank {rank}: communicator revoked{}{}", by.map(|b| format!(" by rank {b}")).unwrap_or_default(), during.map(|(k, s)| format!(" during {k} #{s}")).unwrap_or_default())]
    Revoked {
        rank: usize,
        /// The rank that revoked it, when another rank did.
        by: Option<usize>,
        /// The operation running where it was revoked, if any.
        during: Option<(OpKind, u64)>,
    },
    /// This rank is among the ranks the survivors agreed had failed (or that the caller
    /// excluded), so it has no place in the communicator being made.
    #[error("rank {rank}: excluded from the communicator made at epoch {epoch} (agreed failed or excluded by the caller)")]
    Excluded { rank: usize, epoch: u64 },
    /// Ranks called different collectives (kind, type, count, reduction or root differ).
    #[error(
        "rank {rank}: mismatched collectives: this rank called {ours}, rank {peer} called {theirs}"
    )]
    Mismatch {
        rank: usize,
        peer: usize,
        ours: OpDesc,
        theirs: OpDesc,
    },
    /// A transport failed in a way other than losing the peer.
    #[error("rank {rank}: transport error with rank {peer} during {op} #{seq}: {source}")]
    Transport {
        rank: usize,
        peer: usize,
        op: OpKind,
        seq: u64,
        source: TransportError,
    },
    /// Setting the communicator up failed (rendezvous, connections).
    #[error("rank {rank}: bootstrap failed: {source}")]
    Bootstrap { rank: usize, source: TransportError },
    /// The ranks were started with settings, or library versions, that must agree and do not
    /// (found when the communicator is made; every rank fails with the same list).
    #[error(
        "rank {rank}: the ranks must agree on these and do not: {}",
        disagreements.iter().map(ToString::to_string).collect::<Vec<_>>().join(" | ")
    )]
    Inconsistent {
        rank: usize,
        /// Each setting or property that differs, with every value and its ranks.
        disagreements: Vec<Disagreement>,
    },
    /// `WEFT_RUN_DIAGNOSTICS=FAIL`: a pair of ranks measured at set-up was below
    /// `WEFT_DIAGNOSTICS_BELOW` % of the job's typical pair of its kind (every rank fails alike).
    #[error("rank {rank}: diagnostics at set-up: rank {a} ↔ rank {b} at {percent:.0} % of the typical pair (below {below} %): {verdict}")]
    Diagnostics {
        rank: usize,
        /// The slowest pair.
        a: usize,
        b: usize,
        percent: f64,
        below: f64,
        verdict: String,
    },
    /// The environment or configuration is incomplete or invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A setting's value does not parse (it names the variable, the value and what it takes).
    #[error("configuration: {0}")]
    Setting(#[from] weftcc_settings::SettingError),
    /// An invariant of weftcc itself broke (a bug): reported instead of panicking.
    #[error("rank {rank}: internal error during {op} #{seq}: {reason}")]
    Internal {
        rank: usize,
        op: OpKind,
        seq: u64,
        reason: String,
    },
}

/// Where an error happened, as typed fields ([`Error::facts`]); `None` where the error does not
/// say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorFacts {
    /// The rank reporting the error.
    pub rank: Option<usize>,
    /// The other rank it is about: the peer lost, mismatched or failing on the wire, the rank
    /// that aborted or failed first, or (a timeout) the rank furthest behind.
    pub peer: Option<usize>,
    /// The operation.
    pub op: Option<OpKind>,
    /// The operation's sequence number.
    pub seq: Option<u64>,
}

/// Who saw a peer's loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeenBy {
    /// This rank, on its own connection to the peer.
    ThisRank,
    /// Another rank, which published the loss; this rank adopted its report.
    Rank(usize),
    /// This rank's watcher: the bootstrap store (on rank 0) stopped answering.
    Watcher,
    /// The bootstrap store: the peer's connection to it closed (its process went).
    Store,
}

impl std::fmt::Display for SeenBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SeenBy::ThisRank => Ok(()),
            SeenBy::Rank(r) => write!(f, "reported by rank {r}: "),
            SeenBy::Watcher => f.write_str("reported by the watcher: "),
            SeenBy::Store => f.write_str("reported by the bootstrap store: "),
        }
    }
}

impl Error {
    /// A short name of the error's kind (flight-recorder entries, logs).
    pub fn kind_name(&self) -> &'static str {
        match self {
            Error::InvalidArgument { .. } => "invalid-argument",
            Error::Timeout { .. } => "timeout",
            Error::PeerLost { .. } => "peer-lost",
            Error::StoreLost { .. } => "store-lost",
            Error::Aborted { .. } => "aborted",
            Error::Revoked { .. } => "revoked",
            Error::Excluded { .. } => "excluded",
            Error::Mismatch { .. } => "mismatch",
            Error::Transport { .. } => "transport",
            Error::Bootstrap { .. } => "bootstrap",
            Error::Inconsistent { .. } => "inconsistent",
            Error::Diagnostics { .. } => "diagnostics",
            Error::Config(_) | Error::Setting(_) => "config",
            Error::Internal { .. } => "internal",
        }
    }

    /// The error's facts as typed fields, for callers that must not parse the message (the C
    /// ABI's `weftGetLastErrorInfo`, the Python exceptions).
    pub fn facts(&self) -> ErrorFacts {
        let facts = |rank, peer, op, seq| ErrorFacts {
            rank: Some(rank),
            peer,
            op: Some(op),
            seq,
        };
        match self {
            Error::InvalidArgument { rank, op, .. } => facts(*rank, None, *op, None),
            // The rank furthest behind is the one to look at; else the first still waited on.
            Error::Timeout {
                rank,
                op,
                seq,
                waiting_on,
                behind,
                ..
            } => {
                let culprit = behind
                    .first()
                    .map(|b| b.rank)
                    .or(waiting_on.first().copied());
                facts(*rank, culprit, *op, Some(*seq))
            }
            Error::PeerLost {
                rank,
                peer,
                op,
                seq,
                ..
            }
            | Error::Transport {
                rank,
                peer,
                op,
                seq,
                ..
            } => facts(*rank, Some(*peer), *op, Some(*seq)),
            Error::Mismatch {
                rank, peer, ours, ..
            } => facts(*rank, Some(*peer), ours.kind, Some(ours.seq)),
            Error::Internal { rank, op, seq, .. } | Error::StoreLost { rank, op, seq, .. } => {
                facts(*rank, None, *op, Some(*seq))
            }
            Error::Aborted {
                rank, by, during, ..
            } => ErrorFacts {
                rank: Some(*rank),
                peer: *by,
                op: during.map(|(k, _)| k),
                seq: during.map(|(_, s)| s),
            },
            Error::Revoked { rank, by, during } => ErrorFacts {
                rank: Some(*rank),
                peer: *by,
                op: during.map(|(k, _)| k),
                seq: during.map(|(_, s)| s),
            },
            Error::Bootstrap { rank, .. } | Error::Excluded { rank, .. } => ErrorFacts {
                rank: Some(*rank),
                ..ErrorFacts::default()
            },
            // The first rank that differs from most.
            Error::Inconsistent {
                rank,
                disagreements,
            } => ErrorFacts {
                rank: Some(*rank),
                peer: disagreements
                    .first()
                    .and_then(|d| d.odd_ranks().first().copied()),
                ..ErrorFacts::default()
            },
            Error::Diagnostics { rank, a, b, .. } => ErrorFacts {
                rank: Some(*rank),
                peer: Some(if a == rank { *b } else { *a }),
                ..ErrorFacts::default()
            },
            Error::Config(_) | Error::Setting(_) => ErrorFacts::default(),
        }
    }

    /// What another communicator ended because of this error says it was
    /// ([`Communicator::abort_because`](crate::Communicator::abort_because)): a mismatch stays
    /// a mismatch, an abort keeps its cause.
    pub fn abort_cause(&self) -> AbortCause {
        match self {
            Error::Mismatch { .. } => AbortCause::Mismatch,
            Error::Aborted { cause, .. } => *cause,
            Error::Revoked { .. } => AbortCause::Revoked,
            _ => AbortCause::Failed,
        }
    }

    /// True for errors that leave the communicator unusable.
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            Error::InvalidArgument { .. } | Error::Config(_) | Error::Setting(_)
        )
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
