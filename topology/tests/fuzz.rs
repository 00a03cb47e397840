//! Fuzzing the topology parsers on stable Rust: proptest mutations (deletions, insertions from
//! each format's own alphabet, truncations, duplicated lines) of every `nvidia-smi topo -m`
//! fixture and of the NCCL XML written from each. Every input must give a topology that
//! validates or a typed error, never a panic; whatever parses must survive the XML round trip
//! unchanged. `WEFT_FUZZ_CASES` sets the cases per target (default 1000); each target prints
//! how many it ran.

mod common;

use common::{fixture, fixtures};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::sync::atomic::{AtomicU64, Ordering};
use weftcc_topology::{nvsmi, xml, Topology};

fn cases() -> u32 {
    std::env::var("WEFT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

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

/// Runs `test` (whether the input parsed, or the failure) on `cases()` values of `strategy`.
fn run<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<bool, TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let n = cases();
    let mut runner = TestRunner::new(Config {
        cases: n,
        failure_persistence: None,
        ..Config::default()
    });
    let ran = AtomicU64::new(0);
    let parsed = AtomicU64::new(0);
    let result = runner.run(&strategy, |v| {
        ran.fetch_add(1, Ordering::Relaxed);
        test(v)
            .inspect(|&was_parsed| {
                if was_parsed {
                    parsed.fetch_add(1, Ordering::Relaxed);
                }
            })
            .map(|_| ())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!(
        "fuzz {name}: {} cases run, {} parsed and survived the XML round trip, none panicked",
        ran.load(Ordering::Relaxed),
        parsed.load(Ordering::Relaxed)
    );
}

#[test]
fn nvidia_smi_matrices_parse_or_give_a_typed_error() {
    let texts: Vec<String> = fixtures().iter().map(|f| fixture(f)).collect();
    let n = texts.len();
    run(
        "nvidia-smi topo -m",
        (
            0..n,
            edits("GPUNICX \t\n0123456789NVPIXSYSNODE/A:-,\u{1b}[mCPUAffinity"),
        ),
        |(i, e)| match nvsmi::parse(&apply(&texts[i], &e)) {
            Ok(t) => check_parsed(&t).map(|()| true),
            Err(_) => Ok(false),
        },
    );
}

#[test]
fn nccl_xml_reads_or_gives_a_typed_error() {
    let texts: Vec<String> = fixtures()
        .iter()
        .map(|f| xml::write(&nvsmi::parse(&fixture(f)).expect("fixture parses")))
        .collect();
    let n = texts.len();
    run(
        "NCCL XML",
        (
            0..n,
            edits("<>\"/= xabcdefgpunicsystemlinkbusidclass0123456789&;\n"),
        ),
        |(i, e)| match xml::read(&apply(&texts[i], &e)) {
            Ok(t) => check_parsed(&t).map(|()| true),
            Err(_) => Ok(false),
        },
    );
}
