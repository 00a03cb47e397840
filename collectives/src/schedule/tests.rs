//! Builder tests: every schedule checked for structure, peers, dependencies and sizes.

use super::build::{even_chunk, slices};
use super::tree::{tree_all_reduce, tree_broadcast, tree_reduce};
use super::*;
use std::collections::HashMap;

/// The part of rank `rank` of `nranks` in a collective of `count` elements.
fn part(rank: usize, nranks: usize, count: usize, slice_elems: usize) -> Part {
    Part {
        rank,
        nranks,
        count,
        slice_elems,
    }
}

/// Elements of Input and Output every rank's schedule may address (besides its Scratch).
struct Sizes {
    input: usize,
    output: usize,
}

impl Sizes {
    fn new(input: usize, output: usize) -> Self {
        Sizes { input, output }
    }
}

fn region_fits(r: &Region, sizes: &Sizes, scratch: usize) -> bool {
    let cap = match r.buf {
        BufId::Input => sizes.input,
        BufId::Output => sizes.output,
        BufId::Scratch => scratch,
    };
    r.offset + r.len <= cap
}

/// Checks the structural rules over the schedules of all ranks of one collective.
fn check_all(scheds: &[Schedule], sizes: &Sizes, slice: usize, all_peers_talk: bool) {
    let n = scheds.len();
    let slice = slice.max(1);
    // (from, to) -> lengths of the sends in order, and of the receives in order.
    let mut sent: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    let mut recvd: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (r, s) in scheds.iter().enumerate() {
        s.check(n).unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (i, step) in s.steps.iter().enumerate() {
            assert!(step.deps.iter().all(|&d| d < i), "rank {r} step {i}");
            let regions: Vec<Region> = match step.action {
                Action::Send { peer, src } => {
                    assert!(src.len <= slice, "rank {r} step {i} too long");
                    sent.entry((r, peer)).or_default().push(src.len);
                    vec![src]
                }
                Action::RecvCopy { peer, dst } => {
                    assert!(dst.len <= slice, "rank {r} step {i} too long");
                    recvd.entry((peer, r)).or_default().push(dst.len);
                    vec![dst]
                }
                Action::RecvReduce { peer, local, dst } => {
                    assert!(dst.len <= slice, "rank {r} step {i} too long");
                    assert_eq!(local.len, dst.len);
                    recvd.entry((peer, r)).or_default().push(dst.len);
                    vec![local, dst]
                }
                Action::Copy { src, dst } => {
                    assert_eq!(src.len, dst.len);
                    vec![src, dst]
                }
            };
            for reg in regions {
                assert!(reg.len > 0, "rank {r} step {i} empty");
                assert!(
                    region_fits(&reg, sizes, s.scratch_elems),
                    "rank {r} step {i} region {reg:?} out of bounds"
                );
            }
        }
        for &p in &s.send_peers {
            assert!(
                scheds[p].recv_peers.contains(&r),
                "{r} -> {p} not in recv_peers"
            );
        }
        for &p in &s.recv_peers {
            assert!(
                scheds[p].send_peers.contains(&r),
                "{p} -> {r} not in send_peers"
            );
        }
        if all_peers_talk && n > 1 {
            assert!(!s.send_peers.is_empty() && !s.recv_peers.is_empty());
        }
    }
    for (pair, lens) in &sent {
        assert_eq!(Some(lens), recvd.get(pair), "channel {pair:?}");
    }
    for (pair, lens) in &recvd {
        assert_eq!(Some(lens), sent.get(pair), "channel {pair:?}");
    }
}

const COUNTS: [usize; 9] = [0, 1, 2, 3, 5, 7, 16, 33, 100];
const SLICES: [usize; 5] = [0, 1, 3, 8, 1000];

fn grid(mut f: impl FnMut(usize, usize, usize)) {
    for n in 1..=9 {
        for count in COUNTS {
            for slice in SLICES {
                f(n, count, slice);
            }
        }
    }
}

#[test]
fn ring_all_reduce_structure() {
    grid(|n, count, slice| {
        let s: Vec<_> = (0..n)
            .map(|r| ring_all_reduce(part(r, n, count, slice)).unwrap())
            .collect();
        let sizes = Sizes::new(count, count);
        check_all(&s, &sizes, slice, true);
    });
}

/// [`check_all`] on every rank's reduce-scatter schedule from `build`; returns them.
fn check_reduce_scatter_shape(
    build: fn(Part) -> Result<Schedule, ScheduleError>,
    n: usize,
    count: usize,
    slice: usize,
    all_peers_talk: bool,
) -> Vec<Schedule> {
    let s: Vec<_> = (0..n)
        .map(|r| build(part(r, n, count, slice)).unwrap())
        .collect();
    let sizes = Sizes::new(n * count, count);
    check_all(&s, &sizes, slice, all_peers_talk);
    s
}

#[test]
fn ring_reduce_scatter_structure() {
    grid(|n, count, slice| {
        for sched in check_reduce_scatter_shape(ring_reduce_scatter, n, count, slice, true) {
            assert!(sched.scratch_elems <= 2 * count);
        }
    });
}

/// For a builder of power-of-two rank counts only: whether `n` is one, after checking that
/// any other count is refused.
fn power_of_two_or_refused(
    build: fn(Part) -> Result<Schedule, ScheduleError>,
    n: usize,
    count: usize,
    slice: usize,
) -> bool {
    if n.is_power_of_two() {
        return true;
    }
    assert_eq!(
        build(part(0, n, count, slice)),
        Err(ScheduleError::NotPowerOfTwo { nranks: n })
    );
    false
}

#[test]
fn recursive_halving_reduce_scatter_structure() {
    grid(|n, count, slice| {
        if !power_of_two_or_refused(recursive_halving_reduce_scatter, n, count, slice) {
            return;
        }
        let s =
            check_reduce_scatter_shape(recursive_halving_reduce_scatter, n, count, slice, false);
        for (r, sched) in s.iter().enumerate() {
            // One partner per round: rank ^ n/2, rank ^ n/4, …, rank ^ 1.
            let partners: Vec<_> = (0..n.ilog2()).rev().map(|k| r ^ (1 << k)).collect();
            assert_eq!(sched.send_peers, partners, "n {n} rank {r}");
            assert!(sched.scratch_elems <= n * count);
        }
    });
}

/// [`check_all`] on every rank's all-gather schedule from `build`.
fn check_all_gather_shape(
    build: fn(Part) -> Result<Schedule, ScheduleError>,
    n: usize,
    count: usize,
    slice: usize,
    all_peers_talk: bool,
) {
    let s: Vec<_> = (0..n)
        .map(|r| build(part(r, n, count, slice)).unwrap())
        .collect();
    let sizes = Sizes::new(count, n * count);
    check_all(&s, &sizes, slice, all_peers_talk);
}

#[test]
fn ring_all_gather_structure() {
    grid(|n, count, slice| check_all_gather_shape(ring_all_gather, n, count, slice, true));
}

#[test]
fn recursive_doubling_all_gather_structure() {
    grid(|n, count, slice| {
        if power_of_two_or_refused(recursive_doubling_all_gather, n, count, slice) {
            check_all_gather_shape(recursive_doubling_all_gather, n, count, slice, false);
        }
    });
}

#[test]
fn chain_structure() {
    grid(|n, count, slice| {
        for root in 0..n {
            let sizes = Sizes::new(count, count);
            let s: Vec<_> = (0..n)
                .map(|r| chain_broadcast(part(r, n, count, slice), root).unwrap())
                .collect();
            check_all(&s, &sizes, slice, false);
            let s: Vec<_> = (0..n)
                .map(|r| chain_reduce(part(r, n, count, slice), root).unwrap())
                .collect();
            check_all(&s, &sizes, slice, false);
            for (r, sched) in s.iter().enumerate() {
                if r != root {
                    let writes_output = sched.steps.iter().any(|st| {
                        matches!(
                            st.action,
                            Action::RecvCopy { dst, .. }
                                | Action::RecvReduce { dst, .. }
                                | Action::Copy { dst, .. } if dst.buf == BufId::Output
                        )
                    });
                    assert!(!writes_output, "non-root {r} writes Output");
                }
            }
        }
    });
}

#[test]
fn all_to_all_and_barrier_structure() {
    grid(|n, count, slice| {
        for in_place in [false, true] {
            let s: Vec<_> = (0..n)
                .map(|r| pairwise_all_to_all(part(r, n, count, slice), in_place).unwrap())
                .collect();
            let sizes = Sizes::new(n * count, n * count);
            check_all(&s, &sizes, slice, true);
            for sched in &s {
                assert_eq!(sched.send_peers.len(), n - 1);
            }
        }
    });
    for n in 1..=40 {
        let s: Vec<_> = (0..n)
            .map(|r| dissemination_barrier(r, n).unwrap())
            .collect();
        let sizes = Sizes::new(0, 0);
        check_all(&s, &sizes, 1, true);
        let rounds = (usize::BITS - (n - 1).leading_zeros()) as usize;
        assert_eq!(s[0].send_peers.len(), if n == 1 { 0 } else { rounds });
    }
}

#[test]
fn slicing_and_chunks() {
    assert_eq!(
        slices(10, 7, 3).collect::<Vec<_>>(),
        [(10, 3), (13, 3), (16, 1)]
    );
    assert_eq!(slices(0, 2, 0).collect::<Vec<_>>(), [(0, 1), (1, 1)]);
    assert_eq!(slices(5, 0, 4).count(), 0);
    let chunks: Vec<_> = (0..4).map(|i| even_chunk(i, 10, 4)).collect();
    assert_eq!(chunks, [(0, 2), (2, 3), (5, 2), (7, 3)]);
    assert_eq!(even_chunk(2, usize::MAX, 3).1, usize::MAX / 3);
}

#[test]
fn count_zero_keeps_peers_and_emits_no_steps() {
    for n in 2..=5 {
        for r in 0..n {
            for s in [
                ring_all_reduce(part(r, n, 0, 4)).unwrap(),
                ring_reduce_scatter(part(r, n, 0, 4)).unwrap(),
                ring_all_gather(part(r, n, 0, 4)).unwrap(),
                pairwise_all_to_all(part(r, n, 0, 4), true).unwrap(),
            ] {
                assert!(s.steps.is_empty());
                assert!(!s.send_peers.is_empty() && !s.recv_peers.is_empty());
            }
        }
    }
    let s = ring_all_reduce(part(0, 1, 0, 4)).unwrap();
    assert!(s.steps.is_empty() && s.send_peers.is_empty());
}

#[test]
fn invalid_arguments_are_errors() {
    use ScheduleError::NoRanks;
    let rank = |rank, nranks| ScheduleError::RankOutOfRange { rank, nranks };
    let root = |root, nranks| ScheduleError::RootOutOfRange { root, nranks };
    let overflow = |count, nranks| ScheduleError::CountOverflow { count, nranks };
    let half = usize::MAX / 2;
    let cases = [
        (ring_all_reduce(part(0, 0, 5, 1)), NoRanks),
        (ring_reduce_scatter(part(3, 3, 5, 1)), rank(3, 3)),
        (chain_broadcast(part(0, 3, 5, 1), 3), root(3, 3)),
        (chain_reduce(part(0, 2, 5, 1), 7), root(7, 2)),
        (ring_all_gather(part(0, 4, half, 1)), overflow(half, 4)),
        (
            pairwise_all_to_all(part(0, 3, half, 1), false),
            overflow(half, 3),
        ),
        (dissemination_barrier(1, 1), rank(1, 1)),
        (tree_all_reduce(part(0, 0, 5, 1)), NoRanks),
        (tree_all_reduce(part(2, 2, 5, 1)), rank(2, 2)),
        (tree_broadcast(part(0, 3, 5, 1), 3), root(3, 3)),
        (tree_reduce(part(0, 2, 5, 1), 9), root(9, 2)),
    ];
    for (i, (got, want)) in cases.into_iter().enumerate() {
        assert_eq!(got, Err(want), "case {i}");
    }
    assert!(matches!(
        dissemination_barrier(0, usize::MAX),
        Err(ScheduleError::TooManyRanks { .. })
    ));
    // Huge counts with one rank are fine (a single copy).
    assert_eq!(
        ring_all_reduce(part(0, 1, usize::MAX, 0))
            .unwrap()
            .steps
            .len(),
        1
    );
}

#[test]
fn check_rejects_malformed_schedules() {
    let send = |peer, len| Step {
        action: Action::Send {
            peer,
            src: Region::new(BufId::Input, 0, len),
        },
        deps: Vec::new(),
    };
    let mut s = Schedule {
        steps: vec![send(1, 1)],
        send_peers: vec![1],
        recv_peers: Vec::new(),
        scratch_elems: 0,
    };
    assert_eq!(s.check(2), Ok(()));
    assert_eq!(
        s.check(1),
        Err(ScheduleError::BadPeer {
            step: 0,
            peer: 1,
            nranks: 1
        })
    );
    s.steps[0].deps = vec![0];
    assert_eq!(s.check(2), Err(ScheduleError::BadDep { step: 0, dep: 0 }));
    s.steps = vec![send(1, 0)];
    assert_eq!(s.check(2), Err(ScheduleError::EmptyStep { step: 0 }));
    s.send_peers.clear();
    s.steps = vec![send(1, 1)];
    assert_eq!(
        s.check(2),
        Err(ScheduleError::PeerNotListed { step: 0, peer: 1 })
    );
    s.steps = vec![Step {
        action: Action::Copy {
            src: Region::new(BufId::Input, 0, 2),
            dst: Region::new(BufId::Output, 0, 3),
        },
        deps: Vec::new(),
    }];
    assert_eq!(
        s.check(2),
        Err(ScheduleError::RegionLengthMismatch { step: 0 })
    );
    s.steps = vec![Step {
        action: Action::Copy {
            src: Region::new(BufId::Input, usize::MAX, 2),
            dst: Region::new(BufId::Output, 0, 2),
        },
        deps: Vec::new(),
    }];
    assert_eq!(s.check(2), Err(ScheduleError::RegionOverflow { step: 0 }));
}

#[test]
fn ring_all_reduce_shape() {
    // 4 ranks, 8 elements, slices of 1: chunks of 2 elements, 2 slices per chunk,
    // 3 reduce-scatter + 3 all-gather steps, each 2 sends + 2 receives.
    let s = ring_all_reduce(part(1, 4, 8, 1)).unwrap();
    assert_eq!(s.steps.len(), 6 * 4);
    assert_eq!(
        (s.send_peers.clone(), s.recv_peers.clone()),
        (vec![2], vec![0])
    );
    // Step 0 sends chunk 1 (elements 2..4) from Input.
    assert_eq!(
        s.steps[0].action,
        Action::Send {
            peer: 2,
            src: Region::new(BufId::Input, 2, 1)
        }
    );
    // The first receive reduces chunk 0 into Output.
    assert_eq!(
        s.steps[1].action,
        Action::RecvReduce {
            peer: 0,
            local: Region::new(BufId::Input, 0, 1),
            dst: Region::new(BufId::Output, 0, 1)
        }
    );
    // The second step's sends forward chunk 0 from Output, each after its slice arrived.
    assert_eq!(
        s.steps[4],
        Step {
            action: Action::Send {
                peer: 2,
                src: Region::new(BufId::Output, 0, 1)
            },
            deps: vec![1]
        }
    );
}

#[test]
fn recursive_doubling_all_reduce_structure() {
    for n in 1..=16 {
        for count in COUNTS {
            for slice in SLICES {
                let s: Vec<_> = (0..n)
                    .map(|r| recursive_doubling_all_reduce(part(r, n, count, slice)).unwrap())
                    .collect();
                let sizes = Sizes::new(count, count);
                check_all(&s, &sizes, slice, true);
                let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
                for (r, sched) in s.iter().enumerate() {
                    let want = if n > 1 && r < p { count } else { 0 };
                    assert_eq!(sched.scratch_elems, want, "n {n} rank {r}");
                    // Input is only ever read.
                    assert!(sched.steps.iter().all(|st| !matches!(
                        st.action,
                        Action::RecvCopy { dst, .. }
                            | Action::RecvReduce { dst, .. }
                            | Action::Copy { dst, .. } if dst.buf == BufId::Input
                    )));
                }
            }
        }
    }
}

/// Sorted copies of a schedule's peer lists.
fn peers(s: &Schedule) -> (Vec<usize>, Vec<usize>) {
    let (mut a, mut b) = (s.send_peers.clone(), s.recv_peers.clone());
    a.sort_unstable();
    b.sort_unstable();
    (a, b)
}

#[test]
fn recursive_doubling_all_reduce_peers() {
    for count in [0, 5] {
        let rd = |r, n| recursive_doubling_all_reduce(part(r, n, count, 2)).unwrap();
        // Two ranks: one round.
        assert_eq!(peers(&rd(0, 2)), (vec![1], vec![1]));
        assert_eq!(peers(&rd(1, 2)), (vec![0], vec![0]));
        // Four ranks: partners r ^ 1 and r ^ 2.
        let four = [vec![1, 2], vec![0, 3], vec![0, 3], vec![1, 2]];
        for (r, want) in four.iter().enumerate() {
            assert_eq!(peers(&rd(r, 4)), (want.clone(), want.clone()), "rank {r}");
        }
        // Six ranks: 4 and 5 fold into 0 and 1, which then run the four-rank rounds.
        let six = [
            vec![1, 2, 4],
            vec![0, 3, 5],
            vec![0, 3],
            vec![1, 2],
            vec![0],
            vec![1],
        ];
        for (r, want) in six.iter().enumerate() {
            assert_eq!(peers(&rd(r, 6)), (want.clone(), want.clone()), "rank {r}");
        }
    }
    let one = recursive_doubling_all_reduce(part(0, 1, 5, 2)).unwrap();
    assert!(one.send_peers.is_empty() && one.recv_peers.is_empty());
    assert_eq!(one.scratch_elems, 0);
    assert_eq!(
        one.steps,
        [Step {
            action: Action::Copy {
                src: Region::new(BufId::Input, 0, 5),
                dst: Region::new(BufId::Output, 0, 5)
            },
            deps: Vec::new()
        }]
    );
    assert!(recursive_doubling_all_reduce(part(0, 1, 0, 2))
        .unwrap()
        .steps
        .is_empty());
    for n in 2..=9 {
        for r in 0..n {
            assert!(recursive_doubling_all_reduce(part(r, n, 0, 3))
                .unwrap()
                .steps
                .is_empty());
        }
    }
}

#[test]
fn recursive_doubling_all_reduce_shape() {
    // Two ranks, 4 elements, slices of 2: send Input, combine into Scratch (in place, Output
    // is the Input being sent), then copy each slice once it is combined and sent.
    let s = recursive_doubling_all_reduce(part(1, 2, 4, 2)).unwrap();
    let send = |o| Action::Send {
        peer: 0,
        src: Region::new(BufId::Input, o, 2),
    };
    let recv = |o| Action::RecvReduce {
        peer: 0,
        local: Region::new(BufId::Input, o, 2),
        dst: Region::new(BufId::Scratch, o, 2),
    };
    let copy = |o| Action::Copy {
        src: Region::new(BufId::Scratch, o, 2),
        dst: Region::new(BufId::Output, o, 2),
    };
    let step = |action, deps: &[StepId]| Step {
        action,
        deps: deps.to_vec(),
    };
    assert_eq!(
        s.steps,
        [
            step(send(0), &[]),
            step(recv(0), &[]),
            step(send(2), &[]),
            step(recv(2), &[]),
            step(copy(0), &[1, 0]),
            step(copy(2), &[3, 2]),
        ]
    );
    // Three ranks: rank 0 folds rank 2 in (into Scratch, so its single round writes Output)
    // and sends the result from Output; rank 2 receives each slice after sending it.
    let s = recursive_doubling_all_reduce(part(0, 3, 2, 0)).unwrap();
    assert_eq!(s.scratch_elems, 2);
    let region = |buf, o| Region::new(buf, o, 1);
    assert_eq!(
        s.steps[0].action,
        Action::RecvReduce {
            peer: 2,
            local: region(BufId::Input, 0),
            dst: region(BufId::Scratch, 0)
        }
    );
    assert_eq!(
        s.steps[2],
        step(
            Action::Send {
                peer: 1,
                src: region(BufId::Scratch, 0)
            },
            &[0]
        )
    );
    assert_eq!(
        s.steps[3],
        step(
            Action::RecvReduce {
                peer: 1,
                local: region(BufId::Scratch, 0),
                dst: region(BufId::Output, 0)
            },
            &[0]
        )
    );
    assert_eq!(
        s.steps[6],
        step(
            Action::Send {
                peer: 2,
                src: region(BufId::Output, 0)
            },
            &[3]
        )
    );
    let s = recursive_doubling_all_reduce(part(2, 3, 2, 0)).unwrap();
    assert_eq!(s.scratch_elems, 0);
    assert_eq!(
        s.steps[1],
        step(
            Action::RecvCopy {
                peer: 0,
                dst: region(BufId::Output, 0)
            },
            &[0]
        )
    );
}

#[test]
fn recursive_doubling_all_reduce_invalid_arguments() {
    assert_eq!(
        recursive_doubling_all_reduce(part(0, 0, 5, 1)),
        Err(ScheduleError::NoRanks)
    );
    assert_eq!(
        recursive_doubling_all_reduce(part(4, 4, 5, 1)),
        Err(ScheduleError::RankOutOfRange { rank: 4, nranks: 4 })
    );
    assert!(matches!(
        recursive_doubling_all_reduce(part(0, usize::MAX, 5, 1)),
        Err(ScheduleError::TooManyRanks { .. })
    ));
    // Large communicators and huge counts with few slices are fine.
    let s = recursive_doubling_all_reduce(part(MAX_RANKS - 1, MAX_RANKS, 3, 1)).unwrap();
    assert_eq!(s.send_peers.len(), 24);
    let s = recursive_doubling_all_reduce(part(3, 5, usize::MAX, usize::MAX)).unwrap();
    assert_eq!(s.steps.len(), 2 * 2);
    s.check(5).unwrap();
    let s = recursive_doubling_all_reduce(part(5, 6, usize::MAX, usize::MAX)).unwrap();
    assert_eq!(s.steps.len(), 2);
}
