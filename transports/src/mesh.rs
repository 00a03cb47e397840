//! A rank's connections in a communicator: set up the means to connect at init, connect each
//! peer when first needed.
//!
//! [`Mesh::establish`] runs these steps, all through the bootstrap store under the communicator's
//! key prefix (`namespace`), which is single-use: a new communicator needs a new namespace.
//! 1. Listen for TCP on the selected interface ([`crate::tcp::select_interface`] with
//!    `socket_ifname` and `WEFT_SOCKET_FAMILY`) and, unless shared memory is disabled, on this
//!    rank's abstract Unix socket ([`crate::dial::listen_unix`]); publish the TCP address (`<namespace>/addr/<rank>`,
//!    read only by the peers that connect to this rank over TCP).
//! 2. Gather the host table, every rank's [`PeerHost`] (host id, network namespace, shared memory
//!    allowed, network provider): at rank 0 through the store, then down a binary tree of direct
//!    connections among the ranks ([`crate::host_table`]), so that the store serves `O(n)`
//!    requests and bytes.
//! 3. Where this rank shares memory with others: check that the host can hold their rings
//!    ([`shm::check_host_shm`], every rank of the host fails alike) and create this rank's
//!    doorbell.
//! 4. Start the acceptor ([`Connector`]); with [`ConnectMode::Eager`], connect every peer now.
//! 5. Departure: every rank counts itself out (`<namespace>/mesh/left`) and rank 0 returns only
//!    once all have. The store usually lives in rank 0's process: a rank 0 that returned and
//!    dropped its communicator straight away used to shut the store down while another rank's
//!    last request was still on its way ("bootstrap store closed" during init).
//!
//! [`Mesh::connect`] then connects the peers an operation needs before it runs (see
//! [`crate::dial`] for how both ends agree and why it cannot deadlock): over TCP to peers on
//! other hosts, whose addresses it fetches in one store request, and through a pair of
//! shared-memory rings (one per direction, made at that moment) to peers on this host.
//!
//! [`Mesh::split`] makes the mesh of a split communicator without any set-up of its own: the
//! communicators of a family (the first one and every split made from it, at any depth) share
//! this process's listeners, acceptor and doorbell, and one connection per pair of processes,
//! each communicator talking through its own channel of it ([`crate::mux`]). A split that needs
//! a peer its parent already reached uses that connection; one that needs a new peer connects
//! it once for the whole family.

use crate::conn::{Connection, IdleWaiter, Interest};
use crate::dial::{Connector, Kind, Made, PeerHost};
use crate::error::{Result, TransportError};
use crate::host_table;
use crate::mem::{self, Doorbell, MemWaiter};
use crate::mux::{self, ChannelId, Mux, Signal};
use crate::net::{self, NetChoice, NetConnection, Provider};
use crate::shm::{self, Outboxes, ShmEndpoint, ShmWaiter};
use crate::tcp::{self, Family, TcpEndpoint, TcpPollHandle, TcpWaiter};
use crate::tcp_stripes::StripePlan;
use crate::util::{lock, Deadline};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weftcc_store::{StoreClient, StoreError};

/// Longest slice the mesh waiter sleeps on the futex before looking at TCP sockets again when it
/// waits for both kinds of peers.
pub const MIXED_WAIT_SLICE: Duration = Duration::from_micros(200);

/// When a rank connects to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConnectMode {
    /// When an operation first needs the peer (the default).
    #[default]
    OnDemand,
    /// Every peer during set-up (`WEFT_CONNECT=eager`), e.g. to time first calls without
    /// connection set-up.
    Eager,
}

impl ConnectMode {
    /// Parses `WEFT_CONNECT` (`eager`, `lazy` or `on-demand`).
    pub fn parse(text: &str) -> Result<ConnectMode> {
        match text.trim().to_ascii_lowercase().as_str() {
            "eager" | "all" => Ok(ConnectMode::Eager),
            "lazy" | "on-demand" | "ondemand" | "demand" => Ok(ConnectMode::OnDemand),
            other => Err(TransportError::Config(format!(
                "WEFT_CONNECT={other:?}: expected eager or on-demand"
            ))),
        }
    }
}

/// How to connect one rank into a communicator.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub nranks: usize,
    /// Ranks with equal host ids may use shared memory (see [`host_id`]).
    pub host_id: String,
    /// Use TCP even between ranks on the same host.
    pub shm_disable: bool,
    /// `WEFT_SOCKET_IFNAME`-style interface selection; `None` for the default policy.
    pub socket_ifname: Option<String>,
    /// Job token, checked in every TCP handshake (at most 64 bytes).
    pub token: String,
    /// Store key prefix of this communicator, so that several communicators (splits) can share
    /// one store; also hashed into segment names and TCP handshakes.
    pub namespace: String,
    /// Limit for the whole establishment.
    pub timeout: Duration,
    /// Shared-memory ring capacity in bytes (normalized by [`shm::ring_capacity`]); `None`
    /// sizes rings by the ranks on this host ([`shm::auto_capacity`]).
    pub buffsize: Option<usize>,
    /// Largest write sent over shared memory as a low-latency message (see [`shm`]); 0 sends
    /// every write through the ring.
    pub shm_ll_max: usize,
    /// When to connect peers.
    pub connect: ConnectMode,
    /// Splits share this communicator's connections ([`Mesh::split`]): every connection then
    /// carries frames ([`crate::mux`]). Every rank must choose alike (dials check it).
    pub share_splits: bool,
    /// The network to ranks on other hosts ([`net::select`]): a pair whose ranks opened the
    /// same provider uses it, other pairs TCP.
    pub net: NetChoice,
    /// Sockets and helper threads of a TCP connection (`WEFT_SOCKET_NTHREADS`,
    /// `WEFT_NSOCKS_PERTHREAD`); a TCP connection under a network connection keeps one socket.
    pub stripes: StripePlan,
}

/// What this rank's network settings resolve to on this machine: the interface and address
/// TCP listens on and the network provider the pairs across hosts may use. [`Mesh::establish`]
/// uses exactly this; the consistency check at set-up announces it ([`Network::announced`]).
pub struct Network {
    /// [`tcp::select_interface`] with `WEFT_SOCKET_IFNAME` and `WEFT_SOCKET_FAMILY`.
    pub interface: tcp::Interface,
    /// [`net::select::open`]: `None` for TCP only.
    pub provider: Option<Arc<dyn net::Provider>>,
}

impl Network {
    /// Resolves `socket_ifname` and `net` (the provider is opened once per process and cached,
    /// so resolving again costs a look-up).
    pub fn resolve(socket_ifname: Option<&str>, net: &NetChoice) -> Result<Network> {
        let interface = tcp::select_interface(socket_ifname, Family::from_env()?)?;
        let provider = net::select::open(net)?;
        Ok(Network {
            interface,
            provider,
        })
    }

    /// What a peer must match for a pair to work, as announced at set-up: the interface's kind
    /// (`IPv4`, `IPv6`, `loopback IPv4`, …; its name and address differ from host to host) and
    /// the provider's class (`tcp`, `ib:roce`, `ofi:verbs;ofi_rxm`, `loopback`; the in-memory
    /// loopback's id names its process, which differs from rank to rank by design).
    pub fn announced(&self) -> (String, String) {
        let i = &self.interface;
        let family = match i.addr {
            std::net::IpAddr::V4(_) => "IPv4",
            std::net::IpAddr::V6(_) => "IPv6",
        };
        let kind = if i.loopback {
            format!("loopback {family}")
        } else {
            family.to_string()
        };
        let provider = self.provider.as_ref().map_or("tcp".to_string(), |p| {
            let id = p.id();
            match id.split_once(':') {
                Some((class, _)) if class == net::loopback::PROVIDER => class.to_string(),
                _ => id,
            }
        });
        (kind, provider)
    }
}

/// A peer [`Mesh::connect`] could not connect, and why.
#[derive(Debug, thiserror::Error)]
#[error("connecting to rank {peer}: {source}")]
pub struct ConnectError {
    /// The peer.
    pub peer: usize,
    /// What went wrong.
    #[source]
    pub source: TransportError,
}

/// Store key of rank `rank`'s TCP address (step 1), read by the peers that connect to it.
pub fn addr_key(ns: &str, rank: usize) -> String {
    format!("{ns}/addr/{rank}")
}

/// Store key under which a rank's death during the set-up of namespace `ns` is published (its
/// rank, in decimal): the store's host sets it when the rank's session closes before the rank
/// has joined, and every set-up wait of the namespace ends on it.
pub fn setup_lost_key(ns: &str) -> String {
    format!("{ns}/mesh/lost")
}

/// A set-up wait's failure: the death it was interrupted by as [`TransportError::DiedInSetup`].
pub fn setup_error(e: StoreError) -> TransportError {
    match e {
        StoreError::Interrupted { value, .. } => {
            match std::str::from_utf8(&value)
                .ok()
                .and_then(|v| v.parse().ok())
            {
                Some(peer) => TransportError::DiedInSetup { peer },
                None => TransportError::Protocol(format!(
                    "the store's note of a rank lost during set-up is not a rank: {value:?}"
                )),
            }
        }
        e => e.into(),
    }
}

/// [`StoreClient::get_all`] for a set-up step of namespace `ns`: ends as soon as a rank's death
/// during set-up is published ([`setup_lost_key`]).
pub fn setup_get_all(
    store: &mut StoreClient,
    ns: &str,
    keys: &[String],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    store
        .get_all_unless(keys, &setup_lost_key(ns), timeout)
        .map_err(setup_error)
}

/// Before returning an error that every rank meets alike (a check on the host table or the
/// limits): rank 0 serves the store, so it leaves only once every rank has read the host table;
/// none of them then reports the store closing instead of that reason.
fn leave_together(
    store: &mut StoreClient,
    ns: &str,
    n: usize,
    rank: usize,
    deadline: &Deadline,
) -> Result<()> {
    if rank == 0 {
        while store.add(&format!("{ns}/hosts-read"), 0)? < n as i64 && !deadline.expired() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    Ok(())
}

/// Peers a rank of `n` connects to for ring, tree and recursive-doubling collectives: at most
/// two ring neighbours, two tree children and a parent, and one partner per doubling round, with
/// room for the non-power-of-two fold-in (`2⌈log2 n⌉ + 4`).
pub fn typical_peers(n: usize) -> usize {
    2 * n.max(1).next_power_of_two().trailing_zeros() as usize + 4
}

/// Counts this rank out of set-up step `step` of namespace `ns` (`<ns>/<step>/left`) and, if
/// `wait`, returns only once all `n` ranks have (waiting at most `timeout`, or until a rank's
/// death during set-up is published): the process serving the store must not close it while
/// another rank's last request of the step is on its way.
pub fn count_out(
    store: &mut StoreClient,
    ns: &str,
    step: &str,
    n: usize,
    wait: bool,
    timeout: Duration,
) -> Result<()> {
    let all_left = format!("{ns}/{step}/all-left");
    if store.add(&format!("{ns}/{step}/left"), 1)? >= n as i64 {
        store.set(&all_left, b"1")?;
    }
    if wait {
        setup_get_all(store, ns, &[all_left], timeout)?;
    }
    Ok(())
}

/// Longest rank 0 keeps the store up after a set-up that ranks did not join, for the ranks
/// that did to find out who is missing.
const NOT_JOINED_LINGER: Duration = Duration::from_secs(2);

/// Most missing ranks a [`TransportError::NotJoined`] lists.
pub const MAX_NAMED_MISSING: usize = 16;

/// A set-up that timed out waiting for every rank's record (`record(r)` is rank r's key: the
/// host table's, or the communicator's announcements), as the ranks whose records are missing
/// (asked one by one, without waiting: only on this failure path); any other error, or a store
/// that cannot tell, is returned as it is. Rank 0, which serves the store, leaves only once
/// every rank that joined has found the same (at most [`NOT_JOINED_LINGER`] more), so that none
/// of them finds the store closed instead.
pub fn name_the_missing(
    store: &mut StoreClient,
    ns: &str,
    record: &dyn Fn(usize) -> String,
    (rank, n): (usize, usize),
    e: TransportError,
) -> TransportError {
    let after = match &e {
        TransportError::Store(StoreError::Timeout { after, .. })
        | TransportError::Timeout { after, .. } => *after,
        _ => return e,
    };
    let mut missing = Vec::new();
    let mut more = 0;
    for r in 0..n {
        match store.get(&record(r), Duration::ZERO) {
            Ok(_) => {}
            Err(StoreError::Timeout { .. }) if missing.len() < MAX_NAMED_MISSING => missing.push(r),
            Err(StoreError::Timeout { .. }) => more += 1,
            Err(_) => return e,
        }
    }
    if missing.is_empty() {
        return e;
    }
    let joined = (n - missing.len() - more) as i64;
    let seen = format!("{ns}/not-joined-seen");
    if let Ok(mut count) = store.add(&seen, 1) {
        let linger = Deadline::after(NOT_JOINED_LINGER);
        while rank == 0 && count < joined && !linger.expired() {
            std::thread::sleep(Duration::from_millis(10));
            count = store.add(&seen, 0).unwrap_or(joined);
        }
    }
    TransportError::NotJoined {
        missing,
        more,
        nranks: n,
        after,
    }
}

/// After a set-up ended by a rank's death ([`TransportError::DiedInSetup`], from any of its
/// waits): rank 0, which may serve the store, leaves only once every other survivor has found the
/// same (at most [`NOT_JOINED_LINGER`] more, as ranks that were past their last set-up wait never
/// look), so that none finds the store closed instead; a rank that had not reached the store yet
/// gets the time to.
pub fn all_see_the_death(store: &mut StoreClient, ns: &str, rank: usize, n: usize) {
    let seen = format!("{ns}/mesh/lost-seen");
    let Ok(mut count) = store.add(&seen, 1) else {
        return;
    };
    let linger = Deadline::after(NOT_JOINED_LINGER);
    while rank == 0 && count < n as i64 - 1 && !linger.expired() {
        std::thread::sleep(Duration::from_millis(10));
        count = store.add(&seen, 0).unwrap_or(n as i64);
    }
}

/// The [`IdleWaiter`] of a [`Mesh`]: the futex doorbell for shared-memory peers, `poll()` for TCP
/// peers, alternating short waits of at most [`MIXED_WAIT_SLICE`] when the interest list holds
/// both; the in-process doorbell for in-memory meshes.
pub struct MeshWaiter {
    shm: Option<ShmWaiter>,
    tcp: TcpWaiter,
    mem: Option<MemWaiter>,
    shm_peers: Vec<bool>,
    /// Peers reached over a network provider: they move only when polled, so waits on them
    /// are short slices that poll every network connection of the process.
    net_peers: Vec<bool>,
    /// Raised when another communicator's reader moved bytes for this one off a shared
    /// connection (a socket it may then wait on in vain), and the value last seen.
    signal: Option<(Signal, u64)>,
    /// Communicators alive in the family: with more than one, waits on sockets are sliced so
    /// that the signal is seen.
    family_live: Option<Arc<AtomicUsize>>,
}

impl MeshWaiter {
    /// Whether `interest` (empty: anything) involves shared-memory, TCP and network peers.
    fn wants(&self, interest: &[Interest]) -> (bool, bool, bool) {
        if interest.is_empty() {
            return (
                self.shm.is_some(),
                !self.tcp.is_empty(),
                self.net_peers.contains(&true),
            );
        }
        let marked = |peers: &[bool]| {
            interest
                .iter()
                .any(|i| peers.get(i.peer).copied().unwrap_or(false))
        };
        let tcp = interest.iter().any(|i| self.tcp.has_peer(i.peer));
        (marked(&self.shm_peers), tcp, marked(&self.net_peers))
    }
}

impl MeshWaiter {
    /// Whether the signal was raised since the last look (and acknowledges it).
    fn signalled(&mut self) -> bool {
        match &mut self.signal {
            Some((s, seen)) => {
                let now = s.load(Ordering::Acquire);
                let raised = now != *seen;
                *seen = now;
                raised
            }
            None => false,
        }
    }

    fn shared(&self) -> bool {
        self.family_live
            .as_ref()
            .is_some_and(|l| l.load(Ordering::Relaxed) > 1)
    }
}

impl IdleWaiter for MeshWaiter {
    fn wait(&mut self, interest: &[Interest], max: Duration) -> Result<()> {
        if let Some(m) = &mut self.mem {
            return m.wait(interest, max);
        }
        if self.signalled() {
            return Ok(());
        }
        let (want_shm, want_tcp, want_net) = self.wants(interest);
        // Network connections move only when polled: poll them whatever this wait is for, and
        // wake again soon while one owes its peer a word (a head behind its data's
        // completion), since that peer may be what the peers waited for are waiting on.
        let owed = net::stream::progress_all();
        let max = if want_net || owed {
            max.min(net::stream::NET_POLL_SLICE)
        } else {
            max
        };
        if want_tcp && self.shared() {
            // Another communicator of this process may drain a socket this one waits on.
            let deadline = Deadline::after(max);
            loop {
                let slice = deadline.remaining().min(MIXED_WAIT_SLICE);
                let ready = match (&mut self.shm, want_shm) {
                    (Some(s), true) => {
                        self.tcp.poll_for(interest, Duration::ZERO)? || s.wait_doorbell(slice)
                    }
                    _ => self.tcp.poll_for(interest, slice)?,
                };
                if ready || self.signalled() || deadline.expired() {
                    return Ok(());
                }
            }
        }
        match (&mut self.shm, want_shm, want_tcp) {
            (Some(s), true, false) => {
                s.wait_doorbell(max);
                Ok(())
            }
            (Some(s), true, true) => {
                let deadline = Deadline::after(max);
                loop {
                    if self.tcp.poll_for(interest, Duration::ZERO)? {
                        return Ok(());
                    }
                    let left = deadline.remaining();
                    if left.is_zero() {
                        return Ok(());
                    }
                    if s.wait_doorbell(left.min(MIXED_WAIT_SLICE)) {
                        return Ok(());
                    }
                }
            }
            (_, _, true) => self.tcp.poll_for(interest, max).map(|_| ()),
            (shm, _, false) => {
                // Nothing known to wait on: sleep on whatever exists, bounded by `max`.
                match shm {
                    Some(s) => {
                        s.wait_doorbell(max);
                    }
                    None => std::thread::sleep(max.min(Duration::from_millis(10))),
                }
                Ok(())
            }
        }
    }
}

/// A connection of a family, and what its users need to wait on it.
struct Linked {
    mux: Arc<Mux>,
    kind: &'static str,
    poll: Option<TcpPollHandle>,
}

/// A new connection: the connection, its transport's name, the socket a TCP one is polled on,
/// and a shared-memory peer's one-shot outbox.
type Opened = (
    Box<dyn Connection>,
    &'static str,
    Option<TcpPollHandle>,
    Option<shm::Outbox>,
);

/// What a one-shot collective works with ([`Mesh::one_shot_parts`]): the outboxes, and the
/// connections (for liveness and stray headers).
pub type OneShotParts<'a> = (&'a mut Outboxes, &'a mut [Option<Box<dyn Connection>>]);

/// What the communicators of one family share in this process (see the module docs). Ranks
/// here are ranks of the family's first communicator.
struct Shared {
    connector: Connector,
    /// Connections are shared by channels (`MeshConfig::share_splits`); otherwise each is the
    /// one communicator's own.
    share: bool,
    /// The first communicator's store namespace, where the TCP addresses are.
    namespace: String,
    shm_ll_max: usize,
    /// The network provider this rank opened (see [`MeshConfig::net`]) and the shape of its
    /// connections.
    net: Option<Arc<dyn Provider>>,
    net_link: crate::net::stream::NetLink,
    links: Mutex<Links>,
    /// Meshes alive.
    live: Arc<AtomicUsize>,
}

impl Shared {
    /// Whether this rank reaches `member` (a family rank) through its network provider.
    fn uses_network(&self, member: usize) -> bool {
        self.net.is_some()
            && self
                .connector
                .host(member)
                .is_some_and(|h| self.connector.me().shares_network_with(h))
    }
}

struct Links {
    by_rank: Vec<Option<Linked>>,
    /// TCP addresses fetched so far.
    addrs: HashMap<usize, SocketAddr>,
}

/// Connections from one rank to the other ranks of a communicator, made on demand, plus its
/// waiter.
pub struct Mesh {
    rank: usize,
    nranks: usize,
    conns: Vec<Option<Box<dyn Connection>>>,
    kinds: Vec<Option<&'static str>>,
    waiter: MeshWaiter,
    /// Host id of every rank, as each published it.
    host_ids: Vec<String>,
    /// Each rank's rank in the family's first communicator.
    members: Vec<usize>,
    /// This communicator's channel on the family's connections.
    channel: ChannelId,
    signal: Signal,
    /// Makes and keeps connections; `None` for in-memory meshes (connected from the start).
    family: Option<Arc<Shared>>,
    /// One-shot outboxes ([`shm::Outbox`]) of this rank and of each peer connected over shared
    /// memory; `None` where connections are shared by a family (its communicators would share
    /// the outbox too) or there is no shared memory.
    outboxes: Option<Outboxes>,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        // Channels first (each tells its peer this communicator is gone), then the family.
        self.conns.clear();
        if let Some(f) = &self.family {
            if f.share {
                // Peers this communicator never reached must learn it is gone too.
                for linked in lock(&f.links).by_rank.iter().flatten() {
                    linked.mux.forget(self.channel);
                }
            }
            f.live.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Mesh {
    /// Prepares this rank to connect to the others (see the module docs for the steps).
    pub fn establish(store: &mut StoreClient, cfg: &MeshConfig) -> Result<Mesh> {
        if cfg.nranks == 0 || cfg.rank >= cfg.nranks || cfg.nranks > u32::MAX as usize {
            return Err(TransportError::Config(format!(
                "rank {} out of range for {} ranks",
                cfg.rank, cfg.nranks
            )));
        }
        let deadline = Deadline::after(cfg.timeout);
        let (rank, n, ns) = (cfg.rank, cfg.nranks, cfg.namespace.as_str());

        // 1. Listen and publish.
        let network = Network::resolve(cfg.socket_ifname.as_deref(), &cfg.net)?;
        let ip = network.interface.addr;
        let endpoint = TcpEndpoint::bind(ip, rank, &cfg.token, ns)?;
        tracing::info!(target: "weftcc::net", rank, addr = %endpoint.local_addr(), "peers dial this rank at this address");
        let unix = if cfg.shm_disable {
            None
        } else {
            Some(crate::dial::listen_unix(&cfg.token, ns, rank)?)
        };
        store.set(
            &addr_key(ns, rank),
            endpoint.local_addr().to_string().as_bytes(),
        )?;

        // 2. The host table.
        let provider = network.provider;
        let mut me = PeerHost::this_process(&cfg.host_id, !cfg.shm_disable);
        if let Some(p) = &provider {
            me.net = p.id();
            tracing::info!(target: "weftcc::net", rank, "NET/{} opened", p.name());
        }
        let hosts = host_table::gather(store, ns, &cfg.token, (rank, n), &me, ip, &deadline)
            .map_err(|e| {
                let host = |r| host_table::entry_key(ns, r);
                name_the_missing(store, ns, &host, (rank, n), e)
            })?;
        store.add(&format!("{ns}/hosts-read"), 1)?;

        // 3. Shared memory with the ranks of this host.
        let local = hosts.iter().filter(|h| me.shares_memory_with(h)).count();
        // Any peer may be connected in the end (send/recv, all-to-all).
        let peers_at_most = n - 1;
        let shm_endpoint = if local > 1 {
            let capacity = cfg.buffsize.unwrap_or_else(|| shm::auto_capacity(local));
            let rings = (local - 1).min(match cfg.connect {
                ConnectMode::Eager => peers_at_most,
                ConnectMode::OnDemand => typical_peers(n),
            });
            let (shm_size, memory) = shm::host_shm_limits();
            let checked =
                shm::check_host_shm(local, rings, shm::ring_bytes(capacity), shm_size, memory)
                    .and_then(|_| ShmEndpoint::create(&cfg.token, ns, rank, capacity));
            match checked {
                Ok(ep) => Some(ep),
                Err(e) => {
                    // Every rank of the host fails alike.
                    leave_together(store, ns, n, rank, &deadline)?;
                    return Err(e);
                }
            }
        } else {
            None
        };
        // The sockets of a remote peer (with helper threads, an eventfd each and one for this
        // thread) or a pidfd per local one may stay open for the mesh's lifetime, plus the
        // doorbell and the listeners.
        let per_peer =
            cfg.stripes.sockets() + usize::from(cfg.stripes.threads > 0) + cfg.stripes.threads;
        if let Err(e) = crate::limits::ensure_open_files((peers_at_most * per_peer) as u64 + 4) {
            // Every rank computes the same need against its limit: all fail alike.
            leave_together(store, ns, n, rank, &deadline)?;
            return Err(e);
        }

        // 4. The acceptor.
        let signal: Signal = Arc::new(AtomicU64::new(0));
        let live = Arc::new(AtomicUsize::new(1));
        let waiter = MeshWaiter {
            shm: shm_endpoint.as_ref().map(ShmEndpoint::waiter),
            tcp: TcpWaiter::new(),
            mem: None,
            shm_peers: vec![false; n],
            net_peers: vec![false; n],
            signal: Some((Arc::clone(&signal), 0)),
            family_live: Some(Arc::clone(&live)),
        };
        let host_ids = hosts.iter().map(|h| h.host_id.clone()).collect();
        let outboxes = shm_endpoint
            .as_ref()
            .and_then(ShmEndpoint::outbox)
            .filter(|_| !cfg.share_splits)
            .map(|mine| Outboxes::new(mine, n));
        let unix = unix.filter(|_| shm_endpoint.is_some());
        let connector = Connector::start(
            rank,
            hosts,
            &cfg.token,
            ns,
            endpoint,
            unix,
            shm_endpoint,
            cfg.share_splits,
            cfg.stripes,
        )?;
        let family = Shared {
            connector,
            share: cfg.share_splits,
            namespace: ns.to_string(),
            shm_ll_max: cfg.shm_ll_max,
            net: provider,
            net_link: cfg.net.link(),
            links: Mutex::new(Links {
                by_rank: (0..n).map(|_| None).collect(),
                addrs: HashMap::new(),
            }),
            live,
        };
        let mut mesh = Mesh {
            rank,
            nranks: n,
            conns: (0..n).map(|_| None).collect(),
            kinds: vec![None; n],
            waiter,
            host_ids,
            members: (0..n).collect(),
            channel: mux::channel_id(ns),
            signal,
            family: Some(Arc::new(family)),
            outboxes,
        };
        if cfg.connect == ConnectMode::Eager {
            let all: Vec<usize> = (0..n).collect();
            mesh.connect(&all, store, deadline.remaining(), &|| false)
                .map_err(|e| e.source)?;
        }

        // 5. No store request of this communicator's set-up may be in flight when rank 0
        // returns.
        count_out(store, ns, "mesh", n, rank == 0, deadline.remaining())?;
        Ok(mesh)
    }

    /// The mesh of a split of this communicator: `members` are the ranks (here) of the new
    /// communicator in its rank order, this rank among them; `namespace` is the split's store
    /// namespace. Makes no connection and asks the store nothing: the family's connections are
    /// shared (see the module docs).
    pub fn split(&self, members: &[usize], namespace: &str) -> Result<Mesh> {
        let Some(family) = self.family.as_ref().filter(|f| f.share) else {
            return Err(TransportError::Config(
                "this communicator does not share its connections with splits \
                 (MeshConfig::share_splits)"
                    .into(),
            ));
        };
        let rank = members.iter().position(|&m| m == self.rank);
        let (Some(rank), true) = (rank, members.iter().all(|&m| m < self.nranks)) else {
            return Err(TransportError::Config(format!(
                "split members {members:?} must be ranks of {} and include rank {}",
                self.nranks, self.rank
            )));
        };
        let n = members.len();
        let signal: Signal = Arc::new(AtomicU64::new(0));
        family.live.fetch_add(1, Ordering::Relaxed);
        Ok(Mesh {
            rank,
            nranks: n,
            conns: (0..n).map(|_| None).collect(),
            kinds: vec![None; n],
            waiter: MeshWaiter {
                shm: family.connector.shm_waiter(),
                tcp: TcpWaiter::new(),
                mem: None,
                shm_peers: vec![false; n],
                net_peers: vec![false; n],
                signal: Some((Arc::clone(&signal), 0)),
                family_live: Some(Arc::clone(&family.live)),
            },
            host_ids: members.iter().map(|&m| self.host_ids[m].clone()).collect(),
            members: members.iter().map(|&m| self.members[m]).collect(),
            channel: mux::channel_id(namespace),
            signal,
            family: Some(Arc::clone(family)),
            outboxes: None,
        })
    }

    /// Connects every peer in `peers` not connected yet (this rank and repeats are skipped),
    /// fetching the TCP addresses it lacks from `store` in one request. Waits at most `timeout`
    /// and gives up once `cancel` returns true. A peer another communicator of the family has
    /// connected already costs nothing but a channel.
    pub fn connect(
        &mut self,
        peers: &[usize],
        store: &mut StoreClient,
        timeout: Duration,
        cancel: &dyn Fn() -> bool,
    ) -> std::result::Result<(), ConnectError> {
        let missing: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| p != self.rank && self.conns.get(p).is_some_and(|c| c.is_none()))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let Some(family) = self.family.clone() else {
            return Err(ConnectError {
                peer: missing[0],
                source: TransportError::Config(
                    "an in-memory mesh cannot connect more peers".into(),
                ),
            });
        };
        let deadline = Deadline::after(timeout);
        // One communicator of the family connects at a time; the acceptor answers dials on its
        // own thread, so holding this while a dial waits cannot stop the peer's dial. A
        // communicator waiting for a sibling's dial still honours its own deadline and cancel.
        let mut links = loop {
            match family.links.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
            let fail = |source| ConnectError {
                peer: missing[0],
                source,
            };
            if cancel() {
                return Err(fail(TransportError::Aborted));
            }
            if deadline.expired() {
                return Err(fail(deadline.timeout_error(
                    "waiting for another communicator of this rank to finish connecting",
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let need_addr: Vec<usize> = missing
            .iter()
            .copied()
            .filter(|&p| {
                let f = self.members[p];
                links.by_rank[f].is_none()
                    && family.connector.kind(f) == Kind::Tcp
                    && !links.addrs.contains_key(&f)
            })
            .collect();
        if !need_addr.is_empty() {
            let ns = &family.namespace;
            let keys: Vec<String> = need_addr
                .iter()
                .map(|&p| addr_key(ns, self.members[p]))
                .collect();
            let fail = |source: StoreError| ConnectError {
                peer: need_addr[0],
                source: source.into(),
            };
            let values = store.get_all(&keys, deadline.remaining()).map_err(fail)?;
            for (&p, raw) in need_addr.iter().zip(values) {
                let text = String::from_utf8_lossy(&raw);
                let addr = text.parse().map_err(|_| ConnectError {
                    peer: p,
                    source: TransportError::Protocol(format!(
                        "rank {p} published a bad TCP address {text:?}"
                    )),
                })?;
                links.addrs.insert(self.members[p], addr);
            }
        }
        // In the family's rank order: a network connection's handshake waits for the peer to
        // reach it, and with every rank going in one order no cycle of waits can form.
        let mut missing = missing;
        missing.sort_by_key(|&p| self.members[p]);
        for p in missing {
            let f = self.members[p];
            let addr = links.addrs.get(&f).copied();
            let (conn, kind, poll) = if family.share {
                if links.by_rank[f].is_none() {
                    let (conn, kind, poll, _) = self
                        .open(&family, p, addr, &deadline, cancel)
                        .map_err(|source| ConnectError { peer: p, source })?;
                    links.by_rank[f] = Some(Linked {
                        mux: Mux::new(conn),
                        kind,
                        poll,
                    });
                }
                let Some(linked) = &links.by_rank[f] else {
                    continue;
                };
                let channel = linked
                    .mux
                    .channel(self.channel, p, Some(Arc::clone(&self.signal)))
                    .map_err(|source| ConnectError { peer: p, source })?;
                let conn: Box<dyn Connection> = Box::new(channel);
                (conn, linked.kind, linked.poll.clone())
            } else {
                let (conn, kind, poll, outbox) = self
                    .open(&family, p, addr, &deadline, cancel)
                    .map_err(|source| ConnectError { peer: p, source })?;
                if let (Some(boxes), Some(outbox)) = (self.outboxes.as_mut(), outbox) {
                    boxes.peers[p] = Some(outbox);
                }
                (conn, kind, poll)
            };
            match (&poll, kind) {
                (Some(h), _) => self.waiter.tcp.add(h.for_peer(p)),
                (None, "net") => self.waiter.net_peers[p] = true,
                (None, _) => self.waiter.shm_peers[p] = true,
            }
            self.conns[p] = Some(conn);
            self.kinds[p] = Some(kind);
        }
        Ok(())
    }

    /// A new connection to peer `p` (TCP address `addr`), its transport's name, over TCP the
    /// socket its waiter polls, and over shared memory the peer's one-shot outbox.
    fn open(
        &self,
        family: &Shared,
        p: usize,
        addr: Option<SocketAddr>,
        deadline: &Deadline,
        cancel: &dyn Fn() -> bool,
    ) -> Result<Opened> {
        let made = family
            .connector
            .connect(self.members[p], addr, deadline, cancel)?;
        let opened: Opened = match made {
            Made::Shm(mut c) => {
                c.set_low_latency_max(family.shm_ll_max);
                let outbox = c.peer_outbox();
                (c, "shm", None, outbox)
            }
            Made::Tcp(c) => {
                let f = self.members[p];
                match &family.net {
                    Some(provider) if family.uses_network(f) => {
                        let conn = NetConnection::establish(
                            p,
                            Box::new(c),
                            provider,
                            family.net_link,
                            deadline,
                        )?;
                        tracing::info!(target: "weftcc::net", rank = self.rank, peer = p, "via NET/{}", provider.name());
                        (Box::new(conn), "net", None, None)
                    }
                    _ => {
                        let poll = Some(c.poll_handle());
                        (Box::new(c), "tcp", poll, None)
                    }
                }
            }
        };
        tracing::info!(target: "weftcc::init", rank = self.rank, peer = p, transport = opened.1, "connected");
        Ok(opened)
    }

    /// Whether every peer in `peers` other than this rank is connected.
    #[inline]
    pub fn all_connected(&self, peers: &[usize]) -> bool {
        peers
            .iter()
            .all(|&p| p == self.rank || self.conns.get(p).is_some_and(|c| c.is_some()))
    }

    /// Peers connected so far.
    pub fn connected_peers(&self) -> usize {
        self.conns.iter().filter(|c| c.is_some()).count()
    }

    /// Connections this rank holds for its family (this communicator, the one it was split
    /// from and every split of either), which their channels share; for an in-memory mesh, its
    /// connected peers.
    pub fn family_connections(&self) -> usize {
        match &self.family {
            Some(f) if f.share => lock(&f.links).by_rank.iter().flatten().count(),
            _ => self.connected_peers(),
        }
    }

    /// `nranks` meshes connected in memory, one per rank (hand each to its own thread); every
    /// direction buffers `capacity` bytes.
    pub fn in_memory(nranks: usize, capacity: usize) -> Vec<Mesh> {
        let bells: Vec<Doorbell> = (0..nranks).map(|_| Doorbell::new()).collect();
        let mut conns: Vec<Vec<Option<Box<dyn Connection>>>> = (0..nranks)
            .map(|_| (0..nranks).map(|_| None).collect())
            .collect();
        for a in 0..nranks {
            for b in a + 1..nranks {
                let (ca, cb) = mem::pair_with(a, &bells[a], b, &bells[b], capacity);
                conns[a][b] = Some(Box::new(ca));
                conns[b][a] = Some(Box::new(cb));
            }
        }
        conns
            .into_iter()
            .enumerate()
            .map(|(r, c)| Mesh {
                host_ids: vec!["mem".to_string(); nranks],
                rank: r,
                nranks,
                kinds: (0..nranks)
                    .map(|p| if p == r { None } else { Some("mem") })
                    .collect(),
                conns: c,
                waiter: MeshWaiter {
                    shm: None,
                    tcp: TcpWaiter::new(),
                    mem: Some(bells[r].waiter()),
                    shm_peers: vec![false; nranks],
                    net_peers: vec![false; nranks],
                    signal: None,
                    family_live: None,
                },
                members: (0..nranks).collect(),
                channel: 0,
                signal: Arc::new(AtomicU64::new(0)),
                family: None,
                outboxes: None,
            })
            .collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The transport used to reach `peer` (`"shm"`, `"tcp"`, `"net"`, `"mem"`), or that will be used once
    /// it is connected; `None` for this rank or an out-of-range peer.
    pub fn transport_name(&self, peer: usize) -> Option<&'static str> {
        if peer == self.rank || peer >= self.nranks {
            return None;
        }
        self.kinds[peer].or_else(|| {
            self.family.as_ref().map(|f| {
                let member = self.members[peer];
                match f.connector.kind(member) {
                    Kind::Shm => "shm",
                    Kind::Tcp if f.uses_network(member) => "net",
                    Kind::Tcp => "tcp",
                }
            })
        })
    }

    /// The host id every rank published (see [`host_id`]), indexed by rank: ranks with equal
    /// ids are on one host.
    pub fn host_ids(&self) -> &[String] {
        &self.host_ids
    }

    /// The connection to `peer`, if any.
    pub fn connection(&mut self, peer: usize) -> Option<&mut (dyn Connection + 'static)> {
        self.conns.get_mut(peer).and_then(|c| c.as_deref_mut())
    }

    /// Leaves `note` on every connection (see [`Connection::leave_farewell`]).
    pub fn leave_farewell(&mut self, note: &str) {
        for conn in self.conns.iter_mut().flatten() {
            conn.leave_farewell(note);
        }
    }

    /// Gives up every connection's unfinished pinned receive (see
    /// [`Connection::cancel_pinned`]): after a failed operation, before its memory goes back
    /// to the caller.
    pub fn cancel_pinned(&mut self) {
        for conn in self.conns.iter_mut().flatten() {
            conn.cancel_pinned();
        }
    }

    /// The note `peer` left before closing its connection to this rank, if any.
    pub fn farewell(&self, peer: usize) -> Option<String> {
        self.conns.get(peer)?.as_ref()?.farewell()
    }

    /// Connections indexed by peer (`None` for this rank) and the waiter, borrowed together so
    /// the engine can poll and wait.
    pub fn parts(&mut self) -> (&mut [Option<Box<dyn Connection>>], &mut dyn IdleWaiter) {
        (&mut self.conns, &mut self.waiter)
    }
    /// The one-shot outboxes with the connections, when every peer of this
    /// communicator is connected over shared memory with an outbox (see [`shm::Outbox`]).
    pub fn one_shot_parts(&mut self) -> Option<OneShotParts<'_>> {
        let boxes = self.outboxes.as_mut().filter(|b| b.complete(self.rank))?;
        Some((boxes, &mut self.conns))
    }

    /// Whether one-shot collectives can run here once every peer is connected: this rank has
    /// an outbox and shares memory with every other rank.
    pub fn one_shot_possible(&self) -> bool {
        self.outboxes.is_some()
            && self.family.as_ref().is_some_and(|f| {
                (0..self.nranks)
                    .all(|p| p == self.rank || f.connector.kind(self.members[p]) == Kind::Shm)
            })
    }
}
