//! Algorithm → schedule: the one table that says which builder runs a collective under an
//! algorithm. The host runtime and the CUDA path both call [`select`].

use super::hierarchical::{hierarchical_all_reduce, HostLayout};
use super::ordered::{ordered_all_reduce, ordered_reduce, ordered_reduce_scatter};
use super::tree::{tree_all_reduce, tree_broadcast, tree_reduce};
use super::{
    chain_broadcast, chain_reduce, dissemination_barrier, pairwise_all_to_all,
    recursive_doubling_all_gather, recursive_doubling_all_reduce, recursive_halving_reduce_scatter,
    ring_all_gather, ring_all_reduce, ring_reduce_scatter, Part, Schedule, ScheduleError,
};
use crate::algorithm::Algorithm;
use crate::op::OpKind;

/// One rank's collective call, as far as its schedule depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Collective {
    pub kind: OpKind,
    pub rank: usize,
    pub nranks: usize,
    /// The root of broadcast and reduce (ignored by the others).
    pub root: usize,
    /// Elements per rank, as in the call.
    pub count: usize,
    /// The largest message, in elements.
    pub slice_elems: usize,
    /// Input and output are the same memory (only all-to-all's schedule differs then).
    pub in_place: bool,
}

impl Collective {
    /// What the builders take: rank, nranks, count and slice size.
    pub fn part(&self) -> Part {
        Part {
            rank: self.rank,
            nranks: self.nranks,
            count: self.count,
            slice_elems: self.slice_elems,
        }
    }
}

/// The schedule `algorithm` gives `call`. An algorithm that has no schedule for the collective
/// runs the ring (or chain) one: tree and rd for all-to-all, rd for all-gather and
/// reduce-scatter on a number of ranks that is not a power of two, hier without a `hosts`
/// layout or for anything but all-reduce, ordered for the collectives that combine nothing
/// (their results do not depend on an order). Point-to-point is not a collective
/// ([`ScheduleError::NotCollective`]; groups are built by [`super::p2p`]).
pub fn select(
    call: &Collective,
    algorithm: Algorithm,
    hosts: Option<&HostLayout>,
) -> Result<Schedule, ScheduleError> {
    let Collective {
        kind,
        rank: r,
        nranks: n,
        root,
        count,
        slice_elems: slice,
        in_place,
    } = *call;
    let p = call.part();
    match (kind, algorithm) {
        (OpKind::AllReduce, Algorithm::Ordered) => ordered_all_reduce(p),
        (OpKind::Reduce, Algorithm::Ordered) => ordered_reduce(p, root),
        (OpKind::ReduceScatter, Algorithm::Ordered) => ordered_reduce_scatter(p),
        (OpKind::AllReduce, Algorithm::Rd) => recursive_doubling_all_reduce(p),
        (OpKind::AllReduce, Algorithm::Tree) => tree_all_reduce(p),
        (OpKind::AllReduce, Algorithm::Hier) => match hosts {
            Some(layout) if layout.nranks() == n => {
                hierarchical_all_reduce(r, layout, count, slice)
            }
            _ => ring_all_reduce(p),
        },
        // One-shot runs without a schedule; asked for one, it gets the ring.
        (OpKind::AllReduce, Algorithm::Ring | Algorithm::OneShot) => ring_all_reduce(p),
        (OpKind::Reduce, Algorithm::Tree) => tree_reduce(p, root),
        (OpKind::Reduce, _) => chain_reduce(p, root),
        (OpKind::Broadcast, Algorithm::Tree) => tree_broadcast(p, root),
        (OpKind::Broadcast, _) => chain_broadcast(p, root),
        (OpKind::AllGather, Algorithm::Rd) if n.is_power_of_two() => {
            recursive_doubling_all_gather(p)
        }
        (OpKind::AllGather, _) => ring_all_gather(p),
        (OpKind::ReduceScatter, Algorithm::Rd) if n.is_power_of_two() => {
            recursive_halving_reduce_scatter(p)
        }
        (OpKind::ReduceScatter, _) => ring_reduce_scatter(p),
        (OpKind::AllToAll, _) => pairwise_all_to_all(p, in_place),
        (OpKind::Barrier, _) => dissemination_barrier(r, n),
        (OpKind::SendRecv, _) => Err(ScheduleError::NotCollective { kind }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(kind: OpKind, rank: usize, nranks: usize) -> Collective {
        Collective {
            kind,
            rank,
            nranks,
            root: 0,
            count: 10,
            slice_elems: 3,
            in_place: false,
        }
    }

    #[test]
    fn each_pair_runs_its_builder_and_falls_back_to_the_ring() {
        let c = call(OpKind::AllReduce, 1, 4);
        assert_eq!(
            select(&c, Algorithm::Rd, None),
            recursive_doubling_all_reduce(c.part())
        );
        assert_eq!(select(&c, Algorithm::Tree, None), tree_all_reduce(c.part()));
        assert_eq!(select(&c, Algorithm::Hier, None), ring_all_reduce(c.part()));
        let hosts = HostLayout::from_labels(&[0, 0, 1, 1]);
        assert_eq!(
            select(&c, Algorithm::Hier, Some(&hosts)),
            hierarchical_all_reduce(1, &hosts, 10, 3)
        );
        let ag = call(OpKind::AllGather, 1, 3);
        assert_eq!(select(&ag, Algorithm::Rd, None), ring_all_gather(ag.part()));
        let rs = call(OpKind::ReduceScatter, 1, 4);
        assert_eq!(
            select(&rs, Algorithm::Rd, None),
            recursive_halving_reduce_scatter(rs.part())
        );
        let a2a = Collective {
            in_place: true,
            ..call(OpKind::AllToAll, 2, 3)
        };
        assert_eq!(
            select(&a2a, Algorithm::Tree, None),
            pairwise_all_to_all(a2a.part(), true)
        );
        assert_eq!(
            select(&call(OpKind::SendRecv, 0, 2), Algorithm::Ring, None),
            Err(ScheduleError::NotCollective {
                kind: OpKind::SendRecv
            })
        );
    }
}
