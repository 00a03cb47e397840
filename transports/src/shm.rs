//! Same-host transport: byte rings in POSIX shared memory with futex doorbells.
//!
//! Each rank has a doorbell object (a header only) and makes one *incoming* ring object per
//! connected local peer ([`ShmEndpoint`]). Objects are created under a unique name in /dev/shm and
//! unlinked at once; the peer maps them from descriptors passed over a Unix socket. A sender
//! writes into the ring the receiver made; the receiver reads from its own ring and lends the
//! bytes in place (zero copy). Layout of an object (doorbell: 0 slots; ring: 1 slot; all offsets
//! are multiples of the page size, at least 4 KiB):
//!
//! ```text
//! header (1+ pages): magic u64 | version u32 | nslots u32 | capacity u64 | header size u64 |
//!                    ring control size u64 | total size u64 | owner pid u32 | owner rank u32 |
//!   @64:  doorbell AtomicU32, sleeping-waiters count AtomicU32   (one cache line)
//!   @128: slot table, one u32 per slot = the rank of the peer that writes that ring
//! ring i: control page: @0 head AtomicU64 (bytes written, by the sender)
//!                       @64 tail AtomicU64 (bytes consumed, by the receiver)
//!                       @128 sender-closed AtomicU32, @192 receiver-closed AtomicU32
//!         data area: `capacity` bytes (power of two), page aligned
//! ```
//!
//! Signalling: after publishing `head` (or `tail`) with Release, a side increments the other
//! side's doorbell and, if that side's sleeping count is non-zero, wakes it with `FUTEX_WAKE` (a
//! shared futex: the waker may live in another process). [`ShmWaiter`] raises the sleeping count,
//! compares the doorbell with the value it saw when it last returned, and only then sleeps in
//! `FUTEX_WAIT`; with SeqCst on both count and doorbell either the waker sees the count or the
//! waiter sees the new doorbell value, and `FUTEX_WAIT` itself rechecks the value atomically, so
//! no wake-up is lost.
//!
//! The receiver keeps the head it last read and reads it again only when those bytes are used up,
//! and publishes its tail lazily: when it has consumed every byte it knows of (the sender may be
//! waiting for space), when its reader stopped short of what it was offered, or once an eighth
//! of the ring is consumed but unreleased. While the sender runs ahead, small reads then touch
//! neither the line the sender keeps writing nor the sender's doorbell.
//!
//! Liveness: a dropped connection sets its closed flags; a dead process is found through a pidfd
//! (readable once the process exited, zombies included), falling back to `kill(pid, 0)`.
//!
//! Single copy for large writes: a write of at least [`cma_min_bytes`] is not copied into the
//! ring. The sender posts a *reference* (its address and length, and the ring position it stands
//! at) in the ring's control page and accepts the bytes only as the receiver reports them copied;
//! the receiver copies them straight out of the sender's address space with
//! `process_vm_readv` (cross-memory attach), into the caller's destination when the engine
//! receives into memory ([`Connection::try_recv_into`]) or into a small staging buffer it lends
//! to a reduction. A received copy step then costs one copy instead of two. The receiver enables
//! this per ring at connect time, after reading a cookie out of the sender's memory proves that
//! the kernel allows it (same user, no ptrace restriction); otherwise (and with
//! `WEFT_SHM_CMA=0`) every byte goes through the ring.
//!
//! ```text
//! ring control page, continued: @256 CMA enabled u32 (receiver) | @320 refs posted u64 (sender)
//!   @384 refs finished u64 (receiver) | @448 reference bytes copied, all refs u64 (receiver)
//!   @512 reference slots: { ring position u64, address u64, length u64, pad } × REF_SLOTS
//!   @640 low-latency messages consumed u64 (receiver)
//!   @1024 low-latency slots (below)
//!   @5120 farewell length u64 (sender) | @5128 farewell bytes, up to FAREWELL_MAX (sender)
//! ```
//!
//! Farewell: a sender that is failing leaves its reason in its ring's control page
//! ([`Connection::leave_farewell`]: the bytes as words, then the length with Release) before it
//! closes; the receiver that sees the close reads it ([`Connection::farewell`]) and can report
//! the cause instead of only the close, even when the bootstrap store is gone.
//!
//! Low-latency messages for small writes (up to [`LL_MAX`] bytes, the idea of NCCL's LL protocol
//! and OpenMPI's fast boxes): the data goes into a slot of cache lines that each end with an
//! 8-byte flag, the message's sequence number, stored with Release after the line's data. The
//! receiver polls the next slot's flags; when a line's flag turns up, the same cache-line transfer
//! brought its data, where a ring write costs two dependent transfers (the head, then the data).
//! A header of 40 bytes and 8 bytes of data fill the first line exactly.
//!
//! ```text
//! slot (LL_SLOT_LINES × 64 bytes): line 0: data[48] | ring position u32 | length u32 | flag u64
//!                                  line j: data[56] | flag u64
//! ```
//!
//! Splits at word boundaries only: low-latency messages and references carry whole 8-byte words
//! of the stream, starting at a word boundary (a write that does not qualify goes through the
//! ring). Ring positions then stay congruent to stream positions modulo 8, so no 8-byte word
//! straddles the ring's end, a message or a reference, and a reader that consumes whole
//! elements (the engine's reductions) never finds an element's start lent without its end
//! being lendable next (that would stall it).
//!
//! Order with the ring and references: a message records the ring position (bytes written to the
//! ring before it) at which it belongs in the stream. The receiver serves it when its tail reaches
//! that position, before a reference posted at the same position (a pending reference stops the
//! sender, so a message at its position was written first), and lends ring bytes only up to it.
//! The receiver reads the references, then the ring head, then the slot: head and the reference
//! count are stored with Release after any earlier message, so neither ring bytes nor a reference
//! written after a message are ever seen without the message.

use crate::conn::{Connection, IdleWaiter, Interest, FAREWELL_MAX};
use crate::error::{Result, TransportError};
use crate::ring::{RecvCursor, SendCursor};
use crate::util::{env_nonempty, fnv1a64, futex_wait, futex_wake, parse_size, ProcessWatch};
use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Default ring capacity (bytes per directed peer pair): 1 MiB. Four 256 KiB slices in flight
/// keep large transfers pipelined, and a ring this small stays in cache (a larger one cycles
/// through memory and slows mid-size transfers).
pub const DEFAULT_BUFFSIZE: usize = 1 << 20;
/// Smallest ring capacity accepted: 64 KiB.
pub const MIN_BUFFSIZE: usize = 64 << 10;
/// Largest ring capacity accepted: 1 GiB.
pub const MAX_BUFFSIZE: usize = 1 << 30;

const MAGIC: u64 = 0x5745_4654_5348_4d31; // "WEFTSHM1"
const VERSION: u32 = 4;
const MAX_SLOTS: usize = 1 << 16;

// Header offsets.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_NSLOTS: usize = 12;
const H_CAPACITY: usize = 16;
const H_HEADER_SIZE: usize = 24;
const H_CTRL_SIZE: usize = 32;
const H_TOTAL: usize = 40;
const H_PID: usize = 48;
const H_RANK: usize = 52;
const H_DOORBELL: usize = 64;
const H_SLEEPING: usize = 68;
/// Address, in the owner's process, of [`CMA_COOKIE`] (peers read it to test cross-memory attach).
const H_CMA_PROBE: usize = 72;
const H_SLOTS: usize = 128;

// Ring control offsets.
const R_HEAD: usize = 0;
const R_TAIL: usize = 64;
const R_SENDER_CLOSED: usize = 128;
const R_RECEIVER_CLOSED: usize = 192;
const R_CMA_OK: usize = 256;
const R_REF_HEAD: usize = 320;
const R_REF_TAIL: usize = 384;
const R_REF_COPIED: usize = 448;
const R_REFS: usize = 512;
const REF_SLOT_BYTES: usize = 32;
const REF_SLOTS: u64 = 4;
const R_LL_DONE: usize = 640;
const R_LL: usize = 1024;
/// The sender's farewell note: its length (u64, stored last with Release), then its bytes as
/// little-endian words.
const R_FAREWELL_LEN: usize = R_LL + LL_SLOTS as usize * LL_SLOT_BYTES;
const R_FAREWELL: usize = R_FAREWELL_LEN + 8;
/// Bytes the ring control region needs (rounded up to whole pages in the layout).
const CTRL_BYTES: usize = R_FAREWELL + FAREWELL_MAX;

const LL_LINE: usize = 64;
const LL_SLOT_LINES: usize = 8;
const LL_SLOT_BYTES: usize = LL_LINE * LL_SLOT_LINES;
const LL_SLOTS: u64 = 8;
/// Data bytes in the first line of a slot (after them: ring position, length, flag).
const LL_FIRST_DATA: usize = 48;
/// Data bytes in every further line (after them: the flag).
const LL_LINE_DATA: usize = 56;
const LL_FLAG: usize = 56;
/// Largest write sent as a low-latency message: 440 bytes (one slot).
pub const LL_MAX: usize = LL_FIRST_DATA + (LL_SLOT_LINES - 1) * LL_LINE_DATA;

/// What peers read out of this process to prove that `process_vm_readv` works.
static CMA_COOKIE: u64 = MAGIC ^ 0x00c0_ffee_00c0_ffee;
/// Default smallest write sent by reference (`WEFT_SHM_CMA_MIN`).
pub const DEFAULT_CMA_MIN: usize = 64 << 10;
/// Staging for references the receiver lends to a reduction (one slice's worth).
const CMA_STAGE_BYTES: usize = 256 << 10;

/// Smallest write sent by reference instead of through the ring: `WEFT_SHM_CMA_MIN` bytes
/// (default [`DEFAULT_CMA_MIN`]); `None` when `WEFT_SHM_CMA=0` disables single copy.
pub fn cma_min_bytes() -> Option<usize> {
    if env_nonempty("WEFT_SHM_CMA").is_some_and(|v| v == "0") {
        return None;
    }
    Some(
        env_nonempty("WEFT_SHM_CMA_MIN")
            .and_then(|v| parse_size(&v).ok())
            .unwrap_or(DEFAULT_CMA_MIN)
            .max(8),
    )
}

/// Largest write a sender posts as a low-latency message: `WEFT_SHM_LL_MAX` bytes, clamped to
/// [`LL_MAX`] (the default); 0 sends every write through the ring. Receivers always accept them.
pub fn ll_max_bytes() -> usize {
    env_nonempty("WEFT_SHM_LL_MAX")
        .and_then(|v| parse_size(&v).ok())
        .map_or(LL_MAX, |v| v.min(LL_MAX))
}

/// Lines a low-latency message of `len` bytes occupies.
fn ll_lines(len: usize) -> usize {
    1 + len.saturating_sub(LL_FIRST_DATA).div_ceil(LL_LINE_DATA)
}

/// Where line `line` of a low-latency message of `len` bytes starts in the message, and how
/// many of its bytes it carries.
fn ll_line_span(line: usize, len: usize) -> (usize, usize) {
    let (start, room) = if line == 0 {
        (0, LL_FIRST_DATA)
    } else {
        (LL_FIRST_DATA + (line - 1) * LL_LINE_DATA, LL_LINE_DATA)
    };
    (start, room.min(len - start))
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst`; returns how many were copied.
fn cma_read(pid: i32, addr: u64, dst: &mut [u8]) -> std::result::Result<usize, Errno> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    use std::io::IoSliceMut;
    let len = dst.len();
    let remote = [RemoteIoVec {
        base: addr as usize,
        len,
    }];
    process_vm_readv(
        nix::unistd::Pid::from_raw(pid),
        &mut [IoSliceMut::new(dst)],
        &remote,
    )
}

const MIB: u64 = 1 << 20;

/// Normalizes a requested ring size: rounded up to a power of two and clamped to
/// [`MIN_BUFFSIZE`]..=[`MAX_BUFFSIZE`].
pub fn ring_capacity(requested: usize) -> usize {
    requested
        .clamp(MIN_BUFFSIZE, MAX_BUFFSIZE)
        .checked_next_power_of_two()
        .unwrap_or(MAX_BUFFSIZE)
        .min(MAX_BUFFSIZE)
}

/// The ring capacity from `WEFT_BUFFSIZE` (bytes, `K`/`M`/`G` suffixes accepted), normalized by
/// [`ring_capacity`]; [`DEFAULT_BUFFSIZE`] when unset.
pub fn buffsize_from_env() -> Result<usize> {
    match env_nonempty("WEFT_BUFFSIZE") {
        Some(v) => parse_size(&v)
            .map(ring_capacity)
            .map_err(|e| TransportError::Config(format!("WEFT_BUFFSIZE: {e}"))),
        None => Ok(DEFAULT_BUFFSIZE),
    }
}

/// `weft-<token>-`: how every segment name of a job begins (the token cut to what a name may hold).
fn job_prefix(token: &str) -> String {
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

/// The host's page size (at least 4 KiB).
pub fn page_size() -> usize {
    // SAFETY: sysconf takes an integer constant and touches no memory.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 && (p as usize).is_power_of_two() {
        (p as usize).max(4096)
    } else {
        4096
    }
}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// Sizes of one segment, computed from its slot count and ring capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    nslots: usize,
    capacity: usize,
    header_size: usize,
    ctrl_size: usize,
    total: usize,
}

impl Layout {
    fn new(nslots: usize, capacity: usize) -> Option<Layout> {
        let page = page_size();
        let header_size = round_up(H_SLOTS + 4 * nslots, page)?;
        let ctrl_size = round_up(CTRL_BYTES, page)?;
        let per = ctrl_size.checked_add(capacity)?;
        let total = header_size.checked_add(per.checked_mul(nslots)?)?;
        Some(Layout {
            nslots,
            capacity,
            header_size,
            ctrl_size,
            total,
        })
    }

    fn ring_offset(&self, slot: usize) -> usize {
        self.header_size + slot * (self.ctrl_size + self.capacity)
    }
}

/// The bytes one segment needs for `peers` incoming rings of `capacity` bytes each.
pub fn segment_size(peers: usize, capacity: usize) -> Option<usize> {
    Layout::new(peers, capacity).map(|l| l.total)
}

fn fmt_mib(bytes: u64) -> String {
    if bytes >= MIB {
        format!("{} MiB", (bytes + MIB / 2) / MIB)
    } else {
        format!("{} KiB", bytes.div_ceil(1024))
    }
}

fn space_error(free: u64, needed: u64, peers: usize, per_peer: u64) -> TransportError {
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

/// A mapped segment (ours or a peer's). All access goes through raw pointers and atomics; no
/// Rust reference to the shared bytes outlives a single call.
struct Mapping {
    raw: MmapRaw,
    layout: Layout,
}

impl Mapping {
    /// # Invariant
    /// Callers pass offsets inside the validated layout (`off + 8 <= total <= raw.len()`, 8-aligned).
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.raw.len());
        // SAFETY: the mapping is valid for `raw.len()` bytes while `self` lives, page aligned, and
        // `off` is an 8-aligned offset inside it (layout invariant), so the pointer is valid and
        // aligned for an AtomicU64; shared memory is only ever accessed atomically at this offset.
        unsafe { AtomicU64::from_ptr(self.raw.as_mut_ptr().add(off).cast::<u64>()) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.raw.len());
        // SAFETY: as in `u64_at`, with a 4-aligned offset inside the mapping.
        unsafe { AtomicU32::from_ptr(self.raw.as_mut_ptr().add(off).cast::<u32>()) }
    }

    fn doorbell(&self) -> &AtomicU32 {
        self.u32_at(H_DOORBELL)
    }

    fn sleeping(&self) -> &AtomicU32 {
        self.u32_at(H_SLEEPING)
    }

    /// Signals the owner of this segment: new data or freed space.
    fn ring_doorbell(&self) {
        self.doorbell().fetch_add(1, Ordering::SeqCst);
        if self.sleeping().load(Ordering::SeqCst) != 0 {
            futex_wake(self.doorbell());
        }
    }

    fn slot_rank(&self, slot: usize) -> u32 {
        self.u32_at(H_SLOTS + 4 * slot).load(Ordering::Relaxed)
    }

    fn owner_pid(&self) -> u32 {
        self.u32_at(H_PID).load(Ordering::Relaxed)
    }

    fn owner_rank(&self) -> u32 {
        self.u32_at(H_RANK).load(Ordering::Relaxed)
    }

    /// Maps the existing object `name` and validates its header.
    fn open(name: &str) -> Result<Mapping> {
        let fd = nix::sys::mman::shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| TransportError::SharedMemory(format!("shm_open {name}: {e}")))?;
        Mapping::from_fd(fd, name)
    }

    /// Maps the object behind `fd` (`name` names it in errors) and validates its header.
    fn from_fd(fd: OwnedFd, name: &str) -> Result<Mapping> {
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

/// This rank's shared memory: its doorbell (a header-only object every connected peer maps) and
/// the factory of its incoming rings, one per connected peer.
///
/// Every object is created under a unique name in /dev/shm and unlinked at once: peers receive
/// its file descriptor over a Unix socket ([`ShmEndpoint::connect_over`]) instead of opening a
/// name, so the memory lives exactly as long as a process holds a descriptor or mapping of it,
/// and a job killed with SIGKILL leaves nothing in /dev/shm. /dev/shm's size still bounds it (an
/// unlinked tmpfs file keeps its pages until the last mapping goes).
pub struct ShmEndpoint {
    bell: Arc<Mapping>,
    bell_fd: OwnedFd,
    token: String,
    namespace: String,
    rank: usize,
    capacity: usize,
}

/// A ring this rank made for one peer to write into, not yet connected.
pub struct IncomingRing {
    fd: OwnedFd,
    map: Mapping,
    peer: usize,
}

impl IncomingRing {
    /// The descriptor the peer maps.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl ShmEndpoint {
    /// Creates this rank's doorbell; rings made later hold `capacity` bytes (normalized by
    /// [`ring_capacity`]).
    pub fn create(
        token: &str,
        namespace: &str,
        rank: usize,
        capacity: usize,
    ) -> Result<ShmEndpoint> {
        if rank > u32::MAX as usize {
            return Err(TransportError::Config(format!(
                "rank {rank} too large for shared memory"
            )));
        }
        let capacity = ring_capacity(capacity);
        let (bell_fd, bell) = create_object(token, namespace, rank, &[], capacity)?;
        Ok(ShmEndpoint {
            bell: Arc::new(bell),
            bell_fd,
            token: token.to_string(),
            namespace: namespace.to_string(),
            rank,
            capacity,
        })
    }

    /// The rank this endpoint belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ring capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The doorbell's descriptor (peers map it to wake this rank).
    pub fn bell_fd(&self) -> BorrowedFd<'_> {
        self.bell_fd.as_fd()
    }

    /// Makes the ring `peer` will write into; /dev/shm's free space is checked first.
    pub fn incoming_ring(&self, peer: usize) -> Result<IncomingRing> {
        if peer == self.rank || peer > u32::MAX as usize {
            return Err(TransportError::Config(format!(
                "invalid peer rank {peer} for shared memory"
            )));
        }
        let (fd, map) = create_object(
            &self.token,
            &self.namespace,
            self.rank,
            &[peer],
            self.capacity,
        )?;
        Ok(IncomingRing { fd, map, peer })
    }

    /// Connects to `peer` given this rank's ring for it and the peer's doorbell and ring for this
    /// rank (descriptors it sent): maps them, checks they are what they claim, and attaches.
    pub fn connect(
        &self,
        incoming: IncomingRing,
        peer_bell: OwnedFd,
        peer_ring: OwnedFd,
    ) -> Result<ShmConnection> {
        let peer = incoming.peer;
        let bell = Mapping::from_fd(peer_bell, &format!("rank {peer}'s doorbell"))?;
        let remote = Mapping::from_fd(peer_ring, &format!("rank {peer}'s ring"))?;
        if bell.owner_rank() as usize != peer || bell.layout.nslots != 0 {
            return Err(TransportError::SharedMemory(format!(
                "rank {peer} sent a doorbell of rank {} with {} rings",
                bell.owner_rank(),
                bell.layout.nslots
            )));
        }
        if remote.owner_rank() as usize != peer
            || remote.layout.nslots != 1
            || remote.slot_rank(0) as usize != self.rank
        {
            return Err(TransportError::SharedMemory(format!(
                "rank {peer} sent a ring of rank {} for rank {}, expected its ring for rank {}",
                remote.owner_rank(),
                remote.slot_rank(0),
                self.rank
            )));
        }
        ShmConnection::attach(
            peer,
            Arc::new(incoming.map),
            Arc::new(remote),
            Arc::new(bell),
        )
    }

    /// Connects to `peer` over a connected Unix stream whose other end runs this same call:
    /// each side makes its incoming ring, sends its doorbell's and that ring's descriptors,
    /// receives the peer's, and attaches. Waits at most `timeout` for the peer.
    pub fn connect_over(
        &self,
        peer: usize,
        stream: &UnixStream,
        timeout: Duration,
    ) -> Result<ShmConnection> {
        let incoming = self.incoming_ring(peer)?;
        let io = |e: std::io::Error| {
            TransportError::io(format!("exchanging shared memory with rank {peer}"), e)
        };
        stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io)?;
        stream
            .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io)?;
        let mut frame = [0u8; 8];
        frame[..4].copy_from_slice(&FD_FRAME_MAGIC.to_le_bytes());
        frame[4..].copy_from_slice(&(self.rank as u32).to_le_bytes());
        crate::util::send_fds(stream, &frame, &[self.bell_fd.as_fd(), incoming.fd()]).map_err(
            |e| TransportError::io_with(peer, format!("sending shared memory to rank {peer}"), e),
        )?;
        let mut got = [0u8; 8];
        let fds = crate::util::recv_fds(stream, &mut got, 2).map_err(|e| {
            TransportError::io_with(peer, format!("receiving shared memory from rank {peer}"), e)
        })?;
        let magic = u32::from_le_bytes([got[0], got[1], got[2], got[3]]);
        let from = u32::from_le_bytes([got[4], got[5], got[6], got[7]]) as usize;
        if magic != FD_FRAME_MAGIC || from != peer || fds.len() != 2 {
            return Err(TransportError::Protocol(format!(
                "rank {peer} sent a malformed shared-memory frame (rank {from}, {} descriptors)",
                fds.len()
            )));
        }
        let mut fds = fds.into_iter();
        let (Some(bell), Some(ring)) = (fds.next(), fds.next()) else {
            return Err(TransportError::Protocol(format!(
                "rank {peer} sent too few descriptors"
            )));
        };
        self.connect(incoming, bell, ring)
    }

    /// The idle waiter of this rank: sleeps on its doorbell.
    pub fn waiter(&self) -> ShmWaiter {
        let last = self.bell.doorbell().load(Ordering::SeqCst);
        ShmWaiter {
            map: self.bell.clone(),
            last,
        }
    }
}

/// Tags the frame that carries a doorbell's and a ring's descriptors.
const FD_FRAME_MAGIC: u32 = 0x5746_4453; // "WFDS"

/// Names are unique per process and call: the object is unlinked right after it is made.
static OBJECT_SERIAL: AtomicU64 = AtomicU64::new(0);

/// Creates, sizes, reserves and initializes one shared-memory object owned by `rank`: a doorbell
/// header when `slot_peers` is empty, else one incoming ring per listed peer. Its name is
/// unlinked before it is sized, so the object is never left behind.
fn create_object(
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
fn init_object(
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

fn create_exclusive(name: &str) -> Result<std::os::fd::OwnedFd> {
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

/// A connection to a peer on the same host through shared memory (see the module docs).
pub struct ShmConnection {
    peer: usize,
    /// The incoming ring (the peer writes it) and the outgoing one (in the peer's memory).
    own: Arc<Mapping>,
    remote: Arc<Mapping>,
    /// The peer's doorbell, rung after writing or freeing space.
    peer_bell: Arc<Mapping>,
    /// Offset of the incoming ring (in `own`) and the outgoing ring (in `remote`).
    rx: usize,
    tx: usize,
    /// The incoming ring's counters (this side is its receiver).
    recv: RecvCursor,
    /// The outgoing ring's counters (this side is its sender).
    send: SendCursor,
    watch: ProcessWatch,
    peer_dead: bool,
    peer_pid: i32,
    /// Smallest write sent by reference; `None` when disabled here.
    cma_min: Option<usize>,
    /// The reference this side is sending, if any.
    out_ref: Option<OutRef>,
    /// Bytes and count of references posted before the current one (sender side).
    tx_ref_bytes: u64,
    tx_refs: u64,
    /// Receiver side: references finished, bytes copied of the front one and of all of them.
    rx_refs_done: u64,
    rx_front_copied: u64,
    rx_copied_total: u64,
    /// Referenced bytes copied but not yet consumed (8-byte aligned storage).
    stage: Vec<u64>,
    stage_start: usize,
    stage_end: usize,
    /// Largest write sent as a low-latency message (0: none).
    ll_max: usize,
    /// Sender side: low-latency messages posted, and consumed as last read from the receiver.
    tx_ll: u64,
    tx_ll_done_seen: u64,
    /// Receiver side: low-latency messages consumed.
    rx_ll: u64,
    /// The consumed message's bytes not yet lent out (8-byte aligned storage).
    ll_stage: [u64; LL_STAGE_WORDS],
    ll_start: usize,
    ll_end: usize,
}

const LL_STAGE_WORDS: usize = LL_MAX.div_ceil(8);

/// The next low-latency message, as the receiver sees it in its slot.
#[derive(Debug, Clone, Copy)]
struct LlFront {
    ring_pos: u64,
    len: usize,
    /// Every line of it has arrived (the sender may still be writing the others).
    complete: bool,
}

/// A write being sent by reference.
#[derive(Debug, Clone, Copy)]
struct OutRef {
    addr: usize,
    len: usize,
    /// Bytes of the write after the reference (fewer than 8; they follow through the ring).
    tail: usize,
    /// Bytes already reported accepted to the caller.
    reported: usize,
    /// The peer's all-references copy counter when this reference's first byte is copied.
    base: u64,
}

/// A reference as the receiver reads it.
#[derive(Debug, Clone, Copy)]
struct InRef {
    ring_pos: u64,
    addr: u64,
    len: u64,
}

impl ShmConnection {
    /// Attaches to the peer: `own` is the ring it writes into (here), `remote` the ring this side
    /// writes into (the peer's), `peer_bell` the peer's doorbell.
    fn attach(
        peer: usize,
        own: Arc<Mapping>,
        remote: Arc<Mapping>,
        peer_bell: Arc<Mapping>,
    ) -> Result<ShmConnection> {
        let watch = ProcessWatch::new(remote.owner_pid() as i32);
        let rx = own.layout.ring_offset(0);
        let tx = remote.layout.ring_offset(0);
        let rx_tail = own.u64_at(rx + R_TAIL).load(Ordering::Acquire);
        let tx_head = remote.u64_at(tx + R_HEAD).load(Ordering::Acquire);
        let tx_tail_seen = remote.u64_at(tx + R_TAIL).load(Ordering::Acquire);
        // Like the head above: continue after what the receiver has consumed.
        let tx_ll = remote.u64_at(tx + R_LL_DONE).load(Ordering::Acquire);
        let cma_min = cma_min_bytes();
        let peer_pid = remote.owner_pid() as i32;
        if cma_min.is_some() {
            // Enable references on the ring the peer writes to us only if we can read its memory.
            let probe = peer_bell.u64_at(H_CMA_PROBE).load(Ordering::Relaxed);
            let mut cookie = [0u8; 8];
            let ok = matches!(cma_read(peer_pid, probe, &mut cookie), Ok(8))
                && u64::from_ne_bytes(cookie) == CMA_COOKIE;
            if !ok {
                tracing::debug!(target: "weftcc::shm", peer, "cross-memory attach unavailable; single copy disabled");
            }
            own.u32_at(rx + R_CMA_OK)
                .store(u32::from(ok), Ordering::Release);
        }
        let rx_ll = own.u64_at(rx + R_LL_DONE).load(Ordering::Acquire);
        Ok(ShmConnection {
            peer,
            own,
            remote,
            peer_bell,
            rx,
            tx,
            recv: RecvCursor::at(rx_tail),
            send: SendCursor {
                head: tx_head,
                tail_seen: tx_tail_seen,
            },
            watch,
            peer_dead: false,
            peer_pid,
            cma_min,
            out_ref: None,
            tx_ref_bytes: 0,
            tx_refs: 0,
            rx_refs_done: 0,
            rx_front_copied: 0,
            rx_copied_total: 0,
            stage: Vec::new(),
            stage_start: 0,
            stage_end: 0,
            ll_max: ll_max_bytes(),
            tx_ll,
            tx_ll_done_seen: tx_ll,
            rx_ll,
            ll_stage: [0; LL_STAGE_WORDS],
            ll_start: 0,
            ll_end: 0,
        })
    }

    /// Sets the largest write this side sends as a low-latency message (clamped to [`LL_MAX`];
    /// 0: every write goes through the ring). The receiving side always accepts them.
    pub fn set_low_latency_max(&mut self, bytes: usize) {
        self.ll_max = bytes.min(LL_MAX);
    }

    fn lost(&self, detail: &str) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer,
            detail: detail.to_string(),
        }
    }

    fn corrupt(&self, what: &str) -> TransportError {
        TransportError::Protocol(format!(
            "shared-memory ring with peer {} is corrupt: {what}",
            self.peer
        ))
    }

    fn rx_empty(&self) -> bool {
        self.stage_start == self.stage_end
            && self.ll_start == self.ll_end
            && self.front_ref().is_none()
            && self.own.u64_at(self.rx + R_HEAD).load(Ordering::Acquire) == self.recv.tail
            && self.ll_front().ok().flatten().is_none_or(|l| !l.complete)
    }

    /// Offset of low-latency slot `n % LL_SLOTS` of the ring at `ring`.
    fn ll_slot(ring: usize, n: u64) -> usize {
        ring + R_LL + (n % LL_SLOTS) as usize * LL_SLOT_BYTES
    }

    /// Posts `data` as a low-latency message; false when it is too long or every slot is full.
    fn try_send_ll(&mut self, data: &[u8]) -> bool {
        // Whole words at a word boundary only (module docs).
        if data.is_empty()
            || data.len() > self.ll_max
            || !(data.len() | self.send.head as usize).is_multiple_of(8)
        {
            return false;
        }
        let r = &*self.remote;
        if self.tx_ll.wrapping_sub(self.tx_ll_done_seen) >= LL_SLOTS {
            self.tx_ll_done_seen = r.u64_at(self.tx + R_LL_DONE).load(Ordering::Acquire);
            if self.tx_ll.wrapping_sub(self.tx_ll_done_seen) >= LL_SLOTS {
                return false;
            }
        }
        let slot = Self::ll_slot(self.tx, self.tx_ll);
        let flag = self.tx_ll.wrapping_add(1);
        // The later lines first, so that the first line, which the receiver looks at first,
        // usually completes the message.
        for line in (0..ll_lines(data.len())).rev() {
            let (start, n) = ll_line_span(line, data.len());
            let at = slot + line * LL_LINE;
            // SAFETY: `at .. at + n` (n <= 56) lies inside slot `tx_ll % LL_SLOTS` of our outgoing
            // ring's control region in the validated mapping, before the line's flag word. The
            // receiver released this slot (its consumed count shows it copied the message that
            // used it last) and reads it again only after seeing the flag stored below.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr().add(start),
                    r.raw.as_mut_ptr().add(at),
                    n,
                );
            }
            if line == 0 {
                let meta = u64::from(self.send.head as u32) | ((data.len() as u64) << 32);
                r.u64_at(at + LL_FIRST_DATA).store(meta, Ordering::Relaxed);
            }
            r.u64_at(at + LL_FLAG).store(flag, Ordering::Release);
        }
        self.tx_ll = flag;
        self.peer_bell.ring_doorbell();
        true
    }

    /// The next low-latency message, if its first line has arrived.
    fn ll_front(&self) -> Result<Option<LlFront>> {
        let m = &*self.own;
        let slot = Self::ll_slot(self.rx, self.rx_ll);
        let want = self.rx_ll.wrapping_add(1);
        // Every line's flag is loaded before any is looked at: independent loads, so the lines
        // of a longer message travel in parallel rather than one after the other.
        let mut flags = [0u64; LL_SLOT_LINES];
        for (line, flag) in flags.iter_mut().enumerate() {
            *flag = m
                .u64_at(slot + line * LL_LINE + LL_FLAG)
                .load(Ordering::Acquire);
        }
        if flags[0] != want {
            return Ok(None);
        }
        let meta = m.u64_at(slot + LL_FIRST_DATA).load(Ordering::Relaxed);
        let len = (meta >> 32) as usize;
        let ahead = u64::from((meta as u32).wrapping_sub(self.recv.tail as u32));
        if len == 0 || len > LL_MAX || ahead > m.layout.capacity as u64 {
            return Err(self.corrupt("low-latency message with a bad length or position"));
        }
        Ok(Some(LlFront {
            ring_pos: self.recv.tail.wrapping_add(ahead),
            len,
            complete: flags[..ll_lines(len)].iter().all(|&f| f == want),
        }))
    }

    /// Copies the complete front message out of its slot into `ll_stage` and releases the slot.
    fn take_ll(&mut self, front: LlFront) {
        let m = &*self.own;
        let slot = Self::ll_slot(self.rx, self.rx_ll);
        let stage = words_as_bytes_mut(&mut self.ll_stage);
        for line in 0..ll_lines(front.len) {
            let (start, n) = ll_line_span(line, front.len);
            // SAFETY: `slot + line * LL_LINE .. + n` lies inside the incoming ring's slot, in our
            // own mapping; the line's flag, loaded with Acquire in `ll_front`, showed its bytes
            // were written, and the sender leaves the slot alone until we publish the consumed
            // count below. `stage` has room for LL_MAX >= front.len bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    m.raw.as_ptr().add(slot + line * LL_LINE),
                    stage[start..start + n].as_mut_ptr(),
                    n,
                );
            }
        }
        self.ll_start = 0;
        self.ll_end = front.len;
        self.rx_ll = self.rx_ll.wrapping_add(1);
        m.u64_at(self.rx + R_LL_DONE)
            .store(self.rx_ll, Ordering::Release);
    }

    /// Advances the tail past the `used` of `offered` ring bytes, publishing it when the rule
    /// says so ([`RecvCursor::consumed`]).
    fn consumed(&mut self, used: usize, offered: usize) {
        let release_every = RecvCursor::release_every(self.own.layout.capacity);
        if self.recv.consumed(used, offered, release_every) {
            self.publish_tail();
        }
    }

    /// Tells the sender how far this side has consumed the ring, if it does not know yet.
    fn publish_tail(&mut self) {
        if let Some(tail) = self.recv.publish() {
            self.own
                .u64_at(self.rx + R_TAIL)
                .store(tail, Ordering::Release);
            self.peer_bell.ring_doorbell();
        }
    }

    /// Lends the consumed low-latency message's remaining bytes.
    fn lend_ll(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> usize {
        lend_staged(
            &self.ll_stage,
            &mut self.ll_start,
            self.ll_end,
            max,
            consume,
        )
    }

    /// Continues or starts a write by reference; `None` when `data` goes through the ring.
    fn try_send_ref(&mut self, data: &[u8]) -> Option<Result<usize>> {
        let r = &*self.remote;
        if let Some(mut out) = self.out_ref {
            if data.as_ptr() as usize != out.addr + out.reported
                || data.len() != out.len - out.reported + out.tail
            {
                return Some(Err(TransportError::Protocol(format!(
                    "pinned write to peer {} did not continue with the rest of its bytes",
                    self.peer
                ))));
            }
            let copied = r.u64_at(self.tx + R_REF_COPIED).load(Ordering::Acquire);
            let done = (copied.wrapping_sub(out.base) as usize).min(out.len);
            let newly = done.saturating_sub(out.reported);
            out.reported += newly;
            self.out_ref = if out.reported == out.len {
                None
            } else {
                Some(out)
            };
            return Some(Ok(newly));
        }
        let min = self.cma_min?;
        // Whole words at a word boundary only (module docs): the last bytes of an odd length
        // follow through the ring.
        let len = data.len() & !7;
        if len < min
            || !self.send.head.is_multiple_of(8)
            || r.u32_at(self.tx + R_CMA_OK).load(Ordering::Acquire) == 0
        {
            return None;
        }
        let done = r.u64_at(self.tx + R_REF_TAIL).load(Ordering::Acquire);
        if self.tx_refs.wrapping_sub(done) >= REF_SLOTS {
            return None;
        }
        let slot = self.tx + R_REFS + (self.tx_refs % REF_SLOTS) as usize * REF_SLOT_BYTES;
        r.u64_at(slot).store(self.send.head, Ordering::Relaxed);
        r.u64_at(slot + 8)
            .store(data.as_ptr() as u64, Ordering::Relaxed);
        r.u64_at(slot + 16).store(len as u64, Ordering::Relaxed);
        self.out_ref = Some(OutRef {
            addr: data.as_ptr() as usize,
            len,
            tail: data.len() - len,
            reported: 0,
            base: self.tx_ref_bytes,
        });
        self.tx_ref_bytes += len as u64;
        self.tx_refs += 1;
        r.u64_at(self.tx + R_REF_HEAD)
            .store(self.tx_refs, Ordering::Release);
        self.peer_bell.ring_doorbell();
        Some(Ok(0))
    }

    /// The oldest reference not yet fully copied, if the sender posted one.
    fn front_ref(&self) -> Option<InRef> {
        let m = &*self.own;
        let posted = m.u64_at(self.rx + R_REF_HEAD).load(Ordering::Acquire);
        if posted == self.rx_refs_done {
            return None;
        }
        let slot = self.rx + R_REFS + (self.rx_refs_done % REF_SLOTS) as usize * REF_SLOT_BYTES;
        Some(InRef {
            ring_pos: m.u64_at(slot).load(Ordering::Relaxed),
            addr: m.u64_at(slot + 8).load(Ordering::Relaxed),
            len: m.u64_at(slot + 16).load(Ordering::Relaxed),
        })
    }

    /// The reference to serve now: the front one, once every ring byte before it was read.
    fn ref_at_tail(&self) -> Result<Option<InRef>> {
        self.at_tail(self.front_ref())
    }

    fn at_tail(&self, front: Option<InRef>) -> Result<Option<InRef>> {
        match front {
            Some(f) if f.ring_pos == self.recv.tail => Ok(Some(f)),
            Some(f)
                if f.ring_pos.wrapping_sub(self.recv.tail) > self.own.layout.capacity as u64 =>
            {
                Err(self.corrupt("reference outside the ring"))
            }
            _ => Ok(None),
        }
    }

    /// Copies up to `dst.len()` bytes of reference `f` out of the sender; reports them copied.
    fn copy_ref(&mut self, f: InRef, dst: &mut [u8]) -> Result<usize> {
        let left = f.len.saturating_sub(self.rx_front_copied);
        let n = dst.len().min(left as usize);
        if n == 0 {
            return Ok(0);
        }
        let got = match cma_read(self.peer_pid, f.addr + self.rx_front_copied, &mut dst[..n]) {
            Ok(got) => got,
            Err(Errno::ESRCH) => {
                self.peer_dead = true;
                return Err(self.lost("peer process exited"));
            }
            Err(e) => {
                return Err(TransportError::Protocol(format!(
                    "process_vm_readv from peer {} (pid {}): {e}",
                    self.peer, self.peer_pid
                )))
            }
        };
        self.rx_front_copied += got as u64;
        self.rx_copied_total += got as u64;
        let m = &*self.own;
        m.u64_at(self.rx + R_REF_COPIED)
            .store(self.rx_copied_total, Ordering::Release);
        if self.rx_front_copied == f.len {
            self.rx_refs_done += 1;
            self.rx_front_copied = 0;
            m.u64_at(self.rx + R_REF_TAIL)
                .store(self.rx_refs_done, Ordering::Release);
        }
        self.peer_bell.ring_doorbell();
        Ok(got)
    }

    /// Lends staged reference bytes (copying more from the sender first if none are staged).
    fn lend_ref(
        &mut self,
        f: Option<InRef>,
        max: usize,
        consume: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<usize> {
        if self.stage_start == self.stage_end {
            let Some(f) = f else { return Ok(0) };
            if self.stage.is_empty() {
                self.stage = vec![0u64; CMA_STAGE_BYTES / 8];
            }
            let mut stage = std::mem::take(&mut self.stage);
            let want = max.min(CMA_STAGE_BYTES);
            let got = self.copy_ref(f, &mut words_as_bytes_mut(&mut stage)[..want]);
            self.stage = stage;
            self.stage_start = 0;
            self.stage_end = got?;
        }
        Ok(lend_staged(
            &self.stage,
            &mut self.stage_start,
            self.stage_end,
            max,
            consume,
        ))
    }
}

/// Lends up to `max` of the staged bytes `start..end` of `words` to `consume` and advances
/// `start` past what it used; returns that.
fn lend_staged(
    words: &[u64],
    start: &mut usize,
    end: usize,
    max: usize,
    consume: &mut dyn FnMut(&[u8]) -> usize,
) -> usize {
    let n = (end - *start).min(max);
    let used = consume(&words_as_bytes(words)[*start..*start + n]).min(n);
    *start += used;
    used
}

fn words_as_bytes_mut(words: &mut [u64]) -> &mut [u8] {
    let len = words.len() * 8;
    // SAFETY: u64 has no padding and any byte pattern is a valid u64; the byte view covers
    // exactly the slice's memory and borrows it mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

fn words_as_bytes(words: &[u64]) -> &[u8] {
    let len = words.len() * 8;
    // SAFETY: as in `words_as_bytes_mut`, read-only.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
}

impl Connection for ShmConnection {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        let r = &*self.remote;
        if self.peer_dead {
            return Err(self.lost("peer process exited"));
        }
        if r.u32_at(self.tx + R_RECEIVER_CLOSED)
            .load(Ordering::Acquire)
            != 0
        {
            return Err(self.lost("peer closed the connection"));
        }
        if self.out_ref.is_some() {
            return Err(TransportError::Protocol(format!(
                "plain write to peer {} while a pinned write is unfinished",
                self.peer
            )));
        }
        if self.try_send_ll(data) {
            return Ok(data.len());
        }
        let r = &*self.remote;
        let cap = r.layout.capacity;
        // The receiver's tail only grows: re-read it (a cache line the receiver keeps writing)
        // only when the space known from the last read is not enough.
        if self.send.needs_tail(data.len(), cap) {
            self.send.tail_seen = r.u64_at(self.tx + R_TAIL).load(Ordering::Acquire);
        }
        let Ok((n, off)) = self.send.writable(data.len(), cap) else {
            return Err(self.corrupt("tail ahead of head"));
        };
        if n == 0 {
            return Ok(0);
        }
        let first = n.min(cap - off);
        let base = self.tx + r.layout.ctrl_size;
        // SAFETY: [base, base + cap) is the data area of our outgoing ring inside the validated
        // mapping; `off + first <= cap` and `n - first <= off`, so both copies stay inside it.
        // The region [head, head + n) mod cap is free (the receiver published a tail showing it
        // consumed those bytes), so nobody reads it concurrently; `data` is a separate allocation.
        unsafe {
            let dst = r.raw.as_mut_ptr().add(base);
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst.add(off), first);
            std::ptr::copy_nonoverlapping(data.as_ptr().add(first), dst, n - first);
        }
        let head = self.send.wrote(n);
        r.u64_at(self.tx + R_HEAD).store(head, Ordering::Release);
        self.peer_bell.ring_doorbell();
        Ok(n)
    }

    fn try_send_pinned(&mut self, data: &[u8]) -> Result<usize> {
        if self.peer_dead {
            return Err(self.lost("peer process exited"));
        }
        if self
            .remote
            .u32_at(self.tx + R_RECEIVER_CLOSED)
            .load(Ordering::Acquire)
            != 0
        {
            return Err(self.lost("peer closed the connection"));
        }
        match self.try_send_ref(data) {
            Some(result) => result,
            None => self.try_send(data),
        }
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        // Referenced bytes come first when they precede the ring's unread bytes.
        if self.stage_start < self.stage_end {
            return self.lend_ref(None, max, consume);
        }
        if self.ll_start < self.ll_end {
            return Ok(self.lend_ll(max, consume));
        }
        // Read order matters (module docs): references, then the ring head, then the
        // low-latency slot, so that nothing written after a message is seen without it. A head
        // kept from an earlier call was also loaded (with Acquire) before this call's loads of
        // references and slots, which is all the rule needs.
        let front = self.front_ref();
        let mut closed = false;
        if self.recv.needs_head() {
            closed = self
                .own
                .u32_at(self.rx + R_SENDER_CLOSED)
                .load(Ordering::Acquire)
                != 0;
            self.recv.head_seen = self.own.u64_at(self.rx + R_HEAD).load(Ordering::Acquire);
        }
        let mut head = self.recv.head_seen;
        let ll = self.ll_front()?;
        if let Some(l) = ll.filter(|l| l.ring_pos == self.recv.tail) {
            // Before a reference at the same position: that one stopped the sender.
            if max == 0 || !l.complete {
                return Ok(0);
            }
            self.take_ll(l);
            return Ok(self.lend_ll(max, consume));
        }
        if let Some(f) = self.at_tail(front)? {
            if max == 0 {
                return Ok(0);
            }
            return self.lend_ref(Some(f), max, consume);
        }
        // Ring bytes after a pending reference or message wait for it.
        for pos in [front.map(|f| f.ring_pos), ll.map(|l| l.ring_pos)]
            .into_iter()
            .flatten()
        {
            if pos.wrapping_sub(self.recv.tail) < head.wrapping_sub(self.recv.tail) {
                head = pos;
            }
        }
        let m = &*self.own;
        let cap = m.layout.capacity;
        let Ok((avail, off)) = self.recv.readable(head, cap) else {
            return Err(self.corrupt("head beyond capacity"));
        };
        if avail == 0 {
            // Starved (or waiting behind a message or reference): the sender may be waiting for
            // the space this side has consumed.
            self.publish_tail();
            return if closed {
                Err(self.lost("peer closed the connection"))
            } else {
                Ok(0)
            };
        }
        if max == 0 {
            self.publish_tail();
            return Ok(0);
        }
        let n = (avail as usize).min(cap - off).min(max);
        let base = self.rx + m.layout.ctrl_size + off;
        // SAFETY: [base, base + n) lies inside the incoming ring's data area of our own mapping
        // (`off + n <= cap`). The sender published these bytes with a Release store of `head`
        // that we read with Acquire, and will not overwrite them until we publish a larger
        // `tail`, which happens only after `consume` returned; the slice does not escape it.
        let slice = unsafe { std::slice::from_raw_parts(m.raw.as_ptr().add(base), n) };
        let used = consume(slice).min(n);
        self.consumed(used, n);
        Ok(used)
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        // A reference at the head of the stream is copied straight into `dst`: the single copy.
        if self.stage_start == self.stage_end && self.ll_start == self.ll_end && !dst.is_empty() {
            if let Some(f) = self.ref_at_tail()? {
                // A low-latency message at the same position was written before it.
                let ll_first = self
                    .ll_front()?
                    .is_some_and(|l| l.ring_pos == self.recv.tail);
                if !ll_first {
                    return self.copy_ref(f, dst);
                }
            }
        }
        crate::conn::recv_into_by_lending(self, dst)
    }

    fn leave_farewell(&mut self, note: &str) {
        let r = &*self.remote;
        if r.u64_at(self.tx + R_FAREWELL_LEN).load(Ordering::Relaxed) != 0 {
            return; // the first note is the cause; later ones follow from it
        }
        let bytes = &note.as_bytes()[..note.len().min(FAREWELL_MAX)];
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            r.u64_at(self.tx + R_FAREWELL + 8 * i)
                .store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        r.u64_at(self.tx + R_FAREWELL_LEN)
            .store(bytes.len() as u64, Ordering::Release);
    }

    fn farewell(&self) -> Option<String> {
        let m = &*self.own;
        let len = m.u64_at(self.rx + R_FAREWELL_LEN).load(Ordering::Acquire) as usize;
        if len == 0 {
            return None;
        }
        let len = len.min(FAREWELL_MAX);
        let mut bytes = Vec::with_capacity(len.div_ceil(8) * 8);
        for i in 0..len.div_ceil(8) {
            let word = m
                .u64_at(self.rx + R_FAREWELL + 8 * i)
                .load(Ordering::Relaxed);
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes.truncate(len);
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn check_peer(&mut self) -> Result<()> {
        let closed = self
            .own
            .u32_at(self.rx + R_SENDER_CLOSED)
            .load(Ordering::Acquire)
            != 0;
        if closed && self.rx_empty() {
            return Err(self.lost("peer closed the connection"));
        }
        if !self.peer_dead && self.watch.exited() {
            self.peer_dead = true;
        }
        if self.peer_dead && self.rx_empty() {
            return Err(self.lost("peer process exited"));
        }
        Ok(())
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.publish_tail();
        self.remote
            .u32_at(self.tx + R_SENDER_CLOSED)
            .store(1, Ordering::Release);
        self.own
            .u32_at(self.rx + R_RECEIVER_CLOSED)
            .store(1, Ordering::Release);
        self.peer_bell.ring_doorbell();
    }
}

/// [`IdleWaiter`] for shared-memory connections: sleeps on this rank's doorbell futex.
pub struct ShmWaiter {
    map: Arc<Mapping>,
    last: u32,
}

impl ShmWaiter {
    /// Waits for at most `max` unless the doorbell was rung since the previous return; returns
    /// whether it was (a ring during this call counts).
    pub fn wait_doorbell(&mut self, max: Duration) -> bool {
        let bell = self.map.doorbell();
        let sleeping = self.map.sleeping();
        // A count rather than a flag, so that several waiters on one segment stay correct.
        sleeping.fetch_add(1, Ordering::SeqCst);
        let cur = bell.load(Ordering::SeqCst);
        if cur == self.last {
            futex_wait(bell, cur, max);
        }
        sleeping.fetch_sub(1, Ordering::SeqCst);
        let now = bell.load(Ordering::SeqCst);
        let rung = now != self.last;
        self.last = now;
        rung
    }

    /// True (and acknowledged) if the doorbell was rung since the previous return; never sleeps.
    pub fn poll_doorbell(&mut self) -> bool {
        let now = self.map.doorbell().load(Ordering::SeqCst);
        let rung = now != self.last;
        self.last = now;
        rung
    }
}

impl IdleWaiter for ShmWaiter {
    fn wait(&mut self, _interest: &[Interest], max: Duration) -> Result<()> {
        self.wait_doorbell(max);
        Ok(())
    }
}

/// Two connected shared-memory ends inside this process (for tests and benchmarks): two
/// endpoints under a random token, their rings exchanged as descriptors.
pub fn local_pair(
    rank_a: usize,
    rank_b: usize,
    capacity: usize,
) -> Result<((ShmConnection, ShmWaiter), (ShmConnection, ShmWaiter))> {
    let token = crate::util::random_hex(8)?;
    let ea = ShmEndpoint::create(&token, "local_pair", rank_a, capacity)?;
    let eb = ShmEndpoint::create(&token, "local_pair", rank_b, capacity)?;
    let (ra, rb) = (ea.incoming_ring(rank_b)?, eb.incoming_ring(rank_a)?);
    let dup = |fd: BorrowedFd<'_>| {
        fd.try_clone_to_owned()
            .map_err(|e| TransportError::io("duplicating a shared-memory descriptor", e))
    };
    let (bell_a, bell_b) = (dup(ea.bell_fd())?, dup(eb.bell_fd())?);
    let (ring_a, ring_b) = (dup(ra.fd())?, dup(rb.fd())?);
    let a = ea.connect(ra, bell_b, ring_b)?;
    let b = eb.connect(rb, bell_a, ring_a)?;
    Ok(((a, ea.waiter()), (b, eb.waiter())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_farewell_is_read_by_the_peer_after_the_close() {
        let ((mut a, _), (mut b, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
        let ((c, _), (d, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
        a.leave_farewell("abort 0 timed out");
        a.leave_farewell("abort 0 a consequence"); // the first note stays
        drop(a);
        assert!(matches!(
            b.check_peer(),
            Err(TransportError::PeerLost { peer: 0, .. })
        ));
        assert_eq!(b.farewell().as_deref(), Some("abort 0 timed out"));
        // No note: none read. A long one: cut at FAREWELL_MAX bytes.
        drop(c);
        assert_eq!(d.farewell(), None);
        let ((mut e, _), (f, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
        let long: String = (0..FAREWELL_MAX + 50)
            .map(|i| (b'a' + (i % 26) as u8) as char)
            .collect();
        e.leave_farewell(&long);
        assert_eq!(f.farewell().as_deref(), Some(&long[..FAREWELL_MAX]));
    }

    #[test]
    fn the_tail_reaches_the_sender_when_the_reader_stops_short_or_runs_dry() {
        let ((mut a, mut wake_a), (mut b, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
        a.set_low_latency_max(0); // ring bytes only
        let fill = |a: &mut ShmConnection| {
            let chunk = [7u8; 4096];
            let mut sent = 0;
            loop {
                match a.try_send(&chunk).unwrap() {
                    0 => return sent,
                    n => sent += n,
                }
            }
        };
        assert_eq!(fill(&mut a), MIN_BUFFSIZE);
        wake_a.poll_doorbell();
        // A reader that takes fewer bytes than it is offered may not come back soon: the space
        // it freed is published (and the sender woken) at once.
        let took = b.try_recv(usize::MAX, &mut |_: &[u8]| 100).unwrap();
        assert_eq!(took, 100);
        assert!(wake_a.poll_doorbell());
        assert_eq!(fill(&mut a), 100);
        // A reader that took every byte it knows of, in pieces well under an eighth of the ring,
        // has released the whole ring, without a further look that finds nothing.
        let mut total = 0;
        while total < MIN_BUFFSIZE {
            let n = b.try_recv(1000, &mut |sl: &[u8]| sl.len()).unwrap();
            assert!(n > 0);
            total += n;
        }
        assert!(wake_a.poll_doorbell());
        assert_eq!(fill(&mut a), MIN_BUFFSIZE);
        // A look that asks for nothing releases what the reader took before.
        let took = b.try_recv(1000, &mut |sl: &[u8]| sl.len()).unwrap();
        assert_eq!(took, 1000);
        assert_eq!(fill(&mut a), 0);
        assert_eq!(b.try_recv(0, &mut |sl: &[u8]| sl.len()).unwrap(), 0);
        assert_eq!(fill(&mut a), 1000);
    }

    /// An object left under a name, as a rank killed between creating and unlinking it would.
    fn leave_named(token: &str, rank: usize) -> (String, Mapping) {
        let name = format!("/{}left-{rank}", job_prefix(token));
        let fd = create_exclusive(&name).expect("create");
        let layout = Layout::new(1, MIN_BUFFSIZE).unwrap();
        let (_, map) = init_object(fd, &name, layout, rank, &[rank + 1], None).expect("init");
        (name, map)
    }

    #[test]
    fn segments_of_a_dead_creator_are_removed_and_live_ones_kept() {
        let token = format!("orphans{}", std::process::id());
        let (live, _live_map) = leave_named(&token, 0);
        let (dead, dead_map) = leave_named(&token, 1);
        // A process that has exited and been reaped stands in for a killed rank.
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let gone = child.id();
        child.wait().expect("wait");
        dead_map.u32_at(H_PID).store(gone, Ordering::Relaxed);
        let removed = remove_orphan_segments(&token, false);
        assert_eq!(removed, vec![dead.clone()]);
        assert!(Path::new(&format!("/dev/shm{live}")).exists());
        nix::sys::mman::shm_unlink(live.as_str()).expect("unlink");
        assert!(remove_orphan_segments(&token, false).is_empty());
        // A fresh segment whose header was never written: kept while someone may still be
        // making it, removed once nobody is left.
        let fresh = format!("/{}fresh", job_prefix(&token));
        let fd = nix::sys::mman::shm_open(
            fresh.as_str(),
            nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_RDWR,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .expect("shm_open");
        drop(fd);
        assert!(remove_orphan_segments(&token, false).is_empty());
        assert_eq!(remove_orphan_segments(&token, true), vec![fresh]);
    }

    #[test]
    fn objects_are_unlinked_as_soon_as_they_are_made() {
        let token = format!("unlinked{}", std::process::id());
        let ep = ShmEndpoint::create(&token, "a", 0, MIN_BUFFSIZE).unwrap();
        let ring = ep.incoming_ring(1).unwrap();
        let prefix = job_prefix(&token);
        let left: Vec<_> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        drop((ep, ring));
    }

    #[test]
    fn a_host_that_cannot_hold_every_ring_is_refused_before_anything_is_made() {
        let ring = ring_bytes(1 << 20);
        let gib = 1u64 << 30;
        // 256 ranks of 1 MiB rings need 64 GiB: refused on a 24 GiB host.
        let e = check_host_shm(256, 255, ring, Some(24 * gib), Some(24 * gib)).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("256 ranks on this host need"), "{text}");
        assert!(
            text.contains("65280 rings") && text.contains("WEFT_BUFFSIZE"),
            "{text}"
        );
        // 128 ranks (16 GiB) fit; the same with a small /dev/shm does not.
        assert!(check_host_shm(128, 127, ring, Some(24 * gib), Some(24 * gib)).is_ok());
        assert!(check_host_shm(128, 127, ring, Some(gib), Some(24 * gib)).is_err());
        // Connected on demand (20 rings each) at the automatic ring size, 256 ranks fit in 1 GiB.
        let small = ring_bytes(auto_capacity(256));
        assert!(check_host_shm(256, 20, small, Some(gib), Some(24 * gib)).is_ok());
        // Nothing known: no refusal.
        assert!(check_host_shm(4096, 4095, ring, None, None).is_ok());
    }

    #[test]
    fn automatic_ring_sizes_shrink_with_the_ranks_of_a_host() {
        assert_eq!(auto_capacity(1), DEFAULT_BUFFSIZE);
        assert_eq!(auto_capacity(32), DEFAULT_BUFFSIZE);
        assert_eq!(auto_capacity(33), DEFAULT_BUFFSIZE / 2);
        assert_eq!(auto_capacity(256), 128 << 10);
        assert_eq!(auto_capacity(100_000), MIN_BUFFSIZE);
    }

    #[test]
    fn capacity_rounding() {
        assert_eq!(ring_capacity(0), MIN_BUFFSIZE);
        assert_eq!(ring_capacity(100_000), 128 << 10);
        assert_eq!(ring_capacity(4 << 20), 4 << 20);
        assert_eq!(ring_capacity(usize::MAX), MAX_BUFFSIZE);
    }

    #[test]
    fn space_message() {
        let e = check_shm_space(64 * MIB, 7, 16 * MIB)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "/dev/shm has 64 MiB free but this communicator needs 112 MiB (7 peers × 16 MiB)"
            ),
            "{e}"
        );
        assert!(e.contains("WEFT_SHM_DISABLE=1"));
        assert!(check_shm_space(112 * MIB, 7, 16 * MIB).is_ok());
    }
}
