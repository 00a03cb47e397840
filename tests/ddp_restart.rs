//! `weft train` under `weft run`: a worker SIGKILLed mid-training is restarted with the others
//! (`--max-restarts 1`), the trainer resumes from its checkpoint, and the final parameters are
//! bit-for-bit those of an uninterrupted run with the same seed.

use std::path::{Path, PathBuf};
use std::process::Command;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-ddp-restart-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `weft run -n 2 [--max-restarts R] -- weft train <common args> <extra>`; returns
/// (exit code, combined output).
fn run_job(restarts: u32, extra: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut all = vec!["--bucket-mb", "0.01", "--first-bucket-mb", "0.004"];
    all.extend_from_slice(extra);
    run_job_on(2, 0, restarts, &all, env)
}

/// `run_job` with `n` ranks, dealt over `hosts` "hosts" (`WEFT_HOST_ID=h<rank mod hosts>`; 0:
/// the machine's own id).
fn run_job_on(
    n: usize,
    hosts: usize,
    restarts: u32,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (i32, String) {
    let mut cmd = Command::new(WEFT);
    cmd.args([
        "run",
        "-n",
        &n.to_string(),
        "--master-port",
        "0",
        "--max-restarts",
    ])
    .arg(restarts.to_string())
    .arg("--");
    if hosts > 0 {
        let script = format!("WEFT_HOST_ID=h$((WEFT_RANK % {hosts})) exec \"$0\" \"$@\"");
        cmd.args(["sh", "-c", &script]);
    }
    cmd.args([WEFT, "train", "--no-progress"])
        .args([
            "--samples",
            "4096",
            "--test-samples",
            "256",
            "--dim",
            "24",
            "--classes",
            "6",
            "--hidden",
            "48,40",
            "--epochs",
            "2",
            "--batch",
            "16",
            "--accum",
            "2",
            "--optimizer",
            "adamw",
            "--lr",
            "0.002",
            "--warmup",
            "10",
            "--seed",
            "42",
        ])
        .args(extra)
        .env("WEFT_TIMEOUT", "60");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("start weft run");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn killed_worker_restarts_and_resumes_bit_identically() {
    let dir = tmpdir("main");
    let reference = dir.join("reference.bin");
    let (code, out) = run_job(0, &["--save-params", reference.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "uninterrupted run failed:\n{out}");
    assert!(out.contains("done after 128 steps"), "{out}");
    let want = read(&reference);
    assert!(!want.is_empty());

    // Kill rank 1 after step 60 (checkpoints at 25 and 50), then rank 0 (the rendezvous host)
    // after step 37 (checkpoint at 25).
    for (victim, step, resumed) in [(1, 60, 50), (0, 37, 25)] {
        let ckpt = dir.join(format!("ckpt-{victim}"));
        let got_path = dir.join(format!("killed-{victim}.bin"));
        let kill = format!("{victim}:{step}");
        let (code, out) = run_job(
            1,
            &[
                "--checkpoint-dir",
                ckpt.to_str().unwrap(),
                "--checkpoint-every",
                "25",
                "--resume",
                "--save-params",
                got_path.to_str().unwrap(),
            ],
            &[("WEFT_TRAIN_KILL_AT", &kill)],
        );
        assert_eq!(code, 0, "killed run did not recover:\n{out}");
        assert!(out.contains("kills itself after step"), "{out}");
        assert!(out.contains("restarting all 2 workers"), "{out}");
        assert!(
            out.contains(&format!("resumed from the checkpoint after step {resumed}")),
            "{out}"
        );
        assert!(out.contains("done after 128 steps"), "{out}");
        let got = read(&got_path);
        assert_eq!(got.len(), want.len());
        assert!(
            got == want,
            "victim {victim}: parameters after kill + restart differ from the uninterrupted run"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `weft train --deterministic` on 3 ranks: WEFT_ALGO ring on one host with 1 MB buckets, tree
/// with 10 KB buckets on three "hosts" (TCP between them), rd with 4 KB buckets on two: the
/// final parameters are byte-identical. Without the flag the first two differ (3 ranks: the
/// order of a sum matters), so the comparison can fail.
#[test]
fn deterministic_training_is_byte_identical_across_algorithms_buckets_and_placements() {
    let dir = tmpdir("deterministic");
    let runs: [(&str, usize, &str, &str, bool); 4] = [
        ("a", 0, "ring", "1", true),
        ("b", 3, "tree", "0.01", true),
        ("c", 2, "rd", "0.004", true),
        ("d", 3, "tree", "0.01", false),
    ];
    let mut params = Vec::new();
    for (name, hosts, algo, bucket, det) in runs {
        let path = dir.join(format!("{name}.bin"));
        let mut extra = vec![
            "--save-params",
            path.to_str().unwrap(),
            "--bucket-mb",
            bucket,
            "--first-bucket-mb",
            bucket,
        ];
        if det {
            extra.push("--deterministic");
        }
        let (code, out) = run_job_on(3, hosts, 0, &extra, &[("WEFT_ALGO", algo)]);
        assert_eq!(code, 0, "run {name} failed:\n{out}");
        params.push(read(&path));
    }
    assert!(!params[0].is_empty());
    assert!(params[0] == params[1], "ring/1 host vs tree/3 hosts differ");
    assert!(params[0] == params[2], "ring/1 host vs rd/2 hosts differ");
    assert!(
        params[3] != params[0],
        "without --deterministic tree on 3 hosts matched the deterministic run: the test could not fail"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
