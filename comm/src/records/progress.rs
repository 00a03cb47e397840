//! Progress records: what each rank publishes about where it is (the last collective it entered,
//! the last operation it completed, when), and the diagnosis read from them ([`behind`]): who
//! has not entered the collective a rank timed out in, and who gives no sign of life.
//!
//! Times are milliseconds of the system clock (UNIX epoch): ranks on different hosts compare
//! them, so a skew between their clocks shows in the "ago" of a diagnosis.

use super::session_rank;
use std::time::Duration;
use weftcc_collectives::OpKind;
use weftcc_store::SessionInfo;

/// A rank that had not entered the collective another rank timed out in, or that had
/// stopped giving signs of life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    /// The rank.
    pub rank: usize,
    /// The last collective it entered (kind, sequence number), if any.
    pub entered: Option<(OpKind, u64)>,
    /// The last operation it completed, if any.
    pub completed: Option<(OpKind, u64)>,
    /// How long before the diagnosis it completed that operation (or, with none, entered its
    /// last collective; or was created).
    pub idle: Duration,
    /// How long its process had given no sign of life (its failure watcher stopped polling
    /// the bootstrap store, or its connection closed), when that was [`SILENT_AFTER`] or more.
    pub silent: Option<Duration>,
}

impl Behind {
    /// What is known of the rank, behind in `op #seq`.
    pub fn describe(&self, op: OpKind, seq: u64) -> String {
        let last = match self.completed {
            Some((k, s)) => format!("its last completed call is {k} #{s}"),
            None => "it has completed no call".into(),
        };
        let silent = self.silent.map(|d| {
            format!(
                "its process has given no sign of life for {:.1} s (stopped, or stuck outside \
                 weftcc)",
                d.as_secs_f64()
            )
        });
        if op == OpKind::SendRecv {
            // Message numbers of one pair: whether it "called" this one is not known.
            return match silent {
                Some(silent) => format!("rank {}, awaited here, {silent}", self.rank),
                None => format!("rank {} is awaited here", self.rank),
            };
        }
        let entered = self.entered.is_some_and(|(_, s)| s >= seq);
        match (entered, silent) {
            (true, Some(silent)) => format!("rank {} is in {op} #{seq} but {silent}", self.rank),
            (false, Some(silent)) => format!(
                "rank {} has not called {op} #{seq} and {silent}; {last}",
                self.rank
            ),
            _ => format!(
                "rank {} has not called {op} #{seq}; {last}, {:.1} s ago",
                self.rank,
                self.idle.as_secs_f64()
            ),
        }
    }
}

/// What one rank publishes about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressRecord {
    pub entered: Option<(OpKind, u64)>,
    pub completed: Option<(OpKind, u64)>,
    /// When the last change happened (ms since the UNIX epoch).
    pub at_ms: u64,
}

impl ProgressRecord {
    const MAGIC: &'static str = "weft-progress/1";

    pub fn encode(&self) -> String {
        let op = |o: Option<(OpKind, u64)>| match o {
            Some((k, s)) => format!("{} {s}", k as u8),
            None => "-".into(),
        };
        format!(
            "{} {} {} {}",
            Self::MAGIC,
            op(self.entered),
            op(self.completed),
            self.at_ms
        )
    }

    pub fn decode(bytes: &[u8]) -> Option<ProgressRecord> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut f = text.split(' ');
        if f.next()? != Self::MAGIC {
            return None;
        }
        let mut op = || -> Option<Option<(OpKind, u64)>> {
            let k = f.next()?;
            if k == "-" {
                return Some(None);
            }
            let kind = OpKind::from_code(k.parse().ok()?)?;
            Some(Some((kind, f.next()?.parse().ok()?)))
        };
        let entered = op()?;
        let completed = op()?;
        let at_ms = f.next()?.parse().ok()?;
        f.next().is_none().then_some(ProgressRecord {
            entered,
            completed,
            at_ms,
        })
    }
}

const SEQ_BITS: u32 = 56;

/// An operation's kind and sequence number as one word (kind in the top byte).
pub fn op_word(kind: OpKind, seq: u64) -> u64 {
    (u64::from(kind as u8) << SEQ_BITS) | (seq & ((1 << SEQ_BITS) - 1))
}

/// The operation of [`op_word`]; `None` for a word with no kind (such as `u64::MAX`).
pub fn word_op(word: u64) -> Option<(OpKind, u64)> {
    let kind = OpKind::from_code((word >> SEQ_BITS) as u8)?;
    Some((kind, word & ((1 << SEQ_BITS) - 1)))
}

pub fn now_ms() -> u64 {
    now_us() / 1000
}

/// Microseconds since the UNIX epoch on the system clock (zero for a clock set before it): what
/// ranks on different hosts can compare. Read straight from `clock_gettime`: through
/// `SystemTime`, the checked `Duration` arithmetic cost more instructions than the (vDSO) clock
/// reading itself, twice on every call.
pub fn now_us() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    match clock_gettime(ClockId::CLOCK_REALTIME) {
        Ok(t) if t.tv_sec() >= 0 => (t.tv_sec() as u64) * 1_000_000 + (t.tv_nsec() as u64) / 1_000,
        _ => 0,
    }
}

/// The ranks of `records` (indexed by rank; `None` where unknown) that have not entered
/// collective #`seq` or are silent (`silent[rank]`, from [`silence`]), furthest behind first
/// and the silent ones that entered after them (at most [`MAX_BEHIND`]), as seen at `now_ms`.
pub fn behind(
    records: &[Option<ProgressRecord>],
    silent: &[Option<Duration>],
    seq: u64,
    me: usize,
    now_ms: u64,
) -> Vec<Behind> {
    let mut out: Vec<Behind> = records
        .iter()
        .enumerate()
        .filter(|(r, _)| *r != me)
        .filter_map(|(rank, rec)| {
            let rec = (*rec)?;
            let silent = silent.get(rank).copied().flatten();
            let entered_seq = rec.entered.map_or(0, |(_, s)| s);
            (entered_seq < seq || silent.is_some()).then(|| Behind {
                rank,
                entered: rec.entered,
                completed: rec.completed,
                idle: Duration::from_millis(now_ms.saturating_sub(rec.at_ms)),
                silent,
            })
        })
        .collect();
    out.sort_by_key(|b| (b.entered.map_or(0, |(_, s)| s.min(seq)), b.rank));
    out.truncate(MAX_BEHIND);
    out
}

/// Per rank of `nranks`, how long it has been silent when that is [`SILENT_AFTER`] or more,
/// from the sessions its watchers named (`<namespace>/rank/<r>`, [`session_key`]).
pub fn silence(sessions: &[SessionInfo], namespace: &str, nranks: usize) -> Vec<Option<Duration>> {
    let mut out = vec![None; nranks];
    for s in sessions {
        let Some(rank) = session_rank(&s.key, namespace).filter(|r| *r < nranks) else {
            continue;
        };
        if !s.open || s.idle >= SILENT_AFTER {
            out[rank] = Some(s.idle);
        }
    }
    out
}

/// Silence after which a rank counts as not responding: ten of its watcher's polls missed.
pub const SILENT_AFTER: Duration = Duration::from_secs(1);

/// Most ranks a diagnosis names (the furthest behind): a job of thousands of ranks stuck behind
/// one rank's peers still gets an error a person can read.
pub const MAX_BEHIND: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = Option<(OpKind, u64)>> {
        proptest::option::of(
            (0usize..OpKind::ALL.len(), 0u64..1 << 56).prop_map(|(k, s)| (OpKind::ALL[k], s)),
        )
    }

    proptest! {
        #[test]
        fn records_round_trip(entered in op(), completed in op(), at_ms in any::<u64>()) {
            let r = ProgressRecord { entered, completed, at_ms };
            prop_assert_eq!(ProgressRecord::decode(r.encode().as_bytes()), Some(r));
        }

        #[test]
        fn anything_else_is_read_without_panicking(
            bytes in proptest::collection::vec(any::<u8>(), 0..48)
        ) {
            let _ = ProgressRecord::decode(&bytes);
        }
    }

    #[test]
    fn the_rank_that_never_entered_is_named_first() {
        let rec = |entered: Option<u64>, completed: Option<(OpKind, u64)>, at_ms| {
            Some(ProgressRecord {
                entered: entered.map(|s| (OpKind::AllReduce, s)),
                completed,
                at_ms,
            })
        };
        let records = vec![
            rec(Some(2), Some((OpKind::Broadcast, 1)), 9_000),
            rec(Some(1), Some((OpKind::Broadcast, 1)), 1_000),
            rec(Some(2), Some((OpKind::Broadcast, 1)), 9_500),
            rec(None, None, 500),
            None,
        ];
        let b = behind(&records, &[], 2, 2, 11_000);
        assert_eq!(b.iter().map(|b| b.rank).collect::<Vec<_>>(), vec![3, 1]);
        assert_eq!(
            b[1].describe(OpKind::AllReduce, 2),
            "rank 1 has not called all-reduce #2; its last completed call is broadcast #1, 10.0 s ago"
        );
        assert_eq!(
            b[0].describe(OpKind::AllReduce, 2),
            "rank 3 has not called all-reduce #2; it has completed no call, 10.5 s ago"
        );
    }

    #[test]
    fn a_silent_rank_is_named_even_when_it_entered() {
        let session = |key: &str, open, idle_ms| SessionInfo {
            key: key.into(),
            value: Vec::new(),
            open,
            idle: Duration::from_millis(idle_ms),
        };
        let sessions = [
            session("c/rank/0", true, 50),
            session("c/rank/1", true, 9_800),
            session("c/rank/2", false, 300),
            session("c/rank/x", true, 9_000),
            session("c/rank/9", true, 9_000),
            session("c/split0/rank/0", true, 9_000),
        ];
        let silent = silence(&sessions, "c", 3);
        assert_eq!(
            silent,
            [
                None,
                Some(Duration::from_millis(9_800)),
                Some(Duration::from_millis(300))
            ]
        );
        let rec = |s| {
            Some(ProgressRecord {
                entered: Some((OpKind::AllReduce, s)),
                completed: Some((OpKind::AllReduce, s - 1)),
                at_ms: 1_000,
            })
        };
        let b = behind(&[rec(2), rec(2), rec(1)], &silent, 2, 0, 11_000);
        assert_eq!(b.iter().map(|b| b.rank).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!(
            b[1].describe(OpKind::AllReduce, 2),
            "rank 1 is in all-reduce #2 but its process has given no sign of life for 9.8 s \
             (stopped, or stuck outside weftcc)"
        );
        // Nobody silent: the ranks that entered are not named.
        let b = behind(&[rec(2), rec(2), rec(1)], &[None; 3], 2, 0, 11_000);
        assert_eq!(b.iter().map(|b| b.rank).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn a_silent_peer_of_a_point_to_point_exchange_is_described_without_sequence_claims() {
        let b = Behind {
            rank: 1,
            entered: None,
            completed: None,
            idle: Duration::ZERO,
            silent: Some(Duration::from_millis(2500)),
        };
        let text = b.describe(OpKind::SendRecv, 7);
        assert_eq!(
            text,
            "rank 1, awaited here, its process has given no sign of life for 2.5 s (stopped, \
             or stuck outside weftcc)"
        );
        assert!(b
            .describe(OpKind::AllReduce, 7)
            .contains("has not called all-reduce #7"));
    }
}
