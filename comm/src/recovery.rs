//! Surviving a lost rank without restarting the job: revoke a communicator, agree on the failed
//! set, shrink to the survivors, grow by newcomers.
//!
//! The job's bootstrap store is the meeting point that outlives any rank (served by the
//! launcher, `weft store serve` or etcd; not where rank 0 serves it, whose loss ends the job):
//! - **Revoke** poisons the communicator with [`Error::Revoked`] and publishes it like any
//!   failure, so every rank's pending and later operations fail within the watcher's period.
//! - **Agreement**: each survivor proposes the ranks it knows failed (its own lost peer, and every
//!   rank whose store session closed without leaving); the first proposal stored under the
//!   epoch's key is the decision every survivor reads ([`StoreClient::set_if_absent`]), also when
//!   its writer dies right after. A rank that dies later is caught by the next agreement.
//! - **Shrink** makes the survivors' communicator, ranks renumbered in order. A healthy
//!   communicator whose family shares connections (`WEFT_SPLIT_SHARE`) reuses them, as a split
//!   does; after a failure the survivors connect anew (an aborted operation may have left a
//!   connection in the middle of a message), under the same store, without a new unique id.
//!   While it sets up, each survivor watches the others' sessions of the parent communicator, so
//!   a survivor that dies before it joined ends every survivor's set-up, naming it.
//! - **Grow**: a newcomer takes a ticket in the store ([`Communicator::join_grown`]); the
//!   growing communicator's rank 0 writes each admitted ticket's place (namespace, size, rank,
//!   epoch); existing ranks keep their numbers, newcomers follow in ticket order.

use crate::background::Background;
use crate::bootstrap::UniqueId;
use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::error::{Error, Result};
use crate::records::identity::RankIdentity;
use crate::records::recovery::{
    agreement_key, decode_ranks, encode_ranks, event_key, joiner_session_key, ticket_key, Place,
    RecoveryEvent, RecoveryKind, ADMITTED_KEY, EVENTS_KEY, JOINERS_KEY, JOINER_SESSION_PREFIX,
};
use crate::records::{session_prefix, session_rank};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use weftcc_collectives::OpKind;
use weftcc_store::{StoreClient, StoreError};
use weftcc_transports::lock;
use weftcc_transports::mesh::setup_lost_key;
use weftcc_transports::TransportError;

/// How often a survivor setting up a shrunk or grown communicator looks for the death of
/// another member.
const MEMBER_WATCH_PERIOD: Duration = Duration::from_millis(20);

/// What the survivors of a failure agreed on ([`Communicator::agree_on_failures`]): the same on
/// every survivor that reads epoch `epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreement {
    /// The failed ranks, ascending (ranks of the communicator agreed on).
    pub failed: Vec<usize>,
    /// The agreement's epoch: how many agreements the communicator's lineage has made, this
    /// one included (communicators made by shrink or grow start at their parent's).
    pub epoch: u64,
}

impl Communicator {
    /// Revokes the communicator on every rank: each pending and later operation returns
    /// [`Error::Revoked`] (here at once, on the other ranks as soon as their watchers read it,
    /// within about a tenth of a second). The communicator is not destroyed: agree on the failed
    /// set and [`Communicator::shrink`] it. Callable from any thread; a communicator that has
    /// already failed keeps its first error.
    pub fn revoke(&self) {
        let inner = &self.inner;
        inner.fail(Error::Revoked {
            rank: inner.rank,
            by: None,
            during: None,
        });
        inner.turns.wake_all();
        tracing::warn!(target: "weftcc::recovery", rank = inner.rank, namespace = %inner.namespace, "communicator revoked");
    }

    /// The id of the job this communicator belongs to (its store's address and token): what a
    /// newcomer passes to [`Communicator::join_grown`].
    pub fn unique_id(&self) -> UniqueId {
        self.inner.id.clone()
    }

    /// The epoch this communicator is at: 0 for a communicator made from scratch, then one more
    /// with each agreement in its lineage.
    pub fn epoch(&self) -> u64 {
        self.inner.lineage.epoch()
    }

    /// How this communicator came from the job's first ones: each shrink and grow, oldest first
    /// (also in its flight-recorder dumps).
    pub fn lineage(&self) -> Vec<RecoveryEvent> {
        self.inner.lineage.events()
    }

    /// Agrees with the other survivors on the failed ranks: every survivor that calls it (the
    /// same number of times on this communicator) gets the same [`Agreement`], also when two
    /// ranks died at once or one dies during the agreement (which a later agreement then
    /// includes). Works on a failed or revoked communicator, and on a healthy one (no failed
    /// ranks). Needs a store that outlives the ranks (not one that rank 0 serves, if rank 0 is
    /// among the lost).
    pub fn agree_on_failures(&self) -> Result<Agreement> {
        let inner = &self.inner;
        let epoch = inner.lineage.next_epoch();
        let key = agreement_key(&inner.namespace, epoch);
        let mut store = lock(&inner.store);
        let proposal = self.suspects(&mut store)?;
        let decided = store
            .set_if_absent(&key, encode_ranks(&proposal).as_bytes())
            .map_err(|e| self.inner.store_lost(OpKind::Barrier, epoch, e))?;
        let failed = decode_ranks(&decided).ok_or_else(|| Error::Internal {
            rank: inner.rank,
            op: OpKind::Barrier,
            seq: epoch,
            reason: format!("agreement {key} holds no rank set: {decided:?}"),
        })?;
        tracing::warn!(target: "weftcc::recovery", rank = inner.rank, epoch, ?failed, proposed = ?proposal, "survivors agreed on the failed ranks");
        Ok(Agreement {
            failed: failed.into_iter().collect(),
            epoch,
        })
    }

    /// The ranks this one knows failed: the peer it lost, and every rank whose session in the
    /// store closed without leaving.
    fn suspects(&self, store: &mut StoreClient) -> Result<BTreeSet<usize>> {
        let inner = &self.inner;
        let mut suspects = BTreeSet::new();
        if let Some(Error::PeerLost { peer, .. }) = inner.poisoned() {
            suspects.insert(peer);
        }
        let sessions = store
            .sessions(&session_prefix(&inner.namespace))
            .map_err(|e| {
                self.inner
                    .store_lost(OpKind::Barrier, inner.lineage.epoch(), e)
            })?;
        for s in sessions.iter().filter(|s| !s.open) {
            let left = RankIdentity::decode(&s.value).is_some_and(|i| i.left);
            if let (false, Some(rank)) = (left, session_rank(&s.key, &inner.namespace)) {
                if rank < inner.size {
                    suspects.insert(rank);
                }
            }
        }
        Ok(suspects)
    }

    /// The communicator of every rank but `excluding` (ranks of this one), numbered in order:
    /// called by each of them, not by the excluded (a caller among them gets
    /// [`Error::Excluded`]). Typically after [`Communicator::agree_on_failures`], with its failed
    /// set; it also shrinks a healthy communicator. If a survivor dies meanwhile, every survivor's
    /// shrink fails naming it ([`TransportError::DiedInSetup`]): agree again and shrink again.
    pub fn shrink(&self, excluding: &[usize]) -> Result<Communicator> {
        let inner = &self.inner;
        let excluded: BTreeSet<usize> = excluding.iter().copied().collect();
        if let Some(bad) = excluded.iter().find(|&&r| r >= inner.size) {
            return Err(Error::Config(format!(
                "shrink: rank {bad} to exclude is not a rank of this communicator of {}",
                inner.size
            )));
        }
        let epoch = inner.lineage.epoch();
        if excluded.contains(&inner.rank) {
            return Err(Error::Excluded {
                rank: inner.rank,
                epoch,
            });
        }
        let started = Instant::now();
        let members: Vec<usize> = (0..inner.size).filter(|r| !excluded.contains(r)).collect();
        let k = inner.lineage.shrinks.fetch_add(1, Ordering::SeqCst);
        // Survivors that disagree on the excluded set meet in different namespaces: their
        // set-up times out instead of mixing two communicators.
        let namespace = format!(
            "{}/shrink{k}-{:016x}",
            inner.namespace,
            weftcc_transports::fnv1a64(encode_ranks(&excluded).as_bytes())
        );
        let new_rank = members.iter().position(|&m| m == inner.rank).unwrap_or(0);
        // A healthy family that shares its connections keeps them (a split without a choosing
        // round: every member knows the members).
        let shared = if inner.poisoned().is_none() && inner.split_share() {
            let ns = namespace.clone();
            let mesh = inner.run_blocking(OpKind::Barrier, |inner, st| {
                st.mesh
                    .split(&members, &ns)
                    .map_err(|source| Error::Bootstrap {
                        rank: inner.rank,
                        source,
                    })
            })?;
            Some(mesh)
        } else {
            None
        };
        let watch = match shared {
            Some(_) => None,
            None => Some(member_watch(self, members.clone(), Vec::new(), &namespace)?),
        };
        let made = self.make_relative(
            (new_rank, members.len(), namespace),
            shared,
            (
                RecoveryKind::Shrink,
                excluded.iter().copied().collect(),
                started,
            ),
        );
        drop(watch);
        let comm = made?;
        tracing::warn!(target: "weftcc::recovery", rank = inner.rank, new_rank, size = members.len(), epoch, ?excluded, "shrunk");
        Ok(comm)
    }

    /// Grows this communicator by `joining` newcomers, which call [`Communicator::join_grown`]:
    /// every rank of this communicator calls it, keeps its rank, and the newcomers follow in the
    /// order they asked for a place. Rank 0 hands out the places; a newcomer that does not come
    /// makes the grow time out (see [`Communicator::joiners_waiting`] for how many wait).
    pub fn grow(&self, joining: usize) -> Result<Communicator> {
        let inner = &self.inner;
        inner.check()?;
        let started = Instant::now();
        let epoch = inner.lineage.epoch();
        let g = inner.lineage.grows.fetch_add(1, Ordering::SeqCst);
        let namespace = format!("{}/grow{g}", inner.namespace);
        let nranks = inner.size + joining;
        // Rank 0 hands out the places and watches the newcomers it admits: one that dies before
        // it joined ends the set-up at once, as a member's death does.
        let mut newcomers = Vec::new();
        if inner.rank == 0 && joining > 0 {
            let mut store = lock(&inner.store);
            let lost = |e| self.inner.store_lost(OpKind::Barrier, epoch, e);
            let admitted = store.add(ADMITTED_KEY, 0).map_err(lost)?;
            for i in 0..joining {
                let place = Place {
                    namespace: namespace.clone(),
                    nranks,
                    rank: inner.size + i,
                    epoch,
                };
                let ticket = admitted + 1 + i as i64;
                store
                    .set(&ticket_key(ticket), place.encode().as_bytes())
                    .map_err(lost)?;
                newcomers.push((joiner_session_key(ticket), place.rank));
            }
            store.add(ADMITTED_KEY, joining as i64).map_err(lost)?;
        }
        let members: Vec<usize> = (0..inner.size).collect();
        let watch = member_watch(self, members, newcomers, &namespace)?;
        let made = self.make_relative(
            (inner.rank, nranks, namespace),
            None,
            (RecoveryKind::Grow, Vec::new(), started),
        );
        drop(watch);
        let comm = made?;
        tracing::warn!(target: "weftcc::recovery", rank = inner.rank, size = nranks, joining, epoch, "grown");
        Ok(comm)
    }

    /// How many newcomers wait for a place ([`Communicator::join_grown`]) and have none yet, as
    /// rank 0 reads it from the store, the same on every rank (collective: a broadcast).
    pub fn joiners_waiting(&self) -> Result<usize> {
        let inner = &self.inner;
        let mut waiting = [0u64];
        if inner.rank == 0 {
            let mut store = lock(&inner.store);
            let lost = |e| self.inner.store_lost(OpKind::Broadcast, 0, e);
            let asked = store.add(JOINERS_KEY, 0).map_err(lost)?;
            let admitted = store.add(ADMITTED_KEY, 0).map_err(lost)?;
            waiting[0] = asked.saturating_sub(admitted).max(0) as u64;
        }
        self.broadcast_in_place(&mut waiting, 0)?;
        Ok(waiting[0] as usize)
    }

    /// Joins a communicator of the job at `id` as a newcomer: asks the store for a place and
    /// waits (up to `config`'s timeout) until a growing communicator gives it one
    /// ([`Communicator::grow`]). `weft run --elastic` starts replacements that call it.
    pub fn join_grown(id: &UniqueId, config: CommConfig) -> Result<Communicator> {
        crate::logging::init();
        let boot = |source: TransportError| Error::Bootstrap { rank: 0, source };
        let mut client = StoreClient::connect(&id.addr, &id.token, config.timeout)
            .map_err(|e| boot(e.into()))?;
        let ticket = client.add(JOINERS_KEY, 1).map_err(|e| boot(e.into()))?;
        // The ticket's session: its closing before the newcomer joined ends the grow's set-up.
        client
            .name_session(
                &joiner_session_key(ticket),
                RankIdentity::this_process(0).encode().as_bytes(),
            )
            .map_err(|e| boot(e.into()))?;
        tracing::info!(target: "weftcc::recovery", ticket, "newcomer waits for a place");
        let value = client
            .get(&ticket_key(ticket), config.timeout)
            .map_err(|e| boot(e.into()))?;
        let place = Place::decode(&value).ok_or_else(|| {
            Error::Config(format!(
                "ticket {ticket}'s place in the store is unreadable"
            ))
        })?;
        let timeout = config.timeout;
        let made = Communicator::build(
            place.rank,
            place.nranks,
            place.namespace.clone(),
            config,
            client,
            (id, false),
            None,
            None,
        );
        let comm = commit(
            made,
            id,
            &place.namespace,
            (place.rank, place.nranks),
            timeout,
        )?;
        comm.inner.lineage.start_at(place.epoch);
        tracing::warn!(target: "weftcc::recovery", rank = place.rank, size = place.nranks, epoch = place.epoch, "newcomer joined");
        Ok(comm)
    }

    /// A communicator made from this one (shrunk or grown) under the same store, `(rank,
    /// nranks, namespace)`, over `shared` (this family's connections) or a mesh of its own; it
    /// starts at this one's epoch, with this one's lineage and the event `(kind, failed,
    /// started)`, which its rank 0 also leaves in the store for `weft status`.
    fn make_relative(
        &self,
        (rank, nranks, namespace): (usize, usize, String),
        shared: Option<weftcc_transports::Mesh>,
        (kind, failed, started): (RecoveryKind, Vec<usize>, Instant),
    ) -> Result<Communicator> {
        let inner = &self.inner;
        let id = inner.id.clone();
        let client = inner.connect_store()?;
        let made = Communicator::build(
            rank,
            nranks,
            namespace.clone(),
            inner.config(),
            client,
            (&id, inner.store_on_rank0),
            inner.store_host.clone(),
            shared,
        );
        let comm = commit(made, &id, &namespace, (rank, nranks), inner.timeout())?;
        let epoch = inner.lineage.epoch();
        comm.inner.lineage.start_at(epoch);
        let event = RecoveryEvent {
            kind,
            epoch,
            from: inner.namespace.clone(),
            from_size: inner.size,
            to: comm.inner.namespace.clone(),
            to_size: nranks,
            failed,
            error: inner.poisoned().map(|e| e.to_string()),
            took_ms: started.elapsed().as_millis() as u64,
            at_us: crate::trace::now_us(),
        };
        if rank == 0 {
            publish_event(&mut lock(&comm.inner.store), &event);
        }
        let mut events = inner.lineage.events();
        events.push(event);
        *lock(&comm.inner.lineage.events) = events;
        Ok(comm)
    }
}

/// How often a member that has made its part of a shrunk or grown communicator looks whether
/// another member failed to make its own (a death ends the wait at once).
const COMMIT_POLL: Duration = Duration::from_millis(50);

/// Makes the set-up of a shrunk or grown communicator succeed or fail on every member alike: a
/// set-up returns on one member while another still waits (only rank 0 waits for all), so a
/// member dying at the end could leave some with the communicator and others without. Every
/// member that made its part counts itself out and waits for all the others, a death, or
/// another member's failure; each proposes the outcome it saw, and the first proposal stored is
/// everyone's ([`StoreClient::set_if_absent`]). A member with the communicator drops it when the
/// outcome is a failure. A death after the outcome is the new communicator's failure, seen by
/// all.
fn commit(
    made: Result<Communicator>,
    id: &UniqueId,
    namespace: &str,
    (rank, nranks): (usize, usize),
    timeout: Duration,
) -> Result<Communicator> {
    let boot = |source: TransportError| Error::Bootstrap { rank, source };
    let outcome_key = format!("{namespace}/commit/outcome");
    let started = Instant::now();
    let comm = match made {
        Ok(comm) => comm,
        Err(e) => {
            // Without a store nobody can be told: the others' waits end at their timeout.
            if let Ok(mut client) = StoreClient::connect(&id.addr, &id.token, timeout) {
                let _ = propose(&mut client, &outcome_key, &failure_proposal(&e, rank));
            }
            return Err(e);
        }
    };
    let mut store = lock(&comm.inner.store);
    let all_left = format!("{namespace}/commit/all-left");
    let counted = store
        .add(&format!("{namespace}/commit/left"), 1)
        .map_err(|e| boot(e.into()))?;
    if counted >= nranks as i64 {
        store.set(&all_left, b"1").map_err(|e| boot(e.into()))?;
    }
    let lost_key = setup_lost_key(namespace);
    let proposal = loop {
        match store.get_all_unless(std::slice::from_ref(&all_left), &lost_key, COMMIT_POLL) {
            Ok(_) => break "ok".to_string(),
            Err(StoreError::Interrupted { value, .. }) => {
                break format!("lost {}", String::from_utf8_lossy(&value))
            }
            Err(StoreError::Timeout { .. }) => {
                if store.check(&outcome_key).map_err(|e| boot(e.into()))? {
                    break "failed".to_string();
                }
                if started.elapsed() >= timeout {
                    break format!("timeout {rank}");
                }
            }
            Err(e) => return Err(boot(e.into())),
        }
    };
    let decided = propose(&mut store, &outcome_key, &proposal).map_err(|e| boot(e.into()))?;
    drop(store);
    if decided == "ok" {
        return Ok(comm);
    }
    drop(comm);
    Err(boot(outcome_error(&decided, nranks, started.elapsed())))
}

/// What a member whose own set-up failed proposes: the death it saw, or its own failure.
fn failure_proposal(e: &Error, rank: usize) -> String {
    match e {
        Error::Bootstrap {
            source: TransportError::DiedInSetup { peer },
            ..
        } => format!("lost {peer}"),
        _ => format!("failed {rank}"),
    }
}

/// Stores `proposal` as the outcome unless one is there; the outcome.
fn propose(
    store: &mut StoreClient,
    key: &str,
    proposal: &str,
) -> std::result::Result<String, StoreError> {
    let decided = store.set_if_absent(key, proposal.as_bytes())?;
    Ok(String::from_utf8_lossy(&decided).into_owned())
}

/// The error of a failed outcome: a member's death, or a member that could not make its part.
fn outcome_error(outcome: &str, nranks: usize, after: Duration) -> TransportError {
    let member = outcome
        .split_once(' ')
        .and_then(|(_, r)| r.trim().parse::<usize>().ok());
    match (outcome.split(' ').next(), member) {
        (Some("lost"), Some(peer)) => TransportError::DiedInSetup { peer },
        (_, Some(r)) => TransportError::NotJoined {
            missing: vec![r],
            more: 0,
            nranks,
            after,
        },
        _ => TransportError::Protocol(format!("unreadable set-up outcome {outcome:?}")),
    }
}

/// Leaves `event` in the job's store for `weft status` (best effort: a store that fails here
/// fails the new communicator's first operation instead).
fn publish_event(store: &mut StoreClient, event: &RecoveryEvent) {
    let Ok(json) = serde_json::to_string(event) else {
        return;
    };
    if let Ok(n) = store.add(EVENTS_KEY, 1) {
        let _ = store.set(&event_key(n), json.as_bytes());
    }
}

/// While a communicator made from another one sets up, watches the parent's sessions of its
/// members: a member that died before joining (its parent session closed without leaving) is
/// published as the new namespace's set-up death, which ends every member's set-up waits
/// naming it (the store's own hook sees only sessions of the new namespace); so is a newcomer
/// whose ticket's session closed. `members` are ranks of `parent` in the new communicator's
/// order; `newcomers` their ticket's session and their rank in the new communicator. Stops when
/// dropped.
fn member_watch(
    parent: &Communicator,
    members: Vec<usize>,
    newcomers: Vec<(String, usize)>,
    namespace: &str,
) -> Result<Background> {
    let inner = &parent.inner;
    let boot = |source: TransportError| Error::Bootstrap {
        rank: inner.rank,
        source,
    };
    let mut client = inner.connect_store()?;
    let prefix = session_prefix(&inner.namespace);
    let parent_ns = inner.namespace.clone();
    let lost_key = setup_lost_key(namespace);
    let watch = Background::spawn(format!("weft-members-{}", inner.rank), move |stop| {
        while !stop.load(Ordering::SeqCst) {
            let Ok(sessions) = client.sessions(&prefix) else {
                return;
            };
            let mut dead = sessions.iter().find_map(|s| {
                let left = RankIdentity::decode(&s.value).is_some_and(|i| i.left);
                let rank = session_rank(&s.key, &parent_ns)?;
                let at = members.iter().position(|&m| m == rank)?;
                (!s.open && !left).then_some(at)
            });
            if dead.is_none() && !newcomers.is_empty() {
                let Ok(joiners) = client.sessions(JOINER_SESSION_PREFIX) else {
                    return;
                };
                dead = newcomers.iter().find_map(|(key, at)| {
                    joiners
                        .iter()
                        .any(|s| &s.key == key && !s.open)
                        .then_some(*at)
                });
            }
            if let Some(at) = dead {
                let _ = client.set_if_absent(&lost_key, at.to_string().as_bytes());
                return;
            }
            std::thread::sleep(MEMBER_WATCH_PERIOD);
        }
    })
    .map_err(|e| boot(TransportError::io("spawning the member watch", e)))?;
    Ok(watch)
}
