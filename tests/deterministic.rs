//! Deterministic reductions over real transports (`CommConfig::deterministic`, as
//! `WEFT_DETERMINISTIC=1` sets it): ranks as threads of this process over shared memory, TCP
//! and the network provider path (libfabric's tcp provider, every rank a host), on one "host"
//! and spread over several (`host_id` per rank), with every `WEFT_ALGO` value and three slice
//! sizes. Every floating-point all-reduce, reduce and reduce-scatter must come out
//! with the same bits in every configuration, equal to the rank-order fold computed here; with
//! the mode off the same data gives different bits under different algorithms (so the check
//! can fail). The same fold in the simulator, across ranks, counts and interleavings:
//! `collectives/tests/schedules.rs` (`ordered_reductions_are_the_rank_order_fold`).

mod common;

use common::Wire;
use weftcc::collectives::testing::{
    buffer_counts, order_sensitive_value, rank_order_fold, to_bytes,
};
use weftcc::collectives::{DataType, OpKind, RawOp, ReduceOp};
use weftcc::comm::run_ranks;
use weftcc::{CommConfig, Selection};

fn input(t: DataType, r: usize, elems: usize) -> Vec<u8> {
    (0..elems)
        .flat_map(|i| to_bytes(t, order_sensitive_value(r, i)))
        .collect()
}

fn factor(r: usize) -> f64 {
    0.5 + r as f64 * 0.25
}

fn op_of(op: ReduceOp, r: usize) -> ReduceOp {
    match op {
        ReduceOp::PreMulSum(_) => ReduceOp::PreMulSum(factor(r)),
        other => other,
    }
}

/// The canonical order (`weftcc_collectives::testing::rank_order_fold`) of every rank's input.
fn canonical(t: DataType, op: ReduceOp, n: usize, elems: usize) -> Vec<u8> {
    let inputs: Vec<Vec<u8>> = (0..n).map(|r| input(t, r, elems)).collect();
    let factors: Vec<f64> = (0..n).map(factor).collect();
    rank_order_fold(t, op, &inputs, &factors)
}

/// One job's settings.
#[derive(Debug, Clone)]
struct Setup {
    tcp: bool,
    /// Every rank a host of its own over the network provider path (libfabric's tcp provider).
    net: bool,
    /// Ranks per host (ranks dealt over the hosts in turn); `n` = one host.
    per_host: usize,
    algo: Option<&'static str>,
    slice_bytes: Option<usize>,
    deterministic: bool,
}

/// Rank r's result of `kind` (reduce: root 1) for every type and reduction, in order.
fn run(n: usize, s: &Setup, kind: OpKind, count: usize) -> Vec<Vec<Vec<u8>>> {
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(1.0),
    ];
    let types = [
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float16,
    ];
    let hosts = n.div_ceil(s.per_host.max(1));
    run_ranks(
        n,
        |r| {
            let mut c = if s.net {
                common::rank_config(Wire::Net, r)
            } else {
                let mut c = CommConfig::from_env().expect("config");
                c.shm_disable = s.tcp;
                c.host_id = format!("det-host-{}", r % hosts);
                c
            };
            c.deterministic = s.deterministic;
            c.timeout = std::time::Duration::from_secs(60);
            if let Some(a) = s.algo {
                c.algo = Selection::parse(a).expect("algorithm");
            }
            if let Some(b) = s.slice_bytes {
                c.slice_bytes = b;
            }
            c
        },
        |r, comm| {
            let mut out = Vec::new();
            for t in types {
                for op in ops {
                    let call = RawOp::new(kind, t, count)
                        .with_op(op_of(op, r))
                        .with_root(1);
                    let (send_elems, recv_elems) = buffer_counts(kind, count, n);
                    let send = input(t, r, send_elems);
                    let mut recv = vec![0u8; recv_elems * t.size()];
                    comm.execute_raw(call, Some(&send), &mut recv)
                        .unwrap_or_else(|e| panic!("rank {r}: {kind} {t} {op:?} {s:?}: {e}"));
                    out.push(recv);
                }
            }
            out
        },
    )
    .expect("job")
}

/// What rank `r` must hold: the canonical fold (reduce: root 1 only, reduce-scatter: block r).
fn expected(n: usize, r: usize, kind: OpKind, count: usize) -> Vec<Option<Vec<u8>>> {
    let mut out = Vec::new();
    for t in [
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float16,
    ] {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Avg,
            ReduceOp::PreMulSum(1.0),
        ] {
            let es = t.size();
            out.push(match kind {
                OpKind::Reduce if r != 1 => None,
                OpKind::ReduceScatter => Some(
                    canonical(t, op, n, count * n)[r * count * es..(r + 1) * count * es].to_vec(),
                ),
                _ => Some(canonical(t, op, n, count)),
            });
        }
    }
    out
}

fn setups(deterministic: bool) -> Vec<Setup> {
    let s = |tcp, per_host, algo, slice_bytes| Setup {
        tcp,
        net: false,
        per_host,
        algo,
        slice_bytes,
        deterministic,
    };
    vec![
        s(false, 8, None, None),
        s(false, 8, Some("ring"), Some(4096)),
        s(false, 8, Some("tree"), None),
        s(true, 8, Some("rd"), Some(4096)),
        s(true, 2, Some("hier"), None),
        s(false, 1, Some("ring"), None),
        s(false, 2, None, Some(512)),
        Setup {
            net: true,
            ..s(false, 1, Some("tree"), Some(4096))
        },
    ]
}

#[test]
fn deterministic_reductions_have_the_same_bits_everywhere() {
    for n in [3usize, 5] {
        for kind in [OpKind::AllReduce, OpKind::Reduce, OpKind::ReduceScatter] {
            let count = 1031;
            for s in setups(true) {
                if s.net && !common::net_available() {
                    continue;
                }
                let got = run(n, &s, kind, count);
                for (r, results) in got.iter().enumerate() {
                    for (k, (g, want)) in
                        results.iter().zip(expected(n, r, kind, count)).enumerate()
                    {
                        if let Some(w) = want {
                            assert!(
                                *g == w,
                                "{n} ranks, {kind}, case {k}, rank {r}, {s:?}: not the rank-order fold"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The same data with the mode off: ring, tree and recursive doubling all-reduces disagree in
/// some bit (so the test above would catch an algorithm that slipped through).
#[test]
fn without_the_mode_the_algorithm_changes_the_bits() {
    let n = 5;
    let count = 1031;
    let results: Vec<Vec<Vec<Vec<u8>>>> = ["ring", "tree", "rd"]
        .into_iter()
        .map(|a| {
            let s = Setup {
                tcp: false,
                net: false,
                per_host: 8,
                algo: Some(a),
                slice_bytes: None,
                deterministic: false,
            };
            run(n, &s, OpKind::AllReduce, count)
        })
        .collect();
    assert!(
        results[0] != results[1] || results[0] != results[2],
        "ring, tree and rd gave identical bits: the data cannot tell orders apart"
    );
}

/// A repeated call reuses the last schedule when the shape matches: an integer all-reduce of
/// the same element size and count must not hand its (tuner's) schedule to the float one that
/// follows, nor the other way round.
#[test]
fn integer_calls_between_float_ones_do_not_lose_the_order() {
    let n = 3;
    let count = 1031;
    let results = run_ranks(
        n,
        |_| {
            let mut c = CommConfig::from_env().expect("config");
            c.deterministic = true;
            c.timeout = std::time::Duration::from_secs(60);
            c
        },
        |r, comm| {
            let mut got = Vec::new();
            for (int, float) in [
                (DataType::Int32, DataType::Float32),
                (DataType::Int64, DataType::Float64),
            ] {
                for t in [int, float, int, float] {
                    let call = RawOp::new(OpKind::AllReduce, t, count).with_op(ReduceOp::Sum);
                    let send = match t {
                        DataType::Int32 | DataType::Int64 => vec![1u8; count * t.size()],
                        _ => input(t, r, count),
                    };
                    let mut recv = vec![0u8; count * t.size()];
                    comm.execute_raw(call, Some(&send), &mut recv)
                        .expect("all-reduce");
                    if t == float {
                        got.push((t, recv));
                    }
                }
            }
            got
        },
    )
    .expect("job");
    for (r, calls) in results.iter().enumerate() {
        for (t, got) in calls {
            assert!(
                *got == canonical(*t, ReduceOp::Sum, n, count),
                "rank {r}: {t} after an integer call is not the rank-order fold"
            );
        }
    }
}
