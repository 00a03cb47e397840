//! Several communicators over one connection.
//!
//! A split communicator reuses its parent's connection to a peer that is the same process in
//! both: every connection of a communicator family (a communicator and the splits made from it)
//! is a [`Mux`], and each communicator reads and writes through its own [`Channel`] of it, which
//! is a [`Connection`] like any other. Bytes travel in frames:
//!
//! ```text
//! header (16 bytes): channel u64 | length u32 | kind u8 | 0 u8 x3      (little endian)
//!   kind 0 DATA    `length` bytes of the channel's stream follow
//!   kind 1 NOTE    `length` (<= FAREWELL_MAX) bytes: the sender's farewell note for the channel
//!   kind 2 CLOSED  length 0: the sender's communicator of this channel is gone
//! ```
//!
//! Sending: one frame is written at a time, for one write of a channel: its header, then the
//! bytes (in the same write of the connection when there are at most [`INLINE_MAX`] of them:
//! one low-latency message over shared memory). Bytes go straight from the caller's memory
//! (pinned writes stay single-copy) and a write reports only what the connection took, so no
//! byte a caller counts as sent waits here. The frame stays open until the channel has written
//! all of it, and the other channels wait meanwhile; the collectives engine always finishes
//! the messages it starts, and a channel dropped with its frame open closes the connection
//! (below). Only control frames (below) and the rest of a header wait in a backlog here, sent
//! before anything else on the next call of any channel.
//!
//! Receiving: the reader of a channel reads frames in order; a frame of another channel is
//! copied into that channel's inbox (and its owner's [`Signal`] is raised), so no communicator
//! ever waits for another to read. The cost is memory: bytes for a communicator that is not
//! reading wait in the heap, as much as its peers send before they need an answer.
//!
//! Waking: a reader raises the [`Signal`] of every other open channel when it read from the
//! connection (a socket read may take their bytes into the connection's own buffer, where their
//! waiter's `poll` cannot see them), and a write refused behind another channel's frame is woken
//! when that frame ends.
//!
//! Frame boundaries fall on multiples of 8 bytes of a stream whose writes are multiples of 8
//! bytes, so the alignment promise of [`Connection::try_recv`] holds through a channel.
//!
//! Failure: a peer process that dies or closes the connection fails every channel
//! ([`TransportError::PeerLost`], numbered with each channel's own peer rank). A communicator
//! that is dropped sends CLOSED: the peer's channel then reports `PeerLost` once its inbox is
//! empty. A channel dropped in the middle of its own pinned frame cannot complete it, so the
//! whole connection is closed (with the channel's farewell note, if it left one): the peer's
//! other channels fail too rather than read a stream that stopped mid-frame, and the family does
//! not connect that peer again. Notes (kind NOTE, padded to whole words) travel per channel; the
//! connection's own farewell place is left alone, since the connection may outlive the
//! communicator that left the note.

use crate::conn::{Connection, FAREWELL_MAX};
use crate::error::{Result, TransportError};
use crate::util::{lock, AlignedBuf};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes of a frame header.
pub const FRAME_HEADER: usize = 16;
/// Writes up to this size travel with their header in one write.
pub const INLINE_MAX: usize = 4096;
/// Longest frame (a longer write continues in another frame).
const FRAME_MAX: usize = 1 << 30;
/// An emptied inbox or backlog larger than this gives its memory back.
const KEEP_MAX: usize = 256 << 10;

const KIND_DATA: u8 = 0;
const KIND_NOTE: u8 = 1;
const KIND_CLOSED: u8 = 2;

/// Which communicator a frame belongs to: [`channel_id`] of its store namespace.
pub type ChannelId = u64;

/// The channel id of the communicator with store namespace `namespace` (unique per job).
pub fn channel_id(namespace: &str) -> ChannelId {
    crate::util::fnv1a64(namespace.as_bytes())
}

/// Raised (incremented) whenever another channel's reader moved bytes into one of this
/// communicator's inboxes, so that its waiter does not sleep on a socket that was drained.
pub type Signal = Arc<AtomicU64>;

/// A header's channel, length and kind.
fn parse(h: &[u8; FRAME_HEADER]) -> (ChannelId, usize, u8) {
    let mut channel = [0u8; 8];
    channel.copy_from_slice(&h[..8]);
    let mut len = [0u8; 4];
    len.copy_from_slice(&h[8..12]);
    (
        u64::from_le_bytes(channel),
        u32::from_le_bytes(len) as usize,
        h[12],
    )
}

fn header(channel: ChannelId, kind: u8, len: usize) -> [u8; FRAME_HEADER] {
    let mut h = [0u8; FRAME_HEADER];
    h[..8].copy_from_slice(&channel.to_le_bytes());
    h[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    h[12] = kind;
    h
}

/// Bytes in arrival order, stored so that the first unread byte keeps its stream alignment.
#[derive(Default)]
struct Inbox {
    buf: Option<AlignedBuf>,
    start: usize,
    end: usize,
    /// Bytes of this channel's stream read off the connection so far (into here or straight
    /// to a reader): an empty inbox restarts at this position's offset within a word, so that
    /// lent slices keep the stream's alignment.
    stream: u64,
    note: Option<String>,
    closed: bool,
    signal: Option<Signal>,
}

impl Inbox {
    fn bytes(&self) -> &[u8] {
        match &self.buf {
            // An empty inbox's start may lie past a small buffer's end (see `push`).
            Some(b) if self.start < self.end => &b.as_slice()[self.start..self.end],
            _ => &[],
        }
    }

    fn push(&mut self, data: &[u8]) {
        if self.start == self.end {
            // Empty: start over at the stream's offset within a word.
            self.start = (self.stream % 8) as usize;
            self.end = self.start;
        }
        let cap = self.buf.as_ref().map_or(0, AlignedBuf::len);
        if self.end + data.len() > cap {
            // Grow (at least double), keeping the first byte's offset within its word.
            let keep = self.start % 8;
            let live = self.end - self.start;
            let mut grown = AlignedBuf::new((keep + live + data.len()).max(2 * cap));
            grown.as_mut_slice()[keep..keep + live].copy_from_slice(self.bytes());
            self.buf = Some(grown);
            self.start = keep;
            self.end = keep + live;
        }
        if let Some(b) = &mut self.buf {
            b.as_mut_slice()[self.end..self.end + data.len()].copy_from_slice(data);
        }
        self.end += data.len();
        self.stream += data.len() as u64;
        self.raise();
    }

    fn raise(&self) {
        if let Some(s) = &self.signal {
            s.fetch_add(1, Ordering::Release);
        }
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end && self.buf.as_ref().is_some_and(|b| b.len() > KEEP_MAX) {
            // A burst for an idle communicator should not pin its memory for ever.
            self.buf = None;
        }
    }
}

/// The frame being read.
struct RxFrame {
    channel: ChannelId,
    kind: u8,
    left: usize,
    note: Vec<u8>,
}

struct State {
    /// `None` once the connection was closed by this side (see the module docs).
    conn: Option<Box<dyn Connection>>,
    /// Why the connection was closed by this side.
    closed_why: Option<String>,
    /// Frames (or the rest of one) the connection has not taken yet; sent before anything else.
    backlog: Vec<u8>,
    backlog_sent: usize,
    /// Complete control frames that wait for the open pinned frame to end.
    deferred: Vec<u8>,
    /// The open frame: its channel and the bytes it still owes.
    open: Option<(ChannelId, usize)>,
    /// Channels whose writes were refused while another channel's frame was open: woken (their
    /// signals raised) when it ends.
    refused: HashSet<ChannelId>,
    scratch: Vec<u8>,
    rx_header: [u8; FRAME_HEADER],
    rx_header_got: usize,
    rx: Option<RxFrame>,
    inboxes: HashMap<ChannelId, Inbox>,
    /// Channels open on this side.
    open_channels: HashSet<ChannelId>,
    /// Channels closed on this side: frames still arriving for them are dropped.
    gone: HashSet<ChannelId>,
}

/// One connection shared by the communicators of a family (see the module docs).
pub struct Mux {
    state: Mutex<State>,
}

impl Mux {
    /// Wraps `conn` (whose peer is numbered as in the family's first communicator).
    pub fn new(conn: Box<dyn Connection>) -> Arc<Mux> {
        Arc::new(Mux {
            state: Mutex::new(State {
                conn: Some(conn),
                closed_why: None,
                backlog: Vec::new(),
                backlog_sent: 0,
                deferred: Vec::new(),
                open: None,
                refused: HashSet::new(),
                scratch: Vec::new(),
                rx_header: [0; FRAME_HEADER],
                rx_header_got: 0,
                rx: None,
                inboxes: HashMap::new(),
                open_channels: HashSet::new(),
                gone: HashSet::new(),
            }),
        })
    }

    /// Opens channel `id` for a communicator in which the peer is rank `peer`; `signal` is raised
    /// when another reader leaves bytes for it. Fails if `id` is already open here.
    pub fn channel(
        self: &Arc<Mux>,
        id: ChannelId,
        peer: usize,
        signal: Option<Signal>,
    ) -> Result<Channel> {
        let mut st = lock(&self.state);
        if st.gone.contains(&id) || !st.open_channels.insert(id) {
            return Err(TransportError::Config(format!(
                "channel {id:016x} is already in use on this connection"
            )));
        }
        let inbox = st.inboxes.entry(id).or_default();
        inbox.signal = signal;
        if inbox.start != inbox.end {
            inbox.raise();
        }
        Ok(Channel {
            mux: Arc::clone(self),
            id,
            peer,
        })
    }

    /// Tells the peer that communicator `id` is gone here, if it never opened a channel on this
    /// connection (a channel that was open says so when it is dropped): the peer's channel then
    /// fails instead of waiting, and bytes it sends are dropped rather than kept.
    pub fn forget(&self, id: ChannelId) {
        let mut st = lock(&self.state);
        if st.open_channels.contains(&id) || !st.gone.insert(id) {
            return;
        }
        st.inboxes.remove(&id);
        st.control(id, KIND_CLOSED, &[], 0);
    }
}

impl State {
    fn lost(&self, peer: usize) -> TransportError {
        TransportError::PeerLost {
            peer,
            detail: self
                .closed_why
                .clone()
                .unwrap_or_else(|| "connection closed".into()),
        }
    }

    fn conn(&mut self, peer: usize) -> Result<&mut Box<dyn Connection>> {
        if self.conn.is_none() {
            return Err(self.lost(peer));
        }
        Ok(self.conn.as_mut().expect("checked above"))
    }

    /// Sends what the backlog holds; whether it is now empty.
    fn flush(&mut self, peer: usize) -> Result<bool> {
        if self.open.is_none() && !self.deferred.is_empty() {
            let deferred = std::mem::take(&mut self.deferred);
            self.backlog.extend_from_slice(&deferred);
        }
        while self.backlog_sent < self.backlog.len() {
            let Some(conn) = self.conn.as_mut() else {
                return Err(self.lost(peer));
            };
            let n = conn
                .try_send(&self.backlog[self.backlog_sent..])
                .map_err(|e| relabel(e, peer))?;
            if n == 0 {
                return Ok(false);
            }
            self.backlog_sent += n;
        }
        self.backlog.clear();
        self.backlog_sent = 0;
        if self.backlog.capacity() > KEEP_MAX {
            self.backlog.shrink_to(INLINE_MAX + FRAME_HEADER);
        }
        Ok(true)
    }

    /// Sends waiting control frames from a reader's call: their channel may never write again.
    fn flush_pending(&mut self, peer: usize) {
        if self.backlog_sent < self.backlog.len() || !self.deferred.is_empty() {
            let _ = self.flush(peer);
        }
    }

    /// Queues a complete control frame (sent after any open pinned frame) and tries to send it.
    fn control(&mut self, id: ChannelId, kind: u8, body: &[u8], peer: usize) {
        // Padded to whole words, so that the connection's later bytes keep their alignment.
        let padded = body.len().next_multiple_of(8);
        let h = header(id, kind, padded);
        let to = if self.open.is_some() {
            &mut self.deferred
        } else {
            &mut self.backlog
        };
        to.extend_from_slice(&h);
        to.extend_from_slice(body);
        to.resize(to.len() + padded - body.len(), 0);
        let _ = self.flush(peer);
    }

    /// Closes the connection from this side, leaving `note` for the peer.
    fn close(&mut self, why: String, note: Option<&str>) {
        if let Some(mut c) = self.conn.take() {
            if let Some(n) = note {
                c.leave_farewell(n);
            }
        }
        self.closed_why = Some(why);
        self.open = None;
        self.backlog.clear();
        self.backlog_sent = 0;
        self.deferred.clear();
    }

    fn send(&mut self, id: ChannelId, peer: usize, data: &[u8], pinned: bool) -> Result<usize> {
        self.conn(peer)?;
        if data.is_empty() {
            return Ok(0);
        }
        if !self.flush(peer)? {
            return Ok(0);
        }
        if let Some((owner, left)) = self.open {
            if owner != id {
                self.refused.insert(id);
                return Ok(0);
            }
            return self.write_payload(id, peer, &data[..left.min(data.len())], pinned, left);
        }
        let len = data.len().min(FRAME_MAX);
        // The header goes first, with the data in the same write when it is small.
        let first = if len <= INLINE_MAX {
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.clear();
            scratch.extend_from_slice(&header(id, KIND_DATA, len));
            scratch.extend_from_slice(&data[..len]);
            let sent = self.conn(peer)?.try_send(&scratch);
            self.scratch = scratch;
            sent.map_err(|e| relabel(e, peer))?
        } else {
            self.conn(peer)?
                .try_send(&header(id, KIND_DATA, len))
                .map_err(|e| relabel(e, peer))?
        };
        if first == 0 {
            return Ok(0);
        }
        if first < FRAME_HEADER {
            // The rest of the header goes first on the caller's next call.
            self.backlog
                .extend_from_slice(&header(id, KIND_DATA, len)[first..]);
            self.open = Some((id, len));
            return Ok(0);
        }
        if len > INLINE_MAX {
            return self.write_payload(id, peer, &data[..len], pinned, len);
        }
        let moved = first - FRAME_HEADER;
        self.open = (moved < len).then_some((id, len - moved));
        if self.open.is_none() {
            self.frame_sent(peer);
        }
        Ok(moved)
    }

    /// Writes `part`, the next bytes of `id`'s frame that still owes `left`, straight from the
    /// caller's memory; keeps the frame open until it is complete.
    fn write_payload(
        &mut self,
        id: ChannelId,
        peer: usize,
        part: &[u8],
        pinned: bool,
        left: usize,
    ) -> Result<usize> {
        let conn = self.conn(peer)?;
        let n = if pinned {
            conn.try_send_pinned(part)
        } else {
            conn.try_send(part)
        }
        .map_err(|e| relabel(e, peer))?;
        self.open = (n < left).then_some((id, left - n));
        if self.open.is_none() {
            self.frame_sent(peer);
        }
        Ok(n)
    }

    /// The open frame was sent in full: control frames waiting for it go, and the channels
    /// refused meanwhile are woken.
    fn frame_sent(&mut self, peer: usize) {
        if !self.deferred.is_empty() {
            let _ = self.flush(peer);
        }
        for id in std::mem::take(&mut self.refused) {
            if let Some(i) = self.inboxes.get(&id) {
                i.raise();
            }
        }
    }

    /// Another channel's reader may have left bytes for the open channels in the connection's
    /// own buffer (a socket read takes what is there): wake them all, so none sleeps on a socket
    /// that was drained for it. Only with several channels open.
    fn wake_others(&self, id: ChannelId) {
        if self.open_channels.len() > 1 {
            for (c, i) in &self.inboxes {
                if *c != id {
                    i.raise();
                }
            }
        }
    }

    /// Counts `n` bytes of `id`'s stream as read straight to its reader.
    fn delivered(&mut self, id: ChannelId, n: usize) {
        if let Some(i) = self.inboxes.get_mut(&id) {
            i.stream += n as u64;
        }
    }

    /// Reads the next frame header, if all of it is there; whether one is now being read.
    fn read_header(&mut self, peer: usize) -> Result<bool> {
        let got = self.rx_header_got;
        let mut buf = self.rx_header;
        let n = self
            .conn(peer)?
            .try_recv_into(&mut buf[got..])
            .map_err(|e| relabel(e, peer))?;
        self.rx_header = buf;
        self.rx_header_got += n;
        if self.rx_header_got < FRAME_HEADER {
            return Ok(false);
        }
        self.take_header(peer)?;
        Ok(true)
    }

    /// Reads the next frame header and, when the frame is `id`'s data, lends its first bytes to
    /// `consume` in the same read of the connection (a small message then costs one read, as
    /// without frames). Returns whether a whole header was read, and how many bytes `consume`
    /// took.
    fn read_header_with(
        &mut self,
        id: ChannelId,
        peer: usize,
        max: usize,
        consume: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<(bool, usize)> {
        if self.rx_header_got > 0 {
            return Ok((self.read_header(peer)?, 0));
        }
        let mut head = [0u8; FRAME_HEADER];
        let mut have = 0usize;
        let mut taken = 0usize;
        self.conn(peer)?
            .try_recv(max.saturating_add(FRAME_HEADER), &mut |s: &[u8]| {
                if s.len() < FRAME_HEADER {
                    head[..s.len()].copy_from_slice(s);
                    have = s.len();
                    return s.len();
                }
                head.copy_from_slice(&s[..FRAME_HEADER]);
                have = FRAME_HEADER;
                let (channel, len, kind) = parse(&head);
                if kind == KIND_DATA && channel == id && head[13..] == [0; 3] {
                    let avail = (s.len() - FRAME_HEADER).min(len).min(max);
                    if avail > 0 {
                        taken = consume(&s[FRAME_HEADER..FRAME_HEADER + avail]).min(avail);
                    }
                }
                FRAME_HEADER + taken
            })
            .map_err(|e| relabel(e, peer))?;
        self.rx_header = head;
        self.rx_header_got = have;
        if have < FRAME_HEADER {
            return Ok((false, 0));
        }
        self.take_header(peer)?;
        if taken > 0 {
            self.delivered(id, taken);
            if let Some(f) = &mut self.rx {
                f.left -= taken;
                if f.left == 0 {
                    self.rx = None;
                }
            }
        }
        Ok((true, taken))
    }

    /// Starts the frame whose whole header is in `rx_header`.
    fn take_header(&mut self, peer: usize) -> Result<()> {
        self.rx_header_got = 0;
        let h = self.rx_header;
        let (channel, len, kind) = parse(&h);
        let valid = h[13..].iter().all(|&b| b == 0)
            && match kind {
                KIND_DATA => len > 0,
                KIND_NOTE => len <= FAREWELL_MAX.next_multiple_of(8),
                KIND_CLOSED => len == 0,
                _ => false,
            };
        if !valid {
            let why = format!("malformed frame header {h:02x?} from rank {peer}");
            self.close(why.clone(), None);
            return Err(TransportError::Protocol(why));
        }
        self.rx = Some(RxFrame {
            channel,
            kind,
            left: len,
            note: Vec::new(),
        });
        if len == 0 {
            self.finish_frame();
        }
        Ok(())
    }

    /// Records a finished control frame and forgets the frame.
    fn finish_frame(&mut self) {
        let Some(f) = self.rx.take() else { return };
        if self.gone.contains(&f.channel) {
            return;
        }
        let inbox = self.inboxes.entry(f.channel).or_default();
        match f.kind {
            KIND_NOTE => {
                // Without the padding.
                let end = f.note.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
                inbox.note = Some(String::from_utf8_lossy(&f.note[..end]).into_owned());
            }
            KIND_CLOSED => inbox.closed = true,
            _ => {}
        }
        if f.kind != KIND_DATA {
            inbox.raise();
        }
    }

    /// Moves what has arrived of the current frame to where it belongs (its channel's inbox, or
    /// the note being read); returns how many bytes moved.
    fn drain_frame(&mut self, peer: usize) -> Result<usize> {
        let Some(mut f) = self.rx.take() else {
            return Ok(0);
        };
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => return Err(self.lost(peer)),
        };
        let mut sink = if self.gone.contains(&f.channel) {
            None
        } else {
            Some(self.inboxes.entry(f.channel).or_default())
        };
        let got = conn.try_recv(f.left, &mut |s: &[u8]| {
            if f.kind == KIND_NOTE {
                f.note.extend_from_slice(s);
            } else if let Some(inbox) = sink.as_mut() {
                inbox.push(s);
            }
            s.len()
        });
        self.conn = Some(conn);
        let n = match got {
            Ok(n) => n,
            Err(e) => {
                self.rx = Some(f);
                return Err(relabel(e, peer));
            }
        };
        f.left -= n;
        let finished = f.left == 0;
        self.rx = Some(f);
        if finished {
            self.finish_frame();
        }
        Ok(n)
    }

    /// Moves frames of other channels out of the way until `id`'s next bytes are at hand: in
    /// its inbox, in the frame being read, or behind the next header.
    fn next_for(&mut self, id: ChannelId, peer: usize) -> Result<Next> {
        loop {
            if self.inboxes.get(&id).is_some_and(|i| i.start < i.end) {
                // The inbox may end in part of a word whose rest is in this channel's frame:
                // bring that in too, so a reader of whole elements is never stuck.
                if matches!(&self.rx, Some(f) if f.kind == KIND_DATA && f.channel == id) {
                    self.drain_frame(peer)?;
                }
                return Ok(Next::Inbox);
            }
            match &self.rx {
                Some(f) if f.kind == KIND_DATA && f.channel == id => {
                    return Ok(Next::Frame(f.left))
                }
                Some(_) => {
                    if self.drain_frame(peer)? == 0 && self.rx.is_some() {
                        return Ok(Next::Nothing);
                    }
                }
                None => return Ok(Next::Header),
            }
        }
    }

    /// Lends up to `max` bytes of `id`'s inbox to `consume`; returns how many it took.
    fn lend_inbox(
        &mut self,
        id: ChannelId,
        max: usize,
        consume: &mut dyn FnMut(&[u8]) -> usize,
    ) -> usize {
        let Some(inbox) = self.inboxes.get_mut(&id) else {
            return 0;
        };
        let avail = inbox.bytes();
        let avail = &avail[..avail.len().min(max)];
        let n = consume(avail).min(avail.len());
        inbox.consume(n);
        n
    }

    /// Counts `n` bytes of `id`'s frame being read (of `left`) as read by its reader.
    fn advance(&mut self, id: ChannelId, n: usize, left: usize) {
        self.delivered(id, n);
        if n > 0 {
            self.wake_others(id);
        }
        if n == left {
            self.rx = None;
        } else if let Some(f) = &mut self.rx {
            f.left -= n;
        }
    }

    fn recv(
        &mut self,
        id: ChannelId,
        peer: usize,
        max: usize,
        consume: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<usize> {
        if max == 0 {
            return Ok(0);
        }
        self.flush_pending(peer);
        loop {
            match self.next_for(id, peer)? {
                Next::Inbox => return Ok(self.lend_inbox(id, max, consume)),
                Next::Frame(left) => {
                    let n = self
                        .conn(peer)?
                        .try_recv(max.min(left), consume)
                        .map_err(|e| relabel(e, peer))?;
                    self.advance(id, n, left);
                    return Ok(n);
                }
                Next::Header => {
                    let (header, n) = self.read_header_with(id, peer, max, consume)?;
                    if header {
                        self.wake_others(id);
                    }
                    if n > 0 || !header {
                        return Ok(n);
                    }
                }
                Next::Nothing => return Ok(0),
            }
        }
    }

    fn recv_into(&mut self, id: ChannelId, peer: usize, dst: &mut [u8]) -> Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        // Small reads: lending is one read of the connection for header and payload together.
        if dst.len() <= INLINE_MAX {
            return self.recv(id, peer, dst.len(), &mut |s: &[u8]| {
                dst[..s.len()].copy_from_slice(s);
                s.len()
            });
        }
        self.flush_pending(peer);
        loop {
            match self.next_for(id, peer)? {
                Next::Inbox => {
                    return Ok(self.lend_inbox(id, dst.len(), &mut |s: &[u8]| {
                        dst[..s.len()].copy_from_slice(s);
                        s.len()
                    }))
                }
                // Large reads go straight into `dst` (sockets read without staging).
                Next::Frame(left) => {
                    let take = left.min(dst.len());
                    let n = self
                        .conn(peer)?
                        .try_recv_into(&mut dst[..take])
                        .map_err(|e| relabel(e, peer))?;
                    self.advance(id, n, left);
                    return Ok(n);
                }
                Next::Header => {
                    if !self.read_header(peer)? {
                        return Ok(0);
                    }
                }
                Next::Nothing => return Ok(0),
            }
        }
    }
}

/// Where a channel's next bytes are (see [`State::next_for`]).
enum Next {
    Inbox,
    Frame(usize),
    Header,
    Nothing,
}

/// Gives a transport error the peer's rank as the channel's communicator numbers it.
fn relabel(e: TransportError, peer: usize) -> TransportError {
    match e {
        TransportError::PeerLost { detail, .. } => TransportError::PeerLost { peer, detail },
        e => e,
    }
}

/// One communicator's [`Connection`] over a [`Mux`].
pub struct Channel {
    mux: Arc<Mux>,
    id: ChannelId,
    peer: usize,
}

impl Connection for Channel {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        lock(&self.mux.state).send(self.id, self.peer, data, false)
    }

    fn try_send_pinned(&mut self, data: &[u8]) -> Result<usize> {
        lock(&self.mux.state).send(self.id, self.peer, data, true)
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        lock(&self.mux.state).recv(self.id, self.peer, max, consume)
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        lock(&self.mux.state).recv_into(self.id, self.peer, dst)
    }

    fn check_peer(&mut self) -> Result<()> {
        let mut st = lock(&self.mux.state);
        st.flush_pending(self.peer);
        if let Some(inbox) = st.inboxes.get(&self.id) {
            if inbox.start < inbox.end {
                return Ok(());
            }
            if inbox.closed {
                return Err(TransportError::PeerLost {
                    peer: self.peer,
                    detail: "its communicator was destroyed".into(),
                });
            }
        }
        // Bytes of other channels may still wait in the connection: move them out of the way
        // first, so that a lost peer is reported once nothing readable is left for anyone.
        while st.rx.is_some()
            && !matches!(&st.rx, Some(f) if f.kind == KIND_DATA && f.channel == self.id)
        {
            if st.drain_frame(self.peer)? == 0 {
                break;
            }
        }
        let peer = self.peer;
        st.conn(peer)?.check_peer().map_err(|e| relabel(e, peer))
    }

    fn leave_farewell(&mut self, note: &str) {
        let mut st = lock(&self.mux.state);
        let note = &note.as_bytes()[..note.len().min(FAREWELL_MAX)];
        let text = String::from_utf8_lossy(note).into_owned();
        match st.open {
            Some((owner, _)) if owner == self.id => {
                st.close(
                    format!("closed by the peer's communicator in the middle of a message: {text}"),
                    Some(&text),
                );
            }
            // A NOTE frame, not the connection's own farewell place: the connection outlives
            // this communicator when its family goes on, and a stale note there would be taken
            // for the cause of a later loss.
            _ => st.control(self.id, KIND_NOTE, note, self.peer),
        }
    }

    fn farewell(&self) -> Option<String> {
        let st = lock(&self.mux.state);
        st.inboxes
            .get(&self.id)
            .and_then(|i| i.note.clone())
            .or_else(|| st.conn.as_ref().and_then(|c| c.farewell()))
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        let mut st = lock(&self.mux.state);
        st.open_channels.remove(&self.id);
        st.gone.insert(self.id);
        st.inboxes.remove(&self.id);
        if matches!(st.open, Some((owner, _)) if owner == self.id) {
            st.close(
                "the peer's communicator left in the middle of a message".into(),
                None,
            );
            return;
        }
        // Sent even when no channel is left here: the connection stays with the family, and
        // the peer's communicator must learn that this one is gone.
        st.control(self.id, KIND_CLOSED, &[], self.peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem;

    /// An inbox emptied while its stream moved on (bytes read straight to the reader) restarts
    /// at the stream's offset within a word, which can lie past its small buffer's end: the
    /// next push must grow the buffer, not slice past it (a CI failure of the property test).
    #[test]
    fn emptied_inbox_whose_stream_moved_on_grows_cleanly() {
        let mut inbox = Inbox::default();
        inbox.push(&[1, 2]);
        inbox.consume(2);
        inbox.stream += 5;
        inbox.push(&[3; 10]);
        assert_eq!(inbox.bytes(), &[3; 10]);
        assert_eq!(
            inbox.start % 8,
            7,
            "the first byte keeps the stream's word offset"
        );
    }

    fn pair() -> (Arc<Mux>, Arc<Mux>) {
        let (a, b) = mem::pair(0, 1, 1 << 12);
        (Mux::new(Box::new(a)), Mux::new(Box::new(b)))
    }

    fn send_all(c: &mut dyn Connection, mut data: &[u8], other: &mut dyn Connection) {
        while !data.is_empty() {
            let n = c.try_send(data).unwrap();
            data = &data[n..];
            // Keep the far side draining so a small buffer never fills for good.
            let _ = other.try_recv(0, &mut |s: &[u8]| s.len());
        }
    }

    #[test]
    fn frames_of_two_channels_reach_their_own_readers() {
        let (a, b) = pair();
        let (mut a1, mut a2) = (
            a.channel(1, 1, None).unwrap(),
            a.channel(2, 1, None).unwrap(),
        );
        let (mut b1, mut b2) = (
            b.channel(1, 0, None).unwrap(),
            b.channel(2, 0, None).unwrap(),
        );
        assert_eq!(a1.try_send(b"one-one-").unwrap(), 8);
        assert_eq!(a2.try_send(b"two-two-").unwrap(), 8);
        assert_eq!(a1.try_send(b"ONE!ONE!").unwrap(), 8);
        // Channel 2's reader goes first: channel 1's frame before it lands in 1's inbox.
        let mut got = Vec::new();
        b2.try_recv(64, &mut |s: &[u8]| {
            got.extend_from_slice(s);
            s.len()
        })
        .unwrap();
        assert_eq!(got, b"two-two-");
        let mut buf = [0u8; 16];
        let mut filled = 0;
        while filled < 16 {
            filled += b1.try_recv_into(&mut buf[filled..]).unwrap();
        }
        assert_eq!(&buf, b"one-one-ONE!ONE!");
        let _ = send_all;
    }

    #[test]
    fn a_dropped_channel_is_lost_for_its_peer_only() {
        let (a, b) = pair();
        let a1 = a.channel(1, 1, None).unwrap();
        let mut a2 = a.channel(2, 1, None).unwrap();
        let mut b1 = b.channel(1, 0, None).unwrap();
        let mut b2 = b.channel(2, 0, None).unwrap();
        drop(a1);
        assert_eq!(a2.try_send(b"still-ok").unwrap(), 8);
        let mut got = 0;
        while got < 8 {
            got += b2.try_recv(8, &mut |s: &[u8]| s.len()).unwrap();
        }
        assert!(matches!(
            b1.check_peer(),
            Err(TransportError::PeerLost { peer: 0, .. })
        ));
        assert!(b2.check_peer().is_ok());
    }

    #[test]
    fn notes_are_per_channel() {
        let (a, b) = pair();
        let mut a1 = a.channel(1, 1, None).unwrap();
        let _a2 = a.channel(2, 1, None).unwrap();
        let mut b1 = b.channel(1, 0, None).unwrap();
        let mut b2 = b.channel(2, 0, None).unwrap();
        a1.leave_farewell("rank 0 failed: boom");
        let _ = b2.try_recv(8, &mut |s: &[u8]| s.len()).unwrap();
        assert_eq!(b1.farewell().as_deref(), Some("rank 0 failed: boom"));
        assert_eq!(b2.farewell(), None);
        assert!(b1.check_peer().is_ok());
    }

    #[test]
    fn an_abandoned_frame_closes_the_connection_for_every_channel() {
        let (a, b) = pair();
        let mut a1 = a.channel(1, 1, None).unwrap();
        let mut a2 = a.channel(2, 1, None).unwrap();
        let _b = b;
        let big = vec![7u8; 64 << 10];
        let n = a1.try_send_pinned(&big).unwrap();
        assert!(n < big.len(), "a 4 KiB buffer cannot take 64 KiB");
        // Channel 2 waits for channel 1's frame.
        assert_eq!(a2.try_send(b"blocked!").unwrap(), 0);
        drop(a1);
        assert!(matches!(
            a2.try_send(b"blocked!"),
            Err(TransportError::PeerLost { peer: 1, .. })
        ));
    }

    #[test]
    fn a_malformed_header_is_a_protocol_error() {
        let (mut raw, b) = mem::pair(0, 1, 1 << 12);
        let b = Mux::new(Box::new(b));
        let mut b1 = b.channel(1, 0, None).unwrap();
        let mut h = header(1, KIND_DATA, 8);
        h[12] = 9;
        assert_eq!(raw.try_send(&h).unwrap(), FRAME_HEADER);
        assert!(matches!(
            b1.try_recv(8, &mut |s: &[u8]| s.len()),
            Err(TransportError::Protocol(_))
        ));
    }

    /// A connection that takes at most `budget` more bytes (`usize::MAX`: whatever `inner`
    /// takes), as a socket may: it cuts a frame in the middle of a word.
    struct Capped {
        inner: mem::MemConnection,
        budget: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Connection for Capped {
        fn peer(&self) -> usize {
            self.inner.peer()
        }
        fn try_send(&mut self, data: &[u8]) -> Result<usize> {
            let take = self.budget.load(Ordering::Relaxed).min(data.len());
            let n = self.inner.try_send(&data[..take])?;
            let _ = self
                .budget
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(n));
            Ok(n)
        }
        fn try_recv(
            &mut self,
            max: usize,
            consume: &mut dyn FnMut(&[u8]) -> usize,
        ) -> Result<usize> {
            self.inner.try_recv(max, consume)
        }
        fn check_peer(&mut self) -> Result<()> {
            self.inner.check_peer()
        }
    }

    /// A sibling's reader leaves part of this channel's frame in its inbox, ending in half a
    /// word: a reader that takes whole 8-byte elements only still reads everything, and every
    /// slice it is lent starts 8-byte aligned.
    #[test]
    fn a_partial_word_in_the_inbox_joins_the_rest_of_its_frame() {
        let (a, b) = mem::pair(0, 1, 1 << 16);
        let budget = Arc::new(std::sync::atomic::AtomicUsize::new(FRAME_HEADER + 4084));
        let capped = Capped {
            inner: a,
            budget: Arc::clone(&budget),
        };
        let (a, b) = (Mux::new(Box::new(capped)), Mux::new(Box::new(b)));
        let mut x_tx = a.channel(1, 1, None).unwrap();
        let _y_tx = a.channel(2, 1, None).unwrap();
        let mut x_rx = b.channel(1, 0, None).unwrap();
        let mut y_rx = b.channel(2, 0, None).unwrap();
        let data: Vec<u8> = (0..8000u32).map(|i| (i % 251) as u8).collect();
        let mut sent = x_tx.try_send(&data).unwrap();
        assert_eq!(sent, 4084);
        budget.store(usize::MAX, Ordering::Relaxed);
        // Y's reader moves what arrived of X's frame (not a whole number of words) aside.
        assert_eq!(y_rx.try_recv(64, &mut |s: &[u8]| s.len()).unwrap(), 0);
        let mut got = Vec::new();
        let mut spins = 0;
        while got.len() < data.len() {
            let n = x_rx
                .try_recv(1 << 20, &mut |s: &[u8]| {
                    assert_eq!(s.as_ptr() as usize % 8, 0, "lent slice misaligned");
                    let whole = s.len() / 8 * 8;
                    got.extend_from_slice(&s[..whole]);
                    whole
                })
                .unwrap();
            if sent < data.len() {
                sent += x_tx.try_send(&data[sent..]).unwrap();
            }
            spins = if n == 0 { spins + 1 } else { 0 };
            assert!(
                spins < 1000,
                "stuck after {} of {} bytes",
                got.len(),
                data.len()
            );
        }
        assert_eq!(got, data);
    }

    /// What one channel of the property test sends: messages, each plain or pinned.
    #[derive(Debug, Clone)]
    struct Plan {
        msgs: Vec<(Vec<u8>, bool)>,
    }

    fn plan(channel: u8) -> impl proptest::strategy::Strategy<Value = Plan> {
        use proptest::prelude::*;
        proptest::collection::vec((1usize..20_000, any::<bool>()), 0..6).prop_map(move |ms| Plan {
            msgs: ms
                .into_iter()
                .enumerate()
                .map(|(i, (len, pinned))| {
                    let data = (0..len)
                        .map(|k| (k as u8).wrapping_mul(31) ^ channel ^ (i as u8) << 4)
                        .collect();
                    (data, pinned)
                })
                .collect(),
        })
    }

    use proptest::strategy::Strategy as _;

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(64))]
        /// Three channels write plain and pinned messages over one 4 KiB connection in a random
        /// order of sends and reads: every channel's reader gets exactly its bytes, in order,
        /// whoever reads first, and nothing gets stuck.
        #[test]
        fn random_interleavings_keep_every_stream_intact(
            plans in (plan(1), plan(2), plan(3)).prop_map(|(a, b, c)| vec![a, b, c]),
            picks in proptest::collection::vec((0usize..6, 1usize..9000), 1..400),
        ) {
            let (a, b) = pair();
            let mut tx: Vec<Channel> = (0..3).map(|c| a.channel(c as u64 + 10, 1, None).unwrap()).collect();
            let mut rx: Vec<Channel> = (0..3).map(|c| b.channel(c as u64 + 10, 0, None).unwrap()).collect();
            let want: Vec<Vec<u8>> = plans.iter().map(|p| p.msgs.iter().flat_map(|m| m.0.clone()).collect()).collect();
            let mut got: Vec<Vec<u8>> = vec![Vec::new(); 3];
            // Per channel: next message and bytes of it sent.
            let mut at = [(0usize, 0usize); 3];
            let mut step = 0usize;
            let done = |got: &Vec<Vec<u8>>| got.iter().zip(&want).all(|(g, w)| g.len() == w.len());
            while !done(&got) {
                proptest::prop_assert!(step < 200_000, "no progress: got {:?} of {:?}", got.iter().map(Vec::len).collect::<Vec<_>>(), want.iter().map(Vec::len).collect::<Vec<_>>());
                let (action, amount) = if step < picks.len() { picks[step] } else { (step % 6, 4096) };
                step += 1;
                let c = action % 3;
                if action < 3 {
                    let (m, sent) = at[c];
                    if let Some((data, pinned)) = plans[c].msgs.get(m) {
                        let rest = &data[sent..];
                        let n = if *pinned { tx[c].try_send_pinned(rest) } else { tx[c].try_send(rest) }.unwrap();
                        at[c] = if sent + n == data.len() { (m + 1, 0) } else { (m, sent + n) };
                    }
                } else {
                    let g = &mut got[c];
                    if amount % 2 == 0 {
                        rx[c].try_recv(amount, &mut |s: &[u8]| { g.extend_from_slice(s); s.len() }).unwrap();
                    } else {
                        let mut buf = vec![0u8; amount];
                        let n = rx[c].try_recv_into(&mut buf).unwrap();
                        g.extend_from_slice(&buf[..n]);
                    }
                }
            }
            proptest::prop_assert_eq!(got, want);
        }
    }
}
