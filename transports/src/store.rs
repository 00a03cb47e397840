//! The bootstrap key-value store: rank 0 serves it ([`StoreServer`]), every rank talks to it with
//! a [`StoreClient`].
//!
//! Wire protocol (all integers little endian):
//!
//! ```text
//! client hello:  b"WFST" | version u16 | token length u16 (<= 1024) | token
//! server answer: status u8 (0 = accepted, 4 = refused; garbage is closed without an answer)
//! then frames:   length u32 (<= MAX_FRAME) | payload
//!   request payload:  opcode u8 | fields          response payload: status u8 | body
//!   1 SET    key | value (rest of frame)          OK
//!   2 GET    timeout_ms u64 | key                 OK value | TIMEOUT
//!   3 WAIT   timeout_ms u64 | count u32 | keys    OK | TIMEOUT
//!   4 ADD    delta i64 | key                      OK new value i64
//!   5 CHECK  key                                  OK exists u8
//!   6 DELETE key                                  OK existed u8
//!   7 GET_ALL timeout_ms u64 | count u32 | keys   OK (length u32 | value) per key | TIMEOUT
//!   8 NAME   key | value (rest of frame)          OK
//!   9 SESSIONS prefix key                         OK count u32 | per session: key | value |
//!                                                    open u8 | idle_ms u64  (by key)
//!   key = length u32 | bytes;  status: 0 OK, 1 TIMEOUT, 2 CLOSED, 3 ERROR (body = message),
//!   5 TOO_LARGE (body = bytes u64: a GET_ALL answer would exceed MAX_FRAME)
//! ```
//!
//! [`StoreClient::get_all`] answers any number of keys: a request or an answer that would not
//! fit one frame is split in halves and asked again, so only a single value larger than a frame
//! (which SET cannot store) could fail, with [`TransportError::StoreTooLarge`].
//!
//! Waits block in the server on a condition variable. An oversized length, a truncated frame, an
//! unknown opcode or garbage closes that one connection (logged with `tracing::warn!`) without
//! allocating the claimed length; other clients are unaffected. On shutdown every pending wait is
//! answered with CLOSED (the client reports [`TransportError::StoreClosed`]) and every connection
//! gets a final CLOSED frame.
//!
//! Counters made with [`StoreClient::add`] are stored as ASCII decimal text.
//!
//! Sessions: a connection that names itself (NAME) is a session the server watches on the
//! client's behalf: while the connection is open, the time since its last request says whether
//! the client is alive (a rank's failure watcher polls every 100 ms, so a stopped or stuck
//! process shows as silence); when it closes (the process died or left), the session stays
//! listed as closed, with the time since. SESSIONS lists them by key prefix, measured on the
//! server's clock alone. No other request is slowed: only named connections touch the table.

use crate::error::{Result, TransportError};
use crate::util::lock;
use crate::util::Deadline;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::collections::{BTreeMap, HashMap};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Magic bytes of the store handshake.
pub const STORE_MAGIC: [u8; 4] = *b"WFST";
/// Version of the store protocol.
pub const STORE_VERSION: u16 = 1;
/// Largest frame accepted in either direction (16 MiB).
pub const MAX_FRAME: usize = 16 << 20;
/// Most simultaneous connections one server keeps.
pub const MAX_CONNECTIONS: usize = 4096;
/// Longest token accepted.
pub const MAX_STORE_TOKEN: usize = 1024;
/// Most sessions ([`StoreClient::name_session`]) one server keeps, closed ones included.
pub const MAX_SESSIONS: usize = 1 << 16;
/// Time a new connection has to present its handshake, and a started frame to arrive in full.
pub const STORE_IO_TIMEOUT: Duration = Duration::from_secs(5);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const OP_CHECK: u8 = 5;
const OP_DELETE: u8 = 6;
const OP_GET_ALL: u8 = 7;
const OP_NAME: u8 = 8;
const OP_SESSIONS: u8 = 9;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_CLOSED: u8 = 2;
const ST_ERROR: u8 = 3;
const ST_TOO_LARGE: u8 = 5;
const ST_REFUSED: u8 = 4;

/// Extra time a client waits beyond a server-side timeout before it gives up on the server.
const CLIENT_MARGIN: Duration = Duration::from_secs(10);
/// How often idle connection threads look at the shutdown flag (a backstop: shutdown also
/// shuts their sockets' read side down).
const IDLE_POLL: Duration = Duration::from_millis(500);

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Reads exactly `buf.len()` bytes, retrying socket timeouts until `deadline`.
fn read_full(sock: &Socket, buf: &mut [u8], deadline: &Deadline) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match (&*sock).read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                if deadline.expired() {
                    return Err(ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_frame(sock: &Socket, payload: &[u8]) -> std::io::Result<()> {
    let mut v = Vec::with_capacity(4 + payload.len());
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    (&*sock).write_all(&v)
}

/// A cursor over a request or response payload that never reads past its end.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Some(u64::from_le_bytes(a))
    }
    fn key(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
    /// `Some` when everything was read (a request carries nothing more).
    fn end(&self) -> Option<()> {
        self.buf.is_empty().then_some(())
    }
}

fn put_key(v: &mut Vec<u8>, key: &[u8]) {
    v.extend_from_slice(&(key.len() as u32).to_le_bytes());
    v.extend_from_slice(key);
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

struct State {
    map: HashMap<Vec<u8>, Vec<u8>>,
    sessions: BTreeMap<Vec<u8>, Session>,
    closed: bool,
}

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
/// data to act on at once (under the store's lock: keep it short).
pub type SessionHook = dyn Fn(&str, &[u8], &mut LocalStore<'_>) + Send + Sync;

/// The store's data as a [`SessionHook`] sees it.
pub struct LocalStore<'a> {
    map: &'a mut HashMap<Vec<u8>, Vec<u8>>,
}

impl LocalStore<'_> {
    /// Whether `key` is set.
    pub fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key.as_bytes())
    }

    /// [`StoreClient::set`].
    pub fn set(&mut self, key: &str, value: &[u8]) {
        self.map.insert(key.as_bytes().to_vec(), value.to_vec());
    }

    /// [`StoreClient::add`]; a value that is not a counter is left alone (and `None` returned).
    pub fn add(&mut self, key: &str, delta: i64) -> Option<i64> {
        add_counter(self.map, key.as_bytes(), delta)
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

/// A session as [`StoreClient::sessions`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Its name.
    pub key: String,
    /// What its client said about itself when it named the session.
    pub value: Vec<u8>,
    /// Whether its connection is still open.
    pub open: bool,
    /// Open: time since its last request. Closed: time since it closed.
    pub idle: Duration,
}

struct Inner {
    state: Mutex<State>,
    cv: Condvar,
    shutdown: AtomicBool,
    token: String,
    active: AtomicUsize,
    next_id: AtomicU64,
    /// Clones of live connection sockets, so shutdown can unblock their reads.
    socks: Mutex<HashMap<u64, Socket>>,
    /// Called when a named session's connection closes ([`StoreServer::on_session_closed`]).
    on_closed: Mutex<Option<Arc<SessionHook>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The bootstrap key-value store server (threads: one acceptor, one per connection).
pub struct StoreServer {
    inner: Arc<Inner>,
    local: SocketAddr,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl StoreServer {
    /// Binds `bind` (port 0 for an ephemeral port) and starts serving clients that present
    /// `token`.
    pub fn start(bind: SocketAddr, token: &str) -> Result<StoreServer> {
        if token.len() > MAX_STORE_TOKEN {
            return Err(TransportError::Config(format!(
                "store token is {} bytes; at most {MAX_STORE_TOKEN} are supported",
                token.len()
            )));
        }
        let (sock, local) = crate::socket::listen(bind, None, "store")?;
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                map: HashMap::new(),
                sessions: BTreeMap::new(),
                closed: false,
            }),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            token: token.to_string(),
            active: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            socks: Mutex::new(HashMap::new()),
            on_closed: Mutex::new(None),
            threads: Mutex::new(Vec::new()),
        });
        let inner2 = inner.clone();
        let acceptor = std::thread::Builder::new()
            .name("weft-store-accept".into())
            .spawn(move || accept_loop(sock, inner2))
            .map_err(|e| TransportError::io("starting store thread", e))?;
        tracing::debug!(target: "weftcc::bootstrap", addr = %local, "bootstrap store serving");
        Ok(StoreServer {
            inner,
            local,
            acceptor: Mutex::new(Some(acceptor)),
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Runs `hook` whenever the connection of a named session closes (its client died or went
    /// away), before anyone can read the store again: what it sets is there for every later
    /// request. Replaces an earlier hook.
    pub fn on_session_closed(&self, hook: Arc<SessionHook>) {
        *lock(&self.inner.on_closed) = Some(hook);
    }

    /// Stops serving: pending waits are answered CLOSED, connections are closed, threads joined.
    /// Idempotent; also done on drop.
    pub fn shutdown(&self) {
        if self.inner.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        lock(&self.inner.state).closed = true;
        self.inner.cv.notify_all();
        for s in lock(&self.inner.socks).values() {
            let _ = s.shutdown(Shutdown::Read);
        }
        let acceptor = lock(&self.acceptor).take();
        if let Some(h) = acceptor {
            let _ = h.join();
        }
        let threads = std::mem::take(&mut *lock(&self.inner.threads));
        for h in threads {
            let _ = h.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: Socket, inner: Arc<Inner>) {
    while !inner.shutdown.load(Ordering::Acquire) {
        let Some((sock, from)) = crate::socket::accept_within(&listener, 50, "store") else {
            continue;
        };
        if inner.active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
            tracing::warn!(target: "weftcc::bootstrap", from = %from, "store connection limit reached; closing new connection");
            continue;
        }
        let _ = sock.set_nonblocking(false);
        let _ = sock.set_nodelay(true);
        let clone = match sock.try_clone() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(target: "weftcc::bootstrap", error = %e, "store: cannot duplicate socket; closing connection");
                continue;
            }
        };
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&inner.socks).insert(id, clone);
        if inner.shutdown.load(Ordering::Acquire) {
            lock(&inner.socks).remove(&id);
            break;
        }
        inner.active.fetch_add(1, Ordering::AcqRel);
        let inner2 = inner.clone();
        let spawned = std::thread::Builder::new()
            .name("weft-store-conn".into())
            .spawn(move || {
                let name = serve_connection(&sock, &from, &inner2, id);
                if let Some(name) = name {
                    session_closed(&inner2, &name, id);
                }
                lock(&inner2.socks).remove(&id);
                inner2.active.fetch_sub(1, Ordering::AcqRel);
            });
        match spawned {
            Ok(h) => {
                let mut threads = lock(&inner.threads);
                threads.retain(|t| !t.is_finished());
                threads.push(h);
            }
            Err(e) => {
                lock(&inner.socks).remove(&id);
                inner.active.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(target: "weftcc::bootstrap", error = %e, "store: cannot start a connection thread");
            }
        }
    }
}

/// Serves one connection until it ends; returns the session name it held, if any.
fn serve_connection(sock: &Socket, from: &str, inner: &Inner, id: u64) -> Option<Vec<u8>> {
    let _ = sock.set_write_timeout(Some(STORE_IO_TIMEOUT));
    let _ = sock.set_read_timeout(Some(Duration::from_millis(100)));
    if let Err(why) = server_handshake(sock, inner) {
        if !inner.shutdown.load(Ordering::Acquire) {
            tracing::warn!(target: "weftcc::bootstrap", from = %from, reason = %why, "store refused a connection");
        }
        return None;
    }
    let _ = sock.set_read_timeout(Some(IDLE_POLL));
    let mut conn = Conn { id, name: None };
    loop {
        match read_request(sock, inner) {
            Ok(Some(payload)) => {
                conn.seen(inner);
                let resp = match handle_request(&payload, inner, &mut conn) {
                    Ok(r) => r,
                    Err(why) => {
                        tracing::warn!(target: "weftcc::bootstrap", from = %from, reason = %why, "store closed a connection");
                        return conn.name;
                    }
                };
                if write_frame(sock, &resp).is_err() {
                    return conn.name;
                }
            }
            Ok(None) => {
                // Shutting down: tell the client once, then close.
                let _ = write_frame(sock, &[ST_CLOSED]);
                return conn.name;
            }
            Err(why) => {
                if inner.shutdown.load(Ordering::Acquire) {
                    let _ = write_frame(sock, &[ST_CLOSED]);
                } else if !why.is_empty() {
                    tracing::warn!(target: "weftcc::bootstrap", from = %from, reason = %why, "store closed a connection");
                }
                return conn.name;
            }
        }
    }
}

/// The connection `conn` holding session `name` closed: marks it so, and runs the hook.
fn session_closed(inner: &Inner, name: &[u8], conn: u64) {
    let hook = lock(&inner.on_closed).clone();
    let mut st = lock(&inner.state);
    if st.closed {
        return;
    }
    let State { map, sessions, .. } = &mut *st;
    let Some(s) = sessions.get_mut(name).filter(|s| s.conn == conn) else {
        return;
    };
    s.open = false;
    s.last = Instant::now();
    if let Some(hook) = hook {
        hook(
            &String::from_utf8_lossy(name),
            &s.value,
            &mut LocalStore { map },
        );
    }
    drop(st);
    inner.cv.notify_all();
}

/// One served connection: its id and the session name it took, if any.
struct Conn {
    id: u64,
    name: Option<Vec<u8>>,
}

impl Conn {
    /// A request arrived: the session (if any) is alive now.
    fn seen(&self, inner: &Inner) {
        let Some(name) = &self.name else { return };
        let mut st = lock(&inner.state);
        if let Some(s) = st.sessions.get_mut(name).filter(|s| s.conn == self.id) {
            s.last = Instant::now();
        }
    }
}

fn server_handshake(sock: &Socket, inner: &Inner) -> std::result::Result<(), String> {
    let deadline = Deadline::after(STORE_IO_TIMEOUT);
    let mut fixed = [0u8; 8];
    read_full(sock, &mut fixed, &deadline).map_err(|e| format!("handshake: {e}"))?;
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
    let mut tok = vec![0u8; tlen];
    read_full(sock, &mut tok, &deadline).map_err(|e| format!("handshake: {e}"))?;
    if tok != inner.token.as_bytes() {
        let _ = (&*sock).write_all(&[ST_REFUSED]);
        return Err("wrong job token".into());
    }
    (&*sock)
        .write_all(&[ST_OK])
        .map_err(|e| format!("handshake reply: {e}"))
}

/// Reads one request frame. `Ok(None)`: the server is shutting down. `Err("")`: the client went
/// away cleanly between frames.
fn read_request(sock: &Socket, inner: &Inner) -> std::result::Result<Option<Vec<u8>>, String> {
    let mut len = [0u8; 4];
    // Wait (indefinitely, but watching the shutdown flag) for the first byte of a frame.
    loop {
        if inner.shutdown.load(Ordering::Acquire) {
            return Ok(None);
        }
        match (&*sock).read(&mut len[..1]) {
            Ok(0) => {
                return if inner.shutdown.load(Ordering::Acquire) {
                    Ok(None)
                } else {
                    Err(String::new())
                }
            }
            Ok(_) => break,
            Err(e) if e.kind() == ErrorKind::Interrupted || is_timeout(&e) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Err(String::new()),
            Err(e) => return Err(e.to_string()),
        }
    }
    let deadline = Deadline::after(STORE_IO_TIMEOUT);
    read_full(sock, &mut len[1..], &deadline)
        .map_err(|e| format!("truncated frame header: {e}"))?;
    let n = u32::from_le_bytes(len) as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(format!("frame length {n} outside 1..={MAX_FRAME}"));
    }
    let mut payload = vec![0u8; n];
    read_full(sock, &mut payload, &deadline).map_err(|e| format!("truncated frame: {e}"))?;
    Ok(Some(payload))
}

fn closed_or(status: u8, inner: &Inner) -> Vec<u8> {
    if inner.shutdown.load(Ordering::Acquire) {
        vec![ST_CLOSED]
    } else {
        vec![status]
    }
}

/// Waits up to `ms` milliseconds until `ready` answers (checked first, so an answer available
/// before a shutdown is still given), the store closes, or the time is up.
fn wait_until(
    inner: &Inner,
    ms: u64,
    ready: impl Fn(&State) -> Option<Vec<u8>>,
) -> std::result::Result<Vec<u8>, String> {
    let deadline = Deadline::after(Duration::from_millis(ms));
    let mut st = lock(&inner.state);
    loop {
        if let Some(answer) = ready(&st) {
            return Ok(answer);
        }
        if st.closed {
            return Ok(vec![ST_CLOSED]);
        }
        let left = deadline.remaining();
        if left.is_zero() {
            return Ok(closed_or(ST_TIMEOUT, inner));
        }
        st = match inner.cv.wait_timeout(st, left) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        };
    }
}

/// The store's state, unless it has closed.
fn open_state(inner: &Inner) -> Option<std::sync::MutexGuard<'_, State>> {
    Some(lock(&inner.state)).filter(|st| !st.closed)
}

/// Executes one request. `Err` means the request was malformed: the connection gets closed.
fn handle_request(
    payload: &[u8],
    inner: &Inner,
    conn: &mut Conn,
) -> std::result::Result<Vec<u8>, String> {
    let mut c = Cursor { buf: payload };
    let bad = || "malformed request".to_string();
    let op = c.u8().ok_or_else(bad)?;
    match op {
        OP_SET => {
            let key = c.key().ok_or_else(bad)?;
            let value = c.rest();
            let Some(mut st) = open_state(inner) else {
                return Ok(vec![ST_CLOSED]);
            };
            st.map.insert(key.to_vec(), value.to_vec());
            drop(st);
            inner.cv.notify_all();
            Ok(vec![ST_OK])
        }
        OP_GET => {
            let ms = c.u64().ok_or_else(bad)?;
            let key = c.key().ok_or_else(bad)?;
            c.end().ok_or_else(bad)?;
            // A value set before the shutdown is still answered: a rank that publishes an
            // abort and then exits must not lose it to the store closing.
            wait_until(inner, ms, |st| {
                st.map.get(key).map(|v| {
                    let mut out = Vec::with_capacity(1 + v.len());
                    out.push(ST_OK);
                    out.extend_from_slice(v);
                    out
                })
            })
        }
        OP_WAIT | OP_GET_ALL => {
            let ms = c.u64().ok_or_else(bad)?;
            let count = c.u32().ok_or_else(bad)? as usize;
            let mut keys = Vec::new();
            for _ in 0..count {
                keys.push(c.key().ok_or_else(bad)?);
            }
            c.end().ok_or_else(bad)?;
            wait_until(inner, ms, |st| {
                let values: Option<Vec<&Vec<u8>>> = keys.iter().map(|k| st.map.get(*k)).collect();
                let values = values?;
                let mut out = vec![ST_OK];
                let answer: u64 = values.iter().map(|v| 4 + v.len() as u64).sum::<u64>() + 1;
                if op == OP_GET_ALL && answer > MAX_FRAME as u64 {
                    let mut out = vec![ST_TOO_LARGE];
                    out.extend_from_slice(&answer.to_le_bytes());
                    return Some(out);
                }
                if op == OP_GET_ALL {
                    for v in values {
                        put_key(&mut out, v);
                    }
                }
                Some(out)
            })
        }
        OP_ADD => {
            let delta = c.u64().ok_or_else(bad)? as i64;
            let key = c.key().ok_or_else(bad)?;
            c.end().ok_or_else(bad)?;
            let Some(mut st) = open_state(inner) else {
                return Ok(vec![ST_CLOSED]);
            };
            let Some(new) = add_counter(&mut st.map, key, delta) else {
                let mut out = vec![ST_ERROR];
                out.extend_from_slice(b"value is not an integer counter");
                return Ok(out);
            };
            drop(st);
            inner.cv.notify_all();
            let mut out = vec![ST_OK];
            out.extend_from_slice(&new.to_le_bytes());
            Ok(out)
        }
        OP_CHECK | OP_DELETE => {
            let key = c.key().ok_or_else(bad)?;
            c.end().ok_or_else(bad)?;
            let Some(mut st) = open_state(inner) else {
                return Ok(vec![ST_CLOSED]);
            };
            let had = if op == OP_CHECK {
                st.map.contains_key(key)
            } else {
                st.map.remove(key).is_some()
            };
            Ok(vec![ST_OK, u8::from(had)])
        }
        OP_NAME => {
            let key = c.key().ok_or_else(bad)?;
            let value = c.rest();
            let Some(mut st) = open_state(inner) else {
                return Ok(vec![ST_CLOSED]);
            };
            if !st.sessions.contains_key(key) && st.sessions.len() >= MAX_SESSIONS {
                let mut out = vec![ST_ERROR];
                out.extend_from_slice(
                    format!("the store keeps at most {MAX_SESSIONS} sessions").as_bytes(),
                );
                return Ok(out);
            }
            // A connection holds one name: taking another closes the old one.
            if let Some(old) = conn.name.take().filter(|old| old != key) {
                if let Some(s) = st.sessions.get_mut(&old).filter(|s| s.conn == conn.id) {
                    s.open = false;
                    s.last = Instant::now();
                }
            }
            st.sessions.insert(
                key.to_vec(),
                Session {
                    value: value.to_vec(),
                    conn: conn.id,
                    open: true,
                    last: Instant::now(),
                },
            );
            conn.name = Some(key.to_vec());
            Ok(vec![ST_OK])
        }
        OP_SESSIONS => {
            let prefix = c.key().ok_or_else(bad)?;
            c.end().ok_or_else(bad)?;
            let Some(st) = open_state(inner) else {
                return Ok(vec![ST_CLOSED]);
            };
            let now = Instant::now();
            let listed: Vec<(&Vec<u8>, &Session)> = st
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
                return Ok(out);
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
            Ok(out)
        }
        other => Err(format!("unknown opcode {other}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// A connection to the bootstrap store. Every call has a timeout.
pub struct StoreClient {
    sock: Socket,
    addr: SocketAddr,
    timeout: Duration,
    closed: bool,
    broken: Option<String>,
}

impl StoreClient {
    /// Connects to `addr` (`"host:port"` or `"[v6]:port"`; host names are resolved) and presents
    /// `token`, retrying until `timeout` while the server is not up yet. `timeout` is also the
    /// default timeout of later calls that take none.
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<StoreClient> {
        if token.len() > MAX_STORE_TOKEN {
            return Err(TransportError::Config(format!(
                "store token is {} bytes; at most {MAX_STORE_TOKEN} are supported",
                token.len()
            )));
        }
        let deadline = Deadline::after(timeout);
        let mut last_err = String::from("no address");
        loop {
            match addr.to_socket_addrs() {
                Ok(addrs) => {
                    for a in addrs {
                        match Self::try_connect(a, token, &deadline) {
                            Ok(sock) => {
                                return Ok(StoreClient {
                                    sock,
                                    addr: a,
                                    timeout,
                                    closed: false,
                                    broken: None,
                                })
                            }
                            Err(e @ TransportError::Protocol(_)) => return Err(e),
                            Err(e) => last_err = e.to_string(),
                        }
                    }
                }
                Err(e) => {
                    if !addr.contains(':') {
                        return Err(TransportError::Config(format!(
                            "store address {addr:?} must be host:port or [v6]:port"
                        )));
                    }
                    last_err = format!("resolving {addr}: {e}");
                }
            }
            if deadline.expired() {
                return Err(TransportError::Timeout {
                    what: format!(
                        "connecting to the bootstrap store at {addr} (last error: {last_err})"
                    ),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(50).min(deadline.remaining()));
        }
    }

    fn try_connect(a: SocketAddr, token: &str, deadline: &Deadline) -> Result<Socket> {
        let sock = Socket::new(Domain::for_address(a), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| TransportError::io("creating store client socket", e))?;
        let slice = deadline
            .remaining()
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(1));
        sock.connect_timeout(&SockAddr::from(a), slice)
            .map_err(|e| TransportError::io(format!("connecting to store {a}"), e))?;
        let _ = sock.set_nodelay(true);
        let io = deadline
            .remaining()
            .max(Duration::from_millis(100))
            .min(STORE_IO_TIMEOUT);
        sock.set_write_timeout(Some(io))
            .map_err(|e| TransportError::io("set_write_timeout", e))?;
        sock.set_read_timeout(Some(io))
            .map_err(|e| TransportError::io("set_read_timeout", e))?;
        let mut hello = Vec::with_capacity(8 + token.len());
        hello.extend_from_slice(&STORE_MAGIC);
        hello.extend_from_slice(&STORE_VERSION.to_le_bytes());
        hello.extend_from_slice(&(token.len() as u16).to_le_bytes());
        hello.extend_from_slice(token.as_bytes());
        (&sock)
            .write_all(&hello)
            .map_err(|e| TransportError::io("sending store handshake", e))?;
        let mut st = [0u8; 1];
        (&sock)
            .read_exact(&mut st)
            .map_err(|e| TransportError::io("reading store handshake reply", e))?;
        match st[0] {
            ST_OK => Ok(sock),
            ST_REFUSED => Err(TransportError::Protocol(format!(
                "the bootstrap store at {a} refused our job token"
            ))),
            other => Err(TransportError::Protocol(format!(
                "unexpected store handshake reply {other}"
            ))),
        }
    }

    /// The server address this client is connected to.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The default timeout of calls that take none.
    pub fn default_timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the timeout of later requests (and with it the margin a request may take beyond its
    /// own wait), e.g. shorter than the connection's once it is made.
    pub fn set_default_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn fail(&mut self, what: String) -> TransportError {
        self.broken = Some(what.clone());
        TransportError::PeerLost {
            peer: 0,
            detail: format!("bootstrap store: {what}"),
        }
    }

    /// Sends one request and reads its response, waiting at most `wait` (plus a margin for the
    /// network) for it.
    fn call(&mut self, payload: &[u8], wait: Duration) -> Result<Vec<u8>> {
        if self.closed {
            return Err(TransportError::StoreClosed);
        }
        if let Some(b) = &self.broken {
            return Err(TransportError::PeerLost {
                peer: 0,
                detail: format!("bootstrap store connection unusable after an earlier error: {b}"),
            });
        }
        if payload.len() > MAX_FRAME {
            return Err(TransportError::Config(format!(
                "store request of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
                payload.len()
            )));
        }
        let _ = self
            .sock
            .set_write_timeout(Some(self.timeout.max(Duration::from_millis(100))));
        if let Err(e) = write_frame(&self.sock, payload) {
            return Err(self.fail(format!("sending request: {e}")));
        }
        // The margin covers the network and a busy server; it scales with the client's timeout
        // (not this call's wait) so that a short poll (the failure watcher asks every 100 ms)
        // tolerates a server slowed by hundreds of ranks on a few cores, while a client made
        // for quick calls (a short default timeout) still gives up quickly.
        let margin = CLIENT_MARGIN
            .min(self.timeout)
            .saturating_add(Duration::from_millis(500));
        let deadline = Deadline::after(wait.saturating_add(margin));
        let _ = self.sock.set_read_timeout(Some(Duration::from_millis(200)));
        let mut len = [0u8; 4];
        if let Err(e) = read_full(&self.sock, &mut len, &deadline) {
            return Err(self.fail(format!("reading response: {e}")));
        }
        let n = u32::from_le_bytes(len) as usize;
        if n == 0 || n > MAX_FRAME {
            return Err(self.fail(format!("response frame length {n} out of range")));
        }
        let mut resp = vec![0u8; n];
        if let Err(e) = read_full(&self.sock, &mut resp, &deadline) {
            return Err(self.fail(format!("reading response: {e}")));
        }
        match resp[0] {
            ST_OK => {
                resp.remove(0);
                Ok(resp)
            }
            ST_CLOSED => {
                self.closed = true;
                Err(TransportError::StoreClosed)
            }
            ST_TIMEOUT => Err(TransportError::Timeout {
                what: "waiting in the bootstrap store".into(),
                after: wait,
            }),
            ST_ERROR => Err(TransportError::Protocol(format!(
                "store error: {}",
                String::from_utf8_lossy(&resp[1..])
            ))),
            ST_TOO_LARGE => match resp[1..].first_chunk::<8>() {
                Some(b) => Err(TransportError::StoreTooLarge {
                    keys: 0,
                    bytes: u64::from_le_bytes(*b),
                    limit: MAX_FRAME,
                }),
                None => Err(self.fail("truncated TOO_LARGE answer".into())),
            },
            other => Err(self.fail(format!("unknown response status {other}"))),
        }
    }

    fn key_request(op: u8, key: &str) -> Vec<u8> {
        let mut v = vec![op];
        put_key(&mut v, key.as_bytes());
        v
    }

    /// Stores `value` under `key` (replacing any previous value).
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        self.set_within(key, value, self.timeout)
    }

    /// [`StoreClient::set`], giving up on the answer after about `wait` plus the client's
    /// margin instead of its timeout (a failure report must not wait long on a lost store).
    pub fn set_within(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<()> {
        let mut v = Self::key_request(OP_SET, key);
        v.extend_from_slice(value);
        self.call(&v, wait).map(|_| ())
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut v = vec![OP_GET];
        v.extend_from_slice(&(timeout.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        put_key(&mut v, key.as_bytes());
        self.call(&v, timeout).map_err(|e| match e {
            TransportError::Timeout { after, .. } => TransportError::Timeout {
                what: format!("waiting for store key {key:?}"),
                after,
            },
            e => e,
        })
    }

    /// Waits up to `timeout` until every key in `keys` is set.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut v = vec![OP_WAIT];
        v.extend_from_slice(&(timeout.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        v.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_key(&mut v, k.as_bytes());
        }
        self.call(&v, timeout).map(|_| ()).map_err(|e| match e {
            TransportError::Timeout { after, .. } => TransportError::Timeout {
                what: format!("waiting for store keys {keys:?}"),
                after,
            },
            e => e,
        })
    }

    /// Waits up to `timeout` until every key in `keys` is set and returns their values, in
    /// order, in one round trip (a rank's peer records: one request instead of one per peer).
    /// A request or answer too large for one frame is asked for in halves (more round trips,
    /// same result).
    pub fn get_all(&mut self, keys: &[String], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let deadline = Deadline::after(timeout);
        let mut values = Vec::with_capacity(keys.len());
        self.get_all_into(keys, &deadline, timeout, &mut values)?;
        Ok(values)
    }

    fn get_all_into(
        &mut self,
        keys: &[String],
        deadline: &Deadline,
        timeout: Duration,
        values: &mut Vec<Vec<u8>>,
    ) -> Result<()> {
        let mut v = vec![OP_GET_ALL];
        let wait = deadline.remaining();
        v.extend_from_slice(&(wait.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        v.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_key(&mut v, k.as_bytes());
        }
        let halve = |this: &mut Self, values: &mut Vec<Vec<u8>>| {
            let (a, b) = keys.split_at(keys.len() / 2);
            this.get_all_into(a, deadline, timeout, values)?;
            this.get_all_into(b, deadline, timeout, values)
        };
        if v.len() > MAX_FRAME && keys.len() > 1 {
            return halve(self, values);
        }
        let body = match self.call(&v, wait) {
            Ok(body) => body,
            Err(TransportError::StoreTooLarge { .. }) if keys.len() > 1 => {
                return halve(self, values)
            }
            Err(TransportError::StoreTooLarge { bytes, limit, .. }) => {
                return Err(TransportError::StoreTooLarge {
                    keys: keys.len(),
                    bytes,
                    limit,
                })
            }
            Err(TransportError::Timeout { .. }) => {
                return Err(TransportError::Timeout {
                    what: format!("waiting for {} store keys", keys.len()),
                    after: timeout,
                })
            }
            Err(e) => return Err(e),
        };
        let mut c = Cursor { buf: &body };
        let start = values.len();
        for _ in keys {
            match c.key() {
                Some(k) => values.push(k.to_vec()),
                None => break,
            }
        }
        if values.len() - start != keys.len() || c.end().is_none() {
            return Err(TransportError::Protocol("bad GET_ALL response".into()));
        }
        Ok(())
    }

    /// Atomically adds `delta` to the counter `key` (missing counts as 0); returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        self.add_within(key, delta, self.timeout)
    }

    /// [`StoreClient::add`], giving up on the answer after about `wait` instead of the client's
    /// timeout (for a last report that must not hold up a shutdown).
    pub fn add_within(&mut self, key: &str, delta: i64, wait: Duration) -> Result<i64> {
        let mut v = vec![OP_ADD];
        v.extend_from_slice(&delta.to_le_bytes());
        put_key(&mut v, key.as_bytes());
        let r = self.call(&v, wait)?;
        let b: [u8; 8] = r
            .as_slice()
            .try_into()
            .map_err(|_| TransportError::Protocol("bad ADD response".into()))?;
        Ok(i64::from_le_bytes(b))
    }

    /// Whether `key` is set (does not wait).
    pub fn check(&mut self, key: &str) -> Result<bool> {
        let r = self.call(&Self::key_request(OP_CHECK, key), self.timeout)?;
        Ok(r.first().copied() == Some(1))
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&mut self, key: &str) -> Result<bool> {
        let r = self.call(&Self::key_request(OP_DELETE, key), self.timeout)?;
        Ok(r.first().copied() == Some(1))
    }

    /// Names this connection `key`, a session the server watches from now on (see the module
    /// docs); `value` says who the client is. Requests on this connection keep it alive.
    pub fn name_session(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut v = Self::key_request(OP_NAME, key);
        v.extend_from_slice(value);
        self.call(&v, self.timeout).map(|_| ())
    }

    /// Every session whose name starts with `prefix`, by name.
    pub fn sessions(&mut self, prefix: &str) -> Result<Vec<SessionInfo>> {
        let body = self.call(&Self::key_request(OP_SESSIONS, prefix), self.timeout)?;
        let bad = || TransportError::Protocol("bad SESSIONS response".into());
        let mut c = Cursor { buf: &body };
        let n = c.u32().ok_or_else(bad)? as usize;
        let mut out = Vec::with_capacity(n.min(MAX_SESSIONS));
        for _ in 0..n {
            let key = c.key().ok_or_else(bad)?;
            let value = c.key().ok_or_else(bad)?;
            let open = c.u8().ok_or_else(bad)? == 1;
            let idle = Duration::from_millis(c.u64().ok_or_else(bad)?);
            out.push(SessionInfo {
                key: String::from_utf8_lossy(key).into_owned(),
                value: value.to_vec(),
                open,
                idle,
            });
        }
        c.end().ok_or_else(bad)?;
        Ok(out)
    }

    /// A barrier over the store: every one of `n` participants calls it with the same `name`;
    /// returns once all have arrived (or fails after `timeout`). Each `name` is single-use.
    pub fn barrier(&mut self, name: &str, n: usize, timeout: Duration) -> Result<()> {
        let count = self.add(&format!("{name}/count"), 1)?;
        let done = format!("{name}/done");
        if count >= n as i64 {
            // The last to arrive is through: a further request could reach the store after
            // rank 0, released by this `set`, has returned and shut the store down.
            return self.set(&done, b"1");
        }
        self.wait(&[&done], timeout)
    }
}
