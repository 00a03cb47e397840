//! Test support shared by weftcc's crates: deterministic pseudo-random data (xorshift64 bytes,
//! a SplitMix64 generator), value comparison, and deterministic mode's reference result. Not
//! part of the API.

/// SplitMix64: the same sequence for a seed on every machine, so ranks can make the same random
/// choices without talking.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

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

/// PreMulSum's scalar of rank `r` in the tests (it differs between ranks, as NCCL allows).
pub fn premul_factor(r: usize) -> f64 {
    (r + 1) as f64
}

/// `op` as rank `r` passes it: a PreMulSum with [`premul_factor`]`(r)`, any other unchanged.
pub fn op_of_rank(op: crate::ReduceOp, r: usize) -> crate::ReduceOp {
    match op {
        crate::ReduceOp::PreMulSum(_) => crate::ReduceOp::PreMulSum(premul_factor(r)),
        other => other,
    }
}

/// Every reduction, PreMulSum with rank `r`'s factor ([`premul_factor`]).
pub fn every_op(r: usize) -> Vec<crate::ReduceOp> {
    use crate::ReduceOp::*;
    vec![Sum, Prod, Min, Max, Avg, PreMulSum(premul_factor(r))]
}

/// The collectives that move data: every kind but send/recv and barrier.
pub fn data_collectives() -> Vec<crate::OpKind> {
    crate::OpKind::ALL
        .into_iter()
        .filter(|k| !matches!(k, crate::OpKind::SendRecv | crate::OpKind::Barrier))
        .collect()
}

/// What rank `me`'s receive buffer holds after `call` on `n` ranks whose inputs are their
/// [`small_input`]s and whose PreMulSum factors are their [`premul_factor`]s (`None`: the call
/// leaves it untouched, as a reduce off the root).
pub fn expected_recv(call: &crate::RawOp, n: usize, me: usize) -> Option<Vec<u8>> {
    use crate::OpKind::*;
    let (t, op, count) = (call.dtype, call.op, call.count);
    let block = count * t.size();
    let factors: Vec<f64> = (0..n).map(premul_factor).collect();
    let each =
        |len: usize| -> Vec<Vec<u8>> { (0..n).map(|r| small_input(t, op, r, len)).collect() };
    let mine = |v: Vec<u8>| v[me * block..(me + 1) * block].to_vec();
    match call.kind {
        AllReduce => Some(rank_order_fold(t, op, &each(count), &factors)),
        Reduce => (me == call.root).then(|| rank_order_fold(t, op, &each(count), &factors)),
        Broadcast => Some(small_input(t, op, call.root, count)),
        AllGather => Some(each(count).concat()),
        ReduceScatter => Some(mine(rank_order_fold(t, op, &each(count * n), &factors))),
        AllToAll => Some(each(count * n).into_iter().flat_map(mine).collect()),
        SendRecv | Barrier => None,
    }
}

/// Elements of the send and the receive buffer a test gives every rank for a call of `count`
/// on `nranks` ranks (the root's sizes on every rank: off the root, a broadcast reads no send
/// buffer and a reduce writes no receive buffer). Written apart from `RawOp::plan`, which the
/// tests check.
pub fn buffer_counts(kind: crate::OpKind, count: usize, nranks: usize) -> (usize, usize) {
    use crate::OpKind::*;
    match kind {
        AllGather => (count, count * nranks),
        ReduceScatter => (count * nranks, count),
        AllToAll => (count * nranks, count * nranks),
        Barrier => (0, 0),
        AllReduce | Reduce | Broadcast | SendRecv => (count, count),
    }
}

/// One element of `dtype` holding `v` (converted as [`crate::Element::from_f64`] does), as bytes.
pub fn to_bytes(dtype: crate::DataType, v: f64) -> Vec<u8> {
    crate::with_element!(dtype, |T| bytemuck::bytes_of(
        &<T as crate::Element>::from_f64(v)
    )
    .to_vec())
}

/// Rank `r`'s element `i` for a reduction `op`: small integers, so that every order of
/// reduction over up to 9 ranks is exact in every type (sums ≤ 9 × 4, products ≤ 3^9; 8-bit
/// integers wrap the same way in any order).
pub fn small_value(op: crate::ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        crate::ReduceOp::Prod => ((r * 5 + i) % 3 + 1) as f64,
        _ => ((r * 3 + i * 7) % 5) as f64,
    }
}

/// Rank `r`'s `len` input elements of `dtype` for `op` ([`small_value`]), as bytes.
pub fn small_input(dtype: crate::DataType, op: crate::ReduceOp, r: usize, len: usize) -> Vec<u8> {
    (0..len)
        .flat_map(|i| to_bytes(dtype, small_value(op, r, i)))
        .collect()
}

/// Rank `r`'s element `i` where the order of a sum matters: signs and magnitudes from 1e-3 to
/// 1e6 (deterministic reductions are checked on these).
pub fn order_sensitive_value(r: usize, i: usize) -> f64 {
    let m = ((r * 7919 + i * 104_729) % 1000 + 1) as f64;
    let e = ((r * 3 + i) % 7) as i32 - 3;
    let sign = if (r + i).is_multiple_of(3) { -1.0 } else { 1.0 };
    sign * m * 10f64.powi(e)
}
