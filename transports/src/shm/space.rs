//! How large rings are, and whether /dev/shm and the host can hold them.

use super::layout::Layout;
use crate::error::{Result, TransportError};

/// Default ring capacity (bytes per directed peer pair): 1 MiB. Four 256 KiB slices in flight
/// keep large transfers pipelined, and a ring this small stays in cache (a larger one cycles
/// through memory and slows mid-size transfers).
pub const DEFAULT_BUFFSIZE: usize = 1 << 20;
/// Smallest ring capacity accepted: 64 KiB.
pub const MIN_BUFFSIZE: usize = 64 << 10;
/// Largest ring capacity accepted: 1 GiB.
pub const MAX_BUFFSIZE: usize = 1 << 30;

pub(super) const MIB: u64 = 1 << 20;

/// Normalizes a requested ring size: rounded up to a power of two and clamped to
/// [`MIN_BUFFSIZE`]..=[`MAX_BUFFSIZE`].
pub fn ring_capacity(requested: usize) -> usize {
    requested
        .clamp(MIN_BUFFSIZE, MAX_BUFFSIZE)
        .checked_next_power_of_two()
        .unwrap_or(MAX_BUFFSIZE)
        .min(MAX_BUFFSIZE)
}

fn fmt_mib(bytes: u64) -> String {
    if bytes >= MIB {
        format!("{} MiB", (bytes + MIB / 2) / MIB)
    } else {
        format!("{} KiB", bytes.div_ceil(1024))
    }
}

pub(super) fn space_error(free: u64, needed: u64, peers: usize, per_peer: u64) -> TransportError {
    TransportError::SharedMemory(format!(
        "/dev/shm has {} free but this communicator needs {} ({} peer{} × {}); enlarge it \
         (docker run --shm-size=…, or mount -o remount,size=… /dev/shm) or set \
         WEFT_SHM_DISABLE=1 to use TCP",
        fmt_mib(free),
        fmt_mib(needed),
        peers,
        if peers == 1 { "" } else { "s" },
        fmt_mib(per_peer),
    ))
}

/// Checks that `free_bytes` of shared memory are enough for `peers` rings of `per_peer_bytes`
/// each; the error explains how to enlarge /dev/shm or fall back to TCP.
pub fn check_shm_space(free_bytes: u64, peers: usize, per_peer_bytes: u64) -> Result<()> {
    let needed = per_peer_bytes.saturating_mul(peers as u64);
    if needed > free_bytes {
        return Err(space_error(free_bytes, needed, peers, per_peer_bytes));
    }
    Ok(())
}

/// Checks that `ranks` ranks on one host, each with `rings` incoming rings of `per_ring_bytes`,
/// fit in what the host can hold at all: /dev/shm's size and nine tenths of its memory (tmpfs
/// pages are memory; past that the kernel's OOM killer, not an error, would stop the job). Every
/// rank computes the same answer, so all of them fail alike, before anything is made.
pub fn check_host_shm(
    ranks: usize,
    rings: usize,
    per_ring_bytes: u64,
    shm_size: Option<u64>,
    memory: Option<u64>,
) -> Result<()> {
    let rings = (ranks as u64).saturating_mul(rings as u64);
    let needed = rings.saturating_mul(per_ring_bytes);
    let limit = [shm_size, memory.map(|m| m / 10 * 9)]
        .into_iter()
        .flatten()
        .min();
    match limit {
        Some(limit) if needed > limit => Err(TransportError::SharedMemory(format!(
            "{ranks} ranks on this host need {} of shared memory ({rings} rings of {}), more \
             than it can hold ({}{}); run fewer ranks per host, set a smaller WEFT_BUFFSIZE, or \
             WEFT_SHM_DISABLE=1 to use TCP",
            fmt_mib(needed),
            fmt_mib(per_ring_bytes),
            shm_size.map_or(String::new(), |s| format!("/dev/shm {}", fmt_mib(s))),
            memory.map_or(String::new(), |m| format!(", memory {}", fmt_mib(m))),
        ))),
        _ => Ok(()),
    }
}

/// Default ring capacity for `local_ranks` ranks sharing memory on one host:
/// [`DEFAULT_BUFFSIZE`] up to 32 ranks, then halved as the rank count doubles (256 ranks: 128 KiB),
/// never under [`MIN_BUFFSIZE`], so that the rings of a full node stay a small share of memory.
pub fn auto_capacity(local_ranks: usize) -> usize {
    let budget = 32 * DEFAULT_BUFFSIZE / local_ranks.max(1).next_power_of_two();
    budget.clamp(MIN_BUFFSIZE, DEFAULT_BUFFSIZE)
}

/// The size of /dev/shm and this host's memory (`MemTotal`), where they can be read.
pub fn host_shm_limits() -> (Option<u64>, Option<u64>) {
    let shm = nix::sys::statvfs::statvfs("/dev/shm")
        .ok()
        .map(|st| st.blocks().saturating_mul(st.fragment_size()));
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib.saturating_mul(1024))
        });
    (shm, memory)
}

/// The bytes of one incoming ring of `capacity` bytes, its control page included.
pub fn ring_bytes(capacity: usize) -> u64 {
    let capacity = ring_capacity(capacity);
    Layout::new(1, capacity).map_or(u64::MAX, |l| (l.ctrl_size + l.capacity) as u64)
}

/// Free bytes in /dev/shm (as `statvfs` reports them to unprivileged users).
pub fn shm_free_bytes() -> Result<u64> {
    let st = nix::sys::statvfs::statvfs("/dev/shm")
        .map_err(|e| TransportError::SharedMemory(format!("statvfs /dev/shm: {e}")))?;
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}
