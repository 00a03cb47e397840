//! Reduction operations and the kinds of collective operation.

use std::fmt;
use std::str::FromStr;

/// A reduction, as NCCL's `ncclRedOp_t` (plus the pre-multiplied sum created by
/// `ncclRedOpCreatePreMulSum`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Min,
    Max,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg,
    /// Each rank's input is multiplied by this rank's scalar, then summed. Scalars may differ
    /// between ranks, as in NCCL.
    PreMulSum(f64),
}

impl ReduceOp {
    /// The ops nccl-tests sweeps with `-o all`.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// nccl-tests' name (`sum`, `prod`, `min`, `max`, `avg`, `premulsum`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premulsum",
        }
    }

    /// Wire code used in op headers (the scalar of `PreMulSum` is not compared across ranks).
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
            ReduceOp::PreMulSum(_) => 5,
        }
    }

    /// The element-wise combination the schedule's reduce steps apply: `Avg` and `PreMulSum`
    /// are sums whose scaling happens once, before or after the algorithm.
    pub const fn combiner(self) -> Combiner {
        match self {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => Combiner::Sum,
            ReduceOp::Prod => Combiner::Prod,
            ReduceOp::Min => Combiner::Min,
            ReduceOp::Max => Combiner::Max,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for a reduction name that is not known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown reduction {0:?} (expected sum, prod, min, max, avg)")]
pub struct UnknownReduceOp(pub String);

impl FromStr for ReduceOp {
    type Err = UnknownReduceOp;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" => Ok(ReduceOp::Prod),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "avg" => Ok(ReduceOp::Avg),
            _ => Err(UnknownReduceOp(s.to_string())),
        }
    }
}

/// The binary element-wise operation a reduce step applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Combiner {
    Sum,
    Prod,
    Min,
    Max,
}

/// The kind of a collective operation (named in errors and op headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    AllReduce = 1,
    Reduce = 2,
    Broadcast = 3,
    AllGather = 4,
    ReduceScatter = 5,
    AllToAll = 6,
    SendRecv = 7,
    Barrier = 8,
}

impl OpKind {
    /// Every kind, in wire-code order.
    pub const ALL: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::SendRecv,
        OpKind::Barrier,
    ];

    /// The kind with this wire code, if any.
    pub fn from_code(code: u8) -> Option<OpKind> {
        OpKind::ALL.iter().copied().find(|k| *k as u8 == code)
    }

    /// Whether a call of this kind reduces (its reduction matters).
    pub const fn has_reduction(self) -> bool {
        matches!(
            self,
            OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter
        )
    }

    /// Whether a call of this kind has a root.
    pub const fn has_root(self) -> bool {
        matches!(self, OpKind::Reduce | OpKind::Broadcast)
    }

    /// Lower-case name with hyphens, as `weft perf` spells it (`all-reduce`).
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all-reduce",
            OpKind::Reduce => "reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all-gather",
            OpKind::ReduceScatter => "reduce-scatter",
            OpKind::AllToAll => "all-to-all",
            OpKind::SendRecv => "send/recv",
            OpKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
