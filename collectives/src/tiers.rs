//! A collective of ranks spread over several hosts, as stages on two tiers of communicators:
//! the ranks of one host (`Local`, fast peer copies) and one rank per host (`Cross`, the
//! network), plus the whole communicator (`Flat`) for what the tiers cannot express.
//!
//! The CUDA path runs these plans: CUDA IPC inside a host, the host network (staged through
//! pinned memory) across hosts. Each stage is an ordinary collective of a sub-communicator, a
//! copy or Avg's division, so the plan is checked here against a direct reduction without any
//! device (`tests/tiers.rs`).
//!
//! Uniform layouts (every host has `L` ranks) get the hierarchical forms:
//! * all-reduce of at least `shard_min` bytes: reduce-scatter inside the host, all-reduce of
//!   each shard across hosts (each local rank `l` with its peers `l` of the other hosts),
//!   all-gather inside the host; the elements beyond a multiple of `L` by the generic form
//!   below (smaller all-reduces too: one exchange across hosts instead of `L` in parallel);
//! * reduce / broadcast: inside the host to / from the root's local index, across hosts among
//!   that index;
//! * all-gather: across hosts among equal local indices, then inside the host, then a permutation
//!   into rank order (ranks may be spread over the hosts in any order);
//! * reduce-scatter: the permutation, then inside the host, then across hosts.
//!
//! Any layout: all-reduce by a reduce to local rank 0, an all-reduce among local ranks 0 and a
//! broadcast inside the host; all-to-all as a group of sends and receives, each peer over its
//! own tier ([`route`]); reduce, broadcast, all-gather and reduce-scatter of a non-uniform
//! layout on the flat communicator.
//!
//! Reductions: the first stage that reduces uses the call's operation (PreMulSum scales each
//! rank's own input once); later stages sum (Avg, PreMulSum) or repeat the operation (prod, min,
//! max); Avg divides once at the end.

use crate::call::RawOp;
use crate::dtype::DataType;
use crate::op::{OpKind, ReduceOp};
use crate::schedule::hierarchical::HostLayout;

/// Host and local rank of `rank` (a rank of `layout`: [`plan`] checks it).
fn place(layout: &HostLayout, rank: usize) -> (usize, usize) {
    (
        layout.host_of(rank).unwrap_or(0),
        layout.local_index(rank).unwrap_or(0),
    )
}

/// A sub-communicator of the plan, as seen by the rank running it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// The ranks of this host (local ranks).
    Local,
    /// The ranks with this rank's local index, one per host (cross index).
    Cross,
    /// Every rank (ranks as in the whole communicator).
    Flat,
}

/// A buffer of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buf {
    Send,
    Recv,
    /// The plan's own scratch memory ([`TierPlan::scratch_bytes`]).
    Scratch,
}

/// Bytes `offset..offset + len` of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub buf: Buf,
    pub offset: usize,
    pub len: usize,
}

impl Region {
    fn new(buf: Buf, offset: usize, len: usize) -> Region {
        Region { buf, offset, len }
    }

    /// Bytes `from..from + len` of this region.
    fn part(self, from: usize, len: usize) -> Region {
        Region::new(self.buf, self.offset + from, len)
    }
}

/// One step of a plan, run in order on the caller's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Stage {
    /// A collective on `tier`; `send: None` is the in-place form on `recv` (which then holds the
    /// whole call: n blocks for all-gather and reduce-scatter).
    Collective {
        tier: Tier,
        op: RawOp,
        send: Option<Region>,
        recv: Region,
    },
    /// Sends and receives on `tier` (peers as ranks of that tier), run as one group.
    Group {
        tier: Tier,
        sends: Vec<(usize, Region)>,
        recvs: Vec<(usize, Region)>,
    },
    /// A copy of `src` into `dst` (equal lengths, never overlapping).
    Copy { src: Region, dst: Region },
    /// Avg's last step: `region`'s elements of `dtype` divided by `by`.
    Divide {
        region: Region,
        dtype: DataType,
        by: usize,
    },
}

/// The stages of one call on one rank, and the scratch they use.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TierPlan {
    pub stages: Vec<Stage>,
    pub scratch_bytes: usize,
}

impl TierPlan {
    /// Adds a collective stage (see [`Stage::Collective`]).
    fn collective(&mut self, tier: Tier, op: RawOp, send: Option<Region>, recv: Region) {
        self.stages.push(Stage::Collective {
            tier,
            op,
            send,
            recv,
        });
    }
}

/// Reductions of the first and of the later reducing stages.
fn stage_ops(op: ReduceOp) -> (ReduceOp, ReduceOp) {
    match op {
        ReduceOp::Avg => (ReduceOp::Sum, ReduceOp::Sum),
        ReduceOp::PreMulSum(_) => (op, ReduceOp::Sum),
        other => (other, other),
    }
}

/// Default of the smallest all-reduce (bytes) that is sharded across hosts. On an H200 with
/// 8 ranks as 2 hosts × 4 (staged between hosts), sharding was 2× slower than one exchange at
/// 64 B–32 KiB (four cross-host all-reduces at once instead of one) and faster from 256 KiB.
pub const DEFAULT_SHARD_MIN: usize = 128 << 10;

/// The plan of `call` (a valid call: [`RawOp::plan`] accepted it) on `rank`; `in_place` when
/// the call has only a receive buffer (NCCL's in-place layout); all-reduces of at least
/// `shard_min` bytes are sharded across hosts (see the module documentation).
pub fn plan(
    layout: &HostLayout,
    rank: usize,
    call: &RawOp,
    in_place: bool,
    shard_min: usize,
) -> TierPlan {
    let mut p = TierPlan::default();
    let n = layout.nranks();
    if call.count == 0 || rank >= n || (call.has_root() && call.root >= n) {
        return p;
    }
    let es = call.dtype.size();
    let block = call.count * es;
    let whole = |blocks: usize| Region::new(Buf::Recv, 0, blocks * block);
    let input = |blocks: usize| match in_place {
        true => whole(blocks),
        false => Region::new(Buf::Send, 0, blocks * block),
    };
    let uniform = layout.ranks_per_host();
    match call.kind {
        OpKind::AllReduce => {
            let sharded = block >= shard_min;
            all_reduce(&mut p, layout, rank, call, sharded, input(1), whole(1))
        }
        OpKind::Reduce if uniform.is_some() => reduce(&mut p, layout, rank, call, in_place),
        OpKind::Broadcast if uniform.is_some() => broadcast(&mut p, layout, rank, call, in_place),
        OpKind::AllGather if uniform.is_some() => {
            let own = match in_place {
                true => whole(n).part(rank * block, block),
                false => input(1),
            };
            all_gather(&mut p, layout, call, own, whole(n));
        }
        OpKind::ReduceScatter if uniform.is_some() => {
            let out = match in_place {
                true => whole(n).part(rank * block, block),
                false => whole(1),
            };
            reduce_scatter(&mut p, layout, call, input(n), out);
        }
        OpKind::AllToAll => all_to_all(&mut p, layout, rank, call, in_place),
        OpKind::Barrier | OpKind::SendRecv => {}
        // Not uniform: the whole call on the flat communicator, Avg and PreMulSum included.
        _ => {
            let blocks = |kind_blocks: bool| if kind_blocks { n } else { 1 };
            // Off the root, a broadcast reads no send buffer and a reduce writes no receive
            // buffer: the caller may have passed none (RawOp::plan allows it).
            let off_root = call.has_root() && rank != call.root && !in_place;
            let send = match call.kind {
                OpKind::Broadcast if off_root => Region::new(Buf::Send, 0, 0),
                _ => input(blocks(call.kind == OpKind::ReduceScatter)),
            };
            let recv = match call.kind {
                OpKind::Reduce if off_root => Region::new(Buf::Recv, 0, 0),
                _ => whole(blocks(
                    call.kind == OpKind::AllGather
                        || (call.kind == OpKind::ReduceScatter && in_place),
                )),
            };
            p.collective(Tier::Flat, *call, (!in_place).then_some(send), recv);
            return p;
        }
    }
    if call.op == ReduceOp::Avg && call.has_reduction() {
        let out = match call.kind {
            OpKind::Reduce if rank != call.root => None,
            OpKind::ReduceScatter if in_place => Some(whole(n).part(rank * block, block)),
            _ => Some(whole(1)),
        };
        if let Some(region) = out {
            p.stages.push(Stage::Divide {
                region,
                dtype: call.dtype,
                by: n,
            });
        }
    }
    p
}

fn all_reduce(
    p: &mut TierPlan,
    layout: &HostLayout,
    rank: usize,
    call: &RawOp,
    sharded: bool,
    input: Region,
    output: Region,
) {
    let es = call.dtype.size();
    let (first, later) = stage_ops(call.op);
    let at = |count| RawOp::new(OpKind::AllReduce, call.dtype, count);
    let l = place(layout, rank).1;
    // Elements carried by the shards of a uniform layout; the rest goes the generic way.
    let (local_size, shard) = match layout.ranks_per_host() {
        Some(ls) if sharded => (ls, call.count / ls),
        _ => (1, 0),
    };
    let sharded = shard * local_size;
    if shard > 0 {
        let (all, mine) = (sharded * es, output.part(l * shard * es, shard * es));
        let in_place = input == output;
        p.collective(
            Tier::Local,
            RawOp {
                kind: OpKind::ReduceScatter,
                count: shard,
                op: first,
                ..at(shard)
            },
            (!in_place).then(|| input.part(0, all)),
            if in_place { output.part(0, all) } else { mine },
        );
        p.collective(Tier::Cross, at(shard).with_op(later), None, mine);
        p.collective(
            Tier::Local,
            RawOp {
                kind: OpKind::AllGather,
                ..at(shard)
            },
            None,
            output.part(0, all),
        );
    }
    let rest = call.count - sharded;
    if rest == 0 {
        return;
    }
    let (from, len) = (sharded * es, rest * es);
    let (input, output) = (input.part(from, len), output.part(from, len));
    p.collective(
        Tier::Local,
        RawOp {
            kind: OpKind::Reduce,
            ..at(rest)
        }
        .with_op(first),
        (input != output).then_some(input),
        output,
    );
    if l == 0 {
        p.collective(Tier::Cross, at(rest).with_op(later), None, output);
    }
    p.collective(
        Tier::Local,
        RawOp {
            kind: OpKind::Broadcast,
            ..at(rest)
        },
        None,
        output,
    );
}

/// Uniform layouts only.
fn reduce(p: &mut TierPlan, layout: &HostLayout, rank: usize, call: &RawOp, in_place: bool) {
    let bytes = call.count * call.dtype.size();
    let (first, later) = stage_ops(call.op);
    let (root_host, root_local) = place(layout, call.root);
    let (h, l) = place(layout, rank);
    let output = Region::new(Buf::Recv, 0, bytes);
    let input = match in_place {
        true => output,
        false => Region::new(Buf::Send, 0, bytes),
    };
    let carrier = Region::new(Buf::Scratch, 0, bytes);
    p.scratch_bytes = bytes;
    // Inside the host, to the root's local index; there the partial sum lands in the output
    // on the root and in scratch elsewhere.
    let partial = if h == root_host { output } else { carrier };
    let lands = if l == root_local { partial } else { carrier };
    p.collective(
        Tier::Local,
        RawOp::new(OpKind::Reduce, call.dtype, call.count)
            .with_op(first)
            .with_root(root_local),
        (input != lands).then_some(input),
        lands,
    );
    if l == root_local {
        p.collective(
            Tier::Cross,
            RawOp::new(OpKind::Reduce, call.dtype, call.count)
                .with_op(later)
                .with_root(root_host),
            None,
            partial,
        );
    }
}

/// Uniform layouts only.
fn broadcast(p: &mut TierPlan, layout: &HostLayout, rank: usize, call: &RawOp, in_place: bool) {
    let bytes = call.count * call.dtype.size();
    let (root_host, root_local) = place(layout, call.root);
    let output = Region::new(Buf::Recv, 0, bytes);
    let op = RawOp::new(OpKind::Broadcast, call.dtype, call.count);
    if place(layout, rank).1 == root_local {
        p.collective(
            Tier::Cross,
            op.with_root(root_host),
            (rank == call.root && !in_place).then(|| Region::new(Buf::Send, 0, bytes)),
            output,
        );
    }
    p.collective(Tier::Local, op.with_root(root_local), None, output);
}

/// The copies that move block `(h, l)` between `local_major` (blocks ordered local rank first,
/// then host) and `ranked` (blocks in rank order), merged where both sides run on.
fn permutation(
    layout: &HostLayout,
    block: usize,
    local_major: Region,
    ranked: Region,
    to_rank_order: bool,
) -> Vec<Stage> {
    let hosts = layout.hosts();
    let local_size = layout.ranks_per_host().unwrap_or(1);
    let mut stages: Vec<Stage> = Vec::new();
    for l in 0..local_size {
        for h in 0..hosts {
            let a = local_major.part((l * hosts + h) * block, block);
            let Some(&rank) = layout.members(h).get(l) else {
                continue;
            };
            let b = ranked.part(rank * block, block);
            let (src, dst) = if to_rank_order { (a, b) } else { (b, a) };
            if let Some(Stage::Copy { src: s, dst: d }) = stages.last_mut() {
                if s.offset + s.len == src.offset && d.offset + d.len == dst.offset {
                    s.len += block;
                    d.len += block;
                    continue;
                }
            }
            stages.push(Stage::Copy { src, dst });
        }
    }
    stages
}

/// Uniform layouts only: across hosts among equal local indices, inside the host, then into
/// rank order.
fn all_gather(p: &mut TierPlan, layout: &HostLayout, call: &RawOp, own: Region, output: Region) {
    let block = call.count * call.dtype.size();
    let (hosts, n) = (layout.hosts(), layout.nranks());
    let across = Region::new(Buf::Scratch, 0, hosts * block);
    let gathered = Region::new(Buf::Scratch, hosts * block, n * block);
    p.scratch_bytes = (hosts + n) * block;
    p.collective(
        Tier::Cross,
        RawOp::new(OpKind::AllGather, call.dtype, call.count),
        Some(own),
        across,
    );
    p.collective(
        Tier::Local,
        RawOp::new(OpKind::AllGather, call.dtype, call.count * hosts),
        Some(across),
        gathered,
    );
    p.stages
        .extend(permutation(layout, block, gathered, output, true));
}

/// Uniform layouts only: into local-major order, inside the host, then across hosts.
fn reduce_scatter(
    p: &mut TierPlan,
    layout: &HostLayout,
    call: &RawOp,
    input: Region,
    output: Region,
) {
    let block = call.count * call.dtype.size();
    let (hosts, n) = (layout.hosts(), layout.nranks());
    let (first, later) = stage_ops(call.op);
    let ordered = Region::new(Buf::Scratch, 0, n * block);
    let partial = Region::new(Buf::Scratch, n * block, hosts * block);
    p.scratch_bytes = (hosts + n) * block;
    p.stages
        .extend(permutation(layout, block, ordered, input, false));
    p.collective(
        Tier::Local,
        RawOp::new(OpKind::ReduceScatter, call.dtype, call.count * hosts).with_op(first),
        Some(ordered),
        partial,
    );
    p.collective(
        Tier::Cross,
        RawOp::new(OpKind::ReduceScatter, call.dtype, call.count).with_op(later),
        Some(partial),
        output,
    );
}

/// Any layout: this rank's own block copied, the other blocks sent and received over each
/// peer's tier (in place: from a copy of the input).
fn all_to_all(p: &mut TierPlan, layout: &HostLayout, rank: usize, call: &RawOp, in_place: bool) {
    let block = call.count * call.dtype.size();
    let n = layout.nranks();
    let output = Region::new(Buf::Recv, 0, n * block);
    let input = if in_place {
        let copy = Region::new(Buf::Scratch, 0, n * block);
        p.scratch_bytes = n * block;
        p.stages.push(Stage::Copy {
            src: output,
            dst: copy,
        });
        copy
    } else {
        Region::new(Buf::Send, 0, n * block)
    };
    p.stages.push(Stage::Copy {
        src: input.part(rank * block, block),
        dst: output.part(rank * block, block),
    });
    let blocks = |buf: Region| -> Vec<(usize, Region)> {
        (0..n)
            .filter(|&q| q != rank)
            .map(|q| (q, buf.part(q * block, block)))
            .collect()
    };
    let routed = route(layout, rank, blocks(input), blocks(output));
    for (tier, ops) in [(Tier::Local, routed.local), (Tier::Flat, routed.flat)] {
        if !ops.is_empty() {
            p.stages.push(Stage::Group {
                tier,
                sends: ops.sends,
                recvs: ops.recvs,
            });
        }
    }
}

/// Sends and receives, each `(peer, buffer)`.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerOps<T> {
    pub sends: Vec<(usize, T)>,
    pub recvs: Vec<(usize, T)>,
}

impl<T> PeerOps<T> {
    /// No send and no receive.
    pub fn is_empty(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }
}

/// Sends and receives split by the tier that reaches each peer.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed<T> {
    /// Peers on this host, named by their local rank.
    pub local: PeerOps<T>,
    /// Peers on other hosts, named by their rank.
    pub flat: PeerOps<T>,
}

/// Splits sends and receives (peers as ranks of the whole communicator) by tier, keeping their
/// order: a group runs as a group on the local tier, then one on the flat tier.
pub fn route<T>(
    layout: &HostLayout,
    rank: usize,
    sends: Vec<(usize, T)>,
    recvs: Vec<(usize, T)>,
) -> Routed<T> {
    let host = layout.host_of(rank);
    let split = |list: Vec<(usize, T)>| {
        let (near, far): (Vec<_>, Vec<_>) = list
            .into_iter()
            .partition(|(q, _)| layout.host_of(*q) == host);
        let near: Vec<_> = near
            .into_iter()
            .map(|(q, x)| (place(layout, q).1, x))
            .collect();
        (near, far)
    };
    let (near_sends, far_sends) = split(sends);
    let (near_recvs, far_recvs) = split(recvs);
    Routed {
        local: PeerOps {
            sends: near_sends,
            recvs: near_recvs,
        },
        flat: PeerOps {
            sends: far_sends,
            recvs: far_recvs,
        },
    }
}
