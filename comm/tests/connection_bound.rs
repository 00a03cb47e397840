//! The peers a rank connects to for ring, tree and recursive-doubling collectives stay within
//! `weftcc_transports::mesh::typical_peers(n)` (2⌈log2 n⌉ + 4), the figure the shared-memory
//! pre-check budgets for, at every rank of many communicator sizes.

use std::collections::BTreeSet;
use weftcc_collectives::schedule::{select, Collective};
use weftcc_collectives::{Algorithm, OpKind};
use weftcc_transports::mesh::typical_peers;

/// Every peer rank `r` of `n` exchanges data with over a job that runs each of these
/// collectives with each of these algorithms (roots 0 and n-1).
fn union_of_peers(r: usize, n: usize) -> BTreeSet<usize> {
    let mut peers = BTreeSet::new();
    let calls = [
        (OpKind::AllReduce, Algorithm::Ring),
        (OpKind::AllReduce, Algorithm::Tree),
        (OpKind::AllReduce, Algorithm::Rd),
        (OpKind::AllGather, Algorithm::Ring),
        (OpKind::AllGather, Algorithm::Rd),
        (OpKind::ReduceScatter, Algorithm::Ring),
        (OpKind::ReduceScatter, Algorithm::Rd),
        (OpKind::Broadcast, Algorithm::Tree),
        (OpKind::Broadcast, Algorithm::Ring),
        (OpKind::Reduce, Algorithm::Tree),
        (OpKind::Reduce, Algorithm::Ring),
    ];
    for (kind, algorithm) in calls {
        for root in [0, n - 1] {
            let call = Collective {
                kind,
                rank: r,
                nranks: n,
                root,
                count: 64,
                slice_elems: 16,
                in_place: false,
            };
            let s = select(&call, algorithm, None).expect("schedule");
            peers.extend(s.send_peers.iter().chain(&s.recv_peers).copied());
        }
    }
    peers.remove(&r);
    peers
}

#[test]
fn ring_tree_and_doubling_collectives_connect_at_most_2_log2_n_plus_4_peers() {
    let mut sizes: Vec<usize> = (2..=70).collect();
    sizes.extend([96, 127, 128, 129, 255, 256, 257, 511, 512, 1000]);
    for n in sizes {
        let bound = typical_peers(n);
        let step = (n / 64).max(1);
        for r in (0..n).step_by(step).chain([n - 1]) {
            let peers = union_of_peers(r, n);
            assert!(
                peers.len() <= bound,
                "rank {r} of {n} connects {} peers, more than {bound}: {peers:?}",
                peers.len()
            );
        }
    }
    // The bound is not slack everywhere: rank 0 of 256 needs most of it.
    assert!(union_of_peers(0, 256).len() >= 8);
}
