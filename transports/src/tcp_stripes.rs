//! Several TCP sockets per peer, driven by helper threads: `WEFT_SOCKET_NTHREADS` threads of
//! `WEFT_NSOCKS_PERTHREAD` sockets each (NCCL's `NCCL_SOCKET_NTHREADS` × `NCCL_NSOCKS_PERTHREAD`),
//! for links faster than one stream and one core carry.
//!
//! **Striping.** The byte stream is cut at fixed positions into stripes of [`STRIPE`] bytes;
//! stripe `k` travels on socket `k mod N`. Both ends know where every byte goes, so nothing but
//! the bytes crosses the wire, and a message shorter than a stripe uses one socket.
//!
//! **Moving bytes.** The caller's thread (the collectives engine) never touches a socket: a send
//! copies into *pieces* (buffers of at most one stripe) and hands each to the thread that owns
//! its stripe's socket; that thread writes it and hands the buffer back. The same thread reads
//! its sockets into pieces that the engine lends from ([`Connection::try_recv`]), so reductions
//! still read straight out of the received bytes, and returns each buffer once it is used. Every
//! socket has at most [`PIECES_PER_SOCKET`] pieces in flight per direction, which bounds the
//! memory. A piece's bytes sit at the same offset modulo 8 as their stream position, and a
//! reader that leaves the start of a word unconsumed at the end of a piece is lent it again in
//! front of the next piece (8 bytes of headroom), so the alignment promises of the trait hold.
//!
//! **Waking.** Each helper thread sleeps in `poll` on its sockets and an eventfd that the engine
//! writes only when the thread said it is going to sleep (a flag and a fence on both sides, so
//! no wake-up is lost). The helpers count the pieces they hand over and the buffers they hand
//! back; [`crate::tcp::TcpWaiter`] compares those counts with what the engine took, and sleeps
//! on the engine's eventfd only when there is nothing, after announcing it (the helpers write
//! the eventfd only to an announced sleeper, so a busy engine costs them no system call).
//!
//! **Failure.** A socket that fails or is closed by the peer marks its lane dead and the thread
//! stops. The engine reads what arrived before that, then sees [`TransportError::PeerLost`];
//! sends fail at once.
//!
//! **Close.** Dropping the connection lets the helpers write what was already accepted (at most
//! [`CLOSE_FLUSH`]), shut the sockets down and exit; the drop joins them.
//!
//! **Establishment** ([`open_stripes`]): after the dial handshake on the first socket, the
//! accepting side always sends one frame
//! `b"WSTR" | sockets u16 LE | port u16 LE | stripe bytes u32 LE | nonce [16]`.
//! With more than one socket it listens on an ephemeral port of the first socket's address; the
//! dialer connects the other sockets there and opens each with `nonce | index u16 LE`; once all
//! arrived the acceptor writes one byte `1` on the first socket. The accepting side's plan sets
//! the number of sockets; each side picks its own number of threads.

use crate::conn::Connection;
use crate::error::{Result, TransportError};
use crate::util::{lock, AlignedBuf, Deadline};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use socket2::Socket;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Bytes of the stream that travel on one socket before the next socket takes over (default).
pub const STRIPE: usize = 128 << 10;
/// Pieces in flight per socket and direction.
pub const PIECES_PER_SOCKET: usize = 8;
/// Longest a dropped connection's helpers go on writing what it had accepted.
pub const CLOSE_FLUSH: Duration = Duration::from_secs(1);
/// Most sockets per connection (threads × sockets per thread), as NCCL.
pub const MAX_SOCKETS: usize = 64;
/// Room in front of a received piece for the unconsumed start of a word.
const HEADROOM: usize = 8;
/// How long a helper sleeps before looking at its stop flag again.
const HELPER_SLICE_MS: u16 = 100;
const STRIPE_MAGIC: [u8; 4] = *b"WSTR";
/// magic, sockets, port, stripe bytes, nonce.
const FRAME_BYTES: usize = 4 + 2 + 2 + 4 + 16;

/// How many helper threads and sockets a TCP connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripePlan {
    /// Helper threads per connection; 0: one socket, driven by the caller's thread.
    pub threads: usize,
    /// Sockets per helper thread.
    pub sockets_per_thread: usize,
    /// Bytes of a stripe (a multiple of 8; [`STRIPE`] unless a test asks for less).
    pub stripe: usize,
}

impl Default for StripePlan {
    fn default() -> Self {
        StripePlan::SINGLE
    }
}

impl StripePlan {
    /// One socket, no helper thread (the default).
    pub const SINGLE: StripePlan = StripePlan {
        threads: 0,
        sockets_per_thread: 1,
        stripe: STRIPE,
    };

    /// The plan `WEFT_SOCKET_NTHREADS` (0–16, default 0) and `WEFT_NSOCKS_PERTHREAD` (1–64,
    /// default 1) ask for; their product is at most [`MAX_SOCKETS`].
    pub fn from_env() -> Result<StripePlan> {
        use weftcc_settings::{NSOCKS_PERTHREAD, SOCKET_NTHREADS};
        let threads = SOCKET_NTHREADS.number()?;
        let per = NSOCKS_PERTHREAD.number()?;
        StripePlan::new(threads.unwrap_or(0) as usize, per.unwrap_or(1) as usize)
    }

    /// A checked plan.
    pub fn new(threads: usize, sockets_per_thread: usize) -> Result<StripePlan> {
        if sockets_per_thread == 0 || threads.max(1) * sockets_per_thread > MAX_SOCKETS {
            return Err(TransportError::Config(format!(
                "WEFT_SOCKET_NTHREADS={threads} x WEFT_NSOCKS_PERTHREAD={sockets_per_thread}: \
                 expected 1 to {MAX_SOCKETS} sockets per connection"
            )));
        }
        Ok(StripePlan {
            threads,
            sockets_per_thread,
            stripe: STRIPE,
        })
    }

    /// The same plan with stripes of `bytes` (a multiple of 8 from 64 to 16 MiB): small ones
    /// make tests cross stripes often.
    pub fn with_stripe(self, bytes: usize) -> Result<StripePlan> {
        if !bytes.is_multiple_of(8) || !(64..=16 << 20).contains(&bytes) {
            return Err(TransportError::Config(format!(
                "stripe of {bytes} bytes: expected a multiple of 8 from 64 to 16 MiB"
            )));
        }
        Ok(StripePlan {
            stripe: bytes,
            ..self
        })
    }

    /// Sockets per connection.
    pub fn sockets(&self) -> usize {
        self.threads.max(1) * self.sockets_per_thread
    }
}

/// Which end of the first socket this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Dialed the peer: connects the extra sockets.
    Dialer,
    /// Accepted the dial: its plan sets the number of sockets; listens for the extra ones.
    Acceptor,
}

/// Runs the stripe exchange on `first` (a handshaken, blocking socket to `peer`) and returns
/// every socket of the connection, the first one first, and the stripe size. Gives up at
/// `deadline`.
pub(crate) fn open_stripes(
    peer: usize,
    first: Socket,
    side: Side,
    plan: StripePlan,
    deadline: &Deadline,
) -> Result<(Vec<Socket>, usize)> {
    let io = |what: &str, e: std::io::Error| {
        TransportError::io_with(peer, format!("{what} (stripes, rank {peer})"), e)
    };
    let wait = deadline.remaining().max(Duration::from_millis(100));
    first
        .set_read_timeout(Some(wait))
        .and_then(|_| first.set_write_timeout(Some(wait)))
        .map_err(|e| io("socket timeouts", e))?;
    let mut socks = vec![first];
    let stripe = match side {
        Side::Acceptor => {
            let count = plan.sockets();
            let local = socks[0]
                .local_addr()
                .ok()
                .and_then(|a| a.as_socket())
                .ok_or_else(|| TransportError::Protocol("first socket has no address".into()))?;
            let listener = if count > 1 {
                let mut any = local;
                any.set_port(0);
                Some(crate::socket::listen(
                    any,
                    Some(crate::socket::SOCKET_BUFFER_BYTES),
                    "stripe listener",
                )?)
            } else {
                None
            };
            let nonce: [u8; 16] = crate::util::random_hex(8)?
                .as_bytes()
                .try_into()
                .map_err(|_| TransportError::Protocol("nonce length".into()))?;
            let mut frame = Vec::with_capacity(FRAME_BYTES);
            frame.extend_from_slice(&STRIPE_MAGIC);
            frame.extend_from_slice(&(count as u16).to_le_bytes());
            let port = listener.as_ref().map_or(0, |(_, a)| a.port());
            frame.extend_from_slice(&port.to_le_bytes());
            frame.extend_from_slice(&(plan.stripe as u32).to_le_bytes());
            frame.extend_from_slice(&nonce);
            (&socks[0])
                .write_all(&frame)
                .map_err(|e| io("sending the stripe frame", e))?;
            if let Some((listener, _)) = listener {
                let mut extra: Vec<Option<Socket>> = (1..count).map(|_| None).collect();
                while extra.iter().any(Option::is_none) {
                    if deadline.expired() {
                        return Err(deadline.timeout_error(format!(
                            "waiting for the {} extra sockets of rank {peer}",
                            count - 1
                        )));
                    }
                    // A dialer that went away (or sent anything) while this end waits is
                    // an error now, not at the deadline.
                    let mut first = [PollFd::new(socks[0].as_fd(), PollFlags::POLLIN)];
                    if nix::poll::poll(&mut first, PollTimeout::ZERO).is_ok_and(|n| n > 0) {
                        return Err(TransportError::PeerLost {
                            peer,
                            detail: "it closed the connection while opening its other sockets"
                                .into(),
                        });
                    }
                    let Some((sock, _)) = crate::socket::accept_within(&listener, 50, "stripes")
                    else {
                        continue;
                    };
                    // A socket that does not present the nonce is not ours: drop it.
                    if let Some(i) = read_stripe_hello(&sock, &nonce, count) {
                        extra[i - 1] = Some(sock);
                    }
                }
                socks.extend(extra.into_iter().flatten());
                (&socks[0])
                    .write_all(&[1])
                    .map_err(|e| io("confirming the stripes", e))?;
            }
            plan.stripe
        }
        Side::Dialer => {
            let mut frame = [0u8; FRAME_BYTES];
            (&socks[0])
                .read_exact(&mut frame)
                .map_err(|e| io("reading the stripe frame", e))?;
            if frame[..4] != STRIPE_MAGIC {
                return Err(TransportError::Protocol(format!(
                    "rank {peer} sent no stripe frame (an older weftcc?)"
                )));
            }
            let count = u16::from_le_bytes([frame[4], frame[5]]) as usize;
            if count != plan.sockets() {
                return Err(TransportError::Config(format!(
                    "rank {peer} uses {count} sockets per TCP connection, this rank {}: set \
                     WEFT_SOCKET_NTHREADS and WEFT_NSOCKS_PERTHREAD alike on every rank",
                    plan.sockets()
                )));
            }
            let port = u16::from_le_bytes([frame[6], frame[7]]);
            let stripe = u32::from_le_bytes([frame[8], frame[9], frame[10], frame[11]]) as usize;
            if count == 0
                || count > MAX_SOCKETS
                || (count > 1 && port == 0)
                || StripePlan::SINGLE.with_stripe(stripe).is_err()
            {
                return Err(TransportError::Protocol(format!(
                    "rank {peer} asked for {count} sockets on port {port}, stripes of {stripe} \
                     bytes"
                )));
            }
            if count > 1 {
                // The peer's address with the listener's port (an IPv6 scope id kept).
                let mut at = socks[0]
                    .peer_addr()
                    .ok()
                    .and_then(|a| a.as_socket())
                    .ok_or_else(|| TransportError::Protocol("first socket has no peer".into()))?;
                at.set_port(port);
                for i in 1..count {
                    let s = crate::socket::dial_socket(peer, at, deadline)?;
                    let mut hello = frame[12..FRAME_BYTES].to_vec();
                    hello.extend_from_slice(&(i as u16).to_le_bytes());
                    (&s).write_all(&hello)
                        .map_err(|e| io("opening an extra socket", e))?;
                    socks.push(s);
                }
                let mut ok = [0u8; 1];
                (&socks[0])
                    .read_exact(&mut ok)
                    .map_err(|e| io("waiting for the stripes", e))?;
                if ok[0] != 1 {
                    return Err(TransportError::Protocol(format!(
                        "rank {peer} refused the extra sockets"
                    )));
                }
            }
            stripe
        }
    };
    for s in &socks {
        s.set_read_timeout(None)
            .and_then(|_| s.set_write_timeout(None))
            .map_err(|e| io("clearing socket timeouts", e))?;
    }
    Ok((socks, stripe))
}

/// The index an extra socket presents with the right nonce, if it does within 250 ms.
fn read_stripe_hello(sock: &Socket, nonce: &[u8; 16], count: usize) -> Option<usize> {
    sock.set_nonblocking(false).ok()?;
    sock.set_read_timeout(Some(Duration::from_millis(250)))
        .ok()?;
    let mut hello = [0u8; 18];
    (&*sock).read_exact(&mut hello).ok()?;
    let i = u16::from_le_bytes([hello[16], hello[17]]) as usize;
    (hello[..16] == nonce[..] && (1..count).contains(&i)).then_some(i)
}

// ---------------------------------------------------------------------------------------------
// The connection
// ---------------------------------------------------------------------------------------------

/// Bytes of the stream in a buffer: `len` bytes at `at`, the first at stream position `pos`;
/// the buffer belongs to socket `lane`.
struct Piece {
    buf: AlignedBuf,
    at: usize,
    len: usize,
    pos: u64,
    lane: usize,
}

impl Piece {
    fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[self.at..self.at + self.len]
    }
}

fn piece_buffer(stripe: usize) -> AlignedBuf {
    AlignedBuf::new(HEADROOM + 8 + stripe)
}

/// A helper thread's doorbell: the engine writes it only while the helper sleeps.
struct Bell {
    fd: EventFd,
    asleep: AtomicBool,
}

impl Bell {
    fn new() -> Result<Bell> {
        Ok(Bell {
            fd: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| TransportError::io("creating an eventfd", e.into()))?,
            asleep: AtomicBool::new(false),
        })
    }

    /// Called after handing the helper work: pairs with the helper's flag-then-recheck.
    fn ring_if_asleep(&self) {
        fence(Ordering::SeqCst);
        if self.asleep.load(Ordering::SeqCst) {
            let _ = self.fd.write(1);
        }
    }

    fn ring(&self) {
        let _ = self.fd.write(1);
    }

    fn drain(&self) {
        let _ = self.fd.read();
    }
}

/// What the engine's idle waiter looks at ([`crate::tcp::TcpWaiter`]): counts of pieces the
/// helpers handed to the engine and of send buffers they handed back, per socket, each against
/// what the engine took, and the eventfd the helpers write after moving bytes. The counts make
/// the waiter level-triggered: a reader that stopped after one piece (a frame header cut between
/// two sockets) while the next one already waits is not put to sleep. Only the sockets the
/// engine needs next count (`want_recv`, `want_send`), so that idle buffers or early pieces of
/// other sockets do not keep it awake.
pub(crate) struct EngineSignal {
    fd: EventFd,
    lanes: Vec<LaneCounts>,
    want_recv: AtomicUsize,
    want_send: AtomicUsize,
    /// A socket failed with an error (not a close): the connection is lost.
    broken: AtomicBool,
    /// Waiters about to sleep on `fd`: the helpers write it only then.
    sleepers: AtomicUsize,
}

#[derive(Default)]
struct LaneCounts {
    arrived: AtomicU64,
    taken: AtomicU64,
    freed: AtomicU64,
    reused: AtomicU64,
    /// The helper saw this socket fail or close (set after its last piece was handed over).
    dead: AtomicBool,
}

/// Marks waiters as sleeping on some signals while it lives (see [`EngineSignal::sleep_on`]).
pub(crate) struct Sleeping<'a>(Vec<&'a EngineSignal>);

impl Drop for Sleeping<'_> {
    fn drop(&mut self) {
        for s in &self.0 {
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl EngineSignal {
    /// Announces a waiter about to sleep on `signals` (until the guard drops). Check
    /// [`Self::ready`] after this and before sleeping: a helper that counts after the check
    /// sees the announcement and writes the eventfd.
    pub(crate) fn sleep_on<'a>(signals: Vec<&'a EngineSignal>) -> Sleeping<'a> {
        for s in &signals {
            s.sleepers.fetch_add(1, Ordering::SeqCst);
        }
        fence(Ordering::SeqCst);
        Sleeping(signals)
    }

    /// Whether the engine has something to do now for the interest given.
    pub(crate) fn ready(&self, recv: bool, send: bool) -> bool {
        let lane =
            |want: &AtomicUsize| &self.lanes[want.load(Ordering::Relaxed) % self.lanes.len()];
        let (r, s) = (lane(&self.want_recv), lane(&self.want_send));
        self.broken.load(Ordering::Acquire)
            || recv
                && (r.dead.load(Ordering::Acquire)
                    || r.arrived.load(Ordering::SeqCst) > r.taken.load(Ordering::SeqCst))
            || send
                && (s.dead.load(Ordering::Acquire)
                    || s.freed.load(Ordering::SeqCst) > s.reused.load(Ordering::SeqCst))
    }

    /// The eventfd, to poll.
    pub(crate) fn fd(&self) -> &EventFd {
        &self.fd
    }

    fn ring(&self) {
        let _ = self.fd.write(1);
    }

    /// After counting what moved: wakes a waiter that announced its sleep.
    fn ring_if_sleeping(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.ring();
        }
    }
}

/// What the engine and the helpers share.
struct Shared {
    /// Why the first socket died.
    why: Mutex<Option<String>>,
    /// The engine's doorbell, written by the helpers after moving bytes.
    engine: Arc<EngineSignal>,
    /// The connection is being dropped.
    closing: AtomicBool,
}

impl Shared {
    /// Socket `socket` failed (`error`) or the peer closed it.
    fn die(&self, socket: usize, error: bool, why: String) {
        {
            let mut w = lock(&self.why);
            if w.is_none() {
                *w = Some(why);
            }
        }
        self.engine.lanes[socket]
            .dead
            .store(true, Ordering::Release);
        if error {
            self.engine.broken.store(true, Ordering::Release);
        }
        self.engine.ring();
    }

    fn dead(&self, socket: usize) -> bool {
        self.engine.lanes[socket].dead.load(Ordering::Acquire)
    }

    /// A socket failed, or every socket was closed by the peer.
    fn lost(&self) -> bool {
        self.engine.broken.load(Ordering::Acquire)
            || self
                .engine
                .lanes
                .iter()
                .all(|l| l.dead.load(Ordering::Acquire))
    }
}

/// The engine's end of one socket.
struct Lane {
    to_wire: Sender<Piece>,
    sent_back: Receiver<AlignedBuf>,
    send_buffers: usize,
    from_wire: Receiver<Piece>,
    give_back: Sender<AlignedBuf>,
    thread: usize,
}

/// A TCP connection over several sockets and helper threads (see the module docs).
pub struct StripedTcp {
    peer: usize,
    stripe: usize,
    lanes: Vec<Lane>,
    bells: Vec<Arc<Bell>>,
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// Stream positions sent and consumed.
    sent: u64,
    received: u64,
    /// The piece being lent from.
    current: Option<Piece>,
}

impl StripedTcp {
    /// Starts `threads` helpers (at least 1, at most one per socket) over `socks` (in stripe
    /// order, stripes of `stripe` bytes) to `peer`.
    pub(crate) fn start(
        peer: usize,
        socks: Vec<Socket>,
        stripe: usize,
        threads: usize,
    ) -> Result<StripedTcp> {
        let n = socks.len();
        let threads = threads.clamp(1, n.max(1));
        let engine = Arc::new(EngineSignal {
            fd: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| TransportError::io("creating an eventfd", e.into()))?,
            lanes: (0..n).map(|_| LaneCounts::default()).collect(),
            want_recv: AtomicUsize::new(0),
            want_send: AtomicUsize::new(0),
            broken: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
        });
        let shared = Arc::new(Shared {
            why: Mutex::new(None),
            engine,
            closing: AtomicBool::new(false),
        });
        let mut bells = Vec::with_capacity(threads);
        for _ in 0..threads {
            bells.push(Arc::new(Bell::new()?));
        }
        let mut lanes = Vec::with_capacity(n);
        let mut wires: Vec<Vec<Wire>> = (0..threads).map(|_| Vec::new()).collect();
        for (index, sock) in socks.into_iter().enumerate() {
            crate::socket::configure_stream(&sock);
            sock.set_nonblocking(true)
                .map_err(|e| TransportError::io("making a socket non-blocking", e))?;
            let (to_wire, from_engine) = channel();
            let (send_back, sent_back) = channel();
            let (to_engine, from_wire) = channel();
            let (give_back, given_back) = channel();
            let thread = index % threads;
            lanes.push(Lane {
                to_wire,
                sent_back,
                send_buffers: 0,
                from_wire,
                give_back,
                thread,
            });
            wires[thread].push(Wire {
                sock,
                index,
                sockets: n,
                out: None,
                from_engine,
                send_back,
                to_engine,
                given_back,
                recv_buffers: 0,
                spare: None,
                rx_pos: (index * stripe) as u64,
                stripe,
                dead: false,
            });
        }
        let mut helpers = Vec::with_capacity(threads);
        for (t, wires) in wires.into_iter().enumerate() {
            let helper = Helper {
                wires,
                bell: Arc::clone(&bells[t]),
                shared: Arc::clone(&shared),
            };
            let h = std::thread::Builder::new()
                .name(format!("weft-sock-{peer}-{t}"))
                .spawn(move || helper.run())
                .map_err(|e| TransportError::io("starting a socket helper thread", e));
            match h {
                Ok(h) => helpers.push(h),
                Err(e) => {
                    // The helpers started so far stop once the lanes are dropped.
                    shared.closing.store(true, Ordering::Release);
                    bells.iter().for_each(|b| b.ring());
                    drop(lanes);
                    helpers.into_iter().for_each(|h: JoinHandle<()>| {
                        let _ = h.join();
                    });
                    return Err(e);
                }
            }
        }
        Ok(StripedTcp {
            peer,
            stripe,
            lanes,
            bells,
            shared,
            helpers,
            sent: 0,
            received: 0,
            current: None,
        })
    }

    /// What the idle waiter looks at (for [`crate::tcp::TcpWaiter`]).
    pub(crate) fn doorbell(&self) -> Arc<EngineSignal> {
        Arc::clone(&self.shared.engine)
    }

    /// Sockets of this connection.
    pub fn sockets(&self) -> usize {
        self.lanes.len()
    }

    /// Helper threads of this connection.
    pub fn threads(&self) -> usize {
        self.bells.len()
    }

    fn lane_of(&self, pos: u64) -> usize {
        ((pos / self.stripe as u64) % self.lanes.len() as u64) as usize
    }

    fn lost(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer,
            detail: lock(&self.shared.why)
                .clone()
                .unwrap_or_else(|| "connection closed by peer".into()),
        }
    }

    /// Tells the waiter which sockets this end needs next.
    fn note_wants(&self) {
        let next = match &self.current {
            Some(c) => c.pos + c.len as u64,
            None => self.received,
        };
        let e = &self.shared.engine;
        e.want_recv.store(self.lane_of(next), Ordering::Relaxed);
        e.want_send
            .store(self.lane_of(self.sent), Ordering::Relaxed);
    }

    /// The next piece of the lane that carries stream position `pos`, if one arrived;
    /// `Err(PeerLost)` if that lane died with nothing left.
    fn next_piece(&mut self, pos: u64) -> Result<Option<Piece>> {
        let lane = self.lane_of(pos);
        // Dead is set after the last piece was handed over: read it first.
        let dead = self.shared.dead(lane);
        match self.lanes[lane].from_wire.try_recv() {
            Ok(p) if p.pos == pos => {
                self.shared.engine.lanes[lane]
                    .taken
                    .fetch_add(1, Ordering::SeqCst);
                Ok(Some(p))
            }
            Ok(p) => Err(TransportError::Protocol(format!(
                "rank {}: socket {lane} delivered stream position {} where {pos} was due",
                self.peer, p.pos
            ))),
            Err(TryRecvError::Empty) if !dead => Ok(None),
            Err(_) => Err(self.lost()),
        }
    }

    /// Gives a used piece's buffer back to the helper that filled it.
    fn retire(&mut self, piece: Piece) {
        let lane = &self.lanes[piece.lane];
        let _ = lane.give_back.send(piece.buf);
        self.bells[lane.thread].ring_if_asleep();
    }

    /// Makes `current` hold unread bytes if any arrived: the next piece, and the unconsumed
    /// start of a word moved in front of it when the caller wants more than is left.
    fn refill(&mut self, max: usize) -> Result<()> {
        match &self.current {
            Some(c) if c.len >= 8 || max <= c.len => return Ok(()),
            Some(c) if c.len > 0 => {
                // On a loss the bytes in hand are lent first; the loss comes after them.
                let Ok(Some(mut next)) = self.next_piece(c.pos + c.len as u64) else {
                    return Ok(());
                };
                let Some(old) = self.current.take() else {
                    return Ok(());
                };
                // `next.at` is at least HEADROOM (8) and `old.len` below 8.
                next.at -= old.len;
                next.len += old.len;
                next.pos = old.pos;
                let at = next.at;
                next.buf.as_mut_slice()[at..at + old.len].copy_from_slice(old.bytes());
                self.retire(old);
                self.current = Some(next);
            }
            _ => {
                if let Some(old) = self.current.take() {
                    self.retire(old);
                }
                self.current = self.next_piece(self.received)?;
            }
        }
        Ok(())
    }

    /// [`Connection::try_recv`] without the bookkeeping for the waiter.
    fn lend(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        self.refill(max)?;
        let Some(c) = &mut self.current else {
            return Ok(0);
        };
        if max == 0 || c.len == 0 {
            return Ok(0);
        }
        let n = c.len.min(max);
        let used = consume(&c.bytes()[..n]).min(n);
        c.at += used;
        c.len -= used;
        c.pos += used as u64;
        self.received += used as u64;
        if c.len == 0 {
            if let Some(done) = self.current.take() {
                self.retire(done);
            }
        }
        Ok(used)
    }
}

impl Connection for StripedTcp {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        // A socket the peer closed means it is going: nothing more is sent.
        if (0..self.lanes.len()).any(|l| self.shared.dead(l)) {
            return Err(self.lost());
        }
        let mut taken = 0usize;
        let mut touched = 0u64;
        while taken < data.len() {
            let lane_index = self.lane_of(self.sent);
            let room = self.stripe - (self.sent % self.stripe as u64) as usize;
            let n = room.min(data.len() - taken);
            let lane = &mut self.lanes[lane_index];
            let buf = match lane.sent_back.try_recv() {
                Ok(b) => {
                    self.shared.engine.lanes[lane_index]
                        .reused
                        .fetch_add(1, Ordering::SeqCst);
                    b
                }
                Err(_) if lane.send_buffers < PIECES_PER_SOCKET => {
                    lane.send_buffers += 1;
                    piece_buffer(self.stripe)
                }
                Err(_) => break,
            };
            let mut piece = Piece {
                buf,
                at: 0,
                len: n,
                pos: self.sent,
                lane: lane_index,
            };
            piece.buf.as_mut_slice()[..n].copy_from_slice(&data[taken..taken + n]);
            if lane.to_wire.send(piece).is_err() {
                return Err(self.lost());
            }
            touched |= 1 << lane.thread;
            self.sent += n as u64;
            taken += n;
        }
        for (t, bell) in self.bells.iter().enumerate() {
            if touched & (1 << t) != 0 {
                bell.ring_if_asleep();
            }
        }
        self.note_wants();
        Ok(taken)
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        let used = self.lend(max, consume);
        self.note_wants();
        used
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        let mut filled = 0usize;
        while filled < dst.len() {
            let n = match crate::conn::recv_into_by_lending(self, &mut dst[filled..]) {
                Ok(n) => n,
                Err(e) if filled == 0 => return Err(e),
                Err(_) => break,
            };
            if n == 0 {
                break;
            }
            filled += n;
        }
        Ok(filled)
    }

    fn check_peer(&mut self) -> Result<()> {
        if self.current.as_ref().is_some_and(|c| c.len > 0) {
            return Ok(());
        }
        // A socket that failed (not one the peer closed: the others may still bring what it
        // sent before) loses the connection even while this end waits on another socket.
        if self.shared.engine.broken.load(Ordering::Acquire) {
            return Err(self.lost());
        }
        let r = self.refill(usize::MAX);
        self.note_wants();
        r
    }
}

impl Drop for StripedTcp {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        // Closing the channels tells each helper that no more pieces come.
        self.lanes.clear();
        for b in &self.bells {
            b.ring();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The helpers
// ---------------------------------------------------------------------------------------------

/// A helper's end of one socket.
struct Wire {
    sock: Socket,
    index: usize,
    sockets: usize,
    /// The piece being written, and how much of it was.
    out: Option<(Piece, usize)>,
    from_engine: Receiver<Piece>,
    send_back: Sender<AlignedBuf>,
    to_engine: Sender<Piece>,
    given_back: Receiver<AlignedBuf>,
    recv_buffers: usize,
    /// A receive buffer in hand (a read found nothing, or the engine gave one back).
    spare: Option<AlignedBuf>,
    /// Stream position of the next byte this socket brings.
    rx_pos: u64,
    stripe: usize,
    dead: bool,
}

enum Step {
    Idle,
    Moved,
    /// The engine is gone and everything it handed over was written.
    Drained,
}

impl Wire {
    /// Writes what the engine handed over until the socket is full.
    fn pump_out(&mut self, shared: &Shared) -> Step {
        let mut moved = false;
        loop {
            if self.out.is_none() {
                match self.from_engine.try_recv() {
                    Ok(p) => self.out = Some((p, 0)),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return Step::Drained,
                }
            }
            let Some((p, done)) = &mut self.out else {
                break;
            };
            match self
                .sock
                .send_with_flags(&p.bytes()[*done..], libc::MSG_NOSIGNAL)
            {
                Ok(n) => {
                    *done += n;
                    moved = true;
                    if *done == p.len {
                        let (p, _) = self.out.take().expect("matched above");
                        let _ = self.send_back.send(p.buf);
                        shared.engine.lanes[self.index]
                            .freed
                            .fetch_add(1, Ordering::SeqCst);
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    break
                }
                Err(e) => {
                    self.dead = true;
                    shared.die(
                        self.index,
                        true,
                        format!("socket {} error: {e}", self.index),
                    );
                    break;
                }
            }
        }
        if moved {
            Step::Moved
        } else {
            Step::Idle
        }
    }

    /// A receive buffer: the one in hand, one given back, or a new one within the limit.
    fn receive_buffer(&mut self) -> Option<AlignedBuf> {
        if let Some(b) = self.spare.take() {
            return Some(b);
        }
        match self.given_back.try_recv() {
            Ok(b) => Some(b),
            Err(_) if self.recv_buffers < PIECES_PER_SOCKET => {
                self.recv_buffers += 1;
                Some(piece_buffer(self.stripe))
            }
            Err(_) => None,
        }
    }

    /// Whether a read has somewhere to go.
    fn can_receive(&self) -> bool {
        self.spare.is_some() || self.recv_buffers < PIECES_PER_SOCKET
    }

    /// One read into a piece, if a buffer is free; `discard`: the engine is gone, the bytes
    /// are dropped.
    fn pump_in(&mut self, shared: &Shared, discard: bool) -> Step {
        let Some(buf) = self.receive_buffer() else {
            return Step::Idle;
        };
        let at = HEADROOM + (self.rx_pos % 8) as usize;
        let room = self.stripe - (self.rx_pos % self.stripe as u64) as usize;
        let mut piece = Piece {
            buf,
            at,
            len: 0,
            pos: self.rx_pos,
            lane: self.index,
        };
        let res = (&self.sock).read(&mut piece.buf.as_mut_slice()[at..at + room]);
        match res {
            Ok(0) => {
                self.dead = true;
                shared.die(self.index, false, "connection closed by peer".into());
                Step::Idle
            }
            Ok(_) if discard => {
                self.spare = Some(piece.buf);
                Step::Moved
            }
            Ok(n) => {
                piece.len = n;
                self.rx_pos += n as u64;
                if self.rx_pos.is_multiple_of(self.stripe as u64) {
                    // This socket's next stripe comes after the other sockets' ones.
                    self.rx_pos += ((self.sockets - 1) * self.stripe) as u64;
                }
                let _ = self.to_engine.send(piece);
                shared.engine.lanes[self.index]
                    .arrived
                    .fetch_add(1, Ordering::SeqCst);
                Step::Moved
            }
            Err(e) => {
                self.spare = Some(piece.buf);
                if !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) {
                    self.dead = true;
                    shared.die(
                        self.index,
                        true,
                        format!("socket {} error: {e}", self.index),
                    );
                }
                Step::Idle
            }
        }
    }
}

struct Helper {
    wires: Vec<Wire>,
    bell: Arc<Bell>,
    shared: Arc<Shared>,
}

impl Helper {
    fn run(mut self) {
        let mut flush_until: Option<Deadline> = None;
        loop {
            let closing = self.shared.closing.load(Ordering::Acquire);
            if closing && flush_until.is_none() {
                flush_until = Some(Deadline::after(CLOSE_FLUSH));
            }
            let mut moved = false;
            let mut drained = 0;
            for w in self.wires.iter_mut().filter(|w| !w.dead) {
                match w.pump_out(&self.shared) {
                    Step::Moved => moved = true,
                    Step::Drained => drained += 1,
                    Step::Idle => {}
                }
                // Closing, bytes are still read (and dropped): a peer flushing to this end
                // while this end flushes to it must not wait for the other's flush to end.
                if !w.dead && matches!(w.pump_in(&self.shared, closing), Step::Moved) {
                    moved = true;
                }
            }
            // A socket the peer closed stays closed, but the others may still bring bytes it
            // sent before closing them: the helper ends when all of its sockets did.
            let live = self.wires.iter().filter(|w| !w.dead).count();
            // A connection that failed is not flushed.
            if live == 0
                || closing
                    && (drained == live
                        || self.shared.lost()
                        || flush_until.as_ref().is_some_and(|d| d.expired()))
            {
                break;
            }
            if moved {
                self.shared.engine.ring_if_sleeping();
                continue;
            }
            self.sleep(closing);
        }
        for w in &self.wires {
            let _ = w.sock.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Sleeps until a socket is ready or the engine rings. The flag goes up first, then the
    /// channels are looked at once more: work the engine handed over before the flag is found
    /// here, and after it the engine rings.
    fn sleep(&mut self, closing: bool) {
        self.bell.asleep.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let mut pending = false;
        for w in self.wires.iter_mut().filter(|w| !w.dead) {
            if w.out.is_none() {
                match w.from_engine.try_recv() {
                    Ok(p) => {
                        w.out = Some((p, 0));
                        pending = true;
                    }
                    // The engine is gone: the close flag is up, nothing more comes.
                    Err(TryRecvError::Disconnected) | Err(TryRecvError::Empty) => {}
                }
            }
            if !closing && !w.can_receive() {
                if let Ok(b) = w.given_back.try_recv() {
                    w.spare = Some(b);
                    pending = true;
                }
            }
        }
        if !pending {
            let mut fds = Vec::with_capacity(self.wires.len() + 1);
            fds.push(PollFd::new(self.bell.fd.as_fd(), PollFlags::POLLIN));
            for w in self.wires.iter().filter(|w| !w.dead) {
                let mut ev = PollFlags::empty();
                if w.out.is_some() {
                    ev |= PollFlags::POLLOUT;
                }
                if w.can_receive() {
                    ev |= PollFlags::POLLIN;
                }
                // Nothing to wait for on this socket (poll would still report a reset one
                // at once, a spin): the bell says when a buffer comes back.
                if !ev.is_empty() {
                    fds.push(PollFd::new(w.sock.as_fd(), ev));
                }
            }
            let _ = nix::poll::poll(&mut fds, PollTimeout::from(HELPER_SLICE_MS));
        }
        self.bell.asleep.store(false, Ordering::SeqCst);
        self.bell.drain();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_range_is_the_socket_limit() {
        use weftcc_settings::{Kind, NSOCKS_PERTHREAD};
        let Kind::Number { min: 1, max } = NSOCKS_PERTHREAD.kind else {
            panic!("{:?}", NSOCKS_PERTHREAD.kind);
        };
        assert_eq!(max, MAX_SOCKETS as u64);
    }
    use crate::conn::{IdleWaiter, Interest};
    use crate::tcp::{local_pair_striped, loopback, Family};
    use std::net::SocketAddr;
    use std::time::Instant;

    fn pair(
        threads: usize,
        per: usize,
        stripe: usize,
    ) -> (crate::tcp::TcpConnection, crate::tcp::TcpConnection) {
        let plan = StripePlan::new(threads, per)
            .and_then(|p| p.with_stripe(stripe))
            .expect("plan");
        local_pair_striped(0, 1, loopback(Family::Inet), plan).expect("pair")
    }

    #[test]
    fn plans_are_checked() {
        assert_eq!(StripePlan::default().sockets(), 1);
        assert_eq!(StripePlan::new(2, 4).unwrap().sockets(), 8);
        assert_eq!(StripePlan::new(0, 3).unwrap().sockets(), 3);
        for (t, s) in [(1, 0), (16, 5), (0, 65)] {
            let e = StripePlan::new(t, s).unwrap_err();
            assert!(e.to_string().contains("sockets per connection"), "{e}");
        }
        for bytes in [0, 60, 1001, 32 << 20] {
            assert!(StripePlan::SINGLE.with_stripe(bytes).is_err(), "{bytes}");
        }
        assert_eq!(StripePlan::SINGLE.with_stripe(1000).unwrap().stripe, 1000);
    }

    /// A blocking socket pair over loopback: (dialed, accepted).
    fn socket_pair() -> (Socket, Socket) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a.into(), b.into())
    }

    #[test]
    fn a_dialer_sent_something_else_than_a_stripe_frame_fails_clearly() {
        let dial = |first: Socket| {
            let d = Deadline::after(Duration::from_secs(5));
            open_stripes(1, first, Side::Dialer, StripePlan::SINGLE, &d).unwrap_err()
        };
        let (dialed, accepted) = socket_pair();
        (&accepted).write_all(&[0x55; FRAME_BYTES]).unwrap();
        let e = dial(dialed);
        assert!(matches!(e, TransportError::Protocol(_)), "{e}");
        // A peer that closes instead is lost, not a hang.
        let (dialed, accepted) = socket_pair();
        drop(accepted);
        let e = dial(dialed);
        assert!(matches!(e, TransportError::PeerLost { peer: 1, .. }), "{e}");
        // A peer set up for another number of sockets: told, not half connected.
        let (dialed, accepted) = socket_pair();
        let mut frame = STRIPE_MAGIC.to_vec();
        frame.extend_from_slice(&3u16.to_le_bytes());
        frame.extend_from_slice(&9u16.to_le_bytes());
        frame.extend_from_slice(&(STRIPE as u32).to_le_bytes());
        frame.extend_from_slice(&[b'a'; 16]);
        (&accepted).write_all(&frame).unwrap();
        let e = dial(dialed);
        assert!(e.to_string().contains("WEFT_NSOCKS_PERTHREAD alike"), "{e}");
    }

    /// The acceptor ignores a connection to its stripe listener without the nonce, takes the
    /// right ones in any order, and gives up at its deadline when they do not come.
    #[test]
    fn the_acceptor_takes_only_its_own_sockets_and_does_not_wait_forever() {
        let plan = StripePlan::new(1, 3).unwrap();
        let (dialed, accepted) = socket_pair();
        std::thread::scope(|s| {
            let acceptor = s.spawn(|| {
                let d = Deadline::after(Duration::from_secs(10));
                open_stripes(0, accepted, Side::Acceptor, plan, &d)
            });
            let mut frame = [0u8; FRAME_BYTES];
            (&dialed).read_exact(&mut frame).unwrap();
            assert_eq!(&frame[..4], b"WSTR");
            assert_eq!(u16::from_le_bytes([frame[4], frame[5]]), 3);
            let port = u16::from_le_bytes([frame[6], frame[7]]);
            let to = SocketAddr::from(([127, 0, 0, 1], port));
            let foreign = std::net::TcpStream::connect(to).unwrap();
            (&foreign).write_all(&[0u8; 18]).unwrap();
            let mut ours = Vec::new();
            for i in [2u16, 1] {
                let c = std::net::TcpStream::connect(to).unwrap();
                let mut hello = frame[12..].to_vec();
                hello.extend_from_slice(&i.to_le_bytes());
                (&c).write_all(&hello).unwrap();
                ours.push(c);
            }
            let mut ok = [0u8];
            (&dialed).read_exact(&mut ok).unwrap();
            assert_eq!(ok, [1]);
            let (socks, stripe) = acceptor.join().unwrap().unwrap();
            assert_eq!((socks.len(), stripe), (3, STRIPE));
            // In stripe order: the socket of index 1 is the one connected second.
            let peer_of = |s: &Socket| s.peer_addr().unwrap().as_socket().unwrap();
            assert_eq!(peer_of(&socks[1]), ours[1].local_addr().unwrap());
            assert_eq!(peer_of(&socks[2]), ours[0].local_addr().unwrap());
        });
        // A dialer that reads the frame and never connects: a timeout, not a hang.
        let (dialed, accepted) = socket_pair();
        let t = std::time::Instant::now();
        let d = Deadline::after(Duration::from_millis(500));
        let e = open_stripes(0, accepted, Side::Acceptor, plan, &d).unwrap_err();
        assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
        drop(dialed);
    }

    /// Ping-pong of 24-byte messages over stripes of 1,000 bytes: every 42nd message is cut
    /// between two sockets of two helpers, and each side sleeps in its waiter between rounds.
    #[test]
    fn messages_cut_between_sockets_wake_the_reader() {
        let (a, b) = pair(2, 2, 1000);
        let rounds = 400u64;
        let run = |mut c: crate::tcp::TcpConnection, first: bool| {
            let mut w = c.waiter();
            let peer = c.peer();
            for i in 0..rounds {
                let msg = [i as u8; 24];
                if first {
                    assert_eq!(c.try_send(&msg).unwrap(), 24);
                }
                let mut got = [0u8; 24];
                let mut n = 0;
                let t = Instant::now();
                while n < 24 {
                    let k = c.try_recv_into(&mut got[n..]).unwrap();
                    n += k;
                    if k == 0 {
                        assert!(
                            t.elapsed() < Duration::from_secs(3),
                            "round {i} stalled at {n} bytes"
                        );
                        w.wait(
                            &[Interest {
                                peer,
                                recv: true,
                                send: false,
                            }],
                            Duration::from_secs(5),
                        )
                        .unwrap();
                    }
                }
                assert_eq!(got, msg, "round {i}");
                if !first {
                    assert_eq!(c.try_send(&msg).unwrap(), 24);
                }
            }
            c
        };
        std::thread::scope(|s| {
            let h = s.spawn(move || run(a, true));
            let _b = run(b, false);
            let _a = h.join().unwrap();
        });
    }
}
