//! The `nvidia-smi topo -m` fixtures the topology tests share (tests/fixtures/*.txt).

use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The text of fixture `name`.
pub fn fixture(name: &str) -> String {
    let p = dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every fixture's file name, sorted: a new fixture is tested without being listed anywhere.
pub fn fixtures() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir())
        .expect("tests/fixtures")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".txt"))
        .collect();
    names.sort();
    assert!(names.len() >= 14, "fixtures missing: {names:?}");
    names
}
