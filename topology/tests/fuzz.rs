//! Fuzzing the topology parsers on stable Rust: proptest mutations (deletions, insertions from
//! each format's own alphabet, truncations, duplicated lines) of every `nvidia-smi topo -m`
//! fixture and of the NCCL XML written from each. Every input must give a topology that
//! validates or a typed error, never a panic; whatever parses must survive the XML round trip
//! unchanged. `WEFT_FUZZ_CASES` sets the cases per target (default 1000); each target prints
//! how many it ran.

mod common;

use common::{fixture, fixtures};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use weftcc_testkit::fuzz::fuzz;
use weftcc_topology::{nvsmi, xml, Topology};

/// One edit of a text.
#[derive(Debug, Clone)]
enum Edit {
    Remove(usize),
    Insert(usize, char),
    Truncate(usize),
    /// Repeats the line that holds this position.
    DuplicateLine(usize),
}

fn edits(alphabet: &'static str) -> impl Strategy<Value = Vec<Edit>> {
    let chars: Vec<char> = alphabet.chars().collect();
    let edit = prop_oneof![
        any::<usize>().prop_map(Edit::Remove),
        (any::<usize>(), proptest::sample::select(chars)).prop_map(|(p, c)| Edit::Insert(p, c)),
        any::<usize>().prop_map(Edit::Truncate),
        any::<usize>().prop_map(Edit::DuplicateLine),
    ];
    proptest::collection::vec(edit, 1..8)
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut s: Vec<char> = text.chars().collect();
    for e in edits {
        if s.is_empty() {
            break;
        }
        match *e {
            Edit::Remove(p) => {
                s.remove(p % s.len());
            }
            Edit::Insert(p, c) => s.insert(p % (s.len() + 1), c),
            Edit::Truncate(p) => s.truncate(p % s.len()),
            Edit::DuplicateLine(p) => {
                let p = p % s.len();
                let start = s[..p].iter().rposition(|&c| c == '\n').map_or(0, |i| i + 1);
                let end = s[p..]
                    .iter()
                    .position(|&c| c == '\n')
                    .map_or(s.len(), |i| p + i + 1);
                let line: Vec<char> = s[start..end].to_vec();
                s.splice(end..end, line);
            }
        }
    }
    s.into_iter().collect()
}

/// A parsed topology is valid and comes back unchanged from the NCCL XML it writes.
fn check_parsed(t: &Topology) -> Result<(), TestCaseError> {
    prop_assert!(
        t.validate().is_ok(),
        "parsed but invalid: {:?}",
        t.validate()
    );
    let written = xml::write(t);
    let back = xml::read(&written).map_err(|e| TestCaseError::fail(format!("{e}\n{written}")))?;
    prop_assert_eq!(xml::write(&back), written);
    Ok(())
}

/// Fuzzes `parse` with edits (from `alphabet`) of the `texts`: whatever parses must be valid
/// and survive the XML round trip, the rest be a typed error. Reports how many parsed.
fn parses_or_fails<E>(
    name: &str,
    texts: &[String],
    alphabet: &'static str,
    parse: impl Fn(&str) -> Result<Topology, E>,
) {
    let parsed = AtomicU64::new(0);
    let ran = fuzz(name, (0..texts.len(), edits(alphabet)), |(i, e)| {
        if let Ok(t) = parse(&apply(&texts[i], &e)) {
            check_parsed(&t)?;
            parsed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    println!(
        "fuzz {name}: {} of {ran} parsed and survived the XML round trip, none panicked",
        parsed.load(Ordering::Relaxed)
    );
}

#[test]
fn nvidia_smi_matrices_parse_or_give_a_typed_error() {
    let texts: Vec<String> = fixtures().iter().map(|f| fixture(f)).collect();
    parses_or_fails(
        "nvidia-smi topo -m",
        &texts,
        "GPUNICX \t\n0123456789NVPIXSYSNODE/A:-,\u{1b}[mCPUAffinity",
        nvsmi::parse,
    );
}

#[test]
fn nccl_xml_reads_or_gives_a_typed_error() {
    let texts: Vec<String> = fixtures()
        .iter()
        .map(|f| xml::write(&nvsmi::parse(&fixture(f)).expect("fixture parses")))
        .collect();
    parses_or_fails(
        "NCCL XML",
        &texts,
        "<>\"/= xabcdefgpunicsystemlinkbusidclass0123456789&;\n",
        xml::read,
    );
}
