//! The shape rules of every call, in one place: what a collective of a given kind, type, count
//! and root reads and writes on each rank, and why a call is invalid.
//!
//! The host communicator, the CUDA device communicator and the C ABI all check calls here, so
//! they accept the same calls and reject the same ones with the same [`CallError`].

use crate::dtype::DataType;
use crate::op::{OpKind, ReduceOp};

/// One collective call, untyped: what every rank must agree on (the host runtime's
/// `execute_raw`, the device path and the C ABI describe calls this way).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawOp {
    pub kind: OpKind,
    pub dtype: DataType,
    /// Elements per rank: the all-reduce/broadcast/reduce buffer, one all-gather or
    /// reduce-scatter block, one all-to-all block.
    pub count: usize,
    pub op: ReduceOp,
    pub root: usize,
}

/// Why a call is invalid. Nothing was sent when a call fails with one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The root of a broadcast or reduce is not a rank of the communicator.
    #[error("root {root} is out of range for {nranks} ranks")]
    RootOutOfRange { root: usize, nranks: usize },
    /// A point-to-point partner is not a rank of the communicator.
    #[error("peer {peer} is out of range for {nranks} ranks")]
    PeerOutOfRange { peer: usize, nranks: usize },
    /// A rank named itself as its point-to-point partner.
    #[error("rank {peer} cannot send to or receive from itself")]
    SelfPeer { peer: usize },
    /// The buffers the count implies do not fit in memory.
    #[error("count overflows")]
    CountOverflow,
    /// The send buffer of an out-of-place call has the wrong length.
    #[error("send buffer has {got} bytes, expected {expected} ({dtype} × {} elements)", expected / dtype.size())]
    SendLength {
        got: usize,
        expected: usize,
        dtype: DataType,
    },
    /// The receive buffer of an out-of-place call has the wrong length.
    #[error("receive buffer has {got} bytes, expected {expected} ({dtype} × {} elements)", expected / dtype.size())]
    RecvLength {
        got: usize,
        expected: usize,
        dtype: DataType,
    },
    /// The buffer of an in-place call has the wrong length; `blocks` is the rank count when the
    /// buffer holds one block per rank.
    #[error("buffer has {got} bytes, expected {expected} ({} elements of {dtype}{})",
        expected / dtype.size(),
        blocks.map(|n| format!(", a multiple of {n} ranks")).unwrap_or_default())]
    InPlaceLength {
        got: usize,
        expected: usize,
        dtype: DataType,
        blocks: Option<usize>,
    },
    /// Point-to-point goes through groups (send/recv), not through a collective call.
    #[error("use group()/send()/recv() for point-to-point")]
    PointToPointAsCollective,
    /// A data type code (the C ABI's) that names no type.
    #[error("data type {code} is not a weftcc data type")]
    UnknownDataType { code: i64 },
    /// A reduction code (the C ABI's) that names no reduction.
    #[error("reduction {code} is not a weftcc reduction")]
    UnknownReduction { code: i64 },
    /// A root or peer given as a negative number (the C ABI's `int`).
    #[error("{what} {value} is not a rank")]
    NegativeRank { what: &'static str, value: i64 },
    /// A buffer pointer is null while its length is not zero.
    #[error("the {which} buffer is null")]
    NullBuffer { which: &'static str },
    /// Send and receive buffers overlap other than in NCCL's in-place layout.
    #[error("send and receive buffers overlap other than in NCCL's in-place layout")]
    Overlap,
    /// A receive buffer of a group shares bytes with another buffer of the group.
    #[error("a receive buffer overlaps another buffer of the group")]
    GroupOverlap,
}

/// Where a validated call's logical buffers lie in the caller's memory (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Input and output share the receive buffer.
    pub in_place: bool,
    /// Offset of the logical Input inside the receive buffer when in place.
    pub input_offset: usize,
    /// Offset of the logical Output inside the receive buffer when in place.
    pub output_offset: usize,
    /// Bytes of the logical Input.
    pub input_len: usize,
}

impl RawOp {
    /// An operation with `Sum` and root 0.
    #[inline]
    pub fn new(kind: OpKind, dtype: DataType, count: usize) -> Self {
        RawOp {
            kind,
            dtype,
            count,
            op: ReduceOp::Sum,
            root: 0,
        }
    }

    /// Whether `rank` reads its send buffer (out of place): off the root a broadcast does not,
    /// so its send buffer may be of any length there.
    #[inline]
    pub fn reads_send(&self, rank: usize) -> bool {
        self.root == rank || self.kind != OpKind::Broadcast
    }

    /// Whether `rank` writes its receive buffer: off the root a reduce does not, so out of
    /// place its receive buffer may be of any length (or none) there.
    #[inline]
    pub fn writes_recv(&self, rank: usize) -> bool {
        self.root == rank || self.kind != OpKind::Reduce
    }

    /// This call as rank `rank` of `nranks` runs it, for [`crate::schedule::select`]: messages
    /// of at most `slice_elems` elements, `in_place` when input and output are one buffer.
    pub fn collective(
        &self,
        rank: usize,
        nranks: usize,
        slice_elems: usize,
        in_place: bool,
    ) -> crate::schedule::Collective {
        crate::schedule::Collective {
            kind: self.kind,
            rank,
            nranks,
            root: self.root,
            count: self.count,
            slice_elems,
            in_place,
        }
    }

    /// Sets the reduction.
    #[inline]
    pub fn with_op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// Sets the root.
    #[inline]
    pub fn with_root(mut self, root: usize) -> Self {
        self.root = root;
        self
    }

    /// Whether the call reduces (its `op` matters).
    pub fn has_reduction(&self) -> bool {
        self.kind.has_reduction()
    }

    /// Whether the result depends on the order in which ranks' values are combined: the
    /// floating-point reductions (integer ones are exact in any order). Deterministic mode folds
    /// these in rank order ([`crate::Algorithm::Ordered`]).
    pub fn order_sensitive(&self) -> bool {
        self.has_reduction() && self.dtype.is_float()
    }

    /// Whether the call has a root (its `root` matters).
    pub fn has_root(&self) -> bool {
        self.kind.has_root()
    }

    /// The call a typed API makes of its buffers (lengths in elements): the count is taken from
    /// the buffer that holds one block (`send` for all-reduce, reduce, all-gather and
    /// all-to-all, `recv` for broadcast and reduce-scatter; an in-place buffer holds `nranks`
    /// blocks for all-gather, reduce-scatter and all-to-all). [`RawOp::plan`] then checks the
    /// other buffer against it.
    #[inline]
    pub fn from_lengths(
        kind: OpKind,
        dtype: DataType,
        nranks: usize,
        send: Option<usize>,
        recv: usize,
    ) -> RawOp {
        let per_rank = |len: usize| len / nranks.max(1);
        let count = match (kind, send) {
            (OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll, None) => per_rank(recv),
            (_, None) => recv,
            (OpKind::AllToAll, Some(s)) => per_rank(s),
            (OpKind::AllReduce | OpKind::Reduce | OpKind::AllGather, Some(s)) => s,
            (_, Some(_)) => recv,
        };
        RawOp::new(kind, dtype, count)
    }

    /// Checks the call on `rank` of `nranks` against its buffers (bytes: `send` is `None` in
    /// place) and says where its logical Input and Output lie.
    ///
    /// Out of place, both buffers must have exactly the lengths the count implies, except the
    /// side a rank does not use (a broadcast's send buffer and a reduce's receive buffer off
    /// the root), which may be anything. In place, the one buffer holds the whole call (n
    /// blocks for all-gather, reduce-scatter and all-to-all, block `rank` being this rank's).
    // Inlined into its callers: returned through memory, the Result was read back in wider loads
    // than it was written with (a store-forwarding stall per call).
    #[inline(always)]
    pub fn plan(
        &self,
        rank: usize,
        nranks: usize,
        send: Option<usize>,
        recv: usize,
    ) -> Result<Plan, CallError> {
        let kind = self.kind;
        let dtype = self.dtype;
        if self.has_root() && self.root >= nranks {
            return Err(CallError::RootOutOfRange {
                root: self.root,
                nranks,
            });
        }
        let count_bytes = self
            .count
            .checked_mul(dtype.size())
            .ok_or(CallError::CountOverflow)?;
        let all_bytes = count_bytes
            .checked_mul(nranks)
            .ok_or(CallError::CountOverflow)?;
        let is_root = self.root == rank;
        let (input_len, output_len, in_off, out_off) = match kind {
            OpKind::AllReduce => (count_bytes, count_bytes, 0, 0),
            OpKind::Reduce => (count_bytes, if is_root { count_bytes } else { 0 }, 0, 0),
            OpKind::Broadcast => (if is_root { count_bytes } else { 0 }, count_bytes, 0, 0),
            OpKind::AllGather => (count_bytes, all_bytes, rank * count_bytes, 0),
            OpKind::ReduceScatter => (all_bytes, count_bytes, 0, rank * count_bytes),
            OpKind::AllToAll => (all_bytes, all_bytes, 0, 0),
            OpKind::Barrier => (0, 0, 0, 0),
            OpKind::SendRecv => return Err(CallError::PointToPointAsCollective),
        };
        match send {
            Some(s) => {
                // Off the root, a broadcast reads no send buffer and a reduce writes no receive
                // buffer: those sides may be anything.
                let send_used = self.reads_send(rank);
                let recv_used = self.writes_recv(rank);
                if send_used && s != input_len {
                    return Err(CallError::SendLength {
                        got: s,
                        expected: input_len,
                        dtype,
                    });
                }
                if recv_used && recv != output_len {
                    return Err(CallError::RecvLength {
                        got: recv,
                        expected: output_len,
                        dtype,
                    });
                }
                Ok(Plan {
                    in_place: false,
                    input_offset: 0,
                    output_offset: 0,
                    input_len,
                })
            }
            None => {
                let blocked = matches!(
                    kind,
                    OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll
                );
                let whole = match kind {
                    _ if blocked => all_bytes,
                    OpKind::Barrier => 0,
                    _ => count_bytes,
                };
                if recv != whole {
                    return Err(CallError::InPlaceLength {
                        got: recv,
                        expected: whole,
                        dtype,
                        blocks: blocked.then_some(nranks),
                    });
                }
                Ok(Plan {
                    in_place: true,
                    input_offset: in_off,
                    output_offset: out_off,
                    input_len,
                })
            }
        }
    }
}

/// Checks that `peer` can be a point-to-point partner of `rank` among `nranks` ranks.
pub fn check_peer(rank: usize, nranks: usize, peer: usize) -> Result<(), CallError> {
    if peer >= nranks {
        Err(CallError::PeerOutOfRange { peer, nranks })
    } else if peer == rank {
        Err(CallError::SelfPeer { peer })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_blocks_sit_at_this_ranks_offset() {
        let c = RawOp::new(OpKind::AllGather, DataType::Float32, 4);
        let p = c.plan(1, 3, None, 48).unwrap();
        assert_eq!((p.input_offset, p.output_offset, p.input_len), (16, 0, 16));
        let c = RawOp::new(OpKind::ReduceScatter, DataType::Float64, 2);
        let p = c.plan(2, 3, None, 48).unwrap();
        assert_eq!((p.input_offset, p.output_offset, p.input_len), (0, 32, 48));
    }

    #[test]
    fn lengths_must_match_exactly_except_the_unused_side() {
        let c = RawOp::new(OpKind::AllReduce, DataType::Int8, 5);
        assert_eq!(
            c.plan(0, 3, Some(4), 5),
            Err(CallError::SendLength {
                got: 4,
                expected: 5,
                dtype: DataType::Int8
            })
        );
        assert!(c.plan(0, 3, Some(6), 5).is_err());
        assert!(c.plan(0, 3, Some(5), 6).is_err());
        assert!(c.plan(0, 3, Some(5), 5).is_ok());
        let b = RawOp::new(OpKind::Broadcast, DataType::Int8, 5).with_root(1);
        assert!(b.plan(0, 3, Some(0), 5).is_ok());
        assert!(b.plan(1, 3, Some(0), 5).is_err());
        let r = RawOp::new(OpKind::Reduce, DataType::Int8, 5).with_root(1);
        assert!(r.plan(0, 3, Some(5), 0).is_ok());
        assert!(r.plan(1, 3, Some(5), 0).is_err());
        let g = RawOp::new(OpKind::AllGather, DataType::Float32, 4);
        assert_eq!(
            g.plan(1, 3, None, 44).unwrap_err().to_string(),
            "buffer has 44 bytes, expected 48 (12 elements of float, a multiple of 3 ranks)"
        );
    }

    #[test]
    fn roots_peers_and_overflow_are_checked() {
        let r = RawOp::new(OpKind::Reduce, DataType::Int8, 5).with_root(3);
        assert_eq!(
            r.plan(0, 3, Some(5), 5).unwrap_err().to_string(),
            "root 3 is out of range for 3 ranks"
        );
        let big = RawOp::new(OpKind::AllGather, DataType::Float64, usize::MAX / 4);
        assert_eq!(big.plan(0, 2, None, 0), Err(CallError::CountOverflow));
        let p2p = RawOp::new(OpKind::SendRecv, DataType::Int8, 1);
        assert_eq!(
            p2p.plan(0, 2, None, 1),
            Err(CallError::PointToPointAsCollective)
        );
        assert_eq!(
            check_peer(1, 2, 2),
            Err(CallError::PeerOutOfRange { peer: 2, nranks: 2 })
        );
        assert_eq!(check_peer(1, 2, 1), Err(CallError::SelfPeer { peer: 1 }));
        assert_eq!(check_peer(1, 2, 0), Ok(()));
    }

    #[test]
    fn typed_calls_take_their_count_from_the_one_block_buffer() {
        let dt = DataType::Float32;
        let count = |k, s, r| RawOp::from_lengths(k, dt, 4, s, r).count;
        assert_eq!(count(OpKind::AllReduce, Some(6), 6), 6);
        assert_eq!(count(OpKind::Broadcast, Some(0), 6), 6);
        assert_eq!(count(OpKind::AllGather, Some(3), 12), 3);
        assert_eq!(count(OpKind::ReduceScatter, Some(12), 3), 3);
        assert_eq!(count(OpKind::AllToAll, Some(12), 12), 3);
        assert_eq!(count(OpKind::AllGather, None, 12), 3);
        assert_eq!(count(OpKind::Reduce, None, 12), 12);
    }
}
