//! The reference trainer: an MLP trained data-parallel through the [`Reducer`], with a
//! distributed sampler, SGD or AdamW with warm-up, per-epoch logs, a progress bar on rank 0,
//! and atomic checkpoints with resume. `weft train` is a thin command-line wrapper over
//! [`train`] and [`train_elastic`]; tests call them in-process with one thread per rank.
//!
//! An elastic run ([`train_elastic`]) survives lost ranks: on a communicator failure during a
//! step the survivors revoke, agree on the failed set, shrink, and redo that step among
//! themselves, sharing the rest of the epoch's samples; at step boundaries they admit newcomers
//! by grow. Every (re)made communicator starts with the same synchronisation: the most advanced
//! rank (lowest among equals) broadcasts the parameters, optimizer state, bucket order and
//! position, so survivors and newcomers continue from identical replicas.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use thiserror::Error;
use weftcc_collectives::ReduceOp;
use weftcc_comm::{Communicator, Error as CommError};
use weftcc_transports::TransportError;

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

/// Settings of an elastic run ([`train_elastic`]).
#[derive(Debug, Clone)]
pub struct ElasticConfig {
    /// Below this many ranks the run stops with [`TrainError::TooFewRanks`].
    pub min_ranks: usize,
    /// Look for newcomers waiting to join ([`Communicator::joiners_waiting`]) every this many
    /// optimizer steps (0: never admit any).
    pub join_check_every: u64,
    /// This process is a newcomer: its communicator came from [`Communicator::join_grown`] and
    /// it takes everything (no checkpoint) from the ranks already training.
    pub joined: bool,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        ElasticConfig {
            min_ranks: 1,
            join_check_every: 10,
            joined: false,
        }
    }
}

/// Where an elastic run is, for the caller's hooks (logs, fault injection in tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// After this many optimizer steps in total.
    Step(u64),
    /// About to agree on the failed ranks.
    Agreeing,
    /// Agreed; about to shrink.
    Shrinking,
    /// About to grow by newcomers.
    Growing,
}

/// One recovery of an elastic run, as rank 0 of the new communicator saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// Size before and after.
    pub from: usize,
    pub to: usize,
    /// The agreement's epoch (for a grow: the communicator's).
    pub epoch: u64,
    /// Ranks of the old communicator agreed failed (empty for a grow).
    pub failed: Vec<usize>,
    /// Newcomers admitted (0 for a shrink).
    pub joined: usize,
    /// From the error (or the start of the grow) to the end of the first step completed after.
    pub to_first_step: Duration,
    /// The optimizer step that was redone or taken first (1-based count after it).
    pub step: u64,
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
    #[error("elastic run: {left} ranks would be left after losing ranks {failed:?} (agreement epoch {epoch}), fewer than --min-ranks {min}")]
    TooFewRanks {
        left: usize,
        min: usize,
        failed: Vec<usize>,
        epoch: u64,
    },
    #[error("elastic run: recovery after {attempts} attempts still failed: {last}")]
    RecoveryFailed {
        attempts: usize,
        last: weftcc_comm::Error,
    },
}

impl TrainError {
    /// The communicator error behind this one, if it is one.
    fn comm(&self) -> Option<&CommError> {
        match self {
            TrainError::Comm(e) | TrainError::Reducer(ReducerError::Comm(e)) => Some(e),
            _ => None,
        }
    }

    /// Whether this error is a lost rank that survivors recover from: a peer lost, the
    /// communicator revoked or aborted by a failure elsewhere, a timeout or broken connection,
    /// or a reducer broken by one of those.
    pub fn lost_a_rank(&self) -> bool {
        match self {
            TrainError::Reducer(ReducerError::Broken(_)) => true,
            _ => self.comm().is_some_and(lost_a_rank),
        }
    }
}

fn lost_a_rank(e: &CommError) -> bool {
    matches!(
        e,
        CommError::PeerLost { .. }
            | CommError::Revoked { .. }
            | CommError::Aborted { .. }
            | CommError::Timeout { .. }
            | CommError::Transport { .. }
    ) || died_in_setup(e)
}

/// A member died while a shrunk or grown communicator was being made: agree again.
fn died_in_setup(e: &CommError) -> bool {
    matches!(
        e,
        CommError::Bootstrap {
            source: TransportError::DiedInSetup { .. },
            ..
        }
    )
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
    /// Recoveries of an elastic run (shrinks and grows), as this rank saw them.
    pub recoveries: Vec<Recovery>,
    /// Ranks at the end.
    pub world: usize,
    /// Elastic: how many times this rank looked for newcomers, and the time it spent on it.
    pub join_checks: (u64, Duration),
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

/// What does not change during a run.
struct Setup<'a> {
    cfg: &'a TrainConfig,
    train_set: Dataset,
    test_set: Dataset,
    shape: MlpShape,
    sizes: Vec<usize>,
}

/// Sums over the steps of the current epoch that this process completed.
#[derive(Debug, Clone, Default)]
struct EpochSums {
    loss: f64,
    correct: f64,
    count: f64,
    steps: u64,
    t_step: Duration,
    t_comm: Duration,
    t_exposed: Duration,
    buckets: usize,
}

/// Everything a rank carries from one communicator to the next.
struct State {
    params: Vec<Vec<f32>>,
    opt: Optimizer,
    rng: Rng,
    /// Optimizer steps completed in total.
    step: u64,
    /// Epoch of the next step.
    epoch: u64,
    /// Samples of the epoch's order the steps so far used.
    consumed: usize,
    bucket_order: Option<Vec<usize>>,
    sums: EpochSums,
    epochs: Vec<EpochStats>,
    resumed_from: Option<u64>,
    recoveries: Vec<Recovery>,
    /// A recovery whose first step has not completed yet: its record and when it started.
    recovering: Option<(Recovery, Instant)>,
    join_checks: (u64, Duration),
}

/// How a run on one communicator ended.
enum Ended {
    Done {
        buckets: Vec<Vec<usize>>,
    },
    /// Newcomers wait: grow by this many.
    Grow(usize),
}

impl<'a> Setup<'a> {
    fn new(cfg: &'a TrainConfig) -> Result<Self, TrainError> {
        if cfg.batch == 0 || cfg.accum == 0 {
            return Err(TrainError::Config("batch and accum must be ≥ 1".into()));
        }
        let (train_set, test_set) = load_data(cfg)?;
        let shape = MlpShape {
            input: train_set.dim,
            hidden: cfg.hidden.clone(),
            classes: train_set.classes,
            unused_param: cfg.unused_param,
        };
        let sizes = shape.param_sizes();
        Ok(Setup {
            cfg,
            train_set,
            test_set,
            shape,
            sizes,
        })
    }

    fn sampler(&self, comm: &Communicator) -> Result<DistributedSampler, TrainError> {
        let cfg = self.cfg;
        let sampler = DistributedSampler::new(
            self.train_set.len(),
            comm.size(),
            comm.rank(),
            cfg.batch,
            cfg.accum,
            cfg.seed,
        );
        if sampler.steps_per_epoch() == 0 {
            return Err(TrainError::Config(format!(
                "{} samples do not fill one global batch of {}",
                self.train_set.len(),
                sampler.global_batch()
            )));
        }
        Ok(sampler)
    }

    /// The starting state of a rank: initialised (differently per rank: the first
    /// synchronisation makes them equal), or the newest checkpoint if resuming.
    fn initial_state(&self, comm: &Communicator, resume: bool) -> Result<State, TrainError> {
        let cfg = self.cfg;
        let rank = comm.rank();
        let mut rng = Rng::new(cfg.seed, 0xa11 + rank as u64);
        let params = self.shape.init(&mut rng);
        let mut st = State {
            params,
            opt: Optimizer::new(cfg.optimizer, &self.sizes),
            rng,
            step: 0,
            epoch: 0,
            consumed: 0,
            bucket_order: None,
            sums: EpochSums::default(),
            epochs: Vec::new(),
            resumed_from: None,
            recoveries: Vec::new(),
            recovering: None,
            join_checks: (0, Duration::ZERO),
        };
        if !resume {
            return Ok(st);
        }
        let dir = cfg
            .checkpoint_dir
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
        if chosen[0] == u64::MAX {
            return Ok(st);
        }
        let c = match mine {
            Some(c) => c,
            None => Checkpoint::load(&dir.join(checkpoint::file_name(chosen[0])))?,
        };
        if c.meta.param_sizes != self.sizes || c.meta.optimizer != cfg.optimizer {
            return Err(TrainError::Config(
                "the checkpoint was written for another model or optimizer".into(),
            ));
        }
        st.params = c.params;
        st.opt.m = c.opt_m;
        if !c.opt_v.is_empty() {
            st.opt.v = c.opt_v;
        }
        st.opt.t = c.meta.optimizer_t;
        st.step = c.meta.step;
        st.epoch = c.meta.epoch;
        // The steps of that epoch were taken by the world that wrote it.
        st.consumed =
            c.meta.step_in_epoch as usize * cfg.batch * cfg.accum * c.meta.world_size.max(1);
        st.rng = c.meta.rng;
        st.bucket_order = c.meta.bucket_order;
        st.resumed_from = Some(st.step);
        Ok(st)
    }
}

/// Makes every rank of `comm` hold the state of its most advanced rank (the lowest among
/// equals): position, optimizer step count, bucket order, parameters and optimizer buffers.
/// At the start every rank is at step 0 and rank 0's initialisation wins; after a failure the
/// survivors may stand on either side of the failed step's all-reduce; newcomers get it all.
fn synchronise(comm: &Communicator, st: &mut State) -> Result<(), TrainError> {
    let mut top = [st.step, st.epoch];
    comm.all_reduce_in_place(&mut top, ReduceOp::Max)?;
    let rank = comm.rank() as u64;
    let mut root = [if [st.step, st.epoch] == top {
        rank
    } else {
        u64::MAX
    }];
    comm.all_reduce_in_place(&mut root, ReduceOp::Min)?;
    let root = root[0] as usize;
    let n = st.params.len();
    let mut head: Vec<u64> = vec![
        st.step,
        st.epoch,
        st.consumed as u64,
        st.opt.t,
        st.bucket_order.is_some() as u64,
    ];
    head.extend((0..n).map(|p| {
        st.bucket_order
            .as_ref()
            .and_then(|o| o.get(p))
            .map_or(0, |&x| x as u64)
    }));
    comm.broadcast_in_place(&mut head, root)?;
    let mut flat: Vec<f32> = st
        .params
        .iter()
        .chain(&st.opt.m)
        .chain(&st.opt.v)
        .flat_map(|p| p.iter().copied())
        .collect();
    comm.broadcast_in_place(&mut flat, root)?;
    if comm.rank() == root {
        return Ok(());
    }
    if head[1] != st.epoch {
        // This rank had not closed the epoch the others closed: its sums belong to it.
        st.sums = EpochSums::default();
    } else {
        // The step this rank failed in completed elsewhere (the dead rank's last messages
        // reached some survivors, not all): it counts as taken, its loss unseen here.
        st.sums.steps += head[0].saturating_sub(st.step);
    }
    st.step = head[0];
    st.epoch = head[1];
    st.consumed = head[2] as usize;
    st.opt.t = head[3];
    st.bucket_order = (head[4] == 1).then(|| head[5..].iter().map(|&p| p as usize).collect());
    let mut off = 0;
    for p in st
        .params
        .iter_mut()
        .chain(st.opt.m.iter_mut())
        .chain(st.opt.v.iter_mut())
    {
        let len = p.len();
        p.copy_from_slice(&flat[off..off + len]);
        off += len;
    }
    Ok(())
}

/// Trains on `comm`'s ranks (every rank calls this with the same `cfg`). `on_step` is called
/// after every optimizer step (and checkpoint) with the number of steps completed. A
/// communicator failure ends the run with its error (see [`train_elastic`] to survive it).
pub fn train(
    comm: &Communicator,
    cfg: &TrainConfig,
    on_step: &mut dyn FnMut(u64),
) -> Result<TrainReport, TrainError> {
    let setup = Setup::new(cfg)?;
    let mut st = setup.initial_state(comm, cfg.resume)?;
    let mut hook = |p: Point| {
        if let Point::Step(s) = p {
            on_step(s)
        }
    };
    match run_on(comm, &setup, &mut st, None, &mut hook)? {
        Ended::Done { buckets } => Ok(report(st, buckets, comm.size())),
        // Never without an elastic configuration.
        Ended::Grow(_) => Err(TrainError::Config("grow outside an elastic run".into())),
    }
}

fn report(st: State, buckets: Vec<Vec<usize>>, world: usize) -> TrainReport {
    TrainReport {
        params: st.params,
        epochs: st.epochs,
        steps: st.step,
        resumed_from: st.resumed_from,
        buckets,
        recoveries: st.recoveries,
        world,
        join_checks: st.join_checks,
    }
}

/// Communicators replaced by a shrink or grow, dropped on threads of their own: dropping one
/// stops its threads and settles with the store (about 80 ms after a failure, measured), which
/// the survivors need not wait for before their next step. Dropping this joins them all.
#[derive(Default)]
struct Retired(Vec<std::thread::JoinHandle<()>>);

impl Retired {
    fn retire(&mut self, old: Communicator) {
        let spawned = std::thread::Builder::new()
            .name("weft-retire".into())
            .spawn(move || drop(old));
        match spawned {
            Ok(t) => self.0.push(t),
            // No thread to spare: the closure that failed to spawn, `old` in it, was dropped
            // here already.
            Err(e) => {
                tracing::warn!(target: "weftcc::ddp", error = %e, "dropping a replaced communicator in line")
            }
        }
    }
}

impl Drop for Retired {
    fn drop(&mut self) {
        for t in self.0.drain(..) {
            let _ = t.join();
        }
    }
}

/// How many times one failure's recovery agrees and shrinks again when members keep dying
/// during it, before giving up.
const MAX_RECOVERY_ATTEMPTS: usize = 8;

/// [`train`] that survives lost ranks (see the module's documentation) and admits newcomers.
/// Takes the communicator (it is replaced by shrinks and grows) and gives back the last one
/// with the report. `hook` sees every step and each recovery point (fault injection).
pub fn train_elastic(
    comm: Communicator,
    cfg: &TrainConfig,
    elastic: &ElasticConfig,
    hook: &mut dyn FnMut(Point),
) -> Result<(TrainReport, Communicator), TrainError> {
    let setup = Setup::new(cfg)?;
    let mut comm = comm;
    let mut st = setup.initial_state(&comm, cfg.resume && !elastic.joined)?;
    let mut retired = Retired::default();
    loop {
        let err = match run_on(&comm, &setup, &mut st, Some(elastic), hook) {
            Ok(Ended::Done { buckets }) => {
                let world = comm.size();
                return Ok((report(st, buckets, world), comm));
            }
            Ok(Ended::Grow(joining)) => {
                let t0 = Instant::now();
                hook(Point::Growing);
                match comm.grow(joining) {
                    Ok(grown) => {
                        let rec = Recovery {
                            from: comm.size(),
                            to: grown.size(),
                            epoch: grown.epoch(),
                            failed: Vec::new(),
                            joined: joining,
                            to_first_step: Duration::ZERO,
                            step: st.step + 1,
                        };
                        st.recovering = Some((rec, t0));
                        retired.retire(std::mem::replace(&mut comm, grown));
                        continue;
                    }
                    Err(e) => TrainError::Comm(e),
                }
            }
            Err(e) => e,
        };
        if !err.lost_a_rank() {
            return Err(err);
        }
        let t0 = Instant::now();
        let from = comm.size();
        if comm.rank() == 0 || cfg.log {
            tracing::warn!(target: "weftcc::ddp", rank = comm.rank(), error = %err, "elastic run: lost a rank; recovering");
        }
        let (shrunk, agreement) = recover(&comm, elastic, hook, err)?;
        st.recovering = Some((
            Recovery {
                from,
                to: shrunk.size(),
                epoch: agreement.epoch,
                failed: agreement.failed,
                joined: 0,
                to_first_step: Duration::ZERO,
                step: st.step + 1,
            },
            t0,
        ));
        retired.retire(std::mem::replace(&mut comm, shrunk));
    }
}

/// Revokes `comm`, agrees on the failed ranks and shrinks to the survivors, again while members
/// die during it.
fn recover(
    comm: &Communicator,
    elastic: &ElasticConfig,
    hook: &mut dyn FnMut(Point),
    first: TrainError,
) -> Result<(Communicator, weftcc_comm::Agreement), TrainError> {
    comm.revoke();
    let mut last = first;
    for attempt in 1..=MAX_RECOVERY_ATTEMPTS {
        hook(Point::Agreeing);
        let agreement = comm.agree_on_failures()?;
        let left = comm.size().saturating_sub(agreement.failed.len());
        if left < elastic.min_ranks.max(1) {
            return Err(TrainError::TooFewRanks {
                left,
                min: elastic.min_ranks,
                failed: agreement.failed,
                epoch: agreement.epoch,
            });
        }
        hook(Point::Shrinking);
        match comm.shrink(&agreement.failed) {
            Ok(c) => return Ok((c, agreement)),
            Err(e) if died_in_setup(&e) || (agreement.failed.is_empty() && lost_a_rank(&e)) => {
                tracing::warn!(target: "weftcc::ddp", rank = comm.rank(), attempt, error = %e, "elastic run: a member died during the shrink; agreeing again");
                last = TrainError::Comm(e);
            }
            Err(e) => return Err(e.into()),
        }
    }
    match last {
        TrainError::Comm(last) => Err(TrainError::RecoveryFailed {
            attempts: MAX_RECOVERY_ATTEMPTS,
            last,
        }),
        other => Err(other),
    }
}

/// Trains on one communicator from `st` until the run ends, a communicator error, or (elastic)
/// newcomers wait at a step boundary.
fn run_on(
    comm: &Communicator,
    setup: &Setup,
    st: &mut State,
    elastic: Option<&ElasticConfig>,
    hook: &mut dyn FnMut(Point),
) -> Result<Ended, TrainError> {
    let cfg = setup.cfg;
    let (rank, world) = (comm.rank(), comm.size());
    let mut reducer = Reducer::new(comm, &setup.sizes, cfg.reducer.clone())?;
    synchronise(comm, st)?;
    if let Some(order) = &st.bucket_order {
        reducer.set_bucket_order(order)?;
    }
    let mut sampler = setup.sampler(comm)?;
    let global = sampler.global_batch();
    let steps_per_epoch = sampler.steps_per_epoch() as u64;
    let mut xb = Vec::new();
    let mut yb = Vec::new();
    let scale = 1.0 / cfg.accum as f32;
    while st.epoch < cfg.epochs {
        sampler.set_epoch(st.epoch);
        let bar = (cfg.progress && rank == 0).then(|| {
            let b = indicatif::ProgressBar::new(steps_per_epoch);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "epoch {msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_message(st.epoch.to_string());
            b.set_position((st.consumed / global) as u64);
            b
        });
        let mut stop = false;
        while sampler.step_fits(st.consumed) {
            let t0 = Instant::now();
            // This step's sums count once it is complete (a failed step is redone).
            let mut sums = EpochSums::default();
            reducer.zero_grad()?;
            for micro in 0..cfg.accum {
                let idx = sampler
                    .micro_batch_at(st.consumed, micro)
                    .ok_or_else(|| TrainError::Config("sampler position out of range".into()))?;
                setup.train_set.gather(idx, &mut xb, &mut yb);
                reducer.prepare_for_backward(micro + 1 == cfg.accum)?;
                let r = model::forward_backward(
                    &setup.shape,
                    &st.params,
                    &xb,
                    &yb,
                    scale,
                    &mut reducer,
                )?;
                let tm = reducer.finish()?;
                sums.loss += r.loss * r.count as f64;
                sums.correct += r.correct as f64;
                sums.count += r.count as f64;
                sums.t_comm += tm.comm;
                sums.t_exposed += tm.exposed;
                sums.buckets = tm.buckets;
            }
            let lr = warmup_lr(cfg.lr, st.step, cfg.warmup);
            for (i, p) in st.params.iter_mut().enumerate() {
                st.opt.update(i, p, reducer.grad(i)?, lr);
            }
            st.opt.tick();
            st.step += 1;
            st.consumed += global;
            if st.bucket_order.is_none() && reducer.is_rebuilt() {
                st.bucket_order = Some(reducer.bucket_order());
            }
            let s = &mut st.sums;
            s.loss += sums.loss;
            s.correct += sums.correct;
            s.count += sums.count;
            s.t_comm += sums.t_comm;
            s.t_exposed += sums.t_exposed;
            s.buckets = sums.buckets;
            s.steps += 1;
            s.t_step += t0.elapsed();
            if let Some(b) = &bar {
                b.inc(1);
            }
            if let Some((mut rec, since)) = st.recovering.take() {
                rec.to_first_step = since.elapsed();
                if cfg.log && rank == 0 {
                    log_recovery(&rec);
                }
                st.recoveries.push(rec);
            }
            if let (Some(dir), true) = (&cfg.checkpoint_dir, cfg.checkpoint_every > 0) {
                if rank == 0 && st.step.is_multiple_of(cfg.checkpoint_every) {
                    save_checkpoint(setup, st, dir, world, &reducer)?;
                }
            }
            hook(Point::Step(st.step));
            if cfg.max_steps.is_some_and(|m| st.step >= m) {
                stop = true;
                break;
            }
            if let Some(el) = elastic {
                if el.join_check_every > 0 && st.step.is_multiple_of(el.join_check_every) {
                    let t = Instant::now();
                    let waiting = comm.joiners_waiting()?;
                    st.join_checks.0 += 1;
                    st.join_checks.1 += t.elapsed();
                    if waiting > 0 {
                        if let Some(b) = bar {
                            b.finish_and_clear();
                        }
                        return Ok(Ended::Grow(waiting));
                    }
                }
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        close_epoch(comm, setup, st)?;
        if stop {
            break;
        }
    }
    Ok(Ended::Done {
        buckets: reducer.buckets(),
    })
}

/// Milliseconds since the Unix epoch: the clock the elastic log lines carry, so that events of
/// several processes on one host can be put in order (a kill, the first step after it).
pub fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Rank 0's line about a recovery: what failed or joined, the new size, and how long from the
/// error to the first step completed after it.
fn log_recovery(rec: &Recovery) {
    let (what, since) = if rec.joined > 0 {
        (format!("{} joined", rec.joined), "the grow began")
    } else {
        (format!("lost ranks {:?}", rec.failed), "the error")
    };
    let unix_ms = unix_ms();
    println!(
        "elastic: {what}: {} -> {} ranks, epoch {}, step {} completed {:.1} ms after {since} (unix_ms {unix_ms})",
        rec.from,
        rec.to,
        rec.epoch,
        rec.step,
        rec.to_first_step.as_secs_f64() * 1e3
    );
}

fn save_checkpoint(
    setup: &Setup,
    st: &State,
    dir: &std::path::Path,
    world: usize,
    reducer: &Reducer,
) -> Result<(), TrainError> {
    let cfg = setup.cfg;
    let global = cfg.batch * cfg.accum * world;
    let (epoch, consumed) = if st.consumed + global > setup.train_set.len() {
        (st.epoch + 1, 0)
    } else {
        (st.epoch, st.consumed)
    };
    Checkpoint {
        meta: Meta {
            step: st.step,
            epoch,
            step_in_epoch: (consumed / global) as u64,
            seed: cfg.seed,
            param_sizes: setup.sizes.clone(),
            optimizer: cfg.optimizer,
            optimizer_t: st.opt.t,
            rng: st.rng.clone(),
            bucket_order: reducer.is_rebuilt().then(|| reducer.bucket_order()),
            world_size: world,
        },
        params: st.params.clone(),
        opt_m: st.opt.m.clone(),
        opt_v: st.opt.v.clone(),
    }
    .save(dir, cfg.keep)?;
    Ok(())
}

/// Ends the epoch: global training statistics (of the ranks there at its end), the test
/// evaluation, rank 0's log line; then moves to the next epoch.
fn close_epoch(comm: &Communicator, setup: &Setup, st: &mut State) -> Result<(), TrainError> {
    let cfg = setup.cfg;
    let s = &st.sums;
    let mut agg = [s.loss, s.correct, s.count];
    comm.all_reduce_in_place(&mut agg, ReduceOp::Sum)?;
    let mut es = EpochStats {
        epoch: st.epoch,
        steps: s.steps,
        buckets: s.buckets,
        ..Default::default()
    };
    if agg[2] > 0.0 {
        es.train_loss = agg[0] / agg[2];
        es.train_acc = agg[1] / agg[2];
    }
    let ev = model::evaluate(
        &setup.shape,
        &st.params,
        &setup.test_set.x,
        &setup.test_set.y,
        512,
    )?;
    es.test_loss = ev.loss;
    es.test_acc = if ev.count > 0 {
        ev.correct as f64 / ev.count as f64
    } else {
        0.0
    };
    if s.steps > 0 {
        let n = s.steps as u32;
        es.step_time = s.t_step / n;
        es.comm_time = s.t_comm / n;
        es.exposed_comm = s.t_exposed / n;
        es.hidden_fraction = if s.t_comm.is_zero() {
            1.0
        } else {
            (1.0 - s.t_exposed.as_secs_f64() / s.t_comm.as_secs_f64()).clamp(0.0, 1.0)
        };
    }
    if cfg.log && comm.rank() == 0 {
        println!(
            "epoch {} steps {} loss {:.4} acc {:.4} test_loss {:.4} test_acc {:.4} step {:.3} ms comm {:.3} ms exposed {:.3} ms hidden {:.0}% buckets {}",
            es.epoch,
            es.steps,
            es.train_loss,
            es.train_acc,
            es.test_loss,
            es.test_acc,
            es.step_time.as_secs_f64() * 1e3,
            es.comm_time.as_secs_f64() * 1e3,
            es.exposed_comm.as_secs_f64() * 1e3,
            es.hidden_fraction * 100.0,
            es.buckets
        );
    }
    st.epochs.push(es);
    st.sums = EpochSums::default();
    st.epoch += 1;
    st.consumed = 0;
    Ok(())
}
