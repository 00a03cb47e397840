//! Reduction kernel throughput per data type (`dst = a ⊕ b` and `dst ⊕= src`), next to a plain
//! memcpy of the same bytes as the baseline measured in the same run.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use weftcc::reduce::{reduce_in_place, reduce_into};
use weftcc::{Combiner, DataType};

const BYTES: usize = 1 << 20;

fn kernels(c: &mut Criterion) {
    let a = vec![1u8; BYTES];
    let b = vec![2u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let mut g = c.benchmark_group("reduce");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.bench_function("memcpy (baseline)", |bench| {
        bench.iter(|| dst.copy_from_slice(black_box(&a)))
    });
    for dtype in DataType::ALL {
        g.bench_with_input(
            BenchmarkId::new("into_sum", dtype.name()),
            &dtype,
            |bench, &t| {
                bench.iter(|| reduce_into(t, Combiner::Sum, &mut dst, black_box(&a), black_box(&b)))
            },
        );
        g.bench_with_input(
            BenchmarkId::new("in_place_sum", dtype.name()),
            &dtype,
            |bench, &t| bench.iter(|| reduce_in_place(t, Combiner::Sum, &mut dst, black_box(&a))),
        );
    }
    for comb in [Combiner::Prod, Combiner::Min, Combiner::Max] {
        g.bench_with_input(
            BenchmarkId::new("into_float", format!("{comb:?}")),
            &comb,
            |bench, &k| {
                bench.iter(|| {
                    reduce_into(DataType::Float32, k, &mut dst, black_box(&a), black_box(&b))
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
