//! Runs N ranks as threads of this process, each with its own communicator.
#![allow(dead_code)]

use std::time::Duration;
use weftcc_comm::{CommConfig, Communicator};

pub fn config() -> CommConfig {
    let mut c = CommConfig::from_env().expect("config from env");
    c.timeout = Duration::from_secs(60);
    c.host_id = "ddp-test-host".into();
    c
}

pub fn with_ranks<R: Send>(n: usize, body: impl Fn(usize, Communicator) -> R + Sync) -> Vec<R> {
    with_ranks_config(n, config(), body)
}

pub fn with_ranks_config<R: Send>(
    n: usize,
    cfg: CommConfig,
    body: impl Fn(usize, Communicator) -> R + Sync,
) -> Vec<R> {
    weftcc_comm::run_ranks(n, |_| cfg.clone(), body).expect("ranks")
}

/// Largest |a - b| / max |b| over the elements of each tensor, maximised over tensors.
pub fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        let scale = y
            .iter()
            .fold(0.0f64, |m, &v| m.max(v.abs() as f64))
            .max(1e-12);
        let d = x
            .iter()
            .zip(y)
            .fold(0.0f64, |m, (&p, &q)| m.max((p as f64 - q as f64).abs()));
        worst = worst.max(d / scale);
    }
    worst
}
