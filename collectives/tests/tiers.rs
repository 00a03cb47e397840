//! The two-tier plans (`weftcc_collectives::tiers`) executed in memory: every rank's stages run
//! against reference collectives of its sub-communicators (a collective runs once every member
//! has reached it; a group's sends are delivered in order per pair), and the results are
//! compared with a direct reduction of every rank's input. A plan that deadlocks, reads or
//! writes outside its buffers, or computes anything else fails.

use proptest::prelude::*;
use weftcc_collectives::reduce;
use weftcc_collectives::schedule::hierarchical::HostLayout;
use weftcc_collectives::testing::{
    buffer_counts, data_collectives, every_op, expected_recv, op_of_rank, rank_order_fold,
    small_input,
};
use weftcc_collectives::tiers::{plan, Buf, Region, Stage, Tier, TierPlan};
use weftcc_collectives::{DataType, OpKind, RawOp, ReduceOp};

/// A byte every result differs from (inputs are small non-negative integers).
const SENTINEL: u8 = 0xA5;

/// The reduction of `inputs` (member i's input scaled by its own PreMulSum factor, `ops[i]`).
fn reduce_all(t: DataType, ops: &[ReduceOp], inputs: &[Vec<u8>]) -> Vec<u8> {
    let factors: Vec<f64> = ops
        .iter()
        .map(|op| match op {
            ReduceOp::PreMulSum(f) => *f,
            _ => 1.0,
        })
        .collect();
    rank_order_fold(t, ops[0], inputs, &factors)
}

#[derive(Clone)]
struct Bufs {
    send: Vec<u8>,
    recv: Vec<u8>,
    scratch: Vec<u8>,
}

impl Bufs {
    fn get(&self, r: Region) -> Vec<u8> {
        let b = match r.buf {
            Buf::Send => &self.send,
            Buf::Recv => &self.recv,
            Buf::Scratch => &self.scratch,
        };
        assert!(
            r.offset + r.len <= b.len(),
            "{r:?} outside its buffer of {} bytes",
            b.len()
        );
        b[r.offset..r.offset + r.len].to_vec()
    }

    fn put(&mut self, r: Region, bytes: &[u8]) {
        assert_eq!(
            r.len,
            bytes.len(),
            "write of {} bytes into {r:?}",
            bytes.len()
        );
        let b = match r.buf {
            Buf::Send => panic!("a plan wrote into the send buffer: {r:?}"),
            Buf::Recv => &mut self.recv,
            Buf::Scratch => &mut self.scratch,
        };
        assert!(
            r.offset + r.len <= b.len(),
            "{r:?} outside its buffer of {} bytes",
            b.len()
        );
        b[r.offset..r.offset + r.len].copy_from_slice(bytes);
    }
}

/// The members of `rank`'s communicator of `tier`, in their order in it.
fn members(layout: &HostLayout, rank: usize, tier: Tier) -> Vec<usize> {
    match tier {
        Tier::Local => layout.members(layout.host_of(rank).expect("rank")).to_vec(),
        Tier::Cross => layout.cross_members(layout.local_index(rank).expect("rank")),
        Tier::Flat => (0..layout.nranks()).collect(),
    }
}

/// Runs one collective stage of every member (in member order) with reference semantics.
fn collective(bufs: &mut [Bufs], who: &[usize], stages: &[(RawOp, Option<Region>, Region)]) {
    let k = who.len();
    let (first, _, _) = stages[0];
    let es = first.dtype.size();
    let block = first.count * es;
    for (op, _, _) in stages {
        assert_eq!(
            (op.kind, op.dtype, op.count, op.root, op.op.combiner()),
            (
                first.kind,
                first.dtype,
                first.count,
                first.root,
                first.op.combiner()
            ),
            "members of one sub-communicator called different collectives"
        );
    }
    // Each member's input, as RawOp::plan lays it out.
    let inputs: Vec<Vec<u8>> = stages
        .iter()
        .enumerate()
        .map(|(i, (op, send, recv))| {
            let len = match op.kind {
                OpKind::ReduceScatter => k * block,
                _ => block,
            };
            match send {
                // Off the root a broadcast reads no send buffer (the plan may give it none).
                Some(_) if op.kind == OpKind::Broadcast && i != op.root => Vec::new(),
                Some(s) => {
                    assert_eq!(s.len, len, "send region of {op:?}");
                    bufs[who[i]].get(*s)
                }
                None => {
                    let off = if op.kind == OpKind::AllGather {
                        i * block
                    } else {
                        0
                    };
                    bufs[who[i]].get(Region {
                        offset: recv.offset + off,
                        len,
                        ..*recv
                    })
                }
            }
        })
        .collect();
    let ops: Vec<ReduceOp> = stages.iter().map(|(op, _, _)| op.op).collect();
    for (i, (op, send, recv)) in stages.iter().enumerate() {
        let out_len = match op.kind {
            OpKind::AllGather => k * block,
            _ => block,
        };
        let (at, len) = match (op.kind, send) {
            (OpKind::ReduceScatter, None) => (recv.offset + i * block, block),
            (OpKind::AllGather, None) => (recv.offset, k * block),
            (_, None) => (recv.offset, block),
            (_, Some(_)) => (recv.offset, recv.len),
        };
        let out = Region {
            offset: at,
            len,
            ..*recv
        };
        let result = match op.kind {
            OpKind::AllReduce => Some(reduce_all(op.dtype, &ops, &inputs)),
            OpKind::Reduce => (i == op.root).then(|| reduce_all(op.dtype, &ops, &inputs)),
            OpKind::Broadcast => Some(inputs[op.root].clone()),
            OpKind::AllGather => Some(inputs.concat()),
            OpKind::ReduceScatter => {
                Some(reduce_all(op.dtype, &ops, &inputs)[i * block..(i + 1) * block].to_vec())
            }
            other => panic!("{other} is not a stage collective"),
        };
        if let Some(r) = result {
            assert_eq!(out.len, out_len, "receive region of {op:?}");
            bufs[who[i]].put(out, &r);
        }
    }
}

/// Runs every rank's plan; panics on a deadlock.
fn execute(layout: &HostLayout, plans: &[TierPlan], bufs: &mut [Bufs]) {
    let n = layout.nranks();
    let mut pc = vec![0usize; n];
    // Messages in flight per (tier, sender, receiver) as ranks, and which groups have posted.
    let mut mail: std::collections::HashMap<(usize, usize), std::collections::VecDeque<Vec<u8>>> =
        Default::default();
    let mut posted = vec![false; n];
    loop {
        let mut progress = false;
        for r in 0..n {
            while let Some(stage) = plans[r].stages.get(pc[r]) {
                match stage {
                    Stage::Copy { src, dst } => {
                        assert_eq!(src.len, dst.len);
                        let b = bufs[r].get(*src);
                        bufs[r].put(*dst, &b);
                    }
                    Stage::Divide { region, dtype, by } => {
                        let mut b = bufs[r].get(*region);
                        reduce::divide_in_place(*dtype, &mut b, *by).expect("divide");
                        bufs[r].put(*region, &b);
                    }
                    _ => break,
                }
                pc[r] += 1;
                progress = true;
            }
        }
        for r in 0..n {
            let Some(Stage::Group { tier, sends, recvs }) = plans[r].stages.get(pc[r]) else {
                continue;
            };
            let ranks = members(layout, r, *tier);
            if !posted[r] {
                for (q, region) in sends {
                    let b = bufs[r].get(*region);
                    mail.entry((r, ranks[*q])).or_default().push_back(b);
                }
                posted[r] = true;
                progress = true;
            }
            let ready = recvs.iter().all(|(q, _)| {
                let want = recvs.iter().filter(|(p, _)| p == q).count();
                mail.get(&(ranks[*q], r)).map_or(0, |m| m.len()) >= want
            });
            if ready {
                for (q, region) in recvs.clone() {
                    let b = mail
                        .get_mut(&(ranks[q], r))
                        .and_then(|m| m.pop_front())
                        .expect("message");
                    bufs[r].put(region, &b);
                }
                posted[r] = false;
                pc[r] += 1;
                progress = true;
            }
        }
        for r in 0..n {
            let Some(Stage::Collective { tier, .. }) = plans[r].stages.get(pc[r]) else {
                continue;
            };
            let who = members(layout, r, *tier);
            if who[0] != r {
                continue;
            }
            let heads: Option<Vec<_>> = who
                .iter()
                .map(|&m| match plans[m].stages.get(pc[m]) {
                    Some(Stage::Collective {
                        tier: t,
                        op,
                        send,
                        recv,
                    }) if t == tier => Some((*op, *send, *recv)),
                    _ => None,
                })
                .collect();
            if let Some(heads) = heads {
                collective(bufs, &who, &heads);
                for &m in &who {
                    pc[m] += 1;
                }
                progress = true;
            }
        }
        if (0..n).all(|r| pc[r] == plans[r].stages.len()) {
            assert!(mail.values().all(|m| m.is_empty()), "messages left unread");
            return;
        }
        assert!(
            progress,
            "deadlock: ranks at stages {pc:?} of {:?}",
            plans.iter().map(|p| p.stages.len()).collect::<Vec<_>>()
        );
    }
}

/// Runs `call` (op and root as rank 0 passes them) on `hosts` (host of each rank) and checks
/// every rank's result.
fn check(shard_min: usize, hosts: &[usize], call: RawOp, in_place: bool) {
    let (kind, t, count, op, root) = (call.kind, call.dtype, call.count, call.op, call.root);
    let layout = HostLayout::from_labels(hosts);
    let n = hosts.len();
    let es = t.size();
    let all = count * n;
    let (send_len, recv_len) = buffer_counts(kind, count, n);
    let what = format!(
        "{kind} {t} {op:?} count {count} root {root} in place {in_place} on hosts {hosts:?}"
    );
    let mut bufs: Vec<Bufs> = (0..n)
        .map(|r| {
            let mine = small_input(t, op, r, send_len);
            if in_place {
                let whole = match kind {
                    OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => all,
                    _ => count,
                };
                let mut recv = vec![SENTINEL; whole * es];
                match kind {
                    OpKind::AllGather => {
                        recv[r * count * es..(r + 1) * count * es].copy_from_slice(&mine)
                    }
                    _ => recv.copy_from_slice(&mine),
                }
                Bufs {
                    send: Vec::new(),
                    recv,
                    scratch: Vec::new(),
                }
            } else {
                Bufs {
                    send: mine,
                    recv: vec![SENTINEL; recv_len * es],
                    scratch: Vec::new(),
                }
            }
        })
        .collect();
    let plans: Vec<TierPlan> = (0..n)
        .map(|r| {
            let call = RawOp::new(kind, t, count)
                .with_op(op_of_rank(op, r))
                .with_root(root);
            let p = plan(&layout, r, &call, in_place, shard_min);
            bufs[r].scratch = vec![SENTINEL; p.scratch_bytes];
            p
        })
        .collect();
    let before: Vec<Vec<u8>> = bufs.iter().map(|b| b.recv.clone()).collect();
    execute(&layout, &plans, &mut bufs);
    for (r, b) in bufs.iter().enumerate() {
        let got = match (kind, in_place) {
            (OpKind::ReduceScatter, true) => b.recv[r * count * es..(r + 1) * count * es].to_vec(),
            _ => b.recv.clone(),
        };
        match expected_recv(&call, n, r) {
            Some(want) => assert!(got == want, "rank {r}: {what}: got {got:?}, want {want:?}"),
            None => assert!(
                b.recv == before[r],
                "rank {r}: {what}: a non-root's buffer changed"
            ),
        }
    }
}

fn call(kind: OpKind, t: DataType, op: ReduceOp, count: usize, root: usize) -> RawOp {
    RawOp::new(kind, t, count).with_op(op).with_root(root)
}

#[test]
fn layouts_number_hosts_and_local_ranks() {
    let l = HostLayout::from_labels(&["b", "a", "b", "c", "a", "b"]);
    assert_eq!(l.hosts(), 3);
    assert_eq!(
        (0..6).map(|r| l.host_of(r)).collect::<Vec<_>>(),
        [0, 1, 0, 2, 1, 0].map(Some)
    );
    assert_eq!(
        (0..6).map(|r| l.local_index(r)).collect::<Vec<_>>(),
        [0, 0, 1, 0, 1, 2].map(Some)
    );
    assert_eq!(l.ranks_per_host(), None);
    assert_eq!(l.max_local(), 3);
    assert_eq!(l.cross_members(1), [2, 4]);
    assert_eq!(l.cross_members(2), [5]);
    assert_eq!(l.cross_index(4), Some(1));
    assert_eq!(l.cross_index(3), Some(2));
    assert_eq!(
        HostLayout::from_labels(&[1, 2, 1, 2]).ranks_per_host(),
        Some(2)
    );
}

#[test]
fn every_collective_on_fixed_layouts() {
    let layouts: [&[usize]; 6] = [
        &[0, 0, 1, 1],
        &[0, 1, 0, 1],
        &[0, 0, 0, 1],
        &[0, 1, 2, 0, 1, 2],
        &[0, 1],
        &[3, 3, 3],
    ];
    for hosts in layouts {
        for kind in data_collectives() {
            for t in [DataType::Float32, DataType::Int32, DataType::Uint8] {
                let ops = if kind.has_reduction() {
                    every_op(0)
                } else {
                    vec![ReduceOp::Sum]
                };
                for op in ops {
                    for count in [0, 1, 2, 5, 13] {
                        for in_place in [false, true] {
                            for root in [0, hosts.len() - 1] {
                                for shard_min in [0, usize::MAX] {
                                    check(
                                        shard_min,
                                        hosts,
                                        call(kind, t, op, count, root),
                                        in_place,
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn uniform_layouts_take_the_hierarchical_forms() {
    let layout = HostLayout::from_labels(&[0, 1, 0, 1]);
    let call = RawOp::new(OpKind::AllReduce, DataType::Float32, 10);
    let p = plan(&layout, 1, &call, false, 0);
    let tiers: Vec<_> = p
        .stages
        .iter()
        .filter_map(|s| match s {
            Stage::Collective { tier, op, .. } => Some((*tier, op.kind, op.count)),
            _ => None,
        })
        .collect();
    // 5 elements per shard, nothing left over; no stage on the flat communicator.
    assert_eq!(
        tiers,
        [
            (Tier::Local, OpKind::ReduceScatter, 5),
            (Tier::Cross, OpKind::AllReduce, 5),
            (Tier::Local, OpKind::AllGather, 5)
        ]
    );
    // Below the sharding threshold: one exchange across hosts, by local ranks 0.
    let small = |rank| {
        plan(&layout, rank, &call, false, usize::MAX)
            .stages
            .iter()
            .filter_map(|s| match s {
                Stage::Collective { tier, op, .. } => Some((*tier, op.kind)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        small(0),
        [
            (Tier::Local, OpKind::Reduce),
            (Tier::Cross, OpKind::AllReduce),
            (Tier::Local, OpKind::Broadcast)
        ]
    );
    assert_eq!(
        small(2),
        [
            (Tier::Local, OpKind::Reduce),
            (Tier::Local, OpKind::Broadcast)
        ]
    );
    // All-gather's permutation: ranks dealt over the hosts in turn are already in local-major
    // order (one merged copy); hosts holding consecutive ranks need a copy per rank.
    let copies = |hosts: &[usize]| {
        let ag = plan(
            &HostLayout::from_labels(hosts),
            0,
            &RawOp::new(OpKind::AllGather, DataType::Float32, 3),
            false,
            0,
        );
        ag.stages
            .iter()
            .filter(|s| matches!(s, Stage::Copy { .. }))
            .count()
    };
    assert_eq!(copies(&[0, 1, 0, 1]), 1);
    assert_eq!(copies(&[0, 0, 1, 1]), 4);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_layouts_give_the_direct_result(
        hosts in prop::collection::vec(0usize..4, 1..=9),
        kind in prop::sample::select(data_collectives()),
        t in prop::sample::select(vec![DataType::Float32, DataType::Float64, DataType::Int32, DataType::Uint8]),
        op in prop::sample::select(every_op(0)),
        count in prop::sample::select(vec![0usize, 1, 3, 4, 7, 9, 16, 37]),
        root_pick in 0usize..9,
        in_place in any::<bool>(),
        shard_min in prop::sample::select(vec![0usize, 16, usize::MAX]),
    ) {
        let root = root_pick % hosts.len();
        let op = if kind.has_reduction() { op } else { ReduceOp::Sum };
        check(shard_min, &hosts, call(kind, t, op, count, root), in_place);
    }
}

/// On a layout that is not uniform, reduce and broadcast run on the flat communicator; off the
/// root they ask for no receive (reduce) or send (broadcast) buffer, which the caller may not
/// have passed.
#[test]
fn flat_reduce_and_broadcast_need_no_unused_buffer_off_the_root() {
    let layout = HostLayout::from_labels(&[0, 0, 0, 1]);
    for rank in 0..4 {
        for kind in [OpKind::Reduce, OpKind::Broadcast] {
            let call = RawOp::new(kind, DataType::Float32, 5).with_root(2);
            let p = plan(&layout, rank, &call, false, 0);
            let [Stage::Collective {
                tier: Tier::Flat,
                send: Some(send),
                recv,
                ..
            }] = p.stages.as_slice()
            else {
                panic!("{kind} on rank {rank}: {:?}", p.stages);
            };
            let (send_len, recv_len) = match (kind, rank == 2) {
                (_, true) => (20, 20),
                (OpKind::Reduce, false) => (20, 0),
                _ => (0, 20),
            };
            assert_eq!(
                (send.len, recv.len),
                (send_len, recv_len),
                "{kind} rank {rank}"
            );
        }
    }
}
