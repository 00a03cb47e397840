//! Correctness matrix: every collective × data type × reduction × rank count × element count ×
//! in-place/out-of-place × transport, checked against an independent reference computed here
//! from the input formula (never with the library's own kernels).
//!
//! Inputs are small integers chosen so that sums, products, minima and maxima are exact in every
//! type (|sum| ≤ 88, |product| ≤ 256): integer and float results must then match exactly. Only
//! `Avg` (a division) and `PreMulSum` with a non-integral result can round; there the tolerance is
//! two units in the last place of the type (the library rounds the exact sum once to the type,
//! then divides in f32 or f64 and rounds again).

mod common;

use common::{with_ranks, Wire};
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

/// The small counts every case runs (the large one is added in `run_colls`).
fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, 2 * n + 1, 1001];
    if n > 2 {
        c.push(n - 1);
    }
    c
}

fn run_type<T: Val>(comm: &Communicator, large: bool, errors: &mut Vec<String>) {
    run_colls::<T>(comm, &COLLS, large, errors)
}

fn run_colls<T: Val>(comm: &Communicator, colls: &[Coll], large: bool, errors: &mut Vec<String>) {
    let n = comm.size();
    for &c in colls {
        let ops: &[ReduceOp] = if has_op(c) { &OPS } else { &[ReduceOp::Sum] };
        for &op in ops {
            for count in counts(n) {
                for in_place in [false, true] {
                    errors.extend(run_case::<T>(comm, c, op, count, in_place));
                }
            }
        }
        // Millions of elements (the pipelined path): every collective and placement with Sum,
        // and with every reduction where `large` asks for it.
        let large_ops: &[ReduceOp] = if large && has_op(c) {
            &OPS
        } else {
            &[ReduceOp::Sum]
        };
        for &op in large_ops {
            for in_place in [false, true] {
                errors.extend(run_case::<T>(comm, c, op, (4 << 20) + 3, in_place));
            }
        }
    }
}

fn matrix(n: usize, wire: Wire) {
    if wire == Wire::Net && !common::net_available() {
        return;
    }
    // Every type, reduction and count (small ones and 4 Mi + 3 elements) for every collective;
    // at the large count every reduction for i8 and f32 (element sizes 1 and 4) and Sum for the
    // other types (the pipelined path depends on the element size, not on the reduction).
    let errors = with_ranks(n, wire, |rank, comm| {
        let mut errors = Vec::new();
        if matches!(wire, Wire::Net | Wire::NetLoopback) && n > 1 {
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
        run_type::<i8>(comm, true, &mut errors);
        run_type::<u8>(comm, false, &mut errors);
        run_type::<i32>(comm, false, &mut errors);
        run_type::<u32>(comm, false, &mut errors);
        run_type::<i64>(comm, false, &mut errors);
        run_type::<u64>(comm, false, &mut errors);
        run_type::<f16>(comm, false, &mut errors);
        run_type::<f32>(comm, true, &mut errors);
        run_type::<f64>(comm, false, &mut errors);
        run_type::<bf16>(comm, false, &mut errors);
        errors
    });
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

/// The collectives `WEFT_ALGO=spec` affects, run with that choice forced (so every algorithm
/// is covered at every size, not only where the tuner would pick it). `hosts` gives each rank's
/// host: ranks of one host use `wire`, ranks of different hosts TCP.
fn forced(n: usize, wire: Wire, spec: &str, colls: &[Coll], hosts: Option<&[usize]>) {
    if wire == Wire::Net && !common::net_available() {
        return;
    }
    let mut cfg = common::config(wire);
    cfg.algo = Selection::parse(spec).expect("algorithm spec");
    let errors = common::with_ranks_configs(
        n,
        |rank| {
            let mut c = cfg.clone();
            if let Some(h) = hosts {
                c.host_id = format!("test-host-{}", h[rank]);
            } else if wire == Wire::Net {
                c.host_id = common::rank_config(wire, rank).host_id;
            }
            c
        },
        |_, comm| {
            let mut errors = Vec::new();
            run_colls::<i8>(comm, colls, false, &mut errors);
            run_colls::<u32>(comm, colls, false, &mut errors);
            run_colls::<i64>(comm, colls, false, &mut errors);
            run_colls::<f16>(comm, colls, false, &mut errors);
            run_colls::<f32>(comm, colls, true, &mut errors);
            run_colls::<bf16>(comm, colls, false, &mut errors);
            run_colls::<f64>(comm, colls, false, &mut errors);
            errors
        },
    );
    assert_all_right(errors);
}

#[test]
fn ring_all_reduce_at_every_size() {
    for (n, wire) in [
        (2, Wire::Shm),
        (3, Wire::Tcp),
        (5, Wire::Shm),
        (8, Wire::Shm),
        (4, Wire::Net),
        (2, Wire::TcpStriped),
    ] {
        forced(n, wire, "ring", &[Coll::AllReduce], None);
    }
}

#[test]
fn recursive_doubling_all_reduce_at_every_size() {
    for (n, wire) in [
        (2, Wire::Tcp),
        (3, Wire::Shm),
        (4, Wire::Shm),
        (6, Wire::Tcp),
        (8, Wire::Shm),
    ] {
        forced(n, wire, "rd", &[Coll::AllReduce], None);
    }
}

/// `rd` for all-gather: recursive doubling where it is implemented (power-of-two rank counts, up
/// to `RD_ALL_GATHER_MAX_BYTES`), the ring elsewhere.
#[test]
fn recursive_doubling_all_gather_at_every_size() {
    for (n, wire) in [
        (2, Wire::Tcp),
        (4, Wire::Shm),
        (8, Wire::Shm),
        (3, Wire::Shm),
    ] {
        forced(n, wire, "rd", &[Coll::AllGather], None);
    }
}

/// `rd` for reduce-scatter: recursive halving where it is implemented (power-of-two rank
/// counts, up to `RD_REDUCE_SCATTER_MAX_BYTES`), the ring elsewhere.
#[test]
fn recursive_halving_reduce_scatter_at_every_size() {
    for (n, wire) in [
        (2, Wire::Tcp),
        (4, Wire::Shm),
        (8, Wire::Shm),
        (3, Wire::Shm),
    ] {
        forced(n, wire, "rd", &[Coll::ReduceScatter], None);
    }
}

#[test]
fn tree_algorithms_at_every_size() {
    let colls = [Coll::AllReduce, Coll::Broadcast, Coll::Reduce];
    for (n, wire) in [
        (2, Wire::Shm),
        (3, Wire::Tcp),
        (5, Wire::Shm),
        (8, Wire::Shm),
        (4, Wire::Net),
    ] {
        forced(n, wire, "tree", &colls, None);
    }
}

#[test]
fn hierarchical_all_reduce_at_every_size() {
    // 2 hosts x 2 ranks (interleaved), uneven hosts (1 + 3 + 2 ranks), one rank per host.
    let cases: [(Wire, &[usize]); 3] = [
        (Wire::Shm, &[0, 1, 0, 1]),
        (Wire::Shm, &[0, 1, 1, 2, 2, 1]),
        (Wire::Tcp, &[0, 1, 2]),
    ];
    for (wire, hosts) in cases {
        forced(hosts.len(), wire, "hier", &[Coll::AllReduce], Some(hosts));
    }
}

macro_rules! matrix_tests {
    ($($name:ident: $n:expr, $wire:expr;)*) => {$(
        #[test]
        fn $name() {
            matrix($n, $wire);
        }
    )*};
}

matrix_tests! {
    shm_1_rank: 1, Wire::Shm;
    shm_2_ranks: 2, Wire::Shm;
    shm_3_ranks: 3, Wire::Shm;
    shm_4_ranks: 4, Wire::Shm;
    shm_5_ranks: 5, Wire::Shm;
    shm_8_ranks: 8, Wire::Shm;
    tcp_1_rank: 1, Wire::Tcp;
    tcp_2_ranks: 2, Wire::Tcp;
    tcp_3_ranks: 3, Wire::Tcp;
    tcp_4_ranks: 4, Wire::Tcp;
    tcp_5_ranks: 5, Wire::Tcp;
    tcp_8_ranks: 8, Wire::Tcp;
    tcp_striped_3_ranks: 3, Wire::TcpStriped;
    net_2_ranks: 2, Wire::Net;
    net_3_ranks: 3, Wire::Net;
    net_loopback_3_ranks: 3, Wire::NetLoopback;
}
