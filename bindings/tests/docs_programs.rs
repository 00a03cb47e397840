//! The documentation's complete C programs (```` ```c program ```` blocks of README.md and
//! docs/) are compiled with the compile line the document gives after them, exactly as
//! written (from the repository's root: `bindings/include`, `target/release`), then run as 1
//! and 2 ranks under a launcher's variables, with no `LD_LIBRARY_PATH`: the documented
//! `-Wl,-rpath` must be what finds `libweft.so`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use weftcc_testkit::docs;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository")
        .to_path_buf()
}

/// The directory holding the libweft.so this test was built with (see tests/c_abi.rs).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().expect("deps directory").to_path_buf()
}

/// The word after `-o` in a compile line.
fn output_of(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    words.find(|w| *w == "-o")?;
    words.next()
}

/// A directory laid out like the repository's root for the compile line: the program's
/// source, `bindings/include` and `target/release` (this build's libweft.so).
fn workspace(name: &str, source_name: &str, source: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("weftcc-docs-c-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bindings")).expect("temp dir");
    std::fs::create_dir_all(dir.join("target")).expect("temp dir");
    std::os::unix::fs::symlink(
        repo().join("bindings/include"),
        dir.join("bindings/include"),
    )
    .expect("link include");
    std::os::unix::fs::symlink(lib_dir(), dir.join("target/release")).expect("link lib");
    std::fs::write(dir.join(source_name), source).expect("write source");
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Runs `exe` as `n` ranks (weft run's variables), bounded; panics with every rank's output
/// when one fails.
fn run_ranks(exe: &Path, n: usize, place: &str) {
    let port = free_port().to_string();
    let token = format!("docs-c-{port}");
    let kids: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(exe)
                .env_remove("LD_LIBRARY_PATH")
                .env("WEFT_RANK", r.to_string())
                .env("WEFT_WORLD_SIZE", n.to_string())
                .env("WEFT_LOCAL_RANK", r.to_string())
                .env("WEFT_LOCAL_WORLD_SIZE", n.to_string())
                .env("WEFT_MASTER_ADDR", "127.0.0.1")
                .env("WEFT_MASTER_PORT", &port)
                .env("WEFT_JOB_TOKEN", &token)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start the program")
        })
        .collect();
    let done = weftcc_testkit::ranks::wait_ranks(
        kids.into_iter().enumerate().collect(),
        Duration::from_secs(60),
    );
    assert!(
        done.failed.is_empty(),
        "{place}: ranks {:?} of {n} failed\n{}",
        done.failed,
        done.report
    );
    println!("{place}: {n} ranks ok");
}

#[test]
fn the_documented_c_programs_compile_as_documented_and_run() {
    let repo = repo();
    let programs = docs::programs(&repo, "c");
    assert!(
        !programs.is_empty(),
        "README.md has a complete C program (```c program)"
    );
    if Command::new("cc").arg("--version").output().is_err() {
        println!("skipped: no C compiler");
        return;
    }
    for (k, program) in programs.iter().enumerate() {
        let place = program.place();
        let line = docs::command_after(&repo, program, "cc ").unwrap_or_else(|| {
            panic!("{place}: no `cc ` line after the program says how to build it")
        });
        let source = line
            .split_whitespace()
            .find(|w| w.ends_with(".c"))
            .unwrap_or_else(|| panic!("{place}: `{line}` names no .c file"));
        let exe = output_of(&line).unwrap_or_else(|| panic!("{place}: `{line}` has no -o"));
        let dir = workspace(&k.to_string(), source, &program.text);
        // As written, plus warnings as errors: a documented program compiles cleanly.
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!("{line} -Wall -Wextra -Werror"))
            .current_dir(&dir)
            .env("PWD", &dir)
            .status()
            .expect("sh");
        assert!(status.success(), "{place}: `{line}` failed");
        for n in [1, 2] {
            run_ranks(&dir.join(exe), n, &place);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_output_of_a_compile_line() {
    assert_eq!(output_of("cc a.c -lweft -o prog"), Some("prog"));
    assert_eq!(output_of("cc a.c"), None);
}
