//! Each call's algorithm (the tuner's choice, remembered per collective and size) and its
//! prepared schedule (cached per call shape: a training loop repeats a few calls, so a repeated
//! call allocates nothing).

use crate::communicator::{Inner, State};
use crate::engine::Prepared;
use crate::error::{Error, Result};
use std::hash::Hasher;
use std::sync::Arc;
use weftcc_collectives::call::{self, RawOp};
use weftcc_collectives::schedule::{self, Collective};
use weftcc_collectives::{Algorithm, DataType, OpKind};

impl Inner {
    pub(crate) fn slice_elems(&self, dtype: DataType) -> usize {
        (self.config.slice_bytes / dtype.size()).max(1)
    }

    /// The prepared schedule of a call of this shape: the tuner's choice (remembered per
    /// collective and size) and the schedule (cached per [`ScheduleKey`]), built on a miss.
    pub(crate) fn prepare(
        &self,
        st: &mut State,
        call: &RawOp,
        shape: CallShape,
        seq: u64,
    ) -> Result<Arc<Prepared>> {
        let (r, n, count) = (self.rank, self.size, call.count);
        let slice = self.slice_elems(call.dtype);
        // nccl-tests size: the largest user buffer of the call.
        let user_bytes = match call.kind {
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => count.saturating_mul(n),
            _ => count,
        }
        .saturating_mul(call.dtype.size());
        // The model's answer depends only on the collective and size: remember it (evaluating
        // every algorithm's cost was an eighth of an 8-byte all-reduce).
        let choice = match st.choices.get(&(call.kind, user_bytes)) {
            _ if n == 1 => Algorithm::Ring,
            _ if shape.ordered => Algorithm::Ordered,
            Some(&c) => {
                tracing::debug!(target: "weftcc::tuning", rank = r, op = %call.kind, seq, bytes = user_bytes, algo = c.name(), "algorithm chosen (remembered)");
                c
            }
            None => {
                let c = self.tuner.choose(call.kind, user_bytes, r, seq);
                if st.choices.len() >= SCHEDULE_CACHE_ENTRIES {
                    st.choices.clear();
                }
                st.choices.insert((call.kind, user_bytes), c);
                c
            }
        };
        let key = ScheduleKey {
            shape,
            algo: choice,
        };
        if let Some(prepared) = st.schedules.get(&key) {
            return Ok(Arc::clone(prepared));
        }
        if call.kind == OpKind::SendRecv {
            return Err(self.invalid(call.kind, call::CallError::PointToPointAsCollective));
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
            schedule::select(&collective, choice, Some(self.tuner.layout())).map_err(|e| {
                Error::Internal {
                    rank: r,
                    op: call.kind,
                    seq,
                    reason: e.to_string(),
                }
            })?;
        if st.schedules.len() >= SCHEDULE_CACHE_ENTRIES {
            st.schedules.clear();
        }
        let prepared = Arc::new(Prepared::new(sched).built_by(choice));
        st.schedules.insert(key, Arc::clone(&prepared));
        Ok(prepared)
    }
}

/// What decides a collective call's schedule apart from the tuner's choice (rank, size and the
/// settings are fixed per communicator; the choice follows from the kind and the bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CallShape {
    pub(crate) kind: OpKind,
    pub(crate) count: usize,
    pub(crate) esize: usize,
    pub(crate) root: usize,
    /// In-place all-to-all (the only collective whose schedule differs in place).
    pub(crate) in_place: bool,
    /// Deterministic mode folds this call in rank order (a float reduction): an integer call of
    /// the same element size must not reuse its schedule, nor it an integer call's.
    pub(crate) ordered: bool,
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
