//! The connection to one peer through its rings ([`ShmConnection`]): ring bytes, low-latency
//! messages and references, in the order the module docs of [`super`] lay down.

use super::cma::{cma_min_bytes, cma_read, InRef, OutRef, CMA_COOKIE, CMA_STAGE_BYTES};
use super::layout::{
    H_CMA_PROBE, LL_FIRST_DATA, LL_FLAG, LL_LINE, LL_MAX, LL_SLOTS, LL_SLOT_BYTES, REF_SLOTS,
    REF_SLOT_BYTES, R_CMA_OK, R_FAREWELL, R_FAREWELL_LEN, R_HEAD, R_LL, R_LL_DONE,
    R_RECEIVER_CLOSED, R_REFS, R_REF_COPIED, R_REF_HEAD, R_REF_TAIL, R_SENDER_CLOSED, R_TAIL,
};
use super::low_latency::{ll_line_span, ll_lines, ll_max_bytes, LlFront, LL_STAGE_WORDS};
use super::segment::Mapping;
use crate::conn::{Connection, FAREWELL_MAX};
use crate::error::{Result, TransportError};
use crate::ring::{RecvCursor, SendCursor};
use crate::util::ProcessWatch;
use nix::errno::Errno;
use std::sync::atomic::Ordering;
use std::sync::Arc;

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

impl ShmConnection {
    /// The peer's one-shot outbox (in its doorbell object, mapped already).
    pub fn peer_outbox(&self) -> Option<super::Outbox> {
        super::Outbox::of(&self.peer_bell)
    }

    /// Attaches to the peer: `own` is the ring it writes into (here), `remote` the ring this side
    /// writes into (the peer's), `peer_bell` the peer's doorbell.
    pub(super) fn attach(
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
        let cma_min = cma_min_bytes()?;
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
            ll_max: ll_max_bytes()?,
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
    ///
    /// Only the first line's flag is polled. The sender stores it last (with Release), so once it
    /// shows, the other lines are written too; their flags, checked as a guard, are then loaded
    /// together (one more transfer, in parallel). Polling every line's flag while the sender was
    /// still writing the lines pulled each of them back to this core between the sender's data
    /// and flag stores, and a 6-line message (256 bytes) took longer than through the ring.
    fn ll_front(&self) -> Result<Option<LlFront>> {
        let m = &*self.own;
        let slot = Self::ll_slot(self.rx, self.rx_ll);
        let want = self.rx_ll.wrapping_add(1);
        if m.u64_at(slot + LL_FLAG).load(Ordering::Acquire) != want {
            return Ok(None);
        }
        let meta = m.u64_at(slot + LL_FIRST_DATA).load(Ordering::Relaxed);
        let len = (meta >> 32) as usize;
        let ahead = u64::from((meta as u32).wrapping_sub(self.recv.tail as u32));
        if len == 0 || len > LL_MAX || ahead > m.layout.capacity as u64 {
            return Err(self.corrupt("low-latency message with a bad length or position"));
        }
        let complete = (1..ll_lines(len)).all(|line| {
            m.u64_at(slot + line * LL_LINE + LL_FLAG)
                .load(Ordering::Acquire)
                == want
        });
        Ok(Some(LlFront {
            ring_pos: self.recv.tail.wrapping_add(ahead),
            len,
            complete,
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

impl ShmConnection {
    /// Writes a prefix of `data` (as a low-latency message, or into the ring); with `whole`,
    /// all of it or nothing.
    fn send_bytes(&mut self, data: &[u8], whole: bool) -> Result<usize> {
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
        if n == 0 || (whole && n < data.len()) {
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
}

impl Connection for ShmConnection {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        self.send_bytes(data, false)
    }

    fn try_send_whole(&mut self, data: &[u8]) -> Result<bool> {
        Ok(self.send_bytes(data, true)? == data.len())
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
