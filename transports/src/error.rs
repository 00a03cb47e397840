//! Errors of the transport layer (the bootstrap store's own errors travel inside them).

use std::time::Duration;

/// A failure while moving bytes to or from a peer, or while bootstrapping.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The peer closed its end, its process died, or its socket reset.
    #[error("peer rank {peer} lost ({detail})")]
    PeerLost {
        /// The lost peer's rank.
        peer: usize,
        /// What was observed (closed, exited, reset).
        detail: String,
    },
    /// An operating-system call failed.
    #[error("{what}: {message}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error message.
        message: String,
    },
    /// A bootstrap or connection step did not finish in time.
    #[error("timed out after {after:?} while {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The limit that expired.
        after: Duration,
    },
    /// Ranks did not reach the bootstrap store within the set-up timeout (never started, or
    /// died or hung before joining).
    #[error(
        "ranks {missing:?}{} of {nranks} did not join within {after:?} (not started, or died or \
         hung before joining)",
        if *more > 0 { format!(" and {more} more") } else { String::new() }
    )]
    NotJoined {
        /// The first missing ranks (at most [`crate::mesh::MAX_NAMED_MISSING`]).
        missing: Vec<usize>,
        /// How many more are missing.
        more: usize,
        /// Ranks of the communicator.
        nranks: usize,
        /// The limit that expired.
        after: Duration,
    },
    /// A rank's process ended during the communicator's set-up: the store's host saw its
    /// connection close before it had joined, and ended every set-up wait with it.
    #[error(
        "rank {peer} died during set-up (its connection to the bootstrap store closed before it \
         joined)"
    )]
    DiedInSetup {
        /// The rank that died.
        peer: usize,
    },
    /// A peer sent something that breaks the protocol (bad magic, version, token, frame).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// Shared memory could not be set up (for example /dev/shm too small).
    #[error("shared memory: {0}")]
    SharedMemory(String),
    /// The process may not open the files (sockets, segments) this rank needs, even after
    /// raising its soft limit to the hard one.
    #[error(
        "needs {needed} open files but the limit is {soft} (hard limit {hard}): raise it \
         (`ulimit -n`, or LimitNOFILE for a service), or run fewer ranks per process"
    )]
    FileLimit { needed: u64, soft: u64, hard: u64 },
    /// A configuration value (an address, a combination of settings) is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A setting's value does not parse.
    #[error(transparent)]
    Setting(#[from] weftcc_settings::SettingError),
    /// The bootstrap store failed (timed out, closed, lost, refused): its own error, unchanged.
    #[error(transparent)]
    Store(#[from] weftcc_store::StoreError),
    /// A network provider (RDMA, libfabric) failed; `peer` where one connection was concerned.
    #[error("network{}: {source}", peer.map(|p| format!(" (rank {p})")).unwrap_or_default())]
    Net {
        /// The peer of the connection, if the failure concerned one.
        peer: Option<usize>,
        /// What the provider reported.
        source: crate::net::NetError,
    },
    /// The operation was aborted locally.
    #[error("aborted")]
    Aborted,
}

impl TransportError {
    /// Wraps an `std::io::Error` with a short description of what was being done.
    pub fn io(what: impl Into<String>, err: std::io::Error) -> Self {
        TransportError::Io {
            what: what.into(),
            message: err.to_string(),
        }
    }

    /// Like [`TransportError::io`] for an exchange with `peer`, except that a stream the peer
    /// closed or reset (its process failed or exited) is [`TransportError::PeerLost`]: the
    /// consequence of the peer's failure, not a failure of this rank.
    pub fn io_with(peer: usize, what: impl Into<String>, err: std::io::Error) -> Self {
        use std::io::ErrorKind;
        match err.kind() {
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                TransportError::PeerLost {
                    peer,
                    detail: format!("{}: {err}", what.into()),
                }
            }
            _ => TransportError::io(what, err),
        }
    }
}

impl From<weftcc_base::OsError> for TransportError {
    fn from(e: weftcc_base::OsError) -> Self {
        TransportError::io(e.what, e.source)
    }
}

impl From<weftcc_base::TimedOut> for TransportError {
    fn from(e: weftcc_base::TimedOut) -> Self {
        TransportError::Timeout {
            what: e.what,
            after: e.after,
        }
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, TransportError>;
