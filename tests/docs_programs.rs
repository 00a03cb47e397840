//! The documentation's complete Rust programs (```` ```rust program ```` blocks of README.md
//! and docs/) are examples of this crate: each block must equal an `examples/*.rs` file (less
//! its leading `//!` lines), which cargo builds with the tests, and that example is run on 2
//! ranks under `weft run`.

use std::path::{Path, PathBuf};
use std::process::Command;

use weftcc_testkit::docs;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// An example's text as the documentation shows it: without its leading `//!` lines.
fn shown(source: &str) -> String {
    source
        .lines()
        .skip_while(|l| l.starts_with("//!"))
        .skip_while(|l| l.is_empty())
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The example whose shown text is `text`.
fn example_of(repo: &Path, text: &str) -> Option<PathBuf> {
    let mut examples: Vec<PathBuf> = std::fs::read_dir(repo.join("examples"))
        .expect("examples/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    examples.sort();
    examples
        .into_iter()
        .find(|p| std::fs::read_to_string(p).is_ok_and(|s| shown(&s) == text))
}

#[test]
fn the_documented_rust_programs_are_examples_and_run() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let programs = docs::programs(repo, "rust");
    assert!(
        !programs.is_empty(),
        "README.md has a complete Rust program (```rust program)"
    );
    let built = Path::new(WEFT)
        .parent()
        .expect("target dir")
        .join("examples");
    for program in &programs {
        let place = program.place();
        let source = example_of(repo, &program.text).unwrap_or_else(|| {
            panic!("{place}: no file in examples/ is this program (less its //! lines)")
        });
        let name = source
            .file_stem()
            .expect("name")
            .to_string_lossy()
            .to_string();
        let exe = built.join(&name);
        let fresh = |exe: &Path| {
            let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            matches!((modified(exe), modified(&source)), (Some(b), Some(s)) if b >= s)
        };
        if !fresh(&exe) {
            // `cargo test --test docs_programs` alone builds no example: build this one.
            let profile = built.parent().and_then(|d| d.file_name());
            let release = profile
                .is_some_and(|p| p == "release")
                .then_some("--release");
            let status = Command::new(env!("CARGO"))
                .arg("build")
                .args(release)
                .args(["--example", &name])
                .current_dir(repo)
                .status()
                .expect("cargo");
            assert!(
                status.success(),
                "{place}: examples/{name}.rs does not build"
            );
        }
        assert!(
            fresh(&exe),
            "{place}: {} is missing or older than {}: `cargo test` builds the examples \
             (with --test alone: cargo build --release --examples first)",
            exe.display(),
            source.display()
        );
        let out = Command::new(WEFT)
            .args(["run", "-n", "2", "--"])
            .arg(&exe)
            .env_remove("WEFT_JOB_TOKEN")
            .output()
            .expect("weft run");
        assert!(
            out.status.success(),
            "{place} ({name}) failed on 2 ranks:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{place}: examples/{name}.rs on 2 ranks ok");
    }
}

#[test]
fn an_example_is_shown_without_its_module_doc() {
    assert_eq!(
        shown("//! a\n//! b\n\nuse x;\nfn main() {}\n"),
        "use x;\nfn main() {}\n"
    );
}
