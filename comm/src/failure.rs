//! The failure protocol: the first fatal error poisons the communicator and is published to
//! the bootstrap store as a typed note; a watcher thread on every rank reads it, so a dead or
//! failing rank becomes an error on all ranks within a fraction of a second instead of a hang.
//! Rank 0, which hosts the store, keeps it up after a failure until every rank's watcher has read
//! it (at most [`SETTLE_TIMEOUT`]).

use crate::communicator::Inner;
use crate::error::{AbortCause, Error, Result, SeenBy};
use crate::lock;
use crate::progress::Behind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weftcc_collectives::OpKind;
use weftcc_transports::store::{LocalStore, StoreClient};
use weftcc_transports::TransportError;

/// How often the watcher thread re-polls the store for a job-wide abort.
pub(crate) const WATCH_PERIOD: Duration = Duration::from_millis(100);
/// Longest a failure report waits on the store (each request; the first that goes unanswered
/// breaks the connection, so a lost store delays a rank's error by about this much, plus half a
/// second of the client's margin, once; a lost peer's report may first wait
/// [`PEER_CAUSE_GRACE`] for the peer's own cause).
pub(crate) const ALARM_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest the store's host, dropping a failed communicator, waits for the other ranks' watchers
/// to read the failure (a rank that died never does).
pub(crate) const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a rank that timed out waits for every rank's progress record.
pub(crate) const PROGRESS_READ_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest a rank that lost a peer waits for that peer's own cause in the store before it
/// publishes the loss as the job's cause.
pub(crate) const PEER_CAUSE_GRACE: Duration = Duration::from_millis(750);
/// Store keys (under a communicator's namespace, [`Inner::store_key`]): the published failure;
/// the count of watchers done with it, and the flag the last of them sets.
pub(crate) const ABORT_KEY: &str = "abort";
pub(crate) const SETTLED_KEY: &str = "settled";
pub(crate) const SETTLED_ALL_KEY: &str = "settled-all";

/// What runs when a communicator fails ([`crate::Communicator::on_failure`]).
pub(crate) type FailureHook = Box<dyn FnOnce(&Error) + Send>;

/// The error that stopped the communicator, and the operation running when it did.
pub(crate) struct Poison {
    pub(crate) error: Mutex<Option<Error>>,
    pub(crate) set: AtomicBool,
    /// Run once, with the error, by whoever sets it. Taken under this lock after `set` is
    /// stored, and a hook added under it sees `set` (runs at once instead), so each hook runs
    /// exactly once.
    pub(crate) hooks: Mutex<Vec<FailureHook>>,
}

impl Poison {
    pub(crate) fn new() -> Poison {
        Poison {
            error: Mutex::new(None),
            set: AtomicBool::new(false),
            hooks: Mutex::new(Vec::new()),
        }
    }
}

impl Inner {
    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        if !self.poison.set.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison.error).clone()
    }

    /// Fails at once when the communicator is poisoned.
    pub(crate) fn check(&self) -> Result<()> {
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
    pub(crate) fn fail(&self, e: Error) {
        if self.poison.set.load(Ordering::Acquire) {
            return;
        }
        let e = self.adopt_farewell(e);
        // Errors adopted from another rank (or seen only by the watcher) are not published again.
        let local = !matches!(&e, Error::Aborted { by: Some(_), .. })
            && !matches!(
                &e,
                Error::PeerLost {
                    seen_by: SeenBy::Rank(_) | SeenBy::Watcher | SeenBy::Store,
                    ..
                } | Error::Timeout {
                    seen_by: SeenBy::Rank(_) | SeenBy::Watcher | SeenBy::Store,
                    ..
                }
            );
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
    pub(crate) fn poison_with(&self, e: Error) -> bool {
        {
            let mut slot = lock(&self.poison.error);
            if slot.is_some() {
                return false;
            }
            tracing::warn!(target: "weftcc::error", rank = self.rank, "{e}");
            *slot = Some(e.clone());
            self.poison.set.store(true, Ordering::Release);
        }
        self.turn.wake_all();
        // Written later, where no store traffic or wake-up waits on it (dump_trace_if_due).
        self.trace_dump_due.store(true, Ordering::Release);
        let hooks = std::mem::take(&mut *lock(&self.poison.hooks));
        for hook in hooks {
            hook(&e);
        }
        true
    }

    /// Runs `hook` with the error when this communicator fails, or now if it has.
    pub(crate) fn on_failure(&self, hook: FailureHook) {
        let mut hooks = lock(&self.poison.hooks);
        if !self.poison.set.load(Ordering::Acquire) {
            hooks.push(hook);
            return;
        }
        drop(hooks);
        if let Some(e) = self.poisoned() {
            hook(&e);
        }
    }

    /// On rank 0, as this communicator goes: if its failure was published in the store, leaves
    /// the key that the other ranks' watchers set once they have all read it, and if no split
    /// relative still holds the store, waits for every such key before the store closes
    /// ([`StoreHost::settle`]; a relative dropped later waits for this one's too).
    pub(crate) fn settle_before_the_store_closes(&self) {
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
    pub(crate) fn store_key(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }

    pub(crate) fn publish_or_adopt(&self, e: Error) -> Error {
        let Ok(mut store) = self.alarm.try_lock() else {
            return e;
        };
        let key = self.store_key(ABORT_KEY);
        let e = self.diagnose(&mut store, e);
        // A peer that failed on its own (a ring it could not make, a bad argument) drops its
        // connections before it can publish why, so this rank often sees the consequence first:
        // give the peer's cause a moment to arrive before competing to publish the consequence.
        if matches!(
            &e,
            Error::PeerLost {
                seen_by: SeenBy::ThisRank,
                ..
            }
        ) {
            if let Ok(v) = store.get(&key, PEER_CAUSE_GRACE) {
                if let Some(cause) = remote_error(self, &v) {
                    return cause;
                }
            }
        }
        // Neither request waits on the server: only the client's margin bounds them, so a store
        // that cannot be reached costs one margin (the first failure breaks the connection).
        match store.add_within(&format!("{key}-count"), 1, Duration::ZERO) {
            Ok(1) => {
                let _ =
                    store.set_within(&key, self.note_of(&e).encode().as_bytes(), Duration::ZERO);
                e
            }
            Ok(_) => match store.get(&key, ALARM_TIMEOUT) {
                Ok(v) => remote_error(self, &v).unwrap_or(e),
                Err(_) => e,
            },
            Err(_) => e,
        }
    }

    /// Store key of rank `rank`'s published progress.
    pub(crate) fn progress_key(&self, rank: usize) -> String {
        crate::progress::progress_key(&self.namespace, rank)
    }

    /// A collective this rank timed out in, with the ranks that had not entered it (from every
    /// rank's published progress; this rank's own record is published first, fresh); a
    /// point-to-point exchange, with the awaited peers that give no sign of life. Any other
    /// error, or a store that cannot tell, leaves `e` as it is.
    fn diagnose(&self, store: &mut StoreClient, e: Error) -> Error {
        let Error::Timeout {
            rank,
            op,
            seq,
            waiting_on,
            after,
            seen_by: SeenBy::ThisRank,
            behind,
        } = e
        else {
            return e;
        };
        let keep = |behind| Error::Timeout {
            rank,
            op,
            seq,
            waiting_on: waiting_on.clone(),
            after,
            seen_by: SeenBy::ThisRank,
            behind,
        };
        if !behind.is_empty() {
            return keep(behind);
        }
        // Each rank's silence, from its watcher's store session (unknown: none silent).
        let silence = |store: &mut StoreClient| {
            store
                .sessions(&crate::progress::session_prefix(&self.namespace))
                .map(|s| crate::progress::silence(&s, &self.namespace, self.size))
                .unwrap_or_default()
        };
        // Point-to-point sequence numbers count one pair's messages, not comparable across
        // ranks: only the silence of the peers awaited says something.
        if op == OpKind::SendRecv {
            let silent = silence(store);
            let named = waiting_on
                .iter()
                .filter_map(|&peer| {
                    let silent = silent.get(peer).copied().flatten()?;
                    Some(Behind {
                        rank: peer,
                        entered: None,
                        completed: None,
                        idle: Duration::ZERO,
                        silent: Some(silent),
                    })
                })
                .collect();
            return keep(named);
        }
        let own = self.progress.record().encode();
        let _ = store.set_within(
            &self.progress_key(self.rank),
            own.as_bytes(),
            Duration::ZERO,
        );
        let keys: Vec<String> = (0..self.size).map(|r| self.progress_key(r)).collect();
        let Ok(values) = store.get_all(&keys, PROGRESS_READ_TIMEOUT) else {
            return keep(behind);
        };
        let records: Vec<_> = values
            .iter()
            .map(|v| crate::progress::ProgressRecord::decode(v))
            .collect();
        let silent = silence(store);
        keep(crate::progress::behind(
            &records,
            &silent,
            seq,
            self.rank,
            crate::progress::now_ms(),
        ))
    }

    /// `e` as the store and farewell notes carry it, naming the rank where the failure started
    /// (this one, or the one an adopted error came from).
    pub(crate) fn note_of(&self, e: &Error) -> FailureNote {
        match e {
            Error::Timeout {
                op,
                seq,
                waiting_on,
                after,
                seen_by,
                behind,
                ..
            } => FailureNote::Timeout {
                origin: match seen_by {
                    SeenBy::Rank(r) => *r,
                    SeenBy::ThisRank | SeenBy::Watcher | SeenBy::Store => self.rank,
                },
                op: *op,
                seq: *seq,
                after_ms: after.as_millis() as u64,
                waiting_on: waiting_on.clone(),
                behind: behind.clone(),
            },
            Error::Aborted {
                by,
                reason,
                cause,
                during,
                ..
            } => FailureNote::Abort {
                origin: by.unwrap_or(self.rank),
                reason: reason.clone(),
                cause: *cause,
                during: *during,
            },
            Error::PeerLost {
                peer,
                seen_by,
                detail,
                ..
            } => FailureNote::Lost {
                peer: *peer,
                reporter: match seen_by {
                    SeenBy::Rank(r) => Some(*r),
                    SeenBy::ThisRank | SeenBy::Watcher => Some(self.rank),
                    SeenBy::Store => None,
                },
                detail: detail.clone(),
            },
            other => FailureNote::Abort {
                origin: self.rank,
                reason: other.to_string(),
                during: {
                    let f = other.facts();
                    f.op.zip(f.seq)
                },
                cause: match other {
                    Error::Mismatch { .. } => AbortCause::Mismatch,
                    _ => AbortCause::Failed,
                },
            },
        }
    }

    /// For a peer that closed its connection after failing, the cause it left there (see
    /// [`Inner::leave_farewell`]): the root cause, which the store may no longer be able to
    /// tell (it lives with rank 0). Any other error is returned as it is.
    pub(crate) fn adopt_farewell(&self, e: Error) -> Error {
        let peer = match &e {
            Error::PeerLost {
                peer,
                seen_by: SeenBy::ThisRank,
                ..
            } => *peer,
            _ => return e,
        };
        let Some(st) = self.try_lock_state() else {
            return e;
        };
        let note = st.mesh.farewell(peer);
        drop(st);
        note.and_then(|n| remote_error(self, n.as_bytes()))
            .unwrap_or(e)
    }

    /// Leaves the poison's cause on every connection, once, for peers that see this rank close
    /// (shared memory keeps it; see [`weftcc_transports::Connection::leave_farewell`]). Skipped
    /// while an operation holds the state; the next call (at the latest the communicator's
    /// drop) leaves it.
    pub(crate) fn leave_farewell(&self) {
        if self.farewell_left.load(Ordering::Acquire) {
            return;
        }
        let Some(e) = self.poisoned() else { return };
        let Some(mut st) = self.try_lock_state() else {
            return;
        };
        st.mesh.leave_farewell(&self.note_of(&e).encode());
        self.farewell_left.store(true, Ordering::Release);
    }
}

/// Watches the store for a job-wide abort, and for the death of the store's host (rank 0).
pub(crate) fn watch(inner: Arc<Inner>, mut client: StoreClient) {
    let key = inner.store_key(ABORT_KEY);
    let progress_key = inner.progress_key(inner.rank);
    let mut published = None;
    // Dump requests made before this communicator existed are not for it.
    let mut requests = DumpRequests::new(&mut client);
    while !inner.watcher_stop.load(Ordering::SeqCst) {
        requests.poll(&inner, &mut client);
        // This rank's progress, when it moved (a store that fails here fails the get below; no
        // server-side wait, so a lost store costs the client's margin, not its timeout).
        let version = inner.progress.version();
        if published != Some(version)
            && client
                .set_within(
                    &progress_key,
                    inner.progress.record().encode().as_bytes(),
                    Duration::ZERO,
                )
                .is_ok()
        {
            published = Some(version);
        }
        match client.get(&key, WATCH_PERIOD) {
            Ok(value) => {
                if let Some(e) = remote_error(&inner, &value) {
                    inner.fail(e);
                    inner.turn.wake_all();
                }
                settle(&inner, &mut client);
                inner.dump_trace_if_due();
                keep_alive(&inner, &mut client, &mut requests);
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
                    seen_by: SeenBy::Watcher,
                    detail: format!("the bootstrap store on rank 0 is unreachable ({e})"),
                });
                inner.dump_trace_if_due();
                return;
            }
        }
    }
    settle(&inner, &mut client);
    leave(&inner, &mut client);
}

/// After a failure, goes on showing the store that this rank lives (`weft status` tells a dead
/// process from one that failed and is still there) until the communicator goes.
fn keep_alive(inner: &Inner, client: &mut StoreClient, requests: &mut DumpRequests) {
    while !inner.watcher_stop.load(Ordering::SeqCst) {
        std::thread::sleep(WATCH_PERIOD);
        requests.poll(inner, client);
        // A request without a server-side wait: a store that is gone costs the client's margin
        // (the communicator's drop joins this thread), not its timeout.
        match client.get(&inner.store_key(SETTLED_ALL_KEY), Duration::ZERO) {
            Ok(_) | Err(TransportError::Timeout { .. }) => {}
            Err(_) => return,
        }
    }
    leave(inner, client);
}

/// The watcher's view of job-wide flight-recorder dump requests: their count is read every
/// [`DumpRequests::EVERY`] polls (one small store request a second), and each request made
/// since this communicator began is answered once, in order.
struct DumpRequests {
    polls: u32,
    /// The last request answered (or made before this communicator existed).
    last: u64,
}

impl DumpRequests {
    const EVERY: u32 = 10;

    fn new(client: &mut StoreClient) -> DumpRequests {
        DumpRequests {
            polls: 0,
            last: crate::trace::requests_made(client),
        }
    }

    fn poll(&mut self, inner: &Inner, client: &mut StoreClient) {
        self.polls = self.polls.wrapping_add(1);
        if !self.polls.is_multiple_of(Self::EVERY) {
            return;
        }
        let made = crate::trace::requests_made(client);
        while self.last < made {
            // Counted but not stored yet: looked for again on the next round.
            let Some(request) = crate::trace::read_request(client, self.last + 1) else {
                break;
            };
            self.last += 1;
            inner.answer_dump_request(&request);
        }
    }
}

/// Marks this rank's session as left (its communicator was destroyed), so that its closing
/// connection does not read as a death.
fn leave(inner: &Inner, client: &mut StoreClient) {
    let mut me = crate::status::RankIdentity::this_process(inner.size);
    me.left = true;
    let key = crate::progress::session_key(&inner.namespace, inner.rank);
    let _ = client.name_session(&key, me.encode().as_bytes());
}

/// The store's host runs this when a rank's session closes ([`StoreServer::on_session_closed`]):
/// a rank that had joined (its progress is published) and did not leave has died, and that is
/// the job's failure unless another was published first. Every rank learns it from its watcher,
/// even ranks that never exchange data with the dead one directly.
///
/// [`StoreServer::on_session_closed`]: weftcc_transports::store::StoreServer::on_session_closed
pub(crate) fn lost_by_the_store(key: &str, value: &[u8], store: &mut LocalStore<'_>) {
    let Some((namespace, rank)) = crate::progress::split_session_key(key) else {
        return;
    };
    let left = crate::status::RankIdentity::decode(value).is_none_or(|i| i.left);
    let abort = format!("{namespace}/{ABORT_KEY}");
    if left
        || !store.contains(&crate::progress::progress_key(namespace, rank))
        || store.contains(&abort)
    {
        return;
    }
    if store.add(&format!("{abort}-count"), 1) == Some(1) {
        let note = FailureNote::Lost {
            peer: rank,
            reporter: None,
            detail: "its process exited or died without destroying the communicator (its \
                     connection to the bootstrap store closed)"
                .into(),
        };
        store.set(&abort, note.encode().as_bytes());
    }
}

/// Counts this rank's watcher as done with the store (it read the failure, or its communicator
/// is going away); the last one to count says so, for [`StoreHost::settle`].
pub(crate) fn settle(inner: &Inner, client: &mut StoreClient) {
    if let Ok(n) = client.add_within(&inner.store_key(SETTLED_KEY), 1, WATCH_PERIOD) {
        if n == inner.size as i64 {
            let _ = client.set(&inner.store_key(SETTLED_ALL_KEY), b"1");
        }
    }
}

/// Turns a failure note published by another rank (in the store or as a farewell) into this
/// rank's error; `None` for a note this rank wrote itself, or one it cannot read.
pub(crate) fn remote_error(inner: &Inner, note: &[u8]) -> Option<Error> {
    let (op, seq) = inner.current.get();
    match FailureNote::decode(note)? {
        FailureNote::Lost {
            peer,
            reporter,
            detail,
        } if peer != inner.rank => Some(Error::PeerLost {
            rank: inner.rank,
            peer,
            op,
            seq,
            seen_by: reporter.map_or(SeenBy::Store, SeenBy::Rank),
            detail,
        }),
        FailureNote::Abort {
            origin,
            reason,
            cause,
            during,
        } if origin != inner.rank => Some(Error::Aborted {
            rank: inner.rank,
            by: Some(origin),
            reason,
            cause,
            during,
        }),
        FailureNote::Timeout {
            origin,
            op,
            seq,
            after_ms,
            waiting_on,
            behind,
        } if origin != inner.rank => Some(Error::Timeout {
            rank: inner.rank,
            op,
            seq,
            waiting_on,
            after: Duration::from_millis(after_ms),
            seen_by: SeenBy::Rank(origin),
            behind,
        }),
        _ => None,
    }
}

/// What a failing rank tells the others (through the store's abort key, and the farewell it
/// leaves in its shared-memory rings): typed fields, encoded as a versioned record of fields
/// separated by U+001F (the unit separator, which no number and no error text of weftcc
/// contains); the text fields are for people and are never parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FailureNote {
    /// Rank `origin` failed (or aborted); `reason` is its error as it reported it.
    Abort {
        origin: usize,
        reason: String,
        cause: AbortCause,
        /// The operation in which it failed or aborted (kind, sequence number), if any.
        during: Option<(OpKind, u64)>,
    },
    /// Rank `reporter` lost rank `peer`; `detail` says how.
    Lost {
        peer: usize,
        /// `None`: the bootstrap store saw the peer's process go ([`lost_by_the_store`]).
        reporter: Option<usize>,
        detail: String,
    },
    /// Rank `origin`'s collective `op` #`seq` timed out, with its diagnosis.
    Timeout {
        origin: usize,
        op: OpKind,
        seq: u64,
        after_ms: u64,
        waiting_on: Vec<usize>,
        behind: Vec<Behind>,
    },
}

impl FailureNote {
    const MAGIC: &'static str = "weft-failure/2";
    const SEP: char = '\u{1f}';

    /// An operation as a word of a note: `kind.seq`, or `-` for none.
    fn op_word(o: Option<(OpKind, u64)>) -> String {
        match o {
            Some((k, s)) => format!("{}.{s}", k as u8),
            None => "-".into(),
        }
    }

    /// Reads [`FailureNote::op_word`]'s form; `None` when it is not one.
    fn parse_op_word(t: &str) -> Option<Option<(OpKind, u64)>> {
        if t == "-" {
            return Some(None);
        }
        let (k, s) = t.split_once('.')?;
        Some(Some((OpKind::from_code(k.parse().ok()?)?, s.parse().ok()?)))
    }

    /// The fields of a timeout note after its kind.
    fn decode_timeout(rest: String) -> Option<FailureNote> {
        let f: Vec<&str> = rest.split(Self::SEP).collect();
        let [origin, op, seq, after_ms, waiting, behind] = f[..] else {
            return None;
        };
        let list = |t: &str| -> Option<Vec<usize>> {
            t.split(',')
                .filter(|x| !x.is_empty())
                .map(|x| x.parse().ok())
                .collect()
        };
        let behind = behind
            .split(',')
            .filter(|x| !x.is_empty())
            .map(|b| {
                let p: Vec<&str> = b.split(':').collect();
                let [rank, entered, completed, idle, silent] = p[..] else {
                    return None;
                };
                Some(Behind {
                    rank: rank.parse().ok()?,
                    entered: Self::parse_op_word(entered)?,
                    completed: Self::parse_op_word(completed)?,
                    idle: Duration::from_millis(idle.parse().ok()?),
                    silent: match silent {
                        "-" => None,
                        ms => Some(Duration::from_millis(ms.parse().ok()?)),
                    },
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(FailureNote::Timeout {
            origin: origin.parse().ok()?,
            op: OpKind::from_code(op.parse().ok()?)?,
            seq: seq.parse().ok()?,
            after_ms: after_ms.parse().ok()?,
            waiting_on: list(waiting)?,
            behind,
        })
    }

    /// The note's wire form.
    pub(crate) fn encode(&self) -> String {
        let s = Self::SEP;
        let m = Self::MAGIC;
        match self {
            FailureNote::Abort {
                origin,
                reason,
                cause,
                during,
            } => {
                let during = Self::op_word(*during);
                let kind = match cause {
                    AbortCause::AbortCalled => "abort",
                    AbortCause::Mismatch => "mismatch",
                    AbortCause::Failed => "failed",
                };
                format!("{m}{s}{kind}{s}{origin}{s}{during}{s}{reason}")
            }
            FailureNote::Lost {
                peer,
                reporter,
                detail,
            } => {
                let reporter = reporter.map_or("-".into(), |r| r.to_string());
                format!("{m}{s}lost{s}{peer}{s}{reporter}{s}{detail}")
            }
            FailureNote::Timeout {
                origin,
                op,
                seq,
                after_ms,
                waiting_on,
                behind,
            } => {
                let waiting: Vec<String> = waiting_on.iter().map(usize::to_string).collect();
                let behind: Vec<String> = behind
                    .iter()
                    .map(|b| {
                        format!(
                            "{}:{}:{}:{}:{}",
                            b.rank,
                            Self::op_word(b.entered),
                            Self::op_word(b.completed),
                            b.idle.as_millis(),
                            b.silent.map_or("-".into(), |d| d.as_millis().to_string())
                        )
                    })
                    .collect();
                format!(
                    "{m}{s}timeout{s}{origin}{s}{}{s}{seq}{s}{after_ms}{s}{}{s}{}",
                    *op as u8,
                    waiting.join(","),
                    behind.join(",")
                )
            }
        }
    }

    /// Reads a note written by [`FailureNote::encode`]; `None` for anything else.
    pub(crate) fn decode(bytes: &[u8]) -> Option<FailureNote> {
        // Lossy: a farewell cut to the ring's note size may end inside a character.
        let text = String::from_utf8_lossy(bytes);
        let mut fields = text.splitn(5, Self::SEP);
        if fields.next()? != Self::MAGIC {
            return None;
        }
        let kind = fields.next()?;
        let cause = match kind {
            "abort" => Some(AbortCause::AbortCalled),
            "mismatch" => Some(AbortCause::Mismatch),
            "failed" => Some(AbortCause::Failed),
            _ => None,
        };
        if let Some(cause) = cause {
            let origin = fields.next()?.parse().ok()?;
            let during = Self::parse_op_word(fields.next()?)?;
            // The reason is the rest, separators and all.
            let rest: Vec<&str> = fields.collect();
            return Some(FailureNote::Abort {
                origin,
                reason: rest.join(&Self::SEP.to_string()),
                cause,
                during,
            });
        }
        match kind {
            "lost" => Some(FailureNote::Lost {
                peer: fields.next()?.parse().ok()?,
                reporter: match fields.next()? {
                    "-" => None,
                    r => Some(r.parse().ok()?),
                },
                detail: fields.next()?.to_string(),
            }),
            "timeout" => {
                Self::decode_timeout(fields.collect::<Vec<_>>().join(&Self::SEP.to_string()))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommConfig;
    use proptest::prelude::*;
    use std::time::Instant;

    proptest! {
        /// Every note reads back as itself, whatever its text (separators included).
        #[test]
        fn failure_notes_round_trip(
            origin in any::<usize>(),
            peer in any::<usize>(),
            text in ".*",
            lost in any::<bool>(),
            cause in 0usize..3,
            during in proptest::option::of((0usize..OpKind::ALL.len(), any::<u64>())),
        ) {
            let during = during.map(|(k, s)| (OpKind::ALL[k], s));
            let cause = [AbortCause::AbortCalled, AbortCause::Mismatch, AbortCause::Failed][cause];
            let note = if lost {
                FailureNote::Lost { peer, reporter: (origin % 2 == 0).then_some(origin), detail: text.clone() }
            } else {
                FailureNote::Abort { origin, reason: text.clone(), cause, during }
            };
            prop_assert_eq!(FailureNote::decode(note.encode().as_bytes()), Some(note));
        }

        /// Timeout notes carry their diagnosis as fields, and read back as themselves.
        #[test]
        fn timeout_notes_round_trip(
            origin in any::<usize>(),
            k in 0usize..OpKind::ALL.len(),
            seq in any::<u64>(),
            after_ms in any::<u64>(),
            waiting_on in proptest::collection::vec(any::<usize>(), 0..5),
            behind in proptest::collection::vec(
                (any::<usize>(), proptest::option::of(0u64..1 << 56),
                 proptest::option::of(0u64..1 << 56), 0u64..1 << 40,
                 proptest::option::of(0u64..1 << 40)),
                0..4,
            ),
        ) {
            let behind = behind
                .into_iter()
                .map(|(rank, e, c, idle, silent)| Behind {
                    rank,
                    entered: e.map(|s| (OpKind::AllReduce, s)),
                    completed: c.map(|s| (OpKind::Broadcast, s)),
                    idle: Duration::from_millis(idle),
                    silent: silent.map(Duration::from_millis),
                })
                .collect();
            let note = FailureNote::Timeout {
                origin,
                op: OpKind::ALL[k],
                seq,
                after_ms,
                waiting_on,
                behind,
            };
            prop_assert_eq!(FailureNote::decode(note.encode().as_bytes()), Some(note));
        }

        /// Bytes that are not a note (free text, a truncated note, garbage) read as nothing.
        #[test]
        fn failure_notes_reject_what_is_not_one(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assume!(!bytes.starts_with(FailureNote::MAGIC.as_bytes()));
            prop_assert_eq!(FailureNote::decode(&bytes), None);
        }
    }

    #[test]
    fn the_store_publishes_the_death_of_a_joined_rank_that_did_not_leave() {
        use crate::status::RankIdentity;
        use weftcc_transports::store::StoreServer;
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").expect("store");
        server.on_session_closed(Arc::new(lost_by_the_store));
        let addr = server.local_addr().to_string();
        let t = Duration::from_secs(10);
        let mut reader = StoreClient::connect(&addr, "t", t).expect("client");
        let me = |left| {
            let mut i = RankIdentity::this_process(3);
            i.left = left;
            i.encode()
        };
        // Rank 1 had not joined (no progress), rank 2 left: neither is a death.
        for (rank, left) in [(1, false), (2, true)] {
            let mut c = StoreClient::connect(&addr, "t", t).expect("client");
            c.name_session(&format!("j/rank/{rank}"), me(left).as_bytes())
                .expect("name");
            if left {
                c.set(&format!("j/progress/{rank}"), b"x").expect("set");
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(!reader.check("j/abort").expect("check"));
        // Rank 0 joined and its process went.
        let mut c = StoreClient::connect(&addr, "t", t).expect("client");
        c.name_session("j/rank/0", me(false).as_bytes())
            .expect("name");
        c.set("j/progress/0", b"x").expect("set");
        drop(c);
        let note = reader.get("j/abort", t).expect("the death is published");
        let Some(FailureNote::Lost {
            peer: 0,
            reporter: None,
            detail,
        }) = FailureNote::decode(&note)
        else {
            panic!("{:?}", String::from_utf8_lossy(&note))
        };
        assert!(detail.contains("connection to the bootstrap store closed"));
        assert_eq!(reader.add("j/abort-count", 0).expect("count"), 1);
    }

    #[test]
    fn old_free_text_notes_and_truncated_ones_are_not_read() {
        assert_eq!(FailureNote::decode(b"abort 1 boom"), None);
        let full = FailureNote::Lost {
            peer: 3,
            reporter: Some(1),
            detail: "closed".into(),
        }
        .encode();
        assert_eq!(
            FailureNote::decode(&full.as_bytes()[..full.len() - 8]),
            None
        );
    }

    #[test]
    fn a_failed_communicator_dropped_before_its_split_child_leaves_its_settle_to_the_child() {
        let config = |_| CommConfig::from_env().expect("config");
        let left = crate::run_ranks(2, config, |rank, parent| {
            let child = parent.split(Some(0), 0).expect("split").expect("member");
            if rank == 1 {
                let start = Instant::now();
                while parent.error().is_none() && start.elapsed() < Duration::from_secs(10) {
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
        .expect("ranks");
        assert_eq!(left[0], vec![format!("c/{SETTLED_ALL_KEY}")]);
    }
}
