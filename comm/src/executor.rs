//! Executes one rank's [`Schedule`] over its connections.
//!
//! The engine is a poll loop: it pushes the bytes of every send whose dependencies are met, pulls
//! the bytes of every receive (reducing or copying them straight out of the transport's buffer),
//! runs local copies, and when nothing moved it backs off — spin, then yield, then sleep in the
//! transport's [`IdleWaiter`] — while watching the deadline, the abort flag and peer liveness.
//!
//! Wire format per connection, direction and operation: one [`HEADER_LEN`]-byte header, sent to
//! every peer in the schedule's `send_peers` (even when no data follows), then the messages of the
//! schedule's sends to that peer in order, each padded to a multiple of 8 bytes so that every
//! message starts 8-byte aligned in the receiver's buffer. Headers travel only where data does:
//! a broadcast root or a sender never waits to hear from its receivers (see
//! [`execute_prepared`] for how mismatches are still caught).

use crate::config::Backoff;
use crate::error::{Error, Result, SeenBy};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use weftcc_collectives::dtype::DataType;
use weftcc_collectives::header::{OpDesc, HEADER_LEN};
use weftcc_collectives::op::{Combiner, OpKind};
use weftcc_collectives::reduce;
use weftcc_collectives::schedule::layout::{BufferMap, Placement};
use weftcc_collectives::schedule::{Action, Region, Schedule};
use weftcc_store::StoreError;
use weftcc_transports::{Connection, IdleWaiter, Interest, TransportError};

/// Longest single sleep of the idle loop: bounds how late an abort, poison or deadline is seen.
const MAX_SLEEP: Duration = Duration::from_millis(5);
/// While spinning, the clock (and the poison flag) is read once per this many idle polls.
const CLOCK_EVERY_POLLS: u32 = 16;
/// How often peers we wait on are checked for liveness while idle.
const LIVENESS_PERIOD: Duration = Duration::from_millis(20);

/// The idle policy of a rank waiting on its peers, from the last progress on: spin (reading the
/// clock and the poison only every [`CLOCK_EVERY_POLLS`] polls), then yield the CPU, then sleep
/// in the transport's waiter, checking liveness every [`LIVENESS_PERIOD`], until the deadline.
/// Shared by the schedule engine and one-shot collectives.
pub(crate) struct Idle {
    policy: Backoff,
    timeout: Duration,
    quiet_polls: u32,
    idle_since: Option<Instant>,
    deadline: Option<Instant>,
    last_liveness: Option<Instant>,
}

/// What an idle rank does next ([`Idle::next`]) when it has not stopped: nothing more (it has
/// spun or yielded), or check its peers' liveness and sleep.
pub(crate) struct IdleStep {
    pub check_liveness: bool,
    pub sleep: Option<Duration>,
}

/// Why waiting stops.
pub(crate) enum Stop {
    Aborted,
    Poisoned(Error),
    TimedOut,
}

impl Stop {
    /// The error of operation `desc` on `rank` stopped while waiting on `waiting_on`.
    pub(crate) fn into_error(
        self,
        rank: usize,
        desc: &OpDesc,
        mut waiting_on: Vec<usize>,
        timeout: Duration,
    ) -> Error {
        match self {
            Stop::Aborted => aborted_error(rank, desc),
            Stop::Poisoned(e) => e,
            Stop::TimedOut => {
                waiting_on.sort_unstable();
                waiting_on.dedup();
                Error::Timeout {
                    rank,
                    op: desc.kind,
                    seq: desc.seq,
                    waiting_on,
                    after: timeout,
                    seen_by: crate::error::SeenBy::ThisRank,
                    behind: Vec::new(),
                }
            }
        }
    }
}

impl Idle {
    pub(crate) fn new(policy: Backoff, timeout: Duration) -> Idle {
        Idle {
            policy,
            timeout,
            quiet_polls: 0,
            idle_since: None,
            deadline: None,
            last_liveness: None,
        }
    }

    /// Something moved: the next wait starts from spinning again, with a new deadline.
    pub(crate) fn progressed(&mut self) {
        self.idle_since = None;
        self.deadline = None;
        self.quiet_polls = 0;
    }

    /// One more poll without progress: checks why the wait might stop, then backs off.
    #[inline]
    pub(crate) fn next(
        &mut self,
        abort: &AtomicBool,
        poisoned: &dyn Fn() -> Option<Error>,
    ) -> std::result::Result<IdleStep, Stop> {
        const SPUN: IdleStep = IdleStep {
            check_liveness: false,
            sleep: None,
        };
        if abort.load(Ordering::Relaxed) {
            return Err(Stop::Aborted);
        }
        // While spinning, most polls skip the clock and the poison check: each costs as much
        // as a poll, and a peer on another core answers within a few polls.
        self.quiet_polls = self.quiet_polls.wrapping_add(1);
        if !self.policy.spin.is_zero() && !self.quiet_polls.is_multiple_of(CLOCK_EVERY_POLLS) {
            std::hint::spin_loop();
            return Ok(SPUN);
        }
        if let Some(e) = poisoned() {
            return Err(Stop::Poisoned(e));
        }
        let now = Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.timeout);
        if now >= deadline {
            return Err(Stop::TimedOut);
        }
        let idle = now.duration_since(*self.idle_since.get_or_insert(now));
        if idle < self.policy.spin {
            std::hint::spin_loop();
            return Ok(SPUN);
        }
        if idle < self.policy.spin + self.policy.yield_for {
            std::thread::yield_now();
            return Ok(SPUN);
        }
        let check_liveness =
            now.duration_since(*self.last_liveness.get_or_insert(now)) >= LIVENESS_PERIOD;
        if check_liveness {
            self.last_liveness = Some(now);
        }
        Ok(IdleStep {
            check_liveness,
            sleep: Some(deadline.saturating_duration_since(now).min(MAX_SLEEP)),
        })
    }
}

/// A transport error of operation `desc` on `rank` with `peer` as the communicator's error.
pub(crate) fn transport_error(rank: usize, desc: &OpDesc, peer: usize, e: TransportError) -> Error {
    let lost = |detail: String| Error::PeerLost {
        rank,
        peer,
        op: desc.kind,
        seq: desc.seq,
        seen_by: SeenBy::ThisRank,
        detail,
    };
    match e {
        TransportError::PeerLost { detail, .. } => lost(detail),
        // The store's host went while this rank asked it for peers' addresses.
        TransportError::Store(StoreError::Lost { detail }) => {
            lost(format!("bootstrap store: {detail}"))
        }
        TransportError::Aborted => aborted_error(rank, desc),
        source => Error::Transport {
            rank,
            peer,
            op: desc.kind,
            seq: desc.seq,
            source,
        },
    }
}

/// `abort()` stopped operation `desc` on `rank`.
pub(crate) fn aborted_error(rank: usize, desc: &OpDesc) -> Error {
    Error::Aborted {
        rank,
        by: None,
        reason: format!("abort() called during {} #{}", desc.kind, desc.seq),
        cause: crate::records::note::AbortCause::AbortCalled,
        during: Some((desc.kind, desc.seq)),
    }
}

/// One contiguous piece of memory the operation reads or writes.
pub enum Area<'a> {
    ReadOnly(&'a [u8]),
    ReadWrite(&'a mut [u8]),
}

impl Area<'_> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Area::ReadOnly(b) => b,
            Area::ReadWrite(b) => b,
        }
    }
}

/// How the schedule's logical buffers map onto the areas.
pub type Layout = BufferMap<Placement>;

/// `region`'s first byte: its area and byte offset.
fn place(layout: &Layout, region: &Region, esize: usize) -> Option<(usize, usize)> {
    let (p, elem) = layout.locate(region.buf, region.offset)?;
    Some((p.area, p.offset.checked_add(elem.checked_mul(esize)?)?))
}

/// One operation as the executor runs it: its header, element type and reduction, its prepared
/// schedule, where the schedule's buffers lie, the per-peer headers of a point-to-point group
/// (`(peer, header sent to it, header expected from it)`; peers not listed use `desc` both
/// ways), and the communicator's settings and signals it runs under.
pub struct Context<'a> {
    pub rank: usize,
    pub desc: OpDesc,
    pub prepared: &'a Prepared,
    pub layout: &'a Layout,
    pub headers: &'a [(usize, OpDesc, OpDesc)],
    pub dtype: DataType,
    pub combiner: Combiner,
    pub timeout: Duration,
    pub abort: &'a AtomicBool,
    /// How long to spin, then to yield the CPU, after the last progress before sleeping.
    pub backoff: Backoff,
    /// Send messages with [`Connection::try_send_pinned`] (single copy where the transport has
    /// one) rather than [`Connection::try_send`].
    pub pinned_sends: bool,
    /// Returns the error that poisoned the communicator while this operation ran, if any.
    pub poisoned: &'a dyn Fn() -> Option<Error>,
    /// Sequence number of the communicator's latest collective (this one, for a collective; 0
    /// before the first, collectives count from 1): a peer's collective header up to it that
    /// waits on a connection this operation does not read is a mismatch.
    pub collective_seq: u64,
}

impl Context<'_> {
    fn kind(&self) -> OpKind {
        self.desc.kind
    }

    fn internal(&self, reason: String) -> Error {
        Error::Internal {
            rank: self.rank,
            op: self.kind(),
            seq: self.desc.seq,
            reason,
        }
    }

    pub(crate) fn transport(&self, peer: usize, e: TransportError) -> Error {
        transport_error(self.rank, &self.desc, peer, e)
    }
}

/// A schedule prepared for execution: its steps grouped per peer and direction. Built once per
/// distinct call and cached by the communicator, so that a repeated call allocates nothing.
#[derive(Debug)]
pub struct Prepared {
    /// Distinguishes this preparation from every other in the process (see [`PlacesKey`]).
    id: u64,
    schedule: Schedule,
    /// Step indices grouped by lane and direction; each lane's cursors walk a range of it.
    order: Vec<usize>,
    lanes: Vec<Lane>,
    /// Local copy steps, in schedule order.
    copies: Vec<usize>,
    /// Every lane's peer.
    peers: Vec<usize>,
    /// The schedule's one transfer, when it has only one and nothing waits ([`OneMessage`]).
    one_message: Option<OneMessage>,
    /// The algorithm the schedule was built by (for the flight recorder); `None` for
    /// point-to-point groups.
    algorithm: Option<weftcc_collectives::Algorithm>,
}

/// The steps exchanged with one peer: `order[send]` go to it, `order[recv]` come from it.
#[derive(Debug, Clone)]
struct Lane {
    peer: usize,
    send: std::ops::Range<usize>,
    recv: std::ops::Range<usize>,
    /// The peer is in the schedule's `send_peers` (gets our header) / `recv_peers` (sends one).
    header_out: bool,
    header_in: bool,
}

impl Prepared {
    /// Groups `schedule`'s steps by peer and direction.
    pub fn new(schedule: Schedule) -> Prepared {
        let mut peers: Vec<usize> = Vec::new();
        let mut add = |p: usize| {
            if !peers.contains(&p) {
                peers.push(p);
            }
        };
        for &p in schedule.send_peers.iter().chain(&schedule.recv_peers) {
            add(p);
        }
        for step in &schedule.steps {
            match step.action {
                Action::Send { peer, .. }
                | Action::RecvCopy { peer, .. }
                | Action::RecvReduce { peer, .. } => add(peer),
                Action::Copy { .. } => {}
            }
        }
        // Per lane and direction, the steps in schedule order (a small counting sort).
        let lane_of = |p: usize| peers.iter().position(|&q| q == p).unwrap_or(0);
        let mut buckets: Vec<Vec<usize>> = vec![Vec::new(); 2 * peers.len()];
        let mut copies = Vec::new();
        for (i, step) in schedule.steps.iter().enumerate() {
            match step.action {
                Action::Send { peer, .. } => buckets[2 * lane_of(peer)].push(i),
                Action::RecvCopy { peer, .. } | Action::RecvReduce { peer, .. } => {
                    buckets[2 * lane_of(peer) + 1].push(i)
                }
                Action::Copy { .. } => copies.push(i),
            }
        }
        let mut order = Vec::with_capacity(schedule.steps.len());
        let mut lanes = Vec::with_capacity(peers.len());
        for (k, &peer) in peers.iter().enumerate() {
            let s0 = order.len();
            order.extend_from_slice(&buckets[2 * k]);
            let r0 = order.len();
            order.extend_from_slice(&buckets[2 * k + 1]);
            lanes.push(Lane {
                peer,
                send: s0..r0,
                recv: r0..order.len(),
                header_out: schedule.send_peers.contains(&peer),
                header_in: schedule.recv_peers.contains(&peer),
            });
        }
        let one_message = OneMessage::of(&schedule, &lanes, &order);
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Prepared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            schedule,
            order,
            lanes,
            copies,
            peers,
            one_message,
            algorithm: None,
        }
    }

    /// Names the algorithm the schedule was built by.
    pub fn built_by(mut self, algorithm: weftcc_collectives::Algorithm) -> Prepared {
        self.algorithm = Some(algorithm);
        self
    }

    /// The algorithm the schedule was built by, when it was named ([`Prepared::built_by`]).
    pub fn algorithm(&self) -> Option<weftcc_collectives::Algorithm> {
        self.algorithm
    }

    /// The peers this schedule exchanges data with (each once): what must be connected first.
    pub fn peers(&self) -> &[usize] {
        &self.peers
    }

    /// The schedule this was prepared from.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
}

/// A schedule that is one message to or from one peer, with nothing that waits on anything (a
/// broadcast or a reduce between 2 ranks, a tree's leaf): the operation is then tried as that
/// one message, whole, before the general pass ([`try_one_message`]).
#[derive(Debug, Clone, Copy)]
struct OneMessage {
    /// The step (of the schedule's only lane), and whether it sends.
    step: usize,
    send: bool,
}

impl OneMessage {
    fn of(schedule: &Schedule, lanes: &[Lane], order: &[usize]) -> Option<OneMessage> {
        let [lane] = lanes else { return None };
        let (send, range) = match (lane.send.len(), lane.recv.len()) {
            (1, 0) => (true, &lane.send),
            (0, 1) => (false, &lane.recv),
            _ => return None,
        };
        // The header travels with the message, and only that way.
        if (lane.header_out, lane.header_in) != (send, !send) {
            return None;
        }
        if schedule.steps.iter().any(|s| !s.deps.is_empty()) {
            return None;
        }
        Some(OneMessage {
            step: order[range.start],
            send,
        })
    }
}

/// Memory the engine reuses from one operation to the next (kept by the communicator).
#[derive(Default)]
pub struct Workspace {
    places: Vec<[(usize, usize, usize); 2]>,
    /// What `places` was resolved from; `None` when it must be resolved again.
    places_for: Option<PlacesKey>,
    done: Vec<bool>,
    cursors: Vec<[Cursor; 2]>,
    interest: Vec<Interest>,
    /// Header and first message of a connection, sent in one write.
    stage: Vec<u8>,
}

/// Progress of the header exchange and of the messages in one direction of one lane.
#[derive(Clone, Copy)]
struct Cursor {
    /// Index into [`Prepared::order`] of the step in progress, and one past the lane's last.
    next: usize,
    end: usize,
    /// Bytes of the current message (data, then padding) already moved.
    moved: usize,
    header_done: bool,
    header_moved: usize,
    header: [u8; HEADER_LEN],
    /// The header this rank expects from the peer (receive side).
    expect: OpDesc,
}

impl Cursor {
    /// `n` more bytes of the header moved; whether all of it has now.
    fn header_advanced(&mut self, n: usize) -> bool {
        self.header_moved += n;
        self.header_done = self.header_moved >= HEADER_LEN;
        self.header_done
    }

    /// The step in progress has moved all its bytes: on to the lane's next.
    fn step_done(&mut self) {
        self.next += 1;
        self.moved = 0;
    }

    /// A cursor over `range`; `header` says whether a header goes first in its direction.
    fn new(range: &std::ops::Range<usize>, header: bool, expect: OpDesc) -> Cursor {
        Cursor {
            next: range.start,
            end: range.end,
            moved: 0,
            header_done: !header,
            header_moved: 0,
            header: [0; HEADER_LEN],
            expect,
        }
    }

    /// [`Cursor::new`] in place (keeps the header bytes, which the header's sender overwrites
    /// and a receiver fills before reading).
    fn reset(&mut self, range: &std::ops::Range<usize>, header: bool, expect: OpDesc) {
        self.next = range.start;
        self.end = range.end;
        self.moved = 0;
        self.header_done = !header;
        self.header_moved = 0;
        self.expect = expect;
    }

    fn pending(&self) -> bool {
        !self.header_done || self.next < self.end
    }

    /// Whether this direction waits on its connection (for the header, or for a step whose
    /// dependencies are met) rather than on another step. Only those go into the waiter's
    /// interest: a socket that is writable while its next send still waits for a receive
    /// would otherwise end every `poll` at once, and a rank would spin in the kernel.
    fn waits_on_transport(
        &self,
        steps: &[weftcc_collectives::schedule::Step],
        order: &[usize],
        done: &[bool],
    ) -> bool {
        !self.header_done || (self.next < self.end && deps_done(steps, done, order[self.next]))
    }
}

/// The inputs that decide an operation's resolved places, for a fixed layout over at most three
/// areas (every collective): a training loop repeats the same calls on the same buffers' sizes,
/// and resolving and bounds-checking every step's regions again was a tenth of an 8-byte
/// all-reduce.
#[derive(Clone, Copy)]
struct PlacesKey {
    prepared: u64,
    esize: usize,
    placements: [(usize, usize); 3],
    lens: [usize; 3],
}

impl PlacesKey {
    fn of(prepared: &Prepared, layout: &Layout, areas: &[Area<'_>], esize: usize) -> Option<Self> {
        let [input, output, scratch] = layout.fixed_places()?;
        if areas.len() > 3 {
            return None;
        }
        let mut lens = [usize::MAX; 3];
        for (len, area) in lens.iter_mut().zip(areas) {
            *len = area.len();
        }
        let at = |p: Placement| (p.area, p.offset);
        Some(PlacesKey {
            prepared: prepared.id,
            esize,
            placements: [at(input), at(output), at(scratch)],
            lens,
        })
    }

    /// Field by field: the derived comparison loads the arrays as vectors just after they were
    /// stored as words, and the failed store forwarding cost more than the comparison.
    fn same(&self, other: &PlacesKey) -> bool {
        self.prepared == other.prepared
            && self.esize == other.esize
            && (0..3).all(|i| {
                self.placements[i].0 == other.placements[i].0
                    && self.placements[i].1 == other.placements[i].1
                    && self.lens[i] == other.lens[i]
            })
    }
}

fn padded(bytes: usize) -> usize {
    bytes.div_ceil(8) * 8
}

/// Largest first message sent in the same write as the header (small operations then cost one
/// transport message per direction).
const COALESCE_MAX: usize = 4096;

/// Runs `ctx`'s prepared schedule over `areas` (the memory its layout places buffers in) and
/// the connections.
///
/// `ctx.timeout` bounds how long the operation may go without progress: it counts from the
/// moment nothing moved, restarts whenever something does, and an operation that never has to
/// wait never reads the clock.
pub fn execute_prepared(
    ctx: &Context<'_>,
    areas: &mut [Area<'_>],
    conns: &mut [Option<Box<dyn Connection>>],
    waiter: &mut dyn IdleWaiter,
    ws: &mut Workspace,
) -> Result<()> {
    let (prepared, layout) = (ctx.prepared, ctx.layout);
    let esize = ctx.dtype.size();
    let steps = &prepared.schedule.steps;
    let order = &prepared.order;
    let Workspace {
        places,
        places_for,
        done,
        cursors,
        interest,
        stage,
    } = ws;
    // Resolve every region once, validating bounds, so the loop below cannot go out of range
    // (unless the previous operation resolved the same schedule over the same memory shape).
    let key = PlacesKey::of(prepared, layout, areas, esize);
    let resolved = matches!((&key, &*places_for), (Some(k), Some(prev)) if k.same(prev));
    if !resolved {
        *places_for = None;
        resolve_places(ctx, steps, layout, areas, esize, places)?;
        *places_for = key;
    }
    if let Some(one) = prepared.one_message {
        if try_one_message(ctx, one, areas, conns, places, stage)? {
            return Ok(());
        }
    }

    // Headers flow where data flows (to `send_peers`, from `recv_peers`), so a broadcast root
    // or a reduce's senders never wait for a round trip. A mismatch is still caught: by the
    // receiver that checks the header, by the next operation that reads the connection (a
    // header sent where none was expected is still there, with an older sequence number), and,
    // while this operation waits, by `stray_header` (two ranks that both believe they only
    // send would otherwise wait on full buffers until the timeout).
    // Cursors are reset field by field where they are: built on the stack and moved into the
    // vector, they were read back in wider loads than they were written with.
    if cursors.len() != prepared.lanes.len() {
        cursors.clear();
        cursors.resize(
            prepared.lanes.len(),
            [Cursor::new(&(0..0), false, ctx.desc); 2],
        );
    }
    for (lane, [send, recv]) in prepared.lanes.iter().zip(cursors.iter_mut()) {
        if lane.peer == ctx.rank || conns.get(lane.peer).is_none_or(|c| c.is_none()) {
            return Err(ctx.internal(format!("no connection to rank {}", lane.peer)));
        }
        let (out, expect) = header_descs(ctx, lane.peer);
        send.reset(&lane.send, lane.header_out, out);
        recv.reset(&lane.recv, lane.header_in, expect);
        if lane.header_out {
            out.encode_into(ctx.rank as u32, &mut send.header);
        }
    }

    done.clear();
    done.resize(steps.len(), false);
    let copies = &prepared.copies;
    let mut copies_left = copies.len();
    let mut idle = Idle::new(ctx.backoff, ctx.timeout);

    // Small local copies that are ready at the start run before any transfer: a send that waits
    // on one (in-place all-to-all stages its outgoing block) then leaves in the same write as
    // its header, instead of the header going alone and the data a pass later.
    if copies_left > 0 {
        copies_left -= run_ready_copies(ctx, steps, copies, places, done, areas, COALESCE_MAX)?;
    }

    loop {
        let mut progressed = false;
        let mut pending = false;
        for (lane, [send, recv]) in prepared.lanes.iter().zip(cursors.iter_mut()) {
            let conn = match conns.get_mut(lane.peer).and_then(|c| c.as_mut()) {
                Some(c) => c,
                None => return Err(ctx.internal(format!("no connection to rank {}", lane.peer))),
            };
            let mut io = Io {
                ctx,
                conn: conn.as_mut(),
                steps,
                order,
                places,
                done,
            };
            progressed |= pump_sends(&mut io, send, areas, stage)?;
            progressed |= pump_recvs(&mut io, recv, areas)?;
            pending |= send.pending() || recv.pending();
        }
        // Local copies whose inputs are final, after the transfers were given their chance:
        // a send that does not need the copy is then already on its way (or being read by the
        // peer) while this rank copies.
        if copies_left > 0 {
            let ran = run_ready_copies(ctx, steps, copies, places, done, areas, usize::MAX)?;
            copies_left -= ran;
            progressed |= ran > 0;
            pending |= copies_left > 0;
        }
        if !pending {
            return Ok(());
        }
        if progressed {
            idle.progressed();
            continue;
        }

        // Nothing moved: check why we might stop, then back off.
        let step = idle.next(ctx.abort, ctx.poisoned).map_err(|stop| {
            let waiting_on: Vec<usize> = prepared
                .lanes
                .iter()
                .zip(cursors.iter())
                .filter(|(_, [s, r])| s.pending() || r.pending())
                .map(|(lane, _)| lane.peer)
                .collect();
            stop.into_error(ctx.rank, &ctx.desc, waiting_on, ctx.timeout)
        })?;
        let Some(sleep) = step.sleep else {
            continue;
        };
        if step.check_liveness {
            for (lane, [s, r]) in prepared.lanes.iter().zip(cursors.iter()) {
                if let (true, Some(Some(conn))) =
                    (s.pending() || r.pending(), conns.get_mut(lane.peer))
                {
                    conn.check_peer().map_err(|e| ctx.transport(lane.peer, e))?;
                }
            }
            let reads_header_from =
                |peer: usize| prepared.lanes.iter().any(|l| l.peer == peer && l.header_in);
            stray_header(
                ctx.rank,
                &ctx.desc,
                ctx.collective_seq,
                &reads_header_from,
                conns,
            )?;
        }
        interest.clear();
        interest.extend(
            prepared
                .lanes
                .iter()
                .zip(cursors.iter())
                .filter_map(|(lane, [s, r])| {
                    let send = s.waits_on_transport(steps, order, done);
                    let recv = r.waits_on_transport(steps, order, done);
                    (send || recv).then_some(Interest {
                        peer: lane.peer,
                        recv,
                        send,
                    })
                }),
        );
        waiter
            .wait(interest, sleep)
            .map_err(|e| ctx.transport(ctx.rank, e))?;
    }
}

/// The header this rank sends to `peer` and the one it expects from it: the operation's own,
/// unless the context names per-peer headers (point-to-point groups).
fn header_descs(ctx: &Context<'_>, peer: usize) -> (OpDesc, OpDesc) {
    ctx.headers
        .iter()
        .find(|h| h.0 == peer)
        .map(|h| (h.1, h.2))
        .unwrap_or((ctx.desc, ctx.desc))
}

/// `header` and a first message's `data` as one write in `stage`, the data padded to whole words.
fn coalesce(stage: &mut Vec<u8>, header: &[u8; HEADER_LEN], data: &[u8]) {
    stage.clear();
    stage.extend_from_slice(header);
    stage.extend_from_slice(data);
    stage.resize(HEADER_LEN + padded(data.len()), 0);
}

/// Runs a [`OneMessage`] schedule when its message can move whole now: sent with its header in
/// one write the transport takes whole, or received complete with its header in one piece.
/// Returns false, having moved nothing, otherwise (the general pass then runs the schedule from
/// its start); true once the transfer and the local copies are done.
fn try_one_message(
    ctx: &Context<'_>,
    one: OneMessage,
    areas: &mut [Area<'_>],
    conns: &mut [Option<Box<dyn Connection>>],
    places: &[[(usize, usize, usize); 2]],
    stage: &mut Vec<u8>,
) -> Result<bool> {
    let prepared = ctx.prepared;
    let Some(lane) = prepared.lanes.first() else {
        return Ok(false);
    };
    let place = places[one.step];
    let (area, off, len) = place[0];
    let total = padded(len);
    if HEADER_LEN + total > COALESCE_MAX {
        return Ok(false);
    }
    let conn = match conns.get_mut(lane.peer).and_then(|c| c.as_mut()) {
        Some(c) if lane.peer != ctx.rank => c,
        _ => return Err(ctx.internal(format!("no connection to rank {}", lane.peer))),
    };
    let (out, expect) = header_descs(ctx, lane.peer);
    if one.send {
        coalesce(
            stage,
            &out.encode(ctx.rank as u32),
            &areas[area].bytes()[off..off + len],
        );
        let sent = conn
            .try_send_whole(stage)
            .map_err(|e| ctx.transport(lane.peer, e))?;
        if !sent {
            return Ok(false);
        }
    } else {
        let step = &prepared.schedule.steps[one.step];
        let mut failure: Option<Error> = None;
        let mut take = |src: &[u8]| -> usize {
            if src.len() < HEADER_LEN + total {
                return 0; // not whole yet: the general pass takes it from here
            }
            let mut header = [0u8; HEADER_LEN];
            header.copy_from_slice(&src[..HEADER_LEN]);
            if let Err(e) = check_header(ctx, lane.peer, &header, &expect) {
                failure = Some(e);
                return HEADER_LEN;
            }
            if let Err(e) = deliver(
                ctx,
                step,
                place,
                areas,
                0,
                &src[HEADER_LEN..HEADER_LEN + len],
            ) {
                failure = Some(ctx.internal(e));
                return HEADER_LEN;
            }
            HEADER_LEN + total
        };
        let n = conn
            .try_recv(HEADER_LEN + total, &mut take)
            .map_err(|e| ctx.transport(lane.peer, e))?;
        if let Some(e) = failure {
            return Err(e);
        }
        if n == 0 {
            return Ok(false);
        }
    }
    // Nothing in the schedule waits on anything: its copies are independent of the message.
    for &i in &prepared.copies {
        let [(da, doff, len), (sa, soff, _)] = places[i];
        copy_region(areas, (sa, soff), (da, doff), len).map_err(|e| ctx.internal(e))?;
    }
    Ok(true)
}

/// Every step's regions as `(area, byte offset, bytes)`, checked to lie inside their areas:
/// `[destination or source, local operand]`.
fn resolve_places(
    ctx: &Context<'_>,
    steps: &[weftcc_collectives::schedule::Step],
    layout: &Layout,
    areas: &[Area<'_>],
    esize: usize,
    places: &mut Vec<[(usize, usize, usize); 2]>,
) -> Result<()> {
    places.clear();
    let resolve = |r: &Region| -> Result<(usize, usize, usize)> {
        let (area, off) = place(layout, r, esize)
            .ok_or_else(|| ctx.internal(format!("region {r:?} has no placement")))?;
        let len = r.len * esize;
        let size = areas.get(area).map(|a| a.bytes().len()).unwrap_or(0);
        if off.checked_add(len).is_none_or(|end| end > size) {
            return Err(ctx.internal(format!(
                "region {r:?} ({off}+{len} bytes) outside area {area} of {size} bytes"
            )));
        }
        Ok((area, off, len))
    };
    for step in steps {
        let p = match &step.action {
            Action::Send { src, .. } => [resolve(src)?, (0, 0, 0)],
            Action::RecvCopy { dst, .. } => [resolve(dst)?, (0, 0, 0)],
            Action::RecvReduce { local, dst, .. } => [resolve(dst)?, resolve(local)?],
            Action::Copy { src, dst } => [resolve(dst)?, resolve(src)?],
        };
        places.push(p);
    }
    Ok(())
}

/// What the pumps of one connection share.
struct Io<'x, 'c> {
    ctx: &'x Context<'c>,
    conn: &'x mut dyn Connection,
    steps: &'x [weftcc_collectives::schedule::Step],
    order: &'x [usize],
    places: &'x [[(usize, usize, usize); 2]],
    done: &'x mut [bool],
}

impl Io<'_, '_> {
    fn ready(&self, i: usize) -> bool {
        deps_done(self.steps, self.done, i)
    }

    /// Step `i`, the one `cur` is on, has moved all its bytes: steps that depend on it may
    /// start, and `cur` goes on to its lane's next.
    fn step_done(&mut self, cur: &mut Cursor, i: usize) {
        self.done[i] = true;
        cur.step_done();
    }
}

/// Pushes the header and then every send step whose dependencies are met, until the connection
/// is full. Returns whether any byte moved.
fn pump_sends(
    io: &mut Io<'_, '_>,
    cur: &mut Cursor,
    areas: &[Area<'_>],
    stage: &mut Vec<u8>,
) -> Result<bool> {
    let ctx = io.ctx;
    let peer = io.conn.peer();
    let mut progressed = false;
    if !cur.header_done {
        // A small first message that is ready goes out in the same write as the header.
        let first = io.order[cur.next..cur.end]
            .first()
            .copied()
            .filter(|&i| cur.header_moved == 0 && io.ready(i));
        match first.map(|i| (i, io.places[i][0])) {
            Some((_, (area, off, len))) if padded(len) <= COALESCE_MAX => {
                coalesce(stage, &cur.header, &areas[area].bytes()[off..off + len]);
                let n = io
                    .conn
                    .try_send(stage)
                    .map_err(|e| ctx.transport(peer, e))?;
                progressed |= n > 0;
                if n < HEADER_LEN {
                    cur.header_moved = n;
                    return Ok(progressed);
                }
                cur.header_done = true;
                cur.moved = n - HEADER_LEN;
            }
            _ => {
                let n = io
                    .conn
                    .try_send(&cur.header[cur.header_moved..])
                    .map_err(|e| ctx.transport(peer, e))?;
                progressed |= n > 0;
                if !cur.header_advanced(n) {
                    return Ok(progressed);
                }
            }
        }
    }
    const ZEROS: [u8; 8] = [0; 8];
    while cur.next < cur.end {
        let i = io.order[cur.next];
        if !io.ready(i) {
            break;
        }
        let (area, off, len) = io.places[i][0];
        let total = padded(len);
        if cur.moved < len {
            // The source stays unchanged until the step completes (later steps that overwrite
            // it depend on this one), which is what a pinned write asks.
            let src = &areas[area].bytes()[off + cur.moved..off + len];
            let n = if ctx.pinned_sends {
                io.conn.try_send_pinned(src)
            } else {
                io.conn.try_send(src)
            }
            .map_err(|e| ctx.transport(peer, e))?;
            cur.moved += n;
            progressed |= n > 0;
            if cur.moved < len {
                break;
            }
        }
        if cur.moved < total {
            let n = io
                .conn
                .try_send(&ZEROS[..total - cur.moved])
                .map_err(|e| ctx.transport(peer, e))?;
            cur.moved += n;
            progressed |= n > 0;
            if cur.moved < total {
                break;
            }
        }
        io.step_done(cur, i);
        progressed = true;
    }
    Ok(progressed)
}

/// Copies or reduces `incoming` into receive step `i`'s destination at byte `at`.
fn deliver(
    ctx: &Context<'_>,
    step: &weftcc_collectives::schedule::Step,
    place: [(usize, usize, usize); 2],
    areas: &mut [Area<'_>],
    at: usize,
    incoming: &[u8],
) -> std::result::Result<(), String> {
    let [(da, doff, _), (la, loff, _)] = place;
    match step.action {
        Action::RecvReduce { .. } => reduce_from(
            areas,
            ctx.dtype,
            ctx.combiner,
            (da, doff + at),
            (la, loff + at),
            incoming,
        ),
        _ => match &mut areas[da] {
            Area::ReadWrite(b) => {
                b[doff + at..doff + at + incoming.len()].copy_from_slice(incoming);
                Ok(())
            }
            Area::ReadOnly(_) => Err("receive into read-only memory".into()),
        },
    }
}

/// Pulls the header and then the data of every receive step whose dependencies are met.
fn pump_recvs(io: &mut Io<'_, '_>, cur: &mut Cursor, areas: &mut [Area<'_>]) -> Result<bool> {
    let ctx = io.ctx;
    let peer = io.conn.peer();
    let esize = ctx.dtype.size();
    let mut progressed = false;
    if !cur.header_done && cur.header_moved == 0 {
        // Header and a small first message in one read, when both are there in one piece.
        let first = io.order[cur.next..cur.end]
            .first()
            .copied()
            .filter(|&i| io.ready(i) && padded(io.places[i][0].2) <= COALESCE_MAX);
        if let Some(i) = first {
            let (step, place) = (&io.steps[i], io.places[i]);
            let len = place[0].2;
            let total = padded(len);
            let mut failure: Option<Error> = None;
            let mut moved = 0usize;
            let mut offered = false;
            let header = &mut cur.header;
            let expect = cur.expect;
            let mut take = |src: &[u8]| -> usize {
                offered = true;
                if src.len() < HEADER_LEN {
                    return 0; // the plain path below takes a partial header
                }
                header.copy_from_slice(&src[..HEADER_LEN]);
                if let Err(e) = check_header(ctx, peer, header, &expect) {
                    failure = Some(e);
                    return HEADER_LEN;
                }
                let data = &src[HEADER_LEN..];
                let n = data.len().min(len) / esize * esize;
                if n > 0 {
                    if let Err(e) = deliver(ctx, step, place, areas, 0, &data[..n]) {
                        failure = Some(ctx.internal(e));
                        return HEADER_LEN;
                    }
                }
                moved = if n == len {
                    len + (data.len() - len).min(total - len)
                } else {
                    n
                };
                HEADER_LEN + moved
            };
            let n = io
                .conn
                .try_recv(HEADER_LEN + total, &mut take)
                .map_err(|e| ctx.transport(peer, e))?;
            if let Some(e) = failure {
                return Err(e);
            }
            if n > 0 {
                cur.header_done = true;
                cur.header_moved = HEADER_LEN;
                cur.moved = moved;
                progressed = true;
            } else if !offered {
                // Nothing has arrived ([`Connection::try_recv`] lends whatever is there): the
                // plain path below would only ask again, which costs as much as this poll.
                return Ok(progressed);
            }
        }
    }
    if !cur.header_done {
        let n = io
            .conn
            .try_recv_into(&mut cur.header[cur.header_moved..])
            .map_err(|e| ctx.transport(peer, e))?;
        progressed |= n > 0;
        if !cur.header_advanced(n) {
            return Ok(progressed);
        }
        check_header(ctx, peer, &cur.header, &cur.expect)?;
    }
    while cur.next < cur.end {
        let i = io.order[cur.next];
        if !io.ready(i) {
            break;
        }
        let [(da, doff, len), _] = io.places[i];
        let reduce = matches!(io.steps[i].action, Action::RecvReduce { .. });
        let total = padded(len);
        while cur.moved < len {
            let at = cur.moved;
            let n = if reduce {
                let mut failure: Option<String> = None;
                let want = len - at;
                let (step, place) = (&io.steps[i], io.places[i]);
                let n = io
                    .conn
                    .try_recv(want, &mut |src: &[u8]| {
                        // Whole elements only; a partial element stays in the transport.
                        let n = src.len().min(want) / esize * esize;
                        if n == 0 {
                            return 0;
                        }
                        match deliver(ctx, step, place, areas, at, &src[..n]) {
                            Ok(()) => n,
                            Err(e) => {
                                failure = Some(e);
                                0
                            }
                        }
                    })
                    .map_err(|e| ctx.transport(peer, e))?;
                if let Some(e) = failure {
                    return Err(ctx.internal(e));
                }
                n
            } else {
                // Copy: receive straight into the destination.
                let dst = match &mut areas[da] {
                    Area::ReadWrite(b) => &mut b[doff + at..doff + len],
                    Area::ReadOnly(_) => {
                        return Err(ctx.internal("receive into read-only memory".into()))
                    }
                };
                // SAFETY: the destination stays put until the step completes (later steps that
                // read or write it depend on this one; this cursor asks again for the rest of
                // it before any other read of the connection), and an operation that fails
                // cancels pinned receives before the caller gets its buffers back
                // (`Inner::execute`, also when unwinding).
                #[allow(unsafe_code)]
                let n = unsafe { io.conn.try_recv_into_pinned(dst) };
                n.map_err(|e| ctx.transport(peer, e))?
            };
            if n == 0 {
                return Ok(progressed);
            }
            cur.moved += n;
            progressed = true;
        }
        while cur.moved < total {
            let want = total - cur.moved;
            let n = io
                .conn
                .try_recv(want, &mut |src: &[u8]| src.len().min(want))
                .map_err(|e| ctx.transport(peer, e))?;
            if n == 0 {
                return Ok(progressed);
            }
            cur.moved += n;
            progressed = true;
        }
        io.step_done(cur, i);
        progressed = true;
    }
    Ok(progressed)
}

/// Looks at the connections this operation does not read from: a collective's header waiting
/// there with a sequence number up to this collective's was sent where this rank expected
/// nothing, so the ranks disagree about an operation. (A later collective's header, or a
/// point-to-point message, may legitimately be waiting: a peer can run ahead.) `ours` is the
/// operation on `rank`, `current` its collective sequence number, and `reads_header_from` names
/// the peers whose header it reads itself. Called only while the operation is idle, so it costs
/// nothing on the fast path.
pub(crate) fn stray_header(
    rank: usize,
    ours: &OpDesc,
    current: u64,
    reads_header_from: &dyn Fn(usize) -> bool,
    conns: &mut [Option<Box<dyn Connection>>],
) -> Result<()> {
    for (peer, conn) in conns.iter_mut().enumerate() {
        let Some(conn) = conn.as_mut() else { continue };
        if peer == rank || reads_header_from(peer) {
            continue;
        }
        let mut seen: Option<[u8; HEADER_LEN]> = None;
        // Errors are not this operation's business: a peer it does not use may have finished
        // its last operation and closed the connection, and a stream that is out of step is
        // reported by the operation that reads it.
        let peeked = conn.try_recv(HEADER_LEN, &mut |b: &[u8]| {
            if let Ok(h) = <[u8; HEADER_LEN]>::try_from(b) {
                seen = Some(h);
            }
            0 // look, do not take
        });
        let (Ok(_), Some(bytes)) = (peeked, seen) else {
            continue;
        };
        let Ok((theirs, _)) = OpDesc::decode(&bytes) else {
            continue;
        };
        if theirs.kind != OpKind::SendRecv && theirs.seq <= current {
            return Err(Error::Mismatch {
                rank,
                peer,
                ours: *ours,
                theirs,
            });
        }
    }
    Ok(())
}

fn check_header(
    ctx: &Context<'_>,
    peer: usize,
    bytes: &[u8; HEADER_LEN],
    expect: &OpDesc,
) -> Result<()> {
    if expect.is_encoded_in(peer as u32, bytes) {
        return Ok(());
    }
    let (theirs, sender) = OpDesc::decode(bytes).map_err(|e| Error::Transport {
        rank: ctx.rank,
        peer,
        op: ctx.kind(),
        seq: ctx.desc.seq,
        source: TransportError::Protocol(format!("bad operation header: {e}")),
    })?;
    if sender as usize != peer {
        return Err(ctx.internal(format!(
            "header from rank {sender} arrived on the connection to rank {peer}"
        )));
    }
    if theirs != *expect {
        return Err(Error::Mismatch {
            rank: ctx.rank,
            peer,
            ours: *expect,
            theirs,
        });
    }
    Ok(())
}

/// `dst = local ⊕ incoming` where dst and local are places in `areas`.
fn reduce_from(
    areas: &mut [Area<'_>],
    dtype: DataType,
    comb: Combiner,
    dst: (usize, usize),
    local: (usize, usize),
    incoming: &[u8],
) -> std::result::Result<(), String> {
    let n = incoming.len();
    let (da, doff) = dst;
    let (la, loff) = local;
    if da == la {
        let buf = match &mut areas[da] {
            Area::ReadWrite(b) => &mut **b,
            Area::ReadOnly(_) => return Err("reduce into read-only memory".into()),
        };
        if doff == loff {
            return reduce::reduce_in_place(dtype, comb, &mut buf[doff..doff + n], incoming)
                .map_err(|e| e.to_string());
        }
        // Same area, different places: split so both can be borrowed.
        if doff + n <= loff {
            let (lo, hi) = buf.split_at_mut(loff);
            return reduce::reduce_into(dtype, comb, &mut lo[doff..doff + n], &hi[..n], incoming)
                .map_err(|e| e.to_string());
        }
        if loff + n <= doff {
            let (lo, hi) = buf.split_at_mut(doff);
            return reduce::reduce_into(dtype, comb, &mut hi[..n], &lo[loff..loff + n], incoming)
                .map_err(|e| e.to_string());
        }
        return Err("overlapping reduce regions".into());
    }
    let (dst_area, local_area) = two_areas(areas, da, la)?;
    let dst_buf = match dst_area {
        Area::ReadWrite(b) => &mut b[doff..doff + n],
        Area::ReadOnly(_) => return Err("reduce into read-only memory".into()),
    };
    reduce::reduce_into(
        dtype,
        comb,
        dst_buf,
        &local_area.bytes()[loff..loff + n],
        incoming,
    )
    .map_err(|e| e.to_string())
}

fn two_areas<'s, 'a>(
    areas: &'s mut [Area<'a>],
    first: usize,
    second: usize,
) -> std::result::Result<(&'s mut Area<'a>, &'s Area<'a>), String> {
    if first == second || first >= areas.len() || second >= areas.len() {
        return Err("bad area pair".into());
    }
    if first < second {
        let (lo, hi) = areas.split_at_mut(second);
        Ok((&mut lo[first], &hi[0]))
    } else {
        let (lo, hi) = areas.split_at_mut(first);
        Ok((&mut hi[0], &lo[second]))
    }
}

/// Whether every step that step `i` depends on is done.
fn deps_done(steps: &[weftcc_collectives::schedule::Step], done: &[bool], i: usize) -> bool {
    steps[i].deps.iter().all(|&d| done.get(d) == Some(&true))
}

/// Runs every copy step not done yet whose dependencies are met and whose length is at most
/// `max_len`; returns how many ran.
fn run_ready_copies(
    ctx: &Context<'_>,
    steps: &[weftcc_collectives::schedule::Step],
    copies: &[usize],
    places: &[[(usize, usize, usize); 2]],
    done: &mut [bool],
    areas: &mut [Area<'_>],
    max_len: usize,
) -> Result<usize> {
    let mut ran = 0;
    for &i in copies {
        let [(da, doff, len), (sa, soff, _)] = places[i];
        if !done[i] && len <= max_len && deps_done(steps, done, i) {
            copy_region(areas, (sa, soff), (da, doff), len).map_err(|e| ctx.internal(e))?;
            done[i] = true;
            ran += 1;
        }
    }
    Ok(ran)
}

fn copy_region(
    areas: &mut [Area<'_>],
    src: (usize, usize),
    dst: (usize, usize),
    len: usize,
) -> std::result::Result<(), String> {
    let (sa, soff) = src;
    let (da, doff) = dst;
    if sa == da {
        if soff == doff {
            return Ok(()); // in-place: already there
        }
        match &mut areas[da] {
            Area::ReadWrite(b) => b.copy_within(soff..soff + len, doff),
            Area::ReadOnly(_) => return Err("copy into read-only memory".into()),
        }
        return Ok(());
    }
    let (d, s) = two_areas(areas, da, sa)?;
    match d {
        Area::ReadWrite(b) => b[doff..doff + len].copy_from_slice(&s.bytes()[soff..soff + len]),
        Area::ReadOnly(_) => return Err("copy into read-only memory".into()),
    }
    Ok(())
}
