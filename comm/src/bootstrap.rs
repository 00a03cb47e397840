//! Unique ids and rank 0's bootstrap store: where the ranks of a job meet, and how long the
//! store stays up after a failure so that every rank learns of it.

use crate::error::{Error, Result};
use crate::failure::SETTLE_TIMEOUT;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use weftcc_store::{StoreClient, StoreServer};
use weftcc_transports::lock;
use weftcc_transports::TransportError;

/// What a program passes between ranks to form a communicator: the rendezvous address where
/// rank 0 serves the bootstrap store, and a random job token. Printable and parseable
/// (`weft1@127.0.0.1:29500#3f9a…`), like NCCL's unique id but human-readable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UniqueId {
    /// `host:port` or `[v6]:port`.
    pub addr: String,
    /// Shared secret that every connection of the job presents.
    pub token: String,
}

impl UniqueId {
    /// Starts a bootstrap store on a free port of this host's chosen interface (see
    /// `WEFT_SOCKET_IFNAME`) and returns its id. Call it on the process that will be rank 0.
    pub fn new() -> Result<UniqueId> {
        let ip = weftcc_transports::tcp::select_interface(
            weftcc_settings::SOCKET_IFNAME.value().as_deref(),
            None,
        )
        .map_err(|e| Error::Bootstrap { rank: 0, source: e })?
        .addr;
        let token = weftcc_transports::random_token()
            .map_err(|e| Error::Bootstrap { rank: 0, source: e })?;
        let server = start_store(std::net::SocketAddr::new(ip, 0), &token).map_err(|e| {
            Error::Bootstrap {
                rank: 0,
                source: e.into(),
            }
        })?;
        let id = UniqueId {
            addr: server.local_addr().to_string(),
            token,
        };
        lock(servers()).insert(id.clone(), Arc::new(StoreHost::new(server, &id)));
        Ok(id)
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "weft1@{}#{}", self.addr, self.token)
    }
}

impl FromStr for UniqueId {
    type Err = Error;
    fn from_str(s: &str) -> Result<UniqueId> {
        let bad = || {
            Error::Config(format!(
                "{s:?} is not a weftcc unique id (weft1@HOST:PORT#TOKEN)"
            ))
        };
        let rest = s.trim().strip_prefix("weft1@").ok_or_else(bad)?;
        let (addr, token) = rest.rsplit_once('#').ok_or_else(bad)?;
        if addr.is_empty() || token.is_empty() || !addr.contains(':') {
            return Err(bad());
        }
        Ok(UniqueId {
            addr: addr.to_string(),
            token: token.to_string(),
        })
    }
}

/// Stores started by [`UniqueId::new`] in this process, found again by rank 0's `init`.
pub(crate) fn servers() -> &'static Mutex<HashMap<UniqueId, Arc<StoreHost>>> {
    static SERVERS: OnceLock<Mutex<HashMap<UniqueId, Arc<StoreHost>>>> = OnceLock::new();
    SERVERS.get_or_init(Default::default)
}

/// Rank 0's bootstrap store, shared by the communicator that started it and every communicator
/// split from it; it closes when the last of them is dropped.
pub(crate) struct StoreHost {
    pub(crate) _server: StoreServer,
    pub(crate) id: UniqueId,
    /// The [`SETTLED_ALL_KEY`]s of failed communicators that have been dropped
    /// ([`Inner::settle_before_the_store_closes`]).
    pub(crate) unsettled: Mutex<Vec<String>>,
}

/// Starts a job's bootstrap store on `addr`'s port (every address of its family), serving
/// clients that present `token`, with the failure protocol's part that runs in the store (a rank
/// whose connection closes unannounced is published as lost): what rank 0, `weft run`'s
/// launcher and `weft store serve` run.
pub fn serve_store(addr: &str, token: &str) -> std::result::Result<StoreServer, TransportError> {
    Ok(start_store(bind_address(addr)?, token)?)
}

/// [`serve_store`] bound to `bind` as it is.
fn start_store(
    bind: std::net::SocketAddr,
    token: &str,
) -> std::result::Result<StoreServer, weftcc_store::StoreError> {
    let server = StoreServer::start(bind, token)?;
    server.on_session_closed(crate::failure::store_hook());
    Ok(server)
}

impl StoreHost {
    pub(crate) fn new(server: StoreServer, id: &UniqueId) -> StoreHost {
        StoreHost {
            _server: server,
            id: id.clone(),
            unsettled: Mutex::new(Vec::new()),
        }
    }

    /// Waits (at most [`SETTLE_TIMEOUT`] in all) until every rank's watcher of every failed
    /// communicator left in `unsettled` has read the failure or stopped, so that the store does
    /// not close between a watcher's two polls and leave that rank without the cause (it would
    /// see only a closed store, or nothing at all while idle). A rank that died never counts
    /// itself, hence the bound.
    pub(crate) fn settle(&self, store: Option<&mut StoreClient>) {
        let keys = std::mem::take(&mut *lock(&self.unsettled));
        if keys.is_empty() {
            return;
        }
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        let mut own = None;
        let store = match store {
            Some(store) => store,
            None => match StoreClient::connect(&self.id.addr, &self.id.token, SETTLE_TIMEOUT) {
                Ok(client) => own.insert(client),
                Err(_) => return,
            },
        };
        for key in keys {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || store.get(&key, left).is_err() {
                return;
            }
        }
    }
}

impl Drop for StoreHost {
    /// The store is about to close: a failure left by a communicator that was not the last
    /// holder of the store (two dropped at once on different threads) is settled here.
    fn drop(&mut self) {
        self.settle(None);
    }
}

/// `host:port`, bracketing IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Address rank 0's store binds to: the wildcard of the id's family, on the id's port.
pub(crate) fn bind_address(
    addr: &str,
) -> std::result::Result<std::net::SocketAddr, TransportError> {
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| TransportError::Config(format!("{addr:?} has no port")))?;
    let port: u16 = port
        .parse()
        .map_err(|_| TransportError::Config(format!("{addr:?} has a bad port")))?;
    let ip: std::net::IpAddr = if host.starts_with('[') {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    };
    Ok(std::net::SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The store host of a fresh id, taken out of the process's table as rank 0's init would.
    fn store_host() -> (UniqueId, Arc<StoreHost>) {
        let id = UniqueId::new().expect("unique id");
        let host = lock(servers()).remove(&id).expect("store host");
        (id, host)
    }

    #[test]
    fn the_store_closes_only_once_left_failures_are_settled_or_the_bound_passed() {
        let (id, host) = store_host();
        lock(&host.unsettled).push("c/settled-all".into());
        let setter = std::thread::spawn({
            let id = id.clone();
            move || {
                let mut client =
                    StoreClient::connect(&id.addr, &id.token, SETTLE_TIMEOUT).expect("client");
                std::thread::sleep(Duration::from_millis(300));
                client.set("c/settled-all", b"1").expect("set");
            }
        });
        let start = Instant::now();
        drop(host);
        let took = start.elapsed();
        setter.join().expect("setter");
        assert!(
            took >= Duration::from_millis(300) && took < SETTLE_TIMEOUT,
            "{took:?}"
        );

        // Nobody settles: the wait ends at the bound.
        let (_, host) = store_host();
        lock(&host.unsettled).push("c/settled-all".into());
        let start = Instant::now();
        drop(host);
        let took = start.elapsed();
        assert!(
            took >= SETTLE_TIMEOUT && took < SETTLE_TIMEOUT * 2,
            "{took:?}"
        );
    }

    #[test]
    fn unique_id_round_trips() {
        let id = UniqueId {
            addr: "[::1]:29500".into(),
            token: "abc".into(),
        };
        assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
        assert!("weft1@nohost#t".parse::<UniqueId>().is_err());
        assert!("x".parse::<UniqueId>().is_err());
    }

    #[test]
    fn bind_addresses() {
        assert!(bind_address("[::1]:5").unwrap().is_ipv6());
        assert!(bind_address("host:5").unwrap().is_ipv4());
        assert!(bind_address("host").is_err());
        assert_eq!(join_host_port("::1", 3), "[::1]:3");
        assert_eq!(join_host_port("a", 3), "a:3");
    }
}
