//! The transport trait.
//!
//! A [`Connection`] is a reliable, ordered, bidirectional byte stream between this rank and one
//! peer. It never blocks: the collectives engine polls every connection it needs and, when none
//! made progress, sleeps in [`IdleWaiter::wait`] (spin, then yield, then a futex or `poll`).
//!
//! Why a byte stream rather than posted send/recv requests: it maps directly onto a FIFO of slots
//! in shared memory, onto a socket, and onto an RDMA-written remote ring (the shape NCCL's "Simple"
//! protocol uses), and it lets the receiver reduce straight out of the transport's own buffer
//! ([`Connection::try_recv`] lends a slice), which is how copy and reduction overlap without an
//! extra copy. "Posting" a send is `try_send` of a byte range, "progress" is calling it again with
//! the rest, and "completion" is when all bytes were accepted.
//!
//! Invariants every implementation keeps (checked by the conformance suite in `tests/`):
//! * Bytes arrive exactly once, in order, unmodified.
//! * `try_send` accepts a prefix of `data` (possibly empty) and copies it out before returning, so
//!   the caller may reuse the source as soon as the bytes are accepted.
//! * `try_recv` lends at most `max` contiguous bytes; only the prefix that `consume` reports as used
//!   is removed from the stream. If every message length is a multiple of 8 bytes, every lent slice
//!   starts 8-byte aligned in memory (so typed reductions can read it in place).
//! * A reader that leaves the start of an element unconsumed (fewer than 8 bytes of an 8-byte
//!   word of the stream) is lent it again together with the rest of the word once that arrived,
//!   so a reader that takes whole elements only never stalls.
//! * A dead or closed peer becomes [`TransportError::PeerLost`](crate::TransportError::PeerLost) once no buffered bytes remain to be
//!   read, never a hang and never a panic.

use crate::error::Result;
use std::time::Duration;

/// A non-blocking byte stream to one peer.
pub trait Connection: Send {
    /// The peer's rank in the communicator.
    fn peer(&self) -> usize;

    /// Accepts as many leading bytes of `data` as fit now; returns how many (0 when full).
    fn try_send(&mut self, data: &[u8]) -> Result<usize>;

    /// Like [`Connection::try_send`], for a caller that promises to call again with exactly the
    /// rest of `data` (the same memory, unchanged) until every byte is accepted, without another
    /// write in between. A transport may then let the peer copy straight out of `data` (shared
    /// memory does, with cross-memory attach) and accept bytes only once they were copied, which
    /// saves the copy into its buffer. The collectives engine sends every message this way.
    fn try_send_pinned(&mut self, data: &[u8]) -> Result<usize> {
        self.try_send(data)
    }

    /// Accepts all of `data` or none of it; returns whether it did. For a caller that can go on
    /// only with a whole message (the engine's path for an operation of one small message);
    /// a transport that cannot tell beforehand whether everything fits keeps this default,
    /// which accepts nothing (the caller then writes through [`Connection::try_send`]).
    fn try_send_whole(&mut self, _data: &[u8]) -> Result<bool> {
        Ok(false)
    }

    /// Lends up to `max` received bytes as one contiguous slice to `consume`, which returns how
    /// many of them it used (a prefix, at most the slice's length). Returns that number; 0 when
    /// nothing is available (or `max` is 0).
    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize>;

    /// Receives up to `dst.len()` bytes straight into `dst`; returns how many. Transports that can
    /// read into the destination without staging (sockets) override this.
    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        recv_into_by_lending(self, dst)
    }

    /// Like [`Connection::try_recv_into`], but a transport may let the peer write straight
    /// into `dst` after this returns (a network rendezvous), which saves the copy out of its
    /// buffer. The collectives engine receives every copied message this way (a transport that
    /// cannot, such as a channel of a shared connection, simply copies).
    ///
    /// # Safety
    /// Until every byte of `dst` has arrived, the caller calls again with exactly the rest of
    /// `dst` (the same memory, neither read nor written meanwhile, and still allocated), with no
    /// other read of this connection in between; or it calls [`Connection::cancel_pinned`] (or
    /// drops the connection) before it touches or frees that memory.
    unsafe fn try_recv_into_pinned(&mut self, dst: &mut [u8]) -> Result<usize> {
        self.try_recv_into(dst)
    }

    /// The caller gives up the pinned receive it started (its operation failed): once this
    /// returns, the transport writes nothing more into that memory, even if that means
    /// closing the connection.
    fn cancel_pinned(&mut self) {}

    /// Returns `PeerLost` when the peer is known to be gone (process exited, socket closed) and no
    /// buffered bytes remain. Cheap enough to call every few milliseconds while waiting.
    fn check_peer(&mut self) -> Result<()>;

    /// Leaves `note` (why this rank is failing; the first [`FAREWELL_MAX`] bytes) where the peer
    /// can read it with [`Connection::farewell`] once this end has closed, so that it can report
    /// the cause rather than only the close. Transports without such a place ignore it.
    fn leave_farewell(&mut self, _note: &str) {}

    /// The note the peer left with [`Connection::leave_farewell`], if it left one.
    fn farewell(&self) -> Option<String> {
        None
    }
}

/// Longest note [`Connection::leave_farewell`] keeps, bytes.
pub const FAREWELL_MAX: usize = 1024;

/// [`Connection::try_recv_into`] through [`Connection::try_recv`]: copies what the transport lends.
/// The default implementation, and the fallback of transports that override it.
pub fn recv_into_by_lending<C: Connection + ?Sized>(conn: &mut C, dst: &mut [u8]) -> Result<usize> {
    let max = dst.len();
    let mut filled = 0usize;
    conn.try_recv(max, &mut |src: &[u8]| {
        let n = src.len().min(max);
        dst[..n].copy_from_slice(&src[..n]);
        filled = n;
        n
    })?;
    Ok(filled)
}

/// What the engine is waiting for on one peer's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interest {
    /// The peer's rank.
    pub peer: usize,
    /// Waiting for bytes from this peer.
    pub recv: bool,
    /// Waiting for room to send to this peer.
    pub send: bool,
}

/// Sleeps until a connection of this rank may be able to make progress.
///
/// Contract: `wait` returns at once if any peer signalled (new data or freed space) since the
/// previous `wait` returned, so a caller that polls its connections, finds nothing, and then
/// waits can never miss a wake-up. Spurious early returns are allowed; callers re-poll their
/// connections after every return.
pub trait IdleWaiter: Send {
    /// Blocks for at most `max` until one of `interest` may make progress.
    fn wait(&mut self, interest: &[Interest], max: Duration) -> Result<()>;
}
