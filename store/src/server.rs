//! The server: one thread runs an event loop (epoll) over the listener and every connection.
//! A request whose keys are not set yet becomes a pending answer of its connection, indexed by
//! the first key it still misses and by its deadline; setting that key or the deadline passing
//! answers it. Threads: one, whatever the number of clients.

use crate::error::{Result, StoreError};
use crate::wire::*;
use crate::{MAX_CONNECTIONS, MAX_FRAME, MAX_SESSIONS, MAX_STORE_TOKEN, STORE_IO_TIMEOUT};
use crate::{STORE_MAGIC, STORE_VERSION};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use socket2::Socket;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weftcc_base::lock;

/// Epoll data of the listener and of the wake-up eventfd; connections use their ids (from 2).
const LISTENER: u64 = 0;
const WAKE: u64 = 1;
/// Longest the loop sleeps while a connection has a handshake or frame half-arrived (their
/// [`STORE_IO_TIMEOUT`] is checked on each turn).
const PARTIAL_TICK: Duration = Duration::from_millis(250);
/// How long accepting pauses when the process is out of file descriptors.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// Bytes read from a socket per call.
const READ_CHUNK: usize = 64 << 10;

/// A named connection, as the server sees it.
struct Session {
    value: Vec<u8>,
    /// The connection that holds the name (a later NAME of the same key by another connection
    /// takes it over).
    conn: u64,
    open: bool,
    /// The last request on the connection, or when it closed.
    last: Instant,
}

/// What [`StoreServer::on_session_closed`] runs: the session's name and value, and the store's
/// data to act on at once (on the server's thread: keep it short).
pub type SessionHook = dyn Fn(&str, &[u8], &mut LocalStore<'_>) + Send + Sync;

/// The store's data as a [`SessionHook`] sees it.
pub struct LocalStore<'a> {
    map: &'a mut HashMap<Vec<u8>, Vec<u8>>,
    /// Keys the hook set: their waiters are woken after it returns.
    touched: &'a mut Vec<Vec<u8>>,
}

impl LocalStore<'_> {
    /// Whether `key` is set.
    pub fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key.as_bytes())
    }

    /// [`StoreClient::set`](crate::StoreClient::set).
    pub fn set(&mut self, key: &str, value: &[u8]) {
        self.map.insert(key.as_bytes().to_vec(), value.to_vec());
        self.touched.push(key.as_bytes().to_vec());
    }

    /// [`StoreClient::add`](crate::StoreClient::add); a value that is not a counter is left alone
    /// (and `None` returned).
    pub fn add(&mut self, key: &str, delta: i64) -> Option<i64> {
        let new = add_counter(self.map, key.as_bytes(), delta)?;
        self.touched.push(key.as_bytes().to_vec());
        Some(new)
    }
}

/// Adds `delta` to the counter `key` of `map` (missing counts as 0) and returns the new value;
/// a value that is not a decimal integer is left alone (`None`). The one rule for ADD, whether a
/// client asks or a session hook does.
fn add_counter(map: &mut HashMap<Vec<u8>, Vec<u8>>, key: &[u8], delta: i64) -> Option<i64> {
    let old = match map.get(key) {
        None => 0,
        Some(v) => std::str::from_utf8(v).ok()?.trim().parse::<i64>().ok()?,
    };
    let new = old.wrapping_add(delta);
    map.insert(key.to_vec(), new.to_string().into_bytes());
    Some(new)
}

/// What the server's owner and its loop thread share.
struct Shared {
    shutdown: AtomicBool,
    wake: EventFd,
    /// Called when a named session's connection closes ([`StoreServer::on_session_closed`]).
    on_closed: Mutex<Option<Arc<SessionHook>>>,
    /// Open connections (for [`StoreServer::connections`]).
    open: AtomicUsize,
    /// What [`StoreServer::traffic`] reports.
    traffic: Mutex<Traffic>,
}

/// What a store has served so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes written to clients.
    pub sent: u64,
    /// Bytes read from clients.
    pub received: u64,
    /// Requests answered or pending.
    pub requests: u64,
    /// Most connections open at once.
    pub peak_connections: usize,
}

/// The bootstrap key-value store server: one thread, an event loop over every connection.
pub struct StoreServer {
    shared: Arc<Shared>,
    local: SocketAddr,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl StoreServer {
    /// Binds `bind` (port 0 for an ephemeral port) and starts serving clients that present
    /// `token`.
    pub fn start(bind: SocketAddr, token: &str) -> Result<StoreServer> {
        if token.len() > MAX_STORE_TOKEN {
            return Err(StoreError::Config(format!(
                "store token is {} bytes; at most {MAX_STORE_TOKEN} are supported",
                token.len()
            )));
        }
        let (listener, local) = weftcc_base::socket::listen(bind, None, "store")?;
        let os = |what: &str, e: nix::Error| StoreError::io(what, std::io::Error::from(e));
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| os("creating the store's epoll", e))?;
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| os("creating the store's eventfd", e))?;
        epoll
            .add(&listener, EpollEvent::new(EpollFlags::EPOLLIN, LISTENER))
            .map_err(|e| os("watching the store's listener", e))?;
        epoll
            .add(&wake, EpollEvent::new(EpollFlags::EPOLLIN, WAKE))
            .map_err(|e| os("watching the store's eventfd", e))?;
        let shared = Arc::new(Shared {
            shutdown: AtomicBool::new(false),
            wake,
            on_closed: Mutex::new(None),
            open: AtomicUsize::new(0),
            traffic: Mutex::new(Traffic::default()),
        });
        let mut event_loop = Loop {
            epoll,
            listener,
            token: token.as_bytes().to_vec(),
            shared: Arc::clone(&shared),
            map: HashMap::new(),
            sessions: BTreeMap::new(),
            conns: HashMap::new(),
            next_id: WAKE + 1,
            waiters: HashMap::new(),
            deadlines: BinaryHeap::new(),
            accept_paused: None,
            partial: 0,
            last_sweep: Instant::now(),
            touched: Vec::new(),
            full_warned: false,
            chunk: vec![0; READ_CHUNK],
        };
        let thread = std::thread::Builder::new()
            .name("weft-store".into())
            .spawn(move || event_loop.run())
            .map_err(|e| StoreError::io("starting store thread", e))?;
        tracing::debug!(target: "weftcc::bootstrap", addr = %local, "bootstrap store serving");
        Ok(StoreServer {
            shared,
            local,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Connections open now (handshaking or served).
    pub fn connections(&self) -> usize {
        self.shared.open.load(Ordering::Acquire)
    }

    /// What the store has served so far.
    pub fn traffic(&self) -> Traffic {
        *lock(&self.shared.traffic)
    }

    /// Runs `hook` whenever the connection of a named session closes (its client died or went
    /// away), before anyone can read the store again: what it sets is there for every later
    /// request. Replaces an earlier hook.
    pub fn on_session_closed(&self, hook: Arc<SessionHook>) {
        *lock(&self.shared.on_closed) = Some(hook);
    }

    /// Stops serving: pending waits are answered CLOSED, connections are closed, the thread
    /// joined. Idempotent; also done on drop.
    pub fn shutdown(&self) {
        if !self.shared.shutdown.swap(true, Ordering::AcqRel) {
            let _ = self.shared.wake.write(1);
        }
        let thread = lock(&self.thread).take();
        if let Some(h) = thread {
            let _ = h.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where a connection is in its life.
#[derive(PartialEq, Eq)]
enum Phase {
    /// Its handshake has not arrived in full.
    Hello,
    /// Accepted: frames are requests.
    Open,
    /// To be closed once its output is written (a refused handshake).
    Closing,
}

/// A request waiting for keys.
struct Pending {
    op: u8,
    keys: Vec<Vec<u8>>,
    /// A key whose setting answers the request at once with that key's value
    /// ([`OP_GET_ALL_UNLESS`]).
    unless: Option<Vec<u8>>,
    deadline: Instant,
    /// Distinguishes this wait from the connection's earlier ones in the deadline heap.
    seq: u64,
    /// The keys it is indexed under in [`Loop::waiters`].
    indexed: Vec<Vec<u8>>,
    /// Keys before this one were found set (keys are set far more often than deleted: the
    /// answer checks them all once more).
    next: usize,
}

/// One connection.
struct Conn {
    sock: Socket,
    from: String,
    phase: Phase,
    input: Vec<u8>,
    output: Vec<u8>,
    /// Since when a handshake or a started frame has been arriving.
    partial_since: Option<Instant>,
    /// The session name it holds, if any.
    name: Option<Vec<u8>>,
    pending: Option<Pending>,
    waits: u64,
    /// Whether epoll watches it for writability (its output did not fit the socket).
    writing: bool,
}

/// What a request gets.
enum Answer {
    Now(Vec<u8>),
    Wait(Pending),
}

/// The loop thread's state: the store's data and every connection.
struct Loop {
    epoll: Epoll,
    listener: Socket,
    token: Vec<u8>,
    shared: Arc<Shared>,
    map: HashMap<Vec<u8>, Vec<u8>>,
    sessions: BTreeMap<Vec<u8>, Session>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    /// Key → connections whose pending request misses it first (or is interrupted by it).
    waiters: HashMap<Vec<u8>, HashSet<u64>>,
    /// Pending requests by deadline: (deadline, connection, its wait's seq).
    deadlines: BinaryHeap<Reverse<(Instant, u64, u64)>>,
    accept_paused: Option<Instant>,
    /// Connections with `partial_since` set.
    partial: usize,
    /// When connections with half-arrived data were last checked for lateness.
    last_sweep: Instant,
    /// Keys set since waiters were last woken.
    touched: Vec<Vec<u8>>,
    full_warned: bool,
    /// Where sockets are read into (reused: zeroing 64 KiB per read showed in profiles).
    chunk: Vec<u8>,
}

impl Loop {
    fn run(&mut self) {
        let mut events = vec![EpollEvent::empty(); 1024];
        while !self.shared.shutdown.load(Ordering::Acquire) {
            let n = match self.epoll.wait(&mut events, self.sleep()) {
                Ok(n) => n,
                Err(nix::Error::EINTR) => 0,
                Err(e) => {
                    tracing::error!(target: "weftcc::bootstrap", error = %e, "store: epoll_wait failed; the store stops");
                    break;
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    LISTENER => self.accept(),
                    WAKE => {
                        let _ = self.shared.wake.read();
                    }
                    id => self.ready(id, ev.events()),
                }
                self.wake_waiters();
            }
            self.expire();
            self.wake_waiters();
        }
        self.close_all();
    }

    /// How long epoll may sleep: until the next deadline, a tick while data is half-arrived or
    /// accepting is paused, else indefinitely (the eventfd wakes it for shutdown).
    fn sleep(&self) -> EpollTimeout {
        let now = Instant::now();
        let mut until: Option<Instant> = self.deadlines.peek().map(|Reverse((d, _, _))| *d);
        if self.partial > 0 {
            let tick = now + PARTIAL_TICK;
            until = Some(until.map_or(tick, |u| u.min(tick)));
        }
        if let Some(p) = self.accept_paused {
            until = Some(until.map_or(p, |u| u.min(p)));
        }
        match until {
            None => EpollTimeout::NONE,
            Some(u) => {
                let ms = u.saturating_duration_since(now).as_millis() + 1;
                EpollTimeout::try_from(ms.min(60_000)).unwrap_or(EpollTimeout::NONE)
            }
        }
    }

    fn accept(&mut self) {
        if self.accept_paused.is_some() {
            return;
        }
        loop {
            match self.listener.accept() {
                Ok((sock, from)) => {
                    let from = from.as_socket().map(|a| a.to_string()).unwrap_or_default();
                    self.admit(sock, from);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors (or another passing failure): the listener would stay
                    // readable and spin the loop, so stop watching it for a moment.
                    tracing::warn!(target: "weftcc::bootstrap", error = %e, "store: accept failed; pausing accepts");
                    let _ = self.epoll.delete(&self.listener);
                    self.accept_paused = Some(Instant::now() + ACCEPT_PAUSE);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, sock: Socket, from: String) {
        if self.conns.len() >= MAX_CONNECTIONS {
            if !self.full_warned {
                tracing::warn!(target: "weftcc::bootstrap", from = %from, limit = MAX_CONNECTIONS, "store connection limit reached; closing new connections");
                self.full_warned = true;
            }
            return;
        }
        let _ = sock.set_nonblocking(true);
        let _ = sock.set_nodelay(true);
        let id = self.next_id;
        self.next_id += 1;
        let interest = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if let Err(e) = self.epoll.add(&sock, EpollEvent::new(interest, id)) {
            tracing::warn!(target: "weftcc::bootstrap", error = %e, "store: cannot watch a connection; closing it");
            return;
        }
        self.partial += 1;
        self.conns.insert(
            id,
            Conn {
                sock,
                from,
                phase: Phase::Hello,
                input: Vec::new(),
                output: Vec::new(),
                partial_since: Some(Instant::now()),
                name: None,
                pending: None,
                waits: 0,
                writing: false,
            },
        );
        let open = self.shared.open.fetch_add(1, Ordering::AcqRel) + 1;
        let mut t = lock(&self.shared.traffic);
        t.peak_connections = t.peak_connections.max(open);
    }

    /// Connection `id` is readable, writable or hung up.
    fn ready(&mut self, id: u64, events: EpollFlags) {
        if events.contains(EpollFlags::EPOLLOUT) && !self.flush(id) {
            return self.close(id, None);
        }
        let mut gone = false;
        if events.intersects(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLHUP) {
            match self.read(id) {
                Ok(eof) => gone = eof,
                Err(why) => return self.close(id, Some(why)),
            }
        }
        // What arrived in full before a hang-up is still served (a rank that publishes its
        // failure and exits at once).
        if let Err(why) = self.serve(id) {
            return self.close(id, Some(why));
        }
        if gone {
            self.close(id, None);
        }
    }

    /// Reads what connection `id` has sent; true when it has hung up. `Err`: it broke the
    /// protocol.
    fn read(&mut self, id: u64) -> std::result::Result<bool, String> {
        let Some(conn) = self.conns.get_mut(&id) else {
            return Ok(false);
        };
        let chunk = &mut self.chunk;
        loop {
            match (&conn.sock).read(chunk) {
                Ok(0) => return Ok(true),
                Ok(n) => {
                    lock(&self.shared.traffic).received += n as u64;
                    conn.input.extend_from_slice(&chunk[..n]);
                    // A client has one request in flight; more than a frame's worth waiting
                    // behind it is not a client of this protocol.
                    if conn.input.len() > MAX_FRAME + 4 + MAX_STORE_TOKEN + 8 {
                        return Err("sent more than a request ahead".into());
                    }
                    if n < chunk.len() {
                        return Ok(false);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(true),
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Handles what connection `id` has sent in full: its handshake, then its requests one at a
    /// time (none while one is pending or an answer is unwritten). `Err`: a protocol breach.
    fn serve(&mut self, id: u64) -> std::result::Result<(), String> {
        let served = self.serve_frames(id);
        self.note_partial(id);
        served
    }

    fn serve_frames(&mut self, id: u64) -> std::result::Result<(), String> {
        loop {
            let Some(conn) = self.conns.get_mut(&id) else {
                return Ok(());
            };
            if conn.pending.is_some() || !conn.output.is_empty() {
                return Ok(());
            }
            match conn.phase {
                Phase::Hello => {
                    if !self.handshake(id)? {
                        return Ok(());
                    }
                }
                Phase::Open => {
                    let Some(payload) = take_frame(&mut conn.input)? else {
                        return Ok(());
                    };
                    self.seen(id);
                    lock(&self.shared.traffic).requests += 1;
                    match self.request(&payload, id)? {
                        Answer::Now(resp) => self.send(id, &resp),
                        Answer::Wait(p) => self.park(id, p),
                    }
                }
                Phase::Closing => return Ok(()),
            }
        }
    }

    /// Reads connection `id`'s handshake if it has arrived in full (true), answering it: the
    /// status byte of acceptance, or of refusal (closing once written).
    fn handshake(&mut self, id: u64) -> std::result::Result<bool, String> {
        let Some(conn) = self.conns.get_mut(&id) else {
            return Ok(false);
        };
        let Some(fixed) = conn.input.first_chunk::<8>() else {
            return Ok(false);
        };
        if fixed[..4] != STORE_MAGIC {
            return Err("bad magic".into());
        }
        let version = u16::from_le_bytes([fixed[4], fixed[5]]);
        if version != STORE_VERSION {
            return Err(format!(
                "protocol version {version}, expected {STORE_VERSION}"
            ));
        }
        let tlen = u16::from_le_bytes([fixed[6], fixed[7]]) as usize;
        if tlen > MAX_STORE_TOKEN {
            return Err("token too long".into());
        }
        if conn.input.len() < 8 + tlen {
            return Ok(false);
        }
        let accepted = conn.input[8..8 + tlen] == self.token[..];
        conn.input.drain(..8 + tlen);
        if accepted {
            conn.phase = Phase::Open;
            self.send_raw(id, &[ST_OK]);
        } else {
            tracing::warn!(target: "weftcc::bootstrap", from = %conn.from, reason = "wrong job token", "store refused a connection");
            conn.phase = Phase::Closing;
            self.send_raw(id, &[ST_REFUSED]);
        }
        Ok(true)
    }

    /// Keeps `partial_since` of connection `id` true to whether part of a handshake or frame is
    /// waiting.
    fn note_partial(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let partial = conn.phase == Phase::Hello || !conn.input.is_empty();
        match (partial, conn.partial_since.is_some()) {
            (true, false) => {
                conn.partial_since = Some(Instant::now());
                self.partial += 1;
            }
            (false, true) => {
                conn.partial_since = None;
                self.partial -= 1;
            }
            _ => {}
        }
    }

    /// A request arrived on connection `id`: its session (if any) is alive now.
    fn seen(&mut self, id: u64) {
        let Some(name) = self.conns.get(&id).and_then(|c| c.name.as_ref()) else {
            return;
        };
        if let Some(s) = self.sessions.get_mut(name).filter(|s| s.conn == id) {
            s.last = Instant::now();
        }
    }

    /// Queues a framed answer on connection `id` and writes what the socket takes.
    fn send(&mut self, id: u64, payload: &[u8]) {
        let mut framed = Vec::with_capacity(4 + payload.len());
        framed.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        framed.extend_from_slice(payload);
        self.send_raw(id, &framed);
    }

    fn send_raw(&mut self, id: u64, bytes: &[u8]) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        conn.output.extend_from_slice(bytes);
        if !self.flush(id) {
            self.close(id, None);
        }
    }

    /// Writes connection `id`'s output; false when the connection broke or, refused, has had
    /// its answer. Watches for writability while some is left.
    fn flush(&mut self, id: u64) -> bool {
        let Some(conn) = self.conns.get_mut(&id) else {
            return true;
        };
        while !conn.output.is_empty() {
            match (&conn.sock).write(&conn.output) {
                Ok(0) => return false,
                Ok(n) => {
                    lock(&self.shared.traffic).sent += n as u64;
                    conn.output.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        let want = !conn.output.is_empty();
        if want != conn.writing {
            let mut flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
            if want {
                flags |= EpollFlags::EPOLLOUT;
            }
            let mut ev = EpollEvent::new(flags, id);
            if self.epoll.modify(&conn.sock, &mut ev).is_err() {
                return false;
            }
            conn.writing = want;
        }
        want || conn.phase != Phase::Closing
    }

    /// Makes `p` connection `id`'s pending request.
    fn park(&mut self, id: u64, mut p: Pending) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        conn.waits += 1;
        p.seq = conn.waits;
        self.deadlines.push(Reverse((p.deadline, id, p.seq)));
        index(&mut self.waiters, &self.map, id, &mut p);
        conn.pending = Some(p);
    }

    /// Takes connection `id`'s pending request out of the index.
    fn unpark(&mut self, id: u64) -> Option<Pending> {
        let p = self.conns.get_mut(&id)?.pending.take()?;
        for key in &p.indexed {
            if let Some(set) = self.waiters.get_mut(key) {
                set.remove(&id);
                if set.is_empty() {
                    self.waiters.remove(key);
                }
            }
        }
        Some(p)
    }

    /// Answers the pending requests whose keys were set since the last call, indexing again
    /// those still missing some, and serves what their connections sent behind them.
    fn wake_waiters(&mut self) {
        while let Some(key) = self.touched.pop() {
            let Some(ids) = self.waiters.get(&key) else {
                continue;
            };
            let ids: Vec<u64> = ids.iter().copied().collect();
            for id in ids {
                let Some(mut p) = self.unpark(id) else {
                    continue;
                };
                match ready_answer(&self.map, &mut p) {
                    Some(resp) => {
                        self.send(id, &resp);
                        if let Err(why) = self.serve(id) {
                            self.close(id, Some(why));
                        }
                    }
                    None => {
                        index(&mut self.waiters, &self.map, id, &mut p);
                        if let Some(conn) = self.conns.get_mut(&id) {
                            conn.pending = Some(p);
                        }
                    }
                }
            }
        }
    }

    /// Answers the requests whose time is up, and closes connections whose handshake or frame
    /// has been arriving for longer than [`STORE_IO_TIMEOUT`].
    fn expire(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((deadline, id, seq))) = self.deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            let current = self
                .conns
                .get(&id)
                .and_then(|c| c.pending.as_ref())
                .is_some_and(|p| p.seq == seq);
            if current && self.unpark(id).is_some() {
                self.send(id, &[ST_TIMEOUT]);
                if let Err(why) = self.serve(id) {
                    self.close(id, Some(why));
                }
            }
        }
        if self.partial > 0 && now - self.last_sweep >= PARTIAL_TICK {
            self.last_sweep = now;
            let late: Vec<(u64, bool)> = self
                .conns
                .iter()
                .filter(|(_, c)| c.partial_since.is_some_and(|t| now - t > STORE_IO_TIMEOUT))
                .map(|(id, c)| (*id, c.phase == Phase::Hello))
                .collect();
            for (id, hello) in late {
                let why = if hello {
                    "its handshake did not arrive in time"
                } else {
                    "a started frame did not arrive in time"
                };
                self.close(id, Some(why.into()));
            }
        }
        if self.accept_paused.is_some_and(|p| p <= now) {
            self.accept_paused = None;
            let ev = EpollEvent::new(EpollFlags::EPOLLIN, LISTENER);
            if self.epoll.add(&self.listener, ev).is_ok() {
                self.accept();
            }
        }
    }

    /// Closes connection `id` (`why`: the protocol breach to log), ending its session; what
    /// the session hook sets wakes its waiters on the loop's next turn.
    fn close(&mut self, id: u64, why: Option<String>) {
        let _ = self.unpark(id);
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        if let Some(why) = why {
            tracing::warn!(target: "weftcc::bootstrap", from = %conn.from, reason = %why, "store closed a connection");
        }
        let _ = self.epoll.delete(&conn.sock);
        if conn.partial_since.is_some() {
            self.partial -= 1;
        }
        self.shared.open.fetch_sub(1, Ordering::AcqRel);
        if let Some(name) = conn.name {
            self.session_closed(&name, id);
        }
    }

    /// The connection `conn` holding session `name` closed: marks it so, and runs the hook.
    fn session_closed(&mut self, name: &[u8], conn: u64) {
        let Some(s) = self.sessions.get_mut(name).filter(|s| s.conn == conn) else {
            return;
        };
        s.open = false;
        s.last = Instant::now();
        let hook = lock(&self.shared.on_closed).clone();
        if let Some(hook) = hook {
            hook(
                &String::from_utf8_lossy(name),
                &s.value,
                &mut LocalStore {
                    map: &mut self.map,
                    touched: &mut self.touched,
                },
            );
        }
    }

    /// Shutting down: a pending request that can be answered is, the others get CLOSED, every
    /// connection a final CLOSED frame; then all close.
    fn close_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            let Some(conn) = self.conns.get_mut(&id) else {
                continue;
            };
            if conn.phase != Phase::Open {
                continue;
            }
            if let Some(mut p) = conn.pending.take() {
                let resp = ready_answer(&self.map, &mut p).unwrap_or_else(|| vec![ST_CLOSED]);
                let mut framed = (resp.len() as u32).to_le_bytes().to_vec();
                framed.extend_from_slice(&resp);
                conn.output.extend_from_slice(&framed);
            }
            conn.output.extend_from_slice(&1u32.to_le_bytes());
            conn.output.push(ST_CLOSED);
            // Best effort, without blocking: a client that stopped reading misses it.
            let _ = (&conn.sock).write(&conn.output);
        }
        self.shared.open.store(0, Ordering::Release);
        self.conns.clear();
    }

    /// Executes one request of connection `id`. `Err` means it was malformed: the connection
    /// gets closed.
    fn request(&mut self, payload: &[u8], id: u64) -> std::result::Result<Answer, String> {
        let mut c = Cursor { buf: payload };
        let bad = || "malformed request".to_string();
        let op = c.u8().ok_or_else(bad)?;
        let wait = |ms: u64, op: u8, keys: Vec<Vec<u8>>, unless: Option<Vec<u8>>| Pending {
            op,
            keys,
            unless,
            deadline: Instant::now()
                .checked_add(Duration::from_millis(ms))
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365)),
            seq: 0,
            indexed: Vec::new(),
            next: 0,
        };
        let pending = match op {
            OP_SET => {
                let key = c.key().ok_or_else(bad)?;
                let value = c.rest();
                self.map.insert(key.to_vec(), value.to_vec());
                self.touched.push(key.to_vec());
                return Ok(Answer::Now(vec![ST_OK]));
            }
            OP_SET_IF_ABSENT => {
                let key = c.key().ok_or_else(bad)?;
                let value = c.rest();
                if !self.map.contains_key(key) {
                    self.map.insert(key.to_vec(), value.to_vec());
                    self.touched.push(key.to_vec());
                }
                let mut out = vec![ST_OK];
                out.extend_from_slice(self.map.get(key).map_or(&[][..], Vec::as_slice));
                return Ok(Answer::Now(out));
            }
            OP_GET => {
                let ms = c.u64().ok_or_else(bad)?;
                let key = c.key().ok_or_else(bad)?;
                c.end().ok_or_else(bad)?;
                wait(ms, op, vec![key.to_vec()], None)
            }
            OP_WAIT | OP_GET_ALL | OP_GET_ALL_UNLESS => {
                let ms = c.u64().ok_or_else(bad)?;
                let unless = match op {
                    OP_GET_ALL_UNLESS => Some(c.key().ok_or_else(bad)?.to_vec()),
                    _ => None,
                };
                let count = c.u32().ok_or_else(bad)? as usize;
                let mut keys = Vec::with_capacity(count.min(payload.len() / 4));
                for _ in 0..count {
                    keys.push(c.key().ok_or_else(bad)?.to_vec());
                }
                c.end().ok_or_else(bad)?;
                wait(ms, op, keys, unless)
            }
            OP_ADD => {
                let delta = c.u64().ok_or_else(bad)? as i64;
                let key = c.key().ok_or_else(bad)?;
                c.end().ok_or_else(bad)?;
                let Some(new) = add_counter(&mut self.map, key, delta) else {
                    let mut out = vec![ST_ERROR];
                    out.extend_from_slice(b"value is not an integer counter");
                    return Ok(Answer::Now(out));
                };
                self.touched.push(key.to_vec());
                let mut out = vec![ST_OK];
                out.extend_from_slice(&new.to_le_bytes());
                return Ok(Answer::Now(out));
            }
            OP_CHECK | OP_DELETE => {
                let key = c.key().ok_or_else(bad)?;
                c.end().ok_or_else(bad)?;
                let had = if op == OP_CHECK {
                    self.map.contains_key(key)
                } else {
                    self.map.remove(key).is_some()
                };
                return Ok(Answer::Now(vec![ST_OK, u8::from(had)]));
            }
            OP_NAME => {
                let key = c.key().ok_or_else(bad)?;
                let value = c.rest();
                return Ok(Answer::Now(self.name(id, key, value)));
            }
            OP_SESSIONS => {
                let prefix = c.key().ok_or_else(bad)?;
                c.end().ok_or_else(bad)?;
                return Ok(Answer::Now(self.list_sessions(prefix)));
            }
            other => return Err(format!("unknown opcode {other}")),
        };
        let mut pending = pending;
        Ok(match ready_answer(&self.map, &mut pending) {
            Some(resp) => Answer::Now(resp),
            None if pending.deadline <= Instant::now() => Answer::Now(vec![ST_TIMEOUT]),
            None => Answer::Wait(pending),
        })
    }

    /// NAME: connection `id` takes session `key`.
    fn name(&mut self, id: u64, key: &[u8], value: &[u8]) -> Vec<u8> {
        if !self.sessions.contains_key(key) && self.sessions.len() >= MAX_SESSIONS {
            let mut out = vec![ST_ERROR];
            out.extend_from_slice(
                format!("the store keeps at most {MAX_SESSIONS} sessions").as_bytes(),
            );
            return out;
        }
        let Some(conn) = self.conns.get_mut(&id) else {
            return vec![ST_ERROR];
        };
        // A connection holds one name: taking another closes the old one.
        if let Some(old) = conn.name.take().filter(|old| old != key) {
            if let Some(s) = self.sessions.get_mut(&old).filter(|s| s.conn == id) {
                s.open = false;
                s.last = Instant::now();
            }
        }
        self.sessions.insert(
            key.to_vec(),
            Session {
                value: value.to_vec(),
                conn: id,
                open: true,
                last: Instant::now(),
            },
        );
        conn.name = Some(key.to_vec());
        vec![ST_OK]
    }

    /// SESSIONS: every session under `prefix`, by name.
    fn list_sessions(&self, prefix: &[u8]) -> Vec<u8> {
        let now = Instant::now();
        let listed: Vec<(&Vec<u8>, &Session)> = self
            .sessions
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .collect();
        let answer: u64 = 5 + listed
            .iter()
            .map(|(k, s)| 8 + k.len() as u64 + s.value.len() as u64 + 9)
            .sum::<u64>();
        if answer > MAX_FRAME as u64 {
            let mut out = vec![ST_TOO_LARGE];
            out.extend_from_slice(&answer.to_le_bytes());
            return out;
        }
        let mut out = vec![ST_OK];
        out.extend_from_slice(&(listed.len() as u32).to_le_bytes());
        for (k, s) in listed {
            put_key(&mut out, k);
            put_key(&mut out, &s.value);
            out.push(u8::from(s.open));
            let idle = now.saturating_duration_since(s.last).as_millis() as u64;
            out.extend_from_slice(&idle.to_le_bytes());
        }
        out
    }
}

/// Indexes pending request `p` of connection `id` under the first of its keys not set and its
/// interrupting key.
fn index(
    waiters: &mut HashMap<Vec<u8>, HashSet<u64>>,
    map: &HashMap<Vec<u8>, Vec<u8>>,
    id: u64,
    p: &mut Pending,
) {
    p.indexed.clear();
    if let Some(i) = first_missing(map, &p.keys, p.next) {
        p.next = i;
        p.indexed.push(p.keys[i].clone());
    }
    if let Some(key) = &p.unless {
        p.indexed.push(key.clone());
    }
    for key in &p.indexed {
        waiters.entry(key.clone()).or_default().insert(id);
    }
}

/// The index of the first of `keys` from `from` on that is not set, if any.
fn first_missing(map: &HashMap<Vec<u8>, Vec<u8>>, keys: &[Vec<u8>], from: usize) -> Option<usize> {
    (from..keys.len()).find(|&i| !map.contains_key(keys[i].as_slice()))
}

/// The answer of pending request `p` if it has one now.
fn ready_answer(map: &HashMap<Vec<u8>, Vec<u8>>, p: &mut Pending) -> Option<Vec<u8>> {
    if let Some(value) = p.unless.as_ref().and_then(|k| map.get(k)) {
        let mut out = vec![ST_INTERRUPTED];
        out.extend_from_slice(value);
        return Some(out);
    }
    if let Some(i) = first_missing(map, &p.keys, p.next) {
        p.next = i;
        return None;
    }
    if let Some(i) = first_missing(map, &p.keys, 0) {
        // One was deleted since it was seen.
        p.next = i;
        return None;
    }
    match p.op {
        OP_GET => {
            let v = map.get(&p.keys[0])?;
            let mut out = Vec::with_capacity(1 + v.len());
            out.push(ST_OK);
            out.extend_from_slice(v);
            Some(out)
        }
        OP_WAIT => Some(vec![ST_OK]),
        _ => {
            let answer: u64 = p
                .keys
                .iter()
                .map(|k| 4 + map.get(k).map_or(0, |v| v.len() as u64))
                .sum::<u64>()
                + 1;
            if answer > MAX_FRAME as u64 {
                let mut out = vec![ST_TOO_LARGE];
                out.extend_from_slice(&answer.to_le_bytes());
                return Some(out);
            }
            let mut out = Vec::with_capacity(answer as usize);
            out.push(ST_OK);
            for k in &p.keys {
                put_key(&mut out, map.get(k).map_or(&[][..], Vec::as_slice));
            }
            Some(out)
        }
    }
}

/// The next whole frame's payload from `input`, if it has arrived; `Err` for a length outside
/// `1..=MAX_FRAME` (nothing is allocated for a claimed length).
fn take_frame(input: &mut Vec<u8>) -> std::result::Result<Option<Vec<u8>>, String> {
    let Some(len) = input.first_chunk::<4>() else {
        return Ok(None);
    };
    let n = u32::from_le_bytes(*len) as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(format!("frame length {n} outside 1..={MAX_FRAME}"));
    }
    if input.len() < 4 + n {
        return Ok(None);
    }
    let payload = input[4..4 + n].to_vec();
    input.drain(..4 + n);
    Ok(Some(payload))
}
