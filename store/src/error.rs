//! The store's errors.

use std::net::SocketAddr;
use std::time::Duration;

/// A failure of the bootstrap store, as its server or a client sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A request did not get its answer in time: a key or keys not set within the wait, or no
    /// store to connect to.
    #[error("timed out after {after:?} while {what}")]
    Timeout {
        /// What was being waited for (the key, keys or address).
        what: String,
        /// The limit that expired.
        after: Duration,
    },
    /// A wait ended because its interrupting key was set ([`StoreClient::get_all_unless`]):
    /// something (a rank's death during set-up) makes waiting on pointless.
    ///
    /// [`StoreClient::get_all_unless`]: crate::StoreClient::get_all_unless
    #[error("waiting in the bootstrap store ended by {key:?}")]
    Interrupted {
        /// The interrupting key.
        key: String,
        /// Its value.
        value: Vec<u8>,
    },
    /// The store was shut down cleanly by its owner (not a failure): every pending and later
    /// request of the client gets this.
    #[error("bootstrap store closed")]
    Closed,
    /// A store answer would not fit one frame even for a single key.
    #[error(
        "the bootstrap store's answer for {keys} key(s) would be {bytes} bytes, over its \
         {limit}-byte frame limit"
    )]
    TooLarge {
        /// Keys asked for.
        keys: usize,
        /// Size of the answer.
        bytes: u64,
        /// The frame limit.
        limit: usize,
    },
    /// The store at `addr` refused the job token the client presented.
    #[error("the bootstrap store at {addr} refused our job token")]
    Refused {
        /// The store's address.
        addr: SocketAddr,
    },
    /// The store refused the request itself (a counter that is not one, too many sessions).
    #[error("store error: {0}")]
    Rejected(String),
    /// The connection to the store broke (its host died, or it sent garbage); the client is
    /// unusable from then on.
    #[error("bootstrap store connection lost ({detail})")]
    Lost {
        /// What was observed.
        detail: String,
    },
    /// The etcd cluster serving as the store could not be reached at any of its endpoints in
    /// time, or refused a request.
    #[error("etcd at {endpoint}: {detail}")]
    Etcd {
        /// The endpoint (`host:port`) last tried, or every endpoint when none answered.
        endpoint: String,
        /// What was observed.
        detail: String,
    },
    /// The store's handshake or answer breaks the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// An operating-system call failed (a socket, a thread).
    #[error("{what}: {message}")]
    Io {
        /// What was being done.
        what: String,
        /// The system's error message.
        message: String,
    },
    /// An argument the store cannot take: an address without a port, a token or request over
    /// its limits.
    #[error("configuration: {0}")]
    Config(String),
}

impl StoreError {
    /// Wraps an `std::io::Error` with a short description of what was being done.
    pub fn io(what: impl Into<String>, err: std::io::Error) -> Self {
        StoreError::Io {
            what: what.into(),
            message: err.to_string(),
        }
    }
}

impl From<weftcc_base::OsError> for StoreError {
    fn from(e: weftcc_base::OsError) -> Self {
        StoreError::io(e.what, e.source)
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, StoreError>;
