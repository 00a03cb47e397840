//! The flat schedules, where every rank talks to its ring neighbours or to one partner per
//! round (no tree, no host structure):
//!
//! * along the ring `rank -> rank + 1`: ring all-reduce (reduce-scatter then all-gather),
//!   reduce-scatter and all-gather, and the pipelined chains of broadcast (away from the root)
//!   and reduce (toward it);
//! * in rounds of partner exchanges: recursive doubling and halving (`log2 n` rounds instead of
//!   the ring's `n - 1` dependent steps, the better choice where latency dominates), the
//!   dissemination barrier and pairwise all-to-all.
//!
//! Every transfer is pipelined in slices of at most `slice_elems` elements.

use super::build::{
    before, check_power_of_two, check_rank, collective, dep_at, even_chunk, slices, total, Builder,
    Chain, Ring, Writes,
};
use super::{Action, BufId, Part, Region, Schedule, ScheduleError, StepId};

/// Ring all-reduce (reduce-scatter then all-gather around the ring `rank -> rank + 1`).
///
/// Input and Output hold `count` elements each and may be the same memory. The buffer is split
/// into `nranks` chunks as evenly as possible; in the reduce-scatter phase each rank receives
/// and reduces one chunk per step (`RecvReduce` of its Input chunk into its Output chunk), so
/// after `nranks - 1` steps it holds the fully reduced chunk `rank + 1`; the all-gather phase
/// then passes the reduced chunks around. Every transfer is split into messages of at most
/// `slice_elems` elements, each send of a received slice depending only on that slice.
pub fn ring_all_reduce(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        let ring @ Ring { next, prev } = Ring::around(rank, n);
        let chunk_slices = |chunk: usize| -> Vec<(usize, usize)> {
            let (offset, len) = even_chunk(chunk, count, n);
            slices(offset, len, slice_elems).collect()
        };

        // Receive steps of the previous ring step, slice by slice: the chunk they filled is the one
        // sent at the current ring step.
        let mut prev_recv: Vec<StepId> = Vec::new();
        // Send steps of each reduce-scatter step; the all-gather receive of the same chunk
        // overwrites what they read (in place even the Input), so it waits for them.
        let mut rs_sends: Vec<Vec<StepId>> = Vec::with_capacity(n - 1);

        for s in 0..n - 1 {
            let src_buf = if s == 0 { BufId::Input } else { BufId::Output };
            let (sends, recvs) = b.exchange(
                &chunk_slices(before(rank, s, n)),
                &chunk_slices(before(rank, s + 1, n)),
                |b, k, (o, l)| b.send(next, Region::new(src_buf, o, l), dep_at(&prev_recv, k)),
                |b, _, (o, l)| {
                    let (input, output) = (
                        Region::new(BufId::Input, o, l),
                        Region::new(BufId::Output, o, l),
                    );
                    b.recv_reduce(prev, input, output, Vec::new())
                },
            );
            rs_sends.push(sends);
            prev_recv = recvs;
        }

        for t in 0..n - 1 {
            // Chunk rank + 1 - t is sent, chunk rank - t received.
            let overwritten = rs_sends.get(t).map(Vec::as_slice).unwrap_or(&[]);
            let (_, recvs) = b.exchange(
                &chunk_slices((rank + 1 + n - t) % n),
                &chunk_slices(before(rank, t, n)),
                |b, k, (o, l)| {
                    b.send(
                        next,
                        Region::new(BufId::Output, o, l),
                        dep_at(&prev_recv, k),
                    )
                },
                |b, k, (o, l)| {
                    b.recv_copy(
                        prev,
                        Region::new(BufId::Output, o, l),
                        dep_at(overwritten, k),
                    )
                },
            );
            prev_recv = recvs;
        }
        Ok(ring.finish(b, 0))
    })
}

/// Ring reduce-scatter.
///
/// Input holds `nranks * count` elements (block `i` is `[i * count, (i + 1) * count)`), Output
/// holds `count`: block `rank` reduced over all ranks. Output may be block `rank` of Input (in
/// place): that block is read only by the final reduction, which writes it.
///
/// At step `s` a rank sends its partial sum of block `rank - s - 1` and receives the partial sum
/// of block `rank - s - 2`, which it combines with its own Input block into Scratch slot `s % 2`
/// (into Output at the last step). A receive into a slot waits for the send that read the slot's
/// previous contents, slice by slice. `scratch_elems` is `min(nranks - 2, 2) * count`.
pub fn ring_reduce_scatter(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        total(count, n)?;
        let ring @ Ring { next, prev } = Ring::around(rank, n);
        let block_slices: Vec<_> = slices(0, count, slice_elems).collect();
        // Where the partial sum written at step s lives.
        let slot = |s: usize| Region::new(BufId::Scratch, (s % 2) * count, count);

        let mut prev_recv: Vec<StepId> = Vec::new();
        let mut prev_send: Vec<StepId> = Vec::new();
        for s in 0..n - 1 {
            let last = s == n - 2;
            let recv_block = before(rank, s + 2, n);
            let src = if s == 0 {
                Region::new(BufId::Input, before(rank, 1, n) * count, count)
            } else {
                slot(s - 1)
            };
            let dst = if last {
                Region::new(BufId::Output, 0, count)
            } else {
                slot(s)
            };
            // The slot written now was last read by the previous step's send (from s = 2 on).
            let overwritten: &[StepId] = if !last && s >= 2 { &prev_send } else { &[] };
            let (sends, recvs) = b.exchange(
                &block_slices,
                &block_slices,
                |b, k, (o, l)| b.send(next, src.part(o, l), dep_at(&prev_recv, k)),
                |b, k, (o, l)| {
                    let input = Region::new(BufId::Input, recv_block * count + o, l);
                    let partial = dst.part(o, l);
                    b.recv_reduce(prev, input, partial, dep_at(overwritten, k))
                },
            );
            prev_recv = recvs;
            prev_send = sends;
        }
        let scratch = (n - 2).min(2) * count;
        Ok(ring.finish(b, scratch))
    })
}

/// Ring all-gather.
///
/// Input holds `count` elements, Output `nranks * count`; block `rank` of Output receives this
/// rank's Input (a local copy, skipped by the engine when Input is that block, i.e. in place).
/// At step `t` a rank sends block `rank - t` (its Input at `t = 0`) and receives block
/// `rank - t - 1` into Output; forwarding a slice waits for its receipt.
pub fn ring_all_gather(part: Part) -> Result<Schedule, ScheduleError> {
    // One rank: the copy into block 0 is all.
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        total(count, n)?;
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, rank * count, count),
        );
        let ring @ Ring { next, prev } = Ring::around(rank, n);
        let block_slices: Vec<_> = slices(0, count, slice_elems).collect();
        let mut prev_recv: Vec<StepId> = Vec::new();
        for t in 0..n - 1 {
            // Block rank - t goes out (the Input at t = 0), block rank - t - 1 comes in.
            let src = if t == 0 {
                Region::new(BufId::Input, 0, count)
            } else {
                Region::new(BufId::Output, before(rank, t, n) * count, count)
            };
            let recv_block = before(rank, t + 1, n);
            let (_, recvs) = b.exchange(
                &block_slices,
                &block_slices,
                |b, k, (o, l)| b.send(next, src.part(o, l), dep_at(&prev_recv, k)),
                |b, _, (o, l)| {
                    b.recv_copy(
                        prev,
                        Region::new(BufId::Output, recv_block * count + o, l),
                        Vec::new(),
                    )
                },
            );
            prev_recv = recvs;
        }
        Ok(ring.finish(b, 0))
    })
}

/// Pipelined chain broadcast along `root -> root + 1 -> ... -> root + nranks - 1`.
///
/// The root copies Input to Output (skipped in place) and sends Input slice by slice; every
/// other rank receives each slice into Output and, unless it is last in the chain, forwards it
/// from Output as soon as it has arrived. Only the root's Input is read.
pub fn chain_broadcast(part: Part, root: usize) -> Result<Schedule, ScheduleError> {
    // One rank: the root's copy is all.
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, Some(root), |mut b| {
        let chain = Chain::starting_at(root, rank, nranks);
        let Ring { next, prev } = chain.ring;
        if rank == root {
            b.copy(
                Region::new(BufId::Input, 0, count),
                Region::new(BufId::Output, 0, count),
            );
            for (o, l) in slices(0, count, slice_elems) {
                b.send(next, Region::new(BufId::Input, o, l), Vec::new());
            }
        } else {
            for (o, l) in slices(0, count, slice_elems) {
                let r = b.recv_copy(prev, Region::new(BufId::Output, o, l), Vec::new());
                if !chain.is_last() {
                    b.send(next, Region::new(BufId::Output, o, l), vec![r]);
                }
            }
        }
        let (send_peers, recv_peers) = chain.peers();
        Ok(b.finish(send_peers, recv_peers, 0))
    })
}

/// Pipelined chain reduce toward `root`, along `root + 1 -> root + 2 -> ... -> root`.
///
/// The first rank of the chain sends its Input; each middle rank combines every received slice
/// with its Input slice into Scratch and forwards it; the root combines into Output. Non-root
/// ranks never write Output. Middle ranks need `scratch_elems = count`.
pub fn chain_reduce(part: Part, root: usize) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, Some(root), |mut b| {
        // Position 0 is root + 1, n - 1 the root.
        let chain = Chain::starting_at(root + 1, rank, nranks);
        let output = |o: usize, l: usize| Region::new(BufId::Output, o, l);
        chain.fold(&mut b, 0, count, slice_elems, &output);
        let scratch = if chain.is_middle() { count } else { 0 };
        let (send_peers, recv_peers) = chain.peers();
        Ok(b.finish(send_peers, recv_peers, scratch))
    })
}

/// Latency-optimal all-reduce for small messages: recursive doubling (⌈log2 n⌉ exchange rounds,
/// each exchanging the whole vector), with the usual fold-in/fold-out for ranks beyond the largest
/// power of two.
///
/// Input and Output hold `count` elements each and may be the same memory (in place). Let `p` be
/// the largest power of two `<= nranks`:
/// * A rank `r >= p` sends its Input to `r - p` and receives the final result from it into
///   Output (each slice of the result only after the same slice of its Input has gone out).
/// * A rank `r < nranks - p` first receives the Input of `r + p` and combines it with its own
///   Input (the fold-in); it is the only rank that computes that combination.
/// * In round `k` (`d = 2^k < p`) ranks `r` and `r ^ d` exchange their accumulators and both
///   combine them (`a ⊕ b` on one side, `b ⊕ a` on the other). The combiners are commutative, so
///   after round `k` every group of `2^(k+1)` aligned ranks holds bitwise identical values, and
///   after the last round all ranks `< p` do (floating-point sums included). The folding ranks
///   then send the result to `r + p`, which copy it, so every rank ends with the same bits.
///   (This needs `⊕` to be commutative bit for bit, which holds for integers and for float sums
///   and products without NaNs; float `Min`/`Max` of `-0.0` and `+0.0`, or NaNs with different
///   payloads, may leave different bits on the two sides of an exchange.)
///
/// A round reads its accumulator `X` (for its send and as the local operand) and writes
/// `X ⊕ received` into the other of Output and Scratch, so a round's receive never writes what
/// the same round's send reads; the next round's receive, which writes `X`'s buffer again, waits
/// for this round's send and receive of the same slice. Round 0 of a non-folding rank reads its
/// Input and therefore writes Scratch (in place, Output is the Input still being sent). The
/// folding ranks place their fold-in so that the last round writes Output; the others copy the
/// result from Scratch to Output when the number of rounds is odd. Every transfer is split into
/// messages of at most `slice_elems` elements with per-slice deps. Ranks `< p` need
/// `scratch_elems = count`; ranks `>= p` and a single rank need none.
pub fn recursive_doubling_all_reduce(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        let n = nranks;
        // n >= 2, so p >= 2 and there is at least one round.
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let extra = n - p;
        let parts: Vec<(usize, usize)> = slices(0, count, slice_elems).collect();
        let at = |buf: BufId, (o, l): (usize, usize)| Region::new(buf, o, l);
        let other = |buf: BufId| {
            if buf == BufId::Output {
                BufId::Scratch
            } else {
                BufId::Output
            }
        };

        if rank >= p {
            let q = rank - p;
            for &s in &parts {
                let sent = b.send(q, at(BufId::Input, s), Vec::new());
                // In place, this Output slice is the Input slice being sent.
                b.recv_copy(q, at(BufId::Output, s), vec![sent]);
            }
            return Ok(b.finish(vec![q], vec![q], 0));
        }

        let rounds = p.trailing_zeros() as usize;
        let folds = rank < extra;
        let mut send_peers = Vec::with_capacity(rounds + 1);
        let mut recv_peers = Vec::with_capacity(rounds + 1);

        // Steps that wrote the current accumulator, slice by slice (none while it is the Input), and
        // the sends of the previous round (which read the buffer the current round writes).
        let mut prev_recv: Vec<StepId> = Vec::new();
        let mut prev_send: Vec<StepId> = Vec::new();
        // Buffers of the current accumulator X and of the next one Y.
        let (mut x, mut y) = if folds {
            // Y of round k is Output when rounds - 1 - k is even: the last round writes Output.
            let first_y = if (rounds - 1).is_multiple_of(2) {
                BufId::Output
            } else {
                BufId::Scratch
            };
            let acc = other(first_y);
            let hi = rank + p;
            recv_peers.push(hi);
            for &s in &parts {
                prev_recv.push(b.recv_reduce(hi, at(BufId::Input, s), at(acc, s), Vec::new()));
            }
            (acc, first_y)
        } else {
            (BufId::Input, BufId::Scratch)
        };

        let mut d = 1usize;
        while d < p {
            let partner = rank ^ d;
            send_peers.push(partner);
            recv_peers.push(partner);
            // The receive writes Y, which the previous round's send read.
            (prev_send, prev_recv) = b.exchange(
                &parts,
                &parts,
                |b, k, s| b.send(partner, at(x, s), dep_at(&prev_recv, k)),
                |b, k, s| {
                    let mut deps = dep_at(&prev_recv, k);
                    deps.extend(dep_at(&prev_send, k));
                    b.recv_reduce(partner, at(x, s), at(y, s), deps)
                },
            );
            (x, y) = (y, other(y));
            d <<= 1;
        }

        if folds {
            // x is Output here (see above).
            let hi = rank + p;
            send_peers.push(hi);
            for (k, &s) in parts.iter().enumerate() {
                b.send(hi, at(x, s), dep_at(&prev_recv, k));
            }
        } else if x == BufId::Scratch {
            // Output was last read by the final round (its Input, in place, when there is one round).
            for (k, &s) in parts.iter().enumerate() {
                let mut deps = dep_at(&prev_recv, k);
                deps.extend(dep_at(&prev_send, k));
                b.push(
                    Action::Copy {
                        src: at(BufId::Scratch, s),
                        dst: at(BufId::Output, s),
                    },
                    deps,
                );
            }
        }
        Ok(b.finish(send_peers, recv_peers, count))
    })
}

/// Recursive-halving reduce-scatter for a power-of-two number of ranks: `log2 n` exchange
/// rounds instead of the ring's `n - 1` dependent steps, the better choice where latency
/// dominates.
///
/// Input holds `nranks * count` elements, Output `count`. A rank starts responsible for all `n`
/// blocks; in round `k` (`d = n/2, n/4, …, 1`) it and its partner `r ^ d` split the window of
/// blocks both are responsible for: each sends the half that holds the partner's block and
/// reduces the partner's copy of the other half with its own. Partial sums live in Scratch, laid
/// out like Input; the last round (the window is then this rank's block) reduces into Output.
/// Every step that reads partial sums waits for the previous round's steps that wrote them.
pub fn recursive_halving_reduce_scatter(part: Part) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        check_power_of_two(nranks)?;
        let n = nranks;
        let all = total(count, n)?;
        // The previous round's writes to Scratch. Each round reads only inside the window the
        // previous one wrote, so older writes never matter.
        let mut written = Writes::default();
        let mut peers = Vec::new();
        let (mut window, mut d) = (0usize, n / 2);
        while d >= 1 {
            let partner = rank ^ d;
            peers.push(partner);
            let (first, last) = (d == n / 2, d == 1);
            // Blocks [window, window + 2d) split in two halves of d blocks.
            let (keep, give) = if rank & d == 0 {
                (window, window + d)
            } else {
                (window + d, window)
            };
            let partial = if first { BufId::Input } else { BufId::Scratch };
            for (o, l) in slices(0, d * count, slice_elems) {
                let start = give * count + o;
                let deps = written.overlapping(start, l);
                b.send(partner, Region::new(partial, start, l), deps);
            }
            let mut now_written = Writes::default();
            for (o, l) in slices(0, d * count, slice_elems) {
                let start = keep * count + o;
                let deps = written.overlapping(start, l);
                let dst = if last {
                    Region::new(BufId::Output, o, l)
                } else {
                    Region::new(BufId::Scratch, start, l)
                };
                let step = b.recv_reduce(partner, Region::new(partial, start, l), dst, deps);
                now_written.record(start, l, step);
            }
            written = now_written;
            window = keep;
            d /= 2;
        }
        Ok(b.finish(peers.clone(), peers, if n > 2 { all } else { 0 }))
    })
}

/// Recursive-doubling all-gather for a power-of-two number of ranks: `log2 n` exchange rounds
/// instead of the ring's `n - 1` dependent steps, the better choice where latency dominates.
///
/// Input holds `count` elements, Output `nranks * count`; block `rank` of Output receives this
/// rank's Input (a local copy, skipped by the engine in place). In round `k` (`d = 2^k`) rank `r`
/// and its partner `r ^ d` exchange the `d` blocks each holds, the aligned group starting at
/// block `r & !(d - 1)`: contiguous in Output, so one transfer each way, split into slices. Each
/// sent slice waits for the steps that wrote its elements (the copy, earlier receives).
pub fn recursive_doubling_all_gather(part: Part) -> Result<Schedule, ScheduleError> {
    // One rank: the copy into block 0 is all.
    let (rank, nranks, count, slice_elems) = part.fields();
    collective(part, None, |mut b| {
        check_power_of_two(nranks)?;
        let n = nranks;
        total(count, n)?;
        // Who wrote which elements of Output.
        let mut writers = Writes::default();
        if let Some(c) = b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, rank * count, count),
        ) {
            writers.record(rank * count, count, c);
        }
        let mut peers = Vec::new();
        let mut d = 1usize;
        while d < n {
            let partner = rank ^ d;
            let mine = (rank & !(d - 1)) * count;
            let theirs = (partner & !(d - 1)) * count;
            peers.push(partner);
            let mut received = Vec::new();
            for (o, l) in slices(0, d * count, slice_elems) {
                if d == 1 {
                    b.send(partner, Region::new(BufId::Input, o, l), Vec::new());
                } else {
                    let deps = writers.overlapping(mine + o, l);
                    b.send(partner, Region::new(BufId::Output, mine + o, l), deps);
                }
                let r = b.recv_copy(
                    partner,
                    Region::new(BufId::Output, theirs + o, l),
                    Vec::new(),
                );
                received.push((theirs + o, l, r));
            }
            for (start, len, step) in received {
                writers.record(start, len, step);
            }
            match d.checked_mul(2) {
                Some(x) => d = x,
                None => break,
            }
        }
        Ok(b.finish(peers.clone(), peers, 0))
    })
}

/// Dissemination barrier: in round `k` (while `d = 2^k < nranks`) a rank sends one element from
/// Scratch\[0\] to `rank + d` and receives one into Scratch\[1\] from `rank - d`. A round's send and
/// receive wait for the previous round's receive. `scratch_elems = 2` (0 for one rank).
pub fn dissemination_barrier(rank: usize, nranks: usize) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    let mut send_peers = Vec::new();
    let mut recv_peers = Vec::new();
    let mut prev_recv: Vec<StepId> = Vec::new();
    let mut d = 1usize;
    while d < n {
        let to = (rank + d) % n;
        let from = before(rank, d, n);
        send_peers.push(to);
        recv_peers.push(from);
        b.send(to, Region::new(BufId::Scratch, 0, 1), prev_recv.clone());
        let r = b.recv_copy(from, Region::new(BufId::Scratch, 1, 1), prev_recv);
        prev_recv = vec![r];
        match d.checked_mul(2) {
            Some(x) => d = x,
            None => break,
        }
    }
    let scratch = if n > 1 { 2 } else { 0 };
    Ok(b.finish(send_peers, recv_peers, scratch))
}

/// Pairwise all-to-all: at round `k = 1..nranks` a rank sends Input block `rank + k` to rank
/// `rank + k` and receives Output block `rank - k` from rank `rank - k`; its own block is copied
/// locally. Input and Output hold `nranks * count` elements.
///
/// With `in_place` (Input and Output are the same memory) every block that leaves (all but the
/// rank's own) is first copied slice by slice to the same place in Scratch
/// (`scratch_elems = nranks * count`); sends read Scratch, and the receive into a slice waits
/// for that slice's copy. The own block stays where it is.
pub fn pairwise_all_to_all(part: Part, in_place: bool) -> Result<Schedule, ScheduleError> {
    let (rank, nranks, count, slice_elems) = part.fields();
    check_rank(rank, nranks)?;
    let n = nranks;
    let all = total(count, n)?;
    let mut b = Builder::default();
    // In place: the staging copy of each outgoing slice, by (block, slice index).
    let mut staged: Vec<Vec<Vec<StepId>>> = vec![Vec::new(); n];
    let (src_buf, scratch) = if in_place {
        for (block, slots) in staged.iter_mut().enumerate() {
            if block == rank {
                continue;
            }
            for (o, l) in slices(0, count, slice_elems) {
                let at = block * count + o;
                let c = b.copy(
                    Region::new(BufId::Output, at, l),
                    Region::new(BufId::Scratch, at, l),
                );
                slots.push(c.into_iter().collect());
            }
        }
        (BufId::Scratch, all)
    } else {
        b.copy(
            Region::new(BufId::Input, rank * count, count),
            Region::new(BufId::Output, rank * count, count),
        );
        (BufId::Input, 0)
    };
    let staged_dep = |block: usize, k: usize| staged[block].get(k).cloned().unwrap_or_default();
    let mut send_peers = Vec::with_capacity(n.saturating_sub(1));
    let mut recv_peers = Vec::with_capacity(n.saturating_sub(1));
    for k in 1..n {
        let to = (rank + k) % n;
        let from = before(rank, k, n);
        send_peers.push(to);
        recv_peers.push(from);
        for (i, (o, l)) in slices(0, count, slice_elems).enumerate() {
            b.send(
                to,
                Region::new(src_buf, to * count + o, l),
                staged_dep(to, i),
            );
            b.recv_copy(
                from,
                Region::new(BufId::Output, from * count + o, l),
                staged_dep(from, i),
            );
        }
    }
    Ok(b.finish(send_peers, recv_peers, scratch))
}
