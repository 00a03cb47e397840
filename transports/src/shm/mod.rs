//! Same-host transport: byte rings in POSIX shared memory with futex doorbells.
//!
//! Each rank has a doorbell object (a header, then the rank's one-shot [`Outbox`]) and makes one
//! *incoming* ring object per connected local peer ([`ShmEndpoint`]). Objects are created under a unique name in /dev/shm and
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
//! receives into memory ([`Connection::try_recv_into`](crate::Connection::try_recv_into)) or into a small staging buffer it lends
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
//! ([`Connection::leave_farewell`](crate::Connection::leave_farewell): the bytes as words, then the length with Release) before it
//! closes; the receiver that sees the close reads it ([`Connection::farewell`](crate::Connection::farewell)) and can report
//! the cause instead of only the close, even when the bootstrap store is gone.
//!
//! Low-latency messages for small writes (up to [`LL_MAX`] bytes, the idea of NCCL's LL protocol
//! and OpenMPI's fast boxes): the data goes into a slot of cache lines that each end with an
//! 8-byte flag, the message's sequence number, stored with Release after the line's data. The
//! receiver polls the first line's flag of the next slot, which the sender stores last: when it
//! turns up, the same cache-line transfer brought that line's data (where a ring write costs two
//! dependent transfers, the head, then the data), and the Release store ordered every other line
//! of the message before it. A header of 40 bytes and 8 bytes of data fill the first line exactly.
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

mod cma;
mod connection;
mod doorbell;
mod endpoint;
mod layout;
mod low_latency;
mod outbox;
mod segment;
mod space;
#[cfg(test)]
mod tests;

pub use cma::{cma_min_bytes, DEFAULT_CMA_MIN};
pub use connection::ShmConnection;
pub use doorbell::ShmWaiter;
pub use endpoint::{local_pair, IncomingRing, ShmEndpoint};
pub use layout::{page_size, segment_size, LL_MAX};
pub use low_latency::ll_max_bytes;
pub use outbox::{Outbox, Outboxes, OUTBOX_HEADER_MAX, OUTBOX_SLOTS, OUTBOX_SLOT_BYTES};
pub use segment::{remove_orphan_segments, ORPHAN_GRACE};
pub use space::{
    auto_capacity, check_host_shm, check_shm_space, host_shm_limits, ring_bytes, ring_capacity,
    shm_free_bytes, DEFAULT_BUFFSIZE, MAX_BUFFSIZE, MIN_BUFFSIZE,
};
