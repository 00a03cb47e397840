//! Failure notes: why a communicator failed, as a failing rank tells the others (the store's
//! abort key, the farewell it leaves in its shared-memory rings, `weft status`).

use super::progress::Behind;
use std::time::Duration;
use weftcc_collectives::OpKind;

/// Why a communicator was aborted ([`Error::Aborted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortCause {
    /// `abort()` was called (on this rank, or on rank `by`).
    AbortCalled,
    /// Rank `by` found that ranks called different collectives ([`Error::Mismatch`] there).
    Mismatch,
    /// Rank `by` failed in another way (its error is the `reason`).
    Failed,
    /// `revoke()` was called (on this rank, or on rank `by`): the communicator stays, for
    /// agreement and shrink ([`Error::Revoked`](crate::Error::Revoked)).
    Revoked,
}

/// What a failing rank tells the others (through the store's abort key, and the farewell it
/// leaves in its shared-memory rings): typed fields, encoded as a versioned record of fields
/// separated by U+001F (the unit separator, which no number and no error text of weftcc
/// contains); the text fields are for people and are never parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureNote {
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
    pub fn encode(&self) -> String {
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
                    AbortCause::Revoked => "revoked",
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
    pub fn decode(bytes: &[u8]) -> Option<FailureNote> {
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
            "revoked" => Some(AbortCause::Revoked),
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
    use proptest::prelude::*;

    proptest! {
        /// Every note reads back as itself, whatever its text (separators included).
        #[test]
        fn failure_notes_round_trip(
            origin in any::<usize>(),
            peer in any::<usize>(),
            text in ".*",
            lost in any::<bool>(),
            cause in 0usize..4,
            during in proptest::option::of((0usize..OpKind::ALL.len(), any::<u64>())),
        ) {
            let during = during.map(|(k, s)| (OpKind::ALL[k], s));
            let cause = [
                AbortCause::AbortCalled,
                AbortCause::Mismatch,
                AbortCause::Failed,
                AbortCause::Revoked,
            ][cause];
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
}
