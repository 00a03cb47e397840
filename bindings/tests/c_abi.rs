//! The C ABI as C programs use it: `tests/c/ranks.c` is compiled against `include/weftcc.h`
//! and linked with `libweft.so`, then run as 1, 2, 3 and 4 rank processes. Rank 0 makes the
//! unique id and prints it; the test hands it to the other ranks on their command line (the
//! "share it by your own means" step of NCCL programs).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use weftcc_testkit::ranks::{wait_ranks, Finished};

/// The directory holding the libweft.so this test was built with: cargo writes the library
/// beside the test binary (`deps/`); the copy one level up is only refreshed by `cargo build`.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().expect("deps directory").to_path_buf()
}

/// Compiles the C test program, or None (after saying why) when there is no C compiler.
fn build() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let libs = lib_dir();
    let lib = libs.join("libweft.so");
    assert!(
        lib.exists(),
        "{} missing (cargo builds it with this test)",
        lib.display()
    );
    let out = std::env::temp_dir().join(format!("weftcc-c-abi-{}", std::process::id()));
    let status = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
        .arg(dir.join("include"))
        .arg("-I")
        .arg(dir.join("../testkit/c"))
        .arg(dir.join("tests/c/ranks.c"))
        .arg("-o")
        .arg(&out)
        .arg("-L")
        .arg(&libs)
        .arg(format!("-Wl,-rpath,{}", libs.display()))
        .arg("-lweft")
        .status();
    match status {
        Ok(s) => {
            assert!(s.success(), "the C test program does not compile or link");
            Some(out)
        }
        Err(e) => {
            println!("skipped: no C compiler ({e})");
            None
        }
    }
}

fn wait(kids: Vec<(usize, Child)>, n: usize) {
    let Finished { failed, report } = wait_ranks(kids, Duration::from_secs(120));
    assert!(
        failed.is_empty(),
        "{n} ranks: ranks {failed:?} failed\n{report}"
    );
}

/// A rank process that loads the library of this build: cargo's LD_LIBRARY_PATH lists
/// `target/<profile>` (where `cargo build` leaves a possibly older copy) before the program's
/// own run path, so it is replaced.
fn rank_command(exe: &Path) -> Command {
    let mut c = Command::new(exe);
    c.env("LD_LIBRARY_PATH", lib_dir())
        .env("WEFT_TIMEOUT", "60");
    c
}

fn run(exe: &Path, n: usize) {
    let mut root = rank_command(exe)
        .arg("id")
        .env("NRANKS", n.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rank 0");
    let mut line = String::new();
    BufReader::new(root.stdout.take().expect("rank 0 stdout"))
        .read_line(&mut line)
        .expect("rank 0 prints the unique id");
    let id = line.trim().to_string();
    assert!(id.starts_with("weft1@"), "rank 0 printed {id:?}");
    let mut kids = vec![(0, root)];
    for r in 1..n {
        let kid = rank_command(exe)
            .args([r.to_string(), n.to_string(), id.clone()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a rank");
        kids.push((r, kid));
    }
    wait(kids, n);
}

/// Three ranks started the way `torchrun` would: `weftCommInitFromEnv` reads `RANK`,
/// `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (rank 0 serves the rendezvous).
fn run_from_env(exe: &Path) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let n = 3;
    let kids = (0..n)
        .map(|r| {
            let kid = rank_command(exe)
                .arg("env")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank");
            (r, kid)
        })
        .collect();
    wait(kids, n);
}

#[test]
fn header_compiles_as_cpp() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new("c++")
        .args([
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-I",
        ])
        .arg(dir.join("include"))
        .arg(dir.join("tests/c/header_check.cpp"))
        .status();
    match status {
        Ok(s) => assert!(s.success(), "include/weftcc.h does not compile as C++"),
        Err(e) => println!("skipped: no C++ compiler ({e})"),
    }
}

#[test]
fn c_programs_run_every_collective_on_1_to_4_ranks() {
    let Some(exe) = build() else { return };
    for n in 1..=4 {
        run(&exe, n);
    }
    run_from_env(&exe);
    let _ = std::fs::remove_file(exe);
}
