//! The byte stream of the [`Connection`](crate::Connection) trait over a provider's one-sided writes.
//!
//! Each side registers a *landing* region: its receive ring (a power of two of bytes) followed
//! by control words that only the peer writes:
//!
//! ```text
//! [ ring: cap bytes | head | tail | closed | direct | answer | promise ]
//! ```
//!
//! A counter travels with its complement in one 16-byte write: a provider may land a write in
//! pieces (libfabric's tcp provider copies from a socket), and a reader that finds the pair
//! inconsistent keeps the value it had, which only under-states data or space.
//!
//! * Sending `n` bytes copies them into the sender's registered *staging* mirror of the peer's
//!   ring (same offsets), writes them to the peer's ring, then writes the new head into the
//!   peer's `head` word (an inline write). Writes on one endpoint are placed in order, so a
//!   reader that sees a head sees the bytes before it.
//! * The receiver reads its own memory: the head (atomic), then the bytes, lending them to the
//!   reader in place. The tail goes back to the sender's `tail` word by an inline write, when it
//!   matters ([`RecvCursor::consumed`](crate::ring::RecvCursor::consumed)'s rule: all known bytes used, a reader that stopped short,
//!   or an eighth of the ring waiting).
//! * Closing writes `closed` = 1 after everything else and waits (briefly) for the writes to
//!   leave. The TCP connection of the handshake stays open beside the rings: a peer whose socket
//!   closed without a close mark, and whose bytes stopped coming, is lost.
//!
//! **Rendezvous.** A pinned receive ([`Connection::try_recv_into_pinned`](crate::Connection::try_recv_into_pinned)) of at least
//! [`NetLink::rendezvous`] bytes that finds its ring empty registers its destination (through
//! the [`RegistrationCache`](crate::net::regcache::RegistrationCache)) and writes a *promise* into the sender's `promise` words: stream
//! position, length, address and key. The sender reads promises when it has bytes to write; one
//! that finds a promise while its own stream position is exactly the promised one (and no earlier
//! promise of its is still finishing) takes it: it writes the promise's number into the
//! receiver's `answer` word, then writes the promised bytes straight into the destination
//! (from a registered bounce buffer, striped like ring data), and once those writes completed,
//! their end into the `direct` word. A sender that had already moved past the position (its
//! bytes are in the ring, or on their way) ignores the promise; the receiver learns it when it
//! finds ring bytes and no answer, which would have landed before them. So the receiver's copy
//! out of the ring is saved when the receiver is the one waiting, and nothing is ever waited
//! for that would not come. An operation that gives up a receive calls
//! [`Connection::cancel_pinned`](crate::Connection::cancel_pinned), which closes the endpoints before the caller's memory is
//! released.
//!
//! The ring counters follow [`crate::ring`]'s rules, checked against every interleaving there.

mod connection;
mod endpoints;
mod handshake;
mod layout;
mod pairs;
mod promise;
#[cfg(test)]
mod tests;

pub use connection::NetConnection;
pub use endpoints::{progress_all, NetWaiter};
pub use layout::{NetLink, MAX_STREAMS, NET_POLL_SLICE};
pub use pairs::{local_pair, local_pair_shaped, local_pair_striped, TEST_RENDEZVOUS};
