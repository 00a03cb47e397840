//! One rank of a `cudarc::nccl` program (started by `weft run -n N`), checking that it runs on
//! weftcc's `libnccl.so` (found through `LD_LIBRARY_PATH`, as cudarc's dynamic loading finds
//! NVIDIA's): all-reduce, broadcast, all-gather and reduce-scatter on device buffers, each
//! checked against exact values. Rank 0 shares the NCCL unique id through a file in DIR.
//! Without a CUDA driver it prints why and exits 0 (skipped); without weftcc's library on the
//! path it fails.
//!
//!     cudarc-nccl DIR

use std::process::ExitCode;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};

fn env_number(name: &str) -> Result<usize, String> {
    std::env::var(name)
        .map_err(|_| format!("{name} unset: run under weft run (or torchrun)"))?
        .parse()
        .map_err(|e| format!("{name}: {e}"))
}

/// Rank 0 writes the id into `dir/cudarc-id`; the others wait for it.
fn share_id(dir: &std::path::Path, rank: usize) -> Result<Id, String> {
    let path = dir.join("cudarc-id");
    if rank == 0 {
        let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
        let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let tmp = dir.join("cudarc-id.tmp");
        std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, &path).map_err(|e| e.to_string())?;
        return Ok(id);
    }
    for _ in 0..60_000 {
        if let Ok(bytes) = std::fs::read(&path) {
            if bytes.len() == 128 {
                let mut internal = [0 as std::ffi::c_char; 128];
                for (d, s) in internal.iter_mut().zip(bytes) {
                    *d = s as std::ffi::c_char;
                }
                return Ok(Id::uninit(internal));
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Err(format!("no unique id in {}", path.display()))
}

fn run() -> Result<bool, String> {
    // SAFETY: only tries to load libcuda (no CUDA call is made without it).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: no CUDA driver (libcuda.so) on this machine");
        return Ok(true);
    }
    // SAFETY: as above, for libnccl.so.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(
            "no libnccl.so on the library path: put weftcc's (target/release) on LD_LIBRARY_PATH"
                .into(),
        );
    }
    // SAFETY: a static string of the library, read at once.
    let text = unsafe {
        std::ffi::CStr::from_ptr(cudarc::nccl::sys::ncclGetErrorString(
            cudarc::nccl::sys::ncclResult_t::ncclSuccess,
        ))
    };
    let text = text.to_string_lossy();
    if !text.contains("weftcc") {
        return Err(format!(
            "the libnccl.so loaded is not weftcc's (ncclGetErrorString: {text:?})"
        ));
    }
    let dir = std::path::PathBuf::from(std::env::args().nth(1).ok_or("usage: cudarc-nccl DIR")?);
    let (rank, n) = (env_number("RANK")?, env_number("WORLD_SIZE")?);
    let local = env_number("LOCAL_RANK").unwrap_or(rank);
    let devices = CudaContext::device_count().map_err(|e| format!("{e:?}"))? as usize;
    let ctx = CudaContext::new(local % devices.max(1)).map_err(|e| format!("{e:?}"))?;
    let stream = ctx.default_stream();
    let id = share_id(&dir, rank)?;
    let comm = Comm::from_rank(stream.clone(), rank, n, id)
        .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
    let cuda = |e: cudarc::driver::DriverError| format!("{e:?}");
    let nccl = |e: cudarc::nccl::result::NcclError| format!("{e:?}");
    let mut ok = true;
    // Copies `got` back to the host and compares it with `want`.
    let mut check = |what: &str, got: &CudaSlice<f32>, want: Vec<f32>| -> Result<(), String> {
        let got = stream.clone_dtoh(got).map_err(cuda)?;
        if got != want {
            eprintln!(
                "rank {rank}: {what}: got {:?}…, want {:?}…",
                &got[..got.len().min(4)],
                &want[..want.len().min(4)]
            );
            ok = false;
        }
        Ok(())
    };

    let count = 1 << 16;
    let send = stream
        .clone_htod(&vec![(rank + 1) as f32; count])
        .map_err(cuda)?;
    let mut recv = stream.alloc_zeros::<f32>(count).map_err(cuda)?;
    comm.all_reduce(&send, &mut recv, &ReduceOp::Sum)
        .map_err(nccl)?;
    check("all_reduce", &recv, vec![(n * (n + 1) / 2) as f32; count])?;

    let mut b = stream.clone_htod(&vec![rank as f32; count]).map_err(cuda)?;
    comm.broadcast_in_place(&mut b, 0).map_err(nccl)?;
    check("broadcast", &b, vec![0.0; count])?;

    let mut gathered = stream.alloc_zeros::<f32>(count * n).map_err(cuda)?;
    let mine = stream.clone_htod(&vec![rank as f32; count]).map_err(cuda)?;
    comm.all_gather(&mine, &mut gathered).map_err(nccl)?;
    let want: Vec<f32> = (0..n).flat_map(|r| vec![r as f32; count]).collect();
    check("all_gather", &gathered, want)?;

    let mut part = stream.alloc_zeros::<f32>(count).map_err(cuda)?;
    comm.reduce_scatter(&gathered, &mut part, &ReduceOp::Sum)
        .map_err(nccl)?;
    check("reduce_scatter", &part, vec![(n * rank) as f32; count])?;
    stream.synchronize().map_err(cuda)?;
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cudarc-nccl: {e}");
            ExitCode::FAILURE
        }
    }
}
