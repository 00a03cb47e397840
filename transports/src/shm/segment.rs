//! One shared-memory object: its mapping and header, how it is created (unlinked at once), and
//! the clean-up of objects a killed rank left behind.

use super::cma::CMA_COOKIE;
use super::layout::{
    Layout, H_CAPACITY, H_CMA_PROBE, H_CTRL_SIZE, H_HEADER_SIZE, H_MAGIC, H_NSLOTS, H_PID, H_RANK,
    H_SLOTS, H_TOTAL, H_VERSION, MAGIC, MAX_SLOTS, VERSION,
};
use super::space::{check_shm_space, shm_free_bytes, space_error, MAX_BUFFSIZE, MIN_BUFFSIZE};
use crate::error::{Result, TransportError};
use crate::util::{fnv1a64, ProcessWatch};
use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// `weft-<token>-`: how every segment name of a job begins (the token cut to what a name may hold).
pub(super) fn job_prefix(token: &str) -> String {
    let mut tok: String = token
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
        .take(48)
        .collect();
    if tok.is_empty() {
        tok.push_str("anon");
    }
    format!("weft-{tok}-")
}

/// How old a segment whose header was never written must be before it counts as abandoned:
/// making one takes microseconds, so an older one lost its creator while it was being made.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(5);

/// Removes the segments of job `token` that no live process will unlink: those whose creator
/// has exited, and those whose header was never written that are older than [`ORPHAN_GRACE`],
/// or of any age when `no_user_left` (every process of the job that could use this host's
/// /dev/shm has exited, so none is still making one). Ranks unlink each name right after
/// creating it, so only a rank killed in between leaves one; `weft run` calls this when a job
/// ends. Returns the names removed.
pub fn remove_orphan_segments(token: &str, no_user_left: bool) -> Vec<String> {
    let prefix = job_prefix(token);
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Ok(file) = entry.file_name().into_string() else {
            continue;
        };
        if !file.starts_with(&prefix) {
            continue;
        }
        let name = format!("/{file}");
        let abandoned = match Mapping::open(&name) {
            Ok(map) => ProcessWatch::new(map.owner_pid() as i32).exited(),
            Err(_) => entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| no_user_left || age > ORPHAN_GRACE),
        };
        if abandoned && nix::sys::mman::shm_unlink(name.as_str()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// A mapped segment (ours or a peer's). All access goes through raw pointers and atomics; no
/// Rust reference to the shared bytes outlives a single call.
pub(super) struct Mapping {
    pub(super) raw: MmapRaw,
    pub(super) layout: Layout,
}

impl Mapping {
    /// # Invariant
    /// Callers pass offsets inside the validated layout (`off + 8 <= total <= raw.len()`, 8-aligned).
    pub(super) fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.raw.len());
        // SAFETY: the mapping is valid for `raw.len()` bytes while `self` lives, page aligned, and
        // `off` is an 8-aligned offset inside it (layout invariant), so the pointer is valid and
        // aligned for an AtomicU64; shared memory is only ever accessed atomically at this offset.
        unsafe { AtomicU64::from_ptr(self.raw.as_mut_ptr().add(off).cast::<u64>()) }
    }

    pub(super) fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.raw.len());
        // SAFETY: as in `u64_at`, with a 4-aligned offset inside the mapping.
        unsafe { AtomicU32::from_ptr(self.raw.as_mut_ptr().add(off).cast::<u32>()) }
    }

    pub(super) fn slot_rank(&self, slot: usize) -> u32 {
        self.u32_at(H_SLOTS + 4 * slot).load(Ordering::Relaxed)
    }

    pub(super) fn owner_pid(&self) -> u32 {
        self.u32_at(H_PID).load(Ordering::Relaxed)
    }

    pub(super) fn owner_rank(&self) -> u32 {
        self.u32_at(H_RANK).load(Ordering::Relaxed)
    }

    /// Maps the existing object `name` and validates its header.
    pub(super) fn open(name: &str) -> Result<Mapping> {
        let fd = nix::sys::mman::shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| TransportError::SharedMemory(format!("shm_open {name}: {e}")))?;
        Mapping::from_fd(fd, name)
    }

    /// Maps the object behind `fd` (`name` names it in errors) and validates its header.
    pub(super) fn from_fd(fd: OwnedFd, name: &str) -> Result<Mapping> {
        let file = File::from(fd);
        let len = file
            .metadata()
            .map_err(|e| TransportError::io(format!("fstat {name}"), e))?
            .len();
        if len < 4096 {
            return Err(TransportError::SharedMemory(format!(
                "segment {name} is not initialized yet ({len} bytes)"
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| TransportError::SharedMemory(format!("segment {name} too large")))?;
        let raw = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| TransportError::io(format!("mmap {name}"), e))?;
        // A provisional layout covering just the header, to read the header fields.
        let probe = Mapping {
            raw,
            layout: Layout {
                nslots: 0,
                capacity: 0,
                header_size: 4096,
                ctrl_size: 4096,
                outbox_size: 0,
                total: 4096,
            },
        };
        let bad =
            |why: &str| TransportError::SharedMemory(format!("segment {name} is invalid: {why}"));
        if probe.u64_at(H_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(bad(
                "bad magic (not initialized yet, or not a weftcc segment)",
            ));
        }
        if probe.u32_at(H_VERSION).load(Ordering::Relaxed) != VERSION {
            return Err(bad("unsupported version"));
        }
        let nslots = probe.u32_at(H_NSLOTS).load(Ordering::Relaxed) as usize;
        let capacity = probe.u64_at(H_CAPACITY).load(Ordering::Relaxed);
        if nslots > MAX_SLOTS {
            return Err(bad("too many slots"));
        }
        let capacity = usize::try_from(capacity).map_err(|_| bad("capacity"))?;
        if !capacity.is_power_of_two() || !(MIN_BUFFSIZE..=MAX_BUFFSIZE).contains(&capacity) {
            return Err(bad("capacity is not a power of two in range"));
        }
        let layout = Layout::new(nslots, capacity).ok_or_else(|| bad("size overflow"))?;
        let stored = (
            probe.u64_at(H_HEADER_SIZE).load(Ordering::Relaxed),
            probe.u64_at(H_CTRL_SIZE).load(Ordering::Relaxed),
            probe.u64_at(H_TOTAL).load(Ordering::Relaxed),
        );
        if stored
            != (
                layout.header_size as u64,
                layout.ctrl_size as u64,
                layout.total as u64,
            )
        {
            return Err(bad("layout mismatch (different page size?)"));
        }
        if layout.total > probe.raw.len() {
            return Err(bad("file shorter than its layout"));
        }
        Ok(Mapping {
            raw: probe.raw,
            layout,
        })
    }
}

/// Names are unique per process and call: the object is unlinked right after it is made.
static OBJECT_SERIAL: AtomicU64 = AtomicU64::new(0);

/// Creates, sizes, reserves and initializes one shared-memory object owned by `rank`: a doorbell
/// header when `slot_peers` is empty, else one incoming ring per listed peer. Its name is
/// unlinked before it is sized, so the object is never left behind.
pub(super) fn create_object(
    token: &str,
    namespace: &str,
    rank: usize,
    slot_peers: &[usize],
    capacity: usize,
) -> Result<(OwnedFd, Mapping)> {
    let layout = Layout::new(slot_peers.len(), capacity)
        .ok_or_else(|| TransportError::Config("shared-memory object size overflows".into()))?;
    let per_peer = (layout.ctrl_size + layout.capacity) as u64;
    let free = shm_free_bytes().ok();
    if let Some(free) = free {
        check_shm_space(free, slot_peers.len(), per_peer)?;
    }
    let serial = OBJECT_SERIAL.fetch_add(1, Ordering::Relaxed);
    let name = format!(
        "/{}{:016x}-{rank}-{}-{serial}",
        job_prefix(token),
        fnv1a64(namespace.as_bytes()),
        std::process::id()
    );
    let fd = create_exclusive(&name)?;
    if let Err(e) = nix::sys::mman::shm_unlink(name.as_str()) {
        tracing::warn!(target: "weftcc::shm", segment = %name, error = %e, "shm_unlink failed");
    }
    init_object(fd, &name, layout, rank, slot_peers, free)
}

/// Sizes, reserves and writes the header of a new object (`free`: /dev/shm's free bytes, for
/// the error when the reservation fails).
pub(super) fn init_object(
    fd: OwnedFd,
    name: &str,
    layout: Layout,
    rank: usize,
    slot_peers: &[usize],
    free: Option<u64>,
) -> Result<(OwnedFd, Mapping)> {
    let per_peer = (layout.ctrl_size + layout.capacity) as u64;
    let file = File::from(fd);
    file.set_len(layout.total as u64)
        .map_err(|e| TransportError::io(format!("ftruncate {name}"), e))?;
    // Reserve the pages now: on tmpfs a later page fault beyond the size limit would be SIGBUS,
    // whereas fallocate reports ENOSPC cleanly.
    match nix::fcntl::posix_fallocate(file.as_raw_fd(), 0, layout.total as libc::off_t) {
        Ok(()) => {}
        Err(Errno::ENOSPC) => {
            return Err(space_error(
                free.unwrap_or(0),
                per_peer * slot_peers.len() as u64,
                slot_peers.len(),
                per_peer,
            ))
        }
        Err(Errno::EOPNOTSUPP) | Err(Errno::EINVAL) | Err(Errno::ENOSYS) => {}
        Err(e) => {
            return Err(TransportError::SharedMemory(format!(
                "fallocate {name}: {e}"
            )))
        }
    }
    let raw = MmapOptions::new()
        .len(layout.total)
        .map_raw(&file)
        .map_err(|e| TransportError::io(format!("mmap {name}"), e))?;
    let map = Mapping { raw, layout };
    map.u32_at(H_VERSION).store(VERSION, Ordering::Relaxed);
    map.u32_at(H_NSLOTS)
        .store(slot_peers.len() as u32, Ordering::Relaxed);
    map.u64_at(H_CAPACITY)
        .store(layout.capacity as u64, Ordering::Relaxed);
    map.u64_at(H_HEADER_SIZE)
        .store(layout.header_size as u64, Ordering::Relaxed);
    map.u64_at(H_CTRL_SIZE)
        .store(layout.ctrl_size as u64, Ordering::Relaxed);
    map.u64_at(H_TOTAL)
        .store(layout.total as u64, Ordering::Relaxed);
    map.u32_at(H_PID)
        .store(std::process::id(), Ordering::Relaxed);
    map.u32_at(H_RANK).store(rank as u32, Ordering::Relaxed);
    map.u64_at(H_CMA_PROBE)
        .store(std::ptr::addr_of!(CMA_COOKIE) as u64, Ordering::Relaxed);
    for (slot, &p) in slot_peers.iter().enumerate() {
        map.u32_at(H_SLOTS + 4 * slot)
            .store(p as u32, Ordering::Relaxed);
    }
    map.u64_at(H_MAGIC).store(MAGIC, Ordering::Release);
    Ok((OwnedFd::from(file), map))
}

pub(super) fn create_exclusive(name: &str) -> Result<std::os::fd::OwnedFd> {
    let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR;
    let mode = Mode::S_IRUSR | Mode::S_IWUSR;
    for _ in 0..2 {
        match nix::sys::mman::shm_open(name, flags, mode) {
            Ok(fd) => return Ok(fd),
            Err(Errno::EEXIST) => {
                // A leftover from a crashed job, or a live one with the same token.
                if let Ok(old) = Mapping::open(name) {
                    let pid = old.owner_pid() as i32;
                    if !ProcessWatch::new(pid).exited() {
                        return Err(TransportError::SharedMemory(format!(
                            "segment {name} already exists and belongs to live process {pid} \
                             (another job with the same token?)"
                        )));
                    }
                }
                tracing::warn!(target: "weftcc::shm", segment = name, "removing stale shared-memory segment");
                let _ = nix::sys::mman::shm_unlink(name);
            }
            Err(e) => {
                return Err(TransportError::SharedMemory(format!(
                    "shm_open {name}: {e}"
                )))
            }
        }
    }
    Err(TransportError::SharedMemory(format!(
        "could not create segment {name}"
    )))
}
