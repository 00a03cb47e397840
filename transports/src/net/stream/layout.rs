//! The landing region's control words and the sizes and limits of a network connection
//! (module docs of [`super`]), and the shape one is asked for ([`NetLink`]).

use std::time::Duration;

/// Bytes of control words after the ring.
pub(super) const CONTROL: usize = 192;
pub(super) const HEAD_IN: usize = 0;
pub(super) const TAIL_IN: usize = 16;
pub(super) const CLOSED_IN: usize = 32;
/// Rendezvous: the stream position up to which direct bytes were delivered (written by the
/// sender), the number of the last promise taken (by the sender), and the promise (by the
/// receiver: [`PROMISE_WORDS`] words).
pub(super) const DIRECT_IN: usize = 48;
pub(super) const ANSWER_IN: usize = 64;
pub(super) const PROMISE_IN: usize = 128;
pub(super) const PROMISE_WORDS: usize = 7;
/// Direct writes in flight per connection, each from its own [`STRIPE`]-byte bounce slot.
pub(super) const BOUNCE_SLOTS: usize = 4;
/// Smallest and largest ring a peer may announce.
pub(super) const RING_MIN: u64 = 4096;
pub(super) const RING_MAX: u64 = 1 << 30;
/// How long a closing side waits for its last writes to leave.
pub(super) const CLOSE_FLUSH: Duration = Duration::from_millis(500);
/// How long bytes may keep arriving after the side connection closed without a close mark.
pub(super) const LINGER: Duration = Duration::from_secs(1);
/// Largest data write when a connection has several endpoints, so that a large send is spread
/// over all of them.
pub(super) const STRIPE: usize = 256 << 10;
/// Registered slots for control words written without inline support, and their size; the
/// promise's source follows them.
pub(super) const WORD_SLOTS: usize = 32;
pub(super) const WORD_SLOT: usize = 16;
pub(super) const PROMISE_SOURCE: usize = WORD_SLOTS * WORD_SLOT;
/// Most endpoints (queue pairs) per connection.
pub const MAX_STREAMS: usize = 16;
/// How long a [`NetWaiter`](super::NetWaiter) sleeps between polls when nothing moved.
pub const NET_POLL_SLICE: Duration = Duration::from_micros(50);
/// The handshake's version: 3 added [`CONNECTED`] (no write before both sides connected).
pub(super) const MAGIC: &[u8; 8] = b"WEFTNET3";
/// Bytes of the hello before the endpoint address.
pub(super) const HELLO_FIXED: usize = 8 + 4 * 8 + 4;
pub(super) const READY: u8 = 0xA5;
/// Sent once this side's endpoints are connected (a verbs queue pair in RTR and RTS): the peer
/// writes nothing before it has this byte.
pub(super) const CONNECTED: u8 = 0x5A;

/// The shape of a network connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetLink {
    /// Receive ring bytes (a power of two).
    pub ring: usize,
    /// Endpoints (queue pairs); both sides use the smaller count.
    pub streams: usize,
    /// Smallest pinned receive offered to the sender as a rendezvous destination (0: none).
    pub rendezvous: usize,
}
/// A counter and its complement, as one 16-byte write.
pub(super) fn counter_pair(value: u64) -> [u8; 16] {
    let mut pair = [0u8; 16];
    pair[..8].copy_from_slice(&value.to_le_bytes());
    pair[8..].copy_from_slice(&(!value).to_le_bytes());
    pair
}
