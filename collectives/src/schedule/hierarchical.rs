//! Hierarchical all-reduce as a pure schedule: reduce-scatter inside each host, all-reduce of
//! each shard across hosts, all-gather inside each host.
//!
//! Ranks are grouped into hosts by a [`HostLayout`]. Hosts may hold different numbers of ranks
//! and a host's ranks need not be contiguous. With `m` ranks on a host, the buffer is split into
//! `m` chunks as evenly as possible (the ring's chunks); after the host's ring reduce-scatter, the
//! rank with local index `i` holds chunk `(i + 1) mod m` reduced over the host. Hosts with
//! different `m` cut the buffer at different places, so the cross-host phase works on *pieces*:
//! the intervals between all hosts' chunk boundaries. Each piece lies in exactly one chunk of
//! every host; the ranks owning it (one per host, in host order) run a ring all-reduce on it.
//! With the same number of ranks on every host the pieces are the chunks, and local rank `i` of
//! every host meets only local rank `i` of the others. Finally each host's ring all-gather
//! spreads the chunks.
//!
//! The intra-host phases are exactly the two halves of [`ring_all_reduce`] over the host's
//! ranks; the cross-host phase is [`ring_all_reduce`] over the owners, in place on Output. Every
//! cross-host step waits for the reduce-scatter steps that wrote its piece, and every all-gather
//! step touching this rank's chunk waits for the cross-host steps that wrote it.

use super::build::{check_rank, even_chunk, slices};
use super::{ring_all_reduce, Action, BufId, Part, Region, Schedule, ScheduleError, Step, StepId};

/// Which host each rank is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLayout {
    /// Host index (`0..hosts()`) of each rank; hosts are numbered by their lowest rank.
    host_of: Vec<usize>,
    /// Ranks of each host, ascending.
    members: Vec<Vec<usize>>,
    /// Index of each rank within its host.
    local_index: Vec<usize>,
}

impl HostLayout {
    /// A layout from one label per rank: ranks with equal labels share a host.
    pub fn from_labels<T: PartialEq>(labels: &[T]) -> HostLayout {
        let mut host_of = Vec::with_capacity(labels.len());
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut local_index = Vec::with_capacity(labels.len());
        let mut first: Vec<usize> = Vec::new(); // lowest rank of each host
        for (r, label) in labels.iter().enumerate() {
            let h = match first.iter().position(|&f| labels[f] == *label) {
                Some(h) => h,
                None => {
                    first.push(r);
                    members.push(Vec::new());
                    first.len() - 1
                }
            };
            host_of.push(h);
            local_index.push(members[h].len());
            members[h].push(r);
        }
        HostLayout {
            host_of,
            members,
            local_index,
        }
    }

    /// One host holding all `nranks` ranks.
    pub fn single(nranks: usize) -> HostLayout {
        HostLayout::from_labels(&vec![0u8; nranks])
    }

    /// Ranks.
    pub fn nranks(&self) -> usize {
        self.host_of.len()
    }

    /// Hosts.
    pub fn hosts(&self) -> usize {
        self.members.len()
    }

    /// The host of `rank`.
    pub fn host_of(&self, rank: usize) -> Option<usize> {
        self.host_of.get(rank).copied()
    }

    /// The ranks of host `h`, ascending.
    pub fn members(&self, h: usize) -> &[usize] {
        self.members.get(h).map_or(&[], Vec::as_slice)
    }

    /// The largest number of ranks on one host.
    pub fn max_local(&self) -> usize {
        self.members.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Whether every host holds the same number of ranks.
    pub fn is_uniform(&self) -> bool {
        self.members.windows(2).all(|w| w[0].len() == w[1].len())
    }

    /// The index of `rank` among its host's ranks (its local rank).
    pub fn local_index(&self, rank: usize) -> Option<usize> {
        self.local_index.get(rank).copied()
    }

    /// Ranks per host when every host holds as many.
    pub fn ranks_per_host(&self) -> Option<usize> {
        self.is_uniform()
            .then(|| self.members.first().map_or(0, Vec::len))
    }

    /// The ranks with local index `l`, one per host that has one, in host order: the ranks that
    /// meet across hosts in a two-tier collective.
    pub fn cross_members(&self, l: usize) -> Vec<usize> {
        self.members
            .iter()
            .filter_map(|m| m.get(l).copied())
            .collect()
    }

    /// `rank`'s place among the [`HostLayout::cross_members`] of its local index (its host's
    /// index when the layout is uniform).
    pub fn cross_index(&self, rank: usize) -> Option<usize> {
        let (h, l) = (self.host_of(rank)?, self.local_index(rank)?);
        Some(self.members[..h].iter().filter(|m| m.len() > l).count())
    }
}

/// The chunk (of `m` even chunks of `count`) that contains element `e < count`.
fn chunk_of(e: usize, count: usize, m: usize) -> usize {
    // Chunk j starts at floor(j * count / m); find the last start <= e.
    let (mut lo, mut hi) = (0, m.max(1) - 1);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if even_chunk(mid, count, m).0 <= e {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The region an action writes in Output, if any.
fn output_write(a: &Action) -> Option<Region> {
    match *a {
        Action::RecvCopy { dst, .. }
        | Action::RecvReduce { dst, .. }
        | Action::Copy { dst, .. }
            if dst.buf == BufId::Output =>
        {
            Some(dst)
        }
        _ => None,
    }
}

/// The Output regions an action reads or writes.
fn output_touches(a: &Action) -> impl Iterator<Item = Region> {
    let regions: [Option<Region>; 2] = match *a {
        Action::Send { src, .. } => [Some(src), None],
        Action::RecvCopy { dst, .. } => [Some(dst), None],
        Action::RecvReduce { local, dst, .. } => [Some(local), Some(dst)],
        Action::Copy { src, dst } => [Some(src), Some(dst)],
    };
    regions
        .into_iter()
        .flatten()
        .filter(|r| r.buf == BufId::Output)
}

fn overlaps(a: &Region, b: &Region) -> bool {
    a.buf == b.buf && a.len > 0 && b.len > 0 && a.offset < b.end() && b.offset < a.end()
}

/// The steps among `writers` (ids, regions) whose region overlaps `r`.
fn writers_of(writers: &[(StepId, Region)], r: &Region) -> Vec<StepId> {
    writers
        .iter()
        .filter(|(_, w)| overlaps(w, r))
        .map(|&(id, _)| id)
        .collect()
}

fn add_peer(list: &mut Vec<usize>, x: usize) {
    if !list.contains(&x) {
        list.push(x);
    }
}

/// Hierarchical all-reduce (see the module documentation). Input and Output hold `count`
/// elements each and may be the same memory; no scratch space. `layout` covers all ranks.
pub fn hierarchical_all_reduce(
    rank: usize,
    layout: &HostLayout,
    count: usize,
    slice_elems: usize,
) -> Result<Schedule, ScheduleError> {
    let n = layout.nranks();
    check_rank(rank, n)?;
    let h = layout.host_of[rank];
    let group = &layout.members[h];
    let m = group.len();
    let i = layout.local_index[rank];
    let nhosts = layout.hosts();

    // Phases 1 and 3: the host's ring all-reduce, local peers mapped to ranks.
    let local = ring_all_reduce(Part {
        rank: i,
        nranks: m,
        count,
        slice_elems,
    })?;
    let rs_steps = if m == 1 {
        local.steps.len()
    } else {
        (0..m - 1)
            .map(|s| {
                let len = |c: usize| {
                    let (o, l) = even_chunk(c, count, m);
                    slices(o, l, slice_elems).count()
                };
                len(super::build::before(i, s, m)) + len(super::build::before(i, s + 1, m))
            })
            .sum()
    }
    .min(local.steps.len());
    let map_peer = |a: Action, to: &dyn Fn(usize) -> usize| match a {
        Action::Send { peer, src } => Action::Send {
            peer: to(peer),
            src,
        },
        Action::RecvCopy { peer, dst } => Action::RecvCopy {
            peer: to(peer),
            dst,
        },
        Action::RecvReduce { peer, local, dst } => Action::RecvReduce {
            peer: to(peer),
            local,
            dst,
        },
        c @ Action::Copy { .. } => c,
    };
    let to_rank = |p: usize| group[p];
    let mut steps: Vec<Step> = Vec::with_capacity(local.steps.len());
    for st in &local.steps[..rs_steps] {
        steps.push(Step {
            action: map_peer(st.action, &to_rank),
            deps: st.deps.clone(),
        });
    }
    let rs_writers: Vec<(StepId, Region)> = steps
        .iter()
        .enumerate()
        .filter_map(|(id, st)| output_write(&st.action).map(|r| (id, r)))
        .collect();
    let mut send_peers: Vec<usize> = local.send_peers.iter().map(|&p| group[p]).collect();
    let mut recv_peers: Vec<usize> = local.recv_peers.iter().map(|&p| group[p]).collect();

    // Phase 2: a ring all-reduce across hosts for every piece of this rank's chunk.
    let mut cross_writers: Vec<(StepId, Region)> = Vec::new();
    let (co, cl) = even_chunk((i + 1) % m, count, m);
    if nhosts > 1 && cl > 0 {
        let mut cuts: Vec<usize> = vec![co, co + cl];
        for hm in layout.members.iter().map(Vec::len) {
            for j in 1..hm {
                let c = even_chunk(j, count, hm).0;
                if c > co && c < co + cl {
                    cuts.push(c);
                }
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let (ps, pl) = (w[0], w[1] - w[0]);
            let owners: Vec<usize> = layout
                .members
                .iter()
                .map(|mem| {
                    let hm = mem.len();
                    mem[(chunk_of(ps, count, hm) + hm - 1) % hm]
                })
                .collect();
            let ring = ring_all_reduce(Part {
                rank: h,
                nranks: nhosts,
                count: pl,
                slice_elems,
            })?;
            let base = steps.len();
            let to_owner = |p: usize| owners[p];
            for st in &ring.steps {
                let mut action = map_peer(st.action, &to_owner);
                let shift = |r: Region| Region::new(BufId::Output, r.offset + ps, r.len);
                action = match action {
                    Action::Send { peer, src } => Action::Send {
                        peer,
                        src: shift(src),
                    },
                    Action::RecvCopy { peer, dst } => Action::RecvCopy {
                        peer,
                        dst: shift(dst),
                    },
                    Action::RecvReduce { peer, local, dst } => Action::RecvReduce {
                        peer,
                        local: shift(local),
                        dst: shift(dst),
                    },
                    Action::Copy { src, dst } => Action::Copy {
                        src: shift(src),
                        dst: shift(dst),
                    },
                };
                let mut deps: Vec<StepId> = st.deps.iter().map(|&d| d + base).collect();
                for r in output_touches(&action) {
                    deps.extend(writers_of(&rs_writers, &r));
                }
                deps.sort_unstable();
                deps.dedup();
                if let Some(r) = output_write(&action) {
                    cross_writers.push((steps.len(), r));
                }
                steps.push(Step { action, deps });
            }
            for &p in &ring.send_peers {
                add_peer(&mut send_peers, owners[p]);
            }
            for &p in &ring.recv_peers {
                add_peer(&mut recv_peers, owners[p]);
            }
        }
    } else if nhosts > 1 && count == 0 && i == 0 {
        // No data: the hosts' first ranks still exchange headers around a ring of hosts, so that
        // mismatched calls are noticed across hosts too.
        add_peer(&mut send_peers, layout.members[(h + 1) % nhosts][0]);
        add_peer(
            &mut recv_peers,
            layout.members[(h + nhosts - 1) % nhosts][0],
        );
    }

    // Phase 3: the all-gather half of the host's ring, after the cross-host steps of its chunk.
    let phase3_base = steps.len();
    for st in &local.steps[rs_steps..] {
        let action = map_peer(st.action, &to_rank);
        let mut deps: Vec<StepId> = st
            .deps
            .iter()
            .map(|&d| {
                if d < rs_steps {
                    d
                } else {
                    d - rs_steps + phase3_base
                }
            })
            .collect();
        for r in output_touches(&action) {
            deps.extend(writers_of(&cross_writers, &r));
        }
        deps.sort_unstable();
        deps.dedup();
        steps.push(Step { action, deps });
    }
    Ok(Schedule {
        steps,
        send_peers,
        recv_peers,
        scratch_elems: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_group_by_label() {
        let l = HostLayout::from_labels(&["b", "a", "b", "c", "a"]);
        assert_eq!(l.hosts(), 3);
        assert_eq!(l.members(0), &[0, 2]);
        assert_eq!(l.members(1), &[1, 4]);
        assert_eq!(l.members(2), &[3]);
        assert_eq!(l.host_of(4), Some(1));
        assert_eq!(l.max_local(), 2);
        assert!(!l.is_uniform());
        assert!(HostLayout::single(4).is_uniform());
        assert_eq!(HostLayout::single(0).hosts(), 0);
    }

    #[test]
    fn chunk_of_matches_even_chunks() {
        for count in 1..40 {
            for m in 1..9 {
                for e in 0..count {
                    let j = chunk_of(e, count, m);
                    let (o, l) = even_chunk(j, count, m);
                    assert!(o <= e && e < o + l, "e {e} count {count} m {m} -> {j}");
                }
            }
        }
    }

    #[test]
    fn uniform_hosts_pair_equal_local_ranks() {
        // 2 hosts x 2 ranks, interleaved: host A = {0, 2}, host B = {1, 3}.
        let l = HostLayout::from_labels(&[0, 1, 0, 1]);
        for r in 0..4 {
            let s = hierarchical_all_reduce(r, &l, 8, 2).unwrap();
            s.check(4).unwrap();
            let local_peer = [2, 3, 0, 1][r];
            let cross_peer = [1, 0, 3, 2][r];
            let mut peers = s.send_peers.clone();
            peers.sort_unstable();
            let mut want = vec![local_peer, cross_peer];
            want.sort_unstable();
            assert_eq!(peers, want, "rank {r}");
        }
    }

    #[test]
    fn every_rank_has_a_peer_at_count_zero() {
        let l = HostLayout::from_labels(&[0, 1, 1, 2, 2, 2]);
        for r in 0..6 {
            let s = hierarchical_all_reduce(r, &l, 0, 2).unwrap();
            assert!(s.steps.is_empty());
            assert!(
                !s.send_peers.is_empty() && !s.recv_peers.is_empty(),
                "rank {r}"
            );
        }
        assert_eq!(
            hierarchical_all_reduce(3, &HostLayout::single(3), 1, 1),
            Err(ScheduleError::RankOutOfRange { rank: 3, nranks: 3 })
        );
    }
}
