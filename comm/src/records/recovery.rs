//! What recovery leaves in the job's store: the survivors' agreed failed set per epoch, and the
//! places a growing communicator hands to newcomers (a newcomer takes a ticket, the growing
//! communicator's rank 0 writes each ticket's place). Key names and encodings only.

use std::collections::BTreeSet;

/// Store key of the decision of agreement `epoch` under a communicator's `namespace`.
pub fn agreement_key(namespace: &str, epoch: u64) -> String {
    format!("{namespace}/agree/{epoch}")
}

/// Job-wide counter of newcomers that asked for a place (each one's value is its ticket).
pub const JOINERS_KEY: &str = "elastic/joiners";
/// Job-wide counter of tickets given a place.
pub const ADMITTED_KEY: &str = "elastic/admitted";

/// Store key of ticket `ticket`'s place.
pub fn ticket_key(ticket: i64) -> String {
    format!("elastic/ticket/{ticket}")
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
