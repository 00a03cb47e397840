//! The `nvidia-smi topo -m` fixtures the topology tests share (tests/fixtures/*.txt), and
//! generated matrices for hosts larger than any fixture.
#![allow(dead_code)]

use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Where fixture `name` lies.
pub fn fixture_path(name: &str) -> PathBuf {
    dir().join(name)
}

/// The text of fixture `name`.
pub fn fixture(name: &str) -> String {
    let p = fixture_path(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Fixture `name`, parsed.
pub fn topology(name: &str) -> weftcc_topology::Topology {
    weftcc_topology::nvsmi::parse(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
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

/// `nvidia-smi topo -m` text for `n` GPUs, the cell of GPU `i` and GPU `j` being `link(i, j)`
/// (`X` on the diagonal).
pub fn gpu_matrix(n: usize, link: impl Fn(usize, usize) -> &'static str) -> String {
    let mut text: String = (0..n).map(|i| format!("\tGPU{i}")).collect();
    for i in 0..n {
        text += &format!("\nGPU{i}");
        for j in 0..n {
            text.push('\t');
            text += if i == j { "X" } else { link(i, j) };
        }
    }
    text + "\n"
}
