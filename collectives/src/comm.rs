//! The communicator: a group of ranks that run collectives together.
//!
//! Issue order is execution order: every call takes a ticket, and tickets execute one at a time
//! (blocking calls on the caller's thread, async calls on the communicator's worker thread).
//! Each call validates its arguments, asks the tuner for an algorithm, takes this rank's
//! [`Schedule`] from the cache of prepared schedules (building it on a miss), maps the schedule's
//! logical buffers onto the caller's memory and hands both to [`engine::execute_prepared`].
//!
//! Failure handling: the first fatal error poisons the communicator and is published to the
//! bootstrap store; a watcher thread on every rank picks it up, so a dead or failing rank becomes
//! an error on all ranks within a fraction of a second instead of a hang. Rank 0, which hosts the
//! store, keeps it up after a failure until every rank's watcher has read it (at most 2 s): a
//! watcher between two polls would otherwise find the store closed and learn nothing.

use crate::dtype::{DataType, Element};
use crate::engine::{self, Area, Backoff, Context, Layout, Placement, Prepared, Workspace};
use crate::env::{self, LaunchInfo};
use crate::error::{Error, Result};
use crate::header::{OpDesc, NO_ROOT};
use crate::hierarchical::{self, HostLayout};
use crate::op::{OpKind, ReduceOp};
use crate::reduce;
use crate::schedule::{self, Action, BufId, Region, Schedule, Step};
use crate::tree;
use crate::tuning::{Choice, Tuner};
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weftcc_topology::tuner::{Algorithm, Calibration, Protocol, Selection};
use weftcc_transports::mesh::{Mesh, MeshConfig};
use weftcc_transports::store::{StoreClient, StoreServer};
use weftcc_transports::TransportError;

/// Default largest message (slice) of a pipelined transfer, in bytes (`WEFT_SLICE_BYTES`).
pub const DEFAULT_SLICE_BYTES: usize = 256 * 1024;
/// How often the watcher thread re-polls the store for a job-wide abort.
const WATCH_PERIOD: Duration = Duration::from_millis(100);
/// Longest a failure report waits on the store.
const ALARM_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest the store's host, dropping a failed communicator, waits for the other ranks' watchers
/// to read the failure (a rank that died never does).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Store keys (under a communicator's namespace, [`Inner::store_key`]): the published failure;
/// the count of watchers done with it, and the flag the last of them sets.
const ABORT_KEY: &str = "abort";
const SETTLED_KEY: &str = "settled";
const SETTLED_ALL_KEY: &str = "settled-all";

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
            std::env::var("WEFT_SOCKET_IFNAME").ok().as_deref(),
            None,
        )
        .map_err(|e| Error::Bootstrap { rank: 0, source: e })?;
        let token = random_token().map_err(|e| Error::Bootstrap { rank: 0, source: e })?;
        let server = StoreServer::start(std::net::SocketAddr::new(ip, 0), &token)
            .map_err(|e| Error::Bootstrap { rank: 0, source: e })?;
        let id = UniqueId {
            addr: server.local_addr().to_string(),
            token,
        };
        servers()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), Arc::new(StoreHost::new(server, &id)));
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

/// Why `peer` cannot be a point-to-point partner of `rank` among `size` ranks (`None`: it
/// can). Shared with the device communicator, so both reject the same calls.
pub fn peer_problem(rank: usize, size: usize, peer: usize) -> Option<String> {
    if peer >= size {
        Some(format!("peer {peer} is out of range for {size} ranks"))
    } else if peer == rank {
        Some(format!("rank {peer} cannot send to or receive from itself"))
    } else {
        None
    }
}

/// Stores started by [`UniqueId::new`] in this process, found again by rank 0's `init`.
fn servers() -> &'static Mutex<HashMap<UniqueId, Arc<StoreHost>>> {
    static SERVERS: OnceLock<Mutex<HashMap<UniqueId, Arc<StoreHost>>>> = OnceLock::new();
    SERVERS.get_or_init(Default::default)
}

/// Rank 0's bootstrap store, shared by the communicator that started it and every communicator
/// split from it; it closes when the last of them is dropped.
struct StoreHost {
    _server: StoreServer,
    id: UniqueId,
    /// The [`SETTLED_ALL_KEY`]s of failed communicators that have been dropped
    /// ([`Inner::settle_before_the_store_closes`]).
    unsettled: Mutex<Vec<String>>,
}

impl StoreHost {
    fn new(server: StoreServer, id: &UniqueId) -> StoreHost {
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
    fn settle(&self, store: Option<&mut StoreClient>) {
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

fn random_token() -> std::result::Result<String, TransportError> {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b).map_err(|e| TransportError::Io {
        what: "random job token".into(),
        message: e.to_string(),
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Settings of a communicator. [`CommConfig::from_env`] reads the `WEFT_*` variables.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// How long an operation may go without progress before it fails with `Error::Timeout`
    /// (`WEFT_TIMEOUT` seconds, default 600).
    pub timeout: Duration,
    /// Force TCP between ranks of one host (`WEFT_SHM_DISABLE=1`).
    pub shm_disable: bool,
    /// Interfaces for TCP (`WEFT_SOCKET_IFNAME`, NCCL_SOCKET_IFNAME syntax).
    pub socket_ifname: Option<String>,
    /// Host identity; ranks with equal ids use shared memory (`WEFT_HOST_ID`).
    pub host_id: String,
    /// Shared-memory ring size per peer (`WEFT_BUFFSIZE`).
    pub buffsize: usize,
    /// Largest message of a pipelined transfer (`WEFT_SLICE_BYTES`).
    pub slice_bytes: usize,
    /// Idle policy while waiting: spin (`WEFT_SPIN_US`), then yield (`WEFT_YIELD_US`), then
    /// sleep until a peer signals.
    pub backoff: Backoff,
    /// Spin used instead of `backoff.spin` when this host runs more ranks than it has CPUs: a
    /// spinning rank then only delays the peer it waits for (measured with 4 ranks on 2 cores:
    /// 8 B all-reduce 5.7 → 3.3 µs without the spin). `None` keeps `backoff.spin`; `from_env`
    /// sets `None` when `WEFT_SPIN_US` is given.
    pub oversubscribed_spin: Option<Duration>,
    /// Largest operation (its largest buffer, bytes) whose messages are sent pinned, i.e. single
    /// copy over shared memory (`WEFT_SHM_CMA_MAX_OP`); only collectives whose receivers copy
    /// (all-gather, broadcast, all-to-all, send/recv) use it. `None` keeps the measured
    /// defaults: no bound for all-gather, all-to-all and send/recv, [`DEFAULT_PINNED_MAX_BYTES`]
    /// for broadcast, whose pipelined cross-memory copies of data no longer in cache were
    /// measured slower than the ring (8 MiB, 2 ranks, in place: 630 → 740–790 µs).
    pub pinned_max_bytes: Option<usize>,
    /// Algorithms the tuner may choose (`WEFT_ALGO`, NCCL_ALGO syntax: `ring`, `tree`, `rd`,
    /// `hier`, `^tree`, `allreduce:tree;broadcast:ring`); unrestricted by default.
    pub algo: Selection<Algorithm>,
    /// Protocols (`WEFT_PROTO`, NCCL_PROTO syntax). The CPU transports move bulk data with
    /// `Simple` (a value that excludes it is reported once and otherwise ignored); shared memory
    /// sends writes of up to [`weftcc_transports::shm::LL_MAX`] bytes as `LL` messages unless the
    /// value excludes `LL` for every collective (the transport does not know the collective).
    pub proto: Selection<Protocol>,
    /// Measured link figures for the tuner (`WEFT_CALIBRATION=FILE`, as saved by
    /// `weft topo --save-calibration`); built-in figures otherwise.
    pub calibration: Option<Calibration>,
}

impl CommConfig {
    /// Defaults overridden by the environment.
    pub fn from_env() -> Result<CommConfig> {
        let size = |name: &str, default: usize| -> Result<usize> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => parse_size(&v)
                    .filter(|&n| n > 0)
                    .ok_or_else(|| Error::Config(format!("{name}={v:?} is not a positive size"))),
                _ => Ok(default),
            }
        };
        let micros = |name: &str, default: Duration| -> Result<Duration> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse::<u64>()
                    .map(Duration::from_micros)
                    .map_err(|_| {
                        Error::Config(format!("{name}={v:?} is not a number of microseconds"))
                    }),
                _ => Ok(default),
            }
        };
        Ok(CommConfig {
            timeout: env::timeout_from_env()?,
            shm_disable: env::flag("WEFT_SHM_DISABLE"),
            socket_ifname: std::env::var("WEFT_SOCKET_IFNAME")
                .ok()
                .filter(|s| !s.is_empty()),
            host_id: weftcc_transports::mesh::host_id(),
            buffsize: size("WEFT_BUFFSIZE", weftcc_transports::shm::DEFAULT_BUFFSIZE)?,
            slice_bytes: size("WEFT_SLICE_BYTES", DEFAULT_SLICE_BYTES)?,
            algo: Selection::from_env("WEFT_ALGO").map_err(|e| Error::Config(e.to_string()))?,
            proto: Selection::from_env("WEFT_PROTO").map_err(|e| Error::Config(e.to_string()))?,
            calibration: match std::env::var("WEFT_CALIBRATION") {
                Ok(path) if !path.trim().is_empty() => {
                    let text = std::fs::read_to_string(path.trim())
                        .map_err(|e| Error::Config(format!("WEFT_CALIBRATION={path:?}: {e}")))?;
                    Some(
                        Calibration::from_json(&text).map_err(|e| {
                            Error::Config(format!("WEFT_CALIBRATION={path:?}: {e}"))
                        })?,
                    )
                }
                _ => None,
            },
            backoff: Backoff {
                spin: micros("WEFT_SPIN_US", Backoff::default().spin)?,
                yield_for: micros("WEFT_YIELD_US", Backoff::default().yield_for)?,
            },
            oversubscribed_spin: match std::env::var("WEFT_SPIN_US") {
                Ok(v) if !v.trim().is_empty() => None,
                _ => Some(Duration::ZERO),
            },
            pinned_max_bytes: match std::env::var("WEFT_SHM_CMA_MAX_OP") {
                Ok(v) if !v.trim().is_empty() => Some(size("WEFT_SHM_CMA_MAX_OP", 0)?),
                _ => None,
            },
        })
    }
}

/// The largest write shared memory sends as a low-latency message: `WEFT_SHM_LL_MAX` (default
/// [`weftcc_transports::shm::LL_MAX`]), or 0 when `proto` excludes `LL` for every collective.
fn shm_low_latency_max(proto: &Selection<Protocol>) -> usize {
    let ll_allowed = weftcc_topology::tuner::Collective::ALL
        .into_iter()
        .any(|c| proto.allows(c, Protocol::Ll));
    if ll_allowed {
        weftcc_transports::shm::ll_max_bytes()
    } else {
        0
    }
}

/// Logs (once per process) that `WEFT_PROTO` excludes the only bulk protocol the CPU
/// transports implement for some collective.
fn warn_unimplemented_protocols(proto: &Selection<Protocol>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let excluded: Vec<&str> = weftcc_topology::tuner::Collective::ALL
        .into_iter()
        .filter(|&c| !proto.allows(c, Protocol::Simple))
        .map(|c| c.name())
        .collect();
    if !excluded.is_empty() {
        ONCE.call_once(|| {
            tracing::warn!(
                target: "weftcc::tuning",
                collectives = %excluded.join(","),
                "WEFT_PROTO excludes Simple, the only protocol of the CPU transports; ignored"
            );
        });
    }
}

/// Parses `4194304`, `512K`, `4M`, `1G` (binary multiples).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1usize << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(mult)
}

/// The error that stopped the communicator, and the operation running when it did.
struct Poison {
    error: Mutex<Option<Error>>,
    set: AtomicBool,
}

struct Inner {
    rank: usize,
    size: usize,
    namespace: String,
    config: CommConfig,
    /// Chooses each call's algorithm.
    tuner: Tuner,
    timeout_ms: AtomicU64,
    abort: AtomicBool,
    poison: Poison,
    /// Kind and sequence number of the operation running now (for errors raised elsewhere).
    current: CurrentOp,
    turn: Turn,
    next_ticket: AtomicU64,
    state: Mutex<State>,
    /// Connection to the bootstrap store for splits.
    store: Mutex<StoreClient>,
    /// Connection to the store with a short timeout, for publishing failures: reporting an error
    /// must never wait long on a store that is itself stuck.
    alarm: Mutex<StoreClient>,
    store_addr: String,
    token: String,
    /// Keeps rank 0's store alive while any communicator using it lives.
    store_host: Option<Arc<StoreHost>>,
    splits: AtomicU64,
    watcher_stop: AtomicBool,
    /// The poison's cause was left on every connection ([`Inner::leave_farewell`]).
    farewell_left: AtomicBool,
}

/// Issue order of operations: which ticket executes now, and how many callers wait for their
/// turn. Atomics, so that a caller whose turn it already is (a single thread issuing blocking
/// calls, the common case) takes no lock; the mutex and condition variable only serve waiters.
#[derive(Default)]
struct Turn {
    now: AtomicU64,
    waiters: AtomicU64,
    lock: Mutex<()>,
    changed: Condvar,
}

impl Turn {
    /// Wakes every waiter. Taking the lock first means a waiter that saw the old state is
    /// already inside `wait_timeout` (it checks the state while holding the lock).
    fn wake_all(&self) {
        drop(lock(&self.lock));
        self.changed.notify_all();
    }
}

/// Kind and sequence number of the operation running now, readable without a lock by the
/// threads that report failures: one word (kind in the top byte), so a reader never pairs one
/// operation's kind with another's sequence number.
#[derive(Default)]
struct CurrentOp(AtomicU64);

impl CurrentOp {
    const SEQ_BITS: u32 = 56;

    fn set(&self, kind: OpKind, seq: u64) {
        let word = (u64::from(kind as u8) << Self::SEQ_BITS) | (seq & ((1 << Self::SEQ_BITS) - 1));
        self.0.store(word, Ordering::Relaxed);
    }

    fn get(&self) -> (OpKind, u64) {
        let word = self.0.load(Ordering::Relaxed);
        let kind = OpKind::from_code((word >> Self::SEQ_BITS) as u8).unwrap_or(OpKind::Barrier);
        (kind, word & ((1 << Self::SEQ_BITS) - 1))
    }
}

struct State {
    mesh: Mesh,
    scratch: Vec<u64>,
    /// Prepared schedules of recent distinct calls (a training loop repeats the same few).
    schedules: HashMap<ScheduleKey, Arc<Prepared>, BuildHasherDefault<KeyHasher>>,
    /// The previous call's shape and its prepared schedule: a repeated call (a benchmark loop,
    /// a training step's buckets of one size) skips the tuner and schedule lookups.
    last: Option<(CallShape, Arc<Prepared>)>,
    /// The tuner's choice per (collective, bytes) already asked for.
    choices: HashMap<(OpKind, usize), Choice, BuildHasherDefault<KeyHasher>>,
    workspace: Workspace,
    coll_seq: u64,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
}

/// A group of ranks that run collectives together. `Send + Sync`: share it by reference (or in
/// an `Arc`) to call [`Communicator::abort`] from another thread.
pub struct Communicator {
    inner: Arc<Inner>,
    worker: Mutex<Option<Worker>>,
    watcher: Option<JoinHandle<()>>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("namespace", &self.inner.namespace)
            .finish()
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct Worker {
    jobs: mpsc::Sender<Job>,
    thread: JoinHandle<()>,
}

impl Communicator {
    /// Joins the job described by the launcher's environment: `weft run`, torchrun, SLURM or
    /// Open MPI variables (see [`LaunchInfo`]), with settings from `WEFT_*` variables.
    pub fn from_env() -> Result<Communicator> {
        let info = LaunchInfo::from_env()?;
        let id = UniqueId {
            addr: join_host_port(&info.master_addr, info.master_port),
            token: info.token.clone(),
        };
        Communicator::init_with(info.rank, info.world_size, &id, CommConfig::from_env()?)
    }

    /// Joins the job identified by `id` as `rank` of `nranks`. Rank 0 serves the bootstrap
    /// store (started by [`UniqueId::new`] in this process, or here on the id's port).
    pub fn init(rank: usize, nranks: usize, id: &UniqueId) -> Result<Communicator> {
        Communicator::init_with(rank, nranks, id, CommConfig::from_env()?)
    }

    /// [`Communicator::init`] with explicit settings.
    pub fn init_with(
        rank: usize,
        nranks: usize,
        id: &UniqueId,
        config: CommConfig,
    ) -> Result<Communicator> {
        crate::logging::init();
        if nranks == 0 || rank >= nranks {
            return Err(Error::Config(format!(
                "rank {rank} is out of range for {nranks} ranks"
            )));
        }
        let boot = |source: TransportError| Error::Bootstrap { rank, source };
        let server = if rank == 0 {
            let existing = servers()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(id);
            match existing {
                Some(s) => Some(s),
                None => {
                    let bind = bind_address(&id.addr).map_err(boot)?;
                    let server = StoreServer::start(bind, &id.token).map_err(boot)?;
                    Some(Arc::new(StoreHost::new(server, id)))
                }
            }
        } else {
            None
        };
        let client = StoreClient::connect(&id.addr, &id.token, config.timeout).map_err(boot)?;
        Communicator::build(rank, nranks, "c".to_string(), config, client, id, server)
    }

    fn build(
        rank: usize,
        nranks: usize,
        namespace: String,
        config: CommConfig,
        mut client: StoreClient,
        id: &UniqueId,
        store_host: Option<Arc<StoreHost>>,
    ) -> Result<Communicator> {
        let boot = |source: TransportError| Error::Bootstrap { rank, source };
        let mesh_config = MeshConfig {
            rank,
            nranks,
            host_id: config.host_id.clone(),
            shm_disable: config.shm_disable,
            socket_ifname: config.socket_ifname.clone(),
            token: id.token.clone(),
            namespace: namespace.clone(),
            timeout: config.timeout,
            buffsize: config.buffsize,
            shm_ll_max: shm_low_latency_max(&config.proto),
        };
        // Every store connection first: the mesh's closing barrier then guarantees that all ranks
        // hold theirs before any rank can return (and rank 0 drop the store).
        let watch_client =
            StoreClient::connect(&id.addr, &id.token, config.timeout).map_err(boot)?;
        let alarm = StoreClient::connect(&id.addr, &id.token, ALARM_TIMEOUT).map_err(boot)?;
        let mesh = Mesh::establish(&mut client, &mesh_config).map_err(boot)?;
        let mut config = config;
        let local_ranks = mesh
            .host_ids()
            .iter()
            .filter(|h| Some(*h) == mesh.host_ids().get(rank))
            .count();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let (Some(spin), true) = (config.oversubscribed_spin, local_ranks > cpus) {
            tracing::info!(target: "weftcc::init", rank, local_ranks, cpus, "more ranks than CPUs on this host: spin {spin:?} before yielding");
            config.backoff.spin = spin;
        }
        let tuner = Tuner::new(
            HostLayout::from_labels(mesh.host_ids()),
            !config.shm_disable,
            config.algo.clone(),
            config.calibration.as_ref(),
        );
        if rank == 0 {
            warn_unimplemented_protocols(&config.proto);
        }
        let inner = Arc::new(Inner {
            rank,
            size: nranks,
            namespace,
            tuner,
            timeout_ms: AtomicU64::new(config.timeout.as_millis().min(u64::MAX as u128) as u64),
            config,
            abort: AtomicBool::new(false),
            poison: Poison {
                error: Mutex::new(None),
                set: AtomicBool::new(false),
            },
            current: CurrentOp::default(),
            turn: Turn::default(),
            next_ticket: AtomicU64::new(0),
            state: Mutex::new(State {
                mesh,
                scratch: Vec::new(),
                schedules: HashMap::default(),
                last: None,
                choices: HashMap::default(),
                workspace: Workspace::default(),
                coll_seq: 0,
                send_seq: vec![0; nranks],
                recv_seq: vec![0; nranks],
            }),
            store: Mutex::new(client),
            alarm: Mutex::new(alarm),
            store_addr: id.addr.clone(),
            token: id.token.clone(),
            store_host,
            splits: AtomicU64::new(0),
            watcher_stop: AtomicBool::new(false),
            farewell_left: AtomicBool::new(false),
        });
        let watcher = if nranks > 1 {
            let w = Arc::clone(&inner);
            Some(
                std::thread::Builder::new()
                    .name(format!("weft-watch-{rank}"))
                    .spawn(move || watch(w, watch_client))
                    .map_err(|e| boot(TransportError::io("spawning the watcher thread", e)))?,
            )
        } else {
            None
        };
        tracing::info!(target: "weftcc::init", rank, nranks, "communicator ready");
        Ok(Communicator {
            inner,
            worker: Mutex::new(None),
            watcher,
        })
    }

    /// This rank's index, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Transport used to reach `peer` ("shm", "tcp"), `None` for this rank itself.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        lock(&self.inner.state).mesh.transport_name(peer)
    }

    /// Per-operation timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.timeout_ms.load(Ordering::Relaxed))
    }

    /// Changes the per-operation timeout for operations that start after this call.
    pub fn set_timeout(&self, timeout: Duration) {
        let ms = timeout.as_millis().clamp(1, u64::MAX as u128) as u64;
        self.inner.timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// Aborts the communicator: every waiting call returns [`Error::Aborted`] within a few
    /// milliseconds, every later call fails, and other ranks are told. Callable from any thread.
    pub fn abort(&self) {
        self.inner.abort.store(true, Ordering::SeqCst);
        let e = Error::Aborted {
            rank: self.inner.rank,
            by: None,
            reason: "abort() called".into(),
        };
        self.inner.fail(e);
        self.inner.leave_farewell();
        self.inner.turn.wake_all();
    }

    /// The error that poisoned this communicator, if any (NCCL's `ncclCommGetAsyncError`).
    pub fn error(&self) -> Option<Error> {
        self.inner.poisoned()
    }

    // ----- collectives, blocking -----

    /// All-reduce from `send` into `recv` (equal lengths).
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let call = RawOp::new(OpKind::AllReduce, T::DTYPE, send.len()).with_op(op);
        self.execute_raw(
            call,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// All-reduce in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let call = RawOp::new(OpKind::AllReduce, T::DTYPE, buf.len()).with_op(op);
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    /// Reduce to `root`: `recv` is written on the root only (other ranks may pass an empty slice).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let call = RawOp::new(OpKind::Reduce, T::DTYPE, send.len())
            .with_op(op)
            .with_root(root);
        self.execute_raw(
            call,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// Reduce to `root` in place (non-root buffers are left unchanged).
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let call = RawOp::new(OpKind::Reduce, T::DTYPE, buf.len())
            .with_op(op)
            .with_root(root);
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    /// Broadcast `send` on the root into `recv` on every rank (non-roots may pass an empty `send`).
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let call = RawOp::new(OpKind::Broadcast, T::DTYPE, recv.len()).with_root(root);
        self.execute_raw(
            call,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// Broadcast in place from `root`.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let call = RawOp::new(OpKind::Broadcast, T::DTYPE, buf.len()).with_root(root);
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    /// All-gather: `recv` (size × `send.len()`) receives every rank's `send`, in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let call = RawOp::new(OpKind::AllGather, T::DTYPE, send.len());
        self.execute_raw(
            call,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// All-gather in place: this rank's contribution is block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let count = buf.len() / self.size();
        let call = RawOp::new(OpKind::AllGather, T::DTYPE, count);
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    /// Reduce-scatter: `send` has size × `recv.len()` elements; block `rank` of the element-wise
    /// reduction lands in `recv`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let call = RawOp::new(OpKind::ReduceScatter, T::DTYPE, recv.len()).with_op(op);
        self.execute_raw(
            call,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// Reduce-scatter in place: the result is block `rank` of `buf`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let count = buf.len() / self.size();
        let call = RawOp::new(OpKind::ReduceScatter, T::DTYPE, count).with_op(op);
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    /// All-to-all: block j of `send` goes to rank j, block i of `recv` comes from rank i.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let call = RawOp::new(OpKind::AllToAll, T::DTYPE, send.len() / self.size());
        self.execute_raw(
            call,
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// All-to-all in place (uses a scratch copy of `buf`).
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let call = RawOp::new(OpKind::AllToAll, T::DTYPE, buf.len() / self.size());
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    /// Blocks until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.execute_raw(
            RawOp::new(OpKind::Barrier, DataType::Uint8, 0),
            None,
            &mut [],
        )
    }

    /// Sends `buf` to `peer`, which must post a matching [`Communicator::recv`]. Like
    /// `MPI_Send`, it may return once the bytes are buffered (small messages) rather than when
    /// the peer has received them; `buf` may be reused either way.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.group().send(buf, peer).run()
    }

    /// Receives into `buf` from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.group().recv(buf, peer).run()
    }

    /// Starts a group of sends and receives that run together (so pairs of ranks can exchange
    /// without deadlock). Messages between one ordered pair of ranks match in call order.
    pub fn group(&self) -> Group<'_> {
        Group {
            comm: self,
            sends: Vec::new(),
            recvs: Vec::new(),
        }
    }

    /// Untyped entry point (for the C bindings and tools): runs `call` with `send` as input
    /// (`None` for in-place) and `recv` as output, both raw bytes of `call.dtype`.
    /// Point-to-point kinds are not accepted here; use [`Communicator::group`].
    pub fn execute_raw(&self, call: RawOp, send: Option<&[u8]>, recv: &mut [u8]) -> Result<()> {
        self.inner.check()?;
        let plan = self.inner.plan(&call, send.map(<[u8]>::len), recv.len())?;
        self.inner.run_blocking(call.kind, |inner, st| {
            inner.run_planned(st, &call, &plan, send, recv)
        })
    }

    // ----- collectives, asynchronous -----

    /// Starts an in-place all-reduce of an owned buffer; the handle gives it back when done.
    pub fn all_reduce_async<T: Element, B>(&self, buf: B, op: ReduceOp) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, move |n| {
            RawOp::new(OpKind::AllReduce, T::DTYPE, n).with_op(op)
        })
    }

    /// Starts an in-place broadcast from `root` of an owned buffer.
    pub fn broadcast_async<T: Element, B>(&self, buf: B, root: usize) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, move |n| {
            RawOp::new(OpKind::Broadcast, T::DTYPE, n).with_root(root)
        })
    }

    /// Starts an in-place reduce to `root` of an owned buffer.
    pub fn reduce_async<T: Element, B>(&self, buf: B, op: ReduceOp, root: usize) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, move |n| {
            RawOp::new(OpKind::Reduce, T::DTYPE, n)
                .with_op(op)
                .with_root(root)
        })
    }

    /// Starts an in-place all-gather (contribution in block `rank`) of an owned buffer.
    pub fn all_gather_async<T: Element, B>(&self, buf: B) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let size = self.size();
        self.submit_in_place(buf, move |n| {
            RawOp::new(OpKind::AllGather, T::DTYPE, n / size)
        })
    }

    /// Starts an in-place reduce-scatter (result in block `rank`) of an owned buffer.
    pub fn reduce_scatter_async<T: Element, B>(&self, buf: B, op: ReduceOp) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let size = self.size();
        self.submit_in_place(buf, move |n| {
            RawOp::new(OpKind::ReduceScatter, T::DTYPE, n / size).with_op(op)
        })
    }

    /// Starts an in-place all-to-all of an owned buffer.
    pub fn all_to_all_async<T: Element, B>(&self, buf: B) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let size = self.size();
        self.submit_in_place(buf, move |n| {
            RawOp::new(OpKind::AllToAll, T::DTYPE, n / size)
        })
    }

    /// Starts a barrier.
    pub fn barrier_async(&self) -> Handle<()> {
        let inner = Arc::clone(&self.inner);
        self.submit((), move |_| {
            let call = RawOp::new(OpKind::Barrier, DataType::Uint8, 0);
            let plan = inner.plan(&call, None, 0)?;
            inner.run_blocking(call.kind, |i, st| {
                i.run_planned(st, &call, &plan, None, &mut [])
            })
        })
    }

    /// Starts sending an owned buffer to `peer`.
    pub fn send_async<T: Element, B>(&self, buf: B, peer: usize) -> Handle<B>
    where
        B: AsRef<[T]> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        self.submit(buf, move |b| {
            let bytes: &[u8] = bytemuck::cast_slice(b.as_ref());
            inner.run_group(&[(peer, bytes)], &mut [])
        })
    }

    /// Starts receiving from `peer` into an owned buffer.
    pub fn recv_async<T: Element, B>(&self, buf: B, peer: usize) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        self.submit(buf, move |b| {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(b.as_mut());
            inner.run_group(&[], &mut [(peer, bytes)])
        })
    }

    fn submit_in_place<T: Element, B>(
        &self,
        buf: B,
        make: impl FnOnce(usize) -> RawOp + Send + 'static,
    ) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        self.submit(buf, move |b| {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(b.as_mut());
            let call = make(bytes.len() / T::DTYPE.size());
            let plan = inner.plan(&call, None, bytes.len())?;
            inner.run_blocking(call.kind, |i, st| {
                i.run_planned(st, &call, &plan, None, bytes)
            })
        })
    }

    /// Queues `work` on the worker thread behind every operation issued before it.
    fn submit<B: Send + 'static>(
        &self,
        mut buf: B,
        work: impl FnOnce(&mut B) -> Result<()> + Send + 'static,
    ) -> Handle<B> {
        let done = Arc::new(Completion::<B>::default());
        if let Err(e) = self.inner.check() {
            done.finish(Err(e));
            return Handle { done };
        }
        // The ticket is taken now, on the issuing thread: that fixes the execution order.
        let ticket = self.inner.next_ticket.fetch_add(1, Ordering::SeqCst);
        let finished = Arc::clone(&done);
        let inner = Arc::clone(&self.inner);
        let job: Job = Box::new(move || {
            let result = match inner.wait_turn(ticket) {
                Ok(()) => {
                    let r = TICKET.with(|t| {
                        t.set(Some(ticket));
                        let r = work(&mut buf);
                        t.set(None);
                        r
                    });
                    inner.end_turn(ticket);
                    r.map(|()| buf)
                }
                Err(e) => {
                    inner.end_turn(ticket);
                    Err(e)
                }
            };
            finished.finish(result);
        });
        let mut worker = lock(&self.worker);
        if worker.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name(format!("weft-worker-{}", self.inner.rank))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                });
            match spawned {
                Ok(thread) => *worker = Some(Worker { jobs: tx, thread }),
                Err(e) => {
                    self.inner.end_turn(ticket);
                    let e = Error::Config(format!("cannot start the worker thread: {e}"));
                    done.finish(Err(e));
                    return Handle { done };
                }
            }
        }
        if let Some(w) = worker.as_ref() {
            if let Err(mpsc::SendError(job)) = w.jobs.send(job) {
                // The worker is gone (cannot happen while we hold it): run inline.
                job();
            }
        }
        Handle { done }
    }

    /// Splits into sub-communicators: ranks passing the same `color` form one, ordered by
    /// (`key`, old rank). Ranks passing `None` take part but get no communicator. Collective
    /// over this communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        self.inner.check()?;
        let inner = &self.inner;
        let index = inner.splits.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("{}/split{}", inner.namespace, index);
        let members = inner.run_blocking(OpKind::Barrier, |inner, _st| {
            let mut store = lock(&inner.store);
            let boot = |source| Error::Bootstrap {
                rank: inner.rank,
                source,
            };
            let mine = match color {
                Some(c) => format!("{c} {key}"),
                None => "none".to_string(),
            };
            store
                .set(&format!("{prefix}/{}", inner.rank), mine.as_bytes())
                .map_err(boot)?;
            let mut members = Vec::new();
            for r in 0..inner.size {
                let v = store
                    .get(&format!("{prefix}/{r}"), inner.timeout())
                    .map_err(boot)?;
                let v = String::from_utf8_lossy(&v).to_string();
                let mut it = v.split_whitespace();
                if let (Some(c), Some(k)) = (it.next(), it.next()) {
                    if let (Ok(c), Ok(k)) = (c.parse::<u32>(), k.parse::<i64>()) {
                        if Some(c) == color {
                            members.push((k, r));
                        }
                    }
                }
            }
            members.sort_unstable();
            Ok(members)
        })?;
        let Some(color) = color else { return Ok(None) };
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == inner.rank)
            .ok_or_else(|| Error::Internal {
                rank: inner.rank,
                op: OpKind::Barrier,
                seq: 0,
                reason: "this rank is missing from its own split group".into(),
            })?;
        let id = UniqueId {
            addr: inner.store_addr.clone(),
            token: inner.token.clone(),
        };
        let client =
            StoreClient::connect(&id.addr, &id.token, inner.timeout()).map_err(|source| {
                Error::Bootstrap {
                    rank: inner.rank,
                    source,
                }
            })?;
        let mut config = inner.config.clone();
        config.timeout = inner.timeout();
        Communicator::build(
            new_rank,
            members.len(),
            format!("{prefix}/c{color}"),
            config,
            client,
            &id,
            inner.store_host.clone(),
        )
        .map(Some)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Some(w) = lock(&self.worker).take() {
            drop(w.jobs);
            let _ = w.thread.join();
        }
        // A poisoned communicator's cause, if no call could leave it yet (connections close
        // when the last reference to `inner` goes).
        self.inner.leave_farewell();
        self.inner.watcher_stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.watcher.take() {
            let _ = t.join();
        }
        self.inner.settle_before_the_store_closes();
    }
}

thread_local! {
    /// The ticket a worker job holds while it runs (so its nested blocking call reuses it).
    static TICKET: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// A grouped set of sends and receives, run together by [`Group::run`].
pub struct Group<'a> {
    comm: &'a Communicator,
    sends: Vec<(usize, &'a [u8])>,
    recvs: Vec<(usize, &'a mut [u8])>,
}

impl<'a> Group<'a> {
    /// Adds a send of `buf` to `peer`.
    pub fn send<T: Element>(mut self, buf: &'a [T], peer: usize) -> Self {
        self.sends.push((peer, bytemuck::cast_slice(buf)));
        self
    }

    /// Adds a receive into `buf` from `peer`.
    pub fn recv<T: Element>(mut self, buf: &'a mut [T], peer: usize) -> Self {
        self.recvs.push((peer, bytemuck::cast_slice_mut(buf)));
        self
    }

    /// Runs every send and receive of the group; returns when all completed.
    pub fn run(mut self) -> Result<()> {
        self.comm.inner.check()?;
        self.comm.inner.run_group(&self.sends, &mut self.recvs)
    }
}

/// An untyped operation for [`Communicator::execute_raw`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawOp {
    pub kind: OpKind,
    pub dtype: DataType,
    /// Elements per rank: the all-reduce/broadcast/reduce buffer, one all-gather or
    /// reduce-scatter block, one all-to-all block.
    pub count: usize,
    pub op: ReduceOp,
    pub root: usize,
}

impl RawOp {
    /// An operation with `Sum` and root 0.
    pub fn new(kind: OpKind, dtype: DataType, count: usize) -> Self {
        RawOp {
            kind,
            dtype,
            count,
            op: ReduceOp::Sum,
            root: 0,
        }
    }

    /// Sets the reduction.
    pub fn with_op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// Sets the root.
    pub fn with_root(mut self, root: usize) -> Self {
        self.root = root;
        self
    }

    fn has_reduction(&self) -> bool {
        matches!(
            self.kind,
            OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter
        )
    }

    fn has_root(&self) -> bool {
        matches!(self.kind, OpKind::Reduce | OpKind::Broadcast)
    }
}

/// Validated shape of a call: which memory is input and output, and where.
struct Plan {
    in_place: bool,
    /// Byte offset of the logical Input inside `recv` when in place.
    input_offset: usize,
    /// Byte offset of the logical Output inside `recv` when in place.
    output_offset: usize,
    /// Bytes of the logical Input.
    input_len: usize,
}

impl Inner {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    fn poisoned(&self) -> Option<Error> {
        if !self.poison.set.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison.error).clone()
    }

    /// Fails at once when the communicator is poisoned.
    fn check(&self) -> Result<()> {
        match self.poisoned() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records the first fatal error and tells the other ranks.
    ///
    /// The job agrees on one root cause: the first rank to fail wins a counter in the store and
    /// publishes its error; a rank failing later (often because of that first failure, e.g. a
    /// neighbour that exited) adopts the published cause instead of its own.
    fn fail(&self, e: Error) {
        if self.poison.set.load(Ordering::Acquire) {
            return;
        }
        let e = self.adopt_farewell(e);
        let local = !matches!(&e, Error::Aborted { by: Some(_), .. })
            && !matches!(&e, Error::PeerLost { detail, .. } if detail.starts_with("reported by"));
        // A local abort() is its own root cause: poison at once, so neither the caller of
        // abort() nor anyone waiting depends on how fast the store answers.
        if matches!(&e, Error::Aborted { by: None, .. }) {
            if self.poison_with(e.clone()) && self.size > 1 {
                let _ = self.publish_or_adopt(e);
            }
            return;
        }
        let e = if local && self.size > 1 {
            self.publish_or_adopt(e)
        } else {
            e
        };
        self.poison_with(e);
    }

    /// Sets the poison if it is not set yet; returns whether this call set it.
    fn poison_with(&self, e: Error) -> bool {
        {
            let mut slot = lock(&self.poison.error);
            if slot.is_some() {
                return false;
            }
            tracing::warn!(target: "weftcc::error", rank = self.rank, "{e}");
            *slot = Some(e);
            self.poison.set.store(true, Ordering::Release);
        }
        self.turn.wake_all();
        true
    }

    /// On rank 0, as this communicator goes: if its failure was published in the store, leaves
    /// the key that the other ranks' watchers set once they have all read it, and if no split
    /// relative still holds the store, waits for every such key before the store closes
    /// ([`StoreHost::settle`]; a relative dropped later waits for this one's too).
    fn settle_before_the_store_closes(&self) {
        let Some(host) = &self.store_host else {
            return;
        };
        let Ok(mut store) = self.alarm.try_lock() else {
            return;
        };
        if self.size > 1
            && self.poison.set.load(Ordering::Acquire)
            && matches!(store.check(&self.store_key(ABORT_KEY)), Ok(true))
        {
            lock(&host.unsettled).push(self.store_key(SETTLED_ALL_KEY));
        }
        if Arc::strong_count(host) == 1 {
            host.settle(Some(&mut store));
        }
    }

    /// `name` under this communicator's namespace in the bootstrap store.
    fn store_key(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }

    fn publish_or_adopt(&self, e: Error) -> Error {
        let Ok(mut store) = self.alarm.try_lock() else {
            return e;
        };
        let key = self.store_key(ABORT_KEY);
        match store.add(&format!("{key}-count"), 1) {
            Ok(1) => {
                let _ = store.set(&key, self.note_of(&e).as_bytes());
                e
            }
            Ok(_) => match store.get(&key, ALARM_TIMEOUT) {
                Ok(v) => remote_error(self, &String::from_utf8_lossy(&v)).unwrap_or(e),
                Err(_) => e,
            },
            Err(_) => e,
        }
    }

    /// `e` as the store and farewell notes carry it, for [`remote_error`] to read back:
    /// `abort <rank> <reason>` or `lost <peer> <reporting rank> <detail>`, naming the rank where
    /// the failure started (this one, or the one an adopted error came from).
    fn note_of(&self, e: &Error) -> String {
        match e {
            Error::Aborted {
                by: Some(by),
                reason,
                ..
            } => {
                let prefix = format!("rank {by} failed: ");
                format!(
                    "abort {by} {}",
                    reason.strip_prefix(&prefix).unwrap_or(reason)
                )
            }
            Error::PeerLost { peer, detail, .. } => {
                match detail
                    .strip_prefix("reported by rank ")
                    .and_then(|d| d.split_once(": "))
                {
                    Some((by, rest)) => format!("lost {peer} {by} {rest}"),
                    None => format!("lost {peer} {} {detail}", self.rank),
                }
            }
            other => format!("abort {} {other}", self.rank),
        }
    }

    /// For a peer that closed its connection after failing, the cause it left there (see
    /// [`Inner::leave_farewell`]): the root cause, which the store may no longer be able to
    /// tell (it lives with rank 0). Any other error is returned as it is.
    fn adopt_farewell(&self, e: Error) -> Error {
        let peer = match &e {
            Error::PeerLost { peer, detail, .. } if !detail.starts_with("reported by") => *peer,
            _ => return e,
        };
        let Some(st) = self.try_lock_state() else {
            return e;
        };
        let note = st.mesh.farewell(peer);
        drop(st);
        note.and_then(|n| remote_error(self, &n)).unwrap_or(e)
    }

    /// Leaves the poison's cause on every connection, once, for peers that see this rank close
    /// (shared memory keeps it; see [`weftcc_transports::Connection::leave_farewell`]). Skipped
    /// while an operation holds the state; the next call (at the latest the communicator's
    /// drop) leaves it.
    fn leave_farewell(&self) {
        if self.farewell_left.load(Ordering::Acquire) {
            return;
        }
        let Some(e) = self.poisoned() else { return };
        let Some(mut st) = self.try_lock_state() else {
            return;
        };
        st.mesh.leave_farewell(&self.note_of(&e));
        self.farewell_left.store(true, Ordering::Release);
    }

    fn try_lock_state(&self) -> Option<std::sync::MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn take_ticket(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    /// Waits until `ticket` is the next to execute (or the communicator is aborted/poisoned).
    fn wait_turn(&self, ticket: u64) -> Result<()> {
        if self.turn.now.load(Ordering::SeqCst) == ticket {
            return Ok(());
        }
        self.wait_turn_slow(ticket, true)
    }

    fn end_turn(&self, ticket: u64) {
        // A caller that failed before its turn must still pass the turn on, in order.
        if self.turn.now.load(Ordering::SeqCst) != ticket {
            let _ = self.wait_turn_slow(ticket, false);
        }
        self.turn.now.store(ticket + 1, Ordering::SeqCst);
        // Waking is a system call: skip it on the common path where nobody waits. The store
        // above and the waiter's increment are both SeqCst, so either the waiter sees the new
        // turn or this load sees the waiter.
        if self.turn.waiters.load(Ordering::SeqCst) > 0 {
            self.turn.wake_all();
        }
    }

    /// Sleeps until `now` reaches `ticket`; with `check`, fails early when poisoned.
    fn wait_turn_slow(&self, ticket: u64, check: bool) -> Result<()> {
        let mut guard = lock(&self.turn.lock);
        self.turn.waiters.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if self.turn.now.load(Ordering::SeqCst) == ticket {
                break Ok(());
            }
            if check {
                if let Err(e) = self.check() {
                    break Err(e);
                }
            }
            // The timeout bounds how late a poison raised without a wake-up is noticed.
            guard = match self
                .turn
                .changed
                .wait_timeout(guard, Duration::from_millis(50))
            {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        self.turn.waiters.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Runs `f` in issue order. Inside a worker job the job's ticket is reused.
    fn run_blocking<R>(
        &self,
        kind: OpKind,
        f: impl FnOnce(&Inner, &mut State) -> Result<R>,
    ) -> Result<R> {
        let held = TICKET.with(|t| t.get());
        // A ticket of our own only when some other call holds or waits for one. When every
        // ticket taken so far has finished (`now` caught up with `next_ticket`, read in that
        // order), every call issued before this one is done, and the state lock alone orders
        // this call against one issued meanwhile from another thread (the two are concurrent:
        // neither order is promised). That saves the two locked instructions of a ticket on
        // the common path, a single thread issuing blocking calls.
        let own_ticket = if held.is_none()
            && self.next_ticket.load(Ordering::SeqCst) != self.turn.now.load(Ordering::SeqCst)
        {
            let t = self.take_ticket();
            if let Err(e) = self.wait_turn(t) {
                self.end_turn(t);
                return Err(e);
            }
            Some(t)
        } else {
            None
        };
        let result = (|| {
            self.check()?;
            let mut st = lock(&self.state);
            f(self, &mut st)
        })();
        if let Some(t) = own_ticket {
            self.end_turn(t);
        }
        if let Err(e) = &result {
            if e.is_fatal() {
                self.fail(e.clone());
                self.leave_farewell();
                // Once poisoned, the first error is the one to report: a peer that closed its
                // connections because this rank aborted is a consequence, not the cause.
                if let Some(first) = self.poisoned() {
                    return Err(first);
                }
            }
        }
        tracing::debug!(target: "weftcc::op", rank = self.rank, %kind, ok = result.is_ok());
        result
    }

    fn invalid(&self, op: OpKind, reason: String) -> Error {
        Error::InvalidArgument {
            rank: self.rank,
            op,
            reason,
        }
    }

    /// Checks a call's buffers against its count, root and kind.
    // Inlined into its one caller: returned through memory, the large `Result` was read back
    // in wider loads than it was written with (a store-forwarding stall per call).
    #[inline(always)]
    fn plan(&self, call: &RawOp, send_len: Option<usize>, recv_len: usize) -> Result<Plan> {
        let n = self.size;
        let kind = call.kind;
        let es = call.dtype.size();
        let bad = |reason: String| Err(self.invalid(kind, reason));
        if call.has_root() && call.root >= n {
            return bad(format!("root {} is out of range for {n} ranks", call.root));
        }
        let bytes = |elems: usize| {
            elems
                .checked_mul(es)
                .ok_or_else(|| self.invalid(kind, "count overflows".into()))
        };
        let count_bytes = bytes(call.count)?;
        let all_bytes = bytes(
            call.count
                .checked_mul(n)
                .ok_or_else(|| self.invalid(kind, "count overflows".into()))?,
        )?;
        let is_root = call.root == self.rank;
        let (input_len, output_len, in_off, out_off) = match kind {
            OpKind::AllReduce => (count_bytes, count_bytes, 0, 0),
            OpKind::Reduce => (count_bytes, if is_root { count_bytes } else { 0 }, 0, 0),
            OpKind::Broadcast => (if is_root { count_bytes } else { 0 }, count_bytes, 0, 0),
            OpKind::AllGather => (count_bytes, all_bytes, self.rank * count_bytes, 0),
            OpKind::ReduceScatter => (all_bytes, count_bytes, 0, self.rank * count_bytes),
            OpKind::AllToAll => (all_bytes, all_bytes, 0, 0),
            OpKind::Barrier => (0, 0, 0, 0),
            OpKind::SendRecv => return bad("use group()/send()/recv() for point-to-point".into()),
        };
        match send_len {
            Some(s) => {
                // Out of place. Non-roots of reduce/broadcast may pass anything for the unused side.
                let send_ok = s == input_len || (kind == OpKind::Broadcast && !is_root);
                if !send_ok {
                    return bad(format!(
                        "send buffer has {s} bytes, expected {input_len} ({} × {} elements)",
                        call.dtype,
                        input_len / es.max(1)
                    ));
                }
                let recv_ok = recv_len == output_len || (kind == OpKind::Reduce && !is_root);
                if !recv_ok {
                    return bad(format!("receive buffer has {recv_len} bytes, expected {output_len} ({} × {} elements)", call.dtype, output_len / es.max(1)));
                }
                Ok(Plan {
                    in_place: false,
                    input_offset: 0,
                    output_offset: 0,
                    input_len,
                })
            }
            None => {
                let whole = match kind {
                    OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => all_bytes,
                    OpKind::Barrier => 0,
                    _ => count_bytes,
                };
                if recv_len != whole {
                    return bad(format!(
                        "buffer has {recv_len} bytes, expected {whole} ({} elements of {}{})",
                        whole / es.max(1),
                        call.dtype,
                        if matches!(
                            kind,
                            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll
                        ) {
                            format!(", a multiple of {n} ranks")
                        } else {
                            String::new()
                        }
                    ));
                }
                Ok(Plan {
                    in_place: true,
                    input_offset: in_off,
                    output_offset: out_off,
                    input_len,
                })
            }
        }
    }

    fn slice_elems(&self, dtype: DataType) -> usize {
        (self.config.slice_bytes / dtype.size()).max(1)
    }

    /// The prepared schedule of a call of this shape: the tuner's choice (remembered per
    /// collective and size) and the schedule (cached per [`ScheduleKey`]), built on a miss.
    fn prepare(
        &self,
        st: &mut State,
        call: &RawOp,
        shape: CallShape,
        seq: u64,
    ) -> Result<Arc<Prepared>> {
        let (r, n, count) = (self.rank, self.size, call.count);
        let slice = self.slice_elems(call.dtype);
        // nccl-tests size: the largest user buffer of the call.
        let user_bytes = match call.kind {
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => count.saturating_mul(n),
            _ => count,
        }
        .saturating_mul(call.dtype.size());
        // The model's answer depends only on the collective and size: remember it (evaluating
        // every algorithm's cost was an eighth of an 8-byte all-reduce).
        let choice = match st.choices.get(&(call.kind, user_bytes)) {
            _ if n == 1 => Choice::Ring,
            Some(&c) => {
                tracing::debug!(target: "weftcc::tuning", rank = r, op = %call.kind, seq, bytes = user_bytes, algo = c.name(), "algorithm chosen (remembered)");
                c
            }
            None => {
                let c = self.tuner.choose(call.kind, user_bytes, r, seq);
                if st.choices.len() >= SCHEDULE_CACHE_ENTRIES {
                    st.choices.clear();
                }
                st.choices.insert((call.kind, user_bytes), c);
                c
            }
        };
        let key = ScheduleKey {
            kind: call.kind,
            count,
            slice,
            root: shape.root,
            in_place: shape.in_place,
            algo: choice,
        };
        if let Some(prepared) = st.schedules.get(&key) {
            return Ok(Arc::clone(prepared));
        }
        let sched = match (call.kind, choice) {
            (OpKind::AllReduce, Choice::Rd) => {
                schedule::recursive_doubling_all_reduce(r, n, count, slice)
            }
            (OpKind::AllReduce, Choice::Tree) => tree::tree_all_reduce(r, n, count, slice),
            (OpKind::AllReduce, Choice::Hier) => {
                hierarchical::hierarchical_all_reduce(r, self.tuner.layout(), count, slice)
            }
            (OpKind::AllReduce, _) => schedule::ring_all_reduce(r, n, count, slice),
            (OpKind::Reduce, Choice::Tree) => tree::tree_reduce(r, n, call.root, count, slice),
            (OpKind::Reduce, _) => schedule::chain_reduce(r, n, call.root, count, slice),
            (OpKind::Broadcast, Choice::Tree) => {
                tree::tree_broadcast(r, n, call.root, count, slice)
            }
            (OpKind::Broadcast, _) => schedule::chain_broadcast(r, n, call.root, count, slice),
            (OpKind::AllGather, Choice::Rd) if n.is_power_of_two() => {
                schedule::recursive_doubling_all_gather(r, n, count, slice)
            }
            (OpKind::AllGather, _) => schedule::ring_all_gather(r, n, count, slice),
            (OpKind::ReduceScatter, Choice::Rd) if n.is_power_of_two() => {
                schedule::recursive_halving_reduce_scatter(r, n, count, slice)
            }
            (OpKind::ReduceScatter, _) => schedule::ring_reduce_scatter(r, n, count, slice),
            (OpKind::AllToAll, _) => {
                schedule::pairwise_all_to_all(r, n, count, slice, shape.in_place)
            }
            (OpKind::Barrier, _) => schedule::dissemination_barrier(r, n),
            (OpKind::SendRecv, _) => {
                return Err(self.invalid(call.kind, "point-to-point through execute_raw".into()))
            }
        }
        .map_err(|e| Error::Internal {
            rank: r,
            op: call.kind,
            seq,
            reason: e.to_string(),
        })?;
        if st.schedules.len() >= SCHEDULE_CACHE_ENTRIES {
            st.schedules.clear();
        }
        let prepared = Arc::new(Prepared::new(sched));
        st.schedules.insert(key, Arc::clone(&prepared));
        Ok(prepared)
    }

    /// Builds the schedule of a validated call and executes it.
    fn run_planned(
        &self,
        st: &mut State,
        call: &RawOp,
        plan: &Plan,
        send: Option<&[u8]>,
        recv: &mut [u8],
    ) -> Result<()> {
        let (r, n, count) = (self.rank, self.size, call.count);
        st.coll_seq += 1;
        let seq = st.coll_seq;
        self.current.set(call.kind, seq);
        let shape = CallShape {
            kind: call.kind,
            count,
            esize: call.dtype.size(),
            root: if call.has_root() { call.root } else { 0 },
            in_place: plan.in_place && call.kind == OpKind::AllToAll,
        };
        if !matches!(&st.last, Some((last, _)) if *last == shape) {
            let prepared = self.prepare(st, call, shape, seq)?;
            st.last = Some((shape, prepared));
        }
        let desc = OpDesc {
            kind: call.kind,
            seq,
            dtype: call.dtype,
            count: count as u64,
            redop: if call.has_reduction() {
                call.op.code()
            } else {
                0xff
            },
            root: if call.has_root() {
                call.root as u32
            } else {
                NO_ROOT
            },
        };
        let internal = |reason: String| Error::Internal {
            rank: r,
            op: call.kind,
            seq,
            reason,
        };

        // PreMulSum: scale this rank's input once; the algorithm then sums.
        let scaled: Option<Vec<u64>> = match call.op {
            ReduceOp::PreMulSum(factor) if call.has_reduction() => {
                let src: &[u8] = match send {
                    Some(s) => s,
                    None => &recv[plan.input_offset..plan.input_offset + plan.input_len],
                };
                let mut tmp = vec![0u64; plan.input_len.div_ceil(8)];
                reduce::scale_into(
                    call.dtype,
                    &mut bytemuck::cast_slice_mut(&mut tmp)[..plan.input_len],
                    src,
                    factor,
                )
                .map_err(|e| internal(e.to_string()))?;
                Some(tmp)
            }
            _ => None,
        };

        let State {
            mesh,
            scratch,
            last,
            workspace,
            ..
        } = st;
        let Some((_, prepared)) = last.as_ref() else {
            return Err(internal("schedule cache".into()));
        };
        let scratch_bytes = prepared.schedule().scratch_elems * call.dtype.size();
        if scratch.len() * 8 < scratch_bytes {
            scratch.resize(scratch_bytes.div_ceil(8), 0);
        }
        let scratch_area: &mut [u8] =
            &mut bytemuck::cast_slice_mut(scratch.as_mut_slice())[..scratch_bytes];
        // Areas: 0 the receive buffer, 1 scratch, 2 the send buffer (or the scaled input).
        let (input_area, input) = match (scaled.as_ref(), send) {
            (Some(tmp), _) => (
                &bytemuck::cast_slice(tmp.as_slice())[..plan.input_len],
                Placement {
                    area: 2,
                    byte_offset: 0,
                },
            ),
            (None, Some(s)) => (
                s,
                Placement {
                    area: 2,
                    byte_offset: 0,
                },
            ),
            (None, None) => (
                &[][..],
                Placement {
                    area: 0,
                    byte_offset: plan.input_offset,
                },
            ),
        };
        let mut areas = [
            Area::ReadWrite(recv),
            Area::ReadWrite(scratch_area),
            Area::ReadOnly(input_area),
        ];
        let layout = Layout::Fixed {
            input,
            output: Placement {
                area: 0,
                byte_offset: plan.output_offset,
            },
            scratch: Placement {
                area: 1,
                byte_offset: 0,
            },
        };
        self.execute(
            mesh,
            desc,
            call.dtype,
            call.op,
            prepared,
            &layout,
            &mut areas,
            &[],
            workspace,
            seq,
        )?;

        // Avg: divide the reduced result once, where a result was written.
        let es = call.dtype.size();
        let result = match call.kind {
            OpKind::Reduce if r != call.root => None,
            OpKind::ReduceScatter => Some(plan.output_offset..plan.output_offset + count * es),
            _ => Some(plan.output_offset..plan.output_offset + count * es),
        };
        if let (ReduceOp::Avg, true, true, Some(range), Area::ReadWrite(out)) =
            (call.op, call.has_reduction(), n > 1, result, &mut areas[0])
        {
            let out = out
                .get_mut(range)
                .ok_or_else(|| internal("average range".into()))?;
            reduce::divide_in_place(call.dtype, out, n).map_err(|e| internal(e.to_string()))?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        mesh: &mut Mesh,
        desc: OpDesc,
        dtype: DataType,
        op: ReduceOp,
        prepared: &Prepared,
        layout: &Layout,
        areas: &mut [Area<'_>],
        headers: &[(usize, OpDesc, OpDesc)],
        workspace: &mut Workspace,
        collective_seq: u64,
    ) -> Result<()> {
        let poisoned = || self.poisoned();
        let largest = areas.iter().map(Area::len).max().unwrap_or(0);
        let ctx = Context {
            rank: self.rank,
            desc,
            dtype,
            combiner: op.combiner(),
            timeout: self.timeout(),
            abort: &self.abort,
            backoff: self.config.backoff,
            pinned_sends: sends_pinned(desc.kind, largest, self.config.pinned_max_bytes),
            poisoned: &poisoned,
            collective_seq,
        };
        let (conns, waiter) = mesh.parts();
        engine::execute_prepared(
            &ctx, prepared, layout, areas, conns, waiter, headers, workspace,
        )
    }

    /// Runs grouped sends and receives as one operation.
    fn run_group(&self, sends: &[(usize, &[u8])], recvs: &mut [(usize, &mut [u8])]) -> Result<()> {
        let kind = OpKind::SendRecv;
        let peers = sends
            .iter()
            .map(|(p, _)| *p)
            .chain(recvs.iter().map(|(p, _)| *p));
        for peer in peers {
            if let Some(reason) = peer_problem(self.rank, self.size, peer) {
                return Err(self.invalid(kind, reason));
            }
        }
        self.check()?;
        self.run_blocking(kind, |inner, st| inner.run_group_locked(st, sends, recvs))
    }

    fn run_group_locked(
        &self,
        st: &mut State,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        let slice = self.config.slice_bytes.max(8);
        let mut sched = Schedule::default();
        let mut areas: Vec<Area<'_>> = Vec::with_capacity(sends.len() + recvs.len());
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        // Per peer: (messages, total bytes, fingerprint of the message sizes).
        let mut out_meta: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut in_meta: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut virtual_in = 0usize;
        for &(peer, buf) in sends {
            inputs.push((virtual_in, areas.len()));
            areas.push(Area::ReadOnly(buf));
            push_sliced(&mut sched, buf.len(), slice, |off, len| Action::Send {
                peer,
                src: Region::new(BufId::Input, virtual_in + off, len),
            });
            virtual_in += buf.len();
            meta_push(&mut out_meta, peer, buf.len());
        }
        let mut virtual_out = 0usize;
        for (peer, buf) in recvs.iter_mut() {
            let peer = *peer;
            let len = buf.len();
            outputs.push((virtual_out, areas.len()));
            areas.push(Area::ReadWrite(buf));
            push_sliced(&mut sched, len, slice, |off, l| Action::RecvCopy {
                peer,
                dst: Region::new(BufId::Output, virtual_out + off, l),
            });
            virtual_out += len;
            meta_push(&mut in_meta, peer, len);
        }
        sched.send_peers = out_meta.iter().map(|(p, _)| *p).collect();
        sched.recv_peers = in_meta.iter().map(|(p, _)| *p).collect();
        let layout = Layout::Concatenated { inputs, outputs };
        // One header per peer and direction: the pair's message sequence number, total bytes and
        // a fingerprint of the message sizes, so mismatched sends and receives are detected.
        let desc_for = |seq: u64, sizes: &[usize]| OpDesc {
            kind: OpKind::SendRecv,
            seq,
            dtype: DataType::Uint8,
            count: sizes.iter().sum::<usize>() as u64,
            redop: 0xff,
            root: fingerprint(sizes),
        };
        let mut headers: Vec<(usize, OpDesc, OpDesc)> = Vec::new();
        let peers: Vec<usize> = {
            let mut p: Vec<usize> = sched
                .send_peers
                .iter()
                .chain(sched.recv_peers.iter())
                .copied()
                .collect();
            p.sort_unstable();
            p.dedup();
            p
        };
        for &p in &peers {
            let out_sizes = out_meta
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, s)| s.clone())
                .unwrap_or_default();
            let in_sizes = in_meta
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, s)| s.clone())
                .unwrap_or_default();
            headers.push((
                p,
                desc_for(st.send_seq[p], &out_sizes),
                desc_for(st.recv_seq[p], &in_sizes),
            ));
        }
        for (p, sizes) in &out_meta {
            st.send_seq[*p] += sizes.len() as u64;
        }
        for (p, sizes) in &in_meta {
            st.recv_seq[*p] += sizes.len() as u64;
        }
        let first_seq = headers.first().map(|h| h.1.seq).unwrap_or(0);
        self.current.set(OpKind::SendRecv, first_seq);
        let prepared = Prepared::new(sched);
        let State {
            mesh,
            workspace,
            coll_seq,
            ..
        } = st;
        self.execute(
            mesh,
            desc_for(first_seq, &[]),
            DataType::Uint8,
            ReduceOp::Sum,
            &prepared,
            &layout,
            &mut areas,
            &headers,
            workspace,
            *coll_seq,
        )
    }
}

/// What decides a collective call's schedule, the tuner's choice included (rank, size and the
/// settings are fixed per communicator; the choice follows from the kind and the bytes).
#[derive(Clone, Copy, PartialEq, Eq)]
struct CallShape {
    kind: OpKind,
    count: usize,
    esize: usize,
    root: usize,
    /// In-place all-to-all (the only collective whose schedule differs in place).
    in_place: bool,
}

/// What makes two calls' schedules identical (rank and size are fixed per communicator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ScheduleKey {
    kind: OpKind,
    count: usize,
    slice: usize,
    root: usize,
    in_place: bool,
    /// The tuner's choice.
    algo: Choice,
}

/// A fast hasher for [`ScheduleKey`] (SipHash's flood resistance buys nothing for keys that
/// are this rank's own calls, and cost a tenth of a small operation).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// Broadcast's bound on single copy when [`CommConfig::pinned_max_bytes`] is `None`.
pub const DEFAULT_PINNED_MAX_BYTES: usize = 1 << 20;

/// Whether an operation of `kind` whose largest buffer has `largest` bytes sends pinned (see
/// [`CommConfig::pinned_max_bytes`]).
fn sends_pinned(kind: OpKind, largest: usize, bound: Option<usize>) -> bool {
    match kind {
        // Single copy pays where the receiver copies into place; a receiver that reduces copies
        // referenced bytes to a staging block first, and was measured slower.
        OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter | OpKind::Barrier => false,
        OpKind::Broadcast => largest <= bound.unwrap_or(DEFAULT_PINNED_MAX_BYTES),
        OpKind::AllGather | OpKind::AllToAll | OpKind::SendRecv => {
            bound.is_none_or(|b| largest <= b)
        }
    }
}

/// Bound on cached schedules: a sweep over many sizes must not grow memory without limit.
const SCHEDULE_CACHE_ENTRIES: usize = 64;

fn meta_push(meta: &mut Vec<(usize, Vec<usize>)>, peer: usize, len: usize) {
    match meta.iter_mut().find(|(p, _)| *p == peer) {
        Some((_, sizes)) => sizes.push(len),
        None => meta.push((peer, vec![len])),
    }
}

/// A fingerprint of a list of message sizes, carried in the header's root field (never
/// [`NO_ROOT`]).
fn fingerprint(sizes: &[usize]) -> u32 {
    let h = crate::header::fnv1a32(sizes.iter().flat_map(|s| (*s as u64).to_le_bytes()));
    if h == NO_ROOT {
        0
    } else {
        h
    }
}

/// Appends steps moving `len` elements in slices of at most `slice`.
fn push_sliced(
    sched: &mut Schedule,
    len: usize,
    slice: usize,
    mut make: impl FnMut(usize, usize) -> Action,
) {
    let mut off = 0;
    while off < len {
        let l = slice.min(len - off);
        sched.steps.push(Step {
            action: make(off, l),
            deps: Vec::new(),
        });
        off += l;
    }
}

/// Watches the store for a job-wide abort, and for the death of the store's host (rank 0).
fn watch(inner: Arc<Inner>, mut client: StoreClient) {
    let key = inner.store_key(ABORT_KEY);
    while !inner.watcher_stop.load(Ordering::SeqCst) {
        match client.get(&key, WATCH_PERIOD) {
            Ok(value) => {
                let text = String::from_utf8_lossy(&value).to_string();
                if let Some(e) = remote_error(&inner, &text) {
                    inner.fail(e);
                    inner.turn.wake_all();
                }
                settle(&inner, &mut client);
                return;
            }
            Err(TransportError::Timeout { .. }) => continue,
            Err(TransportError::StoreClosed) => return,
            Err(e) => {
                if inner.watcher_stop.load(Ordering::SeqCst) {
                    return;
                }
                let (op, seq) = inner.current.get();
                inner.fail(Error::PeerLost {
                    rank: inner.rank,
                    peer: 0,
                    op,
                    seq,
                    detail: format!("reported by the watcher: the bootstrap store on rank 0 is unreachable ({e})"),
                });
                return;
            }
        }
    }
    settle(&inner, &mut client);
}

/// Counts this rank's watcher as done with the store (it read the failure, or its communicator
/// is going away); the last one to count says so, for [`StoreHost::settle`].
fn settle(inner: &Inner, client: &mut StoreClient) {
    if let Ok(n) = client.add_within(&inner.store_key(SETTLED_KEY), 1, WATCH_PERIOD) {
        if n == inner.size as i64 {
            let _ = client.set(&inner.store_key(SETTLED_ALL_KEY), b"1");
        }
    }
}

/// Turns a failure published by another rank into this rank's error.
fn remote_error(inner: &Inner, text: &str) -> Option<Error> {
    let (op, seq) = inner.current.get();
    let mut parts = text.splitn(4, ' ');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("lost"), Some(peer), Some(by), detail) => {
            let peer = peer.parse().ok()?;
            if peer == inner.rank {
                return None;
            }
            Some(Error::PeerLost {
                rank: inner.rank,
                peer,
                op,
                seq,
                detail: format!("reported by rank {by}: {}", detail.unwrap_or("")),
            })
        }
        (Some("abort"), Some(by), first, rest) => {
            let by: usize = by.parse().ok()?;
            if by == inner.rank {
                return None;
            }
            let reason = [first.unwrap_or(""), rest.unwrap_or("")].join(" ");
            Some(Error::Aborted {
                rank: inner.rank,
                by: Some(by),
                reason: format!("rank {by} failed: {}", reason.trim()),
            })
        }
        _ => None,
    }
}

/// The shared state of an async operation.
struct Completion<B> {
    result: Mutex<Option<Result<B>>>,
    cv: Condvar,
    done: AtomicBool,
}

impl<B> Default for Completion<B> {
    fn default() -> Self {
        Completion {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
        }
    }
}

impl<B> Completion<B> {
    fn finish(&self, r: Result<B>) {
        *lock(&self.result) = Some(r);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// The handle of an asynchronous operation; gives the buffer back when the operation is done.
/// Dropping a handle does not cancel the operation.
pub struct Handle<B> {
    done: Arc<Completion<B>>,
}

impl<B> Handle<B> {
    /// True once the operation finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.done.done.load(Ordering::Acquire)
    }

    /// Waits up to `timeout`; returns whether the operation finished.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut slot = lock(&self.done.result);
        while slot.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            slot = match self.done.cv.wait_timeout(slot, deadline - now) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Waits for the operation and returns its buffer. Never waits forever: operations end by
    /// their own timeout.
    pub fn wait(self) -> Result<B> {
        let mut slot = lock(&self.done.result);
        loop {
            if let Some(r) = slot.take() {
                return r;
            }
            slot = match self.done.cv.wait(slot) {
                Ok(s) => s,
                Err(p) => p.into_inner(),
            };
        }
    }
}

/// Locks a mutex, recovering from poisoning (a panic elsewhere must not cascade).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
fn bind_address(addr: &str) -> std::result::Result<std::net::SocketAddr, TransportError> {
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

    #[test]
    fn single_copy_bounds_per_collective() {
        let (big, mib) = (1usize << 30, DEFAULT_PINNED_MAX_BYTES);
        for kind in [OpKind::AllReduce, OpKind::Reduce, OpKind::ReduceScatter] {
            assert!(!sends_pinned(kind, 8, None) && !sends_pinned(kind, 8, Some(big)));
        }
        assert!(sends_pinned(OpKind::Broadcast, mib, None));
        assert!(!sends_pinned(OpKind::Broadcast, mib + 1, None));
        for kind in [OpKind::AllGather, OpKind::AllToAll, OpKind::SendRecv] {
            assert!(sends_pinned(kind, big, None));
            assert!(!sends_pinned(kind, mib + 1, Some(mib)));
        }
        assert!(sends_pinned(OpKind::Broadcast, big, Some(big)));
    }

    #[test]
    fn weft_proto_turns_shared_memory_low_latency_messages_off_only_when_excluded_everywhere() {
        let ll = weftcc_transports::shm::ll_max_bytes();
        assert!(ll > 0);
        for (spec, want) in [
            ("", ll),
            ("LL,Simple", ll),
            ("allreduce:Simple", ll),
            ("Simple", 0),
            ("^LL", 0),
        ] {
            let proto = Selection::parse(spec).expect("spec");
            assert_eq!(shm_low_latency_max(&proto), want, "WEFT_PROTO={spec:?}");
        }
    }

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
    fn a_failed_communicator_dropped_before_its_split_child_leaves_its_settle_to_the_child() {
        let id = UniqueId::new().expect("unique id");
        let left = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let id = id.clone();
                    s.spawn(move || {
                        let parent = Communicator::init_with(
                            rank,
                            2,
                            &id,
                            CommConfig::from_env().expect("config"),
                        )
                        .expect("init");
                        let child = parent.split(Some(0), 0).expect("split").expect("member");
                        if rank == 1 {
                            let start = Instant::now();
                            while parent.error().is_none()
                                && start.elapsed() < Duration::from_secs(10)
                            {
                                std::thread::sleep(Duration::from_millis(2));
                            }
                            return Vec::new();
                        }
                        let host = parent.inner.store_host.clone().expect("rank 0 hosts");
                        parent.abort();
                        drop(parent);
                        let left = lock(&host.unsettled).clone();
                        drop(child);
                        left
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect::<Vec<_>>()
        });
        assert_eq!(left[0], vec![format!("c/{SETTLED_ALL_KEY}")]);
    }

    #[test]
    fn current_op_keeps_kind_and_sequence_together() {
        let current = CurrentOp::default();
        assert_eq!(current.get(), (OpKind::Barrier, 0));
        for kind in OpKind::ALL {
            for seq in [1, 77, (1 << 56) - 1] {
                current.set(kind, seq);
                assert_eq!(current.get(), (kind, seq));
            }
        }
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
    fn sizes_parse() {
        assert_eq!(parse_size("4M"), Some(4 << 20));
        assert_eq!(parse_size("512k"), Some(512 << 10));
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
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
