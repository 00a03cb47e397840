//! The gradient-bucketing reducer.
//!
//! Parameters are registered once (their element counts, in registration order). Their
//! gradients live inside bucket buffers (PyTorch's `gradient_as_bucket_view`): the backward pass
//! writes a gradient straight into [`Reducer::grad_mut`] and then calls
//! [`Reducer::grad_ready`]. When every gradient of a bucket is ready the bucket's all-reduce is
//! started asynchronously; buckets are launched strictly in index order, so every rank issues
//! the same sequence of collectives whatever order its gradients became ready in.
//! [`Reducer::finish`] marks the gradients that were not produced this iteration (unused
//! parameters) as ready with whatever they hold (zero after [`Reducer::zero_grad`]), waits for
//! all buckets and leaves averaged gradients in place.
//!
//! The first layout is reverse registration order (the order a layer-by-layer backward pass
//! produces gradients), first bucket `first_bucket_bytes`, the others `bucket_cap_bytes`, a
//! parameter never split. After the first synchronised iteration the buckets are rebuilt in the
//! order gradients actually became ready on rank 0, which is broadcast so that every rank
//! builds the identical layout.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use thiserror::Error;
use weftcc_collectives::ReduceOp;
use weftcc_comm::{Communicator, Handle};

/// PyTorch's defaults: 25 MiB buckets, the first one 1 MiB.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 << 20;
/// The first bucket is small so that communication starts early.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;

/// What a bucket's communication does with its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommHook {
    /// All-reduce in f32 and divide by the number of ranks.
    #[default]
    Average,
    /// Divide by the number of ranks, cast to bf16, all-reduce (sum), cast back to f32.
    Bf16Compress,
    /// Divide by the number of ranks, cast to f16, all-reduce (sum), cast back to f32.
    Fp16Compress,
}

impl std::str::FromStr for CommHook {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "avg" | "average" | "fp32" | "f32" => Ok(CommHook::Average),
            "bf16" => Ok(CommHook::Bf16Compress),
            "fp16" | "f16" => Ok(CommHook::Fp16Compress),
            other => Err(format!(
                "unknown hook {other:?}: expected none, bf16 or fp16"
            )),
        }
    }
}

/// Settings of a [`Reducer`].
#[derive(Debug, Clone)]
pub struct ReducerConfig {
    /// Capacity of every bucket but the first, in bytes of f32 gradients.
    pub bucket_cap_bytes: usize,
    /// Capacity of the first bucket, in bytes.
    pub first_bucket_bytes: usize,
    /// Communication hook.
    pub hook: CommHook,
    /// Rebuild buckets in the observed ready order after the first synchronised iteration.
    pub rebuild_buckets: bool,
    /// Require deterministic reductions: [`Reducer::new`] refuses a communicator without
    /// [`weftcc_comm::CommConfig::deterministic`] (`WEFT_DETERMINISTIC=1`). Every gradient element is
    /// then reduced in rank order, so parameters come out byte-identical whatever the bucket
    /// sizes, `WEFT_ALGO` or rank placement (same ranks, seed and data).
    pub deterministic: bool,
}

impl Default for ReducerConfig {
    fn default() -> Self {
        ReducerConfig {
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            hook: CommHook::Average,
            rebuild_buckets: true,
            deterministic: false,
        }
    }
}

/// Errors of the reducer. Communication failures (a dead peer, a timeout, a mismatch, an abort)
/// arrive as [`ReducerError::Comm`]; after one the reducer is broken and every later call fails.
#[derive(Debug, Error)]
pub enum ReducerError {
    /// The communicator failed.
    #[error("communication failed: {0}")]
    Comm(#[from] weftcc_comm::Error),
    /// A parameter index outside the registered ones.
    #[error("parameter {param} does not exist ({count} registered)")]
    UnknownParam { param: usize, count: usize },
    /// `grad_ready` called twice for one parameter in one backward pass.
    #[error("gradient of parameter {param} was already marked ready in this backward pass")]
    AlreadyReady { param: usize },
    /// A gradient was accessed while its bucket is being communicated.
    #[error(
        "gradient of parameter {param} is being communicated (bucket {bucket}); wait for finish()"
    )]
    InFlight { param: usize, bucket: usize },
    /// Calls out of order (e.g. `grad_ready` outside a backward pass).
    #[error("reducer used out of order: {0}")]
    State(&'static str),
    /// Ranks registered different parameters, or a peer sent an impossible bucket order.
    #[error("ranks disagree: {0}")]
    Mismatch(String),
    /// An invalid argument (no parameters, zero-sized parameter, wrong lengths).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An earlier communication failure lost the bucket memory.
    #[error("the reducer is unusable after an earlier failure: {0}")]
    Broken(String),
}

/// Result alias of the reducer.
pub type Result<T> = std::result::Result<T, ReducerError>;

/// Timing of one synchronised iteration.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTimings {
    /// From `prepare_for_backward` to `finish` being called.
    pub backward: Duration,
    /// Time the communicator was busy with this iteration's buckets (their all-reduces run one
    /// after another on its worker thread): sum over buckets of done − max(launch, previous
    /// done), completion times taken by the reducer's watcher thread as each operation ends.
    pub comm: Duration,
    /// Time `finish` spent waiting for communication (not hidden behind backward).
    pub exposed: Duration,
    /// Number of buckets.
    pub buckets: usize,
}

impl StepTimings {
    /// Fraction of the communication time that overlapped the backward pass, in [0, 1].
    pub fn hidden_fraction(&self) -> f64 {
        let c = self.comm.as_secs_f64();
        if c <= 0.0 {
            return 1.0;
        }
        (1.0 - self.exposed.as_secs_f64() / c).clamp(0.0, 1.0)
    }
}

/// A launched bucket: the all-reduce handle, and for the compression hooks the f32 bucket
/// memory that the result is cast back into.
enum InFlight {
    F32(Handle<Vec<f32>>),
    Bf16(Handle<Vec<bf16>>, Vec<f32>),
    F16(Handle<Vec<f16>>, Vec<f32>),
}

/// A finished bucket, as reported by the watcher thread.
struct Done {
    bucket: usize,
    result: std::result::Result<Vec<f32>, weftcc_comm::Error>,
    /// When the all-reduce ended (before any cast back).
    at: Instant,
}

fn cast_back<T: Copy>(mut out: Vec<f32>, c: &[T], f: impl Fn(T) -> f32) -> Vec<f32> {
    for (o, &v) in out.iter_mut().zip(c) {
        *o = f(v);
    }
    out
}

/// The watcher thread waits for each launched bucket (in launch order, which is the order the
/// communicator runs them), casts compressed results back to f32 (off the training thread), and
/// sends the buffer back with its completion time.
type Watcher = (mpsc::Sender<(usize, InFlight)>, mpsc::Receiver<Done>);

fn spawn_watcher() -> Result<Watcher> {
    let (jobs_tx, jobs_rx) = mpsc::channel::<(usize, InFlight)>();
    let (done_tx, done_rx) = mpsc::channel::<Done>();
    std::thread::Builder::new()
        .name("weft-ddp-watch".into())
        .spawn(move || {
            for (bucket, inf) in jobs_rx {
                let (result, at) = match inf {
                    InFlight::F32(h) => (h.wait(), Instant::now()),
                    InFlight::Bf16(h, out) => {
                        let r = h.wait();
                        let at = Instant::now();
                        (r.map(|c| cast_back(out, &c, bf16::to_f32)), at)
                    }
                    InFlight::F16(h, out) => {
                        let r = h.wait();
                        let at = Instant::now();
                        (r.map(|c| cast_back(out, &c, f16::to_f32)), at)
                    }
                };
                if done_tx.send(Done { bucket, result, at }).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| {
            ReducerError::InvalidArgument(format!("cannot start the watcher thread: {e}"))
        })?;
    Ok((jobs_tx, done_rx))
}

struct Bucket {
    params: Vec<usize>,
    /// The gradients (None while an uncompressed all-reduce owns the memory, or after a
    /// failure lost it).
    data: Option<Vec<f32>>,
    pending: usize,
    inflight: bool,
    launched_at: Option<Instant>,
    done_at: Option<Instant>,
}

/// The DDP reducer over one communicator.
pub struct Reducer<'c> {
    comm: &'c Communicator,
    cfg: ReducerConfig,
    sizes: Vec<usize>,
    buckets: Vec<Bucket>,
    /// Per parameter: (bucket, offset inside the bucket).
    loc: Vec<(usize, usize)>,
    ready: Vec<bool>,
    ready_order: Vec<usize>,
    next_launch: usize,
    in_backward: bool,
    sync: bool,
    rebuilt: bool,
    broken: Option<String>,
    backward_start: Option<Instant>,
    jobs: mpsc::Sender<(usize, InFlight)>,
    done: mpsc::Receiver<Done>,
    outstanding: usize,
}

/// Groups parameters (taken in `order`) into buckets: first bucket up to `first_cap` bytes,
/// the others up to `cap`; a parameter is never split, a bucket holds at least one parameter.
pub fn assign_buckets(
    order: &[usize],
    sizes: &[usize],
    first_cap: usize,
    cap: usize,
) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut bytes = 0usize;
    for &p in order {
        let b = sizes.get(p).copied().unwrap_or(0).saturating_mul(4);
        let limit = if out.is_empty() { first_cap } else { cap };
        if !cur.is_empty() && bytes.saturating_add(b) > limit {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        cur.push(p);
        bytes = bytes.saturating_add(b);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn fingerprint(sizes: &[usize], cfg: &ReducerConfig) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(sizes.len() as u64);
    for &s in sizes {
        eat(s as u64);
    }
    eat(cfg.bucket_cap_bytes as u64);
    eat(cfg.first_bucket_bytes as u64);
    eat(cfg.hook as u64);
    eat(cfg.rebuild_buckets as u64);
    h
}

impl<'c> Reducer<'c> {
    /// Registers parameters with `sizes` elements each (registration order) and checks that
    /// every rank registered the same ones with the same settings (one small all-reduce).
    pub fn new(comm: &'c Communicator, sizes: &[usize], cfg: ReducerConfig) -> Result<Self> {
        if sizes.is_empty() {
            return Err(ReducerError::InvalidArgument("no parameters".into()));
        }
        if let Some(p) = sizes.iter().position(|&s| s == 0) {
            return Err(ReducerError::InvalidArgument(format!(
                "parameter {p} has no elements"
            )));
        }
        if cfg.deterministic && !comm.deterministic() {
            return Err(ReducerError::InvalidArgument(
                "deterministic reduction needs a deterministic communicator \
                 (WEFT_DETERMINISTIC=1 or CommConfig::deterministic)"
                    .into(),
            ));
        }
        if cfg.bucket_cap_bytes == 0 || cfg.first_bucket_bytes == 0 {
            return Err(ReducerError::InvalidArgument(
                "bucket sizes must be positive".into(),
            ));
        }
        let fp = fingerprint(sizes, &cfg);
        let mut both = [fp, !fp];
        comm.all_reduce_in_place(&mut both, ReduceOp::Max)?;
        if both[0] != fp || !both[1] != fp {
            return Err(ReducerError::Mismatch(format!(
                "rank {} registered different parameters or reducer settings than another rank",
                comm.rank()
            )));
        }
        let initial: Vec<usize> = (0..sizes.len()).rev().collect();
        let (jobs, done) = spawn_watcher()?;
        let mut r = Reducer {
            comm,
            cfg,
            sizes: sizes.to_vec(),
            buckets: Vec::new(),
            loc: vec![(0, 0); sizes.len()],
            ready: vec![false; sizes.len()],
            ready_order: Vec::with_capacity(sizes.len()),
            next_launch: 0,
            in_backward: false,
            sync: true,
            rebuilt: false,
            broken: None,
            backward_start: None,
            jobs,
            done,
            outstanding: 0,
        };
        r.layout(&initial, None);
        Ok(r)
    }

    /// Lays buckets out following `order`, copying gradients from the old layout if given.
    fn layout(&mut self, order: &[usize], old: Option<Vec<Vec<f32>>>) {
        let groups = assign_buckets(
            order,
            &self.sizes,
            self.cfg.first_bucket_bytes,
            self.cfg.bucket_cap_bytes,
        );
        let mut buckets = Vec::with_capacity(groups.len());
        for (bi, params) in groups.into_iter().enumerate() {
            let mut len = 0;
            for &p in &params {
                self.loc[p] = (bi, len);
                len += self.sizes[p];
            }
            let mut data = vec![0f32; len];
            if let Some(old) = &old {
                for &p in &params {
                    let off = self.loc[p].1;
                    data[off..off + self.sizes[p]].copy_from_slice(&old[p]);
                }
            }
            buckets.push(Bucket {
                pending: params.len(),
                params,
                data: Some(data),
                inflight: false,
                launched_at: None,
                done_at: None,
            });
        }
        self.buckets = buckets;
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.size()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The communicator.
    pub fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// Element counts of the registered parameters.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Parameters of each bucket, in bucket order.
    pub fn buckets(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// The parameter order the buckets follow (bucket 0 first), for checkpoints.
    pub fn bucket_order(&self) -> Vec<usize> {
        self.buckets
            .iter()
            .flat_map(|b| b.params.iter().copied())
            .collect()
    }

    /// Whether the buckets were rebuilt from an observed ready order (or restored).
    pub fn is_rebuilt(&self) -> bool {
        self.rebuilt
    }

    fn check_usable(&self) -> Result<()> {
        match &self.broken {
            Some(m) => Err(ReducerError::Broken(m.clone())),
            None => Ok(()),
        }
    }

    fn check_param(&self, param: usize) -> Result<()> {
        if param >= self.sizes.len() {
            return Err(ReducerError::UnknownParam {
                param,
                count: self.sizes.len(),
            });
        }
        Ok(())
    }

    fn all_grads(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.sizes.len())
            .map(|p| self.grad(p).map(<[f32]>::to_vec))
            .collect()
    }

    /// Restores a bucket order saved with [`Reducer::bucket_order`] (same on every rank, e.g.
    /// from a checkpoint); the buckets count as rebuilt.
    pub fn set_bucket_order(&mut self, order: &[usize]) -> Result<()> {
        self.check_usable()?;
        if self.in_backward {
            return Err(ReducerError::State(
                "set_bucket_order during a backward pass",
            ));
        }
        validate_permutation(order, self.sizes.len()).map_err(ReducerError::InvalidArgument)?;
        let old = self.all_grads()?;
        self.layout(order, Some(old));
        self.rebuilt = true;
        Ok(())
    }

    /// Broadcasts parameters from rank 0 so that every rank starts from the same values.
    pub fn broadcast_params(&self, params: &mut [Vec<f32>]) -> Result<()> {
        self.check_usable()?;
        if params.len() != self.sizes.len()
            || params.iter().zip(&self.sizes).any(|(p, &s)| p.len() != s)
        {
            return Err(ReducerError::InvalidArgument(
                "parameters do not match the registered sizes".into(),
            ));
        }
        let mut flat: Vec<f32> = params.iter().flat_map(|p| p.iter().copied()).collect();
        self.comm.broadcast_in_place(&mut flat, 0)?;
        let mut off = 0;
        for p in params.iter_mut() {
            let n = p.len();
            p.copy_from_slice(&flat[off..off + n]);
            off += n;
        }
        Ok(())
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.check_usable()?;
        for (bi, b) in self.buckets.iter_mut().enumerate() {
            if b.inflight {
                return Err(ReducerError::InFlight {
                    param: b.params[0],
                    bucket: bi,
                });
            }
            if let Some(d) = b.data.as_mut() {
                d.fill(0.0);
            }
        }
        Ok(())
    }

    /// The gradient of `param` (averaged after a synchronised `finish`).
    pub fn grad(&self, param: usize) -> Result<&[f32]> {
        let (bi, range) = self.grad_at(param)?;
        let data = self.buckets[bi].data.as_ref();
        Ok(&data.ok_or(ReducerError::InFlight { param, bucket: bi })?[range])
    }

    /// The bucket that holds `param`'s gradient and where in it, once the bucket is not in
    /// flight.
    fn grad_at(&self, param: usize) -> Result<(usize, std::ops::Range<usize>)> {
        self.check_usable()?;
        self.check_param(param)?;
        let (bi, off) = self.loc[param];
        if self.buckets[bi].inflight {
            return Err(ReducerError::InFlight { param, bucket: bi });
        }
        Ok((bi, off..off + self.sizes[param]))
    }

    /// The gradient memory of `param` inside its bucket, to write or accumulate into.
    pub fn grad_mut(&mut self, param: usize) -> Result<&mut [f32]> {
        let (bi, range) = self.grad_at(param)?;
        let data = self.buckets[bi].data.as_mut();
        Ok(&mut data.ok_or(ReducerError::InFlight { param, bucket: bi })?[range])
    }

    /// Starts a backward pass. With `sync == false` (PyTorch's `no_sync`) gradients only
    /// accumulate locally; the next synchronised pass communicates the accumulated sums.
    pub fn prepare_for_backward(&mut self, sync: bool) -> Result<()> {
        self.check_usable()?;
        if self.in_backward {
            return Err(ReducerError::State(
                "prepare_for_backward before finish of the previous pass",
            ));
        }
        self.in_backward = true;
        self.sync = sync;
        self.ready.fill(false);
        self.ready_order.clear();
        self.next_launch = 0;
        for b in &mut self.buckets {
            b.pending = b.params.len();
            b.launched_at = None;
            b.done_at = None;
        }
        self.backward_start = Some(Instant::now());
        Ok(())
    }

    /// Marks the gradient of `param` as complete for this backward pass; launches every bucket
    /// that is complete and next in index order.
    pub fn grad_ready(&mut self, param: usize) -> Result<()> {
        self.check_usable()?;
        self.check_param(param)?;
        if !self.in_backward {
            return Err(ReducerError::State("grad_ready outside a backward pass"));
        }
        if self.ready[param] {
            return Err(ReducerError::AlreadyReady { param });
        }
        self.ready[param] = true;
        self.ready_order.push(param);
        let (bi, _) = self.loc[param];
        self.buckets[bi].pending -= 1;
        if self.sync {
            self.launch_ready()?;
        }
        Ok(())
    }

    fn launch_ready(&mut self) -> Result<()> {
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].pending == 0 {
            self.launch(self.next_launch)?;
            self.next_launch += 1;
        }
        Ok(())
    }

    fn launch(&mut self, bi: usize) -> Result<()> {
        let n = self.comm.size() as f32;
        let comm = self.comm;
        let hook = self.cfg.hook;
        let b = &mut self.buckets[bi];
        let data = b
            .data
            .take()
            .ok_or_else(|| ReducerError::Broken("bucket memory lost".into()))?;
        let inflight = match hook {
            CommHook::Average => {
                InFlight::F32(comm.all_reduce_async::<f32, _>(data, ReduceOp::Avg))
            }
            CommHook::Bf16Compress => {
                let c: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x / n)).collect();
                InFlight::Bf16(comm.all_reduce_async::<bf16, _>(c, ReduceOp::Sum), data)
            }
            CommHook::Fp16Compress => {
                let c: Vec<f16> = data.iter().map(|&x| f16::from_f32(x / n)).collect();
                InFlight::F16(comm.all_reduce_async::<f16, _>(c, ReduceOp::Sum), data)
            }
        };
        b.inflight = true;
        b.launched_at = Some(Instant::now());
        self.outstanding += 1;
        self.jobs
            .send((bi, inflight))
            .map_err(|_| ReducerError::Broken("the watcher thread is gone".into()))
    }

    /// Ends the backward pass. For a synchronised pass: marks gradients that were never
    /// produced (unused parameters) ready, waits for every bucket, and leaves averaged
    /// gradients; after the first synchronised pass rebuilds the buckets in the observed order.
    /// A communication failure is returned (never a hang: every operation has a timeout and a
    /// dead peer fails it); the reducer is unusable afterwards.
    pub fn finish(&mut self) -> Result<StepTimings> {
        self.check_usable()?;
        if !self.in_backward {
            return Err(ReducerError::State("finish without prepare_for_backward"));
        }
        let finish_start = Instant::now();
        let backward = self
            .backward_start
            .map(|t| finish_start - t)
            .unwrap_or_default();
        self.in_backward = false;
        if !self.sync {
            return Ok(StepTimings {
                backward,
                buckets: self.buckets.len(),
                ..Default::default()
            });
        }
        // Unused parameters: ready with whatever they hold, in reverse registration order.
        for p in (0..self.sizes.len()).rev() {
            if !self.ready[p] {
                self.ready[p] = true;
                let (bi, _) = self.loc[p];
                self.buckets[bi].pending -= 1;
            }
        }
        let launched = self.launch_ready();
        let waited = self.wait_all();
        if let Err(e) = launched.and(waited) {
            self.broken = Some(e.to_string());
            return Err(e);
        }
        let end = Instant::now();
        let mut comm = Duration::ZERO;
        let mut prev_done: Option<Instant> = None;
        for b in &self.buckets {
            if let (Some(l), Some(d)) = (b.launched_at, b.done_at) {
                let start = prev_done.map_or(l, |p| p.max(l));
                comm += d.saturating_duration_since(start);
                prev_done = Some(d);
            }
        }
        let timings = StepTimings {
            backward,
            comm,
            exposed: end - finish_start,
            buckets: self.buckets.len(),
        };
        if self.cfg.rebuild_buckets && !self.rebuilt {
            self.rebuild()?;
        }
        Ok(timings)
    }

    fn wait_all(&mut self) -> Result<()> {
        let mut first_err: Option<ReducerError> = None;
        while self.outstanding > 0 {
            let Ok(done) = self.done.recv() else {
                first_err.get_or_insert(ReducerError::Broken("the watcher thread is gone".into()));
                break;
            };
            self.outstanding -= 1;
            let Some(b) = self.buckets.get_mut(done.bucket) else {
                continue;
            };
            b.inflight = false;
            b.done_at = Some(done.at);
            match done.result {
                Ok(d) => b.data = Some(d),
                Err(e) => {
                    b.data = None;
                    first_err.get_or_insert(e.into());
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Rebuilds the buckets in rank 0's observed ready order (broadcast to all ranks).
    fn rebuild(&mut self) -> Result<()> {
        let mut order: Vec<u64> = self.ready_order.iter().map(|&p| p as u64).collect();
        // Parameters that never became ready (unused) go last, reverse registration order.
        for p in (0..self.sizes.len()).rev() {
            if !self.ready_order.contains(&p) {
                order.push(p as u64);
            }
        }
        if let Err(e) = self.comm.broadcast_in_place(&mut order, 0) {
            self.broken = Some(e.to_string());
            return Err(e.into());
        }
        let order: Vec<usize> = order.iter().map(|&p| p as usize).collect();
        validate_permutation(&order, self.sizes.len()).map_err(|m| {
            ReducerError::Mismatch(format!("bucket order received from rank 0: {m}"))
        })?;
        let old = self.all_grads()?;
        self.layout(&order, Some(old));
        self.rebuilt = true;
        Ok(())
    }
}

fn validate_permutation(order: &[usize], n: usize) -> std::result::Result<(), String> {
    if order.len() != n {
        return Err(format!("{} entries for {n} parameters", order.len()));
    }
    let mut seen = vec![false; n];
    for &p in order {
        if p >= n || seen[p] {
            return Err(format!("parameter {p} is out of range or repeated"));
        }
        seen[p] = true;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_never_split_and_respect_caps() {
        let sizes = [10, 300_000, 5, 100, 400_000, 7];
        let order: Vec<usize> = (0..sizes.len()).rev().collect();
        let b = assign_buckets(&order, &sizes, 1 << 20, 2 << 20);
        let flat: Vec<usize> = b.iter().flatten().copied().collect();
        assert_eq!(flat, order);
        // first bucket 1 MiB: 7 + 400000 floats = 1.6 MB > 1 MiB -> param 5 alone
        assert_eq!(b[0], vec![5]);
        assert_eq!(b[1], vec![4, 3, 2]);
        assert_eq!(b[2], vec![1, 0]);
        // one oversized parameter still gets a bucket
        let b = assign_buckets(&[0, 1], &[1000, 10], 16, 16);
        assert_eq!(b, vec![vec![0], vec![1]]);
    }

    #[test]
    fn hook_names() {
        assert_eq!("bf16".parse::<CommHook>(), Ok(CommHook::Bf16Compress));
        assert_eq!("none".parse::<CommHook>(), Ok(CommHook::Average));
        assert!("zip".parse::<CommHook>().is_err());
    }
}
