//! The error of a name that does not parse as one of an enumeration's (a data type, reduction or
//! algorithm here, the tuner's protocols in `weftcc-topology`).

/// A name that is none of a kind's: which kind, the name given, and the names expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {name:?} ({expected})")]
pub struct UnknownName {
    pub kind: &'static str,
    pub name: String,
    pub expected: &'static str,
}

impl UnknownName {
    pub fn new(kind: &'static str, name: &str, expected: &'static str) -> UnknownName {
        UnknownName {
            kind,
            name: name.to_string(),
            expected,
        }
    }
}
