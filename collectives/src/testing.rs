//! Deterministic pseudo-random data (xorshift64) for the tests and benchmarks of weftcc's crates.
//! Not part of the API.

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
