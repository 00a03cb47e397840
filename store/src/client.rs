//! The front end every user of a store holds: [`StoreClient`], over the store its address names
//! (the built-in store for `host:port`, etcd for `etcd://host:port[,host:port…]`).

use crate::backend::{SessionInfo, StoreBackend};
use crate::error::{Result, StoreError};
use crate::etcd::{EtcdBackend, ETCD_SCHEME};
use crate::tcp::TcpBackend;
use std::net::SocketAddr;
use std::time::Duration;
use weftcc_base::Deadline;

/// A client of the bootstrap store. Every call has a timeout.
pub struct StoreClient {
    backend: Box<dyn StoreBackend>,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to the store at `addr` and presents `token`, retrying until `timeout` while the
    /// store is not up yet. `addr` is `"host:port"` or `"[v6]:port"` (host names are resolved)
    /// for the built-in store, `"etcd://host:port[,host:port…]"` for an etcd cluster (the job's
    /// keys then live under a prefix made of `token`). `timeout` is also the default timeout of
    /// later calls that take none.
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<StoreClient> {
        let backend: Box<dyn StoreBackend> = match addr.strip_prefix(ETCD_SCHEME) {
            Some(endpoints) => Box::new(EtcdBackend::connect(endpoints, token, timeout)?),
            None => Box::new(TcpBackend::connect(addr, token, timeout)?),
        };
        Ok(StoreClient::with_backend(backend, timeout))
    }

    /// A client over any [`StoreBackend`], with `timeout` as its default timeout.
    pub fn with_backend(mut backend: Box<dyn StoreBackend>, timeout: Duration) -> StoreClient {
        backend.set_timeout(timeout);
        StoreClient { backend, timeout }
    }

    /// The built-in store's address this client is connected to (`None` for etcd).
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.backend.socket_addr()
    }

    /// The store this client talks to, in words (for errors and logs).
    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// Whether the store runs the session-closed hook itself (the built-in server does:
    /// [`StoreServer::on_session_closed`](crate::StoreServer::on_session_closed)); where it does
    /// not (etcd), the clients act on closed sessions ([`StoreClient::sessions`]) themselves.
    pub fn runs_session_hooks(&self) -> bool {
        self.backend.runs_session_hooks()
    }

    /// The default timeout of calls that take none.
    pub fn default_timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the timeout of later requests (and with it the margin a request may take beyond its
    /// own wait), e.g. shorter than the connection's once it is made.
    pub fn set_default_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        self.backend.set_timeout(timeout);
    }

    /// Stores `value` under `key` (replacing any previous value).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        self.set_within(key, value, self.timeout)
    }

    /// [`StoreClient::set`], giving up on the answer after about `wait` plus the client's
    /// margin instead of its timeout (a failure report must not wait long on a lost store).
    pub fn set_within(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<()> {
        self.backend.set(key, value, wait)
    }

    /// Stores `value` under `key` unless another value is there already; returns the value the
    /// key holds afterwards (the first writer's, this one or another's): a decision every
    /// client reads the same, even when the writer that won has gone since.
    pub fn set_if_absent(&mut self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        self.backend.set_if_absent(key, value, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.backend
            .get(key, timeout)
            .map_err(|e| timed_out(e, || format!("waiting for store key {key:?}"), timeout))
    }

    /// Waits up to `timeout` until every key in `keys` is set.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.backend
            .wait(keys, timeout)
            .map_err(|e| timed_out(e, || format!("waiting for store keys {keys:?}"), timeout))
    }

    /// Waits up to `timeout` until every key in `keys` is set and returns their values, in
    /// order, in one round trip (a rank's peer records: one request instead of one per peer).
    /// A request or answer too large for one request is asked for in halves (more round trips,
    /// same result); so is a list longer than the store takes at once.
    pub fn get_all(&mut self, keys: &[String], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.get_all_parts(keys, None, timeout)
    }

    /// [`StoreClient::get_all`], unless `unless` is set first (or meanwhile): then
    /// [`StoreError::Interrupted`] with its value. The store answers as soon as either happens
    /// (a set-up's wait ends the moment a rank's death is published, not at its timeout).
    pub fn get_all_unless(
        &mut self,
        keys: &[String],
        unless: &str,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        self.get_all_parts(keys, Some(unless), timeout)
            .map_err(|e| match e {
                StoreError::Interrupted { value, .. } => StoreError::Interrupted {
                    key: unless.to_string(),
                    value,
                },
                e => e,
            })
    }

    fn get_all_parts(
        &mut self,
        keys: &[String],
        unless: Option<&str>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let deadline = Deadline::after(timeout);
        let mut values = Vec::with_capacity(keys.len());
        let chunk = self.backend.max_keys_per_request().max(1);
        for part in keys.chunks(chunk) {
            self.get_all_into(part, unless, &deadline, &mut values)
                .map_err(|e| {
                    timed_out(
                        e,
                        || format!("waiting for {} store keys", keys.len()),
                        timeout,
                    )
                })?;
        }
        Ok(values)
    }

    fn get_all_into(
        &mut self,
        keys: &[String],
        unless: Option<&str>,
        deadline: &Deadline,
        values: &mut Vec<Vec<u8>>,
    ) -> Result<()> {
        let halve = |this: &mut Self, values: &mut Vec<Vec<u8>>| {
            let (a, b) = keys.split_at(keys.len() / 2);
            this.get_all_into(a, unless, deadline, values)?;
            this.get_all_into(b, unless, deadline, values)
        };
        match self.backend.get_all(keys, unless, deadline.remaining()) {
            Ok(v) => {
                values.extend(v);
                Ok(())
            }
            Err(StoreError::TooLarge { .. }) if keys.len() > 1 => halve(self, values),
            Err(StoreError::TooLarge { bytes, limit, .. }) => Err(StoreError::TooLarge {
                keys: keys.len(),
                bytes,
                limit,
            }),
            Err(e) => Err(e),
        }
    }

    /// Atomically adds `delta` to the counter `key` (missing counts as 0); returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        self.add_within(key, delta, self.timeout)
    }

    /// [`StoreClient::add`], giving up on the answer after about `wait` instead of the client's
    /// timeout (for a last report that must not hold up a shutdown).
    pub fn add_within(&mut self, key: &str, delta: i64, wait: Duration) -> Result<i64> {
        self.backend.add(key, delta, wait)
    }

    /// Whether `key` is set (does not wait).
    pub fn check(&mut self, key: &str) -> Result<bool> {
        self.backend.check(key)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&mut self, key: &str) -> Result<bool> {
        self.backend.delete(key)
    }

    /// Names this client `key`, a session the store watches from now on (see the crate docs);
    /// `value` says who the client is. The built-in store: requests on this connection keep it
    /// alive. etcd: a lease this client keeps alive.
    pub fn name_session(&mut self, key: &str, value: &[u8]) -> Result<()> {
        self.backend.name_session(key, value)
    }

    /// Every session whose name starts with `prefix`, by name.
    pub fn sessions(&mut self, prefix: &str) -> Result<Vec<SessionInfo>> {
        self.backend.sessions(prefix)
    }

    /// A barrier over the store: every one of `n` participants calls it with the same `name`;
    /// returns once all have arrived (or fails after `timeout`). Each `name` is single-use.
    pub fn barrier(&mut self, name: &str, n: usize, timeout: Duration) -> Result<()> {
        let count = self.add(&format!("{name}/count"), 1)?;
        let done = format!("{name}/done");
        if count >= n as i64 {
            // The last to arrive is through: a further request could reach the store after
            // rank 0, released by this `set`, has returned and shut the store down.
            return self.set(&done, b"1");
        }
        self.wait(&[&done], timeout)
    }
}

/// A backend's timeout, said in the words of the request that timed out.
fn timed_out(e: StoreError, what: impl FnOnce() -> String, after: Duration) -> StoreError {
    match e {
        StoreError::Timeout { .. } => StoreError::Timeout {
            what: what(),
            after,
        },
        e => e,
    }
}
