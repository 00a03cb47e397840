//! The communicator: a group of ranks that run collectives together. Each call validates its
//! arguments ([`weftcc_collectives::call`]), takes its prepared schedule (`cache`), maps the
//! schedule's logical buffers onto the caller's memory and hands both to the engine, in issue
//! order (`ordering`); the first fatal error poisons it (`failure`).

use crate::bootstrap::{join_host_port, serve_store, servers, StoreHost, UniqueId};
use crate::config::{shm_low_latency_max, warn_unimplemented_protocols, CommConfig};
use crate::env::LaunchInfo;
use crate::error::{Error, Result};
use crate::failure::ALARM_TIMEOUT;
use crate::group::Group;
use crate::inner::{Inner, StoreLinks};
use crate::records::identity::RankIdentity;
use crate::records::note::AbortCause;
use crate::records::session_key;
use crate::trace::TraceEntry;
use crate::tuning::Tuner;
use crate::watcher::{setup_scan, watch};
use crate::worker::{join_unless_current, Worker};
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use weftcc_collectives::call::RawOp;
use weftcc_collectives::schedule::hierarchical::HostLayout;
use weftcc_collectives::{reduce, DataType, Element, OpKind, ReduceOp};
use weftcc_store::StoreClient;
use weftcc_transports::lock;
use weftcc_transports::mesh::{all_see_the_death, count_out, Mesh, MeshConfig};
use weftcc_transports::TransportError;
/// A group of ranks that run collectives together. `Send + Sync`: share it by reference (or in
/// an `Arc`) to call [`Communicator::abort`] from another thread.
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
    pub(crate) worker: Mutex<Option<Worker>>,
    pub(crate) watcher: Option<JoinHandle<()>>,
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

/// A collective's two typed forms: `$name` from `send` into `recv`, `$in_place` on one buffer;
/// each `$arg` sets a field of the call through `RawOp::$set`.
macro_rules! collective {
    (
        $(#[$doc:meta])* $name:ident,
        $(#[$in_place_doc:meta])* $in_place:ident,
        $kind:expr $(, $arg:ident : $ty:ty => $set:ident)*
    ) => {
        $(#[$doc])*
        pub fn $name<T: Element>(&self, send: &[T], recv: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            self.typed($kind, send, recv, |c| c $(.$set($arg))*)
        }

        $(#[$in_place_doc])*
        pub fn $in_place<T: Element>(&self, buf: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            self.typed_in_place($kind, buf, |c| c $(.$set($arg))*)
        }
    };
}

impl Communicator {
    /// Joins the job described by the launcher's environment: `weft run`, torchrun, SLURM or
    /// Open MPI variables (see [`LaunchInfo`]), with settings from `WEFT_*` variables.
    pub fn from_env() -> Result<Communicator> {
        Communicator::from_env_with(CommConfig::from_env()?)
    }

    /// [`Communicator::from_env`] with explicit settings (e.g. the environment's with
    /// [`CommConfig::deterministic`] set).
    pub fn from_env_with(config: CommConfig) -> Result<Communicator> {
        let info = LaunchInfo::from_env()?;
        // A store the launcher (or the user) runs: nobody here serves one.
        let (addr, serve) = match &info.store {
            Some(store) => (store.clone(), false),
            None => (join_host_port(&info.master_addr, info.master_port), true),
        };
        let id = UniqueId {
            addr,
            token: info.token.clone(),
        };
        Communicator::join(info.rank, info.world_size, &id, config, serve)
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
        Communicator::join(rank, nranks, id, config, true)
    }

    /// Joins the job at `id`'s store; rank 0 serves it there if `serve` (else it runs
    /// elsewhere: in the launcher, or started by `weft store serve`).
    fn join(
        rank: usize,
        nranks: usize,
        id: &UniqueId,
        config: CommConfig,
        serve: bool,
    ) -> Result<Communicator> {
        crate::logging::init();
        // The pure core reads no environment: the process-wide kernel choice is made here.
        reduce::set_wide_kernels(!weftcc_settings::NO_AVX512.flag()?);
        if nranks == 0 || rank >= nranks {
            return Err(Error::Config(format!(
                "rank {rank} is out of range for {nranks} ranks"
            )));
        }
        let boot = |source: TransportError| Error::Bootstrap { rank, source };
        // An etcd cluster (`etcd://…`) is a store no rank serves.
        let server = if rank == 0 && serve && !weftcc_store::is_etcd_address(&id.addr) {
            let existing = lock(servers()).remove(id);
            match existing {
                Some(s) => Some(s),
                None => {
                    let server = serve_store(&id.addr, &id.token).map_err(boot)?;
                    Some(Arc::new(StoreHost::new(server, id)))
                }
            }
        } else {
            None
        };
        let client = StoreClient::connect(&id.addr, &id.token, config.timeout)
            .map_err(|e| boot(e.into()))?;
        let on_rank0 = serve && !weftcc_store::is_etcd_address(&id.addr);
        Communicator::build(
            rank,
            nranks,
            "c".to_string(),
            config,
            client,
            (id, on_rank0),
            server,
            None,
        )
    }

    /// Makes the communicator: its mesh is `split_mesh` (a split's, sharing its parent's
    /// connections) or set up here through the store.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build(
        rank: usize,
        nranks: usize,
        namespace: String,
        config: CommConfig,
        mut client: StoreClient,
        (id, on_rank0): (&UniqueId, bool),
        store_host: Option<Arc<StoreHost>>,
        split_mesh: Option<Mesh>,
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
            shm_ll_max: shm_low_latency_max(&config.proto)?,
            connect: config.connect,
            share_splits: config.split_share,
            net: config.net.clone(),
            stripes: config.stripes,
        };
        // Every store connection first: the mesh's closing barrier then guarantees that all ranks
        // hold theirs before any rank can return (and rank 0 drop the store).
        let mut watch_client = StoreClient::connect(&id.addr, &id.token, config.timeout)
            .map_err(|e| boot(e.into()))?;
        // The watcher's connection is this rank's session in the store: its polls are the
        // rank's signs of life for diagnoses and `weft status` (crate::status).
        watch_client
            .name_session(
                &session_key(&namespace, rank),
                RankIdentity::this_process(nranks).encode().as_bytes(),
            )
            .map_err(|e| boot(e.into()))?;
        // Connected as patiently as the others (a store busy with a large job's set-up); its
        // requests, failure reports, then wait little.
        let mut alarm = StoreClient::connect(&id.addr, &id.token, config.timeout)
            .map_err(|e| boot(e.into()))?;
        alarm.set_default_timeout(ALARM_TIMEOUT);
        let mesh = match split_mesh {
            Some(m) => m,
            None => {
                let _scan = setup_scan(&watch_client, id, &namespace, config.timeout);
                // Ranks that must agree and do not fail here, before they can hang together.
                let agreed = crate::agreement::this_rank(rank, &config).and_then(|mine| {
                    crate::agreement::agree(
                        &mut client,
                        &namespace,
                        (rank, nranks),
                        &mine,
                        config.timeout,
                    )
                });
                let made =
                    agreed.and_then(|()| Mesh::establish(&mut client, &mesh_config).map_err(boot));
                made.inspect_err(|e| {
                    // This rank's own failure, reported here: its exit is no death in set-up.
                    crate::watcher::leave_session(&namespace, rank, nranks, &mut watch_client);
                    if let Error::Bootstrap {
                        source: TransportError::DiedInSetup { .. },
                        ..
                    } = e
                    {
                        all_see_the_death(&mut client, &namespace, rank, nranks);
                    }
                })?
            }
        };
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
        let deterministic = config.deterministic;
        let links = StoreLinks {
            id: id.clone(),
            client,
            alarm,
            host: store_host,
            on_rank0,
        };
        let inner = Arc::new(Inner::new(
            (rank, nranks, namespace),
            config,
            tuner,
            mesh,
            links,
        ));
        let watcher = if nranks > 1 {
            let w = Arc::clone(&inner);
            Some(
                std::thread::Builder::new()
                    .name(format!("weft-watch-{rank}"))
                    .spawn(move || watch(w, watch_client))
                    .map_err(|e| boot(TransportError::io("spawning the watcher thread", e)))?,
            )
        } else {
            // No watcher, no peers to tell: the session ends here, as having left (its closing
            // is no death, which would end the set-up of splits made from this communicator).
            crate::watcher::leave_session(&inner.namespace, rank, nranks, &mut watch_client);
            None
        };
        tracing::info!(
            target: "weftcc::init",
            rank,
            nranks,
            deterministic,
            "communicator ready"
        );
        let comm = Communicator {
            inner,
            worker: Mutex::new(None),
            watcher,
        };
        crate::doctor::at_init(&comm)?;
        Ok(comm)
    }

    /// This rank's index, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Transport used to reach `peer` ("shm", "tcp", "net"), `None` for this rank itself.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        lock(&self.inner.state).mesh.transport_name(peer)
    }

    /// Peers this communicator has connected so far (connections are made when an operation
    /// first needs a peer, or all at set-up with `WEFT_CONNECT=eager`).
    pub fn connected_peers(&self) -> usize {
        lock(&self.inner.state).mesh.connected_peers()
    }

    /// Connections this rank holds for this communicator's family: the communicator it was split
    /// from (if any) and every split of them share one connection per peer process.
    pub fn family_connections(&self) -> usize {
        lock(&self.inner.state).mesh.family_connections()
    }

    /// Per-operation timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    /// Whether floating-point reductions fold in rank order (`WEFT_DETERMINISTIC`,
    /// [`CommConfig::deterministic`]): the device path follows the host's choice.
    pub fn deterministic(&self) -> bool {
        self.inner.deterministic()
    }

    /// Changes the per-operation timeout for operations that start after this call.
    pub fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout);
    }

    /// Aborts the communicator: every waiting call returns [`Error::Aborted`] within a few
    /// milliseconds, every later call fails, and other ranks are told. Callable from any thread.
    pub fn abort(&self) {
        self.abort_because("abort() called".into(), AbortCause::AbortCalled, None);
    }

    /// [`Communicator::abort`] on behalf of a failure this communicator did not see itself but
    /// must end (a tier of a device communicator built on it failed): the other ranks' errors
    /// carry `reason`, `cause` and the operation `during` as they would this rank's own failure.
    pub fn abort_because(&self, reason: String, cause: AbortCause, during: Option<(OpKind, u64)>) {
        self.inner.abort.store(true, Ordering::SeqCst);
        let e = Error::Aborted {
            rank: self.inner.rank,
            by: None,
            reason,
            cause,
            during,
        };
        self.inner.fail(e);
        self.inner.leave_farewell();
        self.inner.turns.wake_all();
        self.inner.dump_trace_if_due();
    }

    /// Runs `hook` with the error once this communicator fails: a failure on this rank, an
    /// abort, or another rank's failure as the watcher learns it (within a fraction of a
    /// second); at once if it has already failed. Each hook runs once, on the thread that
    /// records the failure, after the waiting calls are woken: it must not block for long, nor
    /// run operations on this communicator. Meant for ending what depends on this
    /// communicator, e.g. the tiers a device communicator built on it
    /// (`other.abort_because(…)` of another communicator is fine).
    pub fn on_failure(&self, hook: impl FnOnce(&Error) + Send + 'static) {
        self.inner.on_failure(Box::new(hook));
    }

    /// The error that poisoned this communicator, if any (NCCL's `ncclCommGetAsyncError`).
    pub fn error(&self) -> Option<Error> {
        self.inner.poisoned()
    }

    /// The flight recorder's operations, oldest first (at most `WEFT_TRACE_BUFFER_SIZE`).
    pub fn trace(&self) -> Vec<crate::records::trace::TraceRecord> {
        let (entries, _) = self.inner.trace.snapshot();
        entries.iter().map(TraceEntry::record).collect()
    }

    /// Writes the flight recorder into `dir` (`weft trace merge` reads such files); returns
    /// the file's path.
    pub fn dump_trace(&self, dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
        self.inner
            .trace_dump(crate::records::trace::DumpReason::Api)
            .write_to(dir)
    }

    // ----- collectives, blocking -----

    /// A typed out-of-place collective: the count from the buffers' lengths
    /// ([`RawOp::from_lengths`], the rule the CUDA path uses too); `with` sets the op and root.
    fn typed<T: Element>(
        &self,
        kind: OpKind,
        send: &[T],
        recv: &mut [T],
        with: impl FnOnce(RawOp) -> RawOp,
    ) -> Result<()> {
        let call = RawOp::from_lengths(kind, T::DTYPE, self.size(), Some(send.len()), recv.len());
        self.execute_raw(
            with(call),
            Some(bytemuck::cast_slice(send)),
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// A typed in-place collective (see [`Communicator::typed`]).
    fn typed_in_place<T: Element>(
        &self,
        kind: OpKind,
        buf: &mut [T],
        with: impl FnOnce(RawOp) -> RawOp,
    ) -> Result<()> {
        let call = with(RawOp::from_lengths(
            kind,
            T::DTYPE,
            self.size(),
            None,
            buf.len(),
        ));
        self.execute_raw(call, None, bytemuck::cast_slice_mut(buf))
    }

    collective!(
        /// All-reduce from `send` into `recv` (equal lengths).
        all_reduce,
        /// All-reduce in place.
        all_reduce_in_place,
        OpKind::AllReduce, op: ReduceOp => with_op
    );
    collective!(
        /// Reduce to `root`: `recv` is written on the root only (other ranks may pass an empty slice).
        reduce,
        /// Reduce to `root` in place (non-root buffers are left unchanged).
        reduce_in_place,
        OpKind::Reduce, op: ReduceOp => with_op, root: usize => with_root
    );
    collective!(
        /// Broadcast `send` on the root into `recv` on every rank (non-roots may pass an empty `send`).
        broadcast,
        /// Broadcast in place from `root`.
        broadcast_in_place,
        OpKind::Broadcast, root: usize => with_root
    );
    collective!(
        /// All-gather: `recv` (size × `send.len()`) receives every rank's `send`, in rank order.
        all_gather,
        /// All-gather in place: this rank's contribution is block `rank` of `buf`.
        all_gather_in_place,
        OpKind::AllGather
    );
    collective!(
        /// Reduce-scatter: `send` has size × `recv.len()` elements; block `rank` of the element-wise
        /// reduction lands in `recv`.
        reduce_scatter,
        /// Reduce-scatter in place: the result is block `rank` of `buf`.
        reduce_scatter_in_place,
        OpKind::ReduceScatter, op: ReduceOp => with_op
    );
    collective!(
        /// All-to-all: block j of `send` goes to rank j, block i of `recv` comes from rank i.
        all_to_all,
        /// All-to-all in place (uses a scratch copy of `buf`).
        all_to_all_in_place,
        OpKind::AllToAll
    );

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
            inner: &self.inner,
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

    /// Splits into sub-communicators: ranks passing the same `color` form one, ordered by
    /// (`key`, old rank). Ranks passing `None` take part but get no communicator. Collective
    /// over this communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        self.inner.check()?;
        let inner = &self.inner;
        let index = inner.splits.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("{}/split{}", inner.namespace, index);
        let child_ns = color.map(|c| format!("{prefix}/c{c}"));
        // Every rank's (color, key) travels among the ranks, an all-gather over this
        // communicator: through the store it would be n² bytes.
        let mine = [
            i64::from(color.is_some()),
            i64::from(color.unwrap_or(0)),
            key,
        ];
        let mut choices = vec![0i64; 3 * inner.size];
        self.all_gather(&mine, &mut choices)?;
        let chosen = inner.run_blocking(OpKind::Barrier, |inner, st| {
            let boot = |source: TransportError| Error::Bootstrap {
                rank: inner.rank,
                source,
            };
            let mut members: Vec<(i64, usize)> = choices
                .chunks_exact(3)
                .enumerate()
                .filter(|(_, c)| c[0] == 1 && color.is_some_and(|mine| i64::from(mine) == c[1]))
                .map(|(r, c)| (c[2], r))
                .collect();
            members.sort_unstable();
            // With split_share, the split's mesh shares this communicator's connections (no
            // set-up of its own); otherwise it is set up through the store like any other.
            let mesh = match &child_ns {
                Some(ns) if inner.split_share() => {
                    let ranks: Vec<usize> = members.iter().map(|&(_, r)| r).collect();
                    Some(st.mesh.split(&ranks, ns).map_err(boot)?)
                }
                _ => None,
            };
            Ok((members, mesh))
        });
        let made = match (chosen, child_ns) {
            (Ok((members, mesh)), Some(ns)) => self.build_split(&members, mesh, ns).map(Some),
            (Ok(_), None) => Ok(None),
            (Err(e), _) => Err(e),
        };
        // Every rank of this communicator counts itself out once its split holds its store
        // connections; the process serving the store waits for all (it may hold no split and
        // drop everything next).
        let counted = count_out(
            &mut lock(&inner.store),
            &inner.namespace,
            &format!("split{index}/joined"),
            inner.size,
            inner.store_host.is_some(),
            inner.timeout(),
        )
        .map_err(|source| Error::Bootstrap {
            rank: inner.rank,
            source,
        });
        let made = made?;
        counted?;
        Ok(made)
    }

    /// The split communicator of this rank, of `members` (`(key, rank here)` in rank order),
    /// over `mesh` (shared connections) or a mesh of its own.
    fn build_split(
        &self,
        members: &[(i64, usize)],
        mesh: Option<Mesh>,
        ns: String,
    ) -> Result<Communicator> {
        let inner = &self.inner;
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == inner.rank)
            .ok_or_else(|| Error::Internal {
                rank: inner.rank,
                op: OpKind::Barrier,
                seq: 0,
                reason: "this rank is missing from its own split group".into(),
            })?;
        let id = inner.id.clone();
        let client = inner.connect_store()?;
        let config = inner.config();
        Communicator::build(
            new_rank,
            members.len(),
            ns,
            config,
            client,
            (&id, inner.store_on_rank0),
            inner.store_host.clone(),
            mesh,
        )
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Some(w) = lock(&self.worker).take() {
            w.stop();
        }
        // A poisoned communicator's cause, if no call could leave it yet (connections close
        // when the last reference to `inner` goes), and its recorder if not written yet.
        self.inner.leave_farewell();
        self.inner.dump_trace_if_due();
        self.inner.watcher_stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.watcher.take() {
            t.thread().unpark();
            join_unless_current(t);
        }
        self.inner.settle_before_the_store_closes();
    }
}
