//! One-shot collectives among ranks that all share memory: every rank posts its contribution
//! once in its outbox ([`weftcc_transports::shm::Outbox`]) and reads every other rank's in
//! place. A small all-reduce, all-gather, reduce-scatter or all-to-all then costs the cache
//! lines its data fills plus one flag per rank, not a schedule's messages (OpenMPI's and MPICH's
//! shared-memory collectives do the same).
//!
//! Every rank checks the header posted with each contribution against its own call (a
//! disagreement is [`Error::Mismatch`]). Reductions fold the contributions in rank order,
//! `((x0 ⊕ x1) ⊕ x2) …`, the order of deterministic mode's `Ordered` schedules: every rank gets
//! the same bits, and the same bits as `WEFT_DETERMINISTIC=1`.
//!
//! Slots alternate ([`OUTBOX_SLOTS`](weftcc_transports::shm::OUTBOX_SLOTS)), and a rank writes a slot again only once every other
//! rank's `done` has reached the collective that last used it. Between one-shot collectives
//! alone that always holds already (a rank posts `s` after reading every post of `s - 1`, each
//! made after reading every post of `s - 2`), but a schedule in between may let a rank run
//! ahead: a broadcast's root sends and goes on, and its next one-shot post would overwrite the
//! one a slower rank still reads. Broadcast and reduce keep their schedules: one-shot versions in
//! which the root goes on and headers are compared a call later were no faster back to back at
//! 2 ranks and slower at 4 (`docs/performance.md`, "What limits small messages").
//!
//! Waiting follows the executor's idle policy and checks: abort, poison, timeout, the peers'
//! liveness, and a schedule's header sent where this rank runs one-shot. A waiting rank sleeps on
//! its own doorbell; a post wakes only ranks that sleep ([`Outbox::wake`]).

use crate::config::Backoff;
use crate::error::{Error, Result};
use crate::executor;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use weftcc_collectives::call::{Plan, RawOp};
use weftcc_collectives::header::{OpDesc, HEADER_LEN};
use weftcc_collectives::op::{Combiner, OpKind};
use weftcc_collectives::reduce;
use weftcc_transports::shm::{Outbox, Outboxes, OUTBOX_HEADER_MAX, OUTBOX_SLOT_BYTES};
use weftcc_transports::Connection;

/// Most ranks a one-shot collective runs on: every rank reads every contribution, so its cost
/// grows with the ranks where a schedule's grows with their logarithm or not at all.
pub(crate) const MAX_RANKS: usize = 8;

const _: () = assert!(HEADER_LEN == OUTBOX_HEADER_MAX);

/// Bytes each rank contributes to `call` on `n` ranks, and the bytes it reads of the others'
/// contributions; `None` when `call` is not a collective one-shot runs.
pub(crate) fn volume(call: &RawOp, n: usize) -> Option<(usize, usize)> {
    let block = call.count.checked_mul(call.dtype.size())?;
    let others = block.checked_mul(n.checked_sub(1)?)?;
    match call.kind {
        OpKind::AllReduce | OpKind::AllGather => Some((block, others)),
        // Both post their whole input, and each rank reads its block of the others'.
        OpKind::ReduceScatter | OpKind::AllToAll => Some((block.checked_mul(n)?, others)),
        OpKind::Broadcast | OpKind::Reduce | OpKind::Barrier | OpKind::SendRecv => None,
    }
}

/// Whether `call` runs one-shot on `n` ranks when a rank may read at most `max_read` bytes of
/// the others' contributions. Depends only on the call and settings every rank shares, so all
/// ranks decide alike.
pub(crate) fn fits(call: &RawOp, n: usize, max_read: usize) -> bool {
    (2..=MAX_RANKS).contains(&n)
        && call.count > 0
        && volume(call, n)
            .is_some_and(|(posted, read)| posted <= OUTBOX_SLOT_BYTES && read <= max_read)
}

/// Where this rank's contribution is: a buffer of its own, or (in place) a range of the receive
/// buffer the output goes to.
pub(crate) enum Contribution<'a> {
    Buffer(&'a [u8]),
    InRecv(std::ops::Range<usize>),
}

/// One one-shot collective as the runtime hands it over.
pub(crate) struct OneShot<'a> {
    pub rank: usize,
    pub nranks: usize,
    pub call: &'a RawOp,
    pub plan: &'a Plan,
    pub seq: u64,
    pub timeout: Duration,
    pub abort: &'a AtomicBool,
    pub idle: Backoff,
    pub poisoned: &'a dyn Fn() -> Option<Error>,
}

impl OneShot<'_> {
    fn desc(&self) -> OpDesc {
        OpDesc::of_call(self.call, self.seq)
    }

    fn internal(&self, reason: String) -> Error {
        Error::Internal {
            rank: self.rank,
            op: self.call.kind,
            seq: self.seq,
            reason,
        }
    }

    /// Runs the collective: `input` is this rank's contribution (`plan.input_len` bytes, scaled
    /// already for `PreMulSum`), `recv` the receive buffer the output goes to at
    /// `plan.output_offset`. `Avg`'s division is the caller's, as for a schedule.
    pub(crate) fn run(
        &self,
        boxes: &mut Outboxes,
        conns: &mut [Option<Box<dyn Connection>>],
        input: Contribution<'_>,
        recv: &mut [u8],
    ) -> Result<()> {
        let (r, n, seq) = (self.rank, self.nranks, self.seq);
        let k = Outbox::slot_of(seq);
        let desc = self.desc();
        // Every other rank must have finished the collective that last used this slot.
        let last = boxes.written[k];
        if boxes
            .seen_done
            .iter()
            .enumerate()
            .any(|(p, &d)| p != r && d < last)
        {
            let peers = &boxes.peers;
            let not_done = |p: usize| peers[p].as_ref().is_some_and(|o| o.done() < last);
            self.wait_for(conns, &boxes.mine, &not_done)?;
            for (seen, peer) in boxes.seen_done.iter_mut().zip(&boxes.peers) {
                if let Some(o) = peer {
                    *seen = o.done();
                }
            }
        }
        let data = match &input {
            Contribution::Buffer(b) => Some(*b),
            Contribution::InRecv(range) => recv.get(range.clone()),
        }
        .ok_or_else(|| self.internal("in-place input outside the receive buffer".into()))?;
        boxes
            .mine
            .post(k, seq, &desc.encode(r as u32), data)
            .map_err(|e| self.internal(e.to_string()))?;
        boxes.written[k] = seq;
        for peer in boxes.peers.iter().flatten() {
            peer.wake();
        }
        let boxes = &*boxes;

        let outbox = |p: usize| -> Option<&Outbox> {
            if p == r {
                Some(&boxes.mine)
            } else {
                boxes.peers[p].as_ref()
            }
        };
        let not_posted = |p: usize| p != r && outbox(p).is_some_and(|o| o.posted(k) != seq);
        self.wait_for(conns, &boxes.mine, &not_posted)?;
        for p in (0..n).filter(|&p| p != r) {
            let o = outbox(p).ok_or_else(|| self.internal(format!("no outbox of rank {p}")))?;
            let theirs: [u8; HEADER_LEN] = o.header(k);
            if !desc.is_encoded_in(p as u32, &theirs) {
                return Err(match OpDesc::decode(&theirs) {
                    Ok((theirs, _)) => Error::Mismatch {
                        rank: r,
                        peer: p,
                        ours: desc,
                        theirs,
                    },
                    Err(e) => self.internal(format!("rank {p} posted a bad header: {e}")),
                });
            }
        }
        self.combine(&outbox, recv)?;
        boxes.mine.finish(seq);
        // A rank waiting to write a slot again may wait for this one.
        for peer in boxes.peers.iter().flatten() {
            peer.wake();
        }
        Ok(())
    }

    fn output<'b>(&self, recv: &'b mut [u8], len: usize) -> Result<&'b mut [u8]> {
        let at = self.plan.output_offset;
        recv.get_mut(at..at + len)
            .ok_or_else(|| self.internal(format!("output {at}+{len} outside the receive buffer")))
    }

    /// Writes this rank's output from the contributions (every one posted and checked).
    fn combine<'o>(
        &self,
        outbox: &dyn Fn(usize) -> Option<&'o Outbox>,
        recv: &mut [u8],
    ) -> Result<()> {
        let (r, n, call) = (self.rank, self.nranks, self.call);
        let k = Outbox::slot_of(self.seq);
        let block = call.count * call.dtype.size();
        let kernel = |e: weftcc_collectives::reduce::KernelError| self.internal(e.to_string());
        let src =
            |p: usize| outbox(p).ok_or_else(|| self.internal(format!("no outbox of rank {p}")));
        match call.kind {
            OpKind::AllGather | OpKind::AllToAll => {
                // Block `p` of the output is rank `p`'s contribution, or (all-to-all) block `r`
                // of it; this rank's own too: in place, its input was copied into the outbox
                // before the output overwrites it.
                let part = if call.kind == OpKind::AllToAll {
                    r * block..(r + 1) * block
                } else {
                    0..block
                };
                let out = self.output(recv, block * n)?;
                for (p, out_block) in out.chunks_exact_mut(block).enumerate() {
                    src(p)?
                        .read(k, part.end, |b| copy_exact(out_block, &b[part.clone()]))
                        .map_err(|e| self.internal(e))?;
                }
                Ok(())
            }
            OpKind::AllReduce | OpKind::ReduceScatter => {
                let comb: Combiner = call.op.combiner();
                // Reduce-scatter: this rank's block of every contribution.
                let part = if call.kind == OpKind::ReduceScatter {
                    r * block..(r + 1) * block
                } else {
                    0..block
                };
                let out = self.output(recv, block)?;
                src(0)?
                    .read(k, part.end, |b| copy_exact(out, &b[part.clone()]))
                    .map_err(|e| self.internal(e))?;
                for p in 1..n {
                    src(p)?.read(k, part.end, |b| {
                        reduce::reduce_in_place(call.dtype, comb, out, &b[part.clone()])
                            .map_err(kernel)
                    })?;
                }
                Ok(())
            }
            other => Err(self.internal(format!("{other} does not run one-shot"))),
        }
    }

    /// Waits until no rank `p` has `pending(p)`, with the executor's idle policy, sleeping on
    /// this rank's doorbell (`mine`).
    #[inline(always)]
    fn wait_for(
        &self,
        conns: &mut [Option<Box<dyn Connection>>],
        mine: &Outbox,
        pending: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        // Usually nothing is pending: no idle policy, no description for errors.
        if !(0..self.nranks).any(pending) {
            return Ok(());
        }
        self.wait_while(conns, mine, pending)
    }

    /// [`OneShot::wait_for`] once something is pending.
    #[inline(never)]
    fn wait_while(
        &self,
        conns: &mut [Option<Box<dyn Connection>>],
        mine: &Outbox,
        pending: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let n = self.nranks;
        let desc = self.desc();
        let mut idle = executor::Idle::new(self.idle, self.timeout);
        loop {
            if !(0..n).any(pending) {
                return Ok(());
            }
            let step = idle.next(self.abort, self.poisoned).map_err(|stop| {
                let waiting_on: Vec<usize> = (0..n).filter(|&p| pending(p)).collect();
                stop.into_error(self.rank, &desc, waiting_on, self.timeout)
            })?;
            if step.check_liveness {
                for p in (0..n).filter(|&p| pending(p)) {
                    if let Some(conn) = conns.get_mut(p).and_then(|c| c.as_mut()) {
                        conn.check_peer()
                            .map_err(|e| executor::transport_error(self.rank, &desc, p, e))?;
                    }
                }
                // Every peer's schedule header up to this collective is a disagreement: one-shot
                // reads none.
                executor::stray_header(self.rank, &desc, self.seq, &|_| false, conns)?;
            }
            if let Some(sleep) = step.sleep {
                mine.sleep_unless(sleep, &|| !(0..n).any(pending));
            }
        }
    }
}

fn copy_exact(dst: &mut [u8], src: &[u8]) -> std::result::Result<(), String> {
    if dst.len() != src.len() {
        return Err(format!(
            "contribution of {} bytes for an output of {}",
            src.len(),
            dst.len()
        ));
    }
    dst.copy_from_slice(src);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CommConfig, DEFAULT_ONE_SHOT_MAX_BYTES};
    use crate::local::run_ranks;
    use weftcc_collectives::{DataType, ReduceOp};

    #[test]
    fn fits_small_collectives_only() {
        let call = |kind, count| RawOp::new(kind, DataType::Float32, count);
        assert!(fits(&call(OpKind::AllReduce, 2), 2, 1024));
        assert!(fits(&call(OpKind::AllReduce, 256), 2, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 257), 2, 1024));
        // Each rank reads the other ranks' contributions.
        assert!(fits(&call(OpKind::AllReduce, 85), 4, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 86), 4, 1024));
        assert!(fits(&call(OpKind::AllGather, 85), 4, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 0), 2, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 2), 1, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 2), MAX_RANKS + 1, 1 << 20));
        assert!(!fits(&call(OpKind::AllReduce, 2), 2, 0));
        // Reduce-scatter posts its whole input, and each rank reads its block of the others'.
        assert!(fits(&call(OpKind::ReduceScatter, 256), 4, 1 << 20));
        assert!(!fits(&call(OpKind::ReduceScatter, 257), 4, 1 << 20));
        assert!(fits(&call(OpKind::ReduceScatter, 256), 2, 1024));
        // Never more than a slot holds.
        assert!(!fits(&call(OpKind::AllReduce, 1025), 2, 1 << 20));
        // All-to-all too: each rank reads its block of the others' whole inputs.
        assert!(fits(&call(OpKind::AllToAll, 256), 4, 1 << 20));
        assert!(!fits(&call(OpKind::AllToAll, 257), 4, 1 << 20));
        assert!(fits(&call(OpKind::AllToAll, 85), 4, 1024));
        assert!(!fits(&call(OpKind::AllToAll, 86), 4, 1024));
        for kind in [OpKind::Broadcast, OpKind::Reduce, OpKind::Barrier] {
            assert!(!fits(&call(kind, 2), 2, 1024), "{kind}");
        }
    }

    fn config() -> CommConfig {
        let mut c = CommConfig::from_env().expect("config");
        c.one_shot_max = DEFAULT_ONE_SHOT_MAX_BYTES;
        c.algo = Default::default();
        c.timeout = Duration::from_secs(20);
        c
    }

    fn last_algorithm(comm: &crate::Communicator) -> Option<String> {
        comm.trace().last().and_then(|t| t.algorithm.clone())
    }

    /// Ranks that arrive at different times, many collectives in a row through alternating
    /// slots: every result is right (a rank that posted before the others read its previous
    /// post would overwrite values still unread).
    #[test]
    fn alternating_slots_hold_while_ranks_arrive_at_different_times() {
        let rounds = 40u64;
        let results = run_ranks(
            3,
            |_| config(),
            |rank, comm| {
                let mut got = Vec::new();
                for i in 0..rounds {
                    if (i as usize + rank).is_multiple_of(5) {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    let mut v = [i + rank as u64; 3];
                    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
                        .expect("all-reduce");
                    assert_eq!(last_algorithm(&comm).as_deref(), Some("one_shot"));
                    got.push(v[2]);
                    let mut g = [0u32; 6];
                    comm.all_gather(&[(i * 10) as u32 + rank as u32; 2], &mut g)
                        .expect("all-gather");
                    got.push(g.iter().map(|&x| x as u64).sum());
                }
                got
            },
        )
        .expect("ranks");
        let want: Vec<u64> = (0..rounds)
            .flat_map(|i| [3 * i + 3, 2 * (30 * i + 3)])
            .collect();
        for (rank, got) in results.iter().enumerate() {
            assert_eq!(got, &want, "rank {rank}");
        }
    }

    /// All-to-all one-shot, out of place and in place: block `p` of each rank's output is
    /// block `rank` of rank `p`'s input (its own included), call after call through both slots.
    #[test]
    fn all_to_all_one_shot_delivers_each_block_to_its_rank() {
        let (n, count) = (3usize, 2usize);
        let value = |round: u32, from: usize, to: usize, i: usize| {
            round * 1000 + (from * 100 + to * 10 + i) as u32
        };
        let results = run_ranks(
            n,
            |_| config(),
            |rank, comm| {
                let mut wrong = Vec::new();
                for round in 0..6u32 {
                    let input: Vec<u32> = (0..n * count)
                        .map(|j| value(round, rank, j / count, j % count))
                        .collect();
                    let want: Vec<u32> = (0..n * count)
                        .map(|j| value(round, j / count, rank, j % count))
                        .collect();
                    let mut out = vec![0u32; n * count];
                    comm.all_to_all(&input, &mut out).expect("all-to-all");
                    assert_eq!(last_algorithm(&comm).as_deref(), Some("one_shot"));
                    let mut buf = input.clone();
                    comm.all_to_all_in_place(&mut buf)
                        .expect("all-to-all in place");
                    assert_eq!(last_algorithm(&comm).as_deref(), Some("one_shot"));
                    if out != want || buf != want {
                        wrong.push((round, out, buf, want));
                    }
                }
                wrong
            },
        )
        .expect("ranks");
        for (rank, wrong) in results.iter().enumerate() {
            assert!(wrong.is_empty(), "rank {rank}: {wrong:?}");
        }
    }

    /// A broadcast's root sends and goes on, so between one-shot collectives it runs ahead of a
    /// slow rank: its next post waits until that rank has read the slot's previous post (without
    /// the wait the slow rank found its slot overwritten and waited until the timeout).
    #[test]
    fn a_rank_ahead_by_broadcasts_waits_before_writing_a_slot_again() {
        let rounds = 30u64;
        let results = run_ranks(
            3,
            |_| config(),
            |rank, comm| {
                comm.set_timeout(Duration::from_secs(10));
                let mut got = Vec::new();
                for i in 0..rounds {
                    let mut v = [i + rank as u64; 2];
                    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
                        .expect("all-reduce");
                    got.push(v[1]);
                    if rank == 2 {
                        std::thread::sleep(Duration::from_millis(3));
                    }
                    let mut b = [if rank == 0 { i } else { 0 }; 1];
                    comm.broadcast_in_place(&mut b, 0).expect("broadcast");
                    got.push(b[0]);
                }
                got
            },
        )
        .expect("ranks");
        let want: Vec<u64> = (0..rounds).flat_map(|i| [3 * i + 3, i]).collect();
        for (rank, got) in results.iter().enumerate() {
            assert_eq!(got, &want, "rank {rank}");
        }
    }

    /// Ranks that call different collectives (or counts) in one-shot get a mismatch naming the
    /// peer, not a hang or a wrong result.
    #[test]
    fn a_mismatch_between_one_shot_calls_is_an_error() {
        let results = run_ranks(
            2,
            |_| config(),
            |rank, comm| {
                comm.set_timeout(Duration::from_secs(5));
                let mut v = vec![1u32; if rank == 0 { 4 } else { 5 }];
                comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
            },
        )
        .expect("ranks");
        // The rank that sees the mismatch first reports it; the other learns it from that rank.
        let mut seen = 0;
        for (rank, r) in results.iter().enumerate() {
            match r {
                Err(Error::Mismatch { peer, .. }) => {
                    assert_eq!(*peer, 1 - rank);
                    seen += 1;
                }
                Err(Error::Aborted {
                    cause: crate::records::note::AbortCause::Mismatch,
                    ..
                }) => {}
                other => panic!("rank {rank}: {other:?}"),
            }
        }
        assert!(seen >= 1, "{results:?}");
    }

    /// A restriction of the algorithms (`WEFT_ALGO`) and `WEFT_SHM_ONESHOT_MAX=0` keep schedules.
    #[test]
    fn restrictions_and_zero_keep_schedules() {
        for (max, algo) in [(0, None), (DEFAULT_ONE_SHOT_MAX_BYTES, Some("ring"))] {
            let cfg = move |_| {
                let mut c = config();
                c.one_shot_max = max;
                if let Some(a) = algo {
                    c.algo = weftcc_topology::tuner::Selection::parse(a).expect("algo");
                }
                c
            };
            let algos = run_ranks(2, cfg, |_, comm| {
                let mut v = [1.0f32; 4];
                comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
                    .expect("all-reduce");
                assert_eq!(v, [2.0; 4]);
                last_algorithm(&comm)
            })
            .expect("ranks");
            assert!(
                algos.iter().all(|a| a.as_deref() != Some("one_shot")),
                "{algos:?}"
            );
        }
    }
}
