//! The reducer across ranks (threads of this process): equivalence to single-process training
//! on the global batch, bucket rebuild, compression hooks, errors instead of hangs.

mod common;

use std::time::{Duration, Instant};

use common::{max_rel_diff, with_ranks, with_ranks_config};
use weftcc_ddp::optim::OptimizerKind;
use weftcc_ddp::trainer::DataSource;
use weftcc_ddp::{train, CommHook, Reducer, ReducerConfig, ReducerError, TrainConfig};

fn small_cfg() -> TrainConfig {
    TrainConfig {
        data: DataSource::Synthetic {
            train: 2048,
            test: 256,
            dim: 16,
            classes: 4,
        },
        hidden: vec![24, 20],
        epochs: 1,
        batch: 8,
        lr: 0.05,
        max_steps: Some(12),
        seed: 3,
        ..TrainConfig::default()
    }
}

fn buckets(first: usize, cap: usize) -> ReducerConfig {
    ReducerConfig {
        bucket_cap_bytes: cap,
        first_bucket_bytes: first,
        ..ReducerConfig::default()
    }
}

/// N ranks with per-rank batch B train to the same parameters as one process with batch N·B,
/// for several bucket sizes, with and without no_sync accumulation and an unused parameter.
#[test]
fn n_rank_training_matches_single_process_on_the_global_batch() {
    let layouts = [
        ("tiny buckets (one parameter each)", buckets(64, 64)),
        ("2 KiB buckets", buckets(512, 2048)),
        ("default 1 MiB / 25 MiB", ReducerConfig::default()),
    ];
    let cases: &[(usize, usize, bool, OptimizerKind)] = &[
        // (ranks, accum, unused parameter, optimizer)
        (1, 1, false, OptimizerKind::sgd()),
        (2, 1, false, OptimizerKind::sgd()),
        (2, 3, true, OptimizerKind::adamw()),
        (4, 1, true, OptimizerKind::sgd()),
        (4, 2, false, OptimizerKind::adamw()),
    ];
    for (n, accum, unused, opt) in cases.iter().copied() {
        for (name, rc) in layouts.iter() {
            let mut cfg = small_cfg();
            cfg.accum = accum;
            cfg.unused_param = unused;
            cfg.optimizer = opt;
            cfg.reducer = rc.clone();
            let mut reference_cfg = cfg.clone();
            reference_cfg.batch = cfg.batch * n;
            let reference = with_ranks(1, |_, comm| train(&comm, &reference_cfg, &mut |_| {}))
                .pop()
                .unwrap()
                .expect("reference run");
            let runs = with_ranks(n, |_, comm| train(&comm, &cfg, &mut |_| {}));
            for (r, run) in runs.into_iter().enumerate() {
                let run = run.unwrap_or_else(|e| panic!("rank {r} failed: {e}"));
                assert_eq!(run.steps, reference.steps);
                let d = max_rel_diff(&run.params, &reference.params);
                eprintln!(
                    "n={n} accum={accum} unused={unused} {name}: rank {r} max rel diff {d:.2e}"
                );
                assert!(
                    d <= 1e-5,
                    "n={n} accum={accum} unused={unused} {name}: rank {r} differs by {d:e}"
                );
                if unused {
                    // The unused parameter never moved (SGD) or only decayed (AdamW).
                    let last = run.params.len() - 1;
                    assert_eq!(run.params[last], reference.params[last]);
                }
            }
        }
    }
}

/// Ranks produce gradients in different orders; after the first iteration every rank has the
/// same layout (rank 0's observed order), and the averages stay right before and after.
#[test]
fn buckets_are_rebuilt_identically_on_every_rank() {
    let sizes = [6usize, 5, 4, 3, 2, 1];
    let results = with_ranks(3, |rank, comm| {
        let cfg = buckets(12, 24);
        let mut red = Reducer::new(&comm, &sizes, cfg).unwrap();
        let initial = red.buckets();
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.rotate_left(rank * 2); // rank 0: 0,1,2,3,4,5
        let mut grads_after = Vec::new();
        for iter in 0..2 {
            red.zero_grad().unwrap();
            red.prepare_for_backward(true).unwrap();
            for &p in &order {
                for (i, g) in red.grad_mut(p).unwrap().iter_mut().enumerate() {
                    *g = (rank * 100 + p * 10 + i + iter) as f32;
                }
                red.grad_ready(p).unwrap();
            }
            red.finish().unwrap();
            let g: Vec<Vec<f32>> = (0..sizes.len())
                .map(|p| red.grad(p).unwrap().to_vec())
                .collect();
            grads_after.push(g);
        }
        (initial, red.buckets(), red.bucket_order(), grads_after)
    });
    let (init0, b0, o0, _) = &results[0];
    // initial layout: reverse registration order, never split
    assert_eq!(
        init0.iter().flatten().copied().collect::<Vec<_>>(),
        vec![5, 4, 3, 2, 1, 0]
    );
    assert_eq!(
        o0,
        &vec![0, 1, 2, 3, 4, 5],
        "rebuilt in rank 0's ready order"
    );
    for (r, (_, b, o, grads)) in results.iter().enumerate() {
        assert_eq!(b, b0, "rank {r} layout");
        assert_eq!(o, o0);
        for (iter, g) in grads.iter().enumerate() {
            for (p, gp) in g.iter().enumerate() {
                for (i, &v) in gp.iter().enumerate() {
                    // mean over ranks of rank*100 + p*10 + i + iter
                    let want = 100.0 + (p * 10 + i + iter) as f32;
                    assert_eq!(v, want, "rank {r} iter {iter} param {p}[{i}]");
                }
            }
        }
    }
}

/// no_sync passes accumulate locally; the synchronised pass averages the sums. A parameter
/// that gets no gradient on some rank does not hang the step.
#[test]
fn no_sync_accumulates_and_unused_parameters_do_not_hang() {
    let sizes = [3usize, 2, 4];
    let results = with_ranks(2, |rank, comm| {
        let mut red = Reducer::new(&comm, &sizes, buckets(8, 8)).unwrap();
        red.zero_grad().unwrap();
        for (pass, sync) in [false, false, true].into_iter().enumerate() {
            red.prepare_for_backward(sync).unwrap();
            for p in 0..sizes.len() {
                // rank 1 never produces parameter 1's gradient
                if rank == 1 && p == 1 {
                    continue;
                }
                red.grad_mut(p)
                    .unwrap()
                    .iter_mut()
                    .for_each(|g| *g += (pass + 1 + rank) as f32);
                red.grad_ready(p).unwrap();
            }
            red.finish().unwrap();
        }
        (0..sizes.len())
            .map(|p| red.grad(p).unwrap().to_vec())
            .collect::<Vec<_>>()
    });
    // rank 0 accumulates 1+2+3 = 6, rank 1 accumulates 2+3+4 = 9; parameter 1: (6 + 0) / 2
    for g in &results {
        assert_eq!(g[0], vec![7.5; 3]);
        assert_eq!(g[1], vec![3.0; 2]);
        assert_eq!(g[2], vec![7.5; 4]);
    }
}

#[test]
fn compression_hooks_match_the_plain_average_closely() {
    for hook in [CommHook::Bf16Compress, CommHook::Fp16Compress] {
        let sizes = [1000usize, 10];
        let results = with_ranks(2, |rank, comm| {
            let cfg = ReducerConfig {
                hook,
                ..buckets(1024, 1024)
            };
            let mut red = Reducer::new(&comm, &sizes, cfg).unwrap();
            red.zero_grad().unwrap();
            red.prepare_for_backward(true).unwrap();
            for p in [1, 0] {
                for (i, g) in red.grad_mut(p).unwrap().iter_mut().enumerate() {
                    *g = ((i as f32 * 0.37 + rank as f32).sin()) * 3.0;
                }
                red.grad_ready(p).unwrap();
            }
            red.finish().unwrap();
            red.grad(0).unwrap().to_vec()
        });
        for g in &results {
            for (i, &v) in g.iter().enumerate() {
                let want = (((i as f32 * 0.37).sin() + (i as f32 * 0.37 + 1.0).sin()) * 3.0) / 2.0;
                assert!(
                    (v - want).abs() <= 0.02 + 0.01 * want.abs(),
                    "{hook:?} [{i}] {v} vs {want}"
                );
            }
        }
        assert_eq!(
            results[0], results[1],
            "{hook:?}: every rank gets the same result"
        );
    }
}

/// A peer that aborts, or dies, turns into an error of the step on the others, quickly.
#[test]
fn communication_failures_are_errors_not_hangs() {
    let sizes = [100usize, 100];
    let mut cfg = common::config();
    cfg.timeout = Duration::from_secs(20);
    let t0 = Instant::now();
    let results = with_ranks_config(2, cfg.clone(), |rank, comm| {
        let mut red = Reducer::new(&comm, &sizes, buckets(256, 256)).unwrap();
        if rank == 1 {
            comm.abort();
            return None;
        }
        red.zero_grad().unwrap();
        red.prepare_for_backward(true).unwrap();
        for p in [1, 0] {
            red.grad_ready(p).unwrap_or(());
        }
        let e = red.finish().err();
        // The reducer stays broken, never hangs.
        let later = red.prepare_for_backward(true).err();
        Some((e, later))
    });
    let (e, later) = results[0].as_ref().unwrap();
    assert!(matches!(e, Some(ReducerError::Comm(_))), "{e:?}");
    assert!(later.is_some());
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );

    // A peer that goes away (its communicator dropped) mid-training.
    let t0 = Instant::now();
    let results = with_ranks_config(2, cfg.clone(), |rank, comm| {
        let mut red = Reducer::new(&comm, &sizes, buckets(256, 256)).unwrap();
        let mut out = Ok(());
        for step in 0..50 {
            if rank == 1 && step == 3 {
                drop(red);
                drop(comm);
                return Ok(());
            }
            out = (|| {
                red.zero_grad()?;
                red.prepare_for_backward(true)?;
                for p in [1, 0] {
                    red.grad_mut(p)?.fill(1.0);
                    red.grad_ready(p)?;
                }
                red.finish().map(|_| ())
            })();
            if out.is_err() {
                break;
            }
        }
        out
    });
    assert!(
        matches!(results[0], Err(ReducerError::Comm(_))),
        "{:?}",
        results[0]
    );
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );

    // Ranks registering different parameters: a typed mismatch on every rank.
    let results = with_ranks_config(2, cfg, |rank, comm| {
        let sizes: &[usize] = if rank == 0 { &[4, 4] } else { &[4, 5] };
        Reducer::new(&comm, sizes, ReducerConfig::default()).err()
    });
    for e in &results {
        assert!(matches!(e, Some(ReducerError::Mismatch(_))), "{e:?}");
    }
}

#[test]
fn misuse_is_a_typed_error() {
    with_ranks(1, |_, comm| {
        assert!(matches!(
            Reducer::new(&comm, &[], ReducerConfig::default()),
            Err(ReducerError::InvalidArgument(_))
        ));
        let mut red = Reducer::new(&comm, &[3, 3], buckets(12, 12)).unwrap();
        assert!(matches!(red.grad_ready(0), Err(ReducerError::State(_))));
        assert!(matches!(
            red.grad(7),
            Err(ReducerError::UnknownParam { .. })
        ));
        red.prepare_for_backward(true).unwrap();
        assert!(matches!(
            red.prepare_for_backward(true),
            Err(ReducerError::State(_))
        ));
        red.grad_ready(1).unwrap();
        assert!(matches!(
            red.grad_ready(1),
            Err(ReducerError::AlreadyReady { .. })
        ));
        red.finish().unwrap();
        assert!(matches!(red.finish(), Err(ReducerError::State(_))));
        assert!(red.set_bucket_order(&[0, 0]).is_err());
    });
}

/// A reducer that must be deterministic refuses a communicator without the mode, and runs on
/// one with it.
#[test]
fn deterministic_reducer_needs_a_deterministic_communicator() {
    let want = ReducerConfig {
        deterministic: true,
        ..buckets(1024, 1024)
    };
    let mut cfg = common::config();
    cfg.deterministic = false;
    let refused = with_ranks_config(2, cfg.clone(), |_, comm| {
        matches!(
            Reducer::new(&comm, &[100], want.clone()),
            Err(ReducerError::InvalidArgument(_))
        )
    });
    assert_eq!(refused, [true, true]);
    cfg.deterministic = true;
    let accepted = with_ranks_config(2, cfg, |_, comm| {
        Reducer::new(&comm, &[100], want.clone()).is_ok()
    });
    assert_eq!(accepted, [true, true]);
}
