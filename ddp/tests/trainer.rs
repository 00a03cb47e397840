//! The reference trainer: accuracy on the synthetic set, MNIST-format files, resume.

mod common;

use std::path::PathBuf;

use common::with_ranks;
use weftcc_ddp::data::write_idx_u8;
use weftcc_ddp::optim::OptimizerKind;
use weftcc_ddp::rng::Rng;
use weftcc_ddp::trainer::DataSource;
use weftcc_ddp::{train, TrainConfig};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-ddp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The stated figure: on the default synthetic set (8192 samples, 32 features, 10 classes;
/// chance 10 %), 2 ranks × batch 32, SGD with momentum, the MLP reaches ≥ 85 % test accuracy
/// within 3 epochs.
#[test]
fn synthetic_set_reaches_85_percent_in_3_epochs() {
    let cfg = TrainConfig {
        epochs: 3,
        warmup: 20,
        ..TrainConfig::default()
    };
    let runs = with_ranks(2, |_, comm| train(&comm, &cfg, &mut |_| {}).unwrap());
    let acc: Vec<f64> = runs[0].epochs.iter().map(|e| e.test_acc).collect();
    eprintln!("test accuracy per epoch: {acc:?}");
    assert!(acc[2] >= 0.85, "accuracy {acc:?}");
    assert_eq!(runs[0].params, runs[1].params, "ranks agree bit for bit");
    // AdamW with warm-up learns as well.
    let cfg = TrainConfig {
        epochs: 3,
        optimizer: OptimizerKind::adamw(),
        lr: 2e-3,
        warmup: 20,
        ..TrainConfig::default()
    };
    let runs = with_ranks(2, |_, comm| train(&comm, &cfg, &mut |_| {}).unwrap());
    let acc = runs[0].epochs[2].test_acc;
    eprintln!("AdamW test accuracy after 3 epochs: {acc}");
    assert!(acc >= 0.85, "AdamW accuracy {acc}");
}

/// Small MNIST-format files written here: 8×8 images of a horizontal or vertical bar, with
/// noise; the trainer loads them with `--data DIR` semantics and learns them.
#[test]
fn trains_on_idx_files() {
    let dir = tmpdir("idx");
    let mut rng = Rng::new(11, 0);
    let mut make = |n: usize, prefix: &str| {
        let mut imgs = Vec::with_capacity(n * 64);
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let class = rng.below(2) as u8;
            let pos = rng.below(8) as usize;
            for r in 0..8 {
                for c in 0..8 {
                    let on = if class == 0 { r == pos } else { c == pos };
                    let noise = rng.below(60) as u8;
                    imgs.push(if on { 255 - noise } else { noise });
                }
            }
            labels.push(class);
        }
        write_idx_u8(
            &dir.join(format!("{prefix}-images-idx3-ubyte")),
            &[n, 8, 8],
            &imgs,
        )
        .unwrap();
        write_idx_u8(
            &dir.join(format!("{prefix}-labels-idx1-ubyte")),
            &[n],
            &labels,
        )
        .unwrap();
    };
    make(1024, "train");
    make(256, "t10k");
    let cfg = TrainConfig {
        data: DataSource::Idx(dir.clone()),
        hidden: vec![32],
        epochs: 3,
        batch: 16,
        lr: 0.05,
        ..TrainConfig::default()
    };
    let runs = with_ranks(2, |_, comm| train(&comm, &cfg, &mut |_| {}).unwrap());
    let acc = runs[0].epochs.last().unwrap().test_acc;
    eprintln!("IDX bars test accuracy: {acc}");
    assert!(acc >= 0.95, "accuracy {acc}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// In-process resume: a run stopped after 30 steps and resumed from its checkpoint ends with
/// parameters bit-identical to an uninterrupted run (bucket layout, optimizer state, sampler
/// position all restored).
#[test]
fn resume_from_checkpoint_is_bit_identical() {
    let dir = tmpdir("resume");
    let base = TrainConfig {
        data: DataSource::Synthetic {
            train: 2048,
            test: 256,
            dim: 16,
            classes: 4,
        },
        hidden: vec![32, 16],
        epochs: 3,
        batch: 16,
        accum: 2,
        optimizer: OptimizerKind::adamw(),
        lr: 1e-3,
        warmup: 5,
        seed: 7,
        reducer: weftcc_ddp::ReducerConfig {
            first_bucket_bytes: 1024,
            bucket_cap_bytes: 4096,
            ..Default::default()
        },
        ..TrainConfig::default()
    };
    let full = with_ranks(2, |_, comm| train(&comm, &base, &mut |_| {}).unwrap());
    // 2048 / (16·2·2) = 32 steps per epoch; stop after 40 (mid epoch 1), checkpoint every 10.
    let first = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        checkpoint_every: 10,
        max_steps: Some(45),
        ..base.clone()
    };
    let part = with_ranks(2, |_, comm| train(&comm, &first, &mut |_| {}).unwrap());
    assert_eq!(part[0].steps, 45);
    let second = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        checkpoint_every: 10,
        resume: true,
        ..base.clone()
    };
    let resumed = with_ranks(2, |_, comm| train(&comm, &second, &mut |_| {}).unwrap());
    assert_eq!(resumed[0].resumed_from, Some(40));
    assert_eq!(resumed[0].steps, full[0].steps);
    for r in 0..2 {
        assert!(
            resumed[r].params == full[r].params,
            "rank {r}: resumed parameters differ from the uninterrupted run"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
