//! The byte stream of the [`Connection`] trait over a provider's one-sided writes.
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
//!   matters ([`RecvCursor::consumed`]'s rule: all known bytes used, a reader that stopped short,
//!   or an eighth of the ring waiting).
//! * Closing writes `closed` = 1 after everything else and waits (briefly) for the writes to
//!   leave. The TCP connection of the handshake stays open beside the rings: a peer whose socket
//!   closed without a close mark, and whose bytes stopped coming, is lost.
//!
//! **Rendezvous.** A pinned receive ([`Connection::try_recv_into_pinned`]) of at least
//! [`NetLink::rendezvous`] bytes that finds its ring empty registers its destination (through
//! the [`RegistrationCache`]) and writes a *promise* into the sender's `promise` words: stream
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
//! [`Connection::cancel_pinned`], which closes the endpoints before the caller's memory is
//! released.
//!
//! The ring counters follow [`crate::ring`]'s rules, checked against every interleaving there.

use super::regcache::{Lease, RegistrationCache};
use super::{Completion, Endpoint, Memory, NetError, Posted, Provider, Region, RemoteRegion};
use crate::conn::{Connection, IdleWaiter, Interest};
use crate::error::{Result, TransportError};
use crate::ring::{RecvCursor, RingCorrupt, SendCursor};
use crate::util::{lock, Deadline};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Bytes of control words after the ring.
const CONTROL: usize = 192;
const HEAD_IN: usize = 0;
const TAIL_IN: usize = 16;
const CLOSED_IN: usize = 32;
/// Rendezvous: the stream position up to which direct bytes were delivered (written by the
/// sender), the number of the last promise taken (by the sender), and the promise (by the
/// receiver: [`PROMISE_WORDS`] words).
const DIRECT_IN: usize = 48;
const ANSWER_IN: usize = 64;
const PROMISE_IN: usize = 128;
const PROMISE_WORDS: usize = 7;
/// Direct writes in flight per connection, each from its own [`STRIPE`]-byte bounce slot.
const BOUNCE_SLOTS: usize = 4;
/// Smallest and largest ring a peer may announce.
const RING_MIN: u64 = 4096;
const RING_MAX: u64 = 1 << 30;
/// How long a closing side waits for its last writes to leave.
const CLOSE_FLUSH: Duration = Duration::from_millis(500);
/// How long bytes may keep arriving after the side connection closed without a close mark.
const LINGER: Duration = Duration::from_secs(1);
/// Largest data write when a connection has several endpoints, so that a large send is spread
/// over all of them.
const STRIPE: usize = 256 << 10;
/// Registered slots for control words written without inline support, and their size; the
/// promise's source follows them.
const WORD_SLOTS: usize = 32;
const WORD_SLOT: usize = 16;
const PROMISE_SOURCE: usize = WORD_SLOTS * WORD_SLOT;
/// Most endpoints (queue pairs) per connection.
pub const MAX_STREAMS: usize = 16;
/// How long a [`NetWaiter`] sleeps between polls when nothing moved.
pub const NET_POLL_SLICE: Duration = Duration::from_micros(50);
const MAGIC: &[u8; 8] = b"WEFTNET2";
/// Bytes of the hello before the endpoint address.
const HELLO_FIXED: usize = 8 + 4 * 8 + 4;
const READY: u8 = 0xA5;

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

/// A promise this side made: the peer may write stream bytes `start..end` straight into the
/// caller's memory at `addr`.
struct RecvPromise {
    seq: u64,
    start: u64,
    end: u64,
    /// The destination's first byte (at stream position `start`) and the end of the memory
    /// the caller promised (the whole `dst` of the call that made the promise).
    addr: usize,
    addr_end: usize,
    /// The destination's registration, held until the promise ends.
    lease: Option<Lease>,
    /// The peer answered: it writes the bytes directly.
    taken: bool,
}

/// What became of the promise this side made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromiseState {
    /// None is open (never made, finished, or passed over just now).
    None,
    /// Not answered, and no ring bytes at its position yet.
    Pending,
    /// The peer writes the bytes straight into the destination.
    Taken,
}

/// A promise of the peer's this side took.
#[derive(Debug, Clone, Copy)]
struct SendPromise {
    start: u64,
    end: u64,
    remote: RemoteRegion,
    /// This side's ring head when it took the promise (the ring position of `start`).
    ring_at: u64,
}

/// A promise as it travels: number, stream range, and where the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Promise {
    seq: u64,
    start: u64,
    end: u64,
    remote: RemoteRegion,
}

impl Promise {
    fn words(&self) -> [u64; PROMISE_WORDS] {
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
    fn from_words(words: &[u64; PROMISE_WORDS]) -> Option<Promise> {
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
fn direct_len(len: usize) -> usize {
    len & !7
}

/// A check word over a promise's fields: a promise whose write landed in part fails it.
fn promise_check(w: &[u64; 6]) -> u64 {
    w.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &v| {
        (h ^ v).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29)
    })
}

/// A [`Connection`] over a network provider's one-sided writes (see the module docs).
pub struct NetConnection {
    peer: usize,
    provider: String,
    /// The endpoint and what its completions tell, shared with [`progress_all`].
    io: Arc<Mutex<EndpointState>>,
    /// The handshake's TCP connection, kept for liveness and farewell notes; closed when this
    /// side fails, so that the peer learns it even if this rank lingers.
    side: Option<Box<dyn Connection>>,
    landing: Arc<Region>,
    staging: Arc<Region>,
    /// This side's ring capacity (the front of `landing`).
    cap: usize,
    /// The peer's landing region and its ring capacity.
    remote: RemoteRegion,
    remote_cap: usize,
    send: SendCursor,
    recv: RecvCursor,
    /// The head the peer was last sent (`send.head` once written).
    head_sent: u64,
    max_outstanding: usize,
    /// The pinned message being sent: stream position of its first unaccepted byte and how
    /// many bytes from there are posted but not yet known to have left.
    pin: Option<(u64, usize)>,
    lost: Option<TransportError>,
    side_lost_at: Option<Instant>,
    closed_sent: bool,
    /// Stream positions: bytes posted, and bytes consumed, through the ring or directly.
    sent: u64,
    read: u64,
    /// Rendezvous: the smallest pinned receive offered (0: none), the registrations of
    /// destinations, the promise this side made and the last number it used, the promise of
    /// the peer's being written and the last number read, the bounce slot written next, and
    /// the last `direct` and `answer` words seen.
    rendezvous: usize,
    cache: Arc<RegistrationCache>,
    promise_out: Option<RecvPromise>,
    promise_seq: u64,
    promise_in: Option<SendPromise>,
    promise_seen: u64,
    bounce_next: usize,
    direct_seen: u64,
    answer_seen: u64,
    /// Bytes received straight into promised destinations.
    direct_received: u64,
}

/// An endpoint and the facts its completions established; locked by its connection's calls
/// and, when free, by [`progress_all`].
struct EndpointState {
    /// Declared first so that it closes before the regions below are deregistered: a
    /// provider may still read the staging mirror or place bytes in the landing ring until
    /// then, and [`progress_all`] may hold this state after the connection is gone.
    eps: Vec<Box<dyn Endpoint>>,
    _regions: [Arc<Region>; 2],
    /// Registered sources for control words on endpoints whose inline writes are too small
    /// (some providers have none): [`WORD_SLOTS`] slots of 16 bytes, each with the work
    /// request reading it while one does.
    words: Arc<Region>,
    slots: [Option<u64>; WORD_SLOTS],
    /// Work requests posted and not completed, per endpoint.
    outstanding: Vec<usize>,
    /// The endpoint the next data write goes to (round robin).
    rr: usize,
    next_wr: u64,
    /// Head writes posted and not completed: (work request, head value), in posting order.
    heads: VecDeque<(u64, u64)>,
    /// The largest head whose write completed: every byte before it has left this process.
    head_done: u64,
    /// Data writes posted: (work request, stream position after it, completed), in posting
    /// order; completed ones leave from the front.
    data: VecDeque<(u64, u64, bool)>,
    /// Every data byte before this stream position was written out of the staging mirror
    /// (its write completed): the mirror may be refilled up to here (a device may re-read a
    /// source until its write completes, so the peer's tail alone is not enough).
    data_done: u64,
    /// Direct (rendezvous) writes posted: (work request, stream position after it, completed),
    /// in posting order, and the stream position before which all of them completed.
    direct: VecDeque<(u64, u64, bool)>,
    direct_done: u64,
    /// `direct` word writes posted and not completed: (work request, value); and the largest
    /// value whose write completed (the peer knows every direct byte before it).
    direct_words: VecDeque<(u64, u64)>,
    direct_word_done: u64,
    /// The write of this side's promise, while in flight (its source is busy until then).
    promise_wr: Option<u64>,
    /// Registered bounce buffer of the direct writes ([`BOUNCE_SLOTS`] × [`STRIPE`] bytes),
    /// made when this side first takes a promise.
    bounce: Option<Arc<Region>>,
    failed: Option<NetError>,
    done: Vec<Completion>,
    /// The peer's landing region and ring size, and the queue bound, for the control words.
    remote: RemoteRegion,
    remote_cap: usize,
    max_outstanding: usize,
    /// Head and tail the connection wants the peer to know, and the values last posted:
    /// whoever polls this state posts what is pending ([`progress_all`] too), so bytes a
    /// plain `try_send` accepted leave even if their connection is never called again.
    head_want: u64,
    head_posted: u64,
    tail_want: u64,
    tail_posted: u64,
    direct_want: u64,
    direct_posted: u64,
}

impl EndpointState {
    /// Polls completions into the counters; the first failure is kept.
    fn poll(&mut self) {
        if self.failed.is_some() {
            return;
        }
        self.done.clear();
        for (ep, outstanding) in self.eps.iter_mut().zip(self.outstanding.iter_mut()) {
            let before = self.done.len();
            if let Err(e) = ep.poll(&mut self.done) {
                self.failed = Some(e);
                return;
            }
            *outstanding = outstanding.saturating_sub(self.done.len() - before);
        }
        for c in &self.done {
            if let Some(slot) = self.slots.iter_mut().find(|s| **s == Some(c.wr_id)) {
                *slot = None;
            }
            if self.promise_wr == Some(c.wr_id) {
                self.promise_wr = None;
            }
            if let Err(e) = &c.result {
                self.failed.get_or_insert_with(|| e.clone());
            }
            if let Some(i) = self.heads.iter().position(|&(id, _)| id == c.wr_id) {
                let (_, head) = self.heads.remove(i).unwrap_or_default();
                self.head_done = self.head_done.max(head);
            } else if let Some(i) = self.direct_words.iter().position(|&(id, _)| id == c.wr_id) {
                let (_, end) = self.direct_words.remove(i).unwrap_or_default();
                self.direct_word_done = self.direct_word_done.max(end);
            } else if let Some(w) = self.data.iter_mut().find(|w| w.0 == c.wr_id) {
                w.2 = true;
            } else if let Some(w) = self.direct.iter_mut().find(|w| w.0 == c.wr_id) {
                w.2 = true;
            }
        }
        while let Some(&(_, end, true)) = self.data.front() {
            self.data_done = end;
            self.data.pop_front();
        }
        while let Some(&(_, end, true)) = self.direct.front() {
            self.direct_done = end;
            self.direct.pop_front();
        }
        // Direct writes go to the destination on any endpoint: the `direct` word covers only
        // bytes whose writes completed.
        self.direct_want = self.direct_want.max(self.direct_done);
        if self.eps.len() > 1 {
            // Writes on different endpoints land in no particular order: the head covers
            // only bytes whose writes completed.
            self.head_want = self.head_want.max(self.data_done);
        }
    }

    fn total_outstanding(&self) -> usize {
        self.outstanding.iter().sum()
    }

    /// Whether direct writes, or the `direct` word after them, have yet to go out.
    fn direct_pending(&self) -> bool {
        !self.direct.is_empty() || self.direct_posted != self.direct_want
    }

    /// Closes every endpoint now, so that nothing more is placed in this side's memory (a
    /// promised destination) nor read from it, and fails the connection.
    fn close_endpoints(&mut self) {
        self.eps.clear();
        self.failed
            .get_or_insert(NetError::Abandoned { provider: "net" });
    }

    /// Posts the head and tail the peer has not been sent yet (a full queue leaves them for
    /// the next call).
    fn flush_words(&mut self) {
        if self.failed.is_some() {
            return;
        }
        for at in [HEAD_IN, TAIL_IN, DIRECT_IN] {
            let (want, posted) = match at {
                HEAD_IN => (self.head_want, self.head_posted),
                TAIL_IN => (self.tail_want, self.tail_posted),
                _ => (self.direct_want, self.direct_posted),
            };
            if want == posted {
                continue;
            }
            let offset = (self.remote_cap + at) as u64;
            let pair = counter_pair(want);
            match self.post_small(0, &pair, offset) {
                Ok(Some(id)) => match at {
                    HEAD_IN => {
                        self.heads.push_back((id, want));
                        self.head_posted = want;
                    }
                    TAIL_IN => self.tail_posted = want,
                    _ => {
                        self.direct_words.push_back((id, want));
                        self.direct_posted = want;
                    }
                },
                Ok(None) => {}
                Err(e) => self.failed = Some(e),
            }
        }
    }

    /// Writes `bytes` (a control word, at most 16) to `offset` of the peer's landing region on
    /// endpoint `e`: inline where the endpoint takes that many bytes inline, else from a free
    /// registered slot. The id if it was posted.
    fn post_small(
        &mut self,
        e: usize,
        bytes: &[u8],
        offset: u64,
    ) -> std::result::Result<Option<u64>, NetError> {
        let remote = self.remote;
        if bytes.len() <= self.eps[e].inline_max() {
            return self.post(e, |ep, id| ep.write_inline(bytes, &remote, offset, id));
        }
        let Some(slot) = self.slots.iter().position(Option::is_none) else {
            return Ok(None);
        };
        // SAFETY: no posted write reads this slot (its last one completed: the slot is free).
        unsafe { self.words.memory.write(slot * WORD_SLOT, bytes) };
        let words = Arc::clone(&self.words);
        let posted = self.post(e, |ep, id| {
            ep.write(&words, slot * WORD_SLOT, bytes.len(), &remote, offset, id)
        })?;
        if let Some(id) = posted {
            self.slots[slot] = Some(id);
        }
        Ok(posted)
    }

    /// Posts on endpoint `e` with a fresh work-request id; the id if it was taken.
    fn post(
        &mut self,
        e: usize,
        post: impl FnOnce(&mut dyn Endpoint, u64) -> std::result::Result<Posted, NetError>,
    ) -> std::result::Result<Option<u64>, NetError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.outstanding[e] >= self.max_outstanding {
            return Ok(None);
        }
        let id = self.next_wr;
        match post(self.eps[e].as_mut(), id)? {
            Posted::Yes => {
                self.next_wr += 1;
                self.outstanding[e] += 1;
                Ok(Some(id))
            }
            Posted::Full => Ok(None),
        }
    }
}

/// Every live network connection's endpoint in this process, so that any of them waiting
/// makes all of them progress (libfabric's tcp provider moves bytes only when polled: a
/// tail written by a rank that then left the connection alone must still leave).
fn registry() -> &'static Mutex<Vec<Weak<Mutex<EndpointState>>>> {
    static LIVE: OnceLock<Mutex<Vec<Weak<Mutex<EndpointState>>>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(Vec::new()))
}

/// Polls every network endpoint of this process that nobody else is polling right now.
pub fn progress_all() {
    let live: Vec<Arc<Mutex<EndpointState>>> = {
        let mut reg = lock(registry());
        reg.retain(|w| w.strong_count() > 0);
        reg.iter().filter_map(Weak::upgrade).collect()
    };
    for st in live {
        if let Ok(mut st) = st.try_lock() {
            st.poll();
            st.flush_words();
        }
    }
}

impl NetConnection {
    /// Makes the connection to `peer` over `provider`, shaped by `link`, by a handshake over
    /// `side` (a connected stream to the same peer, kept open afterwards). Both sides call this
    /// at about the same time.
    pub(crate) fn establish(
        peer: usize,
        mut side: Box<dyn Connection>,
        provider: &Arc<dyn Provider>,
        link: NetLink,
        deadline: &Deadline,
    ) -> Result<NetConnection> {
        let NetLink {
            ring: cap,
            streams,
            rendezvous,
        } = link;
        let cache = RegistrationCache::of(provider);
        let provider = provider.as_ref();
        let name = provider.name();
        let net = |e: NetError| TransportError::Net {
            peer: Some(peer),
            source: e,
        };
        if !cap.is_power_of_two() || (cap as u64) < RING_MIN || cap as u64 > RING_MAX {
            return Err(TransportError::Config(format!(
                "network ring of {cap} bytes: expected a power of two from {RING_MIN} to \
                 {RING_MAX}"
            )));
        }
        let alloc = |len: usize| {
            Memory::new(len).map(Arc::new).ok_or_else(|| {
                TransportError::Config(format!(
                    "cannot allocate {len} bytes of registered memory for rank {peer}"
                ))
            })
        };
        let memory = alloc(cap + CONTROL)?;
        // Both counters start at 0, with their complements.
        for at in [HEAD_IN, TAIL_IN] {
            memory.word(cap + at + 8).store(!0, Ordering::Relaxed);
        }
        let landing = provider.register(memory).map_err(net)?;
        if !(1..=MAX_STREAMS).contains(&streams) {
            return Err(TransportError::Config(format!(
                "{streams} endpoints per network connection: expected 1 to {MAX_STREAMS}"
            )));
        }
        let mut eps = Vec::with_capacity(streams);
        let mut addresses = Vec::new();
        addresses.extend_from_slice(&(streams as u32).to_le_bytes());
        for _ in 0..streams {
            let ep = provider.endpoint().map_err(net)?;
            let address = ep.address().map_err(net)?;
            addresses.extend_from_slice(&(address.len() as u32).to_le_bytes());
            addresses.extend_from_slice(&address);
            eps.push(ep);
        }

        let mut hello = Vec::with_capacity(HELLO_FIXED + addresses.len());
        let r = landing.remote();
        hello.extend_from_slice(MAGIC);
        for v in [cap as u64, r.base, r.key, r.len] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        hello.extend_from_slice(&(addresses.len() as u32).to_le_bytes());
        hello.extend_from_slice(&addresses);
        send_all(side.as_mut(), &hello, deadline, "sending the network hello")?;

        let mut fixed = [0u8; HELLO_FIXED];
        recv_exact(
            side.as_mut(),
            &mut fixed,
            deadline,
            "reading the network hello",
        )?;
        let bad =
            |what: String| TransportError::Protocol(format!("rank {peer}'s network hello: {what}"));
        if &fixed[..8] != MAGIC {
            return Err(bad("bad magic".into()));
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&fixed[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(b)
        };
        let (remote_cap, base, key, len) = (word(0), word(1), word(2), word(3));
        if !remote_cap.is_power_of_two()
            || !(RING_MIN..=RING_MAX).contains(&remote_cap)
            || len < remote_cap + CONTROL as u64
        {
            return Err(bad(format!(
                "ring of {remote_cap} bytes in a {len}-byte region"
            )));
        }
        let mut alen = [0u8; 4];
        alen.copy_from_slice(&fixed[HELLO_FIXED - 4..]);
        let alen = u32::from_le_bytes(alen) as usize;
        if alen > 4096 * (MAX_STREAMS + 1) {
            return Err(bad(format!("addresses of {alen} bytes")));
        }
        let mut block = vec![0u8; alen];
        recv_exact(
            side.as_mut(),
            &mut block,
            deadline,
            "reading the network addresses",
        )?;
        let peer_addresses =
            parse_addresses(&block).ok_or_else(|| bad("bad address list".into()))?;
        // Both sides use as many endpoints as the one with fewer has.
        eps.truncate(peer_addresses.len().min(streams));
        for (ep, address) in eps.iter_mut().zip(&peer_addresses) {
            ep.connect(address).map_err(net)?;
        }
        let staging = provider
            .register(alloc(remote_cap as usize)?)
            .map_err(net)?;

        // Neither side writes data before the other's endpoints are connected (a reliable
        // connection must be ready to receive). Each side first writes a zero into the peer's
        // close word on every endpoint and waits for the writes to complete, polling all the
        // while so that the peer's connection set-up progresses too (libfabric's rxm connects
        // on the first write).
        let peer_region = RemoteRegion { base, key, len };
        let close_word = remote_cap + CLOSED_IN as u64;
        let mut posted = vec![false; eps.len()];
        let mut warmed = vec![false; eps.len()];
        let mut sent_ready = false;
        let mut ready = [0u8; 1];
        let mut got_ready = false;
        let mut done = Vec::new();
        let warm_id = |k: usize| u64::MAX - k as u64;
        // Sources of the warm-up writes for endpoints without inline writes: one zeroed slot
        // each, untouched until the write completes.
        let words = Arc::new(
            provider
                .register(alloc(PROMISE_SOURCE + 8 * PROMISE_WORDS)?)
                .map_err(net)?,
        );
        while !(warmed.iter().all(|&w| w) && got_ready) {
            for (k, ep) in eps.iter_mut().enumerate() {
                if !posted[k] {
                    let zero = 0u64.to_le_bytes();
                    let r = if zero.len() <= ep.inline_max() {
                        ep.write_inline(&zero, &peer_region, close_word, warm_id(k))
                    } else {
                        ep.write(
                            &words,
                            k * WORD_SLOT,
                            8,
                            &peer_region,
                            close_word,
                            warm_id(k),
                        )
                    };
                    posted[k] = r.map_err(net)? == Posted::Yes;
                }
                done.clear();
                ep.poll(&mut done).map_err(net)?;
                for c in &done {
                    c.result.clone().map_err(net)?;
                    warmed[k] |= c.wr_id == warm_id(k);
                }
            }
            if warmed.iter().all(|&w| w) && !sent_ready {
                send_all(side.as_mut(), &[READY], deadline, "sending network ready")?;
                sent_ready = true;
            }
            if !got_ready && side.try_recv_into(&mut ready)? == 1 {
                if ready[0] != READY {
                    return Err(bad("bad ready byte".into()));
                }
                got_ready = true;
            }
            if deadline.expired() {
                return Err(deadline
                    .timeout_error(format!("connecting the network endpoints to rank {peer}")));
            }
            if !(warmed.iter().all(|&w| w) && got_ready) {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        let max_outstanding = eps
            .iter()
            .map(|e| e.max_outstanding())
            .min()
            .unwrap_or(4)
            .max(4);
        let n_eps = eps.len();
        let (landing, staging) = (Arc::new(landing), Arc::new(staging));
        let io = Arc::new(Mutex::new(EndpointState {
            eps,
            _regions: [Arc::clone(&landing), Arc::clone(&staging)],
            words,
            slots: [None; WORD_SLOTS],
            outstanding: vec![0; n_eps],
            rr: 0,
            next_wr: 0,
            heads: VecDeque::new(),
            head_done: 0,
            data: VecDeque::new(),
            data_done: 0,
            direct: VecDeque::new(),
            direct_done: 0,
            direct_words: VecDeque::new(),
            direct_word_done: 0,
            promise_wr: None,
            bounce: None,
            failed: None,
            done: Vec::new(),
            remote: peer_region,
            remote_cap: remote_cap as usize,
            max_outstanding,
            head_want: 0,
            head_posted: 0,
            tail_want: 0,
            tail_posted: 0,
            direct_want: 0,
            direct_posted: 0,
        }));
        lock(registry()).push(Arc::downgrade(&io));
        Ok(NetConnection {
            peer,
            provider: name,
            io,
            side: Some(side),
            landing,
            staging,
            cap,
            remote: peer_region,
            remote_cap: remote_cap as usize,
            send: SendCursor::default(),
            recv: RecvCursor::at(0),
            head_sent: 0,
            max_outstanding,
            pin: None,
            lost: None,
            side_lost_at: None,
            closed_sent: false,
            sent: 0,
            read: 0,
            rendezvous,
            cache,
            promise_out: None,
            promise_seq: 0,
            promise_in: None,
            promise_seen: 0,
            bounce_next: 0,
            direct_seen: 0,
            answer_seen: 0,
            direct_received: 0,
        })
    }

    /// The provider's name, for logs (`OFI/tcp;ofi_rxm`).
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Bytes this side received by rendezvous, written straight into its destinations.
    pub fn direct_received(&self) -> u64 {
        self.direct_received
    }

    fn word(&self, at: usize) -> u64 {
        self.landing
            .memory
            .word(self.cap + at)
            .load(Ordering::Acquire)
    }

    /// The counter at `at` if its pair is consistent, else `last` (a write landing in pieces).
    fn counter(&self, at: usize, last: u64) -> u64 {
        let value = self.word(at);
        let check = self.word(at + 8);
        if check == !value {
            value
        } else {
            last
        }
    }

    fn head_in(&self) -> u64 {
        self.counter(HEAD_IN, self.recv.head_seen)
    }

    fn lost_error(&self, e: &NetError) -> TransportError {
        match e {
            NetError::WorkFailed { .. } => TransportError::PeerLost {
                peer: self.peer,
                detail: e.to_string(),
            },
            _ => TransportError::Net {
                peer: Some(self.peer),
                source: e.clone(),
            },
        }
    }

    /// [`Self::fail`] for a provider's error.
    fn fail_net(&mut self, e: &NetError) -> TransportError {
        let err = self.lost_error(e);
        self.fail(err)
    }

    fn fail(&mut self, e: TransportError) -> TransportError {
        if self.lost.is_none() {
            self.lost = Some(e.clone());
            // The peer may be waiting for a tail or head that will never come: closing the
            // side connection tells it.
            self.side = None;
        }
        e
    }

    /// Polls completions, and sends the head and tail the peer has not been told yet.
    fn progress(&mut self) -> Result<()> {
        if let Some(e) = &self.lost {
            return Err(e.clone());
        }
        self.sync_words(|_| {})
    }

    /// Polls, lets `update` set the words the peer should know, posts what is pending, and
    /// records what was posted.
    fn sync_words(&mut self, update: impl FnOnce(&mut EndpointState)) -> Result<()> {
        let failed = {
            let mut io = lock(&self.io);
            io.poll();
            update(&mut io);
            io.flush_words();
            self.head_sent = io.head_posted;
            self.recv.tail_published = io.tail_posted;
            io.failed.clone()
        };
        match failed {
            Some(e) => Err(self.fail_net(&e)),
            None => Ok(()),
        }
    }

    /// Writes the peer's close word; whether it was posted.
    fn post_close(&mut self) -> Result<bool> {
        let offset = (self.remote_cap + CLOSED_IN) as u64;
        let posted = lock(&self.io).post_small(0, &1u64.to_le_bytes(), offset);
        posted.map(|p| p.is_some()).map_err(|e| self.fail_net(&e))
    }

    /// Posts as much of `data` as the peer's ring and the queues take (data writes of at most
    /// [`STRIPE`] bytes, round robin over the endpoints, none across the ring's end), then the
    /// new head; bytes a taken promise covers go straight to the peer's destination instead.
    /// Returns the bytes posted.
    fn post_data(&mut self, data: &[u8]) -> Result<usize> {
        let mut sent = 0usize;
        let streams = lock(&self.io).eps.len();
        while sent < data.len() {
            if !self.decide_promise()? {
                break;
            }
            if let Some(p) = self.promise_in.filter(|p| self.sent < p.end) {
                let n = (data.len() - sent).min((p.end - self.sent) as usize);
                match self.post_direct(&p, &data[sent..sent + n.min(STRIPE)], streams)? {
                    0 => break,
                    n => {
                        sent += n;
                        self.sent += n as u64;
                        continue;
                    }
                }
            }
            let (tail, data_done) = (
                self.counter(TAIL_IN, self.send.tail_seen),
                lock(&self.io).data_done,
            );
            // The mirror's bytes may be refilled once the peer consumed them and their write
            // completed.
            self.send.tail_seen = tail.min(data_done);
            let (n, at) = self
                .send
                .writable(data.len() - sent, self.remote_cap)
                .map_err(|c| self.corrupt(c))?;
            let mut n = n.min(self.remote_cap - at);
            if streams > 1 {
                n = n.min(STRIPE);
            }
            if n == 0 {
                break;
            }
            let posted = {
                let mut io = lock(&self.io);
                let e = io.rr;
                // Room for this write, and for the head on endpoint 0.
                let head_room = if e == 0 { 2 } else { 1 };
                if io.outstanding[e] + 1 > self.max_outstanding
                    || io.outstanding[0] + head_room > self.max_outstanding
                {
                    Ok(None)
                } else {
                    // SAFETY: [at, at+n) of the staging mirror is free: the peer consumed
                    // what was there and the write that read it out completed (`tail_seen`
                    // is the lower of the two).
                    unsafe { self.staging.memory.write(at, &data[sent..sent + n]) };
                    let (staging, remote) = (&self.staging, &self.remote);
                    let end = self.send.head + n as u64;
                    let r = io.post(e, |ep, id| ep.write(staging, at, n, remote, at as u64, id));
                    if let Ok(Some(id)) = r {
                        io.data.push_back((id, end, false));
                        io.rr = (e + 1) % streams;
                    }
                    r
                }
            };
            match posted {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    return Err(self.fail_net(&e));
                }
            }
            self.send.wrote(n);
            self.sent += n as u64;
            sent += n;
        }
        if self.head_sent != self.send.head {
            let head = self.send.head;
            // One endpoint keeps its writes in order: the head may follow the data at once.
            // Over several, `EndpointState::poll` moves it as data writes complete.
            self.sync_words(|io| {
                if streams == 1 {
                    io.head_want = head;
                }
            })?;
        }
        Ok(sent)
    }

    /// Copies `data` (at most [`STRIPE`] bytes of a taken promise's range, starting at this
    /// side's stream position) into a free bounce slot and writes it to the peer's
    /// destination. Returns the bytes posted (0: no free slot or queue room now).
    fn post_direct(&mut self, p: &SendPromise, data: &[u8], streams: usize) -> Result<usize> {
        let offset = self.sent - p.start;
        let posted = {
            let mut io = lock(&self.io);
            let e = io.rr;
            let head_room = if e == 0 { 2 } else { 1 };
            let Some(bounce) = io.bounce.clone() else {
                return Ok(0);
            };
            if io.direct.len() >= BOUNCE_SLOTS
                || io.outstanding[e] + 1 > self.max_outstanding
                || io.outstanding[0] + head_room > self.max_outstanding
            {
                return Ok(0);
            }
            let at = (self.bounce_next % BOUNCE_SLOTS) * STRIPE;
            // SAFETY: fewer than BOUNCE_SLOTS direct writes are in flight and they were posted
            // in slot order, so the write that last read this slot completed.
            unsafe { bounce.memory.write(at, data) };
            let end = self.sent + data.len() as u64;
            let r = io.post(e, |ep, id| {
                ep.write(&bounce, at, data.len(), &p.remote, offset, id)
            });
            if let Ok(Some(id)) = r {
                io.direct.push_back((id, end, false));
                io.rr = (e + 1) % streams;
            }
            r
        };
        match posted {
            Ok(Some(_)) => {
                self.bounce_next += 1;
                Ok(data.len())
            }
            Ok(None) => Ok(0),
            Err(e) => Err(self.fail_net(&e)),
        }
    }

    /// The peer's promise in this side's landing, if one whole promise is there.
    fn promise_written(&self) -> Option<Promise> {
        let mut words = [0u64; PROMISE_WORDS];
        for (i, w) in words.iter_mut().enumerate() {
            *w = self.word(PROMISE_IN + 8 * i);
        }
        Promise::from_words(&words)
    }

    /// Retires a taken promise whose bytes all left, and takes or declines a new one. False
    /// when a promise for this very position could not be answered yet (queue full): nothing
    /// may be written until it is.
    fn decide_promise(&mut self) -> Result<bool> {
        if let Some(p) = self.promise_in {
            let io = lock(&self.io);
            let ring_done = io.head_done.min(io.data_done);
            if self.sent >= p.end && io.direct_word_done >= p.end && ring_done >= p.ring_at {
                drop(io);
                self.promise_in = None;
            } else {
                return Ok(true);
            }
        }
        let Some(q) = self.promise_written().filter(|q| q.seq > self.promise_seen) else {
            return Ok(true);
        };
        let len = q.end - q.start;
        if q.start != self.sent || q.remote.len != len || len != direct_len(len as usize) as u64 {
            // Bytes at its position were written to the ring already: the receiver finds them
            // there, with no answer.
            self.promise_seen = q.seq;
            return Ok(true);
        }
        let answered = {
            let mut io = lock(&self.io);
            if io.bounce.is_none() {
                let memory = Memory::new(BOUNCE_SLOTS * STRIPE).ok_or_else(|| {
                    TransportError::Config(format!(
                        "cannot allocate {} bytes of registered memory for rank {}",
                        BOUNCE_SLOTS * STRIPE,
                        self.peer
                    ))
                })?;
                let region = self.cache.provider().register(Arc::new(memory));
                io.bounce = Some(Arc::new(region.map_err(|e| TransportError::Net {
                    peer: Some(self.peer),
                    source: e,
                })?));
            }
            let offset = (self.remote_cap + ANSWER_IN) as u64;
            io.post_small(0, &counter_pair(q.seq), offset)
        };
        match answered {
            Ok(Some(_)) => {
                self.promise_seen = q.seq;
                self.promise_in = Some(SendPromise {
                    start: q.start,
                    end: q.end,
                    remote: q.remote,
                    ring_at: self.send.head,
                });
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(self.fail_net(&e)),
        }
    }

    /// The stream position before which every byte this side sent has left (its write, and
    /// the head or `direct` word after it, completed).
    fn delivered(&self) -> u64 {
        let io = lock(&self.io);
        let ring = io.head_done.min(io.data_done);
        match self.promise_in {
            // Every direct byte so far lies before the ring bytes still on their way.
            None => ring + (self.sent - self.send.head),
            Some(p) if ring < p.ring_at => ring + (p.start - p.ring_at),
            Some(p) if io.direct_word_done < p.end => io.direct_word_done.max(p.start),
            Some(p) => p.end + (ring - p.ring_at),
        }
    }

    fn closed(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer,
            detail: format!("closed its end ({})", self.provider),
        }
    }

    fn ring_empty(&self) -> bool {
        self.head_in() == self.recv.tail
    }

    /// No byte waits to be read: none in the ring, none written to a taken promise's
    /// destination beyond what was read.
    fn nothing_to_read(&self) -> bool {
        let direct = self.promise_out.as_ref().is_some_and(|p| p.taken)
            && self.counter(DIRECT_IN, self.direct_seen) > self.read;
        self.ring_empty() && !direct
    }

    /// Offers `dst` to the peer as the destination of the next `dst.len()` stream bytes when
    /// the ring is empty (the peer may not have written them yet) and no earlier promise's
    /// write is in flight.
    fn offer(&mut self, dst: &mut [u8]) -> Result<()> {
        if self.lost.is_some()
            || self.word(CLOSED_IN) != 0
            || !self.ring_empty()
            || lock(&self.io).promise_wr.is_some()
        {
            return Ok(());
        }
        let Some(ptr) = std::ptr::NonNull::new(dst.as_mut_ptr()) else {
            return Ok(());
        };
        // SAFETY: the caller of `try_recv_into_pinned` calls again with the rest of this very
        // memory until every byte arrived, and the lease ends then; a promise given up ends
        // it only after the endpoints that could write the memory closed (`cancel_pinned`).
        let lease = match unsafe { self.cache.lease(ptr, direct_len(dst.len())) } {
            Ok(lease) => lease,
            Err(e) => {
                tracing::debug!(target: "weftcc::net", peer = self.peer, "no rendezvous: {e}");
                return Ok(());
            }
        };
        let promise = Promise {
            seq: self.promise_seq + 1,
            start: self.read,
            end: self.read + direct_len(dst.len()) as u64,
            remote: lease.remote(),
        };
        let bytes: Vec<u8> = promise
            .words()
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let posted = {
            let mut io = lock(&self.io);
            // SAFETY: no write reads the promise's source: the last promise's write completed
            // (`promise_wr` is empty).
            unsafe { io.words.memory.write(PROMISE_SOURCE, &bytes) };
            let (words, remote) = (Arc::clone(&io.words), io.remote);
            let offset = (self.remote_cap + PROMISE_IN) as u64;
            let r = io.post(0, |ep, id| {
                ep.write(&words, PROMISE_SOURCE, bytes.len(), &remote, offset, id)
            });
            if let Ok(Some(id)) = r {
                io.promise_wr = Some(id);
            }
            r
        };
        match posted {
            Ok(Some(_)) => {
                self.promise_seq = promise.seq;
                self.promise_out = Some(RecvPromise {
                    seq: promise.seq,
                    start: promise.start,
                    end: promise.end,
                    addr: ptr.as_ptr() as usize,
                    addr_end: ptr.as_ptr() as usize + dst.len(),
                    lease: Some(lease),
                    taken: false,
                });
                Ok(())
            }
            Ok(None) => {
                self.cache.release(lease);
                Ok(())
            }
            Err(e) => {
                self.cache.release(lease);
                Err(self.fail_net(&e))
            }
        }
    }

    /// Whether the open promise was taken, is still undecided, or (given `head`, read
    /// before this call) was passed over: ring bytes at its position and no answer, which
    /// would have landed before them. A passed-over promise is closed here.
    fn resolve_promise(&mut self, head: u64) -> PromiseState {
        let answer = self.counter(ANSWER_IN, self.answer_seen);
        self.answer_seen = answer;
        let Some(p) = self.promise_out.as_mut() else {
            return PromiseState::None;
        };
        if p.taken || answer == p.seq {
            p.taken = true;
            return PromiseState::Taken;
        }
        if head == self.recv.tail {
            return PromiseState::Pending;
        }
        if let Some(lease) = self.promise_out.take().and_then(|p| p.lease) {
            self.cache.release(lease);
        }
        PromiseState::None
    }

    /// Takes the bytes the peer wrote straight into a taken promise's destination, `dst`
    /// (the rest of the promised memory). `closed` was read before the `direct` word.
    fn recv_direct(
        &mut self,
        dst: &mut [u8],
        closed: bool,
        progressed: Result<()>,
    ) -> Result<usize> {
        let Some(p) = self.promise_out.as_ref() else {
            return Ok(0);
        };
        let end = p.end;
        let landed = self.counter(DIRECT_IN, self.direct_seen);
        self.direct_seen = landed;
        let landed = landed.min(end);
        if landed > self.read {
            let n = ((landed - self.read) as usize).min(dst.len());
            self.read += n as u64;
            self.direct_received += n as u64;
            if self.read == end {
                if let Some(lease) = self.promise_out.take().and_then(|p| p.lease) {
                    self.cache.release(lease);
                }
            }
            return Ok(n);
        }
        progressed?;
        if closed {
            let e = self.closed();
            return Err(self.fail(e));
        }
        Ok(0)
    }

    fn corrupt(&self, c: RingCorrupt) -> TransportError {
        TransportError::Protocol(format!(
            "rank {}'s ring counters are inconsistent ({c:?})",
            self.peer
        ))
    }
}

impl Connection for NetConnection {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        self.progress()?;
        if self.pin.is_some() {
            return Err(TransportError::Protocol(format!(
                "a plain write to rank {} while a pinned one is unfinished",
                self.peer
            )));
        }
        // The bytes are in the staging mirror: accepted now. They leave when this process
        // next polls any network connection ([`progress_all`]) or drops this one.
        self.post_data(data)
    }

    /// Accepts bytes only once the writes that carry them (and the head after them) have
    /// completed, so that a sender whose operation ends needs no further polling for its last
    /// bytes to leave.
    fn try_send_pinned(&mut self, data: &[u8]) -> Result<usize> {
        self.progress()?;
        let (base, ahead) = self.pin.unwrap_or((self.sent, 0));
        let ahead = ahead.min(data.len());
        let posted = self.post_data(&data[ahead..])?;
        let ahead = ahead + posted;
        let accepted = (self.delivered().saturating_sub(base) as usize).min(ahead);
        let ahead = ahead - accepted;
        self.pin = (ahead > 0).then_some((base + accepted as u64, ahead));
        Ok(accepted)
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        // Bytes already here are read even when the peer is gone (its tail writes then fail).
        if let Err(e) = self.progress() {
            if self.nothing_to_read() {
                return Err(e);
            }
        }
        // The close mark lands after the last head: read it first, so that "closed and
        // empty" is judged on a head read after it.
        let closed = self.word(CLOSED_IN) != 0;
        let head = self.head_in();
        if self.resolve_promise(head) == PromiseState::Taken {
            return Err(TransportError::Protocol(format!(
                "a plain read from rank {} while its bytes go to an unfinished pinned receive",
                self.peer
            )));
        }
        self.recv.head_seen = head;
        let (avail, at) = self
            .recv
            .readable(head, self.cap)
            .map_err(|c| self.corrupt(c))?;
        let len = (avail as usize).min(max).min(self.cap - at);
        if avail == 0 && closed {
            // Sends to a peer that closed fail from now on too.
            let e = self.closed();
            return Err(self.fail(e));
        }
        if len == 0 {
            return Ok(0);
        }
        // SAFETY: [at, at+len) lies between the tail and the head the peer published: it
        // writes only past the head, until this side's tail (sent later) frees the range.
        let used = unsafe { self.landing.memory.read(at, len, |s| consume(s)) }.min(len);
        self.read += used as u64;
        let publish = self
            .recv
            .consumed(used, len, RecvCursor::release_every(self.cap));
        if publish && self.lost.is_none() {
            // Not posted now (queue full): `progress` sends it later.
            let tail = self.recv.tail;
            self.sync_words(|io| io.tail_want = tail)?;
        }
        Ok(used)
    }

    /// Offers `dst` as a rendezvous destination when it is large enough and nothing waits in
    /// the ring; then takes the bytes the peer wrote there, or reads the ring.
    unsafe fn try_recv_into_pinned(&mut self, dst: &mut [u8]) -> Result<usize> {
        if let Some(p) = &self.promise_out {
            let at = p.addr + (self.read - p.start) as usize;
            if dst.as_ptr() as usize != at || at + dst.len() != p.addr_end {
                // The caller broke its promise: the peer must write no more.
                self.cancel_pinned();
                return Err(TransportError::Protocol(format!(
                    "a pinned receive from rank {} moved to other memory before it finished",
                    self.peer
                )));
            }
        }
        if self.promise_out.is_none()
            && self.rendezvous > 0
            && direct_len(dst.len()) >= self.rendezvous.max(8)
        {
            self.offer(dst)?;
        }
        if self.promise_out.is_some() {
            let progressed = self.progress();
            let closed = self.word(CLOSED_IN) != 0;
            let head = self.head_in();
            match self.resolve_promise(head) {
                PromiseState::Taken => return self.recv_direct(dst, closed, progressed),
                // Nothing in the ring, no answer yet: a read now could race the answer.
                PromiseState::Pending => {
                    progressed?;
                    if closed {
                        let e = self.closed();
                        return Err(self.fail(e));
                    }
                    return Ok(0);
                }
                PromiseState::None => {}
            }
        }
        self.try_recv_into(dst)
    }

    fn cancel_pinned(&mut self) {
        let Some(p) = self.promise_out.take() else {
            return;
        };
        // The peer may have taken the promise: nothing may land in the caller's memory once
        // this returns.
        lock(&self.io).close_endpoints();
        let e = TransportError::Net {
            peer: Some(self.peer),
            source: NetError::Abandoned { provider: "net" },
        };
        self.fail(e);
        if let Some(lease) = p.lease {
            self.cache.release(lease);
        }
    }

    fn check_peer(&mut self) -> Result<()> {
        let progressed = self.progress();
        let closed = self.word(CLOSED_IN) != 0;
        // An answer that landed with the last bytes and the close mark counts: those bytes
        // are in the destination.
        let head = self.head_in();
        self.resolve_promise(head);
        let empty = self.nothing_to_read();
        if let Err(e) = progressed {
            return if empty { Err(e) } else { Ok(()) };
        }
        if !empty {
            return Ok(());
        }
        if closed {
            let e = self.closed();
            return Err(self.fail(e));
        }
        let side = match self.side.as_mut() {
            Some(side) => side.check_peer(),
            None => Err(self.lost.clone().unwrap_or(TransportError::PeerLost {
                peer: self.peer,
                detail: "connection failed".into(),
            })),
        };
        match side {
            Ok(()) => Ok(()),
            Err(e) => {
                let since = *self.side_lost_at.get_or_insert_with(Instant::now);
                if since.elapsed() >= LINGER {
                    Err(self.fail(e))
                } else {
                    Ok(())
                }
            }
        }
    }

    fn leave_farewell(&mut self, note: &str) {
        if let Some(side) = self.side.as_mut() {
            side.leave_farewell(note);
        }
    }

    fn farewell(&self) -> Option<String> {
        self.side.as_ref().and_then(|s| s.farewell())
    }
}

impl Drop for NetConnection {
    fn drop(&mut self) {
        // A promise still open: the peer may be writing the caller's memory.
        self.cancel_pinned();
        if self.lost.is_some() || self.closed_sent {
            return;
        }
        // Everything posted, then the close mark, must leave before the endpoint goes: with
        // manual progress nothing is sent unless polled. Over several endpoints the head
        // waits for the data writes to be delivered, which needs the peer's progress: this
        // process's other endpoints are polled too (the peer may be one of them).
        let deadline = Instant::now() + CLOSE_FLUSH;
        while Instant::now() < deadline {
            if self.progress().is_err() {
                return;
            }
            progress_all();
            if !self.closed_sent
                && self.head_sent == self.send.head
                && !lock(&self.io).direct_pending()
            {
                match self.post_close() {
                    Ok(true) => self.closed_sent = true,
                    Ok(false) => {}
                    Err(_) => return,
                }
            }
            if self.closed_sent && lock(&self.io).total_outstanding() == 0 {
                return;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

fn send_all(
    c: &mut dyn Connection,
    mut data: &[u8],
    deadline: &Deadline,
    what: &str,
) -> Result<()> {
    while !data.is_empty() {
        let n = c.try_send(data)?;
        data = &data[n..];
        if n == 0 {
            if deadline.expired() {
                return Err(deadline.timeout_error(what.to_string()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    Ok(())
}

fn recv_exact(
    c: &mut dyn Connection,
    buf: &mut [u8],
    deadline: &Deadline,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = c.try_recv_into(&mut buf[got..])?;
        got += n;
        if n == 0 {
            c.check_peer()?;
            if deadline.expired() {
                return Err(deadline.timeout_error(what.to_string()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    Ok(())
}

/// The endpoint addresses of a hello: a count, then each address with its length.
fn parse_addresses(block: &[u8]) -> Option<Vec<Vec<u8>>> {
    let take = |at: &mut usize, n: usize| -> Option<&[u8]> {
        let s = block.get(*at..at.checked_add(n)?)?;
        *at += n;
        Some(s)
    };
    let mut at = 0;
    let count = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?) as usize;
    if count == 0 || count > MAX_STREAMS {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?) as usize;
        out.push(take(&mut at, len)?.to_vec());
    }
    (at == block.len()).then_some(out)
}

/// A counter and its complement, as one 16-byte write.
fn counter_pair(value: u64) -> [u8; 16] {
    let mut pair = [0u8; 16];
    pair[..8].copy_from_slice(&value.to_le_bytes());
    pair[8..].copy_from_slice(&(!value).to_le_bytes());
    pair
}

/// Sleeps in short slices: a network connection moves only when polled, and the caller polls
/// again after every return (spurious returns are allowed by [`IdleWaiter`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct NetWaiter;

impl IdleWaiter for NetWaiter {
    fn wait(&mut self, _interest: &[Interest], max: Duration) -> Result<()> {
        progress_all();
        std::thread::sleep(max.min(NET_POLL_SLICE));
        Ok(())
    }
}

/// Two connected ends over `provider` for tests and benchmarks (ranks 0 and 1 in this process),
/// each with a `cap`-byte ring, their handshakes over a loopback TCP pair (rendezvous from
/// [`TEST_RENDEZVOUS`]).
pub fn local_pair(
    provider: Arc<dyn Provider>,
    cap: usize,
) -> Result<(NetConnection, NetConnection)> {
    local_pair_striped(provider, cap, 1)
}

/// Smallest pinned receive offered for rendezvous by the pairs made for tests and benchmarks
/// ([`local_pair`]), so that the conformance suite covers the path.
pub const TEST_RENDEZVOUS: usize = 64 << 10;

/// [`local_pair`] with `streams` endpoints per connection (rendezvous from
/// [`TEST_RENDEZVOUS`]).
pub fn local_pair_striped(
    provider: Arc<dyn Provider>,
    cap: usize,
    streams: usize,
) -> Result<(NetConnection, NetConnection)> {
    local_pair_shaped(
        provider,
        NetLink {
            ring: cap,
            streams,
            rendezvous: TEST_RENDEZVOUS,
        },
    )
}

/// [`local_pair`] with connections shaped by `link`.
pub fn local_pair_shaped(
    provider: Arc<dyn Provider>,
    link: NetLink,
) -> Result<(NetConnection, NetConnection)> {
    let (a, b) = crate::tcp::local_pair(0, 1, crate::tcp::loopback(crate::tcp::Family::Inet))?;
    let deadline = Deadline::after(Duration::from_secs(30));
    let p = Arc::clone(&provider);
    let d = deadline;
    let other = std::thread::spawn(move || NetConnection::establish(0, Box::new(b), &p, link, &d));
    let mine = NetConnection::establish(1, Box::new(a), &provider, link, &deadline);
    let theirs = other
        .join()
        .map_err(|_| TransportError::Protocol("network handshake thread panicked".into()))?;
    Ok((mine?, theirs?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::loopback::{Faults, Loopback, LoopbackProvider};

    fn pair(faults: Faults) -> (NetConnection, NetConnection) {
        striped(faults, 1)
    }

    fn striped(faults: Faults, streams: usize) -> (NetConnection, NetConnection) {
        let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::with_faults(faults)));
        local_pair_striped(p, 4096, streams).expect("pair")
    }

    /// How the receiving side of [`transfer`] reads.
    #[derive(Clone, Copy)]
    enum Reads {
        /// `try_recv_into` in 777-byte pieces.
        Small,
        /// `try_recv_into_pinned` of this many bytes at a time, each to its end.
        Pinned(usize),
    }

    fn patterned(total: usize) -> Vec<u8> {
        (0..total).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Sends `total` patterned bytes from `a` to `b` (pinned or plain, in uneven pieces) on two
    /// threads; returns what `b` read and the receiving end, or the first error either side saw.
    fn transfer_with(
        a: NetConnection,
        b: NetConnection,
        total: usize,
        pinned: bool,
        reads: Reads,
    ) -> Result<(Vec<u8>, NetConnection)> {
        let data = patterned(total);
        let expect = data.clone();
        let deadline = Instant::now() + Duration::from_secs(20);
        let sender = std::thread::spawn(move || -> Result<NetConnection> {
            let mut a = a;
            let mut off = 0;
            let mut piece = 1;
            while off < data.len() {
                let end = (off + piece).min(data.len());
                let n = if pinned {
                    a.try_send_pinned(&data[off..end])?
                } else {
                    a.try_send(&data[off..end])?
                };
                off += n;
                if n == end - off + n {
                    piece = piece * 3 % 50_000 + 1;
                }
                if n == 0 {
                    a.check_peer()?;
                    assert!(Instant::now() < deadline, "send stuck at {off}");
                    NetWaiter.wait(&[], Duration::from_millis(1))?;
                }
            }
            Ok(a)
        });
        let mut b = b;
        let mut got = vec![0u8; total];
        let mut filled = 0;
        let result = loop {
            if filled == total {
                break Ok(());
            }
            let r = match reads {
                Reads::Small => {
                    let end = (filled + 777).min(total);
                    b.try_recv_into(&mut got[filled..end])
                }
                Reads::Pinned(size) => {
                    // The rest of the current message, as the engine asks.
                    let end = (filled / size * size + size).min(total);
                    recv_pinned(&mut b, &mut got[filled..end])
                }
            };
            match r {
                Ok(0) => {
                    if let Err(e) = b.check_peer() {
                        break Err(e);
                    }
                    assert!(Instant::now() < deadline, "receive stuck at {filled}");
                    NetWaiter.wait(&[], Duration::from_millis(1))?;
                }
                Ok(n) => filled += n,
                Err(e) => break Err(e),
            }
        };
        let sent = sender.join().expect("sender thread");
        result?;
        drop(sent?);
        if let Some(i) = got.iter().zip(&expect).position(|(g, e)| g != e) {
            panic!(
                "byte {i} of {total} is wrong: {} instead of {}",
                got[i], expect[i]
            );
        }
        Ok((got, b))
    }

    fn transfer(a: NetConnection, b: NetConnection, total: usize, pinned: bool) -> Result<Vec<u8>> {
        transfer_with(a, b, total, pinned, Reads::Small).map(|(got, _)| got)
    }

    fn shaped(faults: Faults, streams: usize, rendezvous: usize) -> (NetConnection, NetConnection) {
        let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::with_faults(faults)));
        let link = NetLink {
            ring: 4096,
            streams,
            rendezvous,
        };
        local_pair_shaped(p, link).expect("pair")
    }

    #[test]
    fn completions_out_of_order_and_a_shallow_queue_keep_the_stream() {
        for pinned in [false, true] {
            let faults = Faults {
                reverse_completions: true,
                queue_depth: Some(4),
                ..Faults::default()
            };
            let (a, b) = pair(faults);
            transfer(a, b, 300_000, pinned).expect("transfer");
        }
    }

    #[test]
    fn writes_landing_in_pieces_never_expose_a_half_written_counter() {
        // Counters cross 64 KiB boundaries many times: a head or tail read with only its low
        // two bytes new would be far off (and caught as corrupt, or read as bytes not there).
        for pinned in [false, true] {
            let (a, b) = pair(Faults {
                split_writes: true,
                ..Faults::default()
            });
            transfer(a, b, 3 << 20, pinned).expect("transfer");
        }
    }

    #[test]
    fn several_endpoints_keep_the_stream_whatever_order_writes_land_in() {
        // Completions reversed, writes landing in pieces, shallow queues, three endpoints: the
        // head never covers a byte whose write is still on its way.
        for pinned in [false, true] {
            let faults = Faults {
                reverse_completions: true,
                split_writes: true,
                slow_data: true,
                queue_depth: Some(6),
                ..Faults::default()
            };
            let (a, b) = striped(faults, 3);
            transfer(a, b, 1 << 20, pinned).expect("transfer");
        }
    }

    #[test]
    fn endpoints_without_inline_writes_send_control_words_from_registered_slots() {
        for streams in [1, 2] {
            let faults = Faults {
                no_inline: true,
                reverse_completions: true,
                ..Faults::default()
            };
            let (a, b) = striped(faults, streams);
            transfer(a, b, 300_000, true).expect("transfer");
        }
    }

    /// A pinned receive: every caller here asks again for the rest of `dst`, before anything
    /// else, until it is full, and keeps `dst` alive until its connection is dropped.
    fn recv_pinned(c: &mut NetConnection, dst: &mut [u8]) -> Result<usize> {
        // SAFETY: as above.
        unsafe { c.try_recv_into_pinned(dst) }
    }

    /// Polls `c` until `done` holds (the loopback places a side's writes when it polls).
    fn poll_until(c: &mut NetConnection, mut done: impl FnMut(&mut NetConnection) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(c) {
            assert!(Instant::now() < deadline, "condition never held");
            progress_all();
        }
    }

    /// The in-memory provider, and libfabric's tcp provider where it opens.
    fn providers() -> Vec<Arc<dyn Provider>> {
        let mut all: Vec<Arc<dyn Provider>> = vec![Arc::new(LoopbackProvider(Loopback::new()))];
        match crate::net::ofi::OfiProvider::open(Some("tcp"), false) {
            Ok(p) => all.push(Arc::new(p)),
            Err(e) => eprintln!("libfabric's tcp provider not usable here ({e}): loopback only"),
        }
        all
    }

    #[test]
    fn a_waiting_pinned_receive_gets_the_bytes_written_straight_into_it() {
        for (provider, streams) in providers()
            .into_iter()
            .flat_map(|p| [(p.clone(), 1), (p, 3)])
        {
            let link = NetLink {
                ring: 4096,
                streams,
                rendezvous: 1024,
            };
            let (mut a, mut b) = local_pair_shaped(provider, link).expect("pair");
            let data = patterned(300_000);
            let mut got = vec![0u8; data.len()];
            // The receiver waits first: its destination is promised, and the promise lands.
            assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
            poll_until(&mut b, |b| lock(&b.io).promise_wr.is_none());
            let (mut sent, mut filled) = (0, 0);
            let deadline = Instant::now() + Duration::from_secs(10);
            while filled < got.len() {
                if sent < data.len() {
                    sent += a.try_send_pinned(&data[sent..]).unwrap();
                }
                filled += recv_pinned(&mut b, &mut got[filled..]).unwrap();
                assert!(Instant::now() < deadline, "stuck at {filled}");
                progress_all();
            }
            assert!(got == data, "{streams} endpoints: the bytes differ");
            assert_eq!(
                b.direct_received(),
                data.len() as u64,
                "not one byte through the ring"
            );
            assert_eq!(b.recv.tail, 0, "the ring was never used");
            let deadline = Instant::now() + Duration::from_secs(10);
            while sent < data.len() {
                sent += a.try_send_pinned(&data[sent..]).unwrap();
                if Instant::now() > deadline {
                    let io = lock(&a.io);
                    panic!(
                        "sender stuck at {sent}: promise {:?}, direct done {} word done {} want {} posted {} words {:?}",
                        a.promise_in, io.direct_done, io.direct_word_done, io.direct_want, io.direct_posted, io.direct_words
                    );
                }
            }
            // The stream goes on through the ring after the promise.
            a.try_send(b"after").unwrap();
            let mut tail = [0u8; 5];
            poll_until(&mut b, |b| b.try_recv_into(&mut tail).unwrap() == 5);
            assert_eq!(&tail, b"after");
        }
    }

    #[test]
    fn direct_bytes_are_read_after_the_sender_closed() {
        // The answer, the bytes, their word and the close mark all land before the receiver
        // looks again: a liveness check must see the bytes, not a closed peer.
        let (mut a, mut b) = shaped(Faults::default(), 1, 1024);
        let data = patterned(100_000);
        let mut got = vec![0u8; data.len()];
        assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
        poll_until(&mut b, |b| lock(&b.io).promise_wr.is_none());
        let mut sent = 0;
        poll_until(&mut a, |a| {
            sent += a.try_send_pinned(&data[sent..]).unwrap();
            sent == data.len()
        });
        drop(a);
        b.check_peer()
            .expect("bytes are waiting: the peer is not lost yet");
        let mut filled = 0;
        while filled < got.len() {
            filled += recv_pinned(&mut b, &mut got[filled..]).unwrap();
        }
        assert!(got == data, "the bytes differ");
        assert_eq!(b.direct_received(), data.len() as u64);
        assert!(b.check_peer().is_err(), "closed and read to the end");
    }

    #[test]
    fn a_promise_the_sender_passed_over_is_read_from_the_ring() {
        let fabric = Loopback::new();
        let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(fabric.clone()));
        let link = NetLink {
            ring: 4096,
            streams: 1,
            rendezvous: 1024,
        };
        let (mut a, mut b) = local_pair_shaped(p, link).expect("pair");
        // The sender writes first: its bytes are in the ring (posted, not landed yet) when the
        // receiver offers its destination. Held, since other tests' `progress_all` polls these
        // endpoints too and would land them at any moment.
        fabric.hold_data(true);
        let data = patterned(3000);
        assert_eq!(a.try_send(&data).unwrap(), 3000);
        let mut got = vec![0u8; 3000];
        assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
        assert!(b.promise_out.is_some(), "offered: the ring looked empty");
        fabric.hold_data(false);
        let mut filled = 0;
        poll_until(&mut b, |b| {
            filled += recv_pinned(b, &mut got[filled..]).unwrap();
            filled == 3000
        });
        assert_eq!(got, data);
        assert_eq!(b.direct_received(), 0);
        assert!(b.promise_out.is_none(), "the passed-over promise is closed");
        // The stale promise in the sender's landing is never taken later.
        poll_until(&mut a, |a| a.promise_written().is_some());
        a.try_send_pinned(&data[..8]).unwrap();
        assert!(a.promise_in.is_none());
    }

    #[test]
    fn rendezvous_and_ring_interleave_without_losing_a_byte() {
        // Messages of 40 000 bytes read pinned while the sender sends in uneven pieces: some
        // promises are taken, some passed over, under every fault that reorders or splits.
        for (streams, pinned) in [(1, true), (1, false), (3, true)] {
            let faults = Faults {
                reverse_completions: true,
                split_writes: true,
                slow_data: true,
                queue_depth: Some(6),
                ..Faults::default()
            };
            let (a, b) = shaped(faults, streams, 1000);
            let (_, b) =
                transfer_with(a, b, 2 << 20, pinned, Reads::Pinned(40_000)).expect("transfer");
            assert!(b.read == 2 << 20);
            assert!(b.direct_received() > 0, "no promise was taken");
        }
    }

    #[test]
    fn a_reader_of_whole_words_is_never_stalled_after_a_direct_message_of_odd_length() {
        // Messages of 5004 bytes (copied: offered to the sender) alternate with 2400 bytes of
        // 8-byte elements (reduced: lent, whole elements only) through a 4 KiB ring. Were the
        // direct bytes not whole words, the ring would hold the elements 4 bytes off their
        // stream alignment and lend half an element at its end, which the reader never takes.
        let (mut a, mut b) = shaped(Faults::default(), 1, 1024);
        let (odd, words, rounds) = (5004, 2400, 40);
        let message = move |r: usize| -> Vec<u8> {
            let total = odd + 4 + words; // padded to 8, as the engine does
            (0..total).map(|i| (i * 13 + r * 7) as u8).collect()
        };
        let sender = std::thread::spawn(move || {
            for r in 0..rounds {
                let m = message(r);
                let mut off = 0;
                let deadline = Instant::now() + Duration::from_secs(10);
                while off < m.len() {
                    off += a.try_send(&m[off..]).unwrap();
                    assert!(Instant::now() < deadline, "send stuck");
                    progress_all();
                }
            }
            a
        });
        let mut direct = 0;
        for r in 0..rounds {
            let m = message(r);
            let mut got = vec![0u8; odd];
            let mut filled = 0;
            poll_until(&mut b, |b| {
                filled += recv_pinned(b, &mut got[filled..]).unwrap();
                filled == odd
            });
            assert!(got[..] == m[..odd], "round {r}: copied bytes differ");
            let mut pad = [0u8; 4];
            let mut n = 0;
            poll_until(&mut b, |b| {
                n += b.try_recv_into(&mut pad[n..]).unwrap();
                n == 4
            });
            let mut elements = Vec::new();
            poll_until(&mut b, |b| {
                let want = words - elements.len();
                b.try_recv(want, &mut |s: &[u8]| {
                    let whole = s.len() / 8 * 8;
                    elements.extend_from_slice(&s[..whole]);
                    whole
                })
                .unwrap();
                elements.len() == words
            });
            assert!(elements[..] == m[odd + 4..], "round {r}: elements differ");
            direct = b.direct_received();
        }
        drop(sender.join().expect("sender"));
        assert!(direct > 0, "no message went direct");
    }

    #[test]
    fn a_peer_that_vanishes_between_direct_bytes_and_their_word_is_lost() {
        for vanish in [12, 20, 40] {
            let (a, b) = shaped(
                Faults {
                    vanish_after: Some(vanish),
                    ..Faults::default()
                },
                1,
                1000,
            );
            let err = transfer_with(a, b, 1 << 20, true, Reads::Pinned(100_000))
                .map(|_| ())
                .expect_err("the peer vanished");
            assert!(matches!(err, TransportError::PeerLost { .. }), "{err:?}");
        }
    }

    #[test]
    fn a_cancelled_pinned_receive_is_never_written_again() {
        let (mut a, mut b) = shaped(Faults::default(), 1, 1024);
        let mut got = vec![0u8; 200_000];
        assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
        poll_until(&mut b, |b| lock(&b.io).promise_wr.is_none());
        let data = vec![7u8; 200_000];
        // The sender takes the promise and has some bytes on their way.
        let first = a.try_send_pinned(&data).unwrap();
        assert!(a.promise_in.is_some(), "taken");
        b.cancel_pinned();
        let before = got.clone();
        // Whatever the sender does now fails, and the destination stays as it was.
        let mut sent = first;
        let err = loop {
            progress_all();
            match a.try_send_pinned(&data[sent..]).and_then(|n| {
                sent += n;
                a.check_peer()
            }) {
                Ok(()) => assert!(sent < data.len(), "all accepted after the cancel"),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, TransportError::PeerLost { .. }), "{err:?}");
        assert!(got == before, "written after the cancel");
        assert!(
            b.try_recv_into(&mut got).is_err(),
            "the connection is closed"
        );
    }

    #[test]
    fn promises_are_whole_or_not_at_all() {
        let p = Promise {
            seq: 3,
            start: 100,
            end: 4196,
            remote: RemoteRegion {
                base: 0x7000,
                key: 42,
                len: 4096,
            },
        };
        let words = p.words();
        assert_eq!(Promise::from_words(&words), Some(p));
        for i in 0..PROMISE_WORDS {
            let mut torn = words;
            torn[i] ^= 1 << (i * 5);
            assert_eq!(Promise::from_words(&torn), None, "word {i} changed");
        }
        assert_eq!(
            Promise::from_words(&[0; PROMISE_WORDS]),
            None,
            "nothing written"
        );
    }

    #[test]
    fn hello_address_lists_are_checked() {
        let mut block = Vec::new();
        block.extend_from_slice(&2u32.to_le_bytes());
        for a in [&b"abc"[..], &b"de"[..]] {
            block.extend_from_slice(&(a.len() as u32).to_le_bytes());
            block.extend_from_slice(a);
        }
        assert_eq!(
            parse_addresses(&block),
            Some(vec![b"abc".to_vec(), b"de".to_vec()])
        );
        assert_eq!(parse_addresses(&block[..block.len() - 1]), None, "short");
        let mut long = block.clone();
        long.push(0);
        assert_eq!(parse_addresses(&long), None, "trailing bytes");
        assert_eq!(parse_addresses(&0u32.to_le_bytes()), None, "no endpoint");
        assert_eq!(parse_addresses(&99u32.to_le_bytes()), None, "too many");
    }

    #[test]
    fn a_failed_write_is_peer_lost_on_both_ends_not_a_hang() {
        // Write 40 is a data write well into the stream (the handshake wrote 2).
        let (a, b) = pair(Faults {
            fail_write: Some(40),
            ..Faults::default()
        });
        let err = transfer(a, b, 1 << 20, true).expect_err("a write failed");
        assert!(
            matches!(&err, TransportError::PeerLost { detail, .. } if detail.contains("injected") || detail.contains("closed") || detail.contains("gone")),
            "{err:?}"
        );
    }

    #[test]
    fn a_peer_that_vanishes_between_data_and_head_is_lost() {
        // The fabric dies after 31 placed writes: some data without its head, at the latest.
        let (a, b) = pair(Faults {
            vanish_after: Some(31),
            ..Faults::default()
        });
        let err = transfer(a, b, 1 << 20, false).expect_err("the peer vanished");
        assert!(matches!(err, TransportError::PeerLost { .. }), "{err:?}");
    }

    #[test]
    fn pinned_bytes_are_accepted_only_once_written() {
        let (mut a, mut b) = pair(Faults::default());
        let data = [9u8; 1000];
        // Posted, but the loopback places writes only when polled: nothing is accepted before
        // the completions are seen.
        let first = a.try_send_pinned(&data).unwrap();
        assert_eq!(first, 0, "accepted before the write completed");
        let mut accepted = first;
        while accepted < data.len() {
            accepted += a.try_send_pinned(&data[accepted..]).unwrap();
        }
        let mut got = [0u8; 1000];
        let mut n = 0;
        while n < got.len() {
            n += b.try_recv_into(&mut got[n..]).unwrap();
        }
        assert_eq!(got, data);
    }
}
