//! Reduction kernels: the element-wise arithmetic of reduce steps, `PreMulSum`'s local scaling
//! and `Avg`'s final division.
//!
//! The byte kernels ([`reduce_into`], [`reduce_in_place`], [`scale_into`], [`divide_in_place`])
//! take raw message bytes plus a [`DataType`]; the typed kernels ([`reduce_slice_into`],
//! [`reduce_slice_in_place`]) take slices of an [`Element`] type and use the same code.
//!
//! Semantics:
//! * integers: `Sum` and `Prod` wrap, `Min` and `Max` are exact;
//! * `f32` and `f64`: native IEEE arithmetic, `Min`/`Max` follow [`f32::min`]/[`f32::max`] (a NaN
//!   operand yields the other operand);
//! * `f16` and `bf16`: each operation is computed in `f32` and rounded back to nearest-even,
//!   giving the bits the `half` crate's scalar conversions give (`to_f32`, `from_f32`); `Min`/
//!   `Max` follow `f32`'s; when both operands are NaN the result is the first one's, quieted.
//!   On CPUs with AVX-512 both go through the private module `half_simd` (16 elements widened,
//!   combined and narrowed in registers, chosen at run time); elsewhere `f16` converts through
//!   `half`'s slice conversions (F16C where the CPU has it), `bf16` through branch-free
//!   conversions here that the compiler vectorises with SSE2. Both paths give the same bits.
//!
//! Byte slices are normally aligned for their type (message starts are 8-byte aligned), in which
//! case they are reinterpreted in place and processed by simple loops the compiler vectorises.
//! Misaligned slices are staged through small aligned blocks and processed by the very same
//! loops, so both paths give bit-identical results.

use crate::dtype::{DataType, Element};
pub use crate::half_simd::set_wide_kernels;
use crate::half_simd::{self, Half};
use crate::op::Combiner;
use crate::with_element;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Why a kernel refused its arguments. Lengths are in bytes for the byte kernels and in elements
/// for the typed kernels.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The destination and the two operands of [`reduce_into`] differ in length.
    #[error("operand lengths differ: destination {dst}, operands {a} and {b}")]
    LengthMismatch { dst: usize, a: usize, b: usize },
    /// The destination and the source of a two-operand kernel differ in length.
    #[error("operand lengths differ: destination {dst}, source {src}")]
    SourceLengthMismatch { dst: usize, src: usize },
    /// A byte slice does not hold a whole number of elements.
    #[error("{len} bytes is not a whole number of {elem}-byte elements")]
    NotWholeElements { len: usize, elem: usize },
    /// [`divide_in_place`] was asked to divide by zero.
    #[error("division by zero")]
    DivideByZero,
}

/// Elements per staging block: the misaligned path and the `f16` conversions work on
/// blocks of this many elements held on the stack.
const BLOCK: usize = 256;

/// `dst = a ⊕ b` element-wise. All three byte slices must hold the same number of whole
/// elements of `dtype`.
#[inline]
pub fn reduce_into(
    dtype: DataType,
    comb: Combiner,
    dst: &mut [u8],
    a: &[u8],
    b: &[u8],
) -> Result<(), KernelError> {
    same_lens(dst.len(), a.len(), b.len())?;
    whole_elements(dtype, dst.len())?;
    with_element!(dtype, |T| bytes_reduce_into::<T>(comb, dst, a, b));
    Ok(())
}

/// `dst = dst ⊕ src` element-wise. Both byte slices must hold the same number of whole elements
/// of `dtype`.
#[inline]
pub fn reduce_in_place(
    dtype: DataType,
    comb: Combiner,
    dst: &mut [u8],
    src: &[u8],
) -> Result<(), KernelError> {
    same_len(dst.len(), src.len())?;
    whole_elements(dtype, dst.len())?;
    with_element!(dtype, |T| bytes_reduce_in_place::<T>(comb, dst, src));
    Ok(())
}

/// `dst = src * factor` element-wise (the local scaling of `PreMulSum`).
///
/// Integers are multiplied in `f64`, rounded to nearest (ties to even) and cast back saturating
/// (NaN becomes 0). `f64` computes in `f64`; `f32`, `f16` and `bf16` compute in `f32` with the
/// factor rounded to `f32`.
pub fn scale_into(
    dtype: DataType,
    dst: &mut [u8],
    src: &[u8],
    factor: f64,
) -> Result<(), KernelError> {
    same_len(dst.len(), src.len())?;
    whole_elements(dtype, dst.len())?;
    with_element!(dtype, |T| bytes_scale_into::<T>(dst, src, factor));
    Ok(())
}

/// `buf = buf / divisor` element-wise (the final step of `Avg`).
///
/// Integers use integer division truncating toward zero, as C does; floating-point types divide
/// (`f64` in `f64`, the others in `f32`). A zero divisor is an error.
pub fn divide_in_place(dtype: DataType, buf: &mut [u8], divisor: usize) -> Result<(), KernelError> {
    if divisor == 0 {
        return Err(KernelError::DivideByZero);
    }
    whole_elements(dtype, buf.len())?;
    with_element!(dtype, |T| bytes_divide::<T>(buf, divisor));
    Ok(())
}

/// `dst = a ⊕ b` element-wise on typed slices of equal length (lengths in the error are in
/// elements).
pub fn reduce_slice_into<T: Element>(
    comb: Combiner,
    dst: &mut [T],
    a: &[T],
    b: &[T],
) -> Result<(), KernelError> {
    same_lens(dst.len(), a.len(), b.len())?;
    let (dst, a, b) = (bytes_mut_of(dst)?, bytes_of(a)?, bytes_of(b)?);
    reduce_into(T::DTYPE, comb, dst, a, b)
}

/// `dst = dst ⊕ src` element-wise on typed slices of equal length (lengths in the error are in
/// elements).
pub fn reduce_slice_in_place<T: Element>(
    comb: Combiner,
    dst: &mut [T],
    src: &[T],
) -> Result<(), KernelError> {
    same_len(dst.len(), src.len())?;
    let (dst, src) = (bytes_mut_of(dst)?, bytes_of(src)?);
    reduce_in_place(T::DTYPE, comb, dst, src)
}

fn same_lens(dst: usize, a: usize, b: usize) -> Result<(), KernelError> {
    if dst == a && dst == b {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { dst, a, b })
    }
}

fn same_len(dst: usize, src: usize) -> Result<(), KernelError> {
    if dst == src {
        Ok(())
    } else {
        Err(KernelError::SourceLengthMismatch { dst, src })
    }
}

fn whole_elements(dtype: DataType, len: usize) -> Result<(), KernelError> {
    let elem = dtype.size();
    if len.is_multiple_of(elem) {
        Ok(())
    } else {
        Err(KernelError::NotWholeElements { len, elem })
    }
}

/// Views typed elements as bytes (cannot fail: bytes have size and alignment 1).
fn bytes_of<T: Element>(s: &[T]) -> Result<&[u8], KernelError> {
    bytemuck::try_cast_slice(s).map_err(|_| KernelError::NotWholeElements {
        len: s.len(),
        elem: T::DTYPE.size(),
    })
}

/// Views typed elements as mutable bytes (cannot fail: bytes have size and alignment 1).
fn bytes_mut_of<T: Element>(s: &mut [T]) -> Result<&mut [u8], KernelError> {
    let len = s.len();
    bytemuck::try_cast_slice_mut(s).map_err(|_| KernelError::NotWholeElements {
        len,
        elem: T::DTYPE.size(),
    })
}

// ---------------------------------------------------------------------------------------------
// Byte-level dispatch: aligned fast path, staged misaligned path.

/// Copies up to [`BLOCK`] elements' worth of bytes into an aligned stack block and returns the
/// filled typed prefix. `bytes.len()` must be a multiple of the element size and at most
/// `BLOCK` elements.
fn stage<'s, T: Lanes>(block: &'s mut [T; BLOCK], bytes: &[u8]) -> &'s mut [T] {
    let n = bytes.len() / std::mem::size_of::<T>();
    let (head, _) = block.split_at_mut(n.min(BLOCK));
    for (slot, chunk) in head
        .iter_mut()
        .zip(bytes.chunks_exact(std::mem::size_of::<T>()))
    {
        *slot = bytemuck::pod_read_unaligned(chunk);
    }
    head
}

/// Writes typed elements back to (possibly misaligned) bytes.
fn unstage<T: Lanes>(bytes: &mut [u8], elems: &[T]) {
    for (chunk, e) in bytes
        .chunks_exact_mut(std::mem::size_of::<T>())
        .zip(elems.iter())
    {
        chunk.copy_from_slice(bytemuck::bytes_of(e));
    }
}

fn bytes_reduce_into<T: Lanes>(comb: Combiner, dst: &mut [u8], a: &[u8], b: &[u8]) {
    if let (Ok(d), Ok(x), Ok(y)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(a),
        bytemuck::try_cast_slice::<u8, T>(b),
    ) {
        T::reduce_into(comb, d, x, y);
        return;
    }
    let step = BLOCK * std::mem::size_of::<T>();
    let mut sa = [T::zeroed(); BLOCK];
    let mut sb = [T::zeroed(); BLOCK];
    for ((d, x), y) in dst.chunks_mut(step).zip(a.chunks(step)).zip(b.chunks(step)) {
        let x = stage(&mut sa, x);
        let y = stage(&mut sb, y);
        T::reduce_in_place(comb, x, y);
        unstage(d, x);
    }
}

fn bytes_reduce_in_place<T: Lanes>(comb: Combiner, dst: &mut [u8], src: &[u8]) {
    bytes_pair::<T>(dst, src, |d, s| T::reduce_in_place(comb, d, s));
}

fn bytes_scale_into<T: Lanes>(dst: &mut [u8], src: &[u8], factor: f64) {
    bytes_pair::<T>(dst, src, |d, s| T::scale(d, s, factor));
}

/// Runs `f(dst, src)` on the bytes as `T` elements: on the buffers themselves where both are
/// aligned for `T`, else block by block through aligned stack copies (`dst`'s written back).
fn bytes_pair<T: Lanes>(dst: &mut [u8], src: &[u8], f: impl Fn(&mut [T], &[T])) {
    if let (Ok(d), Ok(s)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        f(d, s);
        return;
    }
    let step = BLOCK * std::mem::size_of::<T>();
    let mut sd = [T::zeroed(); BLOCK];
    let mut ss = [T::zeroed(); BLOCK];
    for (d, s) in dst.chunks_mut(step).zip(src.chunks(step)) {
        let x = stage(&mut sd, d);
        let y = stage(&mut ss, s);
        f(x, y);
        unstage(d, x);
    }
}

fn bytes_divide<T: Lanes>(buf: &mut [u8], divisor: usize) {
    if let Ok(b) = bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        T::divide(b, divisor);
        return;
    }
    let step = BLOCK * std::mem::size_of::<T>();
    let mut sb = [T::zeroed(); BLOCK];
    for d in buf.chunks_mut(step) {
        let x = stage(&mut sb, d);
        T::divide(x, divisor);
        unstage(d, x);
    }
}

// ---------------------------------------------------------------------------------------------
// Typed inner loops.

/// The typed loops behind the byte kernels. Callers pass slices of equal length (the loops zip,
/// so a shorter operand would only shorten the work, never panic).
trait Lanes: bytemuck::Pod {
    fn reduce_into(comb: Combiner, dst: &mut [Self], a: &[Self], b: &[Self]);
    fn reduce_in_place(comb: Combiner, dst: &mut [Self], src: &[Self]);
    fn scale(dst: &mut [Self], src: &[Self], factor: f64);
    /// `divisor` is at least 1.
    fn divide(buf: &mut [Self], divisor: usize);
}

/// `dst[i] = f(a[i], b[i])`: one monomorphised loop per combiner.
#[inline(always)]
fn zip3<T: Copy>(dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
        *d = f(x, y);
    }
}

/// `dst[i] = f(dst[i], src[i])`.
#[inline(always)]
fn zip2<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, &y) in dst.iter_mut().zip(src) {
        *d = f(*d, y);
    }
}

macro_rules! int_lanes {
    ($($t:ty),* $(,)?) => {$(
        impl Lanes for $t {
            fn reduce_into(comb: Combiner, dst: &mut [Self], a: &[Self], b: &[Self]) {
                match comb {
                    Combiner::Sum => zip3(dst, a, b, <$t>::wrapping_add),
                    Combiner::Prod => zip3(dst, a, b, <$t>::wrapping_mul),
                    Combiner::Min => zip3(dst, a, b, Ord::min),
                    Combiner::Max => zip3(dst, a, b, Ord::max),
                }
            }

            fn reduce_in_place(comb: Combiner, dst: &mut [Self], src: &[Self]) {
                match comb {
                    Combiner::Sum => zip2(dst, src, <$t>::wrapping_add),
                    Combiner::Prod => zip2(dst, src, <$t>::wrapping_mul),
                    Combiner::Min => zip2(dst, src, Ord::min),
                    Combiner::Max => zip2(dst, src, Ord::max),
                }
            }

            fn scale(dst: &mut [Self], src: &[Self], factor: f64) {
                for (d, &s) in dst.iter_mut().zip(src) {
                    // `as` from f64 saturates and maps NaN to 0.
                    *d = (s as f64 * factor).round_ties_even() as $t;
                }
            }

            fn divide(buf: &mut [Self], divisor: usize) {
                match <$t>::try_from(divisor) {
                    Ok(d) if d != 0 => {
                        // d >= 1, so neither division by zero nor MIN / -1 can occur.
                        for x in buf.iter_mut() {
                            *x = x.wrapping_div(d);
                        }
                    }
                    _ => {
                        // The divisor does not fit the type: divide exactly in i128 (the
                        // quotient's magnitude never exceeds the dividend's, so it fits).
                        let d = divisor as i128;
                        for x in buf.iter_mut() {
                            *x = ((*x as i128) / d) as $t;
                        }
                    }
                }
            }
        }
    )*};
}

int_lanes!(i8, u8, i32, u32, i64, u64);

macro_rules! float_lanes {
    ($($t:ident),* $(,)?) => {$(
        impl Lanes for $t {
            fn reduce_into(comb: Combiner, dst: &mut [Self], a: &[Self], b: &[Self]) {
                match comb {
                    Combiner::Sum => zip3(dst, a, b, |x, y| x + y),
                    Combiner::Prod => zip3(dst, a, b, |x, y| x * y),
                    Combiner::Min => zip3(dst, a, b, $t::min),
                    Combiner::Max => zip3(dst, a, b, $t::max),
                }
            }

            fn reduce_in_place(comb: Combiner, dst: &mut [Self], src: &[Self]) {
                match comb {
                    Combiner::Sum => zip2(dst, src, |x, y| x + y),
                    Combiner::Prod => zip2(dst, src, |x, y| x * y),
                    Combiner::Min => zip2(dst, src, $t::min),
                    Combiner::Max => zip2(dst, src, $t::max),
                }
            }

            fn scale(dst: &mut [Self], src: &[Self], factor: f64) {
                let f = factor as $t;
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = s * f;
                }
            }

            fn divide(buf: &mut [Self], divisor: usize) {
                let d = divisor as $t;
                for x in buf.iter_mut() {
                    *x /= d;
                }
            }
        }
    )*};
}

float_lanes!(f32, f64);

/// Half-precision types: each element is widened to `f32`, combined in `f32` and rounded back
/// to nearest-even. The conversions give the same bits as the `half` crate's scalar
/// `to_f32`/`from_f32`, NaN payloads included. With AVX-512 the sums, products, minima and
/// maxima go through [`half_simd`]; without it (and for scaling and division, once per
/// operation) the portable paths below are used:
///
/// * `f16` goes block by block through `half`'s slice conversions, which use the F16C
///   instructions when the CPU has them (detected at run time inside `half`), rather than
///   branch-free SSE2 conversions: binary16 needs ~50 vector instructions per 8 elements each
///   way (subnormals, infinities and NaNs selected by masks), against one F16C instruction.
/// * `bf16` is widened, combined and narrowed element by element in one pass by branch-free
///   integer arithmetic ([`bf16_widen`], [`f32_to_bf16`]) that the compiler vectorises with
///   SSE2.
trait HalfLanes: bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl HalfLanes for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// Runs `f` on `f32` copies of corresponding blocks of up to [`BLOCK`] elements of `dst` and
/// `src`, writing the first `f32` block back to `dst`. With `widen_dst == false` the first
/// block starts as a copy of `src` instead of `dst` (for `dst = g(src)` kernels).
fn half_blocks<H: HalfLanes>(
    dst: &mut [H],
    src: &[H],
    widen_dst: bool,
    f: impl Fn(&mut [f32], &[f32]),
) {
    let mut fd = [0f32; BLOCK];
    let mut fs = [0f32; BLOCK];
    for (d, s) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let n = d.len().min(s.len());
        let (d, _) = d.split_at_mut(n);
        let (s, _) = s.split_at(n);
        let (wd, _) = fd.split_at_mut(n);
        let (ws, _) = fs.split_at_mut(n);
        if widen_dst {
            H::widen(d, wd);
        }
        H::widen(s, ws);
        f(wd, ws);
        H::narrow(wd, d);
    }
}

/// The `f32` combination of the half-precision kernels: [`f32`]'s, except that when both
/// operands are NaN the result is the first one's (LLVM may swap the operands of a commutative
/// `+`, `*`, `min` or `max`, and x86 returns the first operand's NaN, so without this the
/// payload would depend on code generation).
#[inline(always)]
fn half_combine(comb: Combiner) -> fn(f32, f32) -> f32 {
    match comb {
        Combiner::Sum => half_sum,
        Combiner::Prod => half_prod,
        Combiner::Min => half_min,
        Combiner::Max => half_max,
    }
}

#[inline(always)]
fn half_sum(x: f32, y: f32) -> f32 {
    if x.is_nan() {
        x
    } else {
        x + y
    }
}

#[inline(always)]
fn half_prod(x: f32, y: f32) -> f32 {
    if x.is_nan() {
        x
    } else {
        x * y
    }
}

#[inline(always)]
fn half_min(x: f32, y: f32) -> f32 {
    if y.is_nan() {
        x
    } else {
        x.min(y)
    }
}

#[inline(always)]
fn half_max(x: f32, y: f32) -> f32 {
    if y.is_nan() {
        x
    } else {
        x.max(y)
    }
}

/// A 16-bit float type's AVX-512 kernel kind and its kernels for CPUs without AVX-512.
trait HalfKernels: bytemuck::Pod {
    const KIND: Half;
    fn portable_into(comb: Combiner, dst: &mut [Self], a: &[Self], b: &[Self]);
    fn portable_in_place(comb: Combiner, dst: &mut [Self], src: &[Self]);
}

/// `dst ⊕= src` through the AVX-512 kernels of [`half_simd`]; false (nothing done) where the
/// CPU has none. Each combiner is passed as its own function item, so that it is inlined into
/// the vector loop.
fn half_simd_in_place<H: HalfKernels>(comb: Combiner, dst: &mut [H], src: &[H]) -> bool {
    let (d, s) = (bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    match comb {
        Combiner::Sum => half_simd::in_place(H::KIND, half_sum, d, s),
        Combiner::Prod => half_simd::in_place(H::KIND, half_prod, d, s),
        Combiner::Min => half_simd::in_place(H::KIND, half_min, d, s),
        Combiner::Max => half_simd::in_place(H::KIND, half_max, d, s),
    }
}

/// `dst = a ⊕ b` through the AVX-512 kernels of [`half_simd`]; false where the CPU has none.
fn half_simd_into<H: HalfKernels>(comb: Combiner, dst: &mut [H], a: &[H], b: &[H]) -> bool {
    let d = bytemuck::cast_slice_mut(dst);
    let (a, b) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
    match comb {
        Combiner::Sum => half_simd::into(H::KIND, half_sum, d, a, b),
        Combiner::Prod => half_simd::into(H::KIND, half_prod, d, a, b),
        Combiner::Min => half_simd::into(H::KIND, half_min, d, a, b),
        Combiner::Max => half_simd::into(H::KIND, half_max, d, a, b),
    }
}

/// `dst ⊕= src`: the AVX-512 kernels where the CPU has them, the portable ones elsewhere.
fn half_in_place<H: HalfKernels>(comb: Combiner, dst: &mut [H], src: &[H]) {
    if !half_simd_in_place(comb, dst, src) {
        H::portable_in_place(comb, dst, src);
    }
}

/// `dst = a ⊕ b`: the AVX-512 kernels where the CPU has them, the portable ones elsewhere.
fn half_into<H: HalfKernels>(comb: Combiner, dst: &mut [H], a: &[H], b: &[H]) {
    if !half_simd_into(comb, dst, a, b) {
        H::portable_into(comb, dst, a, b);
    }
}

/// A 16-bit float type's kernels: its [`HalfKernels`] and its [`Lanes`], whose reductions run
/// through [`half_into`]/[`half_in_place`] and whose scaling and division are the type's own.
macro_rules! half_kernels {
    ($($t:ty => $kind:ident, $into:ident, $in_place:ident, $scale:ident, $divide:ident;)*) => {$(
        impl HalfKernels for $t {
            const KIND: Half = Half::$kind;
            fn portable_into(comb: Combiner, dst: &mut [Self], a: &[Self], b: &[Self]) {
                $into(comb, dst, a, b);
            }
            fn portable_in_place(comb: Combiner, dst: &mut [Self], src: &[Self]) {
                $in_place(comb, dst, src);
            }
        }

        impl Lanes for $t {
            fn reduce_into(comb: Combiner, dst: &mut [Self], a: &[Self], b: &[Self]) {
                half_into(comb, dst, a, b);
            }
            fn reduce_in_place(comb: Combiner, dst: &mut [Self], src: &[Self]) {
                half_in_place(comb, dst, src);
            }
            fn scale(dst: &mut [Self], src: &[Self], factor: f64) {
                $scale(dst, src, factor);
            }
            fn divide(buf: &mut [Self], divisor: usize) {
                $divide(buf, divisor);
            }
        }
    )*};
}

half_kernels! {
    f16 => F16, f16_portable_into, f16_portable_in_place, f16_scale, f16_divide;
    bf16 => Bf16, bf16_portable_into, bf16_portable_in_place, bf16_scale, bf16_divide;
}

fn f16_scale(dst: &mut [f16], src: &[f16], factor: f64) {
    half_blocks(dst, src, false, |d, s| f32::scale(d, s, factor));
}

fn f16_divide(buf: &mut [f16], divisor: usize) {
    let mut fb = [0f32; BLOCK];
    for chunk in buf.chunks_mut(BLOCK) {
        let (w, _) = fb.split_at_mut(chunk.len());
        f16::widen(chunk, w);
        f32::divide(w, divisor);
        f16::narrow(w, chunk);
    }
}

/// `dst = a ⊕ b` for `f16` without AVX-512: `half`'s slice conversions, block by block.
fn f16_portable_into(comb: Combiner, dst: &mut [f16], a: &[f16], b: &[f16]) {
    // Reduce blockwise: dst <- a, then dst <- dst ⊕ b, both in f32.
    let mut fa = [0f32; BLOCK];
    let mut fb = [0f32; BLOCK];
    for ((d, x), y) in dst
        .chunks_mut(BLOCK)
        .zip(a.chunks(BLOCK))
        .zip(b.chunks(BLOCK))
    {
        let n = d.len().min(x.len()).min(y.len());
        let (d, _) = d.split_at_mut(n);
        let (x, _) = x.split_at(n);
        let (y, _) = y.split_at(n);
        let (wa, _) = fa.split_at_mut(n);
        let (wb, _) = fb.split_at_mut(n);
        f16::widen(x, wa);
        f16::widen(y, wb);
        f32_combine_in_place(comb, wa, wb);
        f16::narrow(wa, d);
    }
}

/// `dst ⊕= src` for `f16` without AVX-512.
fn f16_portable_in_place(comb: Combiner, dst: &mut [f16], src: &[f16]) {
    half_blocks(dst, src, true, |d, s| f32_combine_in_place(comb, d, s));
}

/// `dst[i] = half_combine(comb)(dst[i], src[i])` on `f32` blocks, one loop per combiner.
fn f32_combine_in_place(comb: Combiner, dst: &mut [f32], src: &[f32]) {
    match comb {
        Combiner::Sum => zip2(dst, src, half_combine(Combiner::Sum)),
        Combiner::Prod => zip2(dst, src, half_combine(Combiner::Prod)),
        Combiner::Min => zip2(dst, src, half_combine(Combiner::Min)),
        Combiner::Max => zip2(dst, src, half_combine(Combiner::Max)),
    }
}

/// bfloat16 → binary32: the bits shifted into place, which is exact and what
/// [`bf16::to_f32`] gives except that `half` also sets a signalling NaN's quiet bit. The
/// kernels need not: every NaN reaching [`f32_to_bf16`] gets its quiet bit set there, so the
/// kernels' results equal those computed through `half`.
#[inline(always)]
fn bf16_widen(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// binary32 → bfloat16 rounded to nearest-even, as [`bf16::from_f32`] bit for bit: a NaN keeps
/// its top payload bits and gets its quiet bit set. Branch-free (both results computed, one
/// selected by a mask) so that loops over it vectorise.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    // Round to nearest-even: add just under half an ulp plus the kept LSB (a carry may reach
    // the exponent, up to infinity); a NaN gets the quiet bit instead. The result is the high
    // half, taken by an arithmetic shift so that it is sign-extended (`i16` range), which
    // lets the 32 → 16-bit narrowing be one saturating pack.
    let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    let quiet = u | 0x0040_0000;
    let m = (x.is_nan() as u32).wrapping_neg();
    ((((quiet & m) | (rounded & !m)) as i32) >> 16) as u16
}

/// `narrow(f(widen(x), widen(y)))` for one bf16 element.
#[inline(always)]
fn bf16_op(f: fn(f32, f32) -> f32) -> impl Fn(bf16, bf16) -> bf16 {
    move |x, y| {
        bf16::from_bits(f32_to_bf16(f(
            bf16_widen(x.to_bits()),
            bf16_widen(y.to_bits()),
        )))
    }
}

fn bf16_scale(dst: &mut [bf16], src: &[bf16], factor: f64) {
    let f = factor as f32;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16(bf16_widen(s.to_bits()) * f));
    }
}

fn bf16_divide(buf: &mut [bf16], divisor: usize) {
    let d = divisor as f32;
    for x in buf.iter_mut() {
        *x = bf16::from_bits(f32_to_bf16(bf16_widen(x.to_bits()) / d));
    }
}

/// `dst = a ⊕ b` for `bf16` without AVX-512 (SSE2).
fn bf16_portable_into(comb: Combiner, dst: &mut [bf16], a: &[bf16], b: &[bf16]) {
    match comb {
        Combiner::Sum => zip3(dst, a, b, bf16_op(half_combine(Combiner::Sum))),
        Combiner::Prod => zip3(dst, a, b, bf16_op(half_combine(Combiner::Prod))),
        Combiner::Min => zip3(dst, a, b, bf16_op(half_combine(Combiner::Min))),
        Combiner::Max => zip3(dst, a, b, bf16_op(half_combine(Combiner::Max))),
    }
}

/// `dst ⊕= src` for `bf16` without AVX-512 (SSE2).
fn bf16_portable_in_place(comb: Combiner, dst: &mut [bf16], src: &[bf16]) {
    match comb {
        Combiner::Sum => zip2(dst, src, bf16_op(half_combine(Combiner::Sum))),
        Combiner::Prod => zip2(dst, src, bf16_op(half_combine(Combiner::Prod))),
        Combiner::Min => zip2(dst, src, bf16_op(half_combine(Combiner::Min))),
        Combiner::Max => zip2(dst, src, bf16_op(half_combine(Combiner::Max))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMBS: [Combiner; 4] = [Combiner::Sum, Combiner::Prod, Combiner::Min, Combiner::Max];

    /// Reference combination of one pair of values, written independently of the kernels.
    fn reference<T: Element>(comb: Combiner, a: T, b: T) -> T {
        // `$x` and `$y` combined by `$add`/`$mul` (wrapping for integers).
        macro_rules! arith {
            ($x:expr, $y:expr, $add:expr, $mul:expr) => {
                match comb {
                    Combiner::Sum => $add($x, $y),
                    Combiner::Prod => $mul($x, $y),
                    Combiner::Min => $x.min($y),
                    Combiner::Max => $x.max($y),
                }
            };
        }
        // `a` and `b` seen as `$t`, combined by `$combine(x, y)`, seen as `T` again.
        macro_rules! as_type {
            ($t:ty, |$x:ident, $y:ident| $combine:expr) => {{
                let ($x, $y): ($t, $t) = (bytemuck::cast(a), bytemuck::cast(b));
                let r: $t = $combine;
                bytemuck::cast(r)
            }};
        }
        macro_rules! int {
            ($t:ty) => {
                as_type!($t, |x, y| arith!(
                    x,
                    y,
                    <$t>::wrapping_add,
                    <$t>::wrapping_mul
                ))
            };
        }
        macro_rules! float {
            ($t:ty) => {
                as_type!($t, |x, y| arith!(
                    x,
                    y,
                    std::ops::Add::add,
                    std::ops::Mul::mul
                ))
            };
        }
        // Halves combine in f32 and round once; two NaNs give the first one, quieted (the half
        // kernels' documented choice).
        macro_rules! half {
            ($t:ty) => {
                as_type!($t, |x, y| <$t>::from_f32(if x.is_nan() && y.is_nan() {
                    x.to_f32()
                } else {
                    let (x, y) = (x.to_f32(), y.to_f32());
                    arith!(x, y, std::ops::Add::add, std::ops::Mul::mul)
                }))
            };
        }
        match T::DTYPE {
            DataType::Int8 => int!(i8),
            DataType::Uint8 => int!(u8),
            DataType::Int32 => int!(i32),
            DataType::Uint32 => int!(u32),
            DataType::Int64 => int!(i64),
            DataType::Uint64 => int!(u64),
            DataType::Float32 => float!(f32),
            DataType::Float64 => float!(f64),
            DataType::Float16 => half!(f16),
            DataType::Bfloat16 => half!(bf16),
        }
    }

    /// Values of `T` built from random bytes, with interesting ones mixed in.
    fn values<T: Element>(seed: u64, n: usize, special: &[T]) -> Vec<T> {
        let raw = crate::testing::noise(seed, n * std::mem::size_of::<T>());
        let mut v: Vec<T> = raw
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect();
        for (i, s) in special.iter().enumerate() {
            if let Some(slot) = v.get_mut(i * 7 % n.max(1)) {
                *slot = *s;
            }
        }
        v
    }

    /// The typed kernels, out of place and in place, against `want` bit for bit.
    fn check_typed<T: Element>(comb: Combiner, a: &[T], b: &[T], want: &[T]) {
        let n = a.len();
        let mut got = vec![T::zeroed(); n];
        reduce_slice_into(comb, &mut got, a, b).unwrap();
        assert!(same_bits(&got, want), "{:?} {comb:?} n={n}", T::DTYPE);
        let mut got = a.to_vec();
        reduce_slice_in_place(comb, &mut got, b).unwrap();
        assert!(same_bits(&got, want), "{:?} {comb:?} n={n}", T::DTYPE);
    }

    fn same_bits<T: Element>(a: &[T], b: &[T]) -> bool {
        bytemuck::cast_slice::<T, u8>(a) == bytemuck::cast_slice::<T, u8>(b)
    }

    /// Checks every kernel entry point for `T` against the reference, aligned and misaligned.
    fn check_type<T: Element>(special_a: &[T], special_b: &[T]) {
        // Lengths straddle the staging block size.
        for n in [0usize, 1, 3, 17, BLOCK - 1, BLOCK, BLOCK + 5, 3 * BLOCK + 2] {
            let a = values::<T>(n as u64 + 1, n, special_a);
            let b = values::<T>(n as u64 + 1000, n, special_b);
            for comb in COMBS {
                let want: Vec<T> = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| reference(comb, x, y))
                    .collect();

                check_typed(comb, &a, &b, &want);

                // Byte kernels at every misalignment of destination and operands.
                let ab: &[u8] = bytemuck::cast_slice(&a);
                let bb: &[u8] = bytemuck::cast_slice(&b);
                let wb: &[u8] = bytemuck::cast_slice(&want);
                let len = ab.len();
                for (od, oa, ob) in [(0, 0, 0), (1, 0, 0), (0, 3, 0), (0, 0, 5), (1, 2, 3)] {
                    let mut bufa = vec![0u8; len + 8];
                    let mut bufb = vec![0u8; len + 8];
                    let mut bufd = vec![0xEEu8; len + 8];
                    bufa[oa..oa + len].copy_from_slice(ab);
                    bufb[ob..ob + len].copy_from_slice(bb);
                    reduce_into(
                        T::DTYPE,
                        comb,
                        &mut bufd[od..od + len],
                        &bufa[oa..oa + len],
                        &bufb[ob..ob + len],
                    )
                    .unwrap();
                    assert_eq!(
                        &bufd[od..od + len],
                        wb,
                        "{:?} {comb:?} n={n} off {od}",
                        T::DTYPE
                    );
                    // In place: dst starts as a.
                    let mut bufd = vec![0u8; len + 8];
                    bufd[od..od + len].copy_from_slice(ab);
                    reduce_in_place(T::DTYPE, comb, &mut bufd[od..od + len], &bufb[ob..ob + len])
                        .unwrap();
                    assert_eq!(
                        &bufd[od..od + len],
                        wb,
                        "{:?} {comb:?} n={n} off {od}",
                        T::DTYPE
                    );
                }
            }
        }
    }

    #[test]
    fn integers_match_reference_including_wrapping() {
        check_type::<i8>(&[i8::MAX, i8::MIN, -1, 0], &[1, -1, i8::MIN, 0]);
        check_type::<u8>(&[u8::MAX, 0, 16], &[1, 0, 16]);
        check_type::<i32>(&[i32::MAX, i32::MIN, -7], &[1, -1, 3]);
        check_type::<u32>(&[u32::MAX, 0, 1 << 16], &[1, 5, 1 << 16]);
        check_type::<i64>(&[i64::MAX, i64::MIN, -9], &[1, -1, 2]);
        check_type::<u64>(&[u64::MAX, 0, 1 << 32], &[1, 0, 1 << 32]);
    }

    /// The AVX-512 kernels against the portable ones, bit for bit: random bit patterns (NaN
    /// payloads, subnormals, infinities and signed zeros included) at every tail length.
    #[test]
    fn half_simd_kernels_match_the_portable_ones() {
        if !half_simd::available() {
            eprintln!("no AVX-512 on this CPU: only the portable kernels run");
            return;
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut bits = |n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u16
                })
                .collect()
        };
        for n in (0..40).chain([255, 1000]) {
            let (a, b) = (bits(n), bits(n));
            for comb in COMBS {
                simd_matches_portable::<f16>(comb, &a, &b);
                simd_matches_portable::<bf16>(comb, &a, &b);
            }
        }
    }

    /// One case of the test above: `a ⊕ b` out of place and in place, both paths.
    fn simd_matches_portable<H: Element + HalfKernels>(comb: Combiner, a: &[u16], b: &[u16]) {
        let kind = H::KIND;
        let (a, b): (&[H], &[H]) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
        let n = a.len();
        let mut want = vec![H::zeroed(); n];
        H::portable_into(comb, &mut want, a, b);
        let mut got = vec![H::zeroed(); n];
        assert!(half_simd_into(comb, &mut got, a, b));
        assert!(same_bits(&got, &want), "{kind:?} into {comb:?} n={n}");
        let mut got = a.to_vec();
        assert!(half_simd_in_place(comb, &mut got, b));
        assert!(same_bits(&got, &want), "{kind:?} in place {comb:?} n={n}");
    }

    #[test]
    fn floats_match_reference_including_nan() {
        check_type::<f32>(
            &[f32::NAN, 1.5, f32::INFINITY, -0.0, f32::NAN],
            &[2.0, f32::NAN, f32::NEG_INFINITY, 0.5, f32::NAN],
        );
        check_type::<f64>(
            &[f64::NAN, 1.5, f64::INFINITY, f64::MAX],
            &[2.0, f64::NAN, f64::NEG_INFINITY, f64::MAX],
        );
        check_type::<f16>(
            &[f16::NAN, f16::from_f32(1.5), f16::INFINITY, f16::MAX],
            &[f16::ONE, f16::NAN, f16::NEG_INFINITY, f16::MAX],
        );
        check_type::<bf16>(
            &[bf16::NAN, bf16::from_f32(1.5), bf16::INFINITY, bf16::MAX],
            &[bf16::ONE, bf16::NAN, bf16::NEG_INFINITY, bf16::MAX],
        );
    }

    #[test]
    fn nan_min_max_follow_std() {
        let a = [f32::NAN, 1.0, f32::NAN];
        let b = [2.0, f32::NAN, f32::NAN];
        let mut d = [0f32; 3];
        reduce_slice_into(Combiner::Min, &mut d, &a, &b).unwrap();
        assert_eq!(d[0], 2.0);
        assert_eq!(d[1], 1.0);
        assert!(d[2].is_nan());
        reduce_slice_into(Combiner::Max, &mut d, &a, &b).unwrap();
        assert_eq!(d[0], 2.0);
        assert_eq!(d[1], 1.0);
        let h = [f16::NAN, f16::from_f32(3.0)];
        let g = [f16::from_f32(-1.0), f16::NAN];
        let mut o = [f16::ZERO; 2];
        reduce_slice_into(Combiner::Max, &mut o, &h, &g).unwrap();
        assert_eq!(o, [f16::from_f32(-1.0), f16::from_f32(3.0)]);
    }

    #[test]
    fn half_types_round_through_f32() {
        // 2048 + 1 is not representable in f16: rounds to even (2048).
        let a = [f16::from_f32(2048.0), f16::from_f32(0.1)];
        let b = [f16::from_f32(1.0), f16::from_f32(0.2)];
        let mut d = [f16::ZERO; 2];
        reduce_slice_into(Combiner::Sum, &mut d, &a, &b).unwrap();
        assert_eq!(d[0], f16::from_f32(2048.0));
        assert_eq!(d[1], f16::from_f32(a[1].to_f32() + b[1].to_f32()));
        let x = [bf16::from_f32(256.0)];
        let y = [bf16::from_f32(1.0)];
        let mut z = [bf16::ZERO];
        reduce_slice_into(Combiner::Sum, &mut z, &x, &y).unwrap();
        assert_eq!(z[0], bf16::from_f32(256.0));
    }

    #[test]
    fn length_errors() {
        let mut d = [0u8; 8];
        assert_eq!(
            reduce_into(DataType::Int32, Combiner::Sum, &mut d, &[0; 8], &[0; 4]),
            Err(KernelError::LengthMismatch { dst: 8, a: 8, b: 4 })
        );
        assert_eq!(
            reduce_into(
                DataType::Int32,
                Combiner::Sum,
                &mut d[..6],
                &[0; 6],
                &[0; 6]
            ),
            Err(KernelError::NotWholeElements { len: 6, elem: 4 })
        );
        assert_eq!(
            reduce_in_place(DataType::Int64, Combiner::Max, &mut d, &[0; 7]),
            Err(KernelError::SourceLengthMismatch { dst: 8, src: 7 })
        );
        assert_eq!(
            scale_into(DataType::Float16, &mut d[..3], &[0; 3], 2.0),
            Err(KernelError::NotWholeElements { len: 3, elem: 2 })
        );
        assert_eq!(
            divide_in_place(DataType::Float64, &mut d, 0),
            Err(KernelError::DivideByZero)
        );
        assert_eq!(
            divide_in_place(DataType::Float64, &mut d[..5], 2),
            Err(KernelError::NotWholeElements { len: 5, elem: 8 })
        );
        let mut t = [0i32; 2];
        assert_eq!(
            reduce_slice_into(Combiner::Sum, &mut t, &[1, 2, 3], &[1, 2]),
            Err(KernelError::LengthMismatch { dst: 2, a: 3, b: 2 })
        );
        assert_eq!(
            reduce_slice_in_place(Combiner::Sum, &mut t, &[1]),
            Err(KernelError::SourceLengthMismatch { dst: 2, src: 1 })
        );
        // Empty input is fine.
        reduce_into(DataType::Float32, Combiner::Sum, &mut [], &[], &[]).unwrap();
    }

    fn scale_bytes<T: Element>(src: &[T], factor: f64, offset: usize) -> Vec<T> {
        let sb: &[u8] = bytemuck::cast_slice(src);
        let len = sb.len();
        let mut s = vec![0u8; len + 8];
        let mut d = vec![0u8; len + 8];
        s[offset..offset + len].copy_from_slice(sb);
        scale_into(
            T::DTYPE,
            &mut d[offset..offset + len],
            &s[offset..offset + len],
            factor,
        )
        .unwrap();
        d[offset..offset + len]
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    }

    fn divide_bytes<T: Element>(src: &[T], divisor: usize, offset: usize) -> Vec<T> {
        let sb: &[u8] = bytemuck::cast_slice(src);
        let len = sb.len();
        let mut d = vec![0u8; len + 8];
        d[offset..offset + len].copy_from_slice(sb);
        divide_in_place(T::DTYPE, &mut d[offset..offset + len], divisor).unwrap();
        d[offset..offset + len]
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    }

    #[test]
    fn scaling() {
        for off in [0, 1, 3] {
            assert_eq!(scale_bytes(&[1i32, -3, 5, 7], 2.5, off), [2, -8, 12, 18]);
            assert_eq!(scale_bytes(&[100i8, -100], 2.0, off), [127, -128]);
            assert_eq!(scale_bytes(&[200u8, 3], -1.0, off), [0, 0]);
            assert_eq!(scale_bytes(&[5u64], f64::NAN, off), [0]);
            assert_eq!(scale_bytes(&[1.5f64, -2.0], 0.5, off), [0.75, -1.0]);
            assert_eq!(
                scale_bytes(&[1.5f32, -2.0], 0.1, off),
                [1.5 * 0.1f32, -0.2f32]
            );
            assert_eq!(
                scale_bytes(&[f16::from_f32(3.0)], 0.5, off),
                [f16::from_f32(1.5)]
            );
            assert_eq!(
                scale_bytes(&[bf16::from_f32(3.0)], 4.0, off),
                [bf16::from_f32(12.0)]
            );
            let long: Vec<i64> = (0..600).collect();
            let want: Vec<i64> = long.iter().map(|x| 3 * x).collect();
            assert_eq!(scale_bytes(&long, 3.0, off), want);
        }
    }

    #[test]
    fn division_truncates_toward_zero() {
        for off in [0, 1, 5] {
            assert_eq!(divide_bytes(&[7i32, -7, 6, -1], 2, off), [3, -3, 3, 0]);
            assert_eq!(divide_bytes(&[i8::MIN, i8::MAX, -5], 128, off), [-1, 0, 0]);
            assert_eq!(divide_bytes(&[i8::MIN, 100], 1000, off), [0, 0]);
            assert_eq!(divide_bytes(&[255u8, 10], 256, off), [0, 0]);
            assert_eq!(divide_bytes(&[255u8, 10], 3, off), [85, 3]);
            assert_eq!(divide_bytes(&[i64::MIN, -9], 1, off), [i64::MIN, -9]);
            assert_eq!(
                divide_bytes(&[u64::MAX], usize::MAX, off),
                [u64::MAX / usize::MAX as u64]
            );
            assert_eq!(divide_bytes(&[7.0f64, -1.0], 2, off), [3.5, -0.5]);
            assert_eq!(divide_bytes(&[7.0f32], 4, off), [1.75]);
            assert_eq!(
                divide_bytes(&[f16::from_f32(5.0)], 2, off),
                [f16::from_f32(2.5)]
            );
            assert_eq!(
                divide_bytes(&[bf16::from_f32(-6.0)], 4, off),
                [bf16::from_f32(-1.5)]
            );
            let long: Vec<u32> = (0..700).collect();
            let want: Vec<u32> = long.iter().map(|x| x / 7).collect();
            assert_eq!(divide_bytes(&long, 7, off), want);
        }
    }

    // -----------------------------------------------------------------------------------------
    // The bfloat16 conversions against the `half` crate, bit for bit, and the half-precision
    // kernels against an element-wise reference through `half`.

    /// f32 bit patterns on every boundary class: each exponent with mantissas around the
    /// binary16 and bfloat16 rounding points (ties, ±1 ulp around them, odd/even kept bits),
    /// all NaN classes, ±0, ±inf, the extremes of normals and subnormals, and the binary16
    /// overflow threshold.
    fn boundary_f32_bits() -> Vec<u32> {
        let mut mantissas: Vec<u32> = vec![
            0, 1, 2, 0x7f_ffff, 0x7f_fffe, 0x40_0000, 0x40_0001, 0x3f_ffff, 0x20_0000, 0x00_0400,
            0x00_03ff,
        ];
        // binary16 keeps 10 mantissa bits (drops 13), bfloat16 keeps 7 (drops 16).
        for drop in [13u32, 16] {
            let half = 1u32 << (drop - 1);
            for kept in [0u32, 1, 2, 3, 0x2a, 0x55, 0x7f, 0x3fe, 0x3ff] {
                let kept = kept & ((1 << (23 - drop)) - 1);
                let base = kept << drop;
                for low in [0, 1, half - 1, half, half + 1, (1 << drop) - 1] {
                    mantissas.push(base | low);
                }
            }
        }
        // Subnormal binary16 rounding points at every possible shift.
        for shift in 0..24 {
            let bit = 1u32 << shift;
            mantissas.extend([bit, bit - 1, bit + 1, bit | (bit >> 1), (bit << 1) - 1]);
        }
        mantissas.sort_unstable();
        mantissas.dedup();
        let mut out = Vec::new();
        for sign in [0u32, 0x8000_0000] {
            for exp in 0..=255u32 {
                for &m in &mantissas {
                    out.push(sign | (exp << 23) | (m & 0x7f_ffff));
                }
            }
        }
        // Named extremes (some repeat the above; harmless).
        for v in [
            65504.0f32,
            65519.996,
            65520.0,
            65535.0,
            65536.0,
            6.103_515_6e-5, // smallest binary16 normal
            6.097_555e-5,   // largest binary16 subnormal
            5.960_464_5e-8, // smallest binary16 subnormal
            2.980_232_2e-8, // half of it: a tie to zero
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::EPSILON,
        ] {
            out.push(v.to_bits());
            out.push(v.to_bits() ^ 0x8000_0000);
            out.push(v.to_bits() + 1);
            out.push(v.to_bits() - 1);
        }
        out
    }

    #[test]
    fn bf16_widening_matches_half_exhaustively() {
        for h in 0..=u16::MAX {
            let want = bf16::from_bits(h).to_f32().to_bits();
            let got = bf16_widen(h).to_bits();
            if bf16::from_bits(h).is_nan() {
                // `half` quiets a NaN when widening; the kernels leave that to narrowing.
                assert_eq!(got | 0x0040_0000, want, "bf16 {h:#06x}");
            } else {
                assert_eq!(got, want, "bf16 {h:#06x}");
            }
            // Either way the round trip gives `half`'s bits.
            let x = bf16::from_bits(h).to_f32();
            assert_eq!(
                f32_to_bf16(bf16_widen(h)),
                bf16::from_f32(x).to_bits(),
                "bf16 {h:#06x}"
            );
        }
    }

    #[test]
    fn bf16_narrowing_matches_half_on_boundaries() {
        let bits = boundary_f32_bits();
        assert!(bits.len() > 50_000);
        for u in bits {
            let x = f32::from_bits(u);
            assert_eq!(
                f32_to_bf16(x),
                bf16::from_f32(x).to_bits(),
                "bf16 of {u:#010x}"
            );
            assert_eq!(
                f32_to_bf16(x),
                bf16::from_f32_const(x).to_bits(),
                "bf16 (const) of {u:#010x}"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(20_000))]

        #[test]
        fn bf16_narrowing_matches_half_on_random_bits(u in proptest::prelude::any::<u32>()) {
            let x = f32::from_bits(u);
            proptest::prop_assert_eq!(f32_to_bf16(x), bf16::from_f32(x).to_bits());
        }
    }

    /// Element-wise reference through `half`'s scalar conversions.
    fn half_reference<T: Element>(comb: Combiner, a: &[T], b: &[T]) -> Vec<T> {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| reference(comb, x, y))
            .collect()
    }

    fn check_half_lengths<T: Element>(wide: impl Fn(T) -> f32, narrow: impl Fn(f32) -> T) {
        // Values mixing random bit patterns (NaNs, subnormals, infinities included) with
        // ordinary magnitudes, so sums and products round.
        for n in [
            0usize,
            1,
            31,
            32,
            33,
            63,
            64,
            65,
            BLOCK - 1,
            BLOCK + 1,
            1000,
        ] {
            let mut a = values::<T>(n as u64 + 7, n, &[]);
            let b = values::<T>(n as u64 + 77, n, &[]);
            for (i, x) in a.iter_mut().enumerate().filter(|(i, _)| i % 3 == 0) {
                *x = narrow(1.0 + i as f32 / 7.0);
            }
            for comb in COMBS {
                check_typed(comb, &a, &b, &half_reference(comb, &a, &b));
            }
            for factor in [0.1f64, -3.0, 1e-6, 65536.0] {
                let want: Vec<T> = a.iter().map(|&x| narrow(wide(x) * factor as f32)).collect();
                let mut got = vec![T::zeroed(); n];
                let (d, s) = (bytes_mut_of(&mut got).unwrap(), bytes_of(&a).unwrap());
                scale_into(T::DTYPE, d, s, factor).unwrap();
                assert!(
                    same_bits(&got, &want),
                    "{:?} scale {factor} n={n}",
                    T::DTYPE
                );
                assert!(same_bits(&scale_bytes(&a, factor, 1), &want));
            }
            for divisor in [1usize, 3, 7, 1000] {
                let want: Vec<T> = a
                    .iter()
                    .map(|&x| narrow(wide(x) / divisor as f32))
                    .collect();
                let mut got = a.clone();
                divide_in_place(T::DTYPE, bytes_mut_of(&mut got).unwrap(), divisor).unwrap();
                assert!(
                    same_bits(&got, &want),
                    "{:?} divide {divisor} n={n}",
                    T::DTYPE
                );
                assert!(same_bits(&divide_bytes(&a, divisor, 3), &want));
            }
        }
    }

    #[test]
    fn half_kernels_match_half_at_odd_lengths() {
        check_half_lengths::<f16>(f16::to_f32, f16::from_f32);
        check_half_lengths::<bf16>(bf16::to_f32, bf16::from_f32);
    }
}
