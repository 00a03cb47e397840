//! The byte stream over one-sided writes ([`NetConnection`]): ring data, control words,
//! rendezvous, and the close (module docs of [`super`]).

use super::endpoints::{progress_all, EndpointState};
use super::layout::{
    counter_pair, ANSWER_IN, BOUNCE_SLOTS, CLOSED_IN, CLOSE_FLUSH, DIRECT_IN, HEAD_IN, LINGER,
    PROMISE_IN, PROMISE_SOURCE, PROMISE_WORDS, STRIPE, TAIL_IN,
};
use super::promise::{direct_len, Promise, PromiseState, RecvPromise, SendPromise};
use crate::conn::Connection;
use crate::error::{Result, TransportError};
use crate::net::regcache::RegistrationCache;
use crate::net::{Memory, NetError, Region, RemoteRegion};
use crate::ring::{RecvCursor, RingCorrupt, SendCursor};
use crate::util::lock;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A [`Connection`] over a network provider's one-sided writes (see the module docs).
pub struct NetConnection {
    pub(super) peer: usize,
    pub(super) provider: String,
    /// The endpoint and what its completions tell, shared with [`progress_all`].
    pub(super) io: Arc<Mutex<EndpointState>>,
    /// The handshake's TCP connection, kept for liveness and farewell notes; closed when this
    /// side fails, so that the peer learns it even if this rank lingers.
    pub(super) side: Option<Box<dyn Connection>>,
    pub(super) landing: Arc<Region>,
    pub(super) staging: Arc<Region>,
    /// This side's ring capacity (the front of `landing`).
    pub(super) cap: usize,
    /// The peer's landing region and its ring capacity.
    pub(super) remote: RemoteRegion,
    pub(super) remote_cap: usize,
    pub(super) send: SendCursor,
    pub(super) recv: RecvCursor,
    /// The head the peer was last sent (`send.head` once written).
    pub(super) head_sent: u64,
    pub(super) max_outstanding: usize,
    /// The pinned message being sent: stream position of its first unaccepted byte and how
    /// many bytes from there are posted but not yet known to have left.
    pub(super) pin: Option<(u64, usize)>,
    pub(super) lost: Option<TransportError>,
    pub(super) side_lost_at: Option<Instant>,
    pub(super) closed_sent: bool,
    /// Stream positions: bytes posted, and bytes consumed, through the ring or directly.
    pub(super) sent: u64,
    pub(super) read: u64,
    /// Rendezvous: the smallest pinned receive offered (0: none), the registrations of
    /// destinations, the promise this side made and the last number it used, the promise of
    /// the peer's being written and the last number read, the bounce slot written next, and
    /// the last `direct` and `answer` words seen.
    pub(super) rendezvous: usize,
    pub(super) cache: Arc<RegistrationCache>,
    pub(super) promise_out: Option<RecvPromise>,
    pub(super) promise_seq: u64,
    pub(super) promise_in: Option<SendPromise>,
    pub(super) promise_seen: u64,
    pub(super) bounce_next: usize,
    pub(super) direct_seen: u64,
    pub(super) answer_seen: u64,
    /// Bytes received straight into promised destinations.
    pub(super) direct_received: u64,
}

impl NetConnection {
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
        let (streams, ordered) = {
            let io = lock(&self.io);
            (io.eps.len(), io.ordered)
        };
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
            if !ordered {
                // The head moves as writes complete: pieces let it move along.
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
                    let r = io.post(e, |ep, id| {
                        ep.write(staging.range(at, n), remote.at(at as u64), id)
                    });
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
            // One endpoint whose writes are placed in order: the head may follow the data at
            // once. Otherwise `EndpointState::poll` moves it as data writes complete.
            self.sync_words(|io| {
                if io.ordered {
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
                ep.write(bounce.range(at, data.len()), p.remote.at(offset), id)
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
    pub(super) fn promise_written(&self) -> Option<Promise> {
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
                ep.write(
                    words.range(PROMISE_SOURCE, bytes.len()),
                    remote.at(offset),
                    id,
                )
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
