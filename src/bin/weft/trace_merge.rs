//! Lines up the flight-recorder dumps of a job ([`TraceDump`], one per rank and
//! communicator) and says what they show: the furthest collective any rank entered, the ranks
//! that have not called it (furthest behind first), the collectives ranks called differently,
//! the operations that failed, and the ranks with no dump. Pure: `weft trace merge` reads the
//! files and prints [`CommReport`]'s `Display`.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use weftcc::comm::records::trace::{DumpReason, TraceDump, TraceRecord, TraceState};

/// Disagreements reported per communicator (the first ones, by sequence number).
const MAX_DISAGREEMENTS: usize = 8;
/// Largest rank count believed from a dump (a damaged file must not make the merge list
/// billions of missing ranks).
const MAX_RANKS: usize = 1 << 20;

/// What the dumps of one communicator show.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommReport {
    pub job: String,
    pub namespace: String,
    pub nranks: usize,
    /// Ranks with a dump.
    pub dumped: Vec<usize>,
    /// Ranks of `0..nranks` without one.
    pub missing: Vec<usize>,
    /// Why the dumps were taken, and the first error any of them names.
    pub reasons: Vec<DumpReason>,
    pub error: Option<(usize, String)>,
    /// The furthest collective entered by any rank.
    pub frontier: Option<Frontier>,
    /// Ranks that had not entered [`CommReport::frontier`], furthest behind first.
    pub behind: Vec<RankBehind>,
    /// Collectives the ranks called differently.
    pub disagreements: Vec<Disagreement>,
    /// Failed operations, one per rank (its first).
    pub failed: Vec<FailedOp>,
    /// Send/receive groups still running at the dump (point-to-point has no job-wide sequence,
    /// so these are listed, not lined up).
    pub in_send_recv: Vec<RunningP2p>,
    /// Facts about the dumps themselves (a rank count that differs, a ring too short to reach
    /// back to the frontier, duplicate dumps).
    pub notes: Vec<String>,
}

/// The furthest collective entered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Frontier {
    pub seq: u64,
    /// Its call (kind, type, count, reduction, root) as the first rank there recorded it.
    pub signature: String,
    /// Ranks that entered it, and those of them still running it at their dump.
    pub entered: Vec<usize>,
    pub running: Vec<usize>,
    /// The longest it had run on one rank at its dump (µs).
    pub longest_running_us: u64,
}

/// A rank that had not entered the frontier collective.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankBehind {
    pub rank: usize,
    /// Its last collective: sequence number, signature, state, and µs between its end (or
    /// start, while running) and the rank's dump.
    pub last: Option<(u64, String, TraceState, u64)>,
}

/// One collective called differently by different ranks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Disagreement {
    pub seq: u64,
    /// Each distinct call, with the ranks that made it (largest group first).
    pub calls: Vec<(String, Vec<usize>)>,
}

/// A send/receive group running on a rank at its dump.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunningP2p {
    pub rank: usize,
    pub seq: u64,
    pub peers: Vec<usize>,
    /// How long it had run at the dump (µs).
    pub running_us: u64,
}

/// An operation that failed on a rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailedOp {
    pub rank: usize,
    pub seq: u64,
    pub kind: String,
    pub error: String,
}

impl CommReport {
    /// Whether the dumps show nothing wrong: every rank dumped, none behind, none disagreeing,
    /// nothing failed.
    pub fn consistent(&self) -> bool {
        self.missing.is_empty()
            && self.behind.is_empty()
            && self.disagreements.is_empty()
            && self.failed.is_empty()
            && self.in_send_recv.is_empty()
            && self.error.is_none()
    }
}

/// Groups `dumps` by job and communicator and reports on each (ordered by job, namespace).
pub fn merge(dumps: &[TraceDump]) -> Vec<CommReport> {
    let mut groups: BTreeMap<(&str, &str), Vec<&TraceDump>> = BTreeMap::new();
    for d in dumps {
        groups.entry((&d.job, &d.namespace)).or_default().push(d);
    }
    groups
        .into_values()
        .map(|mut g| {
            g.sort_by_key(|d| (d.rank, std::cmp::Reverse(d.dumped_us)));
            report(&g)
        })
        .collect()
}

/// The report on one communicator's dumps (sorted by rank, newest first within a rank).
fn report(dumps: &[&TraceDump]) -> CommReport {
    let mut notes = Vec::new();
    let mut nranks = dumps.iter().map(|d| d.nranks).max().unwrap_or(0);
    if dumps.iter().any(|d| d.nranks != nranks) {
        notes.push("the dumps disagree on the number of ranks; the largest is used".into());
    }
    if nranks > MAX_RANKS {
        notes.push(format!(
            "a dump claims {nranks} ranks; only the ranks that dumped are considered"
        ));
        nranks = dumps.iter().map(|d| d.rank + 1).max().unwrap_or(0);
    }
    // One dump per rank: the newest.
    let mut per_rank: Vec<&TraceDump> = Vec::new();
    for d in dumps {
        if per_rank.last().is_some_and(|p| p.rank == d.rank) {
            notes.push(format!(
                "rank {}: more than one dump; the newest is used",
                d.rank
            ));
            continue;
        }
        per_rank.push(d);
    }
    let dumped: Vec<usize> = per_rank.iter().map(|d| d.rank).collect();
    let missing: Vec<usize> = (0..nranks).filter(|r| !dumped.contains(r)).collect();
    let mut reasons: Vec<DumpReason> = per_rank.iter().map(|d| d.reason).collect();
    reasons.sort_by_key(|r| *r as u8);
    reasons.dedup();
    let error = per_rank
        .iter()
        .find_map(|d| d.error.clone().map(|e| (d.rank, e)));

    let collectives = |d: &TraceDump| -> Vec<TraceRecord> {
        d.entries
            .iter()
            .filter(|e| e.is_collective())
            .cloned()
            .collect()
    };
    let per_rank_ops: Vec<(&TraceDump, Vec<TraceRecord>)> =
        per_rank.iter().map(|d| (*d, collectives(d))).collect();
    let last_seq = |ops: &[TraceRecord]| ops.iter().map(|e| e.seq).max().unwrap_or(0);

    let frontier_seq = per_rank_ops
        .iter()
        .map(|(_, ops)| last_seq(ops))
        .max()
        .unwrap_or(0);
    let frontier = (frontier_seq > 0).then(|| {
        let mut entered = Vec::new();
        let mut running = Vec::new();
        let mut signature = String::new();
        let mut longest_running_us = 0;
        for (d, ops) in &per_rank_ops {
            if let Some(e) = ops.iter().find(|e| e.seq == frontier_seq) {
                if signature.is_empty() {
                    signature = e.signature();
                }
                entered.push(d.rank);
                if e.state == TraceState::Running {
                    running.push(d.rank);
                    longest_running_us =
                        longest_running_us.max(d.dumped_us.saturating_sub(e.start_us));
                }
            }
        }
        Frontier {
            seq: frontier_seq,
            signature,
            entered,
            running,
            longest_running_us,
        }
    });

    // A rank that recorded no collective because its recorder is off, or its ring holds only
    // newer point-to-point groups, is unknown, not behind.
    let unknown = |d: &TraceDump, ops: &[TraceRecord]| {
        ops.is_empty() && (d.capacity == 0 || d.recorded > d.capacity as u64)
    };
    for (d, ops) in &per_rank_ops {
        if unknown(d, ops) {
            notes.push(format!(
                "rank {}: no collective in its recorder (capacity {}, {} recorded); where it is \
                 is unknown",
                d.rank, d.capacity, d.recorded
            ));
        }
    }
    let mut behind: Vec<RankBehind> = per_rank_ops
        .iter()
        .filter(|(d, ops)| last_seq(ops) < frontier_seq && !unknown(d, ops))
        .map(|(d, ops)| RankBehind {
            rank: d.rank,
            last: ops.iter().max_by_key(|e| e.seq).map(|e| {
                let at = e.end_us.unwrap_or(e.start_us);
                (
                    e.seq,
                    e.signature(),
                    e.state,
                    d.dumped_us.saturating_sub(at),
                )
            }),
        })
        .collect();
    behind.sort_by_key(|b| (b.last.as_ref().map_or(0, |l| l.0), b.rank));

    // A rank whose ring no longer reaches back to a rank that is behind cannot be compared
    // there; say so rather than guess.
    if let Some(oldest_needed) = behind
        .iter()
        .filter_map(|b| b.last.as_ref().map(|l| l.0))
        .min()
    {
        for (d, ops) in &per_rank_ops {
            let oldest = ops.iter().map(|e| e.seq).min().unwrap_or(0);
            if d.recorded > d.capacity as u64 && oldest > oldest_needed {
                notes.push(format!(
                    "rank {}: its ring starts at #{oldest}, after the last collective of the \
                     rank furthest behind (#{oldest_needed}); raise WEFT_TRACE_BUFFER_SIZE",
                    d.rank
                ));
            }
        }
    }

    let mut by_seq: BTreeMap<u64, BTreeMap<String, Vec<usize>>> = BTreeMap::new();
    for (d, ops) in &per_rank_ops {
        for e in ops {
            by_seq
                .entry(e.seq)
                .or_default()
                .entry(e.signature())
                .or_default()
                .push(d.rank);
        }
    }
    let disagreements: Vec<Disagreement> = by_seq
        .into_iter()
        .filter(|(_, calls)| calls.len() > 1)
        .take(MAX_DISAGREEMENTS)
        .map(|(seq, calls)| {
            let mut calls: Vec<(String, Vec<usize>)> = calls.into_iter().collect();
            calls.sort_by_key(|(sig, ranks)| (std::cmp::Reverse(ranks.len()), sig.clone()));
            Disagreement { seq, calls }
        })
        .collect();

    let failed: Vec<FailedOp> = per_rank
        .iter()
        .filter_map(|d| {
            let e = d.entries.iter().find(|e| e.state == TraceState::Failed)?;
            Some(FailedOp {
                rank: d.rank,
                seq: e.seq,
                kind: e.kind.clone(),
                error: e.error.clone().unwrap_or_else(|| "error".into()),
            })
        })
        .collect();

    let in_send_recv: Vec<RunningP2p> = per_rank
        .iter()
        .flat_map(|d| {
            d.entries
                .iter()
                .filter(|e| !e.is_collective() && e.state == TraceState::Running)
                .map(|e| RunningP2p {
                    rank: d.rank,
                    seq: e.seq,
                    peers: e.peers.clone(),
                    running_us: d.dumped_us.saturating_sub(e.start_us),
                })
        })
        .collect();

    CommReport {
        job: dumps.first().map(|d| d.job.clone()).unwrap_or_default(),
        namespace: dumps
            .first()
            .map(|d| d.namespace.clone())
            .unwrap_or_default(),
        nranks,
        dumped,
        missing,
        reasons,
        error,
        frontier,
        behind,
        disagreements,
        failed,
        in_send_recv,
        notes,
    }
}

/// Ranks as a short list of ranges: `0,2-5,9`.
pub fn rank_set(ranks: &[usize]) -> String {
    weftcc_topology::xml::list_ranges(ranks.iter().copied())
}

fn secs(us: u64) -> String {
    format!("{:.1} s", us as f64 / 1e6)
}

impl fmt::Display for CommReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "communicator {} (job {}): {} ranks, dumps from {} ({})",
            self.namespace,
            self.job,
            self.nranks,
            self.dumped.len(),
            self.reasons
                .iter()
                .map(|r| match r {
                    DumpReason::Failure => "on failure",
                    DumpReason::Request => "on request",
                    DumpReason::Api => "by the program",
                })
                .collect::<Vec<_>>()
                .join(", ")
        )?;
        // The error's text names its rank.
        if let Some((_, e)) = &self.error {
            writeln!(f, "  error:     {e}")?;
        }
        if !self.missing.is_empty() {
            writeln!(
                f,
                "  missing:   no dump from rank(s) {} (dead, stopped, or not asked)",
                rank_set(&self.missing)
            )?;
        }
        match &self.frontier {
            Some(fr) => {
                write!(
                    f,
                    "  furthest:  {} #{} entered by rank(s) {}",
                    fr.signature,
                    fr.seq,
                    rank_set(&fr.entered)
                )?;
                if !fr.running.is_empty() {
                    write!(
                        f,
                        "; running on {} (up to {} at the dump)",
                        rank_set(&fr.running),
                        secs(fr.longest_running_us)
                    )?;
                }
                writeln!(f)?;
            }
            None => writeln!(f, "  furthest:  no collective recorded")?,
        }
        for b in &self.behind {
            let frontier = self.frontier.as_ref().map_or(0, |fr| fr.seq);
            match &b.last {
                Some((seq, sig, state, ago)) => {
                    let state = match state {
                        TraceState::Running => "still running",
                        TraceState::Completed => "completed",
                        TraceState::Failed => "failed",
                    };
                    writeln!(
                        f,
                        "  behind:    rank {} has not called #{frontier}; its last collective is \
                         {sig} #{seq}, {state} {} before its dump",
                        b.rank,
                        secs(*ago)
                    )?;
                }
                None => writeln!(
                    f,
                    "  behind:    rank {} has not called #{frontier}; it recorded no collective",
                    b.rank
                )?,
            }
        }
        for d in &self.disagreements {
            let calls: Vec<String> = d
                .calls
                .iter()
                .map(|(sig, ranks)| format!("rank(s) {} called {sig}", rank_set(ranks)))
                .collect();
            writeln!(f, "  disagree:  #{}: {}", d.seq, calls.join("; "))?;
        }
        for p in &self.in_send_recv {
            writeln!(
                f,
                "  send/recv: rank {} in send/recv #{} with rank(s) {}, running {} at its dump",
                p.rank,
                p.seq,
                rank_set(&p.peers),
                secs(p.running_us)
            )?;
        }
        for x in &self.failed {
            writeln!(
                f,
                "  failed:    rank {}: {} #{} ({})",
                x.rank, x.kind, x.seq, x.error
            )?;
        }
        for n in &self.notes {
            writeln!(f, "  note:      {n}")?;
        }
        let verdict = if self.consistent() {
            "CONSISTENT".to_string()
        } else {
            let mut words = Vec::new();
            if !self.behind.is_empty() {
                let ranks: Vec<usize> = self.behind.iter().map(|b| b.rank).collect();
                words.push(format!("BEHIND [{}]", rank_set(&ranks)));
            }
            if !self.disagreements.is_empty() {
                words.push("DISAGREE".into());
            }
            if !self.in_send_recv.is_empty() {
                let ranks: Vec<usize> = self.in_send_recv.iter().map(|p| p.rank).collect();
                words.push(format!("IN-SEND/RECV [{}]", rank_set(&ranks)));
            }
            if !self.failed.is_empty() || self.error.is_some() {
                words.push("FAILED".into());
            }
            if !self.missing.is_empty() {
                words.push(format!("MISSING [{}]", rank_set(&self.missing)));
            }
            words.join(" ")
        };
        writeln!(f, "  verdict:   {verdict}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weftcc::comm::records::trace::TRACE_FORMAT;
    use weftcc::comm::trace::TraceEntry;
    use weftcc_collectives::{DataType, OpKind, ReduceOp};

    const T0: u64 = 1_000_000_000;

    fn op(kind: OpKind, seq: u64, count: u64, state: TraceState) -> TraceRecord {
        let mut e = TraceEntry::start(kind, seq, DataType::Float32, count);
        e.start_us = T0 + seq * 1000;
        if kind == OpKind::AllReduce {
            e.redop = Some(ReduceOp::Sum);
        }
        if kind == OpKind::Broadcast {
            e.root = Some(0);
        }
        e.state = state;
        if state != TraceState::Running {
            e.end_us = Some(e.start_us + 500);
        }
        e.record()
    }

    fn dump(rank: usize, nranks: usize, entries: Vec<TraceRecord>) -> TraceDump {
        TraceDump {
            format: TRACE_FORMAT.into(),
            job: "j".into(),
            namespace: "c".into(),
            rank,
            nranks,
            host: "h".into(),
            pid: 100 + rank as u32,
            reason: DumpReason::Request,
            error: None,
            dumped_us: T0 + 10_000_000,
            recorded: entries.len() as u64,
            lineage: Vec::new(),
            capacity: 100,
            entries,
        }
    }

    use OpKind::{AllReduce, Broadcast, SendRecv};
    use TraceState::{Completed, Running};

    #[test]
    fn the_late_rank_is_named_and_the_others_are_running_the_next_collective() {
        // Rank 1 completed broadcast #1 and never called all-reduce #2; the others wait in it.
        let dumps: Vec<TraceDump> = (0..4)
            .map(|r| {
                let mut ops = vec![op(Broadcast, 1, 8, Completed)];
                if r != 1 {
                    ops.push(op(AllReduce, 2, 1024, Running));
                }
                dump(r, 4, ops)
            })
            .collect();
        let reports = merge(&dumps);
        assert_eq!(reports.len(), 1);
        let r = &reports[0];
        let fr = r.frontier.as_ref().expect("frontier");
        assert_eq!((fr.seq, fr.entered.clone()), (2, vec![0, 2, 3]));
        assert_eq!(fr.running, vec![0, 2, 3]);
        assert_eq!(r.behind.len(), 1);
        assert_eq!(r.behind[0].rank, 1);
        assert_eq!(r.behind[0].last.as_ref().map(|l| l.0), Some(1));
        assert!(r.disagreements.is_empty() && r.missing.is_empty());
        assert!(!r.consistent());
        let text = r.to_string();
        assert!(text.contains("rank 1 has not called #2; its last collective is broadcast"));
        assert!(text.contains("verdict:   BEHIND [1]"), "{text}");
    }

    #[test]
    fn ranks_that_called_differently_are_grouped() {
        let dumps: Vec<TraceDump> = (0..4)
            .map(|r| {
                let second = if r == 3 {
                    op(Broadcast, 2, 1024, Running)
                } else {
                    op(AllReduce, 2, 1024, Running)
                };
                dump(r, 4, vec![op(AllReduce, 1, 8, Completed), second])
            })
            .collect();
        let r = &merge(&dumps)[0];
        assert_eq!(r.disagreements.len(), 1);
        let d = &r.disagreements[0];
        assert_eq!(d.seq, 2);
        assert_eq!(d.calls[0].1, vec![0, 1, 2]);
        assert_eq!(d.calls[1], ("broadcast float×1024 root 0".into(), vec![3]));
        assert!(r.behind.is_empty());
        assert!(r.to_string().contains("DISAGREE"));
    }

    #[test]
    fn missing_ranks_failures_and_a_consistent_job() {
        let good: Vec<TraceDump> = (0..3)
            .map(|r| dump(r, 3, vec![op(AllReduce, 1, 8, Completed)]))
            .collect();
        let r = &merge(&good)[0];
        assert!(r.consistent(), "{r}");
        assert!(r.to_string().contains("CONSISTENT"));

        let mut partial = good.clone();
        partial.remove(1);
        partial[0].entries[0].state = TraceState::Failed;
        partial[0].entries[0].error = Some("timeout".into());
        let r = &merge(&partial)[0];
        assert_eq!(r.missing, vec![1]);
        assert_eq!(r.failed.len(), 1);
        assert!(r.to_string().contains("MISSING [1]"));
    }

    #[test]
    fn point_to_point_groups_do_not_count_as_collectives() {
        let dumps = vec![
            dump(
                0,
                2,
                vec![op(AllReduce, 1, 8, Completed), op(SendRecv, 5, 64, Running)],
            ),
            dump(1, 2, vec![op(AllReduce, 1, 8, Completed)]),
        ];
        let r = &merge(&dumps)[0];
        assert_eq!(r.frontier.as_ref().map(|f| f.seq), Some(1));
        assert!(r.behind.is_empty());
        // A send/recv still running is listed, and the job not called consistent.
        assert_eq!(r.in_send_recv.len(), 1);
        assert_eq!((r.in_send_recv[0].rank, r.in_send_recv[0].seq), (0, 5));
        assert!(r.to_string().contains("IN-SEND/RECV [0]"), "{r}");
    }

    #[test]
    fn a_rank_whose_recorder_holds_no_collective_is_unknown_not_behind() {
        let ahead = dump(0, 2, vec![op(AllReduce, 4, 8, Completed)]);
        let mut off = dump(1, 2, vec![]);
        off.capacity = 0;
        let r = &merge(&[ahead.clone(), off])[0];
        assert!(r.behind.is_empty(), "{r}");
        assert!(r.notes.iter().any(|n| n.contains("rank 1: no collective")));
        // With a ring that never overflowed, no collective means it made none: behind.
        let fresh = dump(1, 2, vec![]);
        let r = &merge(&[ahead, fresh])[0];
        assert_eq!(r.behind.len(), 1);
    }

    #[test]
    fn dumps_of_other_communicators_and_repeats_are_kept_apart() {
        let mut a = dump(0, 2, vec![op(AllReduce, 1, 8, Completed)]);
        let mut b = a.clone();
        b.namespace = "c/split0".into();
        let mut older = a.clone();
        older.dumped_us -= 1;
        older.entries.clear();
        a.entries.push(op(AllReduce, 2, 8, Completed));
        let r1 = dump(
            1,
            2,
            vec![
                op(AllReduce, 1, 8, Completed),
                op(AllReduce, 2, 8, Completed),
            ],
        );
        let reports = merge(&[older, a, b, r1]);
        assert_eq!(reports.len(), 2);
        assert_eq!(reports[0].namespace, "c");
        assert!(
            reports[0].behind.is_empty(),
            "the newest dump of rank 0 is used"
        );
        assert!(reports[0]
            .notes
            .iter()
            .any(|n| n.contains("more than one dump")));
        assert_eq!(reports[1].missing, vec![1]);
    }

    #[test]
    fn a_ring_that_no_longer_reaches_back_is_said() {
        let mut ahead = dump(
            0,
            2,
            (10..20).map(|s| op(AllReduce, s, 8, Completed)).collect(),
        );
        ahead.recorded = 19;
        ahead.capacity = 10;
        let late = dump(1, 2, vec![op(AllReduce, 3, 8, Completed)]);
        let r = &merge(&[ahead, late])[0];
        assert_eq!(r.behind[0].rank, 1);
        assert!(r.notes.iter().any(|n| n.contains("WEFT_TRACE_BUFFER_SIZE")));
    }

    #[test]
    fn rank_sets_are_short() {
        assert_eq!(rank_set(&[]), "");
        assert_eq!(rank_set(&[3]), "3");
        assert_eq!(rank_set(&[5, 0, 1, 2, 9, 10]), "0-2,5,9-10");
        assert_eq!(rank_set(&[1, 1, 2]), "1-2");
    }
}
