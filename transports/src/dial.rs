//! Connections made on demand: a rank dials a peer the first time a schedule needs it, and two
//! ranks that dial each other at once end with exactly one connection and the same transport.
//!
//! Every rank runs an *acceptor* thread that answers dials at once, whatever the rank's main
//! thread is doing, so a dial never waits for the peer to reach the same operation (a rank that
//! sends to a peer still busy in an earlier collective must not hang). The answer follows one
//! rule, [`answer`], applied under the lock that guards this rank's [`Link`] with the dialer:
//! - `Idle` (this rank is not dialing the peer): accept; the link is `Ready`.
//! - `Dialing` (both dial at once): the lower rank's dial wins. The higher rank accepts the lower
//!   rank's dial; the lower rank answers the higher rank's dial `Defer`, and the deferred dialer
//!   waits for its own acceptor to take the winning dial.
//! - `Ready` (this rank's own dial won, and the loser's dial arrives late): defer; the dialer's
//!   acceptor has already taken the winning dial, so its link is ready.
//!
//! The exhaustive model in this module's tests runs this rule with every interleaving of three
//! ranks' main threads, acceptors and messages, for every order in which the ranks want their
//! peers, and checks that every pair ends with one connection both ends agree on and nobody
//! waits forever.
//!
//! Wire: the dialer sends the TCP handshake frame ([`tcp::encode_hello`]) and one byte, the
//! transport it chose; the acceptor answers with its own frame and one [`Answer`] byte. After an
//! accept, a TCP stream becomes the connection's first socket (the acceptor then tells how many
//! more it wants, [`crate::tcp_stripes`]); over a Unix socket the two ends exchange their
//! shared-memory descriptors ([`ShmEndpoint::connect_over`]) and the socket is closed.
//!
//! Both ends choose the transport from the same facts, the host table every rank gathered at
//! set-up ([`PeerHost`]): shared memory when both are on one host, in one network namespace
//! (the Unix sockets are abstract names, which live in a network namespace) and both allow it.

use crate::error::{Result, TransportError};
use crate::shm::{ShmConnection, ShmEndpoint};
use crate::tcp::{self, TcpConnection, TcpEndpoint};
use crate::tcp_stripes::{open_stripes, Side, StripePlan};
use crate::util::{lock, Deadline};
use socket2::Socket;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where this rank stands with one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// Not connected, not dialing.
    Idle,
    /// This rank's main thread is dialing the peer, or waits for the peer's dial after a defer.
    Dialing,
    /// A connection exists (possibly still being set up by the acceptor).
    Ready,
}

/// The acceptor's answer to a dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// The dial makes the connection.
    Accept = 0,
    /// This rank's own dial wins (it is running, or it made the connection): wait for it.
    Defer = 1,
    /// The dialer chose another transport than this rank would.
    Mismatch = 3,
}

impl Answer {
    fn from_byte(b: u8) -> Option<Answer> {
        [Answer::Accept, Answer::Defer, Answer::Mismatch]
            .into_iter()
            .find(|a| *a as u8 == b)
    }
}

/// The rule: what rank `me` answers a dial from `peer` while its own link to `peer` is `link`.
pub fn answer(me: usize, peer: usize, link: Link) -> Answer {
    match link {
        Link::Idle => Answer::Accept,
        Link::Dialing if peer < me => Answer::Accept,
        Link::Dialing | Link::Ready => Answer::Defer,
    }
}

/// What the transport choice needs to know of a rank: its host, network namespace and whether
/// it allows shared memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerHost {
    /// Ranks with equal host ids are on one host.
    pub host_id: String,
    /// Inode of the rank's network namespace (0 when unknown).
    pub netns: u64,
    /// The rank allows shared memory.
    pub shm: bool,
    /// The [`Provider::id`](crate::net::Provider::id) of the network provider the rank opened
    /// (empty for TCP only): two ranks on different hosts with equal ids use it.
    pub net: String,
}

impl PeerHost {
    /// This process, with `host_id` and whether it allows shared memory.
    pub fn this_process(host_id: &str, shm: bool) -> PeerHost {
        use std::os::unix::fs::MetadataExt;
        PeerHost {
            host_id: host_id.to_string(),
            netns: std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino()),
            shm,
            net: String::new(),
        }
    }

    /// Whether two ranks that do not share memory connect through their network provider.
    pub fn shares_network_with(&self, other: &PeerHost) -> bool {
        !self.net.is_empty() && self.net == other.net && !self.shares_memory_with(other)
    }

    /// Whether two ranks connect through shared memory (else TCP).
    pub fn shares_memory_with(&self, other: &PeerHost) -> bool {
        self.shm && other.shm && self.host_id == other.host_id && self.netns == other.netns
    }
}

/// The transport a connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Shared-memory rings.
    Shm = 1,
    /// A TCP stream.
    Tcp = 2,
}

/// A connection made by a dial or an acceptor.
pub enum Made {
    Shm(Box<ShmConnection>),
    Tcp(TcpConnection),
}

/// How long one side of a handshake waits for the other (both answer from an acceptor thread,
/// so only a dead or foreign process takes long).
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How often the acceptor looks at its stop flag while no dial comes.
const ACCEPT_SLICE_MS: u16 = 50;
/// How often a dialer waiting for its handshake's answer looks for an abort.
const CANCEL_CHECK: Duration = Duration::from_millis(50);
/// How long accepts must have failed for lack of a resource before waiting ranks give up
/// (a descriptor or buffer shortage can pass: another thread closes a file).
const ACCEPT_FAILURE_LASTS: Duration = Duration::from_millis(500);

/// Everything the dialing and accepting sides share.
struct Shared {
    rank: usize,
    nranks: usize,
    token: String,
    namespace_hash: u64,
    hosts: Vec<PeerHost>,
    tcp: TcpEndpoint,
    unix: Option<UnixListener>,
    unix_prefix: String,
    shm: Option<ShmEndpoint>,
    links: Mutex<Links>,
    changed: Condvar,
    stop: AtomicBool,
    /// Connections carry frames (see [`Connector::start`]): sent with the kind in every dial.
    framed: AtomicBool,
    /// Sockets and helper threads of a TCP connection.
    stripes: StripePlan,
    /// Why the acceptor cannot take dials right now (out of descriptors or memory), as an OS
    /// error number, and since when; cleared by the next accept that works. Once it has lasted
    /// [`ACCEPT_FAILURE_LASTS`], a rank waiting for a peer's dial fails with it instead of
    /// waiting out its timeout.
    accept_failure: Mutex<Option<(i32, Instant)>>,
}

struct Links {
    state: Vec<Link>,
    /// Connections the acceptor made that the main thread has not taken yet (or why it failed).
    made: HashMap<usize, Result<Made>>,
}

/// This rank's side of on-demand connections: its listeners, its acceptor thread, its links.
pub struct Connector {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Connector {
    /// Starts the acceptor of `rank` (of `hosts.len()` ranks) listening on `tcp` and, where this
    /// rank may use shared memory, on `unix` (from [`listen_unix`]); `shm` makes the rings.
    /// `framed`: this rank's connections carry frames ([`crate::mux`]); dials between ranks that
    /// disagree are refused (`Answer::Mismatch`). `stripes`: the sockets and helper threads of
    /// a TCP connection (the accepting side's number of sockets holds for both).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        rank: usize,
        hosts: Vec<PeerHost>,
        token: &str,
        namespace: &str,
        tcp: TcpEndpoint,
        unix: Option<UnixListener>,
        shm: Option<ShmEndpoint>,
        framed: bool,
        stripes: StripePlan,
    ) -> Result<Connector> {
        let nranks = hosts.len();
        let unix_prefix = unix_prefix(token, namespace);
        let shared = Arc::new(Shared {
            rank,
            nranks,
            token: token.to_string(),
            namespace_hash: tcp::namespace_hash(namespace),
            hosts,
            tcp,
            unix,
            unix_prefix,
            shm,
            links: Mutex::new(Links {
                state: vec![Link::Idle; nranks],
                made: HashMap::new(),
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            framed: AtomicBool::new(framed),
            stripes,
            accept_failure: Mutex::new(None),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("weft-accept-{rank}"))
            .spawn(move || s.accept_loop())
            .map_err(|e| TransportError::io("starting the acceptor thread", e))?;
        Ok(Connector {
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The transport this rank uses with `peer`.
    pub fn kind(&self, peer: usize) -> Kind {
        self.shared.kind(peer)
    }

    /// What the host table says of `peer` (`None` out of range).
    pub fn host(&self, peer: usize) -> Option<&PeerHost> {
        self.shared.hosts.get(peer)
    }

    /// This rank's own entry of the host table.
    pub fn me(&self) -> &PeerHost {
        &self.shared.hosts[self.shared.rank]
    }

    /// A waiter on this rank's shared-memory doorbell, if it has one.
    pub fn shm_waiter(&self) -> Option<crate::shm::ShmWaiter> {
        self.shared.shm.as_ref().map(ShmEndpoint::waiter)
    }

    /// Connects to `peer` (its TCP address `addr` where the transport is TCP): takes the
    /// connection the acceptor already made, or dials, or waits for the peer's winning dial.
    /// Gives up at `deadline`, or with [`TransportError::Aborted`] once `cancel` says so.
    pub(crate) fn connect(
        &self,
        peer: usize,
        addr: Option<SocketAddr>,
        deadline: &Deadline,
        cancel: &dyn Fn() -> bool,
    ) -> Result<Made> {
        let s = &*self.shared;
        if peer >= s.nranks || peer == s.rank {
            return Err(TransportError::Config(format!(
                "rank {} cannot connect to rank {peer} of {}",
                s.rank, s.nranks
            )));
        }
        let mut links = lock(&s.links);
        loop {
            match links.state[peer] {
                Link::Ready => {
                    if let Some(made) = links.made.remove(&peer) {
                        return made;
                    }
                }
                Link::Idle => {
                    links.state[peer] = Link::Dialing;
                    drop(links);
                    let dialed = s.dial(peer, addr, deadline, cancel);
                    links = lock(&s.links);
                    match dialed {
                        Ok(Some(made)) => {
                            if links.state[peer] != Link::Dialing {
                                return Err(TransportError::Protocol(format!(
                                    "rank {peer} accepted a dial while its own dial was \
                                     accepted too"
                                )));
                            }
                            links.state[peer] = Link::Ready;
                            return Ok(made);
                        }
                        // Deferred: the peer's dial is on its way to our acceptor.
                        Ok(None) => continue,
                        Err(e) => {
                            if links.state[peer] == Link::Dialing {
                                links.state[peer] = Link::Idle;
                            }
                            return Err(e);
                        }
                    }
                }
                Link::Dialing => {}
            }
            if cancel() {
                return Err(TransportError::Aborted);
            }
            if let Some(e) = s.cannot_accept(peer) {
                return Err(e);
            }
            if deadline.expired() {
                return Err(deadline.timeout_error(format!(
                    "rank {} waiting for rank {peer} to connect (it is dialing this rank)",
                    s.rank
                )));
            }
            let slice = deadline.remaining().min(Duration::from_millis(10));
            links = s
                .changed
                .wait_timeout(links, slice)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl Drop for Connector {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

/// `weft-<token hash>-<namespace hash>-`: the abstract Unix socket names of a communicator's
/// ranks begin so (the rank follows).
fn unix_prefix(token: &str, namespace: &str) -> String {
    format!(
        "weft-{:016x}-{:016x}-",
        crate::util::fnv1a64(token.as_bytes()),
        tcp::namespace_hash(namespace)
    )
}

/// Listens on `rank`'s abstract Unix socket in communicator `namespace` of job `token`, where
/// peers on this host dial it. Bind it before the rank's host entry is published: a peer may
/// dial as soon as it reads the entry. Abstract names vanish with the process.
pub fn listen_unix(token: &str, namespace: &str, rank: usize) -> Result<UnixListener> {
    let name = format!("{}{rank}", unix_prefix(token, namespace));
    let addr = UnixAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| TransportError::io("naming the Unix socket", e))?;
    let l = UnixListener::bind_addr(&addr).map_err(|e| {
        TransportError::io(
            format!("binding the Unix socket @{name} (another job with the same token?)"),
            e,
        )
    })?;
    l.set_nonblocking(true)
        .map_err(|e| TransportError::io("making the Unix socket non-blocking", e))?;
    Ok(l)
}

/// A handshake stream of either kind.
enum Stream {
    Tcp(Socket),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }

    fn write_all(&self, b: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => (&*s).write_all(b),
            Stream::Unix(s) => (&*s).write_all(b),
        }
    }

    fn read_byte(&self) -> std::io::Result<u8> {
        let mut b = [0u8];
        match self {
            Stream::Tcp(s) => (&*s).read_exact(&mut b)?,
            Stream::Unix(s) => (&*s).read_exact(&mut b)?,
        }
        Ok(b[0])
    }

    fn read_hello(&self) -> Result<tcp::Hello> {
        match self {
            Stream::Tcp(s) => tcp::read_hello(&mut &*s),
            Stream::Unix(s) => tcp::read_hello(&mut &*s),
        }
    }

    fn read_some(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

/// Reads a handshake stream in short slices until `until`, giving up at once when `cancel`
/// says so (the communicator was aborted or failed): a dialer waiting for an answer that will
/// not come (its peer cannot accept) must not hold its rank past an abort.
struct Cancellable<'a> {
    stream: &'a Stream,
    until: Instant,
    cancel: &'a dyn Fn() -> bool,
}

impl Read for Cancellable<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::io::ErrorKind;
        loop {
            let left = self.until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ErrorKind::TimedOut.into());
            }
            self.stream
                .set_timeouts(Some(left.min(CANCEL_CHECK).max(Duration::from_millis(1))))?;
            match self.stream.read_some(buf) {
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    // Not `Interrupted`: `read_exact` would read again.
                    if (self.cancel)() {
                        return Err(std::io::Error::new(ErrorKind::ConnectionAborted, "aborted"));
                    }
                }
                other => return other,
            }
        }
    }
}

impl Shared {
    /// The high bit of the dial's kind byte: set when connections carry frames.
    fn framed_bit(&self) -> u8 {
        u8::from(self.framed.load(Ordering::Relaxed)) << 7
    }

    fn kind(&self, peer: usize) -> Kind {
        match (self.hosts.get(self.rank), self.hosts.get(peer)) {
            (Some(me), Some(p)) if me.shares_memory_with(p) && self.shm.is_some() => Kind::Shm,
            _ => Kind::Tcp,
        }
    }

    fn hello(&self, kind_or_answer: u8) -> Result<Vec<u8>> {
        let mut v = tcp::encode_hello(&self.token, self.rank as u32, self.namespace_hash)?;
        v.push(kind_or_answer);
        Ok(v)
    }

    /// One dial: `Some` connection when accepted, `None` when deferred.
    fn dial(
        &self,
        peer: usize,
        addr: Option<SocketAddr>,
        deadline: &Deadline,
        cancel: &dyn Fn() -> bool,
    ) -> Result<Option<Made>> {
        let kind = self.kind(peer);
        let lost = |detail: String| TransportError::PeerLost { peer, detail };
        let stream = match kind {
            Kind::Shm => {
                let name = format!("{}{peer}", self.unix_prefix);
                let a = UnixAddr::from_abstract_name(name.as_bytes())
                    .map_err(|e| TransportError::io("naming the Unix socket", e))?;
                Stream::Unix(UnixStream::connect_addr(&a).map_err(|e| {
                    lost(format!(
                        "its shared-memory socket @{name} does not answer: {e}"
                    ))
                })?)
            }
            Kind::Tcp => {
                let addr = addr.ok_or_else(|| {
                    TransportError::Config(format!("no TCP address known for rank {peer}"))
                })?;
                Stream::Tcp(crate::socket::dial_socket(peer, addr, deadline)?)
            }
        };
        let wait = deadline
            .remaining()
            .min(HANDSHAKE)
            .max(Duration::from_millis(100));
        let io = |what: &str, e: std::io::Error| {
            TransportError::io_with(peer, format!("{what} with rank {peer}"), e)
        };
        stream
            .set_timeouts(Some(wait))
            .map_err(|e| io("handshake", e))?;
        stream
            .write_all(&self.hello(kind as u8 | self.framed_bit())?)
            .map_err(|e| io("sending the handshake", e))?;
        // The answer comes from the peer's acceptor. Stop waiting for it once the job failed, or
        // once this rank's own acceptor cannot take dials: a peer that dialed this rank too may
        // be waiting on that (the rule lets only one of two crossing dials make the link).
        let stop = || cancel() || self.cannot_accept(peer).is_some();
        let mut answer = Cancellable {
            stream: &stream,
            until: Instant::now() + wait,
            cancel: &stop,
        };
        let aborted = |e: TransportError| {
            if cancel() {
                TransportError::Aborted
            } else if let Some(e) = self.cannot_accept(peer) {
                e
            } else if let TransportError::Timeout { .. } = e {
                TransportError::Timeout {
                    what: format!("waiting for rank {peer} to answer the handshake"),
                    after: wait,
                }
            } else {
                e
            }
        };
        tcp::read_hello(&mut answer).map_err(aborted)?.check_reply(
            &self.token,
            self.namespace_hash,
            peer,
        )?;
        let mut ans = [0u8];
        answer
            .read_exact(&mut ans)
            .map_err(|e| aborted(io("reading the answer", e)))?;
        let ans = ans[0];
        stream
            .set_timeouts(Some(wait))
            .map_err(|e| io("handshake", e))?;
        match Answer::from_byte(ans) {
            Some(Answer::Accept) => self.finish(peer, stream, Side::Dialer, wait).map(Some),
            Some(Answer::Defer) => Ok(None),
            Some(Answer::Mismatch) => Err(TransportError::Protocol(format!(
                "rank {peer} would not use {kind:?} with rank {} (different host records, or \
                 WEFT_SPLIT_SHARE differs between them?)",
                self.rank
            ))),
            None => Err(TransportError::Protocol(format!(
                "rank {peer} answered {ans}"
            ))),
        }
    }

    /// Turns an accepted handshake stream into the connection (both ends run this; a TCP
    /// stream first opens the connection's other sockets, [`open_stripes`]).
    fn finish(&self, peer: usize, stream: Stream, side: Side, wait: Duration) -> Result<Made> {
        match stream {
            Stream::Tcp(sock) => {
                // Under a network connection TCP only carries the setup: one socket.
                let plan = if self.hosts[self.rank].shares_network_with(&self.hosts[peer]) {
                    StripePlan::SINGLE
                } else {
                    self.stripes
                };
                let socks = open_stripes(peer, sock, side, plan, &Deadline::after(wait))?;
                Ok(Made::Tcp(TcpConnection::from_sockets(
                    peer,
                    socks,
                    plan.threads,
                )?))
            }
            Stream::Unix(u) => {
                let ep = self.shm.as_ref().ok_or_else(|| {
                    TransportError::SharedMemory("shared memory is disabled here".into())
                })?;
                Ok(Made::Shm(Box::new(ep.connect_over(peer, &u, wait)?)))
            }
        }
    }

    fn accept_loop(&self) {
        let tcp_fd = self.tcp.listener().as_fd();
        while !self.stop.load(Ordering::Acquire) {
            let mut fds = vec![nix::poll::PollFd::new(tcp_fd, nix::poll::PollFlags::POLLIN)];
            if let Some(u) = &self.unix {
                fds.push(nix::poll::PollFd::new(
                    u.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                ));
            }
            if !matches!(
                nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ACCEPT_SLICE_MS)),
                Ok(n) if n > 0
            ) {
                continue;
            }
            drop(fds);
            let tcp = self.tcp.listener().accept();
            let tcp_failed = self.note_accept(tcp.as_ref().err());
            if let Ok((sock, _)) = tcp {
                self.answer_dial(Stream::Tcp(sock), Kind::Tcp);
            }
            let mut unix_failed = false;
            if let Some(u) = &self.unix {
                let unix = u.accept();
                unix_failed = self.note_accept(unix.as_ref().err());
                if let Ok((s, _)) = unix {
                    self.answer_dial(Stream::Unix(s), Kind::Shm);
                }
            }
            // The dial stays queued and the listener readable: wait instead of spinning.
            if tcp_failed || unix_failed {
                std::thread::sleep(Duration::from_millis(u64::from(ACCEPT_SLICE_MS)));
            }
        }
    }

    /// Why this rank cannot take the dial of `peer` it waits for, when its acceptor has run
    /// out of descriptors or memory ([`Shared::note_accept`]).
    fn cannot_accept(&self, peer: usize) -> Option<TransportError> {
        let (code, since) = (*lock(&self.accept_failure))?;
        if since.elapsed() < ACCEPT_FAILURE_LASTS {
            return None;
        }
        Some(TransportError::io(
            format!(
                "rank {} accepting connections (needed for the one with rank {peer})",
                self.rank
            ),
            std::io::Error::from_raw_os_error(code),
        ))
    }

    /// Records why an accept failed when the reason is a resource this process ran out of
    /// (descriptors, buffers, memory), clears it when an accept worked; returns whether it
    /// failed so.
    fn note_accept(&self, error: Option<&std::io::Error>) -> bool {
        let exhausted = error.and_then(|e| e.raw_os_error()).filter(|&code| {
            [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM].contains(&code)
        });
        let mut failure = lock(&self.accept_failure);
        match (error, exhausted) {
            (None, _) => *failure = None,
            (Some(_), Some(code)) => {
                let since = match *failure {
                    Some((_, since)) => since,
                    None => {
                        tracing::warn!(target: "weftcc::net", rank = self.rank, error = %std::io::Error::from_raw_os_error(code), "cannot accept connections");
                        Instant::now()
                    }
                };
                *failure = Some((code, since));
                drop(failure);
                self.changed.notify_all();
            }
            (Some(_), None) => {}
        }
        exhausted.is_some()
    }

    /// Reads a dial, answers it by [`answer`], and on accept makes the connection and leaves it
    /// for the main thread. Foreign or broken dials are logged and dropped.
    fn answer_dial(&self, stream: Stream, came_by: Kind) {
        let peer = match self.read_dial(&stream, came_by) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(target: "weftcc::net", rank = self.rank, error = %e, "refused a connection");
                return;
            }
        };
        let (peer, ans) = peer;
        if ans != Answer::Accept {
            let _ = stream.write_all(&self.hello(ans as u8).unwrap_or_default());
            return;
        }
        let made = stream
            .write_all(&self.hello(Answer::Accept as u8).unwrap_or_default())
            .map_err(|e| TransportError::io(format!("answering rank {peer}"), e))
            .and_then(|_| self.finish(peer, stream, Side::Acceptor, HANDSHAKE));
        if let Err(e) = &made {
            tracing::warn!(target: "weftcc::net", rank = self.rank, peer, error = %e, "accepted connection failed");
        }
        let mut links = lock(&self.links);
        links.made.insert(peer, made);
        self.changed.notify_all();
    }

    /// The dialer's rank and this rank's answer (the link is set `Ready` on accept).
    fn read_dial(&self, stream: &Stream, came_by: Kind) -> Result<(usize, Answer)> {
        if let Stream::Tcp(s) = stream {
            s.set_nonblocking(false)
                .map_err(|e| TransportError::io("set_nonblocking", e))?;
        }
        stream
            .set_timeouts(Some(HANDSHAKE))
            .map_err(|e| TransportError::io("set timeouts", e))?;
        let hello = stream.read_hello()?;
        if hello.token != self.token.as_bytes() || hello.namespace_hash != self.namespace_hash {
            return Err(TransportError::Protocol(format!(
                "claimed rank {} has another job token or communicator",
                hello.rank
            )));
        }
        let peer = hello.rank as usize;
        if peer >= self.nranks || peer == self.rank {
            return Err(TransportError::Protocol(format!(
                "dial from rank {peer}, outside 0..{} or this rank",
                self.nranks
            )));
        }
        let kind = stream
            .read_byte()
            .map_err(|e| TransportError::io("reading the dial", e))?;
        if kind != came_by as u8 | self.framed_bit() || came_by != self.kind(peer) {
            return Ok((peer, Answer::Mismatch));
        }
        let mut links = lock(&self.links);
        let ans = answer(self.rank, peer, links.state[peer]);
        if ans == Answer::Accept {
            links.state[peer] = Link::Ready;
        }
        Ok((peer, ans))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weftcc_testkit::model::{explore, Faulty, Model, Violation};

    /// Three ranks, each with a main thread that wants its peers in a given order and an
    /// acceptor; dials and answers in flight are unordered.
    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct Dials {
        rule: Rule,
        want: [Vec<usize>; 3],
        /// Main thread: index into `want`, and what it waits for.
        next: [usize; 3],
        waiting: [Wait; 3],
        link: [[Link; 3]; 3],
        /// Who dialed the connection each side holds (by the dialer's rank).
        origin: [[Option<usize>; 3]; 3],
        /// Dials (from, to) and answers (to, from, answer) in flight.
        dials: Vec<(usize, usize)>,
        answers: Vec<(usize, usize, Answer)>,
        broken: Option<&'static str>,
    }

    /// The acceptor's rule: the real one, or a broken variant the model must catch.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Rule {
        Real,
        /// Accept every dial unless connected: both crossing dials win.
        BothWin,
        /// Defer every dial unless idle: both crossing dials wait.
        BothWait,
        /// Refuse a dial when connected (a late losing dial fails).
        RefuseLate,
    }

    impl Rule {
        fn answer(self, me: usize, peer: usize, link: Link) -> Answer {
            match (self, link) {
                (Rule::Real, _) => answer(me, peer, link),
                (Rule::BothWin, Link::Ready) | (Rule::BothWait, Link::Dialing | Link::Ready) => {
                    Answer::Defer
                }
                (Rule::BothWin | Rule::BothWait, _) => Answer::Accept,
                (Rule::RefuseLate, Link::Ready) => Answer::Mismatch,
                (Rule::RefuseLate, _) => answer(me, peer, link),
            }
        }
    }

    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Wait {
        Nothing,
        Answer(usize),
        Ready(usize),
    }

    impl Dials {
        fn new(want: [Vec<usize>; 3]) -> Dials {
            Dials {
                rule: Rule::Real,
                want,
                next: [0; 3],
                waiting: [Wait::Nothing; 3],
                link: [[Link::Idle; 3]; 3],
                origin: [[None; 3]; 3],
                dials: Vec::new(),
                answers: Vec::new(),
                broken: None,
            }
        }
    }

    impl Model for Dials {
        fn threads(&self) -> usize {
            6 // mains 0..3, acceptors 3..6
        }

        fn steps(&self, t: usize) -> Vec<Self> {
            let mut out = Vec::new();
            if t < 3 {
                let r = t;
                match self.waiting[r] {
                    Wait::Nothing => {
                        let Some(&p) = self.want[r].get(self.next[r]) else {
                            return out;
                        };
                        let mut s = self.clone();
                        match s.link[r][p] {
                            Link::Ready => s.next[r] += 1,
                            Link::Idle => {
                                s.link[r][p] = Link::Dialing;
                                s.dials.push((r, p));
                                s.dials.sort();
                                s.waiting[r] = Wait::Answer(p);
                            }
                            Link::Dialing => s.broken = Some("main found its own dial running"),
                        }
                        out.push(s);
                    }
                    Wait::Answer(p) => {
                        if let Some(i) = self
                            .answers
                            .iter()
                            .position(|&(to, from, _)| to == r && from == p)
                        {
                            let mut s = self.clone();
                            let (_, _, a) = s.answers.remove(i);
                            match a {
                                Answer::Accept => {
                                    if s.link[r][p] != Link::Dialing {
                                        s.broken = Some("two connections for one pair");
                                    }
                                    s.link[r][p] = Link::Ready;
                                    s.origin[r][p] = Some(r);
                                    s.waiting[r] = Wait::Nothing;
                                    s.next[r] += 1;
                                }
                                Answer::Defer => s.waiting[r] = Wait::Ready(p),
                                Answer::Mismatch => s.broken = Some("a dial was refused"),
                            }
                            out.push(s);
                        }
                    }
                    Wait::Ready(p) => {
                        if self.link[r][p] == Link::Ready {
                            let mut s = self.clone();
                            s.waiting[r] = Wait::Nothing;
                            s.next[r] += 1;
                            out.push(s);
                        }
                    }
                }
            } else {
                let me = t - 3;
                for (i, &(from, to)) in self.dials.iter().enumerate() {
                    if to != me {
                        continue;
                    }
                    let mut s = self.clone();
                    s.dials.remove(i);
                    let a = s.rule.answer(me, from, s.link[me][from]);
                    if a == Answer::Accept {
                        s.link[me][from] = Link::Ready;
                        s.origin[me][from] = Some(from);
                    }
                    s.answers.push((from, me, a));
                    s.answers.sort_by_key(|x| (x.0, x.1, x.2 as u8));
                    out.push(s);
                }
            }
            out
        }

        fn finished(&self) -> bool {
            (0..3).all(|r| self.next[r] == self.want[r].len())
                && self.dials.is_empty()
                && self.answers.is_empty()
        }

        fn check(&self) -> std::result::Result<(), &'static str> {
            if let Some(why) = self.broken {
                return Err(why);
            }
            for a in 0..3 {
                for b in 0..3 {
                    let (x, y) = (self.origin[a][b], self.origin[b][a]);
                    if x.is_some() && y.is_some() && x != y {
                        return Err("the two ends hold different connections");
                    }
                }
            }
            if self.finished() {
                for r in 0..3 {
                    for &p in &self.want[r] {
                        if self.origin[r][p].is_none() || self.origin[p][r] != self.origin[r][p] {
                            return Err("a wanted pair ended without one shared connection");
                        }
                    }
                }
            }
            Ok(())
        }
    }

    /// Every order in which rank `r` may want a subset of the two other ranks.
    fn wants(r: usize) -> Vec<Vec<usize>> {
        let o: Vec<usize> = (0..3).filter(|&p| p != r).collect();
        vec![
            vec![],
            vec![o[0]],
            vec![o[1]],
            vec![o[0], o[1]],
            vec![o[1], o[0]],
        ]
    }

    #[test]
    fn every_interleaving_of_three_ranks_dialing_ends_with_one_connection_per_pair() {
        let mut states = 0;
        for w0 in wants(0) {
            for w1 in wants(1) {
                for w2 in wants(2) {
                    let m = Dials::new([w0.clone(), w1.clone(), w2.clone()]);
                    match explore(m, 1_000_000) {
                        Ok(e) => {
                            assert!(e.finished > 0);
                            states += e.states;
                        }
                        Err(v) => panic!("{v}"),
                    }
                }
            }
        }
        assert!(states > 10_000, "{states} states");
    }

    fn wanted_by_all() -> [Vec<usize>; 3] {
        [vec![1, 2], vec![2, 0], vec![0, 1]]
    }

    /// What the model checker finds wrong with the acceptor's `rule` when the ranks `want`
    /// those peers (it must find something: the rule is broken).
    fn violation(rule: Rule, want: [Vec<usize>; 3]) -> Violation<Dials> {
        let mut m = Dials::new(want);
        m.rule = rule;
        match explore(m, 1_000_000) {
            Ok(_) => panic!("{rule:?} passed the model check"),
            Err(v) => v,
        }
    }

    #[test]
    fn the_model_finds_each_broken_rule() {
        // Both crossing dials win: two connections for one pair.
        let v = violation(Rule::BothWin, wanted_by_all());
        assert!(matches!(v, Violation::Invariant { .. }), "{v}");
        // The first rule tried: refuse a dial when a connection exists. A losing dial that
        // arrives after the winner's accept is then refused.
        let v = violation(Rule::RefuseLate, [vec![], vec![2], vec![1]]);
        let refused = matches!(
            v,
            Violation::Invariant {
                why: "a dial was refused",
                ..
            }
        );
        assert!(refused, "{v}");
        // Both crossing dials wait: nobody moves.
        let v = violation(Rule::BothWait, wanted_by_all());
        assert!(matches!(v, Violation::Stuck { .. }), "{v}");
    }

    #[test]
    fn a_fault_in_the_acceptor_is_found() {
        // The acceptor forgets to mark its link ready on accept: a later dial of its own makes
        // a second connection.
        let f = Faulty {
            model: Dials::new(wanted_by_all()),
            fault: |before, t, after| {
                if t >= 3 && after.answers.len() > before.answers.len() {
                    let me = t - 3;
                    for p in 0..3 {
                        if before.link[me][p] == Link::Idle && after.link[me][p] == Link::Ready {
                            after.link[me][p] = Link::Idle;
                        }
                    }
                }
            },
        };
        assert!(explore(f, 1_000_000).is_err());
    }

    #[test]
    fn answers_round_trip_through_their_byte() {
        for a in [Answer::Accept, Answer::Defer, Answer::Mismatch] {
            assert_eq!(Answer::from_byte(a as u8), Some(a));
        }
        assert_eq!(Answer::from_byte(9), None);
    }
}
