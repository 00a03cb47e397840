//! `weft train`: the reference data-parallel trainer (an MLP through weftcc-ddp's reducer).
//!
//! Run alone it trains in one process; under `weft run -n N` (or torchrun, srun, mpirun) each
//! worker is one rank. With `--checkpoint-dir` rank 0 writes atomic checkpoints every
//! `--checkpoint-every` steps and `--resume` continues from the newest one, so that
//! `weft run --max-restarts K -- weft train --resume …` survives worker failures. With
//! `--elastic` (under `weft run --elastic`) the survivors of a lost rank continue without a
//! restart, and replacements the launcher starts (`WEFT_ELASTIC_JOIN=1`) join by grow.

use std::io::Write;
use std::path::PathBuf;

use weftcc::{CommConfig, Communicator, UniqueId};
use weftcc_ddp::optim::OptimizerKind;
use weftcc_ddp::trainer::{unix_ms, DataSource};
use weftcc_ddp::{
    train, train_elastic, CommHook, ElasticConfig, Point, ReducerConfig, TrainConfig,
};

const AFTER_HELP: &str = "\
Examples:
  weft train --epochs 3                                   # one process, synthetic data
  weft run -n 4 -- weft train --hidden 512,512,512 --bucket-mb 5 --hook bf16
  weft run -n 2 --max-restarts 3 -- weft train --checkpoint-dir ckpt --checkpoint-every 50 --resume
  weft train --data ~/mnist --hidden 256,128 --optimizer adamw --lr 1e-3 --warmup 100
  weft run -n 4 --elastic --max-replacements 2 -- weft train --elastic --min-ranks 2

Per-epoch log (rank 0): loss, accuracy, test accuracy, step time, time the communicator was busy,
communication not hidden behind backward, and the hidden fraction.

Elastic runs (--elastic, under `weft run --elastic`; the job's store must outlive every rank, as
`weft run`'s does): on a lost rank the survivors agree on the failed set, shrink, redo the failed
step among themselves and share the rest of the epoch; below --min-ranks they stop with an error.
A process started with WEFT_ELASTIC_JOIN=1 joins the running job by grow and receives the
parameters, optimizer state and position by broadcast. Rank 0 logs each recovery; every rank
prints its final parameters' checksum.

Testing aid: WEFT_TRAIN_KILL_AT=RANK:WHEN[,RANK:WHEN…] makes the rank launched as RANK SIGKILL
itself after WHEN optimizer steps (a number), or right before it agrees on failures (`agree`),
shrinks (`shrink`) or grows (`grow`) in an elastic run; on the first attempt only
(TORCHELASTIC_RESTART_COUNT unset or 0).";

/// Command-line arguments of `weft train`.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct TrainArgs {
    /// Directory with MNIST-format IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte,
    /// optional t10k-*); default: the synthetic set.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Synthetic set: training samples.
    #[arg(long, default_value_t = 8192)]
    pub samples: usize,
    /// Synthetic set: test samples.
    #[arg(long, default_value_t = 2048)]
    pub test_samples: usize,
    /// Synthetic set: features per sample.
    #[arg(long, default_value_t = 32)]
    pub dim: usize,
    /// Synthetic set: classes.
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Hidden layer widths, comma-separated (depth = count + 1 layers).
    #[arg(long, default_value = "64,64", value_delimiter = ',')]
    pub hidden: Vec<usize>,
    /// Passes over the training set (at least 1).
    #[arg(long, default_value_t = 5, value_parser = at_least_one_epoch)]
    pub epochs: u64,
    /// Samples per rank per micro-batch (global batch = batch × accum × ranks).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Micro-batches per optimizer step (all but the last without communication: no_sync).
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// sgd (with momentum) or adamw.
    #[arg(long, default_value = "sgd")]
    pub optimizer: String,
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    #[arg(long = "weight-decay")]
    pub weight_decay: Option<f32>,
    /// Linear learning-rate warm-up, in steps.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Bucket capacity in MiB (fractions allowed).
    #[arg(long = "bucket-mb", default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// First bucket's capacity in MiB.
    #[arg(long = "first-bucket-mb", default_value_t = 1.0)]
    pub first_bucket_mb: f64,
    /// Communication hook: none (f32 average), bf16 or fp16 compression.
    #[arg(long, default_value = "none")]
    pub hook: CommHook,
    /// Register a parameter that never gets a gradient (exercises unused-parameter handling).
    #[arg(long = "unused-param")]
    pub unused_param: bool,
    /// Where rank 0 writes checkpoints.
    #[arg(long = "checkpoint-dir")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N optimizer steps (0: never).
    #[arg(long = "checkpoint-every", default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 2)]
    pub keep: usize,
    /// Continue from the newest checkpoint in --checkpoint-dir (if any).
    #[arg(long)]
    pub resume: bool,
    /// Stop after this many optimizer steps in total.
    #[arg(long = "max-steps")]
    pub max_steps: Option<u64>,
    /// No progress bar.
    #[arg(long = "no-progress")]
    pub no_progress: bool,
    /// Rank 0 writes the final parameters here (raw little-endian f32, parameter after parameter).
    #[arg(long = "save-params")]
    pub save_params: Option<PathBuf>,
    /// Rank 0 writes per-epoch statistics here as JSON lines.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Deterministic gradient reduction (as WEFT_DETERMINISTIC=1): the final parameters are
    /// byte-identical whatever WEFT_ALGO, the bucket sizes or the ranks' placement on hosts.
    #[arg(long)]
    pub deterministic: bool,
    /// Survive lost ranks (shrink and continue) and admit replacements (grow).
    #[arg(long)]
    pub elastic: bool,
    /// Elastic: stop with an error when fewer ranks would be left.
    #[arg(long = "min-ranks", default_value_t = 1, requires = "elastic")]
    pub min_ranks: usize,
    /// Elastic: look for replacements waiting to join every N steps (0: never). One look costs
    /// rank 0 two store reads and every rank an 8-byte broadcast (about 0.1 ms here).
    #[arg(long = "join-check-every", default_value_t = 10, requires = "elastic")]
    pub join_check_every: u64,
}

fn at_least_one_epoch(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(0) => Err("at least 1 (0 epochs would train nothing)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a whole number of epochs")),
    }
}

fn mib(x: f64) -> usize {
    ((x * 1048576.0).round() as usize).max(4)
}

fn config(a: &TrainArgs) -> Result<TrainConfig, String> {
    let optimizer = match a.optimizer.to_ascii_lowercase().as_str() {
        "sgd" => OptimizerKind::Sgd {
            momentum: a.momentum,
            weight_decay: a.weight_decay.unwrap_or(0.0),
        },
        "adamw" | "adam" => match OptimizerKind::adamw() {
            OptimizerKind::AdamW {
                beta1, beta2, eps, ..
            } => OptimizerKind::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay: a.weight_decay.unwrap_or(0.01),
            },
            k => k,
        },
        o => return Err(format!("unknown optimizer {o:?}: expected sgd or adamw")),
    };
    if !(a.bucket_mb > 0.0 && a.first_bucket_mb > 0.0) {
        return Err("bucket sizes must be positive".into());
    }
    Ok(TrainConfig {
        data: match &a.data {
            Some(d) => DataSource::Idx(d.clone()),
            None => DataSource::Synthetic {
                train: a.samples,
                test: a.test_samples,
                dim: a.dim,
                classes: a.classes,
            },
        },
        hidden: a.hidden.clone(),
        unused_param: a.unused_param,
        epochs: a.epochs,
        batch: a.batch,
        accum: a.accum,
        optimizer,
        lr: a.lr,
        warmup: a.warmup,
        seed: a.seed,
        reducer: ReducerConfig {
            bucket_cap_bytes: mib(a.bucket_mb),
            first_bucket_bytes: mib(a.first_bucket_mb),
            hook: a.hook,
            rebuild_buckets: true,
            deterministic: a.deterministic,
        },
        checkpoint_dir: a.checkpoint_dir.clone(),
        checkpoint_every: a.checkpoint_every,
        keep: a.keep,
        resume: a.resume,
        progress: !a.no_progress,
        log: true,
        max_steps: a.max_steps,
    })
}

use weftcc::comm::env::started_by_launcher as launched;

/// The restart count of torchrun's (and `weft run`'s) elastic agent.
fn restart_count() -> String {
    weftcc::settings::foreign("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())
}

/// When a WEFT_TRAIN_KILL_AT entry fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillAt {
    Step(u64),
    Point(Point),
}

/// The WEFT_TRAIN_KILL_AT entries of the rank launched as `rank` (first attempt only).
fn kill_hook(rank: Option<usize>) -> Vec<KillAt> {
    let first_attempt = restart_count() == "0";
    let (Some(spec), Some(rank), true) =
        (weftcc::settings::TRAIN_KILL_AT.value(), rank, first_attempt)
    else {
        return Vec::new();
    };
    spec.split(',')
        .filter_map(|entry| {
            let (r, when) = entry.split_once(':')?;
            if r.trim().parse::<usize>().ok()? != rank {
                return None;
            }
            Some(match when.trim() {
                "agree" => KillAt::Point(Point::Agreeing),
                "shrink" => KillAt::Point(Point::Shrinking),
                "grow" => KillAt::Point(Point::Growing),
                s => KillAt::Step(s.parse().ok()?),
            })
        })
        .collect()
}

fn kill_self(rank: usize, what: &str) {
    eprintln!(
        "weft train: WEFT_TRAIN_KILL_AT: rank {rank} kills itself {what} (unix_ms {})",
        unix_ms()
    );
    let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::SIGKILL);
}

/// The communicator of a replacement (WEFT_ELASTIC_JOIN=1): a newcomer of the job at
/// WEFT_STORE, admitted by the next grow. A member dying during that grow fails it: ask again.
fn join_as_newcomer(settings: CommConfig) -> weftcc::Result<Communicator> {
    let env = |k: &str| weftcc::settings::foreign(k).filter(|v| !v.is_empty());
    let (Some(addr), Some(token)) = (env("WEFT_STORE"), env("WEFT_JOB_TOKEN")) else {
        return Err(weftcc::Error::Config(
            "WEFT_ELASTIC_JOIN=1 needs WEFT_STORE and WEFT_JOB_TOKEN (as `weft run --elastic` gives)"
                .into(),
        ));
    };
    let id = UniqueId { addr, token };
    let mut tries = 0;
    loop {
        match Communicator::join_grown(&id, settings.clone()) {
            Err(weftcc::Error::Bootstrap { source, .. }) if tries < 3 => {
                tries += 1;
                eprintln!("weft train: joining failed ({source}); asking for a place again");
            }
            other => return other,
        }
    }
}

/// FNV-1a over the parameters' bits: equal on ranks whose parameters are byte-identical.
fn checksum(params: &[Vec<f32>]) -> u64 {
    params
        .iter()
        .flatten()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
            x.to_bits().to_le_bytes().iter().fold(h, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
            })
        })
}

pub fn main(args: TrainArgs) -> i32 {
    let Ok(cfg) = config(&args).map_err(|e| eprintln!("weft train: {e}")) else {
        return 2;
    };
    let joining = weftcc::settings::ELASTIC_JOIN
        .value()
        .is_some_and(|v| v == "1");
    if joining && !args.elastic {
        eprintln!("weft train: WEFT_ELASTIC_JOIN=1 (a replacement) needs --elastic");
        return 2;
    }
    let comm = CommConfig::from_env().and_then(|mut settings| {
        settings.deterministic |= args.deterministic;
        if joining {
            join_as_newcomer(settings)
        } else if launched() {
            Communicator::from_env_with(settings)
        } else {
            UniqueId::new().and_then(|id| Communicator::init_with(0, 1, &id, settings))
        }
    });
    let comm = match comm {
        Ok(c) => c,
        Err(e) => {
            eprintln!("weft train: cannot join the job: {e}");
            return 1;
        }
    };
    if comm.rank() == 0 {
        println!(
            "weft train: {} ranks, restart {}, hidden {:?}, batch {} x accum {} x {} ranks, bucket {} B (first {} B), hook {:?}",
            comm.size(),
            restart_count(),
            cfg.hidden,
            cfg.batch,
            cfg.accum,
            comm.size(),
            cfg.reducer.bucket_cap_bytes,
            cfg.reducer.first_bucket_bytes,
            cfg.reducer.hook
        );
    }
    // The rank this process was launched as (none for a replacement): what the kill hook names.
    let launched_as = (!joining).then(|| comm.rank());
    let kills = kill_hook(launched_as);
    let mut hook = |p: Point| {
        let rank = launched_as.unwrap_or(usize::MAX);
        match p {
            Point::Step(step) if kills.contains(&KillAt::Step(step)) => {
                kill_self(rank, &format!("after step {step}"))
            }
            p if kills.contains(&KillAt::Point(p)) => kill_self(rank, &format!("at {p:?}")),
            _ => {}
        }
    };
    let started = std::time::Instant::now();
    let result = if args.elastic {
        let elastic = ElasticConfig {
            min_ranks: args.min_ranks,
            join_check_every: args.join_check_every,
            joined: joining,
        };
        train_elastic(comm, &cfg, &elastic, &mut hook)
    } else {
        let mut on_step = |s: u64| hook(Point::Step(s));
        train(&comm, &cfg, &mut on_step).map(|r| (r, comm))
    };
    let elapsed = started.elapsed();
    let (report, comm) = match result {
        Ok(r) => r,
        Err(e) => {
            let who = launched_as.map_or("a replacement".to_string(), |r| format!("rank {r}"));
            eprintln!("weft train: {who}: {e}");
            return 1;
        }
    };
    if args.elastic && comm.rank() == 0 {
        let (n, t) = report.join_checks;
        println!(
            "weft train: {n} checks for newcomers, {:.1} us each",
            t.as_secs_f64() * 1e6 / n.max(1) as f64
        );
    }
    if args.elastic {
        println!(
            "weft train: rank {} of {} params fnv {:016x} after {} steps (unix_ms {})",
            comm.rank(),
            comm.size(),
            checksum(&report.params),
            report.steps,
            unix_ms()
        );
    }
    let rank = comm.rank();
    if rank == 0 {
        if let Some(s) = report.resumed_from {
            println!("weft train: resumed from the checkpoint after step {s}");
        }
        println!(
            "weft train: done after {} steps; {} buckets; {:.3} s training ({:.1} steps/s)",
            report.steps,
            report.buckets.len(),
            elapsed.as_secs_f64(),
            report.steps as f64 / elapsed.as_secs_f64().max(1e-9)
        );
        if let Some(path) = &args.json {
            let mut out = String::new();
            for e in &report.epochs {
                let v = serde_json::json!({
                    "ranks": comm.size(),
                    "epoch": e.epoch,
                    "steps": e.steps,
                    "train_loss": e.train_loss,
                    "train_acc": e.train_acc,
                    "test_loss": e.test_loss,
                    "test_acc": e.test_acc,
                    "step_ms": e.step_time.as_secs_f64() * 1e3,
                    "comm_ms": e.comm_time.as_secs_f64() * 1e3,
                    "exposed_ms": e.exposed_comm.as_secs_f64() * 1e3,
                    "hidden_fraction": e.hidden_fraction,
                    "buckets": e.buckets,
                });
                out.push_str(&v.to_string());
                out.push('\n');
            }
            if let Err(e) = std::fs::write(path, out) {
                eprintln!("weft train: {}: {e}", path.display());
                return 1;
            }
        }
        if let Some(path) = &args.save_params {
            let bytes: Vec<u8> = report
                .params
                .iter()
                .flatten()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect();
            let written = std::fs::File::create(path)
                .and_then(|mut f| f.write_all(&bytes).and_then(|_| f.sync_all()));
            if let Err(e) = written {
                eprintln!("weft train: {}: {e}", path.display());
                return 1;
            }
        }
    }
    0
}
