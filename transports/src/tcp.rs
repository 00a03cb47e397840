//! Transport between hosts: TCP streams (IPv4 or IPv6) through socket2.
//!
//! Sockets use `TCP_NODELAY`, ask for 4 MiB send/receive buffers (a refusal is not an error) and
//! are non-blocking once connected. [`TcpConnection::try_recv`] reads into an 8-byte-aligned
//! staging buffer and lends from it; [`Connection::try_recv_into`] drains the staging buffer and
//! then reads straight into the destination.
//!
//! Every connection starts with a handshake frame in each direction:
//!
//! ```text
//! b"WEFT" | version u16 LE | token length u8 (<= 64) | token | rank u32 LE | namespace hash u64 LE
//! ```
//!
//! The accepting side checks magic, version, token and namespace before replying with its own
//! frame; anything else is logged with `tracing::warn!` and closed, and the listener goes on
//! serving the legitimate peers. Handshake reads time out, and each accepted connection is
//! handshaken on its own thread, so a silent connector cannot stall setup.
//!
//! Interface selection ([`select_interface`]) follows the syntax of `NCCL_SOCKET_IFNAME` for
//! `WEFT_SOCKET_IFNAME`: `eth,ib` (name prefixes), `^docker,lo` (excluded prefixes), `=eth0`
//! (exact names), `^=eth0` (excluded exact names). Unset, any up interface except loopback and
//! `docker*` is eligible, **`veth*` included** (in containers and network namespaces a veth end
//! is the "host NIC"; the host-side ends of Docker's veths carry no address, so they are never
//! picked). Loopback is the fallback when nothing else qualifies. IPv4 is preferred over IPv6
//! unless `WEFT_SOCKET_FAMILY` (`AF_INET` / `AF_INET6`) says otherwise; IPv6 link-local addresses
//! are skipped (they would need a scope id).

use crate::conn::{Connection, IdleWaiter, Interest};
use crate::error::{Result, TransportError};
pub use crate::socket::SOCKET_BUFFER_BYTES;
use crate::socket::{accept_within, configure_stream, dial_socket, listen};
use crate::tcp_stripes::{open_stripes, EngineSignal, Side, StripePlan, StripedTcp};
use crate::util::{fnv1a64, AlignedBuf, Deadline};
use nix::sys::eventfd::EventFd;
use socket2::Socket;
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Magic bytes opening every TCP handshake frame.
pub const HANDSHAKE_MAGIC: [u8; 4] = *b"WEFT";
/// Version of the TCP handshake.
pub const HANDSHAKE_VERSION: u16 = 2;
/// Longest job token carried by the handshake.
pub const MAX_TOKEN_LEN: usize = 64;
/// Size of the receive staging buffer.
pub const STAGING_BYTES: usize = 1 << 21;
/// Longest time one incoming connection may take to present its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_INFLIGHT_HANDSHAKES: usize = 64;
const REFILL_BELOW: usize = 64 << 10;

// ---------------------------------------------------------------------------------------------
// Interface selection
// ---------------------------------------------------------------------------------------------

/// An address family for [`select_interface`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// IPv4 (`AF_INET`).
    Inet,
    /// IPv6 (`AF_INET6`).
    Inet6,
}

impl Family {
    /// Parses `AF_INET`/`AF_INET6` (also `inet`, `inet6`, `ipv4`, `ipv6`, `4`, `6`).
    pub fn parse(text: &str) -> Result<Family> {
        match text.trim().to_ascii_lowercase().as_str() {
            "af_inet" | "inet" | "ipv4" | "4" => Ok(Family::Inet),
            "af_inet6" | "inet6" | "ipv6" | "6" => Ok(Family::Inet6),
            other => Err(TransportError::Config(format!(
                "WEFT_SOCKET_FAMILY={other:?}: expected AF_INET or AF_INET6"
            ))),
        }
    }

    /// The family requested by `WEFT_SOCKET_FAMILY`, if set.
    pub fn from_env() -> Result<Option<Family>> {
        weftcc_settings::SOCKET_FAMILY
            .value()
            .map(|v| Family::parse(&v))
            .transpose()
    }

    fn of(addr: &IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::Inet,
            IpAddr::V6(_) => Family::Inet6,
        }
    }
}

/// One address of one network interface, as [`choose_interface`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Interface name (`eth0`).
    pub name: String,
    /// One of its addresses.
    pub addr: IpAddr,
    /// `IFF_UP` is set.
    pub up: bool,
    /// `IFF_LOOPBACK` is set.
    pub loopback: bool,
}

/// A parsed `WEFT_SOCKET_IFNAME` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfnameSpec {
    /// `^`: the names are excluded rather than selected.
    pub exclude: bool,
    /// `=`: names must match exactly rather than as prefixes.
    pub exact: bool,
    /// The comma-separated names (empty items dropped).
    pub names: Vec<String>,
}

impl IfnameSpec {
    /// Parses `eth,ib`, `^docker,lo`, `=eth0` or `^=eth0`.
    pub fn parse(text: &str) -> IfnameSpec {
        let list = crate::util::NcclList::parse(text);
        IfnameSpec {
            exclude: list.exclude,
            exact: list.exact,
            names: list.items.into_iter().map(str::to_string).collect(),
        }
    }

    /// Whether an interface called `name` is allowed by this spec.
    pub fn matches(&self, name: &str) -> bool {
        let hit = self
            .names
            .iter()
            .any(|n| crate::util::NcclList::name_matches(self.exact, n, name));
        hit != self.exclude
    }
}

fn usable_addr(addr: &IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => !a.is_unspecified() && !a.is_multicast() && !a.is_broadcast(),
        IpAddr::V6(a) => {
            !a.is_unspecified() && !a.is_multicast() && (a.segments()[0] & 0xffc0) != 0xfe80
        }
    }
}

/// Picks the interface address to use (pure function over a list, see the module docs for the
/// rules). `None` when nothing matches.
pub fn choose_interface(
    spec: Option<&str>,
    family: Option<Family>,
    ifaces: &[Interface],
) -> Option<Interface> {
    let spec = spec.map(IfnameSpec::parse);
    let mut candidates: Vec<(usize, &Interface)> = ifaces
        .iter()
        .enumerate()
        .filter(|(_, i)| i.up && usable_addr(&i.addr))
        .filter(|(_, i)| family.is_none_or(|f| Family::of(&i.addr) == f))
        .filter(|(_, i)| match &spec {
            Some(s) => s.matches(&i.name),
            None => !i.loopback && !i.name.starts_with("docker"),
        })
        .collect();
    if candidates.is_empty() && spec.is_none() {
        candidates = ifaces
            .iter()
            .enumerate()
            .filter(|(_, i)| i.up && i.loopback && usable_addr(&i.addr))
            .filter(|(_, i)| family.is_none_or(|f| Family::of(&i.addr) == f))
            .collect();
    }
    // Non-loopback first, then IPv4 before IPv6, then the system's order.
    candidates.sort_by_key(|(idx, i)| (i.loopback, Family::of(&i.addr) == Family::Inet6, *idx));
    candidates.first().map(|(_, i)| (*i).clone())
}

/// The system's interface addresses (via `getifaddrs`).
pub fn list_interfaces() -> Result<Vec<Interface>> {
    use nix::net::if_::InterfaceFlags;
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| TransportError::Io {
        what: "getifaddrs".into(),
        message: e.to_string(),
    })?;
    let mut out = Vec::new();
    for ifa in addrs {
        let Some(storage) = ifa.address else { continue };
        let addr = if let Some(v4) = storage.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = storage.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        out.push(Interface {
            name: ifa.interface_name.clone(),
            addr,
            up: ifa.flags.contains(InterfaceFlags::IFF_UP),
            loopback: ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK),
        });
    }
    Ok(out)
}

/// Chooses the interface and address to listen on: `spec` has the syntax of
/// `WEFT_SOCKET_IFNAME`, `family` restricts the address family (see the module docs).
pub fn select_interface(spec: Option<&str>, family: Option<Family>) -> Result<Interface> {
    let ifaces = list_interfaces()?;
    match choose_interface(spec, family, &ifaces) {
        Some(i) => {
            tracing::info!(target: "weftcc::net", interface = %i.name, addr = %i.addr, "selected network interface");
            Ok(i)
        }
        None => {
            let have: Vec<String> = ifaces
                .iter()
                .map(|i| format!("{}={}", i.name, i.addr))
                .collect();
            Err(TransportError::Config(format!(
                "no network interface matches WEFT_SOCKET_IFNAME={:?} family={:?}; available: {}",
                spec.unwrap_or(""),
                family,
                have.join(", ")
            )))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------------

/// What a peer says about itself in its handshake frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The job token.
    pub token: Vec<u8>,
    /// The sender's rank.
    pub rank: u32,
    /// Hash of the communicator namespace.
    pub namespace_hash: u64,
}

impl Hello {
    /// Checks that a reply to this rank's handshake comes from `peer` of the same job `token`
    /// and communicator.
    pub fn check_reply(&self, token: &str, namespace_hash: u64, peer: usize) -> Result<()> {
        if self.token != token.as_bytes() || self.namespace_hash != namespace_hash {
            return Err(TransportError::Protocol(format!(
                "rank {peer} answered with a different job token or communicator"
            )));
        }
        if self.rank as usize != peer {
            return Err(TransportError::Protocol(format!(
                "dialed rank {peer}, rank {} answered",
                self.rank
            )));
        }
        Ok(())
    }
}

/// The communicator hash carried in handshakes for `namespace`.
pub fn namespace_hash(namespace: &str) -> u64 {
    fnv1a64(namespace.as_bytes())
}

/// Encodes a handshake frame (the token must be at most [`MAX_TOKEN_LEN`] bytes).
pub fn encode_hello(token: &str, rank: u32, namespace_hash: u64) -> Result<Vec<u8>> {
    let tok = token.as_bytes();
    if tok.len() > MAX_TOKEN_LEN {
        return Err(TransportError::Config(format!(
            "job token is {} bytes; at most {MAX_TOKEN_LEN} are supported",
            tok.len()
        )));
    }
    let mut v = Vec::with_capacity(4 + 2 + 1 + tok.len() + 12);
    v.extend_from_slice(&HANDSHAKE_MAGIC);
    v.extend_from_slice(&HANDSHAKE_VERSION.to_le_bytes());
    v.push(tok.len() as u8);
    v.extend_from_slice(tok);
    v.extend_from_slice(&rank.to_le_bytes());
    v.extend_from_slice(&namespace_hash.to_le_bytes());
    Ok(v)
}

fn read_exact_or(r: &mut impl Read, buf: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => TransportError::Timeout {
            what: what.to_string(),
            after: HANDSHAKE_TIMEOUT,
        },
        ErrorKind::UnexpectedEof => {
            TransportError::Protocol(format!("{what}: connection closed early"))
        }
        _ => TransportError::io(what, e),
    })
}

/// Reads and structurally validates one handshake frame (magic, version, token length).
pub fn read_hello(r: &mut impl Read) -> Result<Hello> {
    let mut fixed = [0u8; 7];
    read_exact_or(r, &mut fixed, "reading handshake")?;
    if fixed[..4] != HANDSHAKE_MAGIC {
        return Err(TransportError::Protocol("bad handshake magic".into()));
    }
    let version = u16::from_le_bytes([fixed[4], fixed[5]]);
    if version != HANDSHAKE_VERSION {
        return Err(TransportError::Protocol(format!(
            "handshake version {version}, expected {HANDSHAKE_VERSION}"
        )));
    }
    let tlen = fixed[6] as usize;
    if tlen > MAX_TOKEN_LEN {
        return Err(TransportError::Protocol("handshake token too long".into()));
    }
    let mut rest = [0u8; MAX_TOKEN_LEN + 12];
    read_exact_or(r, &mut rest[..tlen + 12], "reading handshake")?;
    let token = rest[..tlen].to_vec();
    let mut rank = [0u8; 4];
    rank.copy_from_slice(&rest[tlen..tlen + 4]);
    let mut ns = [0u8; 8];
    ns.copy_from_slice(&rest[tlen + 4..tlen + 12]);
    Ok(Hello {
        token,
        rank: u32::from_le_bytes(rank),
        namespace_hash: u64::from_le_bytes(ns),
    })
}

// ---------------------------------------------------------------------------------------------
// Connection
// ---------------------------------------------------------------------------------------------

/// A TCP connection to one peer (see the module docs): one socket driven by the caller's
/// thread, or several sockets driven by helper threads ([`crate::tcp_stripes`]).
pub struct TcpConnection {
    io: TcpIo,
}

enum TcpIo {
    Single(SingleSocket),
    Striped(StripedTcp),
}

/// One socket, read and written by the caller's thread.
struct SingleSocket {
    peer: usize,
    sock: Arc<Socket>,
    stage: AlignedBuf,
    start: usize,
    end: usize,
    /// Stream position of the byte at `start` (`start % 8 == rx_pos % 8` while data is staged).
    rx_pos: u64,
    eof: bool,
    failed: Option<String>,
}

/// A shareable handle on what a connection's idle waiter polls, for [`TcpWaiter`].
#[derive(Clone)]
pub struct TcpPollHandle {
    peer: usize,
    source: PollSource,
}

/// A single socket is polled itself; a striped connection's helpers write an eventfd.
#[derive(Clone)]
enum PollSource {
    Socket(Arc<Socket>),
    Doorbell(Arc<EngineSignal>),
}

impl TcpPollHandle {
    /// The same source, for a communicator that numbers the peer `peer`.
    pub fn for_peer(&self, peer: usize) -> TcpPollHandle {
        TcpPollHandle {
            peer,
            source: self.source.clone(),
        }
    }
}

impl TcpConnection {
    /// Wraps an already handshaken stream to `peer`; makes it non-blocking.
    pub fn from_socket(peer: usize, sock: Socket) -> Result<TcpConnection> {
        Ok(TcpConnection {
            io: TcpIo::Single(SingleSocket::new(peer, sock)?),
        })
    }

    /// The connection over `socks` (from [`crate::tcp_stripes::open_stripes`], in stripe
    /// order): one socket without helper `threads` is driven by the caller's thread, anything
    /// else by at least one helper thread.
    pub(crate) fn from_sockets(
        peer: usize,
        (mut socks, stripe): (Vec<Socket>, usize),
        threads: usize,
    ) -> Result<TcpConnection> {
        let io = if socks.len() == 1 && threads == 0 {
            TcpIo::Single(SingleSocket::new(peer, socks.remove(0))?)
        } else {
            TcpIo::Striped(StripedTcp::start(peer, socks, stripe, threads)?)
        };
        Ok(TcpConnection { io })
    }

    /// Sockets and helper threads of this connection (helper threads 0: the caller's thread
    /// drives its one socket).
    pub fn shape(&self) -> (usize, usize) {
        match &self.io {
            TcpIo::Single(_) => (1, 0),
            TcpIo::Striped(s) => (s.sockets(), s.threads()),
        }
    }

    /// A handle for a [`TcpWaiter`] to poll this connection.
    pub fn poll_handle(&self) -> TcpPollHandle {
        match &self.io {
            TcpIo::Single(s) => TcpPollHandle {
                peer: s.peer,
                source: PollSource::Socket(Arc::clone(&s.sock)),
            },
            TcpIo::Striped(s) => TcpPollHandle {
                peer: s.peer(),
                source: PollSource::Doorbell(s.doorbell()),
            },
        }
    }

    /// A waiter covering just this connection.
    pub fn waiter(&self) -> TcpWaiter {
        let mut w = TcpWaiter::new();
        w.add(self.poll_handle());
        w
    }
}

impl Connection for TcpConnection {
    fn peer(&self) -> usize {
        match &self.io {
            TcpIo::Single(s) => s.peer(),
            TcpIo::Striped(s) => s.peer(),
        }
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        match &mut self.io {
            TcpIo::Single(s) => s.try_send(data),
            TcpIo::Striped(s) => s.try_send(data),
        }
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        match &mut self.io {
            TcpIo::Single(s) => s.try_recv(max, consume),
            TcpIo::Striped(s) => s.try_recv(max, consume),
        }
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        match &mut self.io {
            TcpIo::Single(s) => s.try_recv_into(dst),
            TcpIo::Striped(s) => s.try_recv_into(dst),
        }
    }

    fn check_peer(&mut self) -> Result<()> {
        match &mut self.io {
            TcpIo::Single(s) => s.check_peer(),
            TcpIo::Striped(s) => s.check_peer(),
        }
    }
}

impl SingleSocket {
    fn new(peer: usize, sock: Socket) -> Result<SingleSocket> {
        configure_stream(&sock);
        sock.set_nonblocking(true)
            .map_err(|e| TransportError::io("making socket non-blocking", e))?;
        Ok(SingleSocket {
            peer,
            sock: Arc::new(sock),
            stage: AlignedBuf::new(STAGING_BYTES),
            start: 0,
            end: 0,
            rx_pos: 0,
            eof: false,
            failed: None,
        })
    }

    fn lost(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer,
            detail: match &self.failed {
                Some(e) => format!("socket error: {e}"),
                None => "connection closed by peer".into(),
            },
        }
    }

    fn dead(&self) -> bool {
        self.eof || self.failed.is_some()
    }

    fn note_error(&mut self, e: std::io::Error) {
        if self.failed.is_none() {
            self.failed = Some(e.to_string());
        }
    }

    /// One non-blocking read into the staging buffer's free tail.
    fn fill(&mut self) {
        if self.dead() {
            return;
        }
        if self.start == self.end {
            let b = (self.rx_pos % 8) as usize;
            self.start = b;
            self.end = b;
        } else if self.end == self.stage.len() && self.start > 8 {
            let b = self.start % 8;
            let n = self.end - self.start;
            self.stage
                .as_mut_slice()
                .copy_within(self.start..self.end, b);
            self.start = b;
            self.end = b + n;
        }
        if self.end >= self.stage.len() {
            return;
        }
        let end = self.end;
        let res = (&*self.sock).read(&mut self.stage.as_mut_slice()[end..]);
        match res {
            Ok(0) => self.eof = true,
            Ok(n) => self.end += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => self.note_error(e),
        }
    }
}

impl Connection for SingleSocket {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        if self.failed.is_some() {
            return Err(self.lost());
        }
        if data.is_empty() {
            return Ok(0);
        }
        match self.sock.send_with_flags(data, libc::MSG_NOSIGNAL) {
            Ok(n) => Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(0),
            Err(e) => {
                self.note_error(e);
                Err(self.lost())
            }
        }
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        let avail = self.end - self.start;
        if avail == 0 || (max > avail && avail < REFILL_BELOW) {
            self.fill();
        }
        let avail = self.end - self.start;
        if avail == 0 {
            return if self.dead() { Err(self.lost()) } else { Ok(0) };
        }
        if max == 0 {
            return Ok(0);
        }
        let n = avail.min(max);
        let used = consume(&self.stage.as_slice()[self.start..self.start + n]).min(n);
        self.start += used;
        self.rx_pos = self.rx_pos.wrapping_add(used as u64);
        Ok(used)
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        let mut filled = 0usize;
        let staged = self.end - self.start;
        if staged > 0 {
            let n = staged.min(dst.len());
            dst[..n].copy_from_slice(&self.stage.as_slice()[self.start..self.start + n]);
            self.start += n;
            filled = n;
        }
        if filled < dst.len() && !self.dead() {
            match (&*self.sock).read(&mut dst[filled..]) {
                Ok(0) => self.eof = true,
                Ok(n) => filled += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => self.note_error(e),
            }
        }
        self.rx_pos = self.rx_pos.wrapping_add(filled as u64);
        if filled == 0 && !dst.is_empty() && self.dead() {
            return Err(self.lost());
        }
        Ok(filled)
    }

    fn check_peer(&mut self) -> Result<()> {
        if self.start != self.end {
            return Ok(());
        }
        if !self.dead() {
            let mut b = [MaybeUninit::<u8>::uninit(); 1];
            match self.sock.peek(&mut b) {
                Ok(0) => self.eof = true,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => self.note_error(e),
            }
        }
        if self.dead() {
            return Err(self.lost());
        }
        Ok(())
    }
}

/// [`IdleWaiter`] for TCP connections: `poll()` on their sockets (`POLLIN` for receive interest,
/// `POLLOUT` for send interest). With an empty interest list it waits for input on all sockets.
#[derive(Default)]
pub struct TcpWaiter {
    socks: HashMap<usize, PollSource>,
}

impl TcpWaiter {
    /// A waiter with no sockets.
    pub fn new() -> TcpWaiter {
        TcpWaiter::default()
    }

    /// Adds a connection's socket.
    pub fn add(&mut self, handle: TcpPollHandle) {
        self.socks.insert(handle.peer, handle.source);
    }

    /// Whether this waiter has no sockets.
    pub fn is_empty(&self) -> bool {
        self.socks.is_empty()
    }

    /// Whether `peer` has a socket in this waiter.
    pub fn has_peer(&self, peer: usize) -> bool {
        self.socks.contains_key(&peer)
    }

    /// Polls the connections named by `interest` (peers without one here are ignored) for at
    /// most `max` (microsecond precision); returns whether any became ready.
    pub fn poll_for(&self, interest: &[Interest], max: Duration) -> Result<bool> {
        use nix::poll::{PollFd, PollFlags};
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(interest.len().max(self.socks.len()));
        // The doorbells polled, in `fds` order, to be read empty once they rang.
        let mut bells: Vec<(usize, &EventFd)> = Vec::new();
        let wanted: Vec<(&PollSource, bool, bool)> = if interest.is_empty() {
            self.socks.values().map(|s| (s, true, false)).collect()
        } else {
            interest
                .iter()
                .filter_map(|i| self.socks.get(&i.peer).map(|s| (s, i.recv, i.send)))
                .collect()
        };
        // A striped connection with unread pieces or free buffers needs no sleep; else its
        // helpers are told that this waiter sleeps (they then write its eventfd).
        let _sleeping = EngineSignal::sleep_on(
            wanted
                .iter()
                .filter_map(|(s, _, _)| match s {
                    PollSource::Doorbell(b) => Some(&**b),
                    PollSource::Socket(_) => None,
                })
                .collect(),
        );
        if wanted
            .iter()
            .any(|(s, recv, send)| matches!(s, PollSource::Doorbell(b) if b.ready(*recv, *send)))
        {
            return Ok(true);
        }
        for (source, recv, send) in wanted {
            match source {
                PollSource::Socket(s) => {
                    let mut ev = PollFlags::empty();
                    if recv {
                        ev |= PollFlags::POLLIN;
                    }
                    if send {
                        ev |= PollFlags::POLLOUT;
                    }
                    fds.push(PollFd::new(s.as_fd(), ev));
                }
                PollSource::Doorbell(b) => {
                    // Rung for bytes in and for room out alike.
                    bells.push((fds.len(), b.fd()));
                    fds.push(PollFd::new(b.fd().as_fd(), PollFlags::POLLIN));
                }
            }
        }
        let ts = nix::sys::time::TimeSpec::from_duration(max.min(Duration::from_secs(86_400)));
        let polled = nix::poll::ppoll(&mut fds, Some(ts), None);
        for (i, bell) in bells {
            if fds[i].revents().is_some_and(|r| !r.is_empty()) {
                let _ = bell.read();
            }
        }
        match polled {
            Ok(n) => Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => Ok(true),
            Err(e) => Err(TransportError::Io {
                what: "poll".into(),
                message: e.to_string(),
            }),
        }
    }
}

impl IdleWaiter for TcpWaiter {
    fn wait(&mut self, interest: &[Interest], max: Duration) -> Result<()> {
        self.poll_for(interest, max).map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------------
// Establishment
// ---------------------------------------------------------------------------------------------

/// A listening endpoint of one rank plus the identity it presents in handshakes.
pub struct TcpEndpoint {
    listener: Socket,
    local: SocketAddr,
    rank: usize,
    token: String,
    namespace_hash: u64,
}

impl TcpEndpoint {
    /// Listens on `addr` with an ephemeral port, as `rank` of the job `token` in communicator
    /// `namespace`.
    pub fn bind(addr: IpAddr, rank: usize, token: &str, namespace: &str) -> Result<TcpEndpoint> {
        Self::bind_addr(SocketAddr::new(addr, 0), rank, token, namespace)
    }

    /// Like [`TcpEndpoint::bind`] with an explicit port.
    pub fn bind_addr(
        addr: SocketAddr,
        rank: usize,
        token: &str,
        namespace: &str,
    ) -> Result<TcpEndpoint> {
        encode_hello(token, 0, 0)?; // validates the token length
        if rank > u32::MAX as usize {
            return Err(TransportError::Config(format!("rank {rank} too large")));
        }
        let (sock, local) = listen(addr, Some(SOCKET_BUFFER_BYTES), "listener")?;
        Ok(TcpEndpoint {
            listener: sock,
            local,
            rank,
            token: token.to_string(),
            namespace_hash: namespace_hash(namespace),
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The listening socket (non-blocking).
    pub(crate) fn listener(&self) -> &Socket {
        &self.listener
    }

    /// Accepts connections until one from each rank in `expected` completed its handshake.
    /// Connections with a wrong handshake, an unexpected or duplicate rank are logged and closed.
    pub fn accept_peers(
        &self,
        expected: &[usize],
        timeout: Duration,
    ) -> Result<Vec<TcpConnection>> {
        self.accept_peers_until(expected, timeout, None)
    }

    /// Like [`TcpEndpoint::accept_peers`], but gives up with [`TransportError::Aborted`] as soon
    /// as `cancel` becomes true (checked every few milliseconds).
    pub fn accept_peers_until(
        &self,
        expected: &[usize],
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Result<Vec<TcpConnection>> {
        let deadline = Deadline::after(timeout);
        let (tx, rx) = mpsc::channel::<(u32, Socket)>();
        let inflight = Arc::new(AtomicUsize::new(0));
        let mut got: HashMap<usize, TcpConnection> = HashMap::new();
        while got.len() < expected.len() {
            while let Ok((rank, sock)) = rx.try_recv() {
                let rank = rank as usize;
                if expected.contains(&rank) && !got.contains_key(&rank) {
                    got.insert(rank, TcpConnection::from_socket(rank, sock)?);
                } else {
                    tracing::warn!(target: "weftcc::net", rank, "closing unexpected or duplicate TCP connection");
                }
            }
            if got.len() == expected.len() {
                break;
            }
            if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
                return Err(TransportError::Aborted);
            }
            if deadline.expired() {
                let missing: Vec<usize> = expected
                    .iter()
                    .copied()
                    .filter(|r| !got.contains_key(r))
                    .collect();
                return Err(deadline.timeout_error(format!(
                    "rank {} waiting for TCP connections from ranks {missing:?}",
                    self.rank
                )));
            }
            if inflight.load(Ordering::Acquire) >= MAX_INFLIGHT_HANDSHAKES {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let wait_ms = deadline
                .remaining()
                .min(Duration::from_millis(10))
                .as_millis() as u16;
            let Some((sock, from)) = accept_within(&self.listener, wait_ms.max(1), "listener")
            else {
                continue;
            };
            let tx = tx.clone();
            let token = self.token.clone();
            let ns = self.namespace_hash;
            let me = self.rank as u32;
            let hs_timeout = deadline
                .remaining()
                .min(HANDSHAKE_TIMEOUT)
                .max(Duration::from_millis(100));
            inflight.fetch_add(1, Ordering::AcqRel);
            let counter = inflight.clone();
            let spawned = std::thread::Builder::new()
                .name("weft-tcp-handshake".into())
                .spawn(move || {
                    match accept_handshake(sock, &token, ns, me, hs_timeout) {
                        Ok((rank, sock)) => {
                            let _ = tx.send((rank, sock));
                        }
                        Err(e) => {
                            tracing::warn!(target: "weftcc::net", from = %from, error = %e, "refused TCP connection")
                        }
                    }
                    counter.fetch_sub(1, Ordering::AcqRel);
                });
            if let Err(e) = spawned {
                inflight.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(target: "weftcc::net", error = %e, "could not start a handshake thread; connection dropped");
            }
        }
        let mut out: Vec<TcpConnection> = got.into_values().collect();
        out.sort_by_key(|c| c.peer());
        Ok(out)
    }

    /// Connects to `peer` listening at `addr` (retrying while it is not up yet) and handshakes.
    pub fn connect_peer(
        &self,
        peer: usize,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<TcpConnection> {
        let deadline = Deadline::after(timeout);
        let sock = dial_socket(peer, addr, &deadline)?;
        let hs = deadline
            .remaining()
            .min(HANDSHAKE_TIMEOUT)
            .max(Duration::from_millis(100));
        sock.set_read_timeout(Some(hs))
            .map_err(|e| TransportError::io("set_read_timeout", e))?;
        sock.set_write_timeout(Some(hs))
            .map_err(|e| TransportError::io("set_write_timeout", e))?;
        let hello = encode_hello(&self.token, self.rank as u32, self.namespace_hash)?;
        (&sock)
            .write_all(&hello)
            .map_err(|e| TransportError::io(format!("sending handshake to rank {peer}"), e))?;
        read_hello(&mut &sock)?.check_reply(&self.token, self.namespace_hash, peer)?;
        sock.set_read_timeout(None)
            .map_err(|e| TransportError::io("set_read_timeout", e))?;
        sock.set_write_timeout(None)
            .map_err(|e| TransportError::io("set_write_timeout", e))?;
        TcpConnection::from_socket(peer, sock)
    }
}

fn accept_handshake(
    sock: Socket,
    token: &str,
    ns: u64,
    me: u32,
    timeout: Duration,
) -> Result<(u32, Socket)> {
    sock.set_nonblocking(false)
        .map_err(|e| TransportError::io("set_nonblocking", e))?;
    sock.set_read_timeout(Some(timeout))
        .map_err(|e| TransportError::io("set_read_timeout", e))?;
    sock.set_write_timeout(Some(timeout))
        .map_err(|e| TransportError::io("set_write_timeout", e))?;
    let hello = read_hello(&mut &sock)?;
    if hello.token != token.as_bytes() {
        return Err(TransportError::Protocol(format!(
            "wrong job token from claimed rank {}",
            hello.rank
        )));
    }
    if hello.namespace_hash != ns {
        return Err(TransportError::Protocol(format!(
            "claimed rank {} belongs to another communicator",
            hello.rank
        )));
    }
    let reply = encode_hello(token, me, ns)?;
    (&sock)
        .write_all(&reply)
        .map_err(|e| TransportError::io("sending handshake reply", e))?;
    sock.set_read_timeout(None)
        .map_err(|e| TransportError::io("set_read_timeout", e))?;
    sock.set_write_timeout(None)
        .map_err(|e| TransportError::io("set_write_timeout", e))?;
    Ok((hello.rank, sock))
}

/// Two connected TCP ends inside this process over `addr` (for example 127.0.0.1 or ::1), for
/// tests and benchmarks. The lower rank connects, as in a mesh.
pub fn local_pair(
    rank_a: usize,
    rank_b: usize,
    addr: IpAddr,
) -> Result<(TcpConnection, TcpConnection)> {
    let token = crate::util::random_hex(8)?;
    let (lo, hi) = (rank_a.min(rank_b), rank_a.max(rank_b));
    let ep_lo = TcpEndpoint::bind(addr, lo, &token, "local_pair")?;
    let ep_hi = TcpEndpoint::bind(addr, hi, &token, "local_pair")?;
    let hi_addr = ep_hi.local_addr();
    let timeout = Duration::from_secs(10);
    let (c_lo, c_hi) = std::thread::scope(|s| {
        let h = s.spawn(|| ep_hi.accept_peers(&[lo], timeout));
        let c_lo = ep_lo.connect_peer(hi, hi_addr, timeout);
        let c_hi = h.join().unwrap_or_else(|_| {
            Err(TransportError::Io {
                what: "accept thread".into(),
                message: "panicked".into(),
            })
        });
        (c_lo, c_hi)
    });
    let c_lo = c_lo?;
    let c_hi = c_hi?
        .pop()
        .ok_or_else(|| TransportError::Protocol("no connection accepted".into()))?;
    if rank_a <= rank_b {
        Ok((c_lo, c_hi))
    } else {
        Ok((c_hi, c_lo))
    }
}

/// Two connected TCP ends inside this process over `addr`, with the sockets and helper
/// threads of `plan` (the stripe exchange included), for tests and benchmarks. The first end
/// dialed (its peer is `rank_b`), the second accepted (its peer is `rank_a`).
pub fn local_pair_striped(
    rank_a: usize,
    rank_b: usize,
    addr: IpAddr,
    plan: StripePlan,
) -> Result<(TcpConnection, TcpConnection)> {
    let (listener, at) = listen(
        SocketAddr::new(addr, 0),
        Some(SOCKET_BUFFER_BYTES),
        "test listener",
    )?;
    let timeout = Duration::from_secs(10);
    let deadline = Deadline::after(timeout);
    std::thread::scope(|s| {
        let dialer = s.spawn(|| -> Result<TcpConnection> {
            let sock = dial_socket(rank_b, at, &deadline)?;
            let socks = open_stripes(rank_b, sock, Side::Dialer, plan, &deadline)?;
            TcpConnection::from_sockets(rank_b, socks, plan.threads)
        });
        let accepted = (|| -> Result<TcpConnection> {
            let sock = loop {
                if let Some((sock, _)) = accept_within(&listener, 50, "test listener") {
                    break sock;
                }
                if deadline.expired() {
                    return Err(deadline.timeout_error("accepting the test pair"));
                }
            };
            sock.set_nonblocking(false)
                .map_err(|e| TransportError::io("set_nonblocking", e))?;
            let socks = open_stripes(rank_a, sock, Side::Acceptor, plan, &deadline)?;
            TcpConnection::from_sockets(rank_a, socks, plan.threads)
        })();
        let dialed = dialer.join().unwrap_or_else(|_| {
            Err(TransportError::Io {
                what: "dial thread".into(),
                message: "panicked".into(),
            })
        });
        Ok((dialed?, accepted?))
    })
}

/// The loopback address of a family.
pub fn loopback(family: Family) -> IpAddr {
    match family {
        Family::Inet => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Family::Inet6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifc(name: &str, addr: &str, loopback: bool) -> Interface {
        Interface {
            name: name.into(),
            addr: addr.parse().unwrap(),
            up: true,
            loopback,
        }
    }

    fn sample() -> Vec<Interface> {
        vec![
            ifc("lo", "127.0.0.1", true),
            ifc("lo", "::1", true),
            ifc("docker0", "172.17.0.1", false),
            ifc("eth0", "fe80::1", false),
            ifc("eth0", "2001:db8::5", false),
            ifc("eth0", "10.0.0.5", false),
            ifc("ib0", "192.168.1.5", false),
            ifc("veth1", "10.9.0.2", false),
            ifc("eth10", "10.0.1.5", false),
        ]
    }

    fn pick(spec: Option<&str>, fam: Option<Family>, l: &[Interface]) -> Option<String> {
        choose_interface(spec, fam, l).map(|i| format!("{}={}", i.name, i.addr))
    }

    #[test]
    fn parse_spec() {
        assert_eq!(
            IfnameSpec::parse("^=eth0, ib"),
            IfnameSpec {
                exclude: true,
                exact: true,
                names: vec!["eth0".into(), "ib".into()]
            }
        );
        let s = IfnameSpec::parse("eth,ib");
        assert!(s.matches("eth10") && s.matches("ib0") && !s.matches("lo"));
        let s = IfnameSpec::parse("^docker,lo");
        assert!(!s.matches("docker0") && !s.matches("lo") && s.matches("eth0"));
        let s = IfnameSpec::parse("=eth0");
        assert!(s.matches("eth0") && !s.matches("eth10"));
        let s = IfnameSpec::parse("^=eth0");
        assert!(!s.matches("eth0") && s.matches("eth10"));
    }

    #[test]
    fn default_policy() {
        let l = sample();
        assert_eq!(pick(None, None, &l).unwrap(), "eth0=10.0.0.5");
        assert_eq!(
            pick(None, Some(Family::Inet6), &l).unwrap(),
            "eth0=2001:db8::5"
        );
        // Only loopback and docker: loopback is the fallback.
        let l2 = vec![
            ifc("lo", "127.0.0.1", true),
            ifc("docker0", "172.17.0.1", false),
        ];
        assert_eq!(pick(None, None, &l2).unwrap(), "lo=127.0.0.1");
        // veth is selectable by default and when named.
        let l3 = vec![
            ifc("lo", "127.0.0.1", true),
            ifc("veth1", "10.9.0.2", false),
        ];
        assert_eq!(pick(None, None, &l3).unwrap(), "veth1=10.9.0.2");
        // Down interfaces are skipped.
        let mut l4 = l3.clone();
        l4[1].up = false;
        assert_eq!(pick(None, None, &l4).unwrap(), "lo=127.0.0.1");
    }

    #[test]
    fn explicit_specs() {
        let l = sample();
        assert_eq!(pick(Some("ib"), None, &l).unwrap(), "ib0=192.168.1.5");
        assert_eq!(pick(Some("=eth10"), None, &l).unwrap(), "eth10=10.0.1.5");
        assert_eq!(pick(Some("=veth1"), None, &l).unwrap(), "veth1=10.9.0.2");
        assert_eq!(
            pick(Some("^eth,lo,docker"), None, &l).unwrap(),
            "ib0=192.168.1.5"
        );
        assert_eq!(pick(Some("=lo"), None, &l).unwrap(), "lo=127.0.0.1");
        assert_eq!(
            pick(Some("=lo"), Some(Family::Inet6), &l).unwrap(),
            "lo=::1"
        );
        assert!(pick(Some("=eth"), None, &l).is_none());
        assert!(pick(Some("ib"), Some(Family::Inet6), &l).is_none());
        // Exclusion lists still prefer non-loopback interfaces.
        assert_eq!(pick(Some("^docker"), None, &l).unwrap(), "eth0=10.0.0.5");
    }

    #[test]
    fn family_parse() {
        assert_eq!(Family::parse("AF_INET").unwrap(), Family::Inet);
        assert_eq!(Family::parse("af_inet6").unwrap(), Family::Inet6);
        assert!(Family::parse("AF_UNIX").is_err());
    }

    #[test]
    fn hello_roundtrip_and_garbage() {
        let f = encode_hello("tok", 7, 99).unwrap();
        let h = read_hello(&mut &f[..]).unwrap();
        assert_eq!(h.token, b"tok");
        assert_eq!((h.rank, h.namespace_hash), (7, 99));
        assert!(read_hello(&mut &b"XXXXXXXXXXXXXXXXXXXXXXXXX"[..]).is_err());
        assert!(read_hello(&mut &f[..f.len() - 1]).is_err());
        let mut bad = f.clone();
        bad[6] = 200;
        assert!(read_hello(&mut &bad[..]).is_err());
        assert!(encode_hello(&"x".repeat(65), 0, 0).is_err());
    }

    #[test]
    fn real_interfaces_resolve() {
        // Whatever this machine has, the default policy must find something (loopback at least).
        assert!(select_interface(None, None).is_ok());
    }
}
