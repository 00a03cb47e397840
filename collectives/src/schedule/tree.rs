//! Tree algorithms as pure schedules: double-binary-tree all-reduce and pipelined binary-tree
//! broadcast and reduce.
//!
//! The trees are heap-shaped over positions `0..n` (position `p` has children `2p + 1` and
//! `2p + 2`, parent `(p - 1) / 2`), so their depth is `⌊log2 n⌋`. Ranks are placed on positions
//! by a [`Labeling`]:
//! * broadcast and reduce rotate the ranks so that the root sits at position 0;
//! * the all-reduce uses two trees: tree 0 places rank `r` at position `r`, tree 1 at position
//!   `n - 1 - r`. The interior positions of a heap over `n` nodes are `0..⌊n/2⌋`, so the interior
//!   ranks of tree 0 are `0..⌊n/2⌋` and those of tree 1 are `⌈n/2⌉..n`: no rank is interior in
//!   both trees, and every rank forwards (sends to children) at most one half of the data.
//!
//! Like the other builders, these compute one rank's steps from (rank, nranks, root, count,
//! slice) alone and perform no I/O (see [`crate::schedule`] for the execution rules).

use super::build::{collective, even_chunk, slices, Builder};
use super::{BufId, Part, Region, Schedule, ScheduleError, StepId};

/// How ranks are placed on the positions of a heap-shaped tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labeling {
    /// Rank `r` at position `(r - root) mod n`: the root at position 0.
    Rotated { root: usize },
    /// Rank `r` at position `n - 1 - r` (tree 1 of the double binary tree).
    Reversed,
}

impl Labeling {
    fn pos(self, rank: usize, n: usize) -> usize {
        match self {
            Labeling::Rotated { root } => super::build::before(rank, root, n),
            Labeling::Reversed => n - 1 - rank,
        }
    }

    fn rank(self, pos: usize, n: usize) -> usize {
        match self {
            Labeling::Rotated { root } => (pos + root) % n,
            Labeling::Reversed => n - 1 - pos,
        }
    }
}

/// One rank's place in a tree: its parent (none at the root) and its children (at most two).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeNode {
    /// The rank this one sends its partial result to (reduce) or receives from (broadcast).
    pub parent: Option<usize>,
    /// The ranks below this one, in position order.
    pub children: Vec<usize>,
}

/// The parent and children of `rank` in the heap-shaped tree over `nranks` ranks placed by
/// `labeling`. `rank < nranks` and, for [`Labeling::Rotated`], `root < nranks` are required.
pub fn tree_node(labeling: Labeling, rank: usize, nranks: usize) -> TreeNode {
    let n = nranks.max(1);
    let p = labeling.pos(rank, n);
    let parent = (p > 0).then(|| labeling.rank((p - 1) / 2, n));
    let children = [2 * p + 1, 2 * p + 2]
        .into_iter()
        .filter(|&c| c < n)
        .map(|c| labeling.rank(c, n))
        .collect();
    TreeNode { parent, children }
}

/// The two trees of the double binary tree all-reduce, for `rank`.
pub fn double_tree_nodes(rank: usize, nranks: usize) -> [TreeNode; 2] {
    [
        tree_node(Labeling::Rotated { root: 0 }, rank, nranks),
        tree_node(Labeling::Reversed, rank, nranks),
    ]
}

/// `⌈log2 n⌉` for `n >= 1`.
fn ceil_log2(n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        (usize::BITS - (n - 1).leading_zeros()) as usize
    }
}

/// Appends `x` unless present.
fn add_peer(list: &mut Vec<usize>, x: usize) {
    if !list.contains(&x) {
        list.push(x);
    }
}

/// Peers of a node (parent and children), both directions.
fn node_peers(node: &TreeNode, list: &mut Vec<usize>) {
    for &p in node.parent.iter().chain(node.children.iter()) {
        add_peer(list, p);
    }
}

/// One slice on its way up through this rank: its children's partial results, in order,
/// combined with its Input slice `input` into `acc` (each combination waiting for the one
/// before), then the partial result (a leaf's Input slice) sent to the parent. Returns the last
/// combination (none at a leaf) and the send (none at the root).
fn climb(
    b: &mut Builder,
    node: &TreeNode,
    input: Region,
    acc: Region,
) -> (Option<StepId>, Option<StepId>) {
    let mut last: Option<StepId> = None;
    for &c in &node.children {
        let local = if last.is_some() { acc } else { input };
        last = Some(b.recv_reduce(c, local, acc, last.into_iter().collect()));
    }
    let src = if last.is_some() { acc } else { input };
    let sent = node
        .parent
        .map(|p| b.send(p, src, last.into_iter().collect()));
    (last, sent)
}

/// Double binary tree all-reduce.
///
/// Input and Output hold `count` elements each and may be the same memory. The buffer is split
/// in two halves; tree `t` (see [`double_tree_nodes`]) all-reduces half `t`: every slice is
/// reduced up the tree (a rank combines its Input slice with its children's partial results into
/// its Output slice and sends that to its parent; a leaf sends its Input slice) and the root's
/// result is broadcast down (received into Output and forwarded to the children). Every rank
/// therefore ends with the root's bits.
///
/// Steps are emitted in one global order shared by all ranks, so that the messages on each
/// channel match: round `g` carries the reduce of slice `g` and the broadcast of slice
/// `g - lag` of both trees (`lag = 2⌈log2 n⌉ + 1`, so that a slice has climbed to the root
/// before its broadcast is queued behind later reduce messages on a shared channel). Every
/// dependency points to an earlier round, which makes the schedule deadlock-free with bounded
/// FIFOs. The broadcast receive into an Output slice waits for the send that read it (in place,
/// a leaf's Input slice). No scratch space.
pub fn tree_all_reduce(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        let trees = double_tree_nodes(rank, n);
        let parts: [Vec<(usize, usize)>; 2] = [0, 1].map(|t| {
            let (o, l) = even_chunk(t, count, 2);
            slices(o, l, slice_elems).collect()
        });
        let nslices = parts[0].len().max(parts[1].len());
        let lag = 2 * ceil_log2(n) + 1;
        // Per tree and slice: the last step that wrote the Output slice in the reduce phase (none at
        // a leaf), and the send to the parent (none at the root).
        let mut reduced: [Vec<Option<StepId>>; 2] = [vec![None; nslices], vec![None; nslices]];
        let mut sent_up: [Vec<Option<StepId>>; 2] = [vec![None; nslices], vec![None; nslices]];
        let out = |(o, l): (usize, usize)| Region::new(BufId::Output, o, l);
        for g in 0..nslices + lag {
            for (t, node) in trees.iter().enumerate() {
                let Some(&s) = parts[t].get(g) else {
                    continue;
                };
                let input = Region::new(BufId::Input, s.0, s.1);
                (reduced[t][g], sent_up[t][g]) = climb(&mut b, node, input, out(s));
            }
            let Some(k) = g.checked_sub(lag) else {
                continue;
            };
            for (t, node) in trees.iter().enumerate() {
                let Some(&s) = parts[t].get(k) else {
                    continue;
                };
                let ready = match node.parent {
                    Some(p) => {
                        let deps = sent_up[t].get(k).copied().flatten().into_iter().collect();
                        b.recv_copy(p, out(s), deps)
                    }
                    // The root (n >= 2, so it has a child and wrote the slice).
                    None => match reduced[t].get(k).copied().flatten() {
                        Some(id) => id,
                        None => continue,
                    },
                };
                for &c in &node.children {
                    b.send(c, out(s), vec![ready]);
                }
            }
        }
        let mut peers = Vec::new();
        for node in &trees {
            node_peers(node, &mut peers);
        }
        Ok(b.finish(peers.clone(), peers, 0))
    })
}

/// Pipelined binary-tree broadcast from `root`.
///
/// The root copies Input to Output (skipped in place) and sends each Input slice to its
/// children; every other rank receives each slice from its parent into Output and forwards it to
/// its children as soon as it has arrived. Only the root's Input is read. Depth `⌊log2 n⌋`
/// instead of the chain's `n - 1`, at the price of sending every slice twice from interior ranks.
pub fn tree_broadcast(part: Part, root: usize) -> Result<Schedule, ScheduleError> {
    // One rank: the root's copy is all.
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, Some(root), |mut b| {
        let node = tree_node(Labeling::Rotated { root }, rank, nranks);
        if rank == root {
            b.copy(
                Region::new(BufId::Input, 0, count),
                Region::new(BufId::Output, 0, count),
            );
        }
        for (o, l) in slices(0, count, slice_elems) {
            let deps = match node.parent {
                Some(p) => vec![b.recv_copy(p, Region::new(BufId::Output, o, l), Vec::new())],
                None => Vec::new(),
            };
            let src = if node.parent.is_some() {
                BufId::Output
            } else {
                BufId::Input
            };
            for &c in &node.children {
                b.send(c, Region::new(src, o, l), deps.clone());
            }
        }
        Ok(b.finish(node.children.clone(), node.parent.into_iter().collect(), 0))
    })
}

/// Pipelined binary-tree reduce toward `root`.
///
/// Each slice is combined up the tree: a leaf sends its Input slice to its parent; an interior
/// rank combines its Input slice with its children's partial results (into Scratch, or into
/// Output at the root) and sends the partial result on as soon as it is complete. Non-root ranks
/// never write Output; interior non-root ranks need `scratch_elems = count`.
pub fn tree_reduce(part: Part, root: usize) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, Some(root), |mut b| {
        let node = tree_node(Labeling::Rotated { root }, rank, nranks);
        let acc = if node.parent.is_none() {
            BufId::Output
        } else {
            BufId::Scratch
        };
        let mut used_scratch = false;
        for (o, l) in slices(0, count, slice_elems) {
            let input = Region::new(BufId::Input, o, l);
            let (reduced, sent) = climb(&mut b, &node, input, Region::new(acc, o, l));
            // A partial result sent on from Scratch.
            used_scratch |= reduced.is_some() && sent.is_some();
        }
        let scratch = if used_scratch { count } else { 0 };
        Ok(b.finish(
            node.parent.into_iter().collect(),
            node.children.clone(),
            scratch,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Action;

    #[test]
    fn trees_are_trees_and_complementary() {
        for n in 1..=70 {
            for labeling in [
                Labeling::Rotated { root: 0 },
                Labeling::Rotated { root: n / 2 },
                Labeling::Reversed,
            ] {
                let nodes: Vec<_> = (0..n).map(|r| tree_node(labeling, r, n)).collect();
                let roots = nodes.iter().filter(|x| x.parent.is_none()).count();
                assert_eq!(roots, 1, "n {n} {labeling:?}");
                for (r, x) in nodes.iter().enumerate() {
                    for &c in &x.children {
                        assert_eq!(nodes[c].parent, Some(r), "n {n} {labeling:?}");
                    }
                    // Every rank reaches the root within ⌊log2 n⌋ hops.
                    let (mut at, mut hops) = (r, 0);
                    while let Some(p) = nodes[at].parent {
                        at = p;
                        hops += 1;
                        assert!(hops <= ceil_log2(n), "n {n} rank {r}");
                    }
                }
            }
            for r in 0..n {
                let [a, b] = double_tree_nodes(r, n);
                assert!(
                    a.children.is_empty() || b.children.is_empty(),
                    "rank {r} interior in both trees for n {n}"
                );
            }
        }
    }

    #[test]
    fn small_shapes() {
        // Two ranks: 0 is the root of tree 0, 1 of tree 1.
        assert_eq!(
            double_tree_nodes(0, 2),
            [
                TreeNode {
                    parent: None,
                    children: vec![1]
                },
                TreeNode {
                    parent: Some(1),
                    children: vec![]
                }
            ]
        );
        // Broadcast from 2 of 5: positions 0..5 are ranks 2, 3, 4, 0, 1.
        assert_eq!(
            tree_node(Labeling::Rotated { root: 2 }, 3, 5),
            TreeNode {
                parent: Some(2),
                children: vec![0, 1]
            }
        );
        let s = tree_broadcast(
            Part {
                rank: 0,
                nranks: 5,
                count: 4,
                slice_elems: 2,
            },
            2,
        )
        .unwrap();
        assert_eq!(s.recv_peers, vec![3]);
        assert!(s.send_peers.is_empty());
        assert_eq!(
            s.steps[0].action,
            Action::RecvCopy {
                peer: 3,
                dst: Region::new(BufId::Output, 0, 2)
            }
        );
    }

    /// Invalid arguments are checked with the flat builders' in `schedule::tests`.
    #[test]
    fn huge_counts_and_large_communicators_build() {
        let s = tree_all_reduce(Part {
            rank: 5,
            nranks: 9,
            count: usize::MAX,
            slice_elems: usize::MAX,
        })
        .unwrap();
        s.check(9).unwrap();
        let s = tree_all_reduce(Part {
            rank: 1 << 20,
            nranks: crate::schedule::MAX_RANKS,
            count: 3,
            slice_elems: 1,
        })
        .unwrap();
        s.check(crate::schedule::MAX_RANKS).unwrap();
    }

    #[test]
    fn count_zero_keeps_peers() {
        for n in 2..=9 {
            for r in 0..n {
                let s = tree_all_reduce(Part {
                    rank: r,
                    nranks: n,
                    count: 0,
                    slice_elems: 3,
                })
                .unwrap();
                assert!(s.steps.is_empty());
                assert!(!s.send_peers.is_empty());
                assert_eq!(s.send_peers, s.recv_peers);
            }
        }
    }
}
