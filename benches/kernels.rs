//! Reduction kernel throughput per data type (`dst = a ⊕ b` and `dst ⊕= src`), next to the
//! baselines measured in the same run: a plain `a += b` loop on `f32` (what the compiler makes of
//! the simplest reduction; issue target: every kernel ≥ 80 % of it) and `memcpy`.
//!
//! Two sizes: 1 MiB (operands in cache: the kernels' arithmetic rate) and 64 MiB (memory bound:
//! what large collectives see). Throughput is counted in bytes of one operand.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;
use weftcc::collectives::reduce::{reduce_in_place, reduce_into};
use weftcc::{Combiner, DataType};

fn plain_add(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

fn kernels_at(c: &mut Criterion, label: &str, bytes: usize) {
    let a = vec![1u8; bytes];
    let b = vec![2u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut fa = vec![1.0f32; bytes / 4];
    let fb = vec![2.0f32; bytes / 4];
    let mut g = c.benchmark_group(format!("reduce_{label}"));
    g.throughput(Throughput::Bytes(bytes as u64));
    if bytes > 8 << 20 {
        g.sample_size(10).measurement_time(Duration::from_secs(3));
    }
    g.bench_function("baseline a+=b f32", |bench| {
        bench.iter(|| plain_add(black_box(&mut fa), black_box(&fb)))
    });
    g.bench_function("baseline memcpy", |bench| {
        bench.iter(|| dst.copy_from_slice(black_box(&a)))
    });
    for dtype in DataType::ALL {
        g.bench_with_input(
            BenchmarkId::new("in_place_sum", dtype.name()),
            &dtype,
            |bench, &t| bench.iter(|| reduce_in_place(t, Combiner::Sum, &mut dst, black_box(&a))),
        );
        g.bench_with_input(
            BenchmarkId::new("into_sum", dtype.name()),
            &dtype,
            |bench, &t| {
                bench.iter(|| reduce_into(t, Combiner::Sum, &mut dst, black_box(&a), black_box(&b)))
            },
        );
    }
    for comb in [Combiner::Prod, Combiner::Min, Combiner::Max] {
        for dtype in [DataType::Float32, DataType::Bfloat16, DataType::Int32] {
            g.bench_with_input(
                BenchmarkId::new(format!("in_place_{comb:?}"), dtype.name()),
                &(comb, dtype),
                |bench, &(k, t)| bench.iter(|| reduce_in_place(t, k, &mut dst, black_box(&a))),
            );
        }
    }
    g.finish();
}

fn kernels(c: &mut Criterion) {
    // As the communicator does: `WEFT_NO_AVX512` keeps f16/bf16 on the portable kernels.
    let portable = weftcc::settings::NO_AVX512
        .flag()
        .unwrap_or_else(|e| panic!("{e}"));
    weftcc::collectives::reduce::set_wide_kernels(!portable);
    kernels_at(c, "1MiB", 1 << 20);
    kernels_at(c, "64MiB", 64 << 20);
}

criterion_group!(benches, kernels);
criterion_main!(benches);
