//! What a communicator shares with its watcher and worker threads: the concerns it composes,
//! each owning its state (issue order in `ordering`, prepared schedules in `cache`, the failure
//! protocol in `failure`, progress and the flight recorder), and the path of one call through
//! them: validate, take the turn, prepare the schedule, map the buffers, execute, record.

use crate::bootstrap::{StoreHost, UniqueId};
use crate::cache::{CallShape, Preparer, ScheduleCache};
use crate::config::{sends_pinned, CommConfig};
use crate::error::{Error, Result};
use crate::executor::{self, Area, Context, Layout, Prepared, Workspace};
use crate::failure::{FailureHook, Failures, Surroundings};
use crate::one_shot::{self, Contribution, OneShot};
use crate::ordering::{CurrentOp, Turns, TICKET};
use crate::progress::Progress;
use crate::records::identity::RankIdentity;
use crate::records::progress::ProgressRecord;
use crate::records::trace::{
    default_dump_dir, job_tag, DumpReason, DumpRequest, TraceDump, TRACE_FORMAT,
};
use crate::records::SETTLED_ALL_KEY;
use crate::trace::{now_us, FlightRecorder, TraceEntry};
use crate::tuning::Tuner;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weftcc_collectives::call::{self, Plan, RawOp};
use weftcc_collectives::header::OpDesc;
use weftcc_collectives::schedule::layout::Placement;
use weftcc_collectives::{reduce, DataType, OpKind, ReduceOp};
use weftcc_store::StoreClient;
use weftcc_transports::lock;
use weftcc_transports::mesh::{Mesh, OneShotParts};

pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) namespace: String,
    /// The settings the communicator was made with; its timeout is the initial one (the live
    /// one is `timeout_ms`, which `set_timeout` changes): read through [`Inner::config`].
    settings: CommConfig,
    /// Chooses each call's algorithm.
    pub(crate) tuner: Tuner,
    timeout_ms: AtomicU64,
    pub(crate) abort: AtomicBool,
    pub(crate) failures: Failures,
    /// Kind and sequence number of the operation running now (for errors raised elsewhere).
    pub(crate) current: CurrentOp,
    /// What the watcher publishes of this rank's progress.
    pub(crate) progress: Progress,
    /// The last operations, for dumps ([`crate::trace`]).
    pub(crate) trace: FlightRecorder,
    /// The communicator failed and its recorder is not written yet ([`Inner::dump_trace_if_due`]).
    trace_dump_due: AtomicBool,
    pub(crate) turns: Turns,
    pub(crate) state: Mutex<State>,
    /// Connection to the bootstrap store for splits and connection set-up.
    pub(crate) store: Mutex<StoreClient>,
    /// The job's id: its store's address and token.
    pub(crate) id: UniqueId,
    /// Keeps rank 0's store alive while any communicator using it lives.
    pub(crate) store_host: Option<Arc<StoreHost>>,
    /// Rank 0 serves the store ([`StoreLinks::on_rank0`]).
    pub(crate) store_on_rank0: bool,
    pub(crate) splits: AtomicU64,
    /// Its epoch, and the shrinks and grows made from it ([`crate::lineage`]).
    pub(crate) lineage: crate::lineage::Lineage,
    pub(crate) watcher_stop: AtomicBool,
}

/// What one call at a time uses: the connections, buffers and sequence numbers.
pub(crate) struct State {
    pub(crate) mesh: Mesh,
    pub(crate) scratch: Vec<u64>,
    pub(crate) cache: ScheduleCache,
    pub(crate) workspace: Workspace,
    pub(crate) coll_seq: u64,
    pub(crate) send_seq: Vec<u64>,
    pub(crate) recv_seq: Vec<u64>,
}

impl State {
    pub(crate) fn new(mesh: Mesh, nranks: usize) -> State {
        State {
            mesh,
            scratch: Vec::new(),
            cache: ScheduleCache::default(),
            workspace: Workspace::default(),
            coll_seq: 0,
            send_seq: vec![0; nranks],
            recv_seq: vec![0; nranks],
        }
    }
}

/// The places of a collective call's buffers: the executor sees them as numbered areas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallArea {
    /// The receive buffer (also the input of an in-place call).
    Recv = 0,
    /// The communicator's scratch space.
    Scratch = 1,
    /// The send buffer, or this rank's scaled input (`PreMulSum`).
    Send = 2,
}

impl CallArea {
    fn at(self, offset: usize) -> Placement {
        Placement::new(self as usize, offset)
    }
}

/// One operation as the executor runs it: its header, reduction, schedule, buffer map and
/// (point-to-point groups) per-pair headers.
pub(crate) struct Run<'a> {
    pub(crate) desc: OpDesc,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) prepared: &'a Prepared,
    pub(crate) layout: &'a Layout,
    pub(crate) headers: &'a [(usize, OpDesc, OpDesc)],
    /// The collective sequence number (point-to-point groups carry the last collective's).
    pub(crate) collective_seq: u64,
}

/// A communicator's links to its job's bootstrap store: the job's id, a connection for set-up
/// and splits, one for publishing failures, and (on the rank serving it) the store itself.
pub(crate) struct StoreLinks {
    pub(crate) id: UniqueId,
    pub(crate) client: StoreClient,
    /// With a short timeout: reporting an error must never wait long on a stuck store.
    pub(crate) alarm: StoreClient,
    pub(crate) host: Option<Arc<StoreHost>>,
    /// Whether rank 0 serves the store (its loss is rank 0's), rather than a launcher, `weft
    /// store serve` or etcd.
    pub(crate) on_rank0: bool,
}

impl Inner {
    /// Rank `rank` of `size` in the communicator `namespace`, over `mesh`.
    pub(crate) fn new(
        (rank, size, namespace): (usize, usize, String),
        config: CommConfig,
        tuner: Tuner,
        mesh: Mesh,
        links: StoreLinks,
    ) -> Inner {
        Inner {
            rank,
            size,
            failures: Failures::new(rank, size, &namespace, links.alarm),
            namespace,
            tuner,
            timeout_ms: AtomicU64::new(millis(config.timeout)),
            trace: FlightRecorder::new(config.trace_buffer),
            settings: config,
            abort: AtomicBool::new(false),
            current: CurrentOp::default(),
            progress: Progress::default(),
            trace_dump_due: AtomicBool::new(false),
            turns: Turns::default(),
            state: Mutex::new(State::new(mesh, size)),
            store: Mutex::new(links.client),
            id: links.id,
            store_host: links.host,
            store_on_rank0: links.on_rank0,
            splits: AtomicU64::new(0),
            lineage: Default::default(),
            watcher_stop: AtomicBool::new(false),
        }
    }

    /// The communicator's settings as they are now (the timeout as last set).
    pub(crate) fn config(&self) -> CommConfig {
        CommConfig {
            timeout: self.timeout(),
            ..self.settings.clone()
        }
    }

    /// The error of a store that cannot be reached during `op` #`seq`: rank 0's loss where rank
    /// 0 serves it, else the store's own ([`Error::StoreLost`]).
    pub(crate) fn store_lost(&self, op: OpKind, seq: u64, e: impl std::fmt::Display) -> Error {
        let store = self.id.addr.clone();
        if self.store_on_rank0 {
            Error::PeerLost {
                rank: self.rank,
                peer: 0,
                op,
                seq,
                seen_by: crate::error::SeenBy::Watcher,
                detail: format!("the bootstrap store on rank 0 ({store}) is unreachable ({e})"),
            }
        } else {
            Error::StoreLost {
                rank: self.rank,
                store,
                op,
                seq,
                detail: e.to_string(),
            }
        }
    }

    /// A new connection to the job's store, for a communicator made from this one or a helper
    /// thread of it.
    pub(crate) fn connect_store(&self) -> Result<StoreClient> {
        StoreClient::connect(&self.id.addr, &self.id.token, self.timeout()).map_err(|source| {
            Error::Bootstrap {
                rank: self.rank,
                source: source.into(),
            }
        })
    }

    /// Whether floating-point reductions fold in rank order.
    pub(crate) fn deterministic(&self) -> bool {
        self.settings.deterministic
    }

    /// Whether splits share this communicator's connections.
    pub(crate) fn split_share(&self) -> bool {
        self.settings.split_share
    }

    /// Largest message of a pipelined transfer.
    pub(crate) fn slice_bytes(&self) -> usize {
        self.settings.slice_bytes
    }

    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms
            .store(millis(timeout).max(1), Ordering::Relaxed);
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        self.failures.poisoned()
    }

    /// Fails at once when the communicator is poisoned.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        self.failures.check()
    }

    /// Records the first fatal error and tells the other ranks ([`Failures::fail`]).
    pub(crate) fn fail(&self, e: Error) {
        self.failures.fail(e, self);
    }

    /// Runs `hook` with the error when this communicator fails, or now if it has.
    pub(crate) fn on_failure(&self, hook: FailureHook) {
        self.failures.on_failure(hook);
    }

    /// Leaves the poison's cause on every connection, once ([`Failures::leave_farewell`]).
    pub(crate) fn leave_farewell(&self) {
        self.failures.leave_farewell(self);
    }

    /// On rank 0, as this communicator goes: if its failure was published in the store, leaves
    /// the key that the other ranks' watchers set once they have all read it, and if no split
    /// relative still holds the store, waits for every such key before the store closes
    /// ([`StoreHost::settle`]; a relative dropped later waits for this one's too).
    pub(crate) fn settle_before_the_store_closes(&self) {
        let Some(host) = &self.store_host else {
            return;
        };
        let Ok(mut store) = self.failures.alarm.try_lock() else {
            return;
        };
        if self.size > 1
            && self.failures.is_poisoned()
            && matches!(
                store.check(&self.failures.store_key(crate::records::ABORT_KEY)),
                Ok(true)
            )
        {
            lock(&host.unsettled).push(self.failures.store_key(SETTLED_ALL_KEY));
        }
        if Arc::strong_count(host) == 1 {
            host.settle(Some(&mut store));
        }
    }

    /// Runs `f` in issue order. Inside a worker job the job's ticket is reused.
    pub(crate) fn run_blocking<R>(
        &self,
        kind: OpKind,
        f: impl FnOnce(&Inner, &mut State) -> Result<R>,
    ) -> Result<R> {
        let held = TICKET.with(|t| t.get());
        // A ticket of our own only when some other call holds or waits for one.
        let own_ticket = if held.is_none() && self.turns.busy() {
            let t = self.turns.take_ticket();
            if let Err(e) = self.turns.wait_turn(t, &|| self.check()) {
                self.turns.end_turn(t);
                return Err(e);
            }
            Some(t)
        } else {
            None
        };
        let result = (|| {
            self.check()?;
            let mut st = lock(&self.state);
            let result = f(self, &mut st);
            // Under the state lock: the running entry is this call's (one started by `f`), not
            // that of a call another thread starts once the lock is free.
            let end_us = now_us();
            self.trace.end(result.as_ref().err(), end_us);
            if result.is_ok() {
                // Under the state lock too: progress has one writer at a time.
                let (kind, seq) = self.current.get();
                self.progress.completed(kind, seq, end_us / 1000);
            }
            result
        })();
        if let Some(t) = own_ticket {
            self.turns.end_turn(t);
        }
        if let Err(e) = &result {
            if e.is_fatal() {
                self.fail(e.clone());
                self.leave_farewell();
                self.dump_trace_if_due();
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

    /// Checks a call's buffers against its count, root and kind ([`RawOp::plan`]).
    pub(crate) fn plan(&self, call: &RawOp, send: Option<usize>, recv: usize) -> Result<Plan> {
        call.plan(self.rank, self.size, send, recv)
            .map_err(|reason| self.invalid(call.kind, reason))
    }

    pub(crate) fn invalid(&self, op: OpKind, reason: call::CallError) -> Error {
        Error::InvalidArgument {
            rank: self.rank,
            op,
            reason,
        }
    }

    pub(crate) fn try_lock_state(&self) -> Option<std::sync::MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Builds the schedule of a validated call and executes it.
    pub(crate) fn run_planned(
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
        let start_us = now_us();
        self.progress.entered(call.kind, seq, start_us / 1000);
        let mut entry = TraceEntry::started_at(call.kind, seq, call.dtype, count as u64, start_us);
        entry.redop = call.has_reduction().then_some(call.op);
        entry.root = call.has_root().then_some(call.root);
        // A restriction of the algorithms asks for schedules: one-shot is none of them.
        if one_shot::fits(call, n, self.settings.one_shot_max)
            && self.settings.algo.is_unrestricted()
        {
            if let Some(parts) = st.mesh.one_shot_parts() {
                return self.run_one_shot(parts, call, plan, entry, send, recv);
            }
            if st.mesh.one_shot_possible() {
                // Every peer's outbox is needed: they come with the shared-memory connections.
                let all: Vec<usize> = (0..n).collect();
                self.connect_peers(&mut st.mesh, &all, &OpDesc::of_call(call, seq))?;
                if let Some(parts) = st.mesh.one_shot_parts() {
                    return self.run_one_shot(parts, call, plan, entry, send, recv);
                }
            }
        }
        let shape = CallShape::of(call, plan.in_place, self.settings.deterministic);
        let State {
            mesh,
            scratch,
            cache,
            workspace,
            ..
        } = st;
        let record = |prepared: &Prepared| TraceEntry {
            algorithm: prepared.algorithm(),
            ..entry.with_peers(prepared.peers().iter().copied())
        };
        let prepared = match cache.repeated(&shape) {
            Some(prepared) => {
                // A repeated call (the common case) takes the recorder's lock once.
                self.trace.start(record(prepared));
                prepared
            }
            None => {
                // Recorded before preparing, so a call whose preparation fails is in the record.
                self.trace.start(entry);
                let by = Preparer {
                    rank: r,
                    size: n,
                    slice_bytes: self.settings.slice_bytes,
                    tuner: &self.tuner,
                };
                let prepared = cache.prepare_last(&by, call, shape, seq)?;
                self.trace.update_running(|e| *e = record(prepared));
                prepared
            }
        };
        let desc = OpDesc::of_call(call, seq);
        let scaled = self.scaled_input(call, plan, send, recv, seq)?;

        let scratch_bytes = prepared.schedule().scratch_elems * call.dtype.size();
        if scratch.len() * 8 < scratch_bytes {
            scratch.resize(scratch_bytes.div_ceil(8), 0);
        }
        let scratch_area: &mut [u8] =
            &mut bytemuck::cast_slice_mut(scratch.as_mut_slice())[..scratch_bytes];
        let (input_area, input) = match (scaled.as_ref(), send) {
            (Some(tmp), _) => (
                &bytemuck::cast_slice(tmp.as_slice())[..plan.input_len],
                CallArea::Send.at(0),
            ),
            (None, Some(s)) => (s, CallArea::Send.at(0)),
            (None, None) => (&[][..], CallArea::Recv.at(plan.input_offset)),
        };
        // In `CallArea` order.
        let mut areas = [
            Area::ReadWrite(recv),
            Area::ReadWrite(scratch_area),
            Area::ReadOnly(input_area),
        ];
        let layout = Layout::fixed(
            input,
            CallArea::Recv.at(plan.output_offset),
            Some(CallArea::Scratch.at(0)),
        );
        let run = Run {
            desc,
            dtype: call.dtype,
            op: call.op,
            prepared,
            layout: &layout,
            headers: &[],
            collective_seq: seq,
        };
        self.execute(mesh, workspace, &run, &mut areas)?;

        self.divide_average(call, plan, recv, seq)
    }

    /// Runs a call that fits one-shot over every peer's outbox ([`OneShot`]); `entry` is its
    /// flight recorder entry before the algorithm and peers are known (and gives its sequence
    /// number). Inlined: the common path of the smallest calls.
    #[inline(always)]
    fn run_one_shot(
        &self,
        (boxes, conns): OneShotParts<'_>,
        call: &RawOp,
        plan: &Plan,
        entry: TraceEntry,
        send: Option<&[u8]>,
        recv: &mut [u8],
    ) -> Result<()> {
        let seq = entry.seq;
        let (r, n) = (self.rank, self.size);
        self.trace.start(TraceEntry {
            algorithm: Some(weftcc_collectives::Algorithm::OneShot),
            ..entry.with_peers((0..n).filter(|&p| p != r))
        });
        let scaled = self.scaled_input(call, plan, send, recv, seq)?;
        let input = match (scaled.as_ref(), send) {
            (Some(tmp), _) => {
                Contribution::Buffer(&bytemuck::cast_slice(tmp.as_slice())[..plan.input_len])
            }
            (None, Some(s)) => Contribution::Buffer(s),
            (None, None) => {
                Contribution::InRecv(plan.input_offset..plan.input_offset + plan.input_len)
            }
        };
        let op = OneShot {
            rank: r,
            nranks: n,
            call,
            plan,
            seq,
            timeout: self.timeout(),
            abort: &self.abort,
            idle: self.settings.backoff,
            poisoned: &|| self.poisoned(),
        };
        op.run(boxes, conns, input, recv)?;
        self.divide_average(call, plan, recv, seq)
    }

    fn internal(&self, op: OpKind, seq: u64, reason: String) -> Error {
        Error::Internal {
            rank: self.rank,
            op,
            seq,
            reason,
        }
    }

    /// PreMulSum: this rank's input scaled once (the algorithm then sums); `None` for other
    /// reductions.
    #[inline(always)]
    fn scaled_input(
        &self,
        call: &RawOp,
        plan: &Plan,
        send: Option<&[u8]>,
        recv: &[u8],
        seq: u64,
    ) -> Result<Option<Vec<u64>>> {
        let ReduceOp::PreMulSum(factor) = call.op else {
            return Ok(None);
        };
        if !call.has_reduction() {
            return Ok(None);
        }
        let input = plan.input_offset..plan.input_offset + plan.input_len;
        let src = match send {
            Some(s) => Some(s),
            None => recv.get(input),
        };
        self.scale(call, src, factor, seq).map(Some)
    }

    /// [`Inner::scaled_input`]'s work, out of line: `src` is the input (`None`: out of range).
    #[inline(never)]
    fn scale(&self, call: &RawOp, src: Option<&[u8]>, factor: f64, seq: u64) -> Result<Vec<u64>> {
        let src =
            src.ok_or_else(|| self.internal(call.kind, seq, "in-place input range".into()))?;
        let mut tmp = vec![0u64; src.len().div_ceil(8)];
        reduce::scale_into(
            call.dtype,
            &mut bytemuck::cast_slice_mut(&mut tmp)[..src.len()],
            src,
            factor,
        )
        .map_err(|e| self.internal(call.kind, seq, e.to_string()))?;
        Ok(tmp)
    }

    /// Avg: divides the reduced result once, where a result was written.
    #[inline(always)]
    fn divide_average(&self, call: &RawOp, plan: &Plan, recv: &mut [u8], seq: u64) -> Result<()> {
        if call.op != ReduceOp::Avg {
            return Ok(());
        }
        self.divide(call, plan, recv, seq)
    }

    #[inline(never)]
    fn divide(&self, call: &RawOp, plan: &Plan, recv: &mut [u8], seq: u64) -> Result<()> {
        let (r, n) = (self.rank, self.size);
        let range = match call.kind {
            OpKind::Reduce if r != call.root => return Ok(()),
            _ => plan.output_offset..plan.output_offset + call.count * call.dtype.size(),
        };
        if !call.has_reduction() || n <= 1 {
            return Ok(());
        }
        let out = recv
            .get_mut(range)
            .ok_or_else(|| self.internal(call.kind, seq, "average range".into()))?;
        reduce::divide_in_place(call.dtype, out, n)
            .map_err(|e| self.internal(call.kind, seq, e.to_string()))
    }

    /// Connects every peer in `peers` not connected yet (for operation `desc`).
    #[inline(always)]
    fn connect_peers(&self, mesh: &mut Mesh, peers: &[usize], desc: &OpDesc) -> Result<()> {
        if mesh.all_connected(peers) {
            return Ok(());
        }
        self.connect(mesh, peers, desc)
    }

    #[cold]
    fn connect(&self, mesh: &mut Mesh, peers: &[usize], desc: &OpDesc) -> Result<()> {
        let cancel = || self.abort.load(Ordering::Acquire) || self.poisoned().is_some();
        let mut store = lock(&self.store);
        if let Err(e) = mesh.connect(peers, &mut store, self.timeout(), &cancel) {
            if let Some(poison) = self.poisoned() {
                return Err(poison);
            }
            return Err(executor::transport_error(self.rank, desc, e.peer, e.source));
        }
        Ok(())
    }

    /// Runs one operation over the connections, connecting the peers it needs first.
    pub(crate) fn execute(
        &self,
        mesh: &mut Mesh,
        workspace: &mut Workspace,
        run: &Run<'_>,
        areas: &mut [Area<'_>],
    ) -> Result<()> {
        let poisoned = || self.poisoned();
        let largest = areas.iter().map(Area::len).max().unwrap_or(0);
        let ctx = Context {
            rank: self.rank,
            desc: run.desc,
            prepared: run.prepared,
            layout: run.layout,
            headers: run.headers,
            dtype: run.dtype,
            combiner: run.op.combiner(),
            timeout: self.timeout(),
            abort: &self.abort,
            backoff: self.settings.backoff,
            pinned_sends: sends_pinned(run.desc.kind, largest, self.settings.pinned_max_bytes),
            poisoned: &poisoned,
            collective_seq: run.collective_seq,
        };
        let prepared = run.prepared;
        self.connect_peers(mesh, prepared.peers(), &run.desc)?;
        let (conns, waiter) = mesh.parts();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            executor::execute_prepared(&ctx, areas, conns, waiter, workspace)
        }));
        if !matches!(result, Ok(Ok(()))) {
            // The caller gets its buffers back: no peer may write into them any more.
            mesh.cancel_pinned();
        }
        result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// This communicator's flight recorder as a dump taken now.
    pub(crate) fn trace_dump(&self, reason: DumpReason) -> TraceDump {
        let (entries, recorded) = self.trace.snapshot();
        let me = RankIdentity::this_process(self.size);
        TraceDump {
            format: TRACE_FORMAT.into(),
            job: job_tag(&self.id.token),
            namespace: self.namespace.clone(),
            rank: self.rank,
            nranks: self.size,
            host: me.host,
            pid: me.pid,
            reason,
            error: self.poisoned().map(|e| e.to_string()),
            dumped_us: now_us(),
            recorded,
            capacity: self.trace.capacity(),
            entries: entries.iter().map(TraceEntry::record).collect(),
            lineage: self.lineage.events(),
        }
    }

    /// Once the communicator has failed: writes the recorder to `WEFT_TRACE_DUMP_DIR` when that
    /// is set (and the recorder on), once. Called after the failure is published and the
    /// waiting threads woken (the end of a failed call, `abort`, the watcher, the drop).
    pub(crate) fn dump_trace_if_due(&self) {
        let Some(dir) = &self.settings.trace_dump_dir else {
            return;
        };
        if self.trace.capacity() == 0 || !self.trace_dump_due.swap(false, Ordering::AcqRel) {
            return;
        }
        match self.trace_dump(DumpReason::Failure).write_to(dir) {
            Ok(path) => {
                tracing::warn!(target: "weftcc::trace", rank = self.rank, path = %path.display(), "flight recorder written")
            }
            Err(e) => {
                tracing::warn!(target: "weftcc::trace", rank = self.rank, dir = %dir.display(), "flight recorder not written: {e}")
            }
        }
    }

    /// Answers a job-wide dump request (read by the failure watcher): takes the dump now, and
    /// on a thread of its own (a slow or hung file system must not hold up the watcher) writes
    /// it where the request says, else to `WEFT_TRACE_DUMP_DIR`, else [`default_dump_dir`], and
    /// leaves the answer (`ok HOST:PATH` or `error MESSAGE`) under [`DumpRequest::answer_key`]
    /// through a store connection of its own.
    pub(crate) fn answer_dump_request(&self, request: &DumpRequest) {
        let dir = (request.dir.clone())
            .or_else(|| self.settings.trace_dump_dir.clone())
            .unwrap_or_else(default_dump_dir);
        let dump = self.trace_dump(DumpReason::Request);
        let key = DumpRequest::answer_key(request.id, &self.namespace, self.rank);
        let (addr, token) = (self.id.addr.clone(), self.id.token.clone());
        let spawned = std::thread::Builder::new()
            .name("weft-trace-dump".into())
            .spawn(move || {
                let answer = match dump.write_to(&dir) {
                    Ok(path) => format!("ok {}:{}", dump.host, path.display()),
                    Err(e) => format!("error {}: {e}", dir.display()),
                };
                if let Ok(mut store) = StoreClient::connect(&addr, &token, Duration::from_secs(5)) {
                    let _ = store.set(&key, answer.as_bytes());
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(target: "weftcc::trace", rank = self.rank, "dump request not answered: {e}");
        }
    }
}

impl Surroundings for Inner {
    fn current_op(&self) -> (OpKind, u64) {
        self.current.get()
    }

    fn progress_record(&self) -> ProgressRecord {
        self.progress.record()
    }

    fn farewell_from(&self, peer: usize) -> Option<String> {
        self.try_lock_state()?.mesh.farewell(peer)
    }

    fn leave_farewell(&self, note: &str) -> bool {
        let Some(mut st) = self.try_lock_state() else {
            return false;
        };
        st.mesh.leave_farewell(note);
        true
    }

    fn poisoned_now(&self) {
        self.turns.wake_all();
        // Written later, where no store traffic or wake-up waits on it (dump_trace_if_due).
        self.trace_dump_due.store(true, Ordering::Release);
    }
}

/// A duration in whole milliseconds, saturated.
fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}
