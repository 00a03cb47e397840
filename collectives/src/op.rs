//! Reduction operations and the kinds of collective operation.

use std::fmt;
use std::str::FromStr;

use crate::UnknownName;

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

impl FromStr for ReduceOp {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" => Ok(ReduceOp::Prod),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "avg" => Ok(ReduceOp::Avg),
            _ => Err(UnknownName::new("reduction", s, "sum, prod, min, max, avg")),
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

wire_enum! {
    /// The kind of a collective operation (named in errors and op headers).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum OpKind {
        AllReduce = 1 => "all-reduce",
        Reduce = 2 => "reduce",
        Broadcast = 3 => "broadcast",
        AllGather = 4 => "all-gather",
        ReduceScatter = 5 => "reduce-scatter",
        AllToAll = 6 => "all-to-all",
        SendRecv = 7 => "send/recv",
        Barrier = 8 => "barrier",
    }
    /// Every kind, in wire-code order.
    const ALL;
    /// Lower-case name with hyphens, as `weft perf` spells it (`all-reduce`).
    fn name;
}

impl OpKind {
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
}
