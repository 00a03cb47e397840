//! Run-time selected AVX-512 kernels for `f16` and `bf16` reductions.
//!
//! The portable kernels in [`crate::reduce`] convert through `half`'s slice functions (`f16`,
//! one call per 8 elements) or through SSE2 (`bf16`, the baseline target): 0.07–0.33 × the
//! `a += b` rate. Here each 16-element chunk is widened, combined and narrowed in registers:
//! `vcvtph2ps`/`vcvtps2ph` for `f16`, a shift and a rounding add for `bf16`. The loops are
//! compiled for AVX-512 (x86-64-v4) and chosen at run time through `pulp`, whose dispatch
//! (feature detection, then a call into `#[target_feature]` code) is the only unsafe step and
//! lives in that crate, so this crate stays free of `unsafe`.
//!
//! Results are bit-identical to the portable kernels: the same `f32` combination
//! ([`crate::reduce`]'s `half_combine`, passed in as `f`), `vcvtps2ph` with
//! round-to-nearest-even is the instruction `half` itself uses for `f16::from_f32` (its software
//! path gives the same bits), and `bf16` narrows with the very function the portable kernel
//! uses. Tests compare both paths on special values and every tail length.

/// The half-precision formats these kernels handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    F16,
    Bf16,
}

/// Whether the AVX-512 kernels may run (where the CPU has them).
static WIDE_KERNELS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Lets the `f16`/`bf16` reductions use AVX-512 where the CPU has it (the default), or keeps
/// them on the portable kernels (the runtime sets this from `WEFT_NO_AVX512`; this crate reads
/// no environment).
pub fn set_wide_kernels(enabled: bool) {
    WIDE_KERNELS.store(enabled, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::Half;
    use crate::reduce::f32_to_bf16;
    use pulp::x86::V4;
    use std::sync::OnceLock;

    const LANES: usize = 16;

    /// The AVX-512 token, detected once per process; `None` when the CPU lacks AVX-512 or
    /// [`super::set_wide_kernels`] turned the kernels off.
    fn v4() -> Option<V4> {
        static V4_TOKEN: OnceLock<Option<V4>> = OnceLock::new();
        if !super::WIDE_KERNELS.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        *V4_TOKEN.get_or_init(V4::try_new)
    }

    #[cfg(test)]
    pub(crate) fn available() -> bool {
        v4().is_some()
    }

    // The format is a const parameter (`BF16`), not a run-time value, so that every loop is
    // compiled for one format with no branch inside.

    #[inline(always)]
    fn widen<const BF16: bool>(v4: V4, x: [u16; LANES]) -> [f32; LANES] {
        if BF16 {
            let wide = v4.avx512f._mm512_cvtepu16_epi32(bytemuck::cast(x));
            bytemuck::cast(v4.avx512f._mm512_slli_epi32::<16>(wide))
        } else {
            bytemuck::cast(v4.avx512f._mm512_cvtph_ps(bytemuck::cast(x)))
        }
    }

    #[inline(always)]
    fn narrow<const BF16: bool>(v4: V4, x: [f32; LANES]) -> [u16; LANES] {
        if BF16 {
            let mut bits = [0u32; LANES];
            for (b, &v) in bits.iter_mut().zip(&x) {
                *b = u32::from(f32_to_bf16(v));
            }
            bytemuck::cast(v4.avx512f._mm512_cvtepi32_epi16(bytemuck::cast(bits)))
        } else {
            // Immediate 0: round to nearest even, as `half::f16::from_f32`.
            bytemuck::cast(v4.avx512f._mm512_cvtps_ph::<0>(bytemuck::cast(x)))
        }
    }

    /// `d = narrow(f(widen(a), widen(b)))` for one chunk.
    #[inline(always)]
    fn chunk<const BF16: bool>(
        v4: V4,
        f: impl Fn(f32, f32) -> f32,
        a: [u16; LANES],
        b: [u16; LANES],
    ) -> [u16; LANES] {
        let (x, y) = (widen::<BF16>(v4, a), widen::<BF16>(v4, b));
        let mut r = [0f32; LANES];
        for i in 0..LANES {
            r[i] = f(x[i], y[i]);
        }
        narrow::<BF16>(v4, r)
    }

    /// The last `len % 16` elements go through a zero-padded chunk: the same instructions, so
    /// the same bits.
    #[inline(always)]
    fn padded(src: &[u16]) -> [u16; LANES] {
        let mut c = [0u16; LANES];
        c[..src.len()].copy_from_slice(src);
        c
    }

    /// `dst = f(a, b)` for the last `dst.len() < 16` elements, given padded.
    #[inline(always)]
    fn tail<const BF16: bool>(
        v4: V4,
        f: impl Fn(f32, f32) -> f32,
        dst: &mut [u16],
        a: [u16; LANES],
        b: [u16; LANES],
    ) {
        if !dst.is_empty() {
            let r = chunk::<BF16>(v4, f, a, b);
            let k = dst.len();
            dst.copy_from_slice(&r[..k]);
        }
    }

    /// The loops run inside `V4::vectorize`, which calls them from `#[target_feature]` code;
    /// `#[inline(always)]` on `call` makes them part of it (a closure would not be inlined
    /// reliably, and the intrinsics would then be calls).
    struct InPlace<'a, F, const BF16: bool> {
        v4: V4,
        f: F,
        dst: &'a mut [u16],
        src: &'a [u16],
    }

    impl<F: Fn(f32, f32) -> f32 + Copy, const BF16: bool> pulp::NullaryFnOnce for InPlace<'_, F, BF16> {
        type Output = ();

        #[inline(always)]
        fn call(self) {
            let InPlace { v4, f, dst, src } = self;
            let n = dst.len().min(src.len());
            let (dh, dt) = pulp::as_arrays_mut::<LANES, _>(&mut dst[..n]);
            let (sh, st) = pulp::as_arrays::<LANES, _>(&src[..n]);
            for (d, s) in dh.iter_mut().zip(sh) {
                *d = chunk::<BF16>(v4, f, *d, *s);
            }
            let x = padded(dt);
            tail::<BF16>(v4, f, dt, x, padded(st));
        }
    }

    struct Into<'a, F, const BF16: bool> {
        v4: V4,
        f: F,
        dst: &'a mut [u16],
        a: &'a [u16],
        b: &'a [u16],
    }

    impl<F: Fn(f32, f32) -> f32 + Copy, const BF16: bool> pulp::NullaryFnOnce for Into<'_, F, BF16> {
        type Output = ();

        #[inline(always)]
        fn call(self) {
            let Into { v4, f, dst, a, b } = self;
            let n = dst.len().min(a.len()).min(b.len());
            let (dh, dt) = pulp::as_arrays_mut::<LANES, _>(&mut dst[..n]);
            let (ah, at) = pulp::as_arrays::<LANES, _>(&a[..n]);
            let (bh, bt) = pulp::as_arrays::<LANES, _>(&b[..n]);
            for ((d, x), y) in dh.iter_mut().zip(ah).zip(bh) {
                *d = chunk::<BF16>(v4, f, *x, *y);
            }
            tail::<BF16>(v4, f, dt, padded(at), padded(bt));
        }
    }

    /// `dst[i] = f(dst[i], src[i])`; false (nothing done) without AVX-512.
    pub(crate) fn in_place(
        kind: Half,
        f: impl Fn(f32, f32) -> f32 + Copy,
        dst: &mut [u16],
        src: &[u16],
    ) -> bool {
        let Some(v4) = v4() else { return false };
        match kind {
            Half::F16 => v4.vectorize(InPlace::<_, false> { v4, f, dst, src }),
            Half::Bf16 => v4.vectorize(InPlace::<_, true> { v4, f, dst, src }),
        }
        true
    }

    /// `dst[i] = f(a[i], b[i])`; false (nothing done) without AVX-512.
    pub(crate) fn into(
        kind: Half,
        f: impl Fn(f32, f32) -> f32 + Copy,
        dst: &mut [u16],
        a: &[u16],
        b: &[u16],
    ) -> bool {
        let Some(v4) = v4() else { return false };
        match kind {
            Half::F16 => v4.vectorize(Into::<_, false> { v4, f, dst, a, b }),
            Half::Bf16 => v4.vectorize(Into::<_, true> { v4, f, dst, a, b }),
        }
        true
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    use super::Half;

    #[cfg(test)]
    pub(crate) fn available() -> bool {
        false
    }

    pub(crate) fn in_place(
        _: Half,
        _: impl Fn(f32, f32) -> f32 + Copy,
        _: &mut [u16],
        _: &[u16],
    ) -> bool {
        false
    }

    pub(crate) fn into(
        _: Half,
        _: impl Fn(f32, f32) -> f32 + Copy,
        _: &mut [u16],
        _: &[u16],
        _: &[u16],
    ) -> bool {
        false
    }
}

#[cfg(test)]
pub(crate) use imp::available;
pub(crate) use imp::{in_place, into};
