//! A running job seen from outside (`weft status`, like NCCL's RAS client): every rank's
//! identity, liveness and progress, read from the job's bootstrap store, and a verdict.
//!
//! Nothing here talks to the ranks themselves, so a job whose ranks are stuck, stopped or dead
//! can still be read. What the store holds about each rank of a communicator:
//! * its failure watcher's store session (`<namespace>/rank/<r>`, [`RankIdentity`] as value):
//!   open while the process lives, with the time since the watcher's last poll (one every
//!   100 ms), closed when the process died or left (the value says which);
//! * its progress record (the last collective entered, the last operation completed, when);
//! * the job's failure note, once a rank failed.
//!
//! [`judge`] turns them into a [`Verdict`]; it is pure, so the rules are tested without a job.

use std::fmt;
use std::time::Duration;
use weftcc::comm::records::identity::RankIdentity;
use weftcc::comm::records::note::{AbortCause, FailureNote};
use weftcc::comm::records::progress::{behind, now_ms, Behind, ProgressRecord, SILENT_AFTER};
use weftcc::comm::records::recovery::{current_namespace, event_key, RecoveryEvent, EVENTS_KEY};
use weftcc::comm::records::{progress_key, session_prefix, session_rank, ABORT_KEY};
use weftcc::store::{SessionInfo, StoreClient, StoreError};
use weftcc::{Error, Result, UniqueId};
use weftcc_collectives::OpKind;

/// Whether a rank's process shows signs of life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Its watcher polls the store.
    Alive,
    /// Its watcher has not polled for this long ([`SILENT_AFTER`] or more): the process is
    /// stopped, or stuck where weftcc's threads cannot run.
    Silent(Duration),
    /// Its connection to the store closed this long ago without it leaving: the process died.
    Dead(Duration),
    /// It destroyed its communicator this long ago.
    Left(Duration),
    /// It has not reached the store (not started, or still connecting).
    Absent,
}

/// One rank, as [`JobStatus::read`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankStatus {
    /// Its rank.
    pub rank: usize,
    /// Who it is, once it reached the store.
    pub identity: Option<RankIdentity>,
    /// Whether it is alive.
    pub liveness: Liveness,
    /// The last collective it entered and the last operation it completed, once it finished
    /// joining (its progress record exists).
    pub progress: Option<Progress>,
}

/// What a rank has done: its last progress record, and the time since it changed (on the rank's
/// clock against the reader's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub record: ProgressRecord,
    pub since: Duration,
}

impl Progress {
    /// The collective the rank is in (entered and not completed), if any.
    pub fn current(&self) -> Option<(OpKind, u64)> {
        let r = &self.record;
        r.entered.filter(|e| Some(*e) != r.completed)
    }
}

impl RankStatus {
    /// The rank's state in a few words: `dead`, `stopped`, `left`, `joining`, `in all-reduce #2`
    /// or `idle`.
    pub fn state(&self) -> String {
        match (self.liveness, &self.progress) {
            (Liveness::Dead(_), _) => "dead".into(),
            (Liveness::Left(_), _) => "left".into(),
            (Liveness::Absent, _) => "not arrived".into(),
            (Liveness::Silent(_), Some(_)) => "not responding".into(),
            (_, None) => "joining".into(),
            (Liveness::Alive, Some(p)) => match p.current() {
                Some((k, s)) => format!("in {k} #{s}"),
                None => "idle".into(),
            },
        }
    }
}

/// What is wrong with a job, if anything, most serious first.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// A collective timed out on rank `origin`; `behind` is its diagnosis.
    Timeout {
        origin: usize,
        op: OpKind,
        seq: u64,
        after: Duration,
        behind: Vec<Behind>,
    },
    /// Ranks called different collectives (found by rank `origin`).
    Mismatch { origin: usize, reason: String },
    /// Rank `reporter` (`None`: the bootstrap store) lost rank `peer` (it died or closed its
    /// connections).
    Lost {
        peer: usize,
        reporter: Option<usize>,
        detail: String,
    },
    /// Rank `origin` called `abort()`.
    Aborted { origin: usize, reason: String },
    /// Rank `origin` failed otherwise.
    Failed { origin: usize, reason: String },
    /// Rank `origin` revoked the communicator (its survivors may be recovering).
    Revoked { origin: usize, reason: String },
    /// No failure published yet, but these ranks' processes died.
    Dead { ranks: Vec<usize> },
    /// No failure published yet, but these ranks give no sign of life.
    Unresponsive { ranks: Vec<usize> },
    /// Some ranks are in collective `op` #`seq` (for `waited`), the others behind.
    Behind {
        op: OpKind,
        seq: u64,
        waited: Duration,
        behind: Vec<Behind>,
    },
    /// These ranks have not reached the store, or not finished joining.
    Joining { ranks: Vec<usize> },
    /// Every rank has left.
    Finished,
    /// Nothing wrong.
    Ok,
}

impl Verdict {
    /// The verdict in one word, for scripts: TIMEOUT, MISMATCH, DEAD, ABORTED, FAILED, REVOKED,
    /// NOT-RESPONDING, BEHIND, JOINING, FINISHED or OK.
    pub fn word(&self) -> &'static str {
        match self {
            Verdict::Timeout { .. } => "TIMEOUT",
            Verdict::Mismatch { .. } => "MISMATCH",
            Verdict::Lost { .. } | Verdict::Dead { .. } => "DEAD",
            Verdict::Aborted { .. } => "ABORTED",
            Verdict::Failed { .. } => "FAILED",
            Verdict::Revoked { .. } => "REVOKED",
            Verdict::Unresponsive { .. } => "NOT-RESPONDING",
            Verdict::Behind { .. } => "BEHIND",
            Verdict::Joining { .. } => "JOINING",
            Verdict::Finished => "FINISHED",
            Verdict::Ok => "OK",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = self.word();
        let diagnosis = |behind: &[Behind], op, seq| {
            behind
                .iter()
                .map(|b| format!("; {}", b.describe(op, seq)))
                .collect::<String>()
        };
        match self {
            Verdict::Timeout {
                origin,
                op,
                seq,
                after,
                behind,
            } => write!(
                f,
                "{word}: rank {origin}: {op} #{seq} timed out after {after:?}{}",
                diagnosis(behind, *op, *seq)
            ),
            Verdict::Mismatch { origin, reason }
            | Verdict::Aborted { origin, reason }
            | Verdict::Failed { origin, reason }
            | Verdict::Revoked { origin, reason } => write!(f, "{word}: rank {origin}: {reason}"),
            Verdict::Lost {
                peer,
                reporter,
                detail,
            } => match reporter {
                Some(r) => write!(f, "{word}: rank {peer} lost (seen by rank {r}: {detail})"),
                None => write!(
                    f,
                    "{word}: rank {peer} lost (seen by the bootstrap store: {detail})"
                ),
            },
            Verdict::Dead { ranks } => write!(f, "{word}: the processes of ranks {ranks:?} died"),
            Verdict::Unresponsive { ranks } => write!(
                f,
                "{word}: ranks {ranks:?} have given no sign of life for {:.0} s or more \
                 (stopped, or stuck outside weftcc)",
                SILENT_AFTER.as_secs_f64()
            ),
            Verdict::Behind {
                op,
                seq,
                waited,
                behind,
            } => write!(
                f,
                "{word}: ranks in {op} #{seq} have waited {:.1} s{}",
                waited.as_secs_f64(),
                diagnosis(behind, *op, *seq)
            ),
            Verdict::Joining { ranks } => {
                write!(f, "{word}: ranks {ranks:?} have not finished joining")
            }
            Verdict::Finished => write!(f, "{word}: every rank has left"),
            Verdict::Ok => write!(f, "{word}"),
        }
    }
}

/// A communicator of a running job, read from its bootstrap store.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStatus {
    /// The communicator's namespace in the store ([`WORLD_NAMESPACE`] for the job's own).
    pub namespace: String,
    /// Its ranks.
    pub nranks: usize,
    /// Each rank, by rank.
    pub ranks: Vec<RankStatus>,
    /// What is wrong, if anything.
    pub verdict: Verdict,
    /// The shrinks and grows that made this communicator, oldest first.
    pub lineage: Vec<RecoveryEvent>,
}

/// Longest the ranks of a collective may wait for the others before [`judge`] calls the job
/// [`Verdict::Behind`] (ranks reach a collective at different times in every healthy job).
pub const BEHIND_AFTER: Duration = Duration::from_secs(2);

impl JobStatus {
    /// Reads the communicator under `namespace` (the job's own is `WORLD_NAMESPACE`) through
    /// the store at `id` (any rank's id: the rendezvous address and job token).
    pub fn read_namespace(id: &UniqueId, namespace: &str, timeout: Duration) -> Result<JobStatus> {
        let boot = |source: StoreError| Error::Bootstrap {
            rank: 0,
            source: source.into(),
        };
        let mut store = StoreClient::connect(&id.addr, &id.token, timeout).map_err(boot)?;
        let sessions = store.sessions(&session_prefix(namespace)).map_err(boot)?;
        let nranks = sessions
            .iter()
            .filter_map(|s| RankIdentity::decode(&s.value))
            .map(|i| i.nranks)
            .max()
            .ok_or_else(|| {
                Error::Config(format!(
                    "no rank of communicator {namespace:?} has reached the store at {} yet",
                    id.addr
                ))
            })?;
        let keys: Vec<String> = (0..nranks).map(|r| progress_key(namespace, r)).collect();
        // Every record at once when all exist; else one at a time, without waiting.
        let records: Vec<Option<ProgressRecord>> = match store.get_all(&keys, Duration::ZERO) {
            Ok(values) => values.iter().map(|v| ProgressRecord::decode(v)).collect(),
            Err(StoreError::Timeout { .. }) => {
                let mut out = Vec::with_capacity(nranks);
                for k in &keys {
                    out.push(match store.get(k, Duration::ZERO) {
                        Ok(v) => ProgressRecord::decode(&v),
                        Err(StoreError::Timeout { .. }) => None,
                        Err(e) => return Err(boot(e)),
                    });
                }
                out
            }
            Err(e) => return Err(boot(e)),
        };
        let note = match store.get(&format!("{namespace}/{ABORT_KEY}"), Duration::ZERO) {
            Ok(v) => FailureNote::decode(&v),
            Err(StoreError::Timeout { .. }) => None,
            Err(e) => return Err(boot(e)),
        };
        let ranks = rank_statuses(&sessions, namespace, &records, nranks, now_ms());
        let verdict = judge(&ranks, &records, note, now_ms());
        Ok(JobStatus {
            namespace: namespace.to_string(),
            nranks,
            ranks,
            verdict,
            lineage: Vec::new(),
        })
    }

    /// [`JobStatus::read_namespace`] of the newest communicator descended from `namespace` by
    /// shrinks and grows (the survivors' after a recovery), with the events that led to it.
    pub fn read_current(id: &UniqueId, namespace: &str, timeout: Duration) -> Result<JobStatus> {
        let events = read_events(id, timeout)?;
        let current = current_namespace(namespace, &events);
        let mut status = JobStatus::read_namespace(id, &current, timeout)?;
        // The events of this communicator's line only.
        let mut line = Vec::new();
        let mut at = current;
        while let Some(e) = events.iter().rev().find(|e| e.to == at) {
            at = e.from.clone();
            line.push(e.clone());
        }
        line.reverse();
        status.lineage = line;
        Ok(status)
    }
}

/// Every recovery event the job's ranks left in the store, in the order they were left.
fn read_events(id: &UniqueId, timeout: Duration) -> Result<Vec<RecoveryEvent>> {
    let boot = |source: StoreError| Error::Bootstrap {
        rank: 0,
        source: source.into(),
    };
    let mut store = StoreClient::connect(&id.addr, &id.token, timeout).map_err(boot)?;
    let n = store.add(EVENTS_KEY, 0).map_err(boot)?;
    let keys: Vec<String> = (1..=n).map(event_key).collect();
    let values = match store.get_all(&keys, Duration::ZERO) {
        Ok(v) => v,
        // Counted, not yet written: read again next time.
        Err(StoreError::Timeout { .. }) => Vec::new(),
        Err(e) => return Err(boot(e)),
    };
    Ok(values
        .iter()
        .filter_map(|v| serde_json::from_slice(v).ok())
        .collect())
}

/// Each of `nranks` ranks from its session (named under `namespace`) and progress record.
pub fn rank_statuses(
    sessions: &[SessionInfo],
    namespace: &str,
    records: &[Option<ProgressRecord>],
    nranks: usize,
    now_ms: u64,
) -> Vec<RankStatus> {
    let mut ranks: Vec<RankStatus> = (0..nranks)
        .map(|rank| RankStatus {
            rank,
            identity: None,
            liveness: Liveness::Absent,
            progress: records.get(rank).copied().flatten().map(|record| Progress {
                record,
                since: Duration::from_millis(now_ms.saturating_sub(record.at_ms)),
            }),
        })
        .collect();
    for s in sessions {
        let Some(r) = session_rank(&s.key, namespace).filter(|r| *r < nranks) else {
            continue;
        };
        let identity = RankIdentity::decode(&s.value);
        let left = identity.as_ref().is_some_and(|i| i.left);
        let joined = ranks[r].progress.is_some();
        ranks[r].liveness = match (s.open, left) {
            (_, true) => Liveness::Left(s.idle),
            (false, false) => Liveness::Dead(s.idle),
            // A joining rank's watcher does not poll yet: silence means nothing then.
            (true, false) if joined && s.idle >= SILENT_AFTER => Liveness::Silent(s.idle),
            (true, false) => Liveness::Alive,
        };
        ranks[r].identity = identity;
    }
    ranks
}

/// The verdict on a communicator whose ranks are `ranks`, with progress `records` and the
/// published failure `note`, at `now_ms`.
pub fn judge(
    ranks: &[RankStatus],
    records: &[Option<ProgressRecord>],
    note: Option<FailureNote>,
    now_ms: u64,
) -> Verdict {
    if let Some(note) = note {
        return match note {
            FailureNote::Timeout {
                origin,
                op,
                seq,
                after_ms,
                behind,
                ..
            } => Verdict::Timeout {
                origin,
                op,
                seq,
                after: Duration::from_millis(after_ms),
                behind,
            },
            FailureNote::Lost {
                peer,
                reporter,
                detail,
            } => Verdict::Lost {
                peer,
                reporter,
                detail,
            },
            FailureNote::Abort {
                origin,
                reason,
                cause,
                ..
            } => match cause {
                AbortCause::Mismatch => Verdict::Mismatch { origin, reason },
                AbortCause::AbortCalled => Verdict::Aborted { origin, reason },
                AbortCause::Failed => Verdict::Failed { origin, reason },
                AbortCause::Revoked => Verdict::Revoked { origin, reason },
            },
        };
    }
    let which = |f: &dyn Fn(&RankStatus) -> bool| -> Vec<usize> {
        ranks.iter().filter(|r| f(r)).map(|r| r.rank).collect()
    };
    let dead = which(&|r| matches!(r.liveness, Liveness::Dead(_)));
    if !dead.is_empty() {
        return Verdict::Dead { ranks: dead };
    }
    let silent = which(&|r| matches!(r.liveness, Liveness::Silent(_)));
    if !silent.is_empty() {
        return Verdict::Unresponsive { ranks: silent };
    }
    if ranks
        .iter()
        .all(|r| matches!(r.liveness, Liveness::Left(_)))
    {
        return Verdict::Finished;
    }
    let joining = which(&|r| r.progress.is_none() && !matches!(r.liveness, Liveness::Left(_)));
    if !joining.is_empty() {
        return Verdict::Joining { ranks: joining };
    }
    // The furthest collective any rank is in, and how long its ranks have waited in it.
    let ahead = ranks
        .iter()
        .filter_map(|r| Some((r.progress?.current()?, r.progress?.since)))
        .max_by_key(|((_, seq), since)| (*seq, *since));
    if let Some(((op, seq), waited)) = ahead {
        let none = vec![None; ranks.len()];
        let behind = behind(records, &none, seq, usize::MAX, now_ms);
        if waited >= BEHIND_AFTER && !behind.is_empty() {
            return Verdict::Behind {
                op,
                seq,
                waited,
                behind,
            };
        }
    }
    Verdict::Ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(rank: usize, open: bool, idle_ms: u64, left: bool) -> SessionInfo {
        SessionInfo {
            key: format!("c/rank/{rank}"),
            value: RankIdentity {
                nranks: 4,
                pid: 100 + rank as u32,
                host: "node 1".into(),
                left,
            }
            .encode()
            .into_bytes(),
            open,
            idle: Duration::from_millis(idle_ms),
        }
    }

    fn record(entered: u64, completed: u64, at_ms: u64) -> Option<ProgressRecord> {
        let op = |s| (s > 0).then_some((OpKind::AllReduce, s));
        Some(ProgressRecord {
            entered: op(entered),
            completed: op(completed),
            at_ms,
        })
    }

    fn verdict(sessions: &[SessionInfo], records: &[Option<ProgressRecord>]) -> Verdict {
        let ranks = rank_statuses(sessions, "c", records, 4, 20_000);
        judge(&ranks, records, None, 20_000)
    }

    #[test]
    fn identities_round_trip_and_reject_garbage() {
        let i = RankIdentity {
            nranks: 4,
            pid: 7,
            host: "a host with spaces".into(),
            left: true,
        };
        assert_eq!(RankIdentity::decode(i.encode().as_bytes()), Some(i));
        assert_eq!(RankIdentity::decode(b"weft-rank/1 4 7 maybe h"), None);
        assert_eq!(RankIdentity::decode(b"weft-rank/1 x 7 run h"), None);
        assert_eq!(RankIdentity::decode(&[0xff, 0x20]), None);
    }

    #[test]
    fn a_rank_that_has_not_called_the_collective_makes_the_job_behind() {
        let alive: Vec<_> = (0..4).map(|r| session(r, true, 50, false)).collect();
        // Ranks 0, 2, 3 entered all-reduce #2 at 10 s; rank 1 completed #1 at 9 s.
        let records = [
            record(2, 1, 10_000),
            record(1, 1, 9_000),
            record(2, 1, 10_000),
            record(2, 1, 10_000),
        ];
        let v = verdict(&alive, &records);
        let Verdict::Behind { seq, behind, .. } = &v else {
            panic!("{v:?}")
        };
        assert_eq!((*seq, behind.len(), behind[0].rank), (2, 1, 1));
        assert!(v.to_string().starts_with(
            "BEHIND: ranks in all-reduce #2 have waited 10.0 s; rank 1 has not called all-reduce #2"
        ));
        // The same a moment after the others entered: ranks arrive at different times.
        let fresh = [
            record(2, 1, 19_500),
            record(1, 1, 19_000),
            record(2, 1, 19_500),
            record(2, 1, 19_500),
        ];
        assert_eq!(verdict(&alive, &fresh), Verdict::Ok);
        // Everyone in step, idle between calls: fine however long.
        let idle = [record(2, 2, 1_000); 4];
        assert_eq!(verdict(&alive, &idle), Verdict::Ok);
    }

    #[test]
    fn dead_silent_joining_and_left_ranks_are_told_apart() {
        let records = [record(2, 2, 1_000); 4];
        let mut s: Vec<_> = (0..4).map(|r| session(r, true, 50, false)).collect();
        s[2] = session(2, false, 3_000, false);
        let v = verdict(&s, &records);
        assert_eq!(v, Verdict::Dead { ranks: vec![2] });
        assert_eq!(v.word(), "DEAD");

        s[2] = session(2, true, 4_000, false);
        let ranks = rank_statuses(&s, "c", &records, 4, 20_000);
        assert_eq!(ranks[2].state(), "not responding");
        assert_eq!(
            judge(&ranks, &records, None, 20_000),
            Verdict::Unresponsive { ranks: vec![2] }
        );

        // Silent before its progress record exists: still joining (its watcher is not up).
        let mut joining = records;
        joining[2] = None;
        let ranks = rank_statuses(&s, "c", &joining, 4, 20_000);
        assert_eq!(ranks[2].state(), "joining");
        assert_eq!(
            judge(&ranks, &joining, None, 20_000),
            Verdict::Joining { ranks: vec![2] }
        );

        // A rank that never reached the store.
        let ranks = rank_statuses(&s[..3], "c", &joining, 4, 20_000);
        assert_eq!(ranks[3].state(), "not arrived");
        assert_eq!(ranks[3].liveness, Liveness::Absent);

        let left: Vec<_> = (0..4).map(|r| session(r, false, 10, true)).collect();
        assert_eq!(verdict(&left, &records), Verdict::Finished);
    }

    #[test]
    fn a_published_failure_decides_the_verdict() {
        let alive: Vec<_> = (0..4).map(|r| session(r, true, 50, false)).collect();
        let records = [record(2, 1, 1_000); 4];
        let ranks = rank_statuses(&alive, "c", &records, 4, 20_000);
        let note = |cause| FailureNote::Abort {
            origin: 3,
            reason: "boom".into(),
            cause,
            during: None,
        };
        let words: Vec<&str> = [
            AbortCause::Mismatch,
            AbortCause::AbortCalled,
            AbortCause::Failed,
            AbortCause::Revoked,
        ]
        .into_iter()
        .map(|c| judge(&ranks, &records, Some(note(c)), 20_000).word())
        .collect();
        assert_eq!(words, ["MISMATCH", "ABORTED", "FAILED", "REVOKED"]);
        let timeout = FailureNote::Timeout {
            origin: 0,
            op: OpKind::AllReduce,
            seq: 2,
            after_ms: 2_000,
            waiting_on: vec![1],
            behind: Vec::new(),
        };
        let v = judge(&ranks, &records, Some(timeout), 20_000);
        assert_eq!(
            v.to_string(),
            "TIMEOUT: rank 0: all-reduce #2 timed out after 2s"
        );
    }
}
