//! What every schedule builder shares: argument checks, ring arithmetic, slicing, and the
//! [`Builder`] that accumulates steps.

use super::{Action, BufId, Part, Region, Schedule, ScheduleError, Step, StepId, MAX_RANKS};

pub(crate) fn check_rank(rank: usize, nranks: usize) -> Result<(), ScheduleError> {
    if nranks == 0 {
        Err(ScheduleError::NoRanks)
    } else if nranks > MAX_RANKS {
        Err(ScheduleError::TooManyRanks {
            nranks,
            max: MAX_RANKS,
        })
    } else if rank >= nranks {
        Err(ScheduleError::RankOutOfRange { rank, nranks })
    } else {
        Ok(())
    }
}

pub(crate) fn check_root(root: usize, nranks: usize) -> Result<(), ScheduleError> {
    if root >= nranks {
        Err(ScheduleError::RootOutOfRange { root, nranks })
    } else {
        Ok(())
    }
}

/// Recursive doubling and halving pair ranks by `rank ^ 2^k`: they need a power of two.
pub(crate) fn check_power_of_two(nranks: usize) -> Result<(), ScheduleError> {
    if nranks.is_power_of_two() {
        Ok(())
    } else {
        Err(ScheduleError::NotPowerOfTwo { nranks })
    }
}

/// `count * nranks`, or an error when it overflows.
pub(crate) fn total(count: usize, nranks: usize) -> Result<usize, ScheduleError> {
    count
        .checked_mul(nranks)
        .ok_or(ScheduleError::CountOverflow { count, nranks })
}

/// `(rank + n - back) % n` for `back <= n` (the ring position `back` places before `rank`).
pub(crate) fn before(rank: usize, back: usize, n: usize) -> usize {
    // rank < n <= MAX_RANKS and back <= n: no overflow or underflow (saturating regardless).
    (rank.saturating_add(n).saturating_sub(back)) % n.max(1)
}

/// The `[start, end)` of chunk `i` of `count` elements split as evenly as possible into `n`.
pub(crate) fn even_chunk(i: usize, count: usize, n: usize) -> (usize, usize) {
    let n = n.max(1) as u128;
    let at = |j: usize| ((j as u128 * count as u128) / n) as usize;
    let start = at(i);
    (start, at(i + 1).saturating_sub(start))
}

/// Splits `len` elements at `offset` into messages of at most `slice` elements (0 means 1):
/// `(offset, len)` pairs, none empty. Both ends of a transfer compute the same split.
pub(crate) fn slices(
    offset: usize,
    len: usize,
    slice: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let slice = slice.max(1);
    (0..len.div_ceil(slice)).map(move |k| {
        let start = k * slice;
        (offset + start, slice.min(len - start))
    })
}

/// How every builder of a collective starts: the `part`'s rank is checked, then `root` where the
/// collective has one, and a single rank gets [`Builder::single_rank`] (the whole schedule of
/// every collective there: Input copied to Output). `body` builds the schedule of two ranks or
/// more on a fresh [`Builder`]; checks that cannot fail for one rank (a power of two, the total
/// count) belong in it.
pub(crate) fn collective(
    part: Part,
    root: Option<usize>,
    body: impl FnOnce(Builder) -> Result<Schedule, ScheduleError>,
) -> Result<Schedule, ScheduleError> {
    let Part {
        rank,
        nranks,
        count,
        ..
    } = part;
    check_rank(rank, nranks)?;
    if let Some(root) = root {
        check_root(root, nranks)?;
    }
    if nranks == 1 {
        Ok(Builder::single_rank(count))
    } else {
        body(Builder::default())
    }
}

/// The neighbours of a rank on the ring `rank -> rank + 1`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring {
    /// The rank sent to, `rank + 1`.
    pub(crate) next: usize,
    /// The rank received from, `rank - 1`.
    pub(crate) prev: usize,
}

impl Ring {
    pub(crate) fn around(rank: usize, n: usize) -> Self {
        Ring {
            next: (rank + 1) % n.max(1),
            prev: before(rank, 1, n),
        }
    }

    /// The end of a schedule that sends to `next` and receives from `prev`.
    pub(crate) fn finish(self, b: Builder, scratch_elems: usize) -> Schedule {
        b.finish(vec![self.next], vec![self.prev], scratch_elems)
    }
}

/// A rank's place in a pipelined chain laid along the ring: `pos` of `n` (0 first, `n - 1`
/// last), forwarding to `ring.next` and receiving from `ring.prev`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chain {
    pub(crate) pos: usize,
    pub(crate) n: usize,
    pub(crate) ring: Ring,
}

impl Chain {
    /// The chain of `n` ranks that starts at rank `first` (`first <= n`).
    pub(crate) fn starting_at(first: usize, rank: usize, n: usize) -> Self {
        Chain {
            pos: before(rank, first, n),
            n,
            ring: Ring::around(rank, n),
        }
    }

    /// Neither end of the chain.
    pub(crate) fn is_middle(self) -> bool {
        self.pos > 0 && !self.is_last()
    }

    pub(crate) fn is_last(self) -> bool {
        self.pos + 1 >= self.n
    }

    /// `(send_peers, recv_peers)`: every rank but the last sends on, every rank but the first
    /// receives.
    pub(crate) fn peers(self) -> (Vec<usize>, Vec<usize>) {
        let send = (!self.is_last()).then_some(self.ring.next);
        let recv = (self.pos > 0).then_some(self.ring.prev);
        (send.into_iter().collect(), recv.into_iter().collect())
    }

    /// The pipelined reduction of `Input[from .. from + count]` along the chain: the first rank
    /// sends its Input slice by slice, a middle rank combines each slice it receives with its
    /// own Input slice into Scratch (at the same offsets) and forwards it, the last rank
    /// combines into `result(offset, len)`. Returns, per slice, its offset and length and the
    /// step that last touched the Input slice on this rank (to order a later write of the same
    /// memory after it); on the last rank that step wrote the result slice.
    pub(crate) fn fold(
        self,
        b: &mut Builder,
        from: usize,
        count: usize,
        slice_elems: usize,
        result: &dyn Fn(usize, usize) -> Region,
    ) -> Vec<(usize, usize, StepId)> {
        let Ring { next, prev } = self.ring;
        let mut done = Vec::new();
        for (o, l) in slices(from, count, slice_elems) {
            let input = Region::new(BufId::Input, o, l);
            let id = if self.pos == 0 {
                b.send(next, input, Vec::new())
            } else if self.is_middle() {
                let partial = Region::new(BufId::Scratch, o, l);
                let r = b.recv_reduce(prev, input, partial, Vec::new());
                b.send(next, partial, vec![r]);
                r
            } else {
                b.recv_reduce(prev, input, result(o, l), Vec::new())
            };
            done.push((o, l, id));
        }
        done
    }
}

/// Which step last wrote which elements of one buffer, for schedules whose reads do not line up
/// with earlier writes' slices (recursive doubling and halving): a read waits for every write
/// it overlaps. Writes recorded at the same start replace each other.
#[derive(Default)]
pub(crate) struct Writes(std::collections::BTreeMap<usize, (usize, StepId)>);

impl Writes {
    pub(crate) fn record(&mut self, start: usize, len: usize, step: StepId) {
        self.0.insert(start, (start + len, step));
    }

    /// The steps whose writes overlap `start .. start + len` (writes do not overlap each other).
    pub(crate) fn overlapping(&self, start: usize, len: usize) -> Vec<StepId> {
        self.0
            .range(..start + len)
            .rev()
            .take_while(|(_, &(end, _))| end > start)
            .map(|(_, &(_, step))| step)
            .collect()
    }
}

/// Accumulates steps.
#[derive(Default)]
pub(crate) struct Builder {
    pub(crate) steps: Vec<Step>,
}

impl Builder {
    pub(crate) fn push(&mut self, action: Action, deps: Vec<StepId>) -> StepId {
        let id = self.steps.len();
        self.steps.push(Step { action, deps });
        id
    }

    pub(crate) fn send(&mut self, peer: usize, src: Region, deps: Vec<StepId>) -> StepId {
        self.push(Action::Send { peer, src }, deps)
    }

    pub(crate) fn recv_copy(&mut self, peer: usize, dst: Region, deps: Vec<StepId>) -> StepId {
        self.push(Action::RecvCopy { peer, dst }, deps)
    }

    pub(crate) fn recv_reduce(
        &mut self,
        peer: usize,
        local: Region,
        dst: Region,
        deps: Vec<StepId>,
    ) -> StepId {
        self.push(Action::RecvReduce { peer, local, dst }, deps)
    }

    /// A local copy of `len` elements, omitted when empty.
    pub(crate) fn copy(&mut self, src: Region, dst: Region) -> Option<StepId> {
        (src.len > 0).then(|| self.push(Action::Copy { src, dst }, Vec::new()))
    }

    /// The whole schedule of a collective on one rank: a local copy of `count` elements from
    /// Input to Output (none when empty or, at run time, in place).
    pub(crate) fn single_rank(count: usize) -> Schedule {
        let mut b = Builder::default();
        b.copy(
            Region::new(BufId::Input, 0, count),
            Region::new(BufId::Output, 0, count),
        );
        b.finish(Vec::new(), Vec::new(), 0)
    }

    /// One step of a pipelined exchange: the k-th send slice, then the k-th receive slice, for
    /// every k up to the longer list, so a rank forwards slice k while slice k + 1 arrives.
    /// `send(b, k, slice)` and `recv(b, k, slice)` push the steps; their ids come back in order.
    pub(crate) fn exchange(
        &mut self,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
        mut send: impl FnMut(&mut Self, usize, (usize, usize)) -> StepId,
        mut recv: impl FnMut(&mut Self, usize, (usize, usize)) -> StepId,
    ) -> (Vec<StepId>, Vec<StepId>) {
        let mut sent = Vec::with_capacity(sends.len());
        let mut received = Vec::with_capacity(recvs.len());
        for k in 0..sends.len().max(recvs.len()) {
            if let Some(&slice) = sends.get(k) {
                sent.push(send(self, k, slice));
            }
            if let Some(&slice) = recvs.get(k) {
                received.push(recv(self, k, slice));
            }
        }
        (sent, received)
    }

    pub(crate) fn finish(
        self,
        send_peers: Vec<usize>,
        recv_peers: Vec<usize>,
        scratch_elems: usize,
    ) -> Schedule {
        Schedule {
            steps: self.steps,
            send_peers,
            recv_peers,
            scratch_elems,
        }
    }
}

/// The dependency list "slice `k` of the previous transfer", empty when there is none.
pub(crate) fn dep_at(ids: &[StepId], k: usize) -> Vec<StepId> {
    ids.get(k).copied().into_iter().collect()
}
