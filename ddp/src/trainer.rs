//! The reference trainer: an MLP trained data-parallel through the [`Reducer`], with a
//! distributed sampler, SGD or AdamW with warm-up, per-epoch logs, a progress bar on rank 0,
//! and atomic checkpoints with resume. `weft train` is a thin command-line wrapper over
//! [`train`]; tests call it in-process with one thread per rank.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use thiserror::Error;
use weftcc_collectives::ReduceOp;
use weftcc_comm::Communicator;

use crate::checkpoint::{self, Checkpoint, CheckpointError, Meta};
use crate::data::{self, DataError, Dataset, DistributedSampler};
use crate::model::{self, MlpShape};
use crate::optim::{warmup_lr, Optimizer, OptimizerKind};
use crate::reducer::{Reducer, ReducerConfig, ReducerError};
use crate::rng::Rng;

/// Where the data comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// [`data::synthetic`] with these sizes (training and test split from the run's seed).
    Synthetic {
        train: usize,
        test: usize,
        dim: usize,
        classes: usize,
    },
    /// MNIST-format IDX files in a directory ([`data::load_idx_dir`]).
    Idx(PathBuf),
}

/// Settings of a training run.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub data: DataSource,
    /// Hidden layer widths (depth = len + 1 linear layers).
    pub hidden: Vec<usize>,
    /// Register one parameter that never gets a gradient.
    pub unused_param: bool,
    pub epochs: u64,
    /// Samples per rank per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step; all but the last run under `no_sync`.
    pub accum: usize,
    pub optimizer: OptimizerKind,
    pub lr: f32,
    /// Linear learning-rate warm-up, in optimizer steps.
    pub warmup: u64,
    pub seed: u64,
    pub reducer: ReducerConfig,
    /// Where rank 0 writes checkpoints (none: no checkpoints).
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many optimizer steps (0: never).
    pub checkpoint_every: u64,
    /// How many checkpoints to keep.
    pub keep: usize,
    /// Continue from the newest checkpoint in `checkpoint_dir`, if there is one.
    pub resume: bool,
    /// Progress bar on rank 0 (shown only on a terminal).
    pub progress: bool,
    /// Per-epoch log lines on rank 0 (stdout).
    pub log: bool,
    /// Stop after this many optimizer steps in total (benchmarks).
    pub max_steps: Option<u64>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: DataSource::Synthetic {
                train: 8192,
                test: 2048,
                dim: 32,
                classes: 10,
            },
            hidden: vec![64, 64],
            unused_param: false,
            epochs: 5,
            batch: 32,
            accum: 1,
            optimizer: OptimizerKind::sgd(),
            lr: 0.05,
            warmup: 0,
            seed: 1,
            reducer: ReducerConfig::default(),
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep: 2,
            resume: false,
            progress: false,
            log: false,
            max_steps: None,
        }
    }
}

/// Errors of a training run.
#[derive(Debug, Error)]
pub enum TrainError {
    #[error(transparent)]
    Reducer(#[from] ReducerError),
    #[error("communication failed: {0}")]
    Comm(#[from] weftcc_comm::Error),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// What one epoch did (averaged over the steps this process ran in it).
#[derive(Debug, Clone, Default)]
pub struct EpochStats {
    pub epoch: u64,
    pub steps: u64,
    /// Mean training loss and accuracy over all ranks' samples.
    pub train_loss: f64,
    pub train_acc: f64,
    /// On the test split (or the training set when there is none).
    pub test_loss: f64,
    pub test_acc: f64,
    /// Mean wall time of an optimizer step.
    pub step_time: Duration,
    /// Mean time the communicator was busy per step.
    pub comm_time: Duration,
    /// Mean time per step spent waiting for communication after backward.
    pub exposed_comm: Duration,
    /// Fraction of communication hidden behind backward.
    pub hidden_fraction: f64,
    pub buckets: usize,
}

/// The result of [`train`].
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub params: Vec<Vec<f32>>,
    pub epochs: Vec<EpochStats>,
    /// Optimizer steps completed in total (including those before a resume).
    pub steps: u64,
    /// Step this run resumed from, if it did.
    pub resumed_from: Option<u64>,
    /// Bucket layout at the end (parameter indices per bucket).
    pub buckets: Vec<Vec<usize>>,
}

fn load_data(cfg: &TrainConfig) -> Result<(Dataset, Dataset), TrainError> {
    match &cfg.data {
        DataSource::Synthetic {
            train,
            test,
            dim,
            classes,
        } => {
            if *dim == 0 || *classes < 2 {
                return Err(TrainError::Config(
                    "synthetic data needs dim ≥ 1 and classes ≥ 2".into(),
                ));
            }
            Ok((
                data::synthetic(*train, *dim, *classes, cfg.seed, 0),
                data::synthetic(*test, *dim, *classes, cfg.seed, 1),
            ))
        }
        DataSource::Idx(dir) => {
            let (train, test) = data::load_idx_dir(dir)?;
            let test = test.unwrap_or_else(|| train.clone());
            Ok((train, test))
        }
    }
}

/// Trains on `comm`'s ranks (every rank calls this with the same `cfg`). `on_step` is called
/// after every optimizer step (and checkpoint) with the number of steps completed.
pub fn train(
    comm: &Communicator,
    cfg: &TrainConfig,
    on_step: &mut dyn FnMut(u64),
) -> Result<TrainReport, TrainError> {
    if cfg.batch == 0 || cfg.accum == 0 {
        return Err(TrainError::Config("batch and accum must be ≥ 1".into()));
    }
    let (rank, world) = (comm.rank(), comm.size());
    let (train_set, test_set) = load_data(cfg)?;
    let shape = MlpShape {
        input: train_set.dim,
        hidden: cfg.hidden.clone(),
        classes: train_set.classes,
        unused_param: cfg.unused_param,
    };
    let sizes = shape.param_sizes();
    let mut reducer = Reducer::new(comm, &sizes, cfg.reducer.clone())?;
    // Each rank initialises differently; the broadcast from rank 0 makes them equal.
    let mut rng = Rng::new(cfg.seed, 0xa11 + rank as u64);
    let mut params = shape.init(&mut rng);
    let mut opt = Optimizer::new(cfg.optimizer, &sizes);
    let mut sampler =
        DistributedSampler::new(train_set.len(), world, rank, cfg.batch, cfg.accum, cfg.seed);
    let steps_per_epoch = sampler.steps_per_epoch() as u64;
    if steps_per_epoch == 0 {
        return Err(TrainError::Config(format!(
            "{} samples do not fill one global batch of {}",
            train_set.len(),
            sampler.global_batch()
        )));
    }

    let (mut step, mut epoch, mut step_in_epoch) = (0u64, 0u64, 0u64);
    let mut resumed_from = None;
    let ckpt_dir = cfg.checkpoint_dir.clone();
    if cfg.resume {
        let dir = ckpt_dir
            .as_ref()
            .ok_or_else(|| TrainError::Config("resume needs a checkpoint directory".into()))?;
        // Rank 0 picks the checkpoint; every rank loads that same one.
        let mut chosen = [u64::MAX];
        let mut mine = None;
        if rank == 0 {
            if let Some(c) = checkpoint::newest(dir)? {
                chosen[0] = c.meta.step;
                mine = Some(c);
            }
        }
        comm.broadcast_in_place(&mut chosen, 0)?;
        if chosen[0] != u64::MAX {
            let c = match mine {
                Some(c) => c,
                None => Checkpoint::load(&dir.join(checkpoint::file_name(chosen[0])))?,
            };
            if c.meta.param_sizes != sizes || c.meta.optimizer != cfg.optimizer {
                return Err(TrainError::Config(
                    "the checkpoint was written for another model or optimizer".into(),
                ));
            }
            params = c.params;
            opt.m = c.opt_m;
            if !c.opt_v.is_empty() {
                opt.v = c.opt_v;
            }
            opt.t = c.meta.optimizer_t;
            step = c.meta.step;
            epoch = c.meta.epoch;
            step_in_epoch = c.meta.step_in_epoch;
            rng = c.meta.rng;
            if let Some(order) = &c.meta.bucket_order {
                reducer.set_bucket_order(order)?;
            }
            resumed_from = Some(step);
        }
    }
    reducer.broadcast_params(&mut params)?;

    let mut report_epochs = Vec::new();
    let mut xb = Vec::new();
    let mut yb = Vec::new();
    let scale = 1.0 / cfg.accum as f32;
    'epochs: while epoch < cfg.epochs {
        sampler.set_epoch(epoch);
        let bar = (cfg.progress && rank == 0).then(|| {
            let b = indicatif::ProgressBar::new(steps_per_epoch);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "epoch {msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_message(epoch.to_string());
            b.set_position(step_in_epoch);
            b
        });
        let mut st = EpochStats {
            epoch,
            ..Default::default()
        };
        let (mut loss_sum, mut correct, mut count) = (0.0f64, 0.0f64, 0.0f64);
        let (mut t_step, mut t_comm, mut t_exp) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut stop = false;
        while step_in_epoch < steps_per_epoch {
            let t0 = Instant::now();
            reducer.zero_grad()?;
            for micro in 0..cfg.accum {
                let idx = sampler
                    .micro_batch(step_in_epoch as usize, micro)
                    .ok_or_else(|| TrainError::Config("sampler position out of range".into()))?;
                train_set.gather(idx, &mut xb, &mut yb);
                reducer.prepare_for_backward(micro + 1 == cfg.accum)?;
                let r = model::forward_backward(&shape, &params, &xb, &yb, scale, &mut reducer)?;
                let tm = reducer.finish()?;
                loss_sum += r.loss * r.count as f64;
                correct += r.correct as f64;
                count += r.count as f64;
                t_comm += tm.comm;
                t_exp += tm.exposed;
                st.buckets = tm.buckets;
            }
            let lr = warmup_lr(cfg.lr, step, cfg.warmup);
            for (i, p) in params.iter_mut().enumerate() {
                opt.update(i, p, reducer.grad(i)?, lr);
            }
            opt.tick();
            step += 1;
            step_in_epoch += 1;
            st.steps += 1;
            t_step += t0.elapsed();
            if let Some(b) = &bar {
                b.inc(1);
            }
            if let (Some(dir), true) = (&ckpt_dir, cfg.checkpoint_every > 0) {
                if rank == 0 && step % cfg.checkpoint_every == 0 {
                    let (e, s) = if step_in_epoch == steps_per_epoch {
                        (epoch + 1, 0)
                    } else {
                        (epoch, step_in_epoch)
                    };
                    Checkpoint {
                        meta: Meta {
                            step,
                            epoch: e,
                            step_in_epoch: s,
                            seed: cfg.seed,
                            param_sizes: sizes.clone(),
                            optimizer: cfg.optimizer,
                            optimizer_t: opt.t,
                            rng: rng.clone(),
                            bucket_order: reducer.is_rebuilt().then(|| reducer.bucket_order()),
                            world_size: world,
                        },
                        params: params.clone(),
                        opt_m: opt.m.clone(),
                        opt_v: opt.v.clone(),
                    }
                    .save(dir, cfg.keep)?;
                }
            }
            on_step(step);
            if cfg.max_steps.is_some_and(|m| step >= m) {
                stop = true;
                break;
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        // Global training statistics of the epoch.
        let mut agg = [loss_sum, correct, count];
        comm.all_reduce_in_place(&mut agg, ReduceOp::Sum)?;
        if agg[2] > 0.0 {
            st.train_loss = agg[0] / agg[2];
            st.train_acc = agg[1] / agg[2];
        }
        let ev = model::evaluate(&shape, &params, &test_set.x, &test_set.y, 512)?;
        st.test_loss = ev.loss;
        st.test_acc = if ev.count > 0 {
            ev.correct as f64 / ev.count as f64
        } else {
            0.0
        };
        if st.steps > 0 {
            let n = st.steps as u32;
            st.step_time = t_step / n;
            st.comm_time = t_comm / n;
            st.exposed_comm = t_exp / n;
            st.hidden_fraction = if t_comm.is_zero() {
                1.0
            } else {
                (1.0 - t_exp.as_secs_f64() / t_comm.as_secs_f64()).clamp(0.0, 1.0)
            };
        }
        if cfg.log && rank == 0 {
            println!(
                "epoch {} steps {} loss {:.4} acc {:.4} test_loss {:.4} test_acc {:.4} step {:.3} ms comm {:.3} ms exposed {:.3} ms hidden {:.0}% buckets {}",
                st.epoch,
                st.steps,
                st.train_loss,
                st.train_acc,
                st.test_loss,
                st.test_acc,
                st.step_time.as_secs_f64() * 1e3,
                st.comm_time.as_secs_f64() * 1e3,
                st.exposed_comm.as_secs_f64() * 1e3,
                st.hidden_fraction * 100.0,
                st.buckets
            );
        }
        report_epochs.push(st);
        if stop {
            break 'epochs;
        }
        epoch += 1;
        step_in_epoch = 0;
    }
    Ok(TrainReport {
        params,
        epochs: report_epochs,
        steps: step,
        resumed_from,
        buckets: reducer.buckets(),
    })
}
