//! One-shot collectives among ranks that all share memory: every rank posts its contribution
//! once in its outbox ([`weftcc_transports::shm::Outbox`]) and every rank that needs them reads
//! the others' contributions in place, then finishes. A small collective then costs the cache
//! lines its data fills plus one flag per rank, not a schedule's messages (OpenMPI's and MPICH's
//! shared-memory collectives do the same).
//!
//! Who reads what ([`Roles`]): all-reduce, all-gather and reduce-scatter: every rank reads every
//! post; broadcast: the others read the root's; reduce: the root reads every post. Every rank
//! also checks the header posted with at least one peer's post against its own call (a
//! disagreement is [`Error::Mismatch`]). Reductions fold the contributions in rank order,
//! `((x0 ⊕ x1) ⊕ x2) …`, the order of deterministic mode's `Ordered` schedules: every rank gets
//! the same bits, and the same bits as `WEFT_DETERMINISTIC=1`.
//!
//! A slot is written again only once every rank finished the collective that last used it
//! (`done`), so a rank runs at most [`OUTBOX_SLOTS`](weftcc_transports::shm::OUTBOX_SLOTS) collectives ahead of the slowest. Waiting
//! follows the executor's idle policy and checks: abort, poison, timeout, the peer's liveness,
//! and a schedule's header sent where this rank runs one-shot. A post wakes the ranks that
//! check it; a finish wakes the ranks that said they wait for the others to finish.

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
use weftcc_transports::{Connection, IdleWaiter};

/// Most ranks a one-shot collective runs on: every reader reads every contribution, so its cost
/// grows with the ranks where a schedule's grows with their logarithm or not at all.
pub(crate) const MAX_RANKS: usize = 8;

/// Default of `WEFT_SHM_ONESHOT_MAX`: the most bytes a rank reads from the others' outboxes in
/// a collective run one-shot. Reading another core's lines is slower than a pipelined schedule
/// once they are many (on 2-core VMs, measured at 2 ranks: one-shot faster up to 1 KiB of
/// all-reduce, slower from 2 KiB on).
pub(crate) const DEFAULT_MAX_BYTES: usize = 1024;

const _: () = assert!(HEADER_LEN <= OUTBOX_HEADER_MAX);

/// Bytes each posting rank contributes to `call` on `n` ranks, and the most bytes one rank reads
/// from the others' posts; `None` when `call` is not a collective one-shot runs.
pub(crate) fn volume(call: &RawOp, n: usize) -> Option<(usize, usize)> {
    let block = call.count.checked_mul(call.dtype.size())?;
    let others = block.checked_mul(n.checked_sub(1)?)?;
    match call.kind {
        OpKind::AllReduce | OpKind::Reduce | OpKind::AllGather => Some((block, others)),
        OpKind::ReduceScatter => Some((block.checked_mul(n)?, others)),
        OpKind::Broadcast => Some((block, block)),
        OpKind::AllToAll | OpKind::Barrier | OpKind::SendRecv => None,
    }
}

/// Whether `call` runs one-shot on `n` ranks when a rank may read at most `max_read` bytes of
/// the others' posts. Depends only on the call and settings every rank shares, so all ranks
/// decide alike.
pub(crate) fn fits(call: &RawOp, n: usize, max_read: usize) -> bool {
    (2..=MAX_RANKS).contains(&n)
        && call.count > 0
        && volume(call, n)
            .is_some_and(|(posted, read)| posted <= OUTBOX_SLOT_BYTES && read <= max_read)
}

/// What one rank does in a one-shot collective. Every rank posts (its contribution, or only the
/// operation's header) and checks, besides the posts it reads, the header of its successor
/// (rank + 1 mod n): the pairs checked then connect every rank whatever root each believes in,
/// so ranks that disagree about the call cannot all finish; some rank meets a mismatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Roles {
    /// This rank's post carries its input (else only the header: a broadcast's receivers).
    pub contributes: bool,
    pub reads: Reads,
    /// The successor whose header this rank checks.
    pub next: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    /// Every rank's post, this rank's own included.
    All,
    /// One rank's post.
    One(usize),
    /// No post but the successor's header.
    Nothing,
}

impl Roles {
    pub(crate) fn of(kind: OpKind, rank: usize, root: usize, n: usize) -> Roles {
        let (contributes, reads) = match kind {
            OpKind::Broadcast if rank == root => (true, Reads::Nothing),
            OpKind::Broadcast => (false, Reads::One(root)),
            OpKind::Reduce if rank == root => (true, Reads::All),
            OpKind::Reduce => (true, Reads::Nothing),
            _ => (true, Reads::All),
        };
        Roles {
            contributes,
            reads,
            next: (rank + 1) % n,
        }
    }

    /// Whether this rank waits for the post of `peer` (another rank) and checks its header.
    fn checks(&self, peer: usize) -> bool {
        peer == self.next
            || match self.reads {
                Reads::All => true,
                Reads::One(p) => p == peer,
                Reads::Nothing => false,
            }
    }
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
        waiter: &mut dyn IdleWaiter,
        input: Contribution<'_>,
        recv: &mut [u8],
    ) -> Result<()> {
        let (r, n, call, seq) = (self.rank, self.nranks, self.call, self.seq);
        let roles = Roles::of(call.kind, r, call.root, n);
        let k = Outbox::slot_of(seq);
        let desc = self.desc();
        let encoded = desc.encode(r as u32);

        // Every rank must have finished the collective that last used this slot.
        let last = boxes.written[k];
        if boxes
            .seen_done
            .iter()
            .enumerate()
            .any(|(p, &d)| p != r && d < last)
        {
            let peers = &boxes.peers;
            let not_done = |p: usize| peers[p].as_ref().is_some_and(|o| o.done() < last);
            // The others ring this rank when they finish while it says it waits.
            boxes.mine.set_waiting(true);
            let waited = self.wait_for(conns, waiter, &not_done);
            boxes.mine.set_waiting(false);
            waited?;
            for (seen, peer) in boxes.seen_done.iter_mut().zip(&boxes.peers) {
                if let Some(o) = peer {
                    *seen = o.done();
                }
            }
        }
        let data = match (&input, roles.contributes) {
            (_, false) => Some(&[][..]),
            (Contribution::Buffer(b), true) => Some(*b),
            (Contribution::InRecv(range), true) => recv.get(range.clone()),
        }
        .ok_or_else(|| self.internal("in-place input outside the receive buffer".into()))?;
        boxes
            .mine
            .post(k, seq, &encoded, data)
            .map_err(|e| self.internal(e.to_string()))?;
        boxes.written[k] = seq;
        for (p, peer) in boxes.peers.iter().enumerate() {
            if let Some(o) = peer {
                if Roles::of(call.kind, p, call.root, n).checks(r) {
                    o.ring();
                }
            }
        }

        let boxes_ref = &*boxes;
        let outbox = |p: usize| -> Option<&Outbox> {
            if p == r {
                Some(&boxes_ref.mine)
            } else {
                boxes_ref.peers[p].as_ref()
            }
        };
        let not_posted =
            |p: usize| p != r && roles.checks(p) && outbox(p).is_some_and(|o| o.posted(k) != seq);
        self.wait_for(conns, waiter, &not_posted)?;
        for p in (0..n).filter(|&p| p != r && roles.checks(p)) {
            let o = outbox(p).ok_or_else(|| self.internal(format!("no outbox of rank {p}")))?;
            let posted = o.posted(k);
            if posted != seq {
                return Err(self.internal(format!(
                    "rank {p}'s slot holds collective #{posted}, expected #{seq}"
                )));
            }
            let header = o.header(k);
            let mut theirs = [0u8; HEADER_LEN];
            theirs.copy_from_slice(&header[..HEADER_LEN]);
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
        if roles.reads != Reads::Nothing {
            self.combine(&outbox, recv)?;
        }

        boxes.mine.finish(seq);
        for peer in boxes.peers.iter().flatten() {
            if peer.waiting() {
                peer.ring();
            }
        }
        // An out-of-place broadcast root copies its own input.
        if let (OpKind::Broadcast, true, Contribution::Buffer(b)) =
            (call.kind, r == call.root, &input)
        {
            self.output(recv, b.len())?.copy_from_slice(b);
        }
        Ok(())
    }

    fn output<'b>(&self, recv: &'b mut [u8], len: usize) -> Result<&'b mut [u8]> {
        let at = self.plan.output_offset;
        recv.get_mut(at..at + len)
            .ok_or_else(|| self.internal(format!("output {at}+{len} outside the receive buffer")))
    }

    /// Writes this rank's output from the posted contributions (all of them posted and checked).
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
            OpKind::Broadcast => {
                let out = self.output(recv, block)?;
                src(call.root)?
                    .read(k, block, |b| copy_exact(out, b))
                    .map_err(|e| self.internal(e))
            }
            OpKind::AllGather => {
                let out = self.output(recv, block * n)?;
                for (p, part) in out.chunks_exact_mut(block).enumerate() {
                    src(p)?
                        .read(k, block, |b| copy_exact(part, b))
                        .map_err(|e| self.internal(e))?;
                }
                Ok(())
            }
            OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter => {
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

    /// Waits until no rank `p` has `pending(p)`, with the executor's idle policy.
    fn wait_for(
        &self,
        conns: &mut [Option<Box<dyn Connection>>],
        waiter: &mut dyn IdleWaiter,
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
                waiter
                    .wait(&[], sleep)
                    .map_err(|e| executor::transport_error(self.rank, &desc, self.rank, e))?;
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
    use weftcc_collectives::DataType;

    #[test]
    fn roles_post_and_read_as_documented() {
        use OpKind::*;
        for n in 2..=4 {
            let root = 1;
            for r in 0..n {
                let next = (r + 1) % n;
                let roles = |contributes, reads| Roles {
                    contributes,
                    reads,
                    next,
                };
                for kind in [AllReduce, AllGather, ReduceScatter] {
                    assert_eq!(Roles::of(kind, r, root, n), roles(true, Reads::All));
                }
                let b = Roles::of(Broadcast, r, root, n);
                if r == root {
                    assert_eq!(b, roles(true, Reads::Nothing));
                } else {
                    assert_eq!(b, roles(false, Reads::One(root)));
                }
                let red = Roles::of(Reduce, r, root, n);
                if r == root {
                    assert_eq!(red, roles(true, Reads::All));
                } else {
                    assert_eq!(red, roles(true, Reads::Nothing));
                }
            }
        }
    }

    /// Whatever root each rank believes in, the header checks connect every rank: ranks that
    /// disagree about the call cannot all finish without one of them checking the other's.
    #[test]
    fn header_checks_connect_every_rank_whatever_roots_they_believe() {
        use OpKind::*;
        fn find(parent: &[usize], mut x: usize) -> usize {
            while parent[x] != x {
                x = parent[x];
            }
            x
        }
        for kind in [AllReduce, AllGather, ReduceScatter, Broadcast, Reduce] {
            for n in 2..=4usize {
                // Every assignment of believed roots to ranks.
                for code in 0..n.pow(n as u32) {
                    let roots: Vec<usize> = (0..n).map(|r| code / n.pow(r as u32) % n).collect();
                    let mut parent: Vec<usize> = (0..n).collect();
                    for (r, &root) in roots.iter().enumerate() {
                        let roles = Roles::of(kind, r, root, n);
                        for q in (0..n).filter(|&q| q != r && roles.checks(q)) {
                            let (a, b) = (find(&parent, r), find(&parent, q));
                            parent[a] = b;
                        }
                    }
                    let first = find(&parent, 0);
                    assert!(
                        (0..n).all(|r| find(&parent, r) == first),
                        "{kind} on {n} ranks with roots {roots:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn fits_small_collectives_only() {
        let call = |kind, count| RawOp::new(kind, DataType::Float32, count);
        assert!(fits(&call(OpKind::AllReduce, 2), 2, 1024));
        assert!(fits(&call(OpKind::AllReduce, 256), 2, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 257), 2, 1024));
        // Each rank reads the other ranks' contributions.
        assert!(fits(&call(OpKind::AllReduce, 85), 4, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 86), 4, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 0), 2, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 2), 1, 1024));
        assert!(!fits(&call(OpKind::AllReduce, 2), MAX_RANKS + 1, 1 << 20));
        assert!(!fits(&call(OpKind::AllReduce, 2), 2, 0));
        // Reduce-scatter posts its whole input, and each rank reads its block of the others'.
        assert!(fits(&call(OpKind::ReduceScatter, 256), 4, 1 << 20));
        assert!(!fits(&call(OpKind::ReduceScatter, 257), 4, 1 << 20));
        assert!(fits(&call(OpKind::ReduceScatter, 256), 2, 1024));
        // Broadcast receivers read the root's block.
        assert!(fits(&call(OpKind::Broadcast, 256), 8, 1024));
        assert!(!fits(&call(OpKind::AllToAll, 2), 2, 1024));
        // Never more than a slot holds.
        assert!(!fits(&call(OpKind::Broadcast, 1025), 2, 1 << 20));
    }

    use crate::config::CommConfig;
    use crate::local::run_ranks;
    use weftcc_collectives::ReduceOp;

    fn config() -> CommConfig {
        let mut c = CommConfig::from_env().expect("config");
        c.one_shot_max = DEFAULT_MAX_BYTES;
        c.algo = Default::default();
        c.timeout = Duration::from_secs(20);
        c
    }

    fn last_algorithm(comm: &crate::Communicator) -> Option<String> {
        comm.trace().last().and_then(|t| t.algorithm.clone())
    }

    /// A broadcast root and reduce contributors run ahead of a slow reader by more than the
    /// outbox has slots: each slot is written again only once every rank read it, so every
    /// value arrives intact (a writer that did not wait overwrites values still unread).
    #[test]
    fn writers_ahead_of_a_slow_reader_wait_for_their_slots() {
        let rounds = 5 * weftcc_transports::shm::OUTBOX_SLOTS as u64;
        let results = run_ranks(
            3,
            |_| config(),
            |rank, comm| {
                let mut got = Vec::new();
                for i in 0..rounds {
                    if rank == 2 && i % 7 == 0 {
                        std::thread::sleep(Duration::from_millis(3));
                    }
                    let mut b = [if rank == 0 { i * 10 + 1 } else { 0 }; 3];
                    comm.broadcast_in_place(&mut b, 0).expect("broadcast");
                    assert_eq!(last_algorithm(&comm).as_deref(), Some("one_shot"));
                    got.push(b[2]);
                    let mut r = [i + rank as u64; 2];
                    comm.reduce_in_place(&mut r, ReduceOp::Sum, 2)
                        .expect("reduce");
                    if rank == 2 {
                        got.push(r[1]);
                    }
                }
                got
            },
        )
        .expect("ranks");
        for (rank, got) in results.iter().enumerate() {
            let want: Vec<u64> = (0..rounds)
                .flat_map(|i| {
                    let b = i * 10 + 1;
                    if rank == 2 {
                        vec![b, 3 * i + 3]
                    } else {
                        vec![b]
                    }
                })
                .collect();
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
        for (max, algo) in [(0, None), (DEFAULT_MAX_BYTES, Some("ring"))] {
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
