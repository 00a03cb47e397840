//! Test support shared by weftcc's crates: deterministic pseudo-random data (xorshift64), value
//! comparison, and deterministic mode's reference result. Not part of the API.

/// `len` bytes from `seed`: the same seed gives the same bytes on every machine.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// Whether two elements of `dtype` hold the same value as a kernel test compares them: equal
/// bits, or for floats both NaN (any payload) or both zero (either sign).
pub fn same_value(dtype: crate::DataType, a: &[u8], b: &[u8]) -> bool {
    if a == b {
        return true;
    }
    let value = |x: &[u8]| dtype.decode_f64(x).unwrap_or(f64::NAN);
    dtype.is_float() && {
        let (x, y) = (value(a), value(b));
        (x.is_nan() && y.is_nan()) || (x == 0.0 && y == 0.0)
    }
}

/// Deterministic mode's result on the CPU: `inputs` (one per rank, raw elements of `dtype`)
/// folded in rank order, `v = x[n-1] ⊕ (… ⊕ (x[1] ⊕ x[0]))` with each rank's value on the left
/// as the schedules' `RecvReduce` combines it; PreMulSum scales rank r's input by `factors[r]`
/// first and Avg divides by the number of ranks last.
pub fn rank_order_fold(
    dtype: crate::DataType,
    op: crate::ReduceOp,
    inputs: &[Vec<u8>],
    factors: &[f64],
) -> Vec<u8> {
    use crate::{reduce, ReduceOp};
    let scaled = |r: usize| match op {
        ReduceOp::PreMulSum(_) => {
            let mut y = vec![0u8; inputs[r].len()];
            let f = factors.get(r).copied().unwrap_or(1.0);
            reduce::scale_into(dtype, &mut y, &inputs[r], f).expect("whole elements");
            y
        }
        _ => inputs[r].clone(),
    };
    if inputs.is_empty() {
        return Vec::new();
    }
    let mut acc = scaled(0);
    for r in 1..inputs.len() {
        let mut next = vec![0u8; acc.len()];
        reduce::reduce_into(dtype, op.combiner(), &mut next, &scaled(r), &acc)
            .expect("equal lengths");
        acc = next;
    }
    if op == ReduceOp::Avg {
        reduce::divide_in_place(dtype, &mut acc, inputs.len()).expect("ranks");
    }
    acc
}
