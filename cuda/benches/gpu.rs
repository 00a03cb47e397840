//! GPU microbenchmarks (`cargo bench -p weftcc-cuda --bench gpu`). Without a CUDA driver it
//! prints "skipped: no CUDA driver" and exits 0.
//!
//! 1. Device-to-device copy bandwidth (`cuMemcpyDtoDAsync` within one GPU), the reference.
//! 2. The reduction kernel (`weft_reduce_sum_f32`, `dst = a + b`): memory traffic (2 reads +
//!    1 write per element) per second, against the copy's (1 read + 1 write); target ≥ 80 %.
//! 3. CUDA IPC peer copy: a second process maps this process's buffer through an IPC handle and
//!    copies into it (NVLink/PCIe between two GPUs when there are two, otherwise the same GPU
//!    through the IPC mapping), against the D2D copy; target ≥ 90 %.
//!
//! All-reduce bus bandwidth for 2 and 4 ranks, 8 B to 1 GiB, is measured by `weft perf`:
//! `weft perf all-reduce --device cuda --np 2 -b 8 -e 1G` (and `--np 4`).

use std::time::Duration;
use weftcc_collectives::Combiner;
use weftcc_cuda::kernels::reduce_on_device;
use weftcc_cuda::{Context, CudaError, IpcHandle, IpcMapping, Stream};

const CHILD_ENV: &str = "WEFT_CUDA_BENCH_IPC_CHILD";
const ITERS: usize = 20;
const SIZES: [usize; 5] = [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30];

type R<T> = Result<T, CudaError>;

/// Seconds per call of `f` (enqueued ITERS times, timed with events after 3 warm-ups).
fn time(ctx: &Context, stream: &Stream, mut f: impl FnMut() -> R<()>) -> R<f64> {
    for _ in 0..3 {
        f()?;
    }
    let (a, b) = (ctx.event(true)?, ctx.event(true)?);
    a.record(stream)?;
    for _ in 0..ITERS {
        f()?;
    }
    b.record(stream)?;
    b.synchronize(Duration::from_secs(600))?;
    Ok(b.elapsed_ms(&a)? as f64 / 1e3 / ITERS as f64)
}

fn gbs(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn copy_and_reduce(ctx: &Context, stream: &Stream) -> R<Vec<f64>> {
    println!(
        "# D2D copy vs reduction kernel (sum, float), device {}",
        ctx.ordinal()
    );
    println!(
        "{:>12} {:>14} {:>16} {:>8}",
        "bytes", "copy GB/s", "reduce GB/s", "ratio"
    );
    let mut copy_bw = Vec::new();
    for &bytes in &SIZES {
        let n = bytes / 4;
        let src = ctx.alloc_zeroed::<f32>(n)?;
        let b = ctx.alloc_zeroed::<f32>(n)?;
        let mut dst = ctx.alloc_zeroed::<f32>(n)?;
        let t_copy = time(ctx, stream, || dst.copy_from_device(&src, stream))?;
        let t_red = time(ctx, stream, || {
            reduce_on_device(Combiner::Sum, &mut dst, &src, &b, stream)
        })?;
        // Memory traffic: the copy reads and writes `bytes`; the kernel reads 2x and writes 1x.
        let (c, r) = (gbs(2 * bytes, t_copy), gbs(3 * bytes, t_red));
        println!("{bytes:>12} {c:>14.1} {r:>16.1} {:>7.0}%", 100.0 * r / c);
        copy_bw.push(c);
    }
    Ok(copy_bw)
}

/// The child: maps the parent's buffer and times copies into it.
fn ipc_child(handle: &str) -> R<()> {
    let h = IpcHandle::from_text(handle).ok_or_else(|| CudaError::Other("bad handle".into()))?;
    let ndev = weftcc_cuda::device_count()?;
    let ctx = Context::new(if ndev > 1 { 1 } else { 0 })?;
    let stream = ctx.stream()?;
    let map = IpcMapping::open(&ctx, &h)?;
    println!(
        "# IPC peer copy from device {} into the parent's device 0",
        ctx.ordinal()
    );
    println!("{:>12} {:>14}", "bytes", "peer GB/s");
    for &bytes in SIZES.iter().filter(|&&b| b <= map.len()) {
        let src = ctx.alloc_zeroed::<u8>(bytes)?;
        let t = time(&ctx, &stream, || map.copy_from(0, &src, &stream))?;
        println!("{bytes:>12} {:>14.1}", gbs(2 * bytes, t));
    }
    Ok(())
}

fn ipc_parent(ctx: &Context) -> R<()> {
    let buf = ctx.alloc_zeroed::<u8>(*SIZES.last().unwrap_or(&(1 << 20)))?;
    let handle = IpcHandle::export(&buf)?;
    let exe = std::env::current_exe().map_err(|e| CudaError::Other(e.to_string()))?;
    let status = std::process::Command::new(exe)
        .env(CHILD_ENV, handle.to_text())
        .status()
        .map_err(|e| CudaError::Other(e.to_string()))?;
    if !status.success() {
        return Err(CudaError::Other(format!("IPC child failed: {status}")));
    }
    println!("# (peer GB/s counts read + write like the copy column; compare the two)");
    Ok(())
}

fn main() {
    if let Ok(h) = std::env::var(CHILD_ENV) {
        if let Err(e) = ipc_child(&h) {
            eprintln!("IPC child: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = weftcc_cuda::ensure_driver() {
        println!("skipped: no CUDA driver ({e})");
        return;
    }
    let run = || -> R<()> {
        let info = weftcc_cuda::device_info(0)?;
        println!(
            "# {} ({}), driver {}",
            info.name,
            info.pci_bus_id,
            weftcc_cuda::driver_version()?
        );
        print!("{}", weftcc_cuda::p2p_report()?);
        let ctx = Context::new(0)?;
        let stream = ctx.stream()?;
        copy_and_reduce(&ctx, &stream)?;
        ipc_parent(&ctx)
    };
    if let Err(e) = run() {
        eprintln!("bench failed: {e}");
        std::process::exit(1);
    }
}
