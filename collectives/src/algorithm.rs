//! The algorithms a collective can run, by the names `WEFT_ALGO` and `weft topo` use.

use std::fmt;
use std::str::FromStr;

use crate::UnknownName;

/// An algorithm: which family of schedules a call runs ([`crate::schedule::select`] maps it to
/// the schedule of each collective).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// Ring (all-reduce = reduce-scatter + all-gather, all-gather, reduce-scatter) or pipelined
    /// chain (broadcast, reduce).
    Ring,
    /// Double binary tree (all-reduce) or pipelined binary tree (broadcast, reduce).
    Tree,
    /// Recursive doubling (all-reduce; all-gather on a power-of-two number of ranks), or its
    /// mirror recursive halving (reduce-scatter on a power-of-two number of ranks).
    Rd,
    /// Hierarchical all-reduce across hosts: reduce-scatter inside each host, all-reduce of each
    /// shard across hosts, all-gather inside each host.
    Hier,
    /// Deterministic mode's reductions: every element folded in rank order
    /// ([`crate::schedule::ordered`]). Not one of the tuner's choices ([`Algorithm::ALL`]) nor a
    /// `WEFT_ALGO` value: `WEFT_DETERMINISTIC=1` selects it for floating-point reductions.
    Ordered,
    /// Small collectives among ranks that all share memory: each rank posts its contribution
    /// once and reads the others' in place (no schedule; the runtime's `one_shot`). Reductions
    /// fold in rank order, as `Ordered` does. Not a tuner choice nor a `WEFT_ALGO` value:
    /// `WEFT_SHM_ONESHOT_MAX` bounds it, and any `WEFT_ALGO` turns it off.
    OneShot,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 4] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::Rd,
        Algorithm::Hier,
    ];

    /// Lower-case name, as in `WEFT_ALGO`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Rd => "rd",
            Algorithm::Hier => "hier",
            Algorithm::Ordered => "ordered",
            Algorithm::OneShot => "one_shot",
        }
    }
}

impl FromStr for Algorithm {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        let k = s.trim().to_ascii_lowercase().replace('-', "_");
        let k = match k.as_str() {
            "recursive_doubling" => "rd",
            "hierarchical" => "hier",
            other => other,
        };
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == k)
            .ok_or_else(|| UnknownName::new("algorithm", s, "ring, tree, rd, hier"))
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_aliases_parse() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>(), Ok(a));
        }
        assert_eq!("Recursive-Doubling".parse(), Ok(Algorithm::Rd));
        assert_eq!("hierarchical".parse(), Ok(Algorithm::Hier));
        assert_eq!(
            "nvls".parse::<Algorithm>().unwrap_err().to_string(),
            "unknown algorithm \"nvls\" (ring, tree, rd, hier)"
        );
    }
}
