//! The server: an acceptor thread and a thread per connection over one locked map.

use crate::error::{Result, StoreError};
use crate::wire::*;
use crate::{MAX_CONNECTIONS, MAX_FRAME, MAX_SESSIONS, MAX_STORE_TOKEN, STORE_IO_TIMEOUT};
use crate::{STORE_MAGIC, STORE_VERSION};
use socket2::Socket;
use std::collections::{BTreeMap, HashMap};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weftcc_base::{lock, Deadline};

/// How often idle connection threads look at the shutdown flag (a backstop: shutdown also
/// shuts their sockets' read side down).
const IDLE_POLL: Duration = Duration::from_millis(500);

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

    /// [`StoreClient::set`](crate::StoreClient::set).
    pub fn set(&mut self, key: &str, value: &[u8]) {
        self.map.insert(key.as_bytes().to_vec(), value.to_vec());
    }

    /// [`StoreClient::add`](crate::StoreClient::add); a value that is not a counter is left alone
    /// (and `None` returned).
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
            return Err(StoreError::Config(format!(
                "store token is {} bytes; at most {MAX_STORE_TOKEN} are supported",
                token.len()
            )));
        }
        let (sock, local) = weftcc_base::socket::listen(bind, None, "store")?;
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
            .map_err(|e| StoreError::io("starting store thread", e))?;
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
        let Some((sock, from)) = weftcc_base::socket::accept_within(&listener, 50, "store") else {
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
