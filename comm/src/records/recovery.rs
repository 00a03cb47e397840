//! What recovery leaves in the job's store: the survivors' agreed failed set per epoch, and the
//! places a growing communicator hands to newcomers (a newcomer takes a ticket, the growing
//! communicator's rank 0 writes each ticket's place). Key names and encodings only.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Store key of the decision of agreement `epoch` under a communicator's `namespace`.
pub fn agreement_key(namespace: &str, epoch: u64) -> String {
    format!("{namespace}/agree/{epoch}")
}

/// Job-wide counter of newcomers that asked for a place (each one's value is its ticket).
pub const JOINERS_KEY: &str = "elastic/joiners";
/// Job-wide counter of tickets given a place.
pub const ADMITTED_KEY: &str = "elastic/admitted";

/// What the sessions of newcomers waiting for a place are named under.
pub const JOINER_SESSION_PREFIX: &str = "elastic/joiner/";

/// The store session a newcomer with ticket `ticket` holds while it waits and joins.
pub fn joiner_session_key(ticket: i64) -> String {
    format!("{JOINER_SESSION_PREFIX}{ticket}")
}

/// Store key of ticket `ticket`'s place.
pub fn ticket_key(ticket: i64) -> String {
    format!("elastic/ticket/{ticket}")
}

/// Job-wide counter of recovery events (each one's value numbers its [`event_key`]).
pub const EVENTS_KEY: &str = "elastic/events";

/// Store key of recovery event `n` (from 1), a [`RecoveryEvent`] as JSON.
pub fn event_key(n: i64) -> String {
    format!("elastic/event/{n}")
}

/// How a communicator was made from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryKind {
    /// By shrink: the survivors (or the ranks not excluded).
    Shrink,
    /// By grow: newcomers admitted.
    Grow,
}

/// A communicator made from another by shrink or grow: in the new communicator's flight
/// recorder (with those of its ancestors) and in the job's store (`weft status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryEvent {
    pub kind: RecoveryKind,
    /// The epoch the new communicator starts at.
    pub epoch: u64,
    /// The parent's namespace and size.
    pub from: String,
    pub from_size: usize,
    /// The new communicator's namespace and size.
    pub to: String,
    pub to_size: usize,
    /// Ranks of the parent left out (shrink).
    #[serde(default)]
    pub failed: Vec<usize>,
    /// The parent's error, if it had failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Milliseconds the making took on the rank that recorded it.
    pub took_ms: u64,
    /// When it was made (µs since the UNIX epoch).
    pub at_us: u64,
}

impl RecoveryEvent {
    /// One line for people.
    pub fn describe(&self) -> String {
        let what = match self.kind {
            RecoveryKind::Shrink if self.failed.is_empty() => "shrunk".to_string(),
            RecoveryKind::Shrink => format!("shrunk without ranks {:?}", self.failed),
            RecoveryKind::Grow => format!("grown by {}", self.to_size - self.from_size),
        };
        format!(
            "epoch {}: {} -> {} ranks, {what} ({} -> {}, {} ms){}",
            self.epoch,
            self.from_size,
            self.to_size,
            self.from,
            self.to,
            self.took_ms,
            self.error
                .as_ref()
                .map(|e| format!("; after: {e}"))
                .unwrap_or_default()
        )
    }
}

/// The newest communicator descended from `namespace` through `events` (itself if none).
pub fn current_namespace(namespace: &str, events: &[RecoveryEvent]) -> String {
    let mut current = namespace.to_string();
    while let Some(next) = events.iter().rev().find(|e| e.from == current) {
        current = next.to.clone();
    }
    current
}

/// A set of ranks as the store carries it: decimal, comma-separated, ascending (empty: none).
pub fn encode_ranks(ranks: &BTreeSet<usize>) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads [`encode_ranks`]'s form; `None` for anything else.
pub fn decode_ranks(bytes: &[u8]) -> Option<BTreeSet<usize>> {
    let text = std::str::from_utf8(bytes).ok()?;
    text.split(',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().ok())
        .collect()
}

/// A newcomer's place in a growing communicator: its namespace, size, the newcomer's rank
/// and the epoch the communicator starts at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub namespace: String,
    pub nranks: usize,
    pub rank: usize,
    pub epoch: u64,
}

impl Place {
    const MAGIC: &'static str = "weft-place/1";
    const SEP: char = '\u{1f}';

    pub fn encode(&self) -> String {
        let s = Self::SEP;
        format!(
            "{}{s}{}{s}{}{s}{}{s}{}",
            Self::MAGIC,
            self.nranks,
            self.rank,
            self.epoch,
            self.namespace
        )
    }

    pub fn decode(bytes: &[u8]) -> Option<Place> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut f = text.splitn(5, Self::SEP);
        if f.next()? != Self::MAGIC {
            return None;
        }
        let place = Place {
            nranks: f.next()?.parse().ok()?,
            rank: f.next()?.parse().ok()?,
            epoch: f.next()?.parse().ok()?,
            namespace: f.next()?.to_string(),
        };
        (place.rank < place.nranks && !place.namespace.is_empty()).then_some(place)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn rank_sets_round_trip(ranks in proptest::collection::btree_set(any::<usize>(), 0..20)) {
            prop_assert_eq!(decode_ranks(encode_ranks(&ranks).as_bytes()), Some(ranks));
        }

        #[test]
        fn places_round_trip(ns in "[^\u{1f}]{1,40}", n in 1usize..1 << 20, r in any::<usize>(), epoch in any::<u64>()) {
            let place = Place { namespace: ns, nranks: n, rank: r % n, epoch };
            prop_assert_eq!(Place::decode(place.encode().as_bytes()), Some(place));
        }
    }

    #[test]
    fn the_current_communicator_follows_the_lineage() {
        let event = |from: &str, to: &str| RecoveryEvent {
            kind: RecoveryKind::Shrink,
            epoch: 1,
            from: from.into(),
            from_size: 4,
            to: to.into(),
            to_size: 3,
            failed: vec![2],
            error: None,
            took_ms: 1,
            at_us: 0,
        };
        let events = [
            event("c", "c/s0"),
            event("x", "x/s0"),
            event("c/s0", "c/s0/g0"),
        ];
        assert_eq!(current_namespace("c", &events), "c/s0/g0");
        assert_eq!(current_namespace("x", &events), "x/s0");
        assert_eq!(current_namespace("y", &events), "y");
        let json = serde_json::to_string(&events[0]).unwrap();
        assert_eq!(
            serde_json::from_str::<RecoveryEvent>(&json).unwrap(),
            events[0]
        );
        assert!(events[0].describe().contains("without ranks [2]"));
    }

    #[test]
    fn what_is_not_a_record_reads_as_nothing() {
        assert_eq!(decode_ranks(b"1,x"), None);
        assert_eq!(decode_ranks(b"\xff"), None);
        assert_eq!(decode_ranks(b""), Some(BTreeSet::new()));
        let place = Place {
            namespace: "c/grow0".into(),
            nranks: 4,
            rank: 3,
            epoch: 1,
        };
        let text = place.encode();
        assert_eq!(Place::decode(&text.as_bytes()[..text.len() - 8]), None);
        let out_of_range = text.replacen("\u{1f}3\u{1f}", "\u{1f}4\u{1f}", 1);
        assert_eq!(Place::decode(out_of_range.as_bytes()), None);
    }
}
