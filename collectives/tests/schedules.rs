//! Runs every schedule builder in memory (`sim::run`) for all ranks and compares each rank's
//! result with a direct reference computed from all ranks' inputs.
//!
//! Integer data is arbitrary (so wrapping is exercised); floating-point data is small integers
//! (so every reduction order gives the same, exact result).

use half::{bf16, f16};
use proptest::prelude::*;
use weftcc_collectives::schedule::hierarchical::{self, HostLayout};
use weftcc_collectives::schedule::sim::{self, RankMemory, SimError};
use weftcc_collectives::schedule::tree;
use weftcc_collectives::schedule::{self, p2p, Action, Part, Schedule, ScheduleError};
use weftcc_collectives::testing::SplitMix64 as Rng;
use weftcc_collectives::{Combiner, DataType};

const COMBS: [Combiner; 4] = [Combiner::Sum, Combiner::Prod, Combiner::Min, Combiner::Max];

/// Input data for one rank: arbitrary bytes for integers, small integers for floats (in
/// {-2, -1, 1, 2} for products, so they stay exact, -8..=8 otherwise).
fn gen_data(rng: &mut Rng, dtype: DataType, comb: Combiner, elems: usize) -> Vec<u8> {
    if !dtype.is_float() {
        return rng.bytes(elems * dtype.size());
    }
    let mut out = Vec::with_capacity(elems * dtype.size());
    for _ in 0..elems {
        let v = if comb == Combiner::Prod {
            [-2.0, -1.0, 1.0, 2.0][rng.below(4)]
        } else {
            rng.below(17) as f64 - 8.0
        };
        push_float(&mut out, dtype, v);
    }
    out
}

/// Appends `v` rounded to the float type `dtype`.
fn push_float(out: &mut Vec<u8>, dtype: DataType, v: f64) {
    match dtype {
        DataType::Float16 => out.extend(f16::from_f64(v).to_le_bytes()),
        DataType::Bfloat16 => out.extend(bf16::from_f64(v).to_le_bytes()),
        DataType::Float32 => out.extend((v as f32).to_le_bytes()),
        _ => out.extend(v.to_le_bytes()),
    }
}

/// A rank's input for the reducing checks: [`mixed_data`] or [`gen_data`].
fn input_data(p: &Params, rng: &mut Rng, elems: usize) -> Vec<u8> {
    if p.mixed {
        mixed_data(rng, p.dtype, p.comb, elems)
    } else {
        gen_data(rng, p.dtype, p.comb, elems)
    }
}

/// Floats of mixed magnitudes and signs: `±m × 2^e`, `m` in [1, 2) with a random mantissa, `e`
/// within ±12 (±6 for f16 and bf16, ±1 for products), so that sums and products depend on the
/// order of their terms while staying finite and exact in the reference's `f64`.
fn mixed_data(rng: &mut Rng, dtype: DataType, comb: Combiner, elems: usize) -> Vec<u8> {
    let span: i32 = match (comb, dtype) {
        (Combiner::Prod, _) => 1,
        (_, DataType::Float16 | DataType::Bfloat16) => 6,
        _ => 12,
    };
    let mut out = Vec::with_capacity(elems * dtype.size());
    for _ in 0..elems {
        let m = 1.0 + (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let e = rng.below(2 * span as usize + 1) as i32 - span;
        let v = if rng.below(2) == 0 { m } else { -m } * 2f64.powi(e);
        push_float(&mut out, dtype, v);
    }
    out
}

/// `acc = acc ⊕ x` element by element, written directly (independent of the kernels in
/// `reduce.rs`): integers in `i128` (sign- or zero-extended, the result truncated back to the
/// type's width, which is the type's wrapping arithmetic), floats in `f64` rounded to the type.
fn ref_combine(dtype: DataType, comb: Combiner, acc: &mut [u8], x: &[u8]) {
    let width = dtype.size();
    let signed = matches!(dtype, DataType::Int8 | DataType::Int32 | DataType::Int64);
    let int = |b: &[u8]| {
        let mut v = [0u8; 16];
        v[..width].copy_from_slice(b);
        let shift = 128 - 8 * width as u32;
        let raw = i128::from_le_bytes(v);
        if signed {
            (raw << shift) >> shift
        } else {
            raw
        }
    };
    let float = |b: &[u8]| dtype.decode_f64(b).expect("one element");
    for (a, b) in acc.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        if dtype.is_float() {
            let (p, q) = (float(a), float(b));
            let r = match comb {
                Combiner::Sum => p + q,
                Combiner::Prod => p * q,
                Combiner::Min => p.min(q),
                Combiner::Max => p.max(q),
            };
            a.copy_from_slice(&dtype.encode_f64(r));
        } else {
            let (p, q) = (int(a), int(b));
            let r = match comb {
                Combiner::Sum => p.wrapping_add(q),
                Combiner::Prod => p.wrapping_mul(q),
                Combiner::Min => p.min(q),
                Combiner::Max => p.max(q),
            };
            a.copy_from_slice(&r.to_le_bytes()[..width]);
        }
    }
}

/// Folds the given byte ranges of all ranks' inputs in rank order.
fn fold(dtype: DataType, comb: Combiner, inputs: &[Vec<u8>], lo: usize, hi: usize) -> Vec<u8> {
    let mut acc = inputs[0][lo..hi].to_vec();
    for x in &inputs[1..] {
        ref_combine(dtype, comb, &mut acc, &x[lo..hi]);
    }
    acc
}

/// Parameters shared by all property tests.
#[derive(Debug, Clone)]
struct Params {
    n: usize,
    count: usize,
    slice: usize,
    seed: u64,
    dtype: DataType,
    comb: Combiner,
    cap: Option<usize>,
    in_place: bool,
    root: usize,
    /// Floats of mixed magnitudes and signs, whose sums depend on the order ([`mixed_data`]),
    /// instead of [`gen_data`]'s exact ones.
    mixed: bool,
}

impl Params {
    /// Rank `rank`'s part in the collective these parameters describe.
    fn part(&self, rank: usize) -> Part {
        Part {
            rank,
            nranks: self.n,
            count: self.count,
            slice_elems: self.slice,
        }
    }
}

fn params(max_count: usize) -> impl Strategy<Value = Params> {
    (
        1usize..=16,
        prop_oneof![0usize..=20, 0usize..=max_count],
        prop_oneof![Just(0usize), 1usize..=8, 1usize..=5000],
        any::<u64>(),
        0usize..DataType::ALL.len(),
        0usize..4,
        prop_oneof![
            2 => Just(None),
            3 => (8usize..=4096).prop_map(Some),
            1 => (1usize..8).prop_map(Some),
        ],
        any::<bool>(),
        any::<usize>(),
    )
        .prop_map(
            |(n, count, slice, seed, d, c, cap, in_place, root)| Params {
                n,
                count,
                slice,
                seed,
                dtype: DataType::ALL[d],
                comb: COMBS[c],
                cap,
                in_place,
                root: root % n,
                mixed: false,
            },
        )
}

/// Runs the schedules with an interleaving policy drawn from `rng`.
fn simulate(
    p: &Params,
    rng: &mut Rng,
    scheds: &[Schedule],
    mem: &mut [RankMemory],
) -> Result<(), SimError> {
    let policy = rng.below(4);
    let mut pick = Rng(rng.next_u64());
    let mut sticky = 0usize;
    let mut order = move |k: usize| match policy {
        0 => 0,
        1 => k - 1,
        // Keep choosing the same position for a while, then jump.
        2 => {
            if pick.below(8) == 0 {
                sticky = pick.below(k);
            }
            sticky % k
        }
        _ => pick.below(k),
    };
    sim::run(p.dtype, p.comb, scheds, mem, &mut order, p.cap)
}

fn build(
    n: usize,
    f: impl Fn(usize) -> Result<Schedule, ScheduleError>,
) -> Result<Vec<Schedule>, TestCaseError> {
    (0..n)
        .map(|r| f(r).map_err(|e| TestCaseError::fail(format!("rank {r}: {e}"))))
        .collect()
}

/// No message is longer than a slice (0 means 1 element).
fn check_slices(scheds: &[Schedule], slice: usize) -> Result<(), TestCaseError> {
    for (r, s) in scheds.iter().enumerate() {
        for (i, st) in s.steps.iter().enumerate() {
            let len = match st.action {
                Action::Send { src, .. } => src.len,
                Action::RecvCopy { dst, .. } | Action::RecvReduce { dst, .. } => dst.len,
                Action::Copy { .. } => 0,
            };
            prop_assert!(
                len <= slice.max(1),
                "rank {} step {} moves {} elements",
                r,
                i,
                len
            );
        }
    }
    Ok(())
}

/// A host layout for `n` ranks drawn from `seed`: 1 to `n` hosts, ranks assigned at random (so
/// hosts hold different numbers of ranks and need not be contiguous), every host non-empty.
/// Recursive doubling and the double binary tree: all-reduces that promise every rank the same
/// bits (as the hierarchical one does).
const IDENTICAL_ALL_REDUCES: [BlockBuilder; 2] = [
    schedule::recursive_doubling_all_reduce,
    tree::tree_all_reduce,
];

/// The hierarchical all-reduce on a random host layout of `n` ranks.
fn hierarchical_on(n: usize, seed: u64) -> impl Build {
    let hosts = layout(n, seed);
    move |part: Part| {
        hierarchical::hierarchical_all_reduce(part.rank, &hosts, part.count, part.slice_elems)
    }
}

fn layout(n: usize, seed: u64) -> HostLayout {
    let mut rng = Rng(seed ^ 0x5eed);
    let hosts = 1 + rng.below(n);
    let mut labels: Vec<usize> = (0..n)
        .map(|r| if r < hosts { r } else { rng.below(hosts) })
        .collect();
    // Shuffle so that hosts are not numbered in rank order.
    for i in (1..n).rev() {
        labels.swap(i, rng.below(i + 1));
    }
    HostLayout::from_labels(&labels)
}

fn sim_ok(r: Result<(), SimError>) -> Result<(), TestCaseError> {
    r.map_err(|e| TestCaseError::fail(e.to_string()))
}

fn check_all_reduce_with(p: &Params, builder: impl Build) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let bytes = p.count * p.dtype.size();
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|_| input_data(p, &mut rng, p.count)).collect();
    let scheds = build(p.n, |r| builder(p.part(r)))?;
    check_slices(&scheds, p.slice)?;
    let mut mem = same_size_memory(p, &inputs, |_| rng.bytes(bytes));
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    let want = fold(p.dtype, p.comb, &inputs, 0, bytes);
    for (r, m) in mem.iter().enumerate() {
        prop_assert_eq!(m.output().unwrap(), &want[..], "rank {}", r);
        if !p.in_place {
            prop_assert_eq!(m.input().unwrap(), &inputs[r][..], "rank {} input", r);
        }
    }
    Ok(())
}

/// Each rank's memory for a collective whose Input and Output both hold `count` elements: one
/// buffer in place, else the rank's input and `output(rank)`.
fn same_size_memory(
    p: &Params,
    inputs: &[Vec<u8>],
    mut output: impl FnMut(usize) -> Vec<u8>,
) -> Vec<RankMemory> {
    let whole = (0, p.count * p.dtype.size());
    let memory = |(r, x): (usize, &Vec<u8>)| {
        if p.in_place {
            RankMemory::shared(x.clone(), whole, whole)
        } else {
            RankMemory::separate(x.clone(), output(r))
        }
    };
    inputs.iter().enumerate().map(memory).collect()
}

/// A builder that takes a [`Part`], closures included.
trait Build: Fn(Part) -> Result<Schedule, ScheduleError> {}

impl<F: Fn(Part) -> Result<Schedule, ScheduleError>> Build for F {}

/// The signature shared by the all-gather and reduce-scatter builders.
type BlockBuilder = fn(Part) -> Result<Schedule, ScheduleError>;

fn check_reduce_scatter_with(p: &Params, builder: BlockBuilder) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let block = p.count * p.dtype.size();
    let inputs: Vec<Vec<u8>> = (0..p.n)
        .map(|_| input_data(p, &mut rng, p.n * p.count))
        .collect();
    let scheds = build(p.n, |r| builder(p.part(r)))?;
    let mut mem: Vec<RankMemory> = inputs
        .iter()
        .enumerate()
        .map(|(r, x)| {
            if p.in_place {
                RankMemory::shared(x.clone(), (0, p.n * block), (r * block, block))
            } else {
                RankMemory::separate(x.clone(), rng.bytes(block))
            }
        })
        .collect();
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    for (r, m) in mem.iter().enumerate() {
        let want = fold(p.dtype, p.comb, &inputs, r * block, (r + 1) * block);
        prop_assert_eq!(m.output().unwrap(), &want[..], "rank {}", r);
        // Every other block of Input is untouched, in place or not.
        let input = m.input().unwrap();
        for j in (0..p.n).filter(|&j| j != r || !p.in_place) {
            let (lo, hi) = (j * block, (j + 1) * block);
            prop_assert_eq!(&input[lo..hi], &inputs[r][lo..hi], "rank {} block {}", r, j);
        }
    }
    Ok(())
}

fn check_all_gather_with(p: &Params, builder: BlockBuilder) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let block = p.count * p.dtype.size();
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|_| rng.bytes(block)).collect();
    let scheds = build(p.n, |r| builder(p.part(r)))?;
    let mut mem: Vec<RankMemory> = inputs
        .iter()
        .enumerate()
        .map(|(r, x)| {
            let mut out = rng.bytes(p.n * block);
            if p.in_place {
                out[r * block..(r + 1) * block].copy_from_slice(x);
                RankMemory::shared(out, (r * block, block), (0, p.n * block))
            } else {
                RankMemory::separate(x.clone(), out)
            }
        })
        .collect();
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    let want = inputs.concat();
    for (r, m) in mem.iter().enumerate() {
        prop_assert_eq!(m.output().unwrap(), &want[..], "rank {}", r);
        prop_assert_eq!(m.input().unwrap(), &inputs[r][..], "rank {} input", r);
    }
    Ok(())
}

/// The signature shared by the rooted builders (the part, then the root).
type RootedBuilder = fn(Part, usize) -> Result<Schedule, ScheduleError>;

fn check_broadcast_with(p: &Params, builder: RootedBuilder) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let bytes = p.count * p.dtype.size();
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|_| rng.bytes(bytes)).collect();
    let scheds = build(p.n, |r| builder(p.part(r), p.root))?;
    check_slices(&scheds, p.slice)?;
    let mut mem = same_size_memory(p, &inputs, |_| rng.bytes(bytes));
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    for (r, m) in mem.iter().enumerate() {
        prop_assert_eq!(m.output().unwrap(), &inputs[p.root][..], "rank {}", r);
        if !p.in_place || r == p.root {
            prop_assert_eq!(m.input().unwrap(), &inputs[r][..], "rank {} input", r);
        }
    }
    Ok(())
}

fn check_reduce_with(p: &Params, builder: RootedBuilder) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let bytes = p.count * p.dtype.size();
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|_| input_data(p, &mut rng, p.count)).collect();
    let scheds = build(p.n, |r| builder(p.part(r), p.root))?;
    check_slices(&scheds, p.slice)?;
    let sentinels: Vec<Vec<u8>> = (0..p.n).map(|_| rng.bytes(bytes)).collect();
    let mut mem = same_size_memory(p, &inputs, |r| sentinels[r].clone());
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    let want = fold(p.dtype, p.comb, &inputs, 0, bytes);
    for (r, m) in mem.iter().enumerate() {
        if r == p.root {
            prop_assert_eq!(m.output().unwrap(), &want[..], "root {}", r);
        } else if p.in_place {
            // Output is Input: a non-root rank must leave it alone.
            prop_assert_eq!(m.output().unwrap(), &inputs[r][..], "rank {}", r);
        } else {
            prop_assert_eq!(m.output().unwrap(), &sentinels[r][..], "rank {}", r);
            prop_assert_eq!(m.input().unwrap(), &inputs[r][..], "rank {} input", r);
        }
    }
    Ok(())
}

fn check_all_to_all(p: &Params) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let block = p.count * p.dtype.size();
    let total = p.n * block;
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|_| rng.bytes(total)).collect();
    let scheds = build(p.n, |r| {
        schedule::pairwise_all_to_all(p.part(r), p.in_place)
    })?;
    let mut mem: Vec<RankMemory> = inputs
        .iter()
        .map(|x| {
            if p.in_place {
                RankMemory::shared(x.clone(), (0, total), (0, total))
            } else {
                RankMemory::separate(x.clone(), rng.bytes(total))
            }
        })
        .collect();
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    for (r, m) in mem.iter().enumerate() {
        let out = m.output().unwrap();
        for (j, input) in inputs.iter().enumerate() {
            prop_assert_eq!(
                &out[j * block..(j + 1) * block],
                &input[r * block..(r + 1) * block],
                "rank {} block {}",
                r,
                j
            );
        }
        if !p.in_place {
            prop_assert_eq!(m.input().unwrap(), &inputs[r][..], "rank {} input", r);
        }
    }
    Ok(())
}

fn check_barrier(p: &Params) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let scheds = build(p.n, |r| schedule::dissemination_barrier(r, p.n))?;
    let mut mem: Vec<RankMemory> = (0..p.n)
        .map(|_| RankMemory::separate(Vec::new(), Vec::new()))
        .collect();
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    // The defining property: no rank finishes before every rank has entered. Run the schedules
    // of all ranks but one: the others must deadlock rather than complete.
    if p.n > 1 {
        let missing = p.root;
        let mut partial = scheds.clone();
        partial[missing].steps.clear();
        let mut mem: Vec<RankMemory> = (0..p.n)
            .map(|_| RankMemory::separate(Vec::new(), Vec::new()))
            .collect();
        match simulate(p, &mut rng, &partial, &mut mem) {
            Err(SimError::Deadlock { stuck }) => {
                // Every rank other than the missing one is still waiting.
                let waiting: Vec<usize> = stuck.iter().map(|s| s.rank).collect();
                let others: Vec<usize> = (0..p.n).filter(|&r| r != missing).collect();
                prop_assert_eq!(waiting, others);
            }
            other => prop_assert!(false, "expected deadlock, got {:?}", other),
        }
    }
    Ok(())
}

/// A random group on every rank: each rank sends up to 4 messages (0..=`p.count` bytes) to
/// random other ranks; each receiver posts the matching receives, in order per sender but
/// interleaved across senders at random. Every receive buffer must end up with exactly the bytes
/// of its matching send, whatever the interleaving, slice size and FIFO capacity.
fn check_group(p: &Params) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let n = p.n;
    // messages[s][d]: the payloads rank s sends to rank d, in order.
    let mut messages: Vec<Vec<Vec<Vec<u8>>>> = vec![vec![Vec::new(); n]; n];
    let mut sends: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    if n > 1 {
        for (s, list) in sends.iter_mut().enumerate() {
            for _ in 0..rng.below(5) {
                let d = (s + 1 + rng.below(n - 1)) % n;
                let len = rng.below(p.count + 1);
                let data = rng.bytes(len);
                list.push((d, data.len()));
                messages[s][d].push(data);
            }
        }
    }
    // Receives: per receiver, a random merge of its senders' ordered lists.
    let mut recvs: Vec<Vec<(usize, Vec<u8>)>> = vec![Vec::new(); n];
    for (d, list) in recvs.iter_mut().enumerate() {
        let mut queues: Vec<(usize, std::collections::VecDeque<Vec<u8>>)> = (0..n)
            .map(|s| {
                (
                    s,
                    messages[s][d]
                        .iter()
                        .cloned()
                        .collect::<std::collections::VecDeque<_>>(),
                )
            })
            .filter(|(_, q)| !q.is_empty())
            .collect();
        while !queues.is_empty() {
            let k = rng.below(queues.len());
            let (s, q) = &mut queues[k];
            list.push((*s, q.pop_front().unwrap_or_default()));
            if q.is_empty() {
                queues.remove(k);
            }
        }
    }
    let slice = p.slice.max(1);
    let mut scheds = Vec::new();
    let mut mem = Vec::new();
    for r in 0..n {
        let mut input = Vec::new();
        let mut send_list = Vec::new();
        let mut cursor = [0usize; 16];
        for &(d, len) in &sends[r] {
            input.extend_from_slice(&messages[r][d][cursor[d]]);
            cursor[d] += 1;
            send_list.push((d, (), len));
        }
        let recv_list: Vec<(usize, (), usize)> = recvs[r]
            .iter()
            .map(|(s, data)| (*s, (), data.len()))
            .collect();
        let group = p2p::group_schedule(&send_list, &recv_list, slice);
        let out_len: usize = recv_list.iter().map(|x| x.2).sum();
        scheds.push(group.schedule);
        mem.push(RankMemory::separate(input, vec![0xEE; out_len]));
    }
    check_slices(&scheds, slice)?;
    let q = Params {
        dtype: DataType::Uint8,
        comb: Combiner::Sum,
        ..p.clone()
    };
    sim_ok(simulate(&q, &mut rng, &scheds, &mut mem))?;
    for (r, m) in mem.iter().enumerate() {
        let want: Vec<u8> = recvs[r]
            .iter()
            .flat_map(|(_, d)| d.iter().copied())
            .collect();
        prop_assert_eq!(m.output().unwrap(), &want[..], "rank {}", r);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn group_send_recv_delivers_every_message(p in params(300)) {
        check_group(&p)?;
    }

    /// Ring, recursive doubling, double binary tree and hierarchical all-reduce.
    #[test]
    fn all_reduce_matches_reference(p in params(3000)) {
        check_all_reduce_with(&p, schedule::ring_all_reduce)?;
        for builder in IDENTICAL_ALL_REDUCES {
            check_all_reduce_with(&p, builder)?;
        }
        check_all_reduce_with(&p, hierarchical_on(p.n, p.seed))?;
    }

    #[test]
    fn all_reduce_is_bitwise_identical(q in float_params()) {
        for builder in IDENTICAL_ALL_REDUCES {
            check_float_all_reduce_identical(&q, builder)?;
        }
        check_float_all_reduce_identical(&q, hierarchical_on(q.n, q.seed))?;
    }

    /// Chains and pipelined binary trees.
    #[test]
    fn broadcast_and_reduce_match_reference(p in params(3000)) {
        check_broadcast_with(&p, schedule::chain_broadcast)?;
        check_reduce_with(&p, schedule::chain_reduce)?;
        check_broadcast_with(&p, tree::tree_broadcast)?;
        check_reduce_with(&p, tree::tree_reduce)?;
    }

    /// Rings, and recursive halving and doubling on a power of two (1, 2, 4, 8, 16 ranks).
    #[test]
    fn reduce_scatter_and_all_gather_match_reference(p in params(300)) {
        check_reduce_scatter_with(&p, schedule::ring_reduce_scatter)?;
        check_all_gather_with(&p, schedule::ring_all_gather)?;
        let p = Params { n: 1 << p.n.ilog2(), ..p };
        check_reduce_scatter_with(&p, schedule::recursive_halving_reduce_scatter)?;
        check_all_gather_with(&p, schedule::recursive_doubling_all_gather)?;
    }

    #[test]
    fn all_to_all_matches_reference(p in params(200)) {
        check_all_to_all(&p)?;
    }

    #[test]
    fn barrier_completes_only_with_everyone(p in params(0)) {
        check_barrier(&p)?;
    }

    /// Deterministic mode: on floats whose sums depend on the order, the ordered all-reduce,
    /// reduce and reduce-scatter give exactly the rank-order fold, bit for bit, on every rank,
    /// whatever the ranks (1–16), counts (uneven included), slice size, FIFO capacity and
    /// interleaving. (With the default schedules the same check fails:
    /// `default_schedules_change_the_bits`.)
    #[test]
    fn ordered_reductions_are_the_rank_order_fold(p in ordered_params()) {
        check_all_reduce_with(&p, schedule::ordered::ordered_all_reduce)?;
        check_reduce_with(&p, schedule::ordered::ordered_reduce)?;
        check_reduce_scatter_with(&p, schedule::ordered::ordered_reduce_scatter)?;
    }
}

/// The floating-point types, for the order-sensitive checks.
const FLOATS: [DataType; 4] = [
    DataType::Float32,
    DataType::Float64,
    DataType::Float16,
    DataType::Bfloat16,
];

/// Float types, any combiner, mixed-magnitude data.
fn ordered_params() -> impl Strategy<Value = Params> {
    (params(600), 0usize..4).prop_map(|(mut p, d)| {
        p.dtype = FLOATS[d];
        p.mixed = true;
        p
    })
}

/// The property above fails for the default schedules: on the same kind of data, ring,
/// recursive doubling and tree all-reduces, chain and tree reduces, and ring and recursive-halving
/// reduce-scatters each miss the rank-order fold's bits for some case, and the ordered ones
/// never do.
#[test]
fn default_schedules_change_the_bits() {
    let case = |seed: u64, n: usize| Params {
        n,
        count: 64,
        slice: 7,
        seed,
        dtype: DataType::Float32,
        comb: Combiner::Sum,
        cap: None,
        in_place: false,
        root: 1,
        mixed: true,
    };
    let fails = |check: &dyn Fn(&Params) -> Result<(), TestCaseError>| {
        (0..20).any(|seed| check(&case(seed, 8)).is_err())
    };
    assert!(fails(&|p| check_all_reduce_with(
        p,
        schedule::ring_all_reduce
    )));
    assert!(fails(&|p| check_all_reduce_with(
        p,
        schedule::recursive_doubling_all_reduce
    )));
    assert!(fails(&|p| check_all_reduce_with(p, tree::tree_all_reduce)));
    assert!(fails(&|p| check_reduce_with(p, schedule::chain_reduce)));
    assert!(fails(&|p| check_reduce_with(p, tree::tree_reduce)));
    assert!(fails(&|p| check_reduce_scatter_with(
        p,
        schedule::ring_reduce_scatter
    )));
    assert!(fails(&|p| check_reduce_scatter_with(
        p,
        schedule::recursive_halving_reduce_scatter
    )));
    for seed in 0..20 {
        let p = case(seed, 8);
        check_all_reduce_with(&p, schedule::ordered::ordered_all_reduce).expect("ordered");
        check_reduce_with(&p, schedule::ordered::ordered_reduce).expect("ordered");
        check_reduce_scatter_with(&p, schedule::ordered::ordered_reduce_scatter).expect("ordered");
    }
}

/// Params for every data type and combiner at each shape `(ranks, count, slice, FIFO cap)`, with
/// the indices of the type and the combiner (out of place, root `count % ranks`).
fn every_dtype_and_combiner_at(
    shapes: &[(usize, usize, usize, Option<usize>)],
) -> Vec<(usize, usize, Params)> {
    let mut all = Vec::new();
    for (i, dtype) in DataType::ALL.into_iter().enumerate() {
        for (j, comb) in COMBS.into_iter().enumerate() {
            for &(n, count, slice, cap) in shapes {
                let seed = (i * 31 + j * 7 + n) as u64;
                let root = count % n;
                let p = Params {
                    n,
                    count,
                    slice,
                    seed,
                    dtype,
                    comb,
                    cap,
                    in_place: false,
                    root,
                    mixed: false,
                };
                all.push((i, j, p));
            }
        }
    }
    all
}

/// Every data type and combiner through the reducing collectives, at a fixed awkward shape.
#[test]
fn every_dtype_and_combiner() {
    let shapes = [(5, 37, 4, Some(13)), (3, 2, 0, None), (7, 100, 9, Some(64))];
    for (i, j, mut p) in every_dtype_and_combiner_at(&shapes) {
        p.in_place = (i + j) % 2 == 0;
        let what = format!("{p:?}");
        check_all_reduce_with(&p, schedule::ring_all_reduce).expect(&what);
        check_reduce_scatter_with(&p, schedule::ring_reduce_scatter).expect(&what);
        check_reduce_with(&p, schedule::chain_reduce).expect(&what);
        check_all_gather_with(&p, schedule::ring_all_gather).expect(&what);
        check_broadcast_with(&p, schedule::chain_broadcast).expect(&what);
        check_all_to_all(&p).expect(&what);
    }
}

/// Float data whose sums are not exact, so a rank that combined in a different order would end
/// up with different bits.
fn float_params() -> impl Strategy<Value = Params> {
    (params(600), 0usize..4).prop_map(|(mut p, d)| {
        p.dtype = FLOATS[d];
        p.comb = Combiner::Sum;
        p
    })
}

/// Element `i` of rank `r`: `0.1 * (r + 1) + 1e-3 * i` in `p.dtype`.
fn inexact_data(p: &Params, r: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(p.count * p.dtype.size());
    for i in 0..p.count {
        let v = 0.1 * (r + 1) as f64 + 1e-3 * i as f64;
        push_float(&mut out, p.dtype, v);
    }
    out
}

/// Runs an all-reduce (sum) of inexact float data and checks that every rank ends with the same
/// bits, and that those are close to the exact sum.
fn check_float_all_reduce_identical(p: &Params, builder: impl Build) -> Result<(), TestCaseError> {
    let mut rng = Rng(p.seed);
    let bytes = p.count * p.dtype.size();
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|r| inexact_data(p, r)).collect();
    let scheds = build(p.n, |r| builder(p.part(r)))?;
    let mut mem = same_size_memory(p, &inputs, |_| rng.bytes(bytes));
    sim_ok(simulate(p, &mut rng, &scheds, &mut mem))?;
    let first = mem[0].output().unwrap().to_vec();
    for (r, m) in mem.iter().enumerate() {
        prop_assert_eq!(
            m.output().unwrap(),
            &first[..],
            "rank {} differs from rank 0",
            r
        );
    }
    let (size, tol) = match p.dtype {
        DataType::Float16 | DataType::Bfloat16 => (2, 0.05),
        DataType::Float32 => (4, 1e-5),
        _ => (8, 1e-12),
    };
    for (i, e) in first.chunks_exact(size).enumerate() {
        let got = match p.dtype {
            DataType::Float16 => f16::from_le_bytes([e[0], e[1]]).to_f64(),
            DataType::Bfloat16 => bf16::from_le_bytes([e[0], e[1]]).to_f64(),
            DataType::Float32 => f64::from(f32::from_le_bytes(e.try_into().unwrap())),
            _ => f64::from_le_bytes(e.try_into().unwrap()),
        };
        let n = p.n as f64;
        let exact = 0.1 * n * (n + 1.0) / 2.0 + 1e-3 * i as f64 * n;
        prop_assert!(
            (got - exact).abs() <= tol * exact.abs().max(1.0),
            "element {}: {} vs {}",
            i,
            got,
            exact
        );
    }
    Ok(())
}

/// The inexact data really is order-sensitive: summing in rank order and in reverse differs for
/// some element, so the bitwise-identity test above can fail.
#[test]
fn inexact_float_sums_depend_on_order() {
    let p = Params {
        n: 7,
        count: 64,
        slice: 0,
        seed: 0,
        dtype: DataType::Float32,
        comb: Combiner::Sum,
        cap: None,
        in_place: false,
        root: 0,
        mixed: false,
    };
    let inputs: Vec<Vec<u8>> = (0..p.n).map(|r| inexact_data(&p, r)).collect();
    let mut reversed = inputs.clone();
    reversed.reverse();
    let bytes = p.count * 4;
    assert_ne!(
        fold(p.dtype, p.comb, &inputs, 0, bytes),
        fold(p.dtype, p.comb, &reversed, 0, bytes)
    );
}

/// Every data type and combiner through recursive doubling (shapes with and without folding),
/// the trees and the hierarchical all-reduce.
#[test]
fn recursive_doubling_every_dtype_and_combiner() {
    let shapes = [
        (5, 37, 4, Some(13)),
        (3, 2, 0, None),
        (8, 100, 9, Some(5)),
        (12, 3, 1, Some(1)),
    ];
    for (_, _, p) in every_dtype_and_combiner_at(&shapes) {
        for in_place in [false, true] {
            let p = Params {
                in_place,
                root: 0,
                ..p.clone()
            };
            let what = format!("{p:?}");
            for builder in IDENTICAL_ALL_REDUCES {
                check_all_reduce_with(&p, builder).expect(&what);
            }
            check_broadcast_with(&p, tree::tree_broadcast).expect(&what);
            check_reduce_with(&p, tree::tree_reduce).expect(&what);
            check_all_reduce_with(&p, hierarchical_on(p.n, p.seed)).expect(&what);
        }
    }
}
