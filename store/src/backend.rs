//! What a store is to its clients: the primitive requests every store answers
//! ([`StoreBackend`]), and the view of a store that a session-closed rule acts on
//! ([`SessionStore`]).

use crate::error::Result;
use std::time::Duration;

/// A session as [`StoreClient::sessions`](crate::StoreClient::sessions) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Its name.
    pub key: String,
    /// What its client said about itself when it named the session.
    pub value: Vec<u8>,
    /// Whether its client is still there (the built-in store: its connection is open; etcd: its
    /// lease has not expired).
    pub open: bool,
    /// Open: time since the client was last heard from. Closed: time since it closed (etcd: since
    /// it was last heard from, by the clocks of the client and the reader).
    pub idle: Duration,
}

/// One store behind a [`StoreClient`](crate::StoreClient): the primitive requests, each answered
/// by one round trip where the store allows it. The front end adds what is the same for every
/// store: splitting large [`StoreBackend::get_all`]s, barriers, default timeouts and the wording
/// of timeouts. Every call returns within its wait plus a margin for the network.
pub trait StoreBackend: Send {
    /// Stores `value` under `key`, giving up on the answer after about `wait`.
    fn set(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<()>;
    /// The value of `key`, waiting up to `wait` for it to be set
    /// ([`StoreError::Timeout`](crate::StoreError::Timeout) when it was not).
    fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>>;
    /// Waits up to `wait` until every key of `keys` is set.
    fn wait(&mut self, keys: &[&str], wait: Duration) -> Result<()>;
    /// Waits up to `wait` until every key of `keys` is set and returns their values in order, in
    /// one request. A request or answer too large for the store is
    /// [`StoreError::TooLarge`](crate::StoreError::TooLarge) (the front end asks again in halves).
    /// With `unless`, the wait ends as soon as that key is set (or is already):
    /// [`StoreError::Interrupted`](crate::StoreError::Interrupted) with its value (its `key` is
    /// filled in by the front end).
    fn get_all(
        &mut self,
        keys: &[String],
        unless: Option<&str>,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>>;
    /// Most keys one [`StoreBackend::get_all`] may carry (the front end splits longer lists).
    fn max_keys_per_request(&self) -> usize {
        usize::MAX
    }
    /// Adds `delta` to the decimal counter `key` (missing counts as 0) atomically; the new value.
    fn add(&mut self, key: &str, delta: i64, wait: Duration) -> Result<i64>;
    /// Stores `value` under `key` unless `key` is set already, atomically; the value `key` holds
    /// afterwards (this one, or the first writer's): the first writer wins, whoever asks.
    fn set_if_absent(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<Vec<u8>>;
    /// Whether `key` is set (no wait).
    fn check(&mut self, key: &str) -> Result<bool>;
    /// Removes `key`; whether it existed.
    fn delete(&mut self, key: &str) -> Result<bool>;
    /// Makes this client the session `key` (taking it over from any other holder), `value`
    /// saying who the client is; naming it again updates `value`.
    fn name_session(&mut self, key: &str, value: &[u8]) -> Result<()>;
    /// Every session whose name starts with `prefix`, by name.
    fn sessions(&mut self, prefix: &str) -> Result<Vec<SessionInfo>>;
    /// The store this client talks to, for errors and logs (an address, etcd's endpoints).
    fn describe(&self) -> String;
    /// The one address of the store, where it has one.
    fn socket_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }
    /// The client's default timeout changed: the margin a request may take beyond its own wait.
    fn set_timeout(&mut self, timeout: Duration);
    /// Whether the store itself runs a session-closed hook (the built-in server does; etcd
    /// cannot, so its clients act on closed sessions themselves).
    fn runs_session_hooks(&self) -> bool;
}

/// The store as a rule about a closed session sees it: the built-in server's data under its lock
/// ([`LocalStore`](crate::LocalStore)), or a client of any store
/// ([`StoreClient`](crate::StoreClient)) where the store runs no hooks of its own. Over a client,
/// a failure to reach the store reads as "set" and "not added", so that a rule that publishes
/// only what is not set yet publishes nothing from a failed read.
pub trait SessionStore {
    /// Whether `key` is set.
    fn contains(&mut self, key: &str) -> bool;
    /// Stores `value` under `key`.
    fn set(&mut self, key: &str, value: &[u8]);
    /// Adds `delta` to the counter `key`; `None` when it is not a counter (or unreachable).
    fn add(&mut self, key: &str, delta: i64) -> Option<i64>;
}

impl SessionStore for crate::LocalStore<'_> {
    fn contains(&mut self, key: &str) -> bool {
        crate::LocalStore::contains(self, key)
    }
    fn set(&mut self, key: &str, value: &[u8]) {
        crate::LocalStore::set(self, key, value)
    }
    fn add(&mut self, key: &str, delta: i64) -> Option<i64> {
        crate::LocalStore::add(self, key, delta)
    }
}

impl SessionStore for crate::StoreClient {
    fn contains(&mut self, key: &str) -> bool {
        self.check(key).unwrap_or(true)
    }
    fn set(&mut self, key: &str, value: &[u8]) {
        let _ = crate::StoreClient::set(self, key, value);
    }
    fn add(&mut self, key: &str, delta: i64) -> Option<i64> {
        crate::StoreClient::add(self, key, delta).ok()
    }
}
