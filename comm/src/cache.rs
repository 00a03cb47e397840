//! Each call's algorithm (the tuner's choice, remembered per collective and size) and its
//! prepared schedule (cached per call shape: a training loop repeats a few calls, so a repeated
//! call allocates nothing).

use crate::error::{Error, Result};
use crate::executor::Prepared;
use crate::tuning::Tuner;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use weftcc_collectives::call::{self, RawOp};
use weftcc_collectives::schedule::{self, Collective};
use weftcc_collectives::{Algorithm, OpKind};

/// The schedules one communicator has prepared, and its tuner's remembered choices.
#[derive(Default)]
pub(crate) struct ScheduleCache {
    /// Prepared schedules of recent distinct calls (a training loop repeats the same few).
    schedules: HashMap<ScheduleKey, Arc<Prepared>, BuildHasherDefault<KeyHasher>>,
    /// The previous call's shape and its prepared schedule: a repeated call (a benchmark loop,
    /// a training step's buckets of one size) skips the tuner and schedule lookups.
    last: Option<(CallShape, Arc<Prepared>)>,
    /// The tuner's choice per (collective, bytes) already asked for.
    choices: HashMap<(OpKind, usize), Algorithm, BuildHasherDefault<KeyHasher>>,
}

/// Who prepares: the rank, its communicator's size and settings, and its tuner.
pub(crate) struct Preparer<'a> {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    /// Largest message of a pipelined transfer (`WEFT_SLICE_BYTES`).
    pub(crate) slice_bytes: usize,
    pub(crate) tuner: &'a Tuner,
}

impl ScheduleCache {
    /// The schedule of the previous call, when it had this shape.
    pub(crate) fn repeated(&self, shape: &CallShape) -> Option<&Arc<Prepared>> {
        match &self.last {
            Some((last, prepared)) if last == shape => Some(prepared),
            _ => None,
        }
    }

    /// Prepares (or finds) the schedule of a call of this shape and remembers it as the last.
    pub(crate) fn prepare_last(
        &mut self,
        by: &Preparer<'_>,
        call: &RawOp,
        shape: CallShape,
        seq: u64,
    ) -> Result<&Arc<Prepared>> {
        let prepared = self.prepare(by, call, shape, seq)?;
        Ok(&self.last.insert((shape, prepared)).1)
    }

    /// The prepared schedule of a call of this shape: the tuner's choice (remembered per
    /// collective and size) and the schedule (cached per [`ScheduleKey`]), built on a miss.
    fn prepare(
        &mut self,
        by: &Preparer<'_>,
        call: &RawOp,
        shape: CallShape,
        seq: u64,
    ) -> Result<Arc<Prepared>> {
        let (r, n, count) = (by.rank, by.size, call.count);
        let slice = (by.slice_bytes / call.dtype.size()).max(1);
        // nccl-tests size: the largest user buffer of the call.
        let user_bytes = match call.kind {
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => count.saturating_mul(n),
            _ => count,
        }
        .saturating_mul(call.dtype.size());
        // The model's answer depends only on the collective and size: remember it (evaluating
        // every algorithm's cost was an eighth of an 8-byte all-reduce).
        let choice = match self.choices.get(&(call.kind, user_bytes)) {
            _ if n == 1 => Algorithm::Ring,
            _ if shape.ordered => Algorithm::Ordered,
            Some(&c) => {
                tracing::debug!(target: "weftcc::tuning", rank = r, op = %call.kind, seq, bytes = user_bytes, algo = c.name(), "algorithm chosen (remembered)");
                c
            }
            None => {
                let c = by.tuner.choose(call.kind, user_bytes, r, seq);
                if self.choices.len() >= SCHEDULE_CACHE_ENTRIES {
                    self.choices.clear();
                }
                self.choices.insert((call.kind, user_bytes), c);
                c
            }
        };
        let key = ScheduleKey {
            shape,
            algo: choice,
        };
        if let Some(prepared) = self.schedules.get(&key) {
            return Ok(Arc::clone(prepared));
        }
        if call.kind == OpKind::SendRecv {
            return Err(Error::InvalidArgument {
                rank: r,
                op: call.kind,
                reason: call::CallError::PointToPointAsCollective,
            });
        }
        let collective = Collective {
            kind: call.kind,
            rank: r,
            nranks: n,
            root: call.root,
            count,
            slice_elems: slice,
            in_place: shape.in_place,
        };
        let sched =
            schedule::select(&collective, choice, Some(by.tuner.layout())).map_err(|e| {
                Error::Internal {
                    rank: r,
                    op: call.kind,
                    seq,
                    reason: e.to_string(),
                }
            })?;
        if self.schedules.len() >= SCHEDULE_CACHE_ENTRIES {
            self.schedules.clear();
        }
        let prepared = Arc::new(Prepared::new(sched).built_by(choice));
        self.schedules.insert(key, Arc::clone(&prepared));
        Ok(prepared)
    }
}

/// What decides a collective call's schedule apart from the tuner's choice (rank, size and the
/// settings are fixed per communicator; the choice follows from the kind and the bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CallShape {
    kind: OpKind,
    count: usize,
    esize: usize,
    root: usize,
    /// In-place all-to-all (the only collective whose schedule differs in place).
    in_place: bool,
    /// Deterministic mode folds this call in rank order (a float reduction): an integer call of
    /// the same element size must not reuse its schedule, nor it an integer call's.
    ordered: bool,
}

impl CallShape {
    /// The shape of `call`, in place or not, on a communicator in deterministic mode or not:
    /// the fields a call ignores (a root it has no use for) are left out, so they never split
    /// the cache.
    pub(crate) fn of(call: &RawOp, in_place: bool, deterministic: bool) -> CallShape {
        CallShape {
            kind: call.kind,
            count: call.count,
            esize: call.dtype.size(),
            root: if call.has_root() { call.root } else { 0 },
            in_place: in_place && call.kind == OpKind::AllToAll,
            ordered: deterministic && call.order_sensitive(),
        }
    }
}

/// What makes two calls' schedules identical: the shape and the tuner's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ScheduleKey {
    pub(crate) shape: CallShape,
    pub(crate) algo: Algorithm,
}

/// A fast hasher for [`ScheduleKey`] (SipHash's flood resistance buys nothing for keys that
/// are this rank's own calls, and cost a tenth of a small operation).
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// Bound on cached schedules: a sweep over many sizes must not grow memory without limit.
pub(crate) const SCHEDULE_CACHE_ENTRIES: usize = 64;
