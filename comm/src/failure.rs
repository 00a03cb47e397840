//! The failure protocol: the first fatal error poisons the communicator and is published to
//! the bootstrap store as a typed note; a watcher thread on every rank reads it, so a dead or
//! failing rank becomes an error on all ranks within a fraction of a second instead of a hang.
//! Rank 0, which hosts the store, keeps it up after a failure until every rank's watcher has read
//! it (at most [`SETTLE_TIMEOUT`]).

use crate::error::{Error, Result, SeenBy};
use crate::records::identity::RankIdentity;
use crate::records::note::{AbortCause, FailureNote};
use crate::records::progress::{self, Behind, ProgressRecord};
use crate::records::{abort_count_key, progress_key, split_session_key, store_key};
use crate::records::{ABORT_KEY, SETTLED_ALL_KEY, SETTLED_KEY};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use weftcc_collectives::OpKind;
use weftcc_store::{LocalStore, SessionStore, StoreClient};
use weftcc_transports::lock;
use weftcc_transports::mesh::setup_lost_key;

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
/// What runs when a communicator fails (`Communicator::on_failure`).
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

/// What the failure protocol needs from the rest of the communicator, which owns it: the
/// operation running now, this rank's progress, the connections' farewells, and what must
/// happen the moment the communicator is poisoned.
pub(crate) trait Surroundings {
    /// Kind and sequence number of the operation running now.
    fn current_op(&self) -> (OpKind, u64);
    /// This rank's progress as published.
    fn progress_record(&self) -> ProgressRecord;
    /// The farewell note `peer` left on its connection, if any; `None` also while an operation
    /// holds the connections (nothing may wait for it).
    fn farewell_from(&self, peer: usize) -> Option<String>;
    /// Leaves `note` on every connection; false when an operation holds them (left later).
    fn leave_farewell(&self, note: &str) -> bool;
    /// The communicator was just poisoned: wake every waiting call, have the flight recorder
    /// written.
    fn poisoned_now(&self);
}

/// The failure protocol of one communicator: its poison, and its connection to the store for
/// publishing failures (a short timeout: reporting an error must never wait long on a store
/// that is itself stuck).
pub(crate) struct Failures {
    rank: usize,
    size: usize,
    namespace: String,
    poison: Poison,
    pub(crate) alarm: Mutex<StoreClient>,
    /// The poison's cause was left on every connection ([`Failures::leave_farewell`]).
    farewell_left: AtomicBool,
}

impl Failures {
    pub(crate) fn new(rank: usize, size: usize, namespace: &str, alarm: StoreClient) -> Failures {
        Failures {
            rank,
            size,
            namespace: namespace.to_string(),
            poison: Poison::new(),
            alarm: Mutex::new(alarm),
            farewell_left: AtomicBool::new(false),
        }
    }

    /// Whether the communicator is poisoned.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poison.set.load(Ordering::Acquire)
    }
    pub(crate) fn poisoned(&self) -> Option<Error> {
        if !self.poison.set.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison.error).clone()
    }

    /// Fails at once when the communicator is poisoned.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        // The common answer without building an `Option<Error>`: every call checks twice.
        if !self.is_poisoned() {
            return Ok(());
        }
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
    pub(crate) fn fail(&self, e: Error, s: &dyn Surroundings) {
        if self.poison.set.load(Ordering::Acquire) {
            return;
        }
        let e = self.adopt_farewell(e, s);
        // Errors adopted from another rank (or seen only by the watcher) are not published again.
        let local = !matches!(
            &e,
            Error::Aborted { by: Some(_), .. } | Error::Revoked { by: Some(_), .. }
        ) && !matches!(
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
        if matches!(
            &e,
            Error::Aborted { by: None, .. } | Error::Revoked { by: None, .. }
        ) {
            if self.poison_with(e.clone(), s) && self.size > 1 {
                let _ = self.publish_or_adopt(e, s);
            }
            return;
        }
        let e = if local && self.size > 1 {
            self.publish_or_adopt(e, s)
        } else {
            e
        };
        self.poison_with(e, s);
    }

    /// Sets the poison if it is not set yet; returns whether this call set it.
    pub(crate) fn poison_with(&self, e: Error, s: &dyn Surroundings) -> bool {
        {
            let mut slot = lock(&self.poison.error);
            if slot.is_some() {
                return false;
            }
            tracing::warn!(target: "weftcc::error", rank = self.rank, "{e}");
            *slot = Some(e.clone());
            self.poison.set.store(true, Ordering::Release);
        }
        s.poisoned_now();
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

    /// `name` under this communicator's namespace in the bootstrap store.
    pub(crate) fn store_key(&self, name: &str) -> String {
        store_key(&self.namespace, name)
    }

    pub(crate) fn publish_or_adopt(&self, e: Error, s: &dyn Surroundings) -> Error {
        let Ok(mut store) = self.alarm.try_lock() else {
            return e;
        };
        let key = self.store_key(ABORT_KEY);
        let e = self.diagnose(&mut store, e, s);
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
                if let Some(cause) = self.remote_error(&v, s.current_op()) {
                    return cause;
                }
            }
        }
        // Neither request waits on the server: only the client's margin bounds them, so a store
        // that cannot be reached costs one margin (the first failure breaks the connection).
        match store.add_within(&abort_count_key(&key), 1, Duration::ZERO) {
            Ok(1) => {
                let _ =
                    store.set_within(&key, self.note_of(&e).encode().as_bytes(), Duration::ZERO);
                e
            }
            Ok(_) => match store.get(&key, ALARM_TIMEOUT) {
                Ok(v) => self.remote_error(&v, s.current_op()).unwrap_or(e),
                Err(_) => e,
            },
            Err(_) => e,
        }
    }

    /// A collective this rank timed out in, with the ranks that had not entered it (from every
    /// rank's published progress; this rank's own record is published first, fresh); a
    /// point-to-point exchange, with the awaited peers that give no sign of life. Any other
    /// error, or a store that cannot tell, leaves `e` as it is.
    fn diagnose(&self, store: &mut StoreClient, e: Error, s: &dyn Surroundings) -> Error {
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
                .sessions(&crate::records::session_prefix(&self.namespace))
                .map(|sessions| progress::silence(&sessions, &self.namespace, self.size))
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
        let own = s.progress_record().encode();
        let _ = store.set_within(
            &progress_key(&self.namespace, self.rank),
            own.as_bytes(),
            Duration::ZERO,
        );
        let keys: Vec<String> = (0..self.size)
            .map(|r| progress_key(&self.namespace, r))
            .collect();
        let Ok(values) = store.get_all(&keys, PROGRESS_READ_TIMEOUT) else {
            return keep(behind);
        };
        let records: Vec<_> = values.iter().map(|v| ProgressRecord::decode(v)).collect();
        let silent = silence(store);
        keep(progress::behind(
            &records,
            &silent,
            seq,
            self.rank,
            progress::now_ms(),
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
            Error::Revoked { by, during, .. } => FailureNote::Abort {
                origin: by.unwrap_or(self.rank),
                reason: "revoke() called".into(),
                cause: AbortCause::Revoked,
                during: *during,
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
    /// [`Failures::leave_farewell`]): the root cause, which the store may no longer be able to
    /// tell (it lives with rank 0). Any other error is returned as it is.
    pub(crate) fn adopt_farewell(&self, e: Error, s: &dyn Surroundings) -> Error {
        let peer = match &e {
            Error::PeerLost {
                peer,
                seen_by: SeenBy::ThisRank,
                ..
            } => *peer,
            _ => return e,
        };
        s.farewell_from(peer)
            .and_then(|n| self.remote_error(n.as_bytes(), s.current_op()))
            .unwrap_or(e)
    }

    /// Leaves the poison's cause on every connection, once, for peers that see this rank close
    /// (shared memory keeps it; see [`weftcc_transports::Connection::leave_farewell`]). Skipped
    /// while an operation holds the state; the next call (at the latest the communicator's
    /// drop) leaves it.
    pub(crate) fn leave_farewell(&self, s: &dyn Surroundings) {
        if self.farewell_left.load(Ordering::Acquire) {
            return;
        }
        let Some(e) = self.poisoned() else { return };
        if s.leave_farewell(&self.note_of(&e).encode()) {
            self.farewell_left.store(true, Ordering::Release);
        }
    }

    /// Counts this rank's watcher as done with the store (it read the failure, or its communicator
    /// is going away); the last one to count says so, for [`StoreHost::settle`].
    pub(crate) fn settle(&self, client: &mut StoreClient) {
        if let Ok(n) = client.add_within(&self.store_key(SETTLED_KEY), 1, WATCH_PERIOD) {
            if n == self.size as i64 {
                let _ = client.set(&self.store_key(SETTLED_ALL_KEY), b"1");
            }
        }
    }

    /// Turns a failure note published by another rank (in the store or as a farewell) into this
    /// rank's error; `None` for a note this rank wrote itself, or one it cannot read.
    pub(crate) fn remote_error(&self, note: &[u8], (op, seq): (OpKind, u64)) -> Option<Error> {
        match FailureNote::decode(note)? {
            FailureNote::Lost {
                peer,
                reporter,
                detail,
            } if peer != self.rank => Some(Error::PeerLost {
                rank: self.rank,
                peer,
                op,
                seq,
                seen_by: reporter.map_or(SeenBy::Store, SeenBy::Rank),
                detail,
            }),
            FailureNote::Abort {
                origin,
                cause: AbortCause::Revoked,
                during,
                ..
            } if origin != self.rank => Some(Error::Revoked {
                rank: self.rank,
                by: Some(origin),
                during,
            }),
            FailureNote::Abort {
                origin,
                reason,
                cause,
                during,
            } if origin != self.rank => Some(Error::Aborted {
                rank: self.rank,
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
            } if origin != self.rank => Some(Error::Timeout {
                rank: self.rank,
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
}

/// [`lost_by_the_store`] as the built-in store's session-closed hook.
pub(crate) fn store_hook() -> std::sync::Arc<weftcc_store::SessionHook> {
    std::sync::Arc::new(|key: &str, value: &[u8], store: &mut LocalStore<'_>| {
        lost_by_the_store(key, value, store)
    })
}

/// Run when a rank's session closes: by the built-in store's host
/// ([`StoreServer::on_session_closed`], on its data under its lock), or by every rank's watcher
/// over its client where the store runs no hooks (etcd, [`StoreClient::runs_session_hooks`]).
/// A rank that had joined (its progress is published) and did not leave has died, and that is
/// the job's failure unless another was published first (the abort count makes the first
/// publisher the only one, however many ranks run the rule). Every rank learns it from its
/// watcher, even ranks that never exchange data with the dead one directly. A rank that dies
/// before it has joined ends the others' set-up waits instead ([`setup_lost_key`]).
///
/// [`StoreServer::on_session_closed`]: weftcc_store::StoreServer::on_session_closed
pub(crate) fn lost_by_the_store(key: &str, value: &[u8], store: &mut dyn SessionStore) {
    let Some((namespace, rank)) = split_session_key(key) else {
        return;
    };
    let left = RankIdentity::decode(value).is_none_or(|i| i.left);
    let abort = store_key(namespace, ABORT_KEY);
    if left || store.contains(&abort) {
        return;
    }
    if !store.contains(&progress_key(namespace, rank)) {
        // Gone before its watcher's first report: during set-up. The first such death ends
        // every set-up wait of the namespace, naming it.
        let lost = setup_lost_key(namespace);
        if !store.contains(&lost) {
            store.set(&lost, rank.to_string().as_bytes());
        }
        return;
    }
    if store.add(&abort_count_key(&abort), 1) == Some(1) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CommConfig;
    use std::time::Instant;

    #[test]
    fn the_store_publishes_the_death_of_a_joined_rank_that_did_not_leave() {
        use weftcc_store::StoreServer;
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").expect("store");
        server.on_session_closed(store_hook());
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

    /// Where the store runs no hook (etcd), every rank's watcher runs the same rule over its
    /// client: the death is published once however many ranks run it, and a rank that left is no
    /// death.
    #[test]
    fn the_rule_over_a_client_publishes_a_death_once() {
        use weftcc_store::StoreServer;
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t").expect("store");
        let addr = server.local_addr().to_string();
        let t = Duration::from_secs(10);
        let mut clients: Vec<StoreClient> = (0..3)
            .map(|_| StoreClient::connect(&addr, "t", t).expect("client"))
            .collect();
        let me = |left| {
            let mut i = RankIdentity::this_process(3);
            i.left = left;
            i.encode()
        };
        clients[0].set("j/progress/1", b"x").expect("set");
        clients[0].set("j/progress/2", b"x").expect("set");
        lost_by_the_store("j/rank/2", me(true).as_bytes(), &mut clients[0]);
        assert!(!clients[0].check("j/abort").expect("check"));
        for c in &mut clients {
            lost_by_the_store("j/rank/1", me(false).as_bytes(), c);
        }
        let note = clients[2].get("j/abort", t).expect("published");
        assert!(matches!(
            FailureNote::decode(&note),
            Some(FailureNote::Lost {
                peer: 1,
                reporter: None,
                ..
            })
        ));
        assert_eq!(clients[1].add("j/abort-count", 0).expect("count"), 1);
    }

    #[test]
    fn a_failed_communicator_dropped_before_its_split_child_leaves_its_settle_to_the_child() {
        let config = |_| CommConfig::from_env().expect("config");
        let left = crate::local::run_ranks(2, config, |rank, parent| {
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
