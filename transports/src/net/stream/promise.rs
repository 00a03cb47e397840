//! Rendezvous promises: what a receiver offers, what a sender takes, and how a promise travels
//! as words (module docs of [`super`]).

use super::layout::PROMISE_WORDS;
use crate::net::regcache::Lease;
use crate::net::RemoteRegion;

/// A promise this side made: the peer may write stream bytes `start..end` straight into the
/// caller's memory at `addr`.
pub(super) struct RecvPromise {
    /// The promise's number (increasing per connection).
    pub(super) seq: u64,
    /// The stream positions the promise covers, `start..end`.
    pub(super) start: u64,
    pub(super) end: u64,
    /// The destination's first byte (at stream position `start`) and the end of the memory
    /// the caller promised (the whole `dst` of the call that made the promise).
    pub(super) addr: usize,
    pub(super) addr_end: usize,
    /// The destination's registration, held until the promise ends.
    pub(super) lease: Option<Lease>,
    /// The peer answered: it writes the bytes directly.
    pub(super) taken: bool,
}

/// What became of the promise this side made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PromiseState {
    /// None is open (never made, finished, or passed over just now).
    None,
    /// Not answered, and no ring bytes at its position yet.
    Pending,
    /// The peer writes the bytes straight into the destination.
    Taken,
}

/// A promise of the peer's this side took.
#[derive(Debug, Clone, Copy)]
pub(super) struct SendPromise {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) remote: RemoteRegion,
    /// This side's ring head when it took the promise (the ring position of `start`).
    pub(super) ring_at: u64,
}

/// A promise as it travels: number, stream range, and where the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Promise {
    pub(super) seq: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) remote: RemoteRegion,
}

impl Promise {
    pub(super) fn words(&self) -> [u64; PROMISE_WORDS] {
        let w = [
            self.seq,
            self.start,
            self.end,
            self.remote.base,
            self.remote.key,
            self.remote.len,
        ];
        [w[0], w[1], w[2], w[3], w[4], w[5], promise_check(&w)]
    }

    /// The promise in `words`, if they are one whole promise (not a write landed in part).
    pub(super) fn from_words(words: &[u64; PROMISE_WORDS]) -> Option<Promise> {
        let w: [u64; 6] = words[..6].try_into().ok()?;
        (w[0] != 0 && words[6] == promise_check(&w) && w[1] < w[2]).then_some(Promise {
            seq: w[0],
            start: w[1],
            end: w[2],
            remote: RemoteRegion {
                base: w[3],
                key: w[4],
                len: w[5],
            },
        })
    }
}

/// The bytes of a `len`-byte destination a promise offers: whole 8-byte words, so that ring
/// positions stay congruent to stream positions modulo 8 (a reader of 8-byte elements is then
/// never lent part of one at the ring's end); the rest comes through the ring.
pub(super) fn direct_len(len: usize) -> usize {
    len & !7
}

/// A check word over a promise's fields: a promise whose write landed in part fails it.
pub(super) fn promise_check(w: &[u64; 6]) -> u64 {
    w.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &v| {
        (h ^ v).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29)
    })
}
