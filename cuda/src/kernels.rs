//! The reduction kernels: CUDA C source (`kernel_source.cu`), compiled once per process with
//! NVRTC, loaded once per context, launched on a stream.
//!
//! One kernel per (data type, operation): `weft_reduce_{sum,prod,min,max}_{type}` computes
//! `dst = a ⊕ b`, `weft_scale_{type}` is `PreMulSum`'s local scaling and `weft_divide_{type}` is
//! `Avg`'s final division, so every [`ReduceOp`](weftcc_collectives::ReduceOp) is covered the way the host communicator
//! covers it (Avg = sum then divide; PreMulSum = scale then sum). The source is self-contained
//! C that also compiles as host C++; the unit tests here run that host build against
//! `weftcc_collectives::reduce` (the CPU kernels) for every type and operation.

use crate::driver::{check, ensure_driver, ensure_nvrtc};
use crate::error::{CudaError, Result};
use crate::memory::{DeviceBuffer, Stream};
use cudarc::driver::sys;
use std::sync::OnceLock;
use weftcc_collectives::{Combiner, DataType};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernel_source.cu");

/// What a kernel does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// `dst = a ⊕ b` element-wise.
    Reduce(Combiner),
    /// `dst = src × factor` (PreMulSum's scaling).
    Scale,
    /// `buf = buf / divisor` (Avg's division).
    Divide,
}

impl KernelKind {
    /// Every kind, in table order.
    pub const ALL: [KernelKind; 6] = [
        KernelKind::Reduce(Combiner::Sum),
        KernelKind::Reduce(Combiner::Prod),
        KernelKind::Reduce(Combiner::Min),
        KernelKind::Reduce(Combiner::Max),
        KernelKind::Scale,
        KernelKind::Divide,
    ];

    fn index(self) -> usize {
        match self {
            KernelKind::Reduce(Combiner::Sum) => 0,
            KernelKind::Reduce(Combiner::Prod) => 1,
            KernelKind::Reduce(Combiner::Min) => 2,
            KernelKind::Reduce(Combiner::Max) => 3,
            KernelKind::Scale => 4,
            KernelKind::Divide => 5,
        }
    }
}

/// The source's short name of a data type (`i8`, `f16`, `bf16`, ...).
pub fn type_suffix(t: DataType) -> &'static str {
    match t {
        DataType::Int8 => "i8",
        DataType::Uint8 => "u8",
        DataType::Int32 => "i32",
        DataType::Uint32 => "u32",
        DataType::Int64 => "i64",
        DataType::Uint64 => "u64",
        DataType::Float16 => "f16",
        DataType::Float32 => "f32",
        DataType::Float64 => "f64",
        DataType::Bfloat16 => "bf16",
    }
}

/// The kernel's symbol in [`SOURCE`].
pub fn kernel_name(kind: KernelKind, t: DataType) -> String {
    let ty = type_suffix(t);
    match kind {
        KernelKind::Reduce(c) => {
            let op = match c {
                Combiner::Sum => "sum",
                Combiner::Prod => "prod",
                Combiner::Min => "min",
                Combiner::Max => "max",
            };
            format!("weft_reduce_{op}_{ty}")
        }
        KernelKind::Scale => format!("weft_scale_{ty}"),
        KernelKind::Divide => format!("weft_divide_{ty}"),
    }
}

/// PTX of [`SOURCE`], compiled by NVRTC at most once per process.
pub fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<Result<String>> = OnceLock::new();
    PTX.get_or_init(|| {
        ensure_nvrtc()?;
        let opts = cudarc::nvrtc::CompileOptions {
            name: Some("weft_kernels.cu".into()),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
            .map(|p| p.to_src())
            .map_err(|e| CudaError::Compile(format!("{e:?}")))
    })
    .as_ref()
    .map(String::as_str)
    .map_err(Clone::clone)
}

/// The kernels loaded into one context: `table[dtype][kind]`.
pub(crate) struct Kernels {
    module: sys::CUmodule,
    table: Vec<[sys::CUfunction; 6]>,
}

// SAFETY: module and function handles are plain driver handles, valid in every thread once the
// owning context is current; the driver API is thread-safe.
unsafe impl Send for Kernels {}
// SAFETY: as above; the table is never mutated after loading.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the module into the current context (the caller made its context current).
    pub(crate) fn load() -> Result<Kernels> {
        ensure_driver()?;
        let ptx = ptx()?;
        let image = std::ffi::CString::new(ptx)
            .map_err(|_| CudaError::Compile("PTX contains a NUL byte".into()))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: driver initialised and a context is current (caller's contract); `image` is a
        // NUL-terminated PTX string that outlives the call; `module` is an out pointer.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        let mut table = Vec::with_capacity(DataType::ALL.len());
        for t in DataType::ALL {
            let mut row = [std::ptr::null_mut(); 6];
            for kind in KernelKind::ALL {
                let name = std::ffi::CString::new(kernel_name(kind, t))
                    .map_err(|_| CudaError::Other("kernel name with NUL".into()))?;
                // SAFETY: `module` was loaded above; `name` is NUL-terminated; out pointer valid.
                check("cuModuleGetFunction", unsafe {
                    sys::cuModuleGetFunction(&mut row[kind.index()], module, name.as_ptr())
                })?;
            }
            table.push(row);
        }
        Ok(Kernels { module, table })
    }

    fn function(&self, kind: KernelKind, t: DataType) -> sys::CUfunction {
        self.table[t.code() as usize][kind.index()]
    }

    /// Launch shape for `n` elements: 512 threads per block, at most 4096 blocks (grid-stride).
    fn shape(n: usize) -> (u32, u32) {
        let threads = 512u32;
        let blocks = n.div_ceil(threads as usize).clamp(1, 4096) as u32;
        (blocks, threads)
    }

    /// Enqueues `dst = a ⊕ b` on `stream` (device pointers to `n` elements of `t`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reduce(
        &self,
        comb: Combiner,
        t: DataType,
        dst: u64,
        a: u64,
        b: u64,
        n: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        let (mut dst, mut a, mut b, mut n64) = (dst, a, b, n as u64);
        let mut args: [*mut std::ffi::c_void; 4] = [
            (&mut dst as *mut u64).cast(),
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut n64 as *mut u64).cast(),
        ];
        self.launch(KernelKind::Reduce(comb), t, n, &mut args, stream)
    }

    /// Enqueues `dst = src × factor`.
    pub(crate) fn scale(
        &self,
        t: DataType,
        dst: u64,
        src: u64,
        factor: f64,
        n: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        let (mut dst, mut src, mut f, mut n64) = (dst, src, factor, n as u64);
        let mut args: [*mut std::ffi::c_void; 4] = [
            (&mut dst as *mut u64).cast(),
            (&mut src as *mut u64).cast(),
            (&mut f as *mut f64).cast(),
            (&mut n64 as *mut u64).cast(),
        ];
        self.launch(KernelKind::Scale, t, n, &mut args, stream)
    }

    /// Enqueues `buf = buf / divisor`.
    pub(crate) fn divide(
        &self,
        t: DataType,
        buf: u64,
        divisor: usize,
        n: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        let (mut buf, mut d, mut n64) = (buf, divisor as u64, n as u64);
        let mut args: [*mut std::ffi::c_void; 3] = [
            (&mut buf as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
            (&mut n64 as *mut u64).cast(),
        ];
        self.launch(KernelKind::Divide, t, n, &mut args, stream)
    }

    fn launch(
        &self,
        kind: KernelKind,
        t: DataType,
        n: usize,
        args: &mut [*mut std::ffi::c_void],
        stream: sys::CUstream,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (blocks, threads) = Self::shape(n);
        // SAFETY: the function belongs to this loaded module; `args` points at locals of the
        // caller that match the kernel's parameter list (u64 pointers, u64/f64 scalars) and live
        // until cuLaunchKernel returns (the driver copies parameters at launch); the stream
        // belongs to the context the module was loaded into.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.function(kind, t),
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the module was loaded by `load` and no launch can follow (we are dropped with
        // the context that owns us, whose primary context is still retained at this point).
        let _ = unsafe { sys::cuModuleUnload(self.module) };
    }
}

/// Checks that device buffers of one operation have the same length and device as `dst`.
fn same_shape<T: weftcc_collectives::Element>(
    dst: &DeviceBuffer<T>,
    others: &[&DeviceBuffer<T>],
    stream: &Stream,
) -> Result<()> {
    for o in others {
        if o.len() != dst.len() || o.context().ordinal() != dst.context().ordinal() {
            return Err(CudaError::Other(
                "kernel operands differ in length or device".into(),
            ));
        }
    }
    if stream.context().ordinal() != dst.context().ordinal() {
        return Err(CudaError::Other("stream of another device".into()));
    }
    Ok(())
}

/// Enqueues `dst = a ⊕ b` on `stream` with the NVRTC kernel (buffers of equal length on the
/// stream's device; `dst` may not alias `a` or `b` here, the executor's in-place uses are
/// element-wise safe but Rust's borrows forbid them in this API).
pub fn reduce_on_device<T: weftcc_collectives::Element>(
    comb: Combiner,
    dst: &mut DeviceBuffer<T>,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    stream: &Stream,
) -> Result<()> {
    same_shape(dst, &[a, b], stream)?;
    let k = dst.context().kernels()?;
    k.reduce(
        comb,
        T::DTYPE,
        dst.device_ptr(),
        a.device_ptr(),
        b.device_ptr(),
        dst.len(),
        stream.as_raw(),
    )
}

/// Enqueues `dst = src × factor` (PreMulSum's scaling) on `stream`.
pub fn scale_on_device<T: weftcc_collectives::Element>(
    dst: &mut DeviceBuffer<T>,
    src: &DeviceBuffer<T>,
    factor: f64,
    stream: &Stream,
) -> Result<()> {
    same_shape(dst, &[src], stream)?;
    let k = dst.context().kernels()?;
    k.scale(
        T::DTYPE,
        dst.device_ptr(),
        src.device_ptr(),
        factor,
        dst.len(),
        stream.as_raw(),
    )
}

/// Enqueues `buf = buf / divisor` (Avg's division) on `stream`.
pub fn divide_on_device<T: weftcc_collectives::Element>(
    buf: &mut DeviceBuffer<T>,
    divisor: usize,
    stream: &Stream,
) -> Result<()> {
    same_shape(buf, &[], stream)?;
    if divisor == 0 {
        return Err(CudaError::Other("division by zero".into()));
    }
    let k = buf.context().kernels()?;
    k.divide(
        T::DTYPE,
        buf.device_ptr(),
        divisor,
        buf.len(),
        stream.as_raw(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use weftcc_collectives::reduce;

    #[test]
    fn every_type_and_op_has_a_kernel_in_the_source() {
        let mut names = std::collections::HashSet::new();
        for t in DataType::ALL {
            for k in KernelKind::ALL {
                let name = kernel_name(k, t);
                assert!(names.insert(name.clone()), "duplicate {name}");
                let ty = type_suffix(t);
                assert!(
                    SOURCE.contains(&format!("WEFT_KERNELS({ty},")),
                    "no kernels for {ty}"
                );
            }
            assert_eq!(KernelKind::ALL.len(), 6);
        }
        assert_eq!(names.len(), 60);
        // No headers: NVRTC must compile the source without include paths.
        assert!(!SOURCE.contains("#include"));
    }

    /// Inputs for one type: raw random bits (every exponent, NaN, infinities, subnormals)
    /// interleaved with small integers (exact cases, ties when scaled by -2.5).
    fn inputs(t: DataType, n: usize, seed: u64) -> Vec<u8> {
        let es = t.size();
        let mut v = weftcc_collectives::testing::noise(seed, n * es);
        for i in (0..n).step_by(3) {
            let small = ((i as i64 * 7919 + seed as i64) % 41 - 20) as f64;
            let mut one = vec![0u8; es];
            reduce::scale_into(t, &mut one, &t.encode_f64(1.0), small).expect("scale");
            v[i * es..(i + 1) * es].copy_from_slice(&one);
        }
        v
    }

    /// The host C++ program: for every type, runs each kernel aligned and misaligned (offset by
    /// one element) and in place, writing the results to stdout.
    fn harness() -> String {
        let mut s = String::from(SOURCE);
        s += "\n#include <cstdio>\n#include <cstdlib>\n#include <cstring>\n";
        s += "template <class T> static T* rd(FILE* f, weft_size n) { T* p = (T*)aligned_alloc(16, (n * sizeof(T) + 15) / 16 * 16 + 16); if (fread(p, sizeof(T), n, f) != n) exit(3); return p; }\n";
        s += "template <class T> static void wr(const T* p, weft_size n) { fwrite(p, sizeof(T), n, stdout); }\n";
        s += "int main(int argc, char** argv) {\n  FILE* f = fopen(argv[1], \"rb\"); weft_size n; double fac; weft_size d;\n";
        s += "  if (fread(&n, 8, 1, f) != 1 || fread(&fac, 8, 1, f) != 1 || fread(&d, 8, 1, f) != 1) return 2;\n";
        for t in DataType::ALL {
            let ty = type_suffix(t);
            let ct = format!("weft_{ty}_t");
            s += &format!("  {{ {ct}* a = rd<{ct}>(f, n); {ct}* b = rd<{ct}>(f, n);\n");
            s += &format!(
                "    {ct}* o = ({ct}*)aligned_alloc(16, (n * sizeof({ct}) + 15) / 16 * 16 + 16);\n"
            );
            for op in ["sum", "prod", "min", "max"] {
                s += &format!("    weft_reduce_{op}_{ty}(o, a, b, n); wr(o, n);\n");
                s += &format!(
                    "    weft_reduce_{op}_{ty}(o + 1, a + 1, b + 1, n - 1); wr(o + 1, n - 1);\n"
                );
                s += &format!("    memcpy(o, a, n * sizeof({ct})); weft_reduce_{op}_{ty}(o, o, b, n); wr(o, n);\n");
            }
            s += &format!("    weft_scale_{ty}(o, a, fac, n); wr(o, n);\n");
            s += &format!(
                "    memcpy(o, a, n * sizeof({ct})); weft_divide_{ty}(o, d, n); wr(o, n);\n  }}\n"
            );
        }
        s += "  return 0;\n}\n";
        s
    }

    #[test]
    fn kernel_source_matches_the_cpu_kernels_on_the_host() {
        let Some(cxx) = ["c++", "g++", "clang++"].into_iter().find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        }) else {
            println!("skipped: no C++ compiler to build the kernel source on the host");
            return;
        };
        let dir = std::env::temp_dir().join(format!("weft-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = dir.join("k.cpp");
        let exe = dir.join("k");
        std::fs::write(&src, harness()).expect("write source");
        let out = std::process::Command::new(cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-DWEFT_HOST_TEST",
                "-fno-strict-aliasing",
            ])
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("run the C++ compiler");
        assert!(
            out.status.success(),
            "the kernel source does not compile as host C++:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for (case, (n, factor, divisor)) in [(1003usize, -2.5f64, 3usize), (64, 0.7, 300)]
            .into_iter()
            .enumerate()
        {
            let mut input = Vec::new();
            input.extend_from_slice(&(n as u64).to_le_bytes());
            input.extend_from_slice(&factor.to_le_bytes());
            input.extend_from_slice(&(divisor as u64).to_le_bytes());
            let mut per_type = Vec::new();
            for (k, t) in DataType::ALL.into_iter().enumerate() {
                let a = inputs(t, n, 11 + k as u64 + 100 * case as u64);
                let b = inputs(t, n, 7 + k as u64 + 100 * case as u64);
                input.extend_from_slice(&a);
                input.extend_from_slice(&b);
                per_type.push((t, a, b));
            }
            let file = dir.join(format!("in{case}"));
            std::fs::write(&file, &input).expect("write input");
            let run = std::process::Command::new(&exe)
                .arg(&file)
                .output()
                .expect("run host kernels");
            assert!(run.status.success(), "host kernels failed: {run:?}");
            let got = run.stdout;
            let mut at = 0usize;
            let mut take = |len: usize| {
                let s = got
                    .get(at..at + len)
                    .expect("host output too short")
                    .to_vec();
                at += len;
                s
            };
            for (t, a, b) in &per_type {
                let es = t.size();
                let nb = n * es;
                let check = |what: &str, got: Vec<u8>, want: Vec<u8>| {
                    for (i, (g, w)) in got.chunks(es).zip(want.chunks(es)).enumerate() {
                        assert!(
                            weftcc_collectives::testing::same_value(*t, g, w),
                            "{t} {what} element {i}: kernel {g:?}, CPU {w:?} (a {:?}, b {:?})",
                            &a[i * es..(i + 1) * es],
                            &b[i * es..(i + 1) * es]
                        );
                    }
                };
                for comb in [Combiner::Sum, Combiner::Prod, Combiner::Min, Combiner::Max] {
                    let mut want = vec![0u8; nb];
                    reduce::reduce_into(*t, comb, &mut want, a, b).expect("cpu reduce");
                    check(&format!("{comb:?}"), take(nb), want.clone());
                    check(
                        &format!("{comb:?} misaligned"),
                        take(nb - es),
                        want[es..].to_vec(),
                    );
                    check(&format!("{comb:?} in place"), take(nb), want);
                }
                let mut want = vec![0u8; nb];
                reduce::scale_into(*t, &mut want, a, factor).expect("cpu scale");
                check("scale", take(nb), want);
                let mut want = a.clone();
                reduce::divide_in_place(*t, &mut want, divisor).expect("cpu divide");
                check("divide", take(nb), want);
            }
            assert_eq!(at, got.len(), "unexpected trailing host output");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
