//! Deterministic reductions: every element is folded in rank order,
//!
//! ```text
//! v = x[n-1] ⊕ ( … ⊕ (x[2] ⊕ (x[1] ⊕ x[0])) … )
//! ```
//!
//! (each rank's own value on the left of `⊕`, as a `RecvReduce` step combines `local ⊕
//! received`), whatever the slice size, the transport, the placement of ranks on hosts or the
//! device that executes the schedule: floating-point sums come out with the same bits for a
//! given number of ranks and inputs. Min and max follow the same order, so which of `-0.0` and
//! `+0.0`, and which NaN, survives is fixed too.
//!
//! The fold is a pipelined chain `0 → 1 → … → n-1`: rank 0 sends its Input slice by slice,
//! rank k combines each slice it receives with its own Input into Scratch and forwards it, rank
//! n-1 holds the result. Then:
//! * all-reduce: a pipelined chain broadcast `n-1 → 0 → 1 → … → n-2` of the result;
//! * reduce: rank n-1 sends the result to the root (nothing more when it is the root);
//! * reduce-scatter: the chain folds all `n` blocks; rank n-1 sends block j to rank j.
//!
//! Compared with the ring, the chain has `n - 1` dependent hops before the first result instead
//! of one round of `n - 1` steps in parallel, and moves about as many bytes per link; see
//! `docs/performance.md` for what it costs.

use super::build::{collective, total, Chain, Ring};
use super::{BufId, Part, Region, Schedule, ScheduleError};

/// The fold of every rank's Input into rank n-1: the chain `0 → … → n-1`.
fn fold_chain(rank: usize, n: usize) -> Chain {
    Chain::starting_at(0, rank, n)
}

/// Deterministic all-reduce: the fold to rank n-1, then a chain broadcast `n-1 → 0 → … → n-2`.
/// Input and Output hold `count` elements each and may be the same memory. Ranks other than
/// the ends need `scratch_elems = count`.
pub fn ordered_all_reduce(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        let chain = fold_chain(rank, n);
        let output = |o: usize, l: usize| Region::new(BufId::Output, o, l);
        let folded = chain.fold(&mut b, 0, count, slice_elems, &output);
        // The broadcast chain n-1 → 0 → … → n-2 uses the same links as the fold.
        let ring @ Ring { next, prev } = chain.ring;
        for (o, l, touched) in folded {
            if rank == n - 1 {
                b.send(next, output(o, l), vec![touched]);
            } else {
                // Output may be the Input this rank folded in (in place): overwrite it after.
                let r = b.recv_copy(prev, output(o, l), vec![touched]);
                if rank + 2 < n {
                    b.send(next, output(o, l), vec![r]);
                }
            }
        }
        let scratch = if chain.is_middle() { count } else { 0 };
        Ok(ring.finish(b, scratch))
    })
}

/// Deterministic reduce: the fold to rank n-1, which then sends the result to `root` unless it
/// is the root. Non-root ranks never write Output; ranks other than rank 0 and the root need
/// `scratch_elems = count`.
pub fn ordered_reduce(part: Part, root: usize) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, Some(root), |mut b| {
        let n = nranks;
        let last = n - 1;
        let chain = fold_chain(rank, n);
        let result = |o: usize, l: usize| {
            let buf = if root == last {
                BufId::Output
            } else {
                BufId::Scratch
            };
            Region::new(buf, o, l)
        };
        let folded = chain.fold(&mut b, 0, count, slice_elems, &result);
        let (mut send_peers, mut recv_peers) = chain.peers();
        if root != last {
            if rank == last {
                for &(o, l, r) in &folded {
                    b.send(root, result(o, l), vec![r]);
                }
                send_peers.push(root);
            } else if rank == root {
                for &(o, l, touched) in &folded {
                    b.recv_copy(last, Region::new(BufId::Output, o, l), vec![touched]);
                }
                recv_peers.push(last);
            }
        }
        let scratch = if rank > 0 && (rank + 1 < n || root != last) {
            count
        } else {
            0
        };
        Ok(b.finish(send_peers, recv_peers, scratch))
    })
}

/// Deterministic reduce-scatter (`count` elements per block, Input `nranks × count`): the fold
/// of the whole Input to rank n-1, which keeps its block and sends block j to rank j. Output may
/// be block `rank` of the Input (in place). Ranks but rank 0 need `scratch_elems = nranks ×
/// count`.
pub fn ordered_reduce_scatter(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        let all = total(count, n)?;
        let last = n - 1;
        let chain = fold_chain(rank, n);
        // Rank n-1 folds its own block straight into Output, the others' into Scratch.
        let own = last * count;
        let result = |o: usize, l: usize| {
            if (own..own + count).contains(&o) {
                Region::new(BufId::Output, o - own, l)
            } else {
                Region::new(BufId::Scratch, o, l)
            }
        };
        let mut folded = Vec::new();
        for j in 0..n {
            folded.extend(chain.fold(&mut b, j * count, count, slice_elems, &result));
        }
        let (mut send_peers, mut recv_peers) = chain.peers();
        let block_of = |o: usize| o.checked_div(count).unwrap_or(0);
        if rank == last {
            for &(o, l, r) in &folded {
                let j = block_of(o);
                if j != last {
                    b.send(j, result(o, l), vec![r]);
                }
            }
            send_peers.extend(0..last);
        } else {
            let mine = rank * count;
            // The folds that read this rank's block of the Input (Output in place) come first.
            for &(o, l, touched) in folded.iter().filter(|f| block_of(f.0) == rank) {
                b.recv_copy(last, Region::new(BufId::Output, o - mine, l), vec![touched]);
            }
            recv_peers.push(last);
        }
        let scratch = if rank > 0 { all } else { 0 };
        Ok(b.finish(send_peers, recv_peers, scratch))
    })
}
