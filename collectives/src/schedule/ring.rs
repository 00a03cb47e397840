//! Schedules along the ring `rank -> rank + 1`: ring all-reduce (reduce-scatter then
//! all-gather), reduce-scatter and all-gather, and the pipelined chains of broadcast (away from
//! the root) and reduce (toward it). Every transfer is pipelined in slices.

use super::build::{before, check_rank, check_root, dep_at, even_chunk, slices, total, Builder};
use super::{BufId, Region, Schedule, ScheduleError, StepId};

/// Ring all-reduce (reduce-scatter then all-gather around the ring `rank -> rank + 1`).
///
/// Input and Output hold `count` elements each and may be the same memory. The buffer is split
/// into `nranks` chunks as evenly as possible; in the reduce-scatter phase each rank receives
/// and reduces one chunk per step (`RecvReduce` of its Input chunk into its Output chunk), so
/// after `nranks - 1` steps it holds the fully reduced chunk `rank + 1`; the all-gather phase
/// then passes the reduced chunks around. Every transfer is split into messages of at most
/// `slice_elems` elements, each send of a received slice depending only on that slice.
pub fn ring_all_reduce(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    if n == 1 {
        return Ok(Builder::single_rank(count));
    }
    let mut b = Builder::default();
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
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
    Ok(b.finish(vec![next], vec![prev], 0))
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
pub fn ring_reduce_scatter(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    total(count, n)?;
    if n == 1 {
        return Ok(Builder::single_rank(count));
    }
    let mut b = Builder::default();
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
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
            |b, k, (o, l)| {
                b.send(
                    next,
                    Region::new(src.buf, src.offset + o, l),
                    dep_at(&prev_recv, k),
                )
            },
            |b, k, (o, l)| {
                let input = Region::new(BufId::Input, recv_block * count + o, l);
                let partial = Region::new(dst.buf, dst.offset + o, l);
                b.recv_reduce(prev, input, partial, dep_at(overwritten, k))
            },
        );
        prev_recv = recvs;
        prev_send = sends;
    }
    let scratch = (n - 2).min(2) * count;
    Ok(b.finish(vec![next], vec![prev], scratch))
}

/// Ring all-gather.
///
/// Input holds `count` elements, Output `nranks * count`; block `rank` of Output receives this
/// rank's Input (a local copy, skipped by the engine when Input is that block, i.e. in place).
/// At step `t` a rank sends block `rank - t` (its Input at `t = 0`) and receives block
/// `rank - t - 1` into Output; forwarding a slice waits for its receipt.
pub fn ring_all_gather(
    rank: usize,
    nranks: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    let n = nranks;
    total(count, n)?;
    let mut b = Builder::default();
    b.copy(
        Region::new(BufId::Input, 0, count),
        Region::new(BufId::Output, rank * count, count),
    );
    if n == 1 {
        return Ok(b.finish(Vec::new(), Vec::new(), 0));
    }
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
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
            |b, k, (o, l)| {
                b.send(
                    next,
                    Region::new(src.buf, src.offset + o, l),
                    dep_at(&prev_recv, k),
                )
            },
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
    Ok(b.finish(vec![next], vec![prev], 0))
}

/// Pipelined chain broadcast along `root -> root + 1 -> ... -> root + nranks - 1`.
///
/// The root copies Input to Output (skipped in place) and sends Input slice by slice; every
/// other rank receives each slice into Output and, unless it is last in the chain, forwards it
/// from Output as soon as it has arrived. Only the root's Input is read.
pub fn chain_broadcast(
    rank: usize,
    nranks: usize,
    root: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    check_root(root, nranks)?;
    let n = nranks;
    let mut b = Builder::default();
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
    let pos = before(rank, root, n);
    if rank == root {
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        if n > 1 {
            for (o, l) in slices(0, count, slice_elems) {
                b.send(next, Region::new(BufId::Input, o, l), Vec::new());
            }
        }
    } else {
        for (o, l) in slices(0, count, slice_elems) {
            let r = b.recv_copy(prev, Region::new(BufId::Output, o, l), Vec::new());
            if pos + 1 < n {
                b.send(next, Region::new(BufId::Output, o, l), vec![r]);
            }
        }
    }
    let send_peers = if pos + 1 < n { vec![next] } else { Vec::new() };
    let recv_peers = if pos > 0 { vec![prev] } else { Vec::new() };
    Ok(b.finish(send_peers, recv_peers, 0))
}

/// Pipelined chain reduce toward `root`, along `root + 1 -> root + 2 -> ... -> root`.
///
/// The first rank of the chain sends its Input; each middle rank combines every received slice
/// with its Input slice into Scratch and forwards it; the root combines into Output. Non-root
/// ranks never write Output. Middle ranks need `scratch_elems = count`.
pub fn chain_reduce(
    rank: usize,
    nranks: usize,
    root: usize,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    check_rank(rank, nranks)?;
    check_root(root, nranks)?;
    let n = nranks;
    if n == 1 {
        return Ok(Builder::single_rank(count));
    }
    let mut b = Builder::default();
    let next = (rank + 1) % n;
    let prev = before(rank, 1, n);
    // Position in the chain: 0 is root + 1, n - 1 is the root.
    let pos = before(rank, root + 1, n);
    let mut scratch = 0;
    for (o, l) in slices(0, count, slice_elems) {
        let input = Region::new(BufId::Input, o, l);
        if pos == 0 {
            b.send(next, input, Vec::new());
        } else if pos + 1 < n {
            let partial = Region::new(BufId::Scratch, o, l);
            let r = b.recv_reduce(prev, input, partial, Vec::new());
            b.send(next, partial, vec![r]);
            scratch = count;
        } else {
            b.recv_reduce(prev, input, Region::new(BufId::Output, o, l), Vec::new());
        }
    }
    let send_peers = if pos + 1 < n { vec![next] } else { Vec::new() };
    let recv_peers = if pos > 0 { vec![prev] } else { Vec::new() };
    Ok(b.finish(send_peers, recv_peers, scratch))
}
