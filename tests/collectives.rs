//! Correctness matrix: every collective × data type × reduction × rank count × element count ×
//! in-place/out-of-place × transport, checked against an independent reference computed here
//! from the input formula (never with the library's own kernels).
//!
//! Inputs are small integers chosen so that sums, products, minima and maxima are exact in every
//! type (|sum| ≤ 88, |product| ≤ 256): integer and float results must then match exactly. Only
//! `Avg` (a division) and `PreMulSum` with a non-integral result can round; there the tolerance is
//! two units in the last place of the type (the library rounds the exact sum once to the type,
//! then divides in f32 or f64 and rounds again).
//!
//! `cargo test` runs a slice of the matrix (`Extent::Slice`): every collective, type, reduction,
//! count, placement and wire on 1, 2, 3 and 8 ranks, rotated so that every pair of dimensions
//! still meets (`ci_slices_cover_every_pair` checks it) but not their whole product. The
//! `full_*` tests (`#[ignore]`d) run all of it: `scripts/full_matrix.sh`.

mod common;

use common::with_ranks;
use common::Wire::{self, Net, Shm, Tcp, TcpStriped};
use half::{bf16, f16};
use weftcc::{Communicator, Element, ReduceOp, Selection};

/// Test-side view of an element type: built from small integers, read back as f64, with the
/// type's own wrapping for integers.
trait Val: Element + Copy + Default {
    const INT: bool;
    const SIGNED: bool;
    /// Relative precision (2 ulp) for rounded results.
    const EPS: f64;
    fn from_i128_wrapping(v: i128) -> Self;
}

macro_rules! int_val {
    ($($t:ty, $signed:expr);*) => {$(
        impl Val for $t {
            const INT: bool = true;
            const SIGNED: bool = $signed;
            const EPS: f64 = 0.0;
            fn from_i128_wrapping(v: i128) -> Self { v as $t }
        }
    )*};
}
int_val!(i8, true; u8, false; i32, true; u32, false; i64, true; u64, false);

macro_rules! float_val {
    ($($t:ty, $eps:expr);*) => {$(
        impl Val for $t {
            const INT: bool = false;
            const SIGNED: bool = true;
            const EPS: f64 = $eps;
            fn from_i128_wrapping(v: i128) -> Self { Element::from_f64(v as f64) }
        }
    )*};
}
float_val!(
    f32, 2.0 * f32::EPSILON as f64;
    f64, 2.0 * f64::EPSILON;
    f16, 2.0 / 1024.0;
    bf16, 2.0 / 128.0
);

/// Input of `rank` at index `i` for reduction `op`.
fn input<T: Val>(rank: usize, i: usize, op: ReduceOp) -> i128 {
    let base = ((rank * 7 + i * 3) % 11) as i128;
    match op {
        // Factors 1 or 2 (and a sign for signed types): |product| ≤ 2^8.
        ReduceOp::Prod => {
            let m = 1 + ((rank + i) % 2) as i128;
            if T::SIGNED && (rank + 2 * i).is_multiple_of(3) {
                -m
            } else {
                m
            }
        }
        _ if T::SIGNED => base - 5,
        _ => base,
    }
}

/// `input` repeats with this period in the index: 11 values, times product factors (period 2)
/// and signs (period 3). Checked by `inputs_repeat_with_their_period`.
const PERIOD: usize = 66;

#[test]
fn inputs_repeat_with_their_period() {
    for op in OPS {
        for r in 0..8 {
            for i in 0..500 {
                assert_eq!(input::<i32>(r, i, op), input::<i32>(r, i + PERIOD, op));
                assert_eq!(input::<u8>(r, i, op), input::<u8>(r, i + PERIOD, op));
            }
        }
    }
}

fn pattern<T: Val>(rank: usize, len: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| T::from_i128_wrapping(input::<T>(rank, i, op)))
        .collect()
}

const PREMUL: f64 = 2.0;

/// The reduction of element `i` of every rank's input, computed exactly then cast to T
/// (without allocating: the large cases check millions of elements).
fn reduced<T: Val>(n: usize, i: usize, op: ReduceOp) -> T {
    let vals = (0..n).map(|r| input::<T>(r, i, op));
    match op {
        ReduceOp::Sum => T::from_i128_wrapping(vals.sum()),
        ReduceOp::Prod => T::from_i128_wrapping(vals.product()),
        ReduceOp::Min => T::from_i128_wrapping(vals.min().unwrap_or(0)),
        ReduceOp::Max => T::from_i128_wrapping(vals.max().unwrap_or(0)),
        ReduceOp::PreMulSum(s) if T::INT => {
            // Each rank's scaled value is exact (s is integral); the sum wraps in the type.
            T::from_i128_wrapping(vals.map(|v| (v as f64 * s).round() as i128).sum())
        }
        ReduceOp::PreMulSum(s) => T::from_f64(vals.map(|v| v as f64 * s).sum::<f64>()),
        ReduceOp::Avg => {
            let sum: i128 = vals.sum();
            if T::INT {
                // Integer average: the wrapped sum, divided with truncation (as C does).
                let wrapped = T::from_i128_wrapping(sum).to_f64() as i128;
                T::from_i128_wrapping(wrapped / n as i128)
            } else {
                T::from_f64(sum as f64 / n as f64)
            }
        }
    }
}

fn close<T: Val>(got: T, want: T) -> bool {
    if T::INT || got == want {
        return got == want;
    }
    let (g, w) = (got.to_f64(), want.to_f64());
    (g - w).abs() <= T::EPS * w.abs().max(1.0)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Coll {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    AllToAll,
    SendRecv,
}

const COLLS: [Coll; 7] = [
    Coll::AllReduce,
    Coll::Reduce,
    Coll::Broadcast,
    Coll::AllGather,
    Coll::ReduceScatter,
    Coll::AllToAll,
    Coll::SendRecv,
];

const OPS: [ReduceOp; 6] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
    ReduceOp::PreMulSum(PREMUL),
];

fn has_op(c: Coll) -> bool {
    matches!(c, Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter)
}

/// Runs one case on this rank and returns a description of the first wrong element, if any.
fn run_case<T: Val>(
    comm: &Communicator,
    c: Coll,
    op: ReduceOp,
    count: usize,
    in_place: bool,
) -> Option<String> {
    let (rank, n) = (comm.rank(), comm.size());
    let root = (count + 1) % n; // varies the root with the count
    let name = std::any::type_name::<T>();
    let fail = |what: String| {
        Some(format!(
            "{c:?} {name} {op} count={count} in_place={in_place} rank={rank}/{n}: {what}"
        ))
    };
    // (input length, output length)
    let (ilen, olen) = match c {
        Coll::AllGather => (count, n * count),
        Coll::ReduceScatter => (n * count, count),
        Coll::AllToAll => (n * count, n * count),
        _ => (count, count),
    };
    let inp: Vec<T> = pattern(rank, ilen, op);
    let sentinel = T::from_i128_wrapping(99);
    let mut out: Vec<T>;
    let result = if in_place {
        out = match c {
            Coll::AllGather => {
                let mut b = vec![sentinel; olen];
                b[rank * count..(rank + 1) * count].copy_from_slice(&inp);
                b
            }
            _ => inp.clone(),
        };
        match c {
            Coll::AllReduce => comm.all_reduce_in_place(&mut out, op),
            Coll::Reduce => comm.reduce_in_place(&mut out, op, root),
            Coll::Broadcast => comm.broadcast_in_place(&mut out, root),
            Coll::AllGather => comm.all_gather_in_place(&mut out),
            Coll::ReduceScatter => comm.reduce_scatter_in_place(&mut out, op),
            Coll::AllToAll => comm.all_to_all_in_place(&mut out),
            Coll::SendRecv => return None,
        }
    } else {
        out = vec![sentinel; olen];
        match c {
            Coll::AllReduce => comm.all_reduce(&inp, &mut out, op),
            Coll::Reduce => comm.reduce(&inp, &mut out, op, root),
            Coll::Broadcast => comm.broadcast(&inp, &mut out, root),
            Coll::AllGather => comm.all_gather(&inp, &mut out),
            Coll::ReduceScatter => comm.reduce_scatter(&inp, &mut out, op),
            Coll::AllToAll => comm.all_to_all(&inp, &mut out),
            Coll::SendRecv => {
                if n == 1 {
                    return None;
                }
                comm.group()
                    .send(&inp, (rank + 1) % n)
                    .recv(&mut out, (rank + n - 1) % n)
                    .run()
            }
        }
    };
    if let Err(e) = result {
        return fail(format!("error {e}"));
    }
    // The inputs repeat every PERIOD elements, so the expected values come from small tables and
    // checking millions of elements costs a memory scan.
    let red_tab: Vec<T> = (0..PERIOD).map(|i| reduced::<T>(n, i, op)).collect();
    let in_tab: Vec<Vec<T>> = (0..n)
        .map(|r| {
            (0..PERIOD)
                .map(|i| T::from_i128_wrapping(input::<T>(r, i, op)))
                .collect()
        })
        .collect();
    let red = |i: usize| red_tab[i % PERIOD];
    let inv = |r: usize, i: usize| in_tab[r][i % PERIOD];
    let want = |i: usize| -> T {
        match c {
            Coll::AllReduce => red(i),
            Coll::Reduce if rank == root => red(i),
            Coll::Reduce => {
                if in_place {
                    inp[i]
                } else {
                    sentinel
                }
            }
            Coll::Broadcast => inv(root, i),
            Coll::AllGather => inv(i / count.max(1), i % count.max(1)),
            Coll::ReduceScatter => {
                if in_place {
                    let block = rank * count;
                    if (block..block + count).contains(&i) {
                        red(i)
                    } else {
                        out[i] // outside the result block: unspecified, as in NCCL
                    }
                } else {
                    red(rank * count + i)
                }
            }
            Coll::AllToAll => {
                let (from, k) = (i / count.max(1), i % count.max(1));
                inv(from, rank * count + k)
            }
            Coll::SendRecv => inv((rank + n - 1) % n, i),
        }
    };
    for (i, &got) in out.iter().enumerate() {
        let w = want(i);
        if !close(got, w) {
            return fail(format!("element {i}: got {got:?}, want {w:?}"));
        }
    }
    None
}

/// The small counts every case runs (the large one is `LARGE`).
fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, 2 * n + 1, 1001];
    if n > 2 {
        c.push(n - 1);
    }
    c
}

/// Millions of elements: the pipelined path.
const LARGE: usize = (4 << 20) + 3;

/// The element types, numbered for `Case::ty` (the slices rotate through them in this order).
const TYPES: [&str; 10] = [
    "i8", "u8", "i32", "u32", "i64", "u64", "f16", "f32", "f64", "bf16",
];

/// One call of the matrix on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Case {
    coll: Coll,
    /// Index into `TYPES`.
    ty: usize,
    op: ReduceOp,
    count: usize,
    in_place: bool,
}

/// How much of the matrix a test runs.
#[derive(Clone, Copy, Debug)]
enum Extent {
    /// All of it: every reduction of every type at the small counts; at the large count every
    /// reduction for the types marked so and Sum for the others (the pipelined path depends on
    /// the element size, not on the reduction). `scripts/full_matrix.sh` runs these.
    Full,
    /// CI's slice `k` of a list of `of` cases (rank count × wire): every collective, type, small
    /// count and placement, but each type with two reductions, rotating with the type and `k`,
    /// and the large count for the types `p` with `p ≡ k (mod min(of, types))` only, so that
    /// over the list every pair of dimensions still meets (checked by
    /// `ci_slices_cover_every_pair`).
    Slice { k: usize, of: usize },
}

/// The cases of one test on `n` ranks: `types` are `(type, every reduction at the large count
/// in the full matrix)`, in the order they run.
fn cases(n: usize, colls: &[Coll], types: &[(usize, bool)], extent: Extent) -> Vec<Case> {
    let mut out = Vec::new();
    for (p, &(ty, all_large)) in types.iter().enumerate() {
        let (small, large): (Vec<ReduceOp>, Vec<ReduceOp>) = match extent {
            Extent::Full => {
                let large = if all_large {
                    OPS.to_vec()
                } else {
                    vec![ReduceOp::Sum]
                };
                (OPS.to_vec(), large)
            }
            Extent::Slice { k, of } => {
                let two = vec![OPS[(p + k) % OPS.len()], OPS[(p + k + 3) % OPS.len()]];
                let q = of.min(types.len());
                let large = if p % q == k % q { two.clone() } else { vec![] };
                (two, large)
            }
        };
        for &c in colls {
            let ops = |list: &[ReduceOp]| -> Vec<ReduceOp> {
                match (has_op(c), list.is_empty()) {
                    (true, _) | (false, true) => list.to_vec(),
                    (false, false) => vec![ReduceOp::Sum],
                }
            };
            // Each small count with the small list's reductions, then the large count with the
            // large list's, each out of place and in place.
            let small_calls = ops(&small)
                .into_iter()
                .flat_map(|op| counts(n).into_iter().map(move |count| (op, count)));
            let large_calls = ops(&large).into_iter().map(|op| (op, LARGE));
            for (op, count) in small_calls.chain(large_calls) {
                for in_place in [false, true] {
                    out.push(Case {
                        coll: c,
                        ty,
                        op,
                        count,
                        in_place,
                    });
                }
            }
        }
    }
    out
}

/// Runs `cases` on this rank, adding a description of each wrong one to `errors`.
fn run_cases(comm: &Communicator, cases: &[Case], errors: &mut Vec<String>) {
    for &Case {
        coll,
        ty,
        op,
        count,
        in_place,
    } in cases
    {
        let wrong = match ty {
            0 => run_case::<i8>(comm, coll, op, count, in_place),
            1 => run_case::<u8>(comm, coll, op, count, in_place),
            2 => run_case::<i32>(comm, coll, op, count, in_place),
            3 => run_case::<u32>(comm, coll, op, count, in_place),
            4 => run_case::<i64>(comm, coll, op, count, in_place),
            5 => run_case::<u64>(comm, coll, op, count, in_place),
            6 => run_case::<f16>(comm, coll, op, count, in_place),
            7 => run_case::<f32>(comm, coll, op, count, in_place),
            8 => run_case::<f64>(comm, coll, op, count, in_place),
            9 => run_case::<bf16>(comm, coll, op, count, in_place),
            _ => unreachable!("type {ty}"),
        };
        errors.extend(wrong);
    }
}

/// The matrix's types: every reduction at the large count for i8 and f32 (element sizes 1 and
/// 4), Sum for the others.
const MATRIX_TYPES: [(usize, bool); 10] = [
    (0, true),
    (1, false),
    (2, false),
    (3, false),
    (4, false),
    (5, false),
    (6, false),
    (7, true),
    (8, false),
    (9, false),
];

fn matrix(n: usize, wire: Wire, extent: Extent) {
    if !common::wire_available(wire) {
        return;
    }
    let cases = cases(n, &COLLS, &MATRIX_TYPES, extent);
    let errors = with_ranks(n, wire, |rank, comm| {
        let mut errors = Vec::new();
        if matches!(wire, Wire::Net | Wire::NetLoopback | Wire::NetVerbs) && n > 1 {
            // The matrix is meant for the network path: every rank a host of its own.
            let peer = (rank + 1) % n;
            let _ = comm.all_reduce_in_place(&mut [0u8; 1][..], ReduceOp::Sum);
            if comm.transport_to(peer) != Some("net") {
                errors.push(format!(
                    "rank {rank} reaches {peer} over {:?}",
                    comm.transport_to(peer)
                ));
            }
        }
        run_cases(comm, &cases, &mut errors);
        errors
    });
    let wrong: usize = errors.iter().map(Vec::len).sum();
    println!(
        "matrix: {} cases on {n} ranks over {wire:?}, {wrong} wrong",
        cases.len()
    );
    assert_all_right(errors);
}

/// Fails with the first wrong cases of every rank's list.
fn assert_all_right(per_rank: Vec<Vec<String>>) {
    let errors: Vec<String> = per_rank.into_iter().flatten().collect();
    assert!(
        errors.is_empty(),
        "{} wrong cases, first ones:\n{}",
        errors.len(),
        errors[..errors.len().min(20)].join("\n")
    );
}

/// The forced algorithms' types: i8, u32, i64, f16, f32 (every reduction at the large count),
/// bf16, f64.
const FORCED_TYPES: [(usize, bool); 7] = [
    (0, false),
    (3, false),
    (4, false),
    (6, false),
    (7, true),
    (9, false),
    (8, false),
];

/// The collectives `WEFT_ALGO=spec` affects, run with that choice forced (so every algorithm
/// is covered at every size, not only where the tuner would pick it). `hosts` gives each rank's
/// host: ranks of one host use `wire`, ranks of different hosts TCP.
fn forced(
    n: usize,
    wire: Wire,
    spec: &str,
    colls: &[Coll],
    hosts: Option<&[usize]>,
    extent: Extent,
) {
    if !common::wire_available(wire) {
        return;
    }
    let cases = cases(n, colls, &FORCED_TYPES, extent);
    let mut cfg = common::config(wire);
    cfg.algo = Selection::parse(spec).expect("algorithm spec");
    let errors = common::with_ranks_configs(
        n,
        |rank| {
            let mut c = cfg.clone();
            if let Some(h) = hosts {
                c.host_id = format!("test-host-{}", h[rank]);
            } else if matches!(wire, Wire::Net | Wire::NetVerbs) {
                c.host_id = common::rank_config(wire, rank).host_id;
            }
            c
        },
        |_, comm| {
            let mut errors = Vec::new();
            run_cases(comm, &cases, &mut errors);
            errors
        },
    );
    assert_all_right(errors);
}

/// CI runs slice `k` of a list of `of` (rank count, wire) cases; the full matrix all of each.
fn extent(full: bool, k: usize, of: usize) -> Extent {
    if full {
        Extent::Full
    } else {
        Extent::Slice { k, of }
    }
}

/// Runs `forced` for every (rank count, wire) of `list`.
fn forced_list(list: &[(usize, Wire)], spec: &str, colls: &[Coll], full: bool) {
    for (k, &(n, wire)) in list.iter().enumerate() {
        forced(n, wire, spec, colls, None, extent(full, k, list.len()));
    }
}

/// A test of CI's slice (`run(false)`) and its `#[ignore]`d full-matrix twin (`run(true)`).
macro_rules! slice_and_full {
    ($($name:ident, $full:ident => $run:expr;)*) => {$(
        #[test]
        fn $name() {
            let run: fn(bool) = $run;
            run(false)
        }

        #[test]
        #[ignore = "full matrix: scripts/full_matrix.sh"]
        fn $full() {
            let run: fn(bool) = $run;
            run(true)
        }
    )*};
}

const RING: [(usize, Wire); 6] = [
    (2, Shm),
    (3, Tcp),
    (5, Shm),
    (8, Shm),
    (4, Net),
    (2, TcpStriped),
];

slice_and_full! {
    ring_all_reduce_at_every_size, full_ring_all_reduce_at_every_size => |full| forced_list(&RING, "ring", &[Coll::AllReduce], full);
}

const RD_ALL_REDUCE: [(usize, Wire); 5] = [(2, Tcp), (3, Shm), (4, Shm), (6, Tcp), (8, Shm)];

slice_and_full! {
    recursive_doubling_all_reduce_at_every_size, full_recursive_doubling_all_reduce_at_every_size => |full| forced_list(&RD_ALL_REDUCE, "rd", &[Coll::AllReduce], full);
}

/// `rd` for all-gather and reduce-scatter: recursive doubling and halving where they are
/// implemented (power-of-two rank counts, up to `RD_ALL_GATHER_MAX_BYTES` and
/// `RD_REDUCE_SCATTER_MAX_BYTES`), the ring elsewhere.
const RD: [(usize, Wire); 4] = [(2, Tcp), (4, Shm), (8, Shm), (3, Shm)];

slice_and_full! {
    recursive_doubling_all_gather_at_every_size, full_recursive_doubling_all_gather_at_every_size => |full| forced_list(&RD, "rd", &[Coll::AllGather], full);
}

slice_and_full! {
    recursive_halving_reduce_scatter_at_every_size, full_recursive_halving_reduce_scatter_at_every_size => |full| forced_list(&RD, "rd", &[Coll::ReduceScatter], full);
}

const TREE: [(usize, Wire); 5] = [(2, Shm), (3, Tcp), (5, Shm), (8, Shm), (4, Net)];
const TREE_COLLS: [Coll; 3] = [Coll::AllReduce, Coll::Broadcast, Coll::Reduce];

slice_and_full! {
    tree_algorithms_at_every_size, full_tree_algorithms_at_every_size => |full| forced_list(&TREE, "tree", &TREE_COLLS, full);
}

/// 2 hosts x 2 ranks (interleaved), uneven hosts (1 + 3 + 2 ranks), one rank per host.
const HIER: [(Wire, &[usize]); 3] = [
    (Wire::Shm, &[0, 1, 0, 1]),
    (Wire::Shm, &[0, 1, 1, 2, 2, 1]),
    (Wire::Tcp, &[0, 1, 2]),
];

fn hierarchical(full: bool) {
    for (k, (wire, hosts)) in HIER.into_iter().enumerate() {
        let extent = extent(full, k, HIER.len());
        forced(
            hosts.len(),
            wire,
            "hier",
            &[Coll::AllReduce],
            Some(hosts),
            extent,
        );
    }
}

slice_and_full! {
    hierarchical_all_reduce_at_every_size, full_hierarchical_all_reduce_at_every_size => |full| hierarchical(full);
}

/// The matrix's (rank count, wire) cases: CI's, each running its slice of the list (1, 2, 3 and
/// 8 ranks; every wire), then the full matrix's others.
const MATRIX: [(&str, usize, Wire); 19] = [
    ("shm_1_rank", 1, Wire::Shm),
    ("shm_2_ranks", 2, Wire::Shm),
    ("shm_3_ranks", 3, Wire::Shm),
    ("shm_8_ranks", 8, Wire::Shm),
    ("tcp_1_rank", 1, Wire::Tcp),
    ("tcp_2_ranks", 2, Wire::Tcp),
    ("tcp_3_ranks", 3, Wire::Tcp),
    ("tcp_striped_3_ranks", 3, Wire::TcpStriped),
    ("net_2_ranks", 2, Wire::Net),
    ("net_3_ranks", 3, Wire::Net),
    ("net_loopback_3_ranks", 3, Wire::NetLoopback),
    ("net_verbs_2_ranks", 2, Wire::NetVerbs),
    ("net_verbs_3_ranks", 3, Wire::NetVerbs),
    ("net_verbs_5_ranks", 5, Wire::NetVerbs),
    ("shm_4_ranks", 4, Wire::Shm),
    ("shm_5_ranks", 5, Wire::Shm),
    ("tcp_4_ranks", 4, Wire::Tcp),
    ("tcp_5_ranks", 5, Wire::Tcp),
    ("tcp_8_ranks", 8, Wire::Tcp),
];

/// How many of `MATRIX` CI runs (as slices).
const CI_MATRIX: usize = 14;

/// Runs `MATRIX`'s case `name`: CI's slice, or all of it.
fn matrix_case(name: &str, full: bool) {
    let k = MATRIX
        .iter()
        .position(|m| m.0 == name)
        .expect("a case of MATRIX");
    let (_, n, wire) = MATRIX[k];
    matrix(n, wire, extent(full || k >= CI_MATRIX, k, CI_MATRIX));
}

macro_rules! matrix_tests {
    ($($name:ident, $full:ident;)*) => {$(
        slice_and_full! {
            $name, $full => |full| matrix_case(stringify!($name), full);
        }
    )*};
}

matrix_tests! {
    shm_1_rank, full_shm_1_rank;
    shm_2_ranks, full_shm_2_ranks;
    shm_3_ranks, full_shm_3_ranks;
    shm_8_ranks, full_shm_8_ranks;
    tcp_1_rank, full_tcp_1_rank;
    tcp_2_ranks, full_tcp_2_ranks;
    tcp_3_ranks, full_tcp_3_ranks;
    tcp_striped_3_ranks, full_tcp_striped_3_ranks;
    net_2_ranks, full_net_2_ranks;
    net_3_ranks, full_net_3_ranks;
    net_loopback_3_ranks, full_net_loopback_3_ranks;
    net_verbs_2_ranks, full_net_verbs_2_ranks;
    net_verbs_3_ranks, full_net_verbs_3_ranks;
    net_verbs_5_ranks, full_net_verbs_5_ranks;
}

/// The full matrix's other rank counts (CI covers them by the slices' 1, 2, 3 and 8 ranks).
macro_rules! full_matrix_tests {
    ($($name:ident;)*) => {$(
        #[test]
        #[ignore = "full matrix: scripts/full_matrix.sh"]
        fn $name() {
            matrix_case(stringify!($name).trim_start_matches("full_"), true);
        }
    )*};
}

full_matrix_tests! {
    full_shm_4_ranks;
    full_shm_5_ranks;
    full_tcp_4_ranks;
    full_tcp_5_ranks;
    full_tcp_8_ranks;
}

/// The (rank count, wire) cases of a test.
type Sizes = [(usize, Wire)];

/// The dimensions of one case in a (rank count, wire) test, as labels: collective, type,
/// reduction (`-` for collectives without one), count, placement, rank count, wire.
fn labels(c: &Case, n: usize, wire: Wire) -> [String; 7] {
    let count = match c.count {
        LARGE => "large".to_string(),
        0 | 1 | 1001 => c.count.to_string(),
        x if x == 2 * n + 1 => "2n+1".to_string(),
        x if x + 1 == n => "n-1".to_string(),
        x => panic!("count {x} of no class"),
    };
    let op = if has_op(c.coll) {
        format!("{}", c.op)
    } else {
        "-".to_string()
    };
    [
        format!("{:?}", c.coll),
        TYPES[c.ty].to_string(),
        op,
        count,
        c.in_place.to_string(),
        n.to_string(),
        format!("{wire:?}"),
    ]
}

/// Every pair of dimension values that the full matrix runs on `full` (rank count, wire) cases
/// and CI on `ci`, for values CI has at all (a rank count CI leaves to the full matrix does not
/// count), except pairs of rank count and wire (the cases themselves).
fn missing_pairs(
    full: &[(usize, Wire, Vec<Case>)],
    ci: &[(usize, Wire, Vec<Case>)],
) -> Vec<String> {
    use std::collections::HashSet;
    let pairs = |set: &[(usize, Wire, Vec<Case>)]| {
        let mut pairs = HashSet::new();
        let mut values = HashSet::new();
        for (n, wire, cases) in set {
            for c in cases {
                let l = labels(c, *n, *wire);
                for a in 0..l.len() {
                    values.insert((a, l[a].clone()));
                    for b in a + 1..l.len() {
                        if (a, b) != (5, 6) {
                            pairs.insert((a, l[a].clone(), b, l[b].clone()));
                        }
                    }
                }
            }
        }
        (pairs, values)
    };
    let (full_pairs, _) = pairs(full);
    let (ci_pairs, ci_values) = pairs(ci);
    let mut missing: Vec<String> = full_pairs
        .into_iter()
        .filter(|(a, va, b, vb)| {
            ci_values.contains(&(*a, va.clone())) && ci_values.contains(&(*b, vb.clone()))
        })
        .filter(|p| !ci_pairs.contains(p))
        .map(|p| format!("{p:?}"))
        .collect();
    missing.sort();
    missing
}

/// CI's slices still meet every pair of dimensions the full matrix does: every collective, type,
/// reduction, count, placement, rank count and wire with each other.
#[test]
fn ci_slices_cover_every_pair() {
    let matrix = |full: bool, range: std::ops::Range<usize>| -> Vec<(usize, Wire, Vec<Case>)> {
        MATRIX[range]
            .iter()
            .enumerate()
            .map(|(k, &(_, n, wire))| {
                let e = extent(full, k, CI_MATRIX);
                (n, wire, cases(n, &COLLS, &MATRIX_TYPES, e))
            })
            .collect()
    };
    let mut missing = missing_pairs(&matrix(true, 0..MATRIX.len()), &matrix(false, 0..CI_MATRIX));
    let hier: Vec<(usize, Wire)> = HIER.iter().map(|(w, h)| (h.len(), *w)).collect();
    let forced: [(&Sizes, &[Coll]); 6] = [
        (&RING, &[Coll::AllReduce]),
        (&RD_ALL_REDUCE, &[Coll::AllReduce]),
        (&RD, &[Coll::AllGather]),
        (&RD, &[Coll::ReduceScatter]),
        (&TREE, &TREE_COLLS),
        (&hier, &[Coll::AllReduce]),
    ];
    for (list, colls) in forced {
        let run = |full: bool| -> Vec<(usize, Wire, Vec<Case>)> {
            list.iter()
                .enumerate()
                .map(|(k, &(n, wire))| {
                    let e = extent(full, k, list.len());
                    (n, wire, cases(n, colls, &FORCED_TYPES, e))
                })
                .collect()
        };
        missing.extend(missing_pairs(&run(true), &run(false)));
    }
    assert!(
        missing.is_empty(),
        "{} pairs of the full matrix that CI's slices miss, first ones:\n{}",
        missing.len(),
        missing[..missing.len().min(20)].join("\n")
    );
}
