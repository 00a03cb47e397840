//! The built-in store's client side ([`TcpBackend`]): one connection to a
//! [`StoreServer`](crate::StoreServer), every call with a timeout.

use crate::backend::{SessionInfo, StoreBackend};
use crate::error::{Result, StoreError};
use crate::wire::*;
use crate::{
    MAX_FRAME, MAX_SESSIONS, MAX_STORE_TOKEN, STORE_IO_TIMEOUT, STORE_MAGIC, STORE_VERSION,
};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::{Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;
use weftcc_base::Deadline;

/// Extra time a client waits beyond a server-side timeout before it gives up on the server.
const CLIENT_MARGIN: Duration = Duration::from_secs(10);

/// A connection to the built-in store. Every call has a timeout.
pub(crate) struct TcpBackend {
    sock: Socket,
    addr: SocketAddr,
    timeout: Duration,
    closed: bool,
    broken: Option<String>,
}

impl TcpBackend {
    /// Connects to `addr` (`"host:port"` or `"[v6]:port"`; host names are resolved) and presents
    /// `token`, retrying until `timeout` while the server is not up yet. `timeout` is also the
    /// default timeout of later calls that take none.
    pub(crate) fn connect(addr: &str, token: &str, timeout: Duration) -> Result<TcpBackend> {
        if token.len() > MAX_STORE_TOKEN {
            return Err(StoreError::Config(format!(
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
                                return Ok(TcpBackend {
                                    sock,
                                    addr: a,
                                    timeout,
                                    closed: false,
                                    broken: None,
                                })
                            }
                            Err(e @ (StoreError::Refused { .. } | StoreError::Protocol(_))) => {
                                return Err(e)
                            }
                            Err(e) => last_err = e.to_string(),
                        }
                    }
                }
                Err(e) => {
                    if !addr.contains(':') {
                        return Err(StoreError::Config(format!(
                            "store address {addr:?} must be host:port or [v6]:port"
                        )));
                    }
                    last_err = format!("resolving {addr}: {e}");
                }
            }
            if deadline.expired() {
                return Err(StoreError::Timeout {
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
            .map_err(|e| StoreError::io("creating store client socket", e))?;
        let slice = deadline
            .remaining()
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(1));
        sock.connect_timeout(&SockAddr::from(a), slice)
            .map_err(|e| StoreError::io(format!("connecting to store {a}"), e))?;
        let _ = sock.set_nodelay(true);
        let io = deadline
            .remaining()
            .max(Duration::from_millis(100))
            .min(STORE_IO_TIMEOUT);
        sock.set_write_timeout(Some(io))
            .map_err(|e| StoreError::io("set_write_timeout", e))?;
        sock.set_read_timeout(Some(io))
            .map_err(|e| StoreError::io("set_read_timeout", e))?;
        let mut hello = Vec::with_capacity(8 + token.len());
        hello.extend_from_slice(&STORE_MAGIC);
        hello.extend_from_slice(&STORE_VERSION.to_le_bytes());
        hello.extend_from_slice(&(token.len() as u16).to_le_bytes());
        hello.extend_from_slice(token.as_bytes());
        (&sock)
            .write_all(&hello)
            .map_err(|e| StoreError::io("sending store handshake", e))?;
        let mut st = [0u8; 1];
        (&sock)
            .read_exact(&mut st)
            .map_err(|e| StoreError::io("reading store handshake reply", e))?;
        match st[0] {
            ST_OK => Ok(sock),
            ST_REFUSED => Err(StoreError::Refused { addr: a }),
            other => Err(StoreError::Protocol(format!(
                "unexpected store handshake reply {other}"
            ))),
        }
    }

    fn fail(&mut self, what: String) -> StoreError {
        self.broken = Some(what.clone());
        StoreError::Lost { detail: what }
    }

    /// Sends one request and reads its response, waiting at most `wait` (plus a margin for the
    /// network) for it.
    fn call(&mut self, payload: &[u8], wait: Duration) -> Result<Vec<u8>> {
        if self.closed {
            return Err(StoreError::Closed);
        }
        if let Some(b) = &self.broken {
            return Err(StoreError::Lost {
                detail: format!("unusable after an earlier error: {b}"),
            });
        }
        if payload.len() > MAX_FRAME {
            return Err(StoreError::Config(format!(
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
                Err(StoreError::Closed)
            }
            ST_TIMEOUT => Err(StoreError::Timeout {
                what: "waiting in the bootstrap store".into(),
                after: wait,
            }),
            ST_INTERRUPTED => Err(StoreError::Interrupted {
                key: String::new(),
                value: resp[1..].to_vec(),
            }),
            ST_ERROR => Err(StoreError::Rejected(
                String::from_utf8_lossy(&resp[1..]).into_owned(),
            )),
            ST_TOO_LARGE => match resp[1..].first_chunk::<8>() {
                Some(b) => Err(StoreError::TooLarge {
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
}

impl StoreBackend for TcpBackend {
    fn set(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<()> {
        let mut v = Self::key_request(OP_SET, key);
        v.extend_from_slice(value);
        self.call(&v, wait).map(|_| ())
    }

    fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>> {
        let mut v = vec![OP_GET];
        v.extend_from_slice(&(wait.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        put_key(&mut v, key.as_bytes());
        self.call(&v, wait)
    }

    fn wait(&mut self, keys: &[&str], wait: Duration) -> Result<()> {
        let mut v = vec![OP_WAIT];
        v.extend_from_slice(&(wait.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        v.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_key(&mut v, k.as_bytes());
        }
        self.call(&v, wait).map(|_| ())
    }

    fn get_all(
        &mut self,
        keys: &[String],
        unless: Option<&str>,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let mut v = vec![if unless.is_some() {
            OP_GET_ALL_UNLESS
        } else {
            OP_GET_ALL
        }];
        v.extend_from_slice(&(wait.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
        if let Some(key) = unless {
            put_key(&mut v, key.as_bytes());
        }
        v.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_key(&mut v, k.as_bytes());
        }
        if v.len() > MAX_FRAME {
            return Err(StoreError::TooLarge {
                keys: keys.len(),
                bytes: v.len() as u64,
                limit: MAX_FRAME,
            });
        }
        let body = self.call(&v, wait)?;
        let mut c = Cursor { buf: &body };
        let mut values = Vec::with_capacity(keys.len());
        for _ in keys {
            match c.key() {
                Some(k) => values.push(k.to_vec()),
                None => break,
            }
        }
        if values.len() != keys.len() || c.end().is_none() {
            return Err(StoreError::Protocol("bad GET_ALL response".into()));
        }
        Ok(values)
    }

    fn add(&mut self, key: &str, delta: i64, wait: Duration) -> Result<i64> {
        let mut v = vec![OP_ADD];
        v.extend_from_slice(&delta.to_le_bytes());
        put_key(&mut v, key.as_bytes());
        let r = self.call(&v, wait)?;
        let b: [u8; 8] = r
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Protocol("bad ADD response".into()))?;
        Ok(i64::from_le_bytes(b))
    }

    fn set_if_absent(&mut self, key: &str, value: &[u8], wait: Duration) -> Result<Vec<u8>> {
        let mut v = Self::key_request(OP_SET_IF_ABSENT, key);
        v.extend_from_slice(value);
        self.call(&v, wait)
    }

    fn check(&mut self, key: &str) -> Result<bool> {
        let r = self.call(&Self::key_request(OP_CHECK, key), self.timeout)?;
        Ok(r.first().copied() == Some(1))
    }

    fn delete(&mut self, key: &str) -> Result<bool> {
        let r = self.call(&Self::key_request(OP_DELETE, key), self.timeout)?;
        Ok(r.first().copied() == Some(1))
    }

    fn name_session(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut v = Self::key_request(OP_NAME, key);
        v.extend_from_slice(value);
        self.call(&v, self.timeout).map(|_| ())
    }

    fn sessions(&mut self, prefix: &str) -> Result<Vec<SessionInfo>> {
        let body = self.call(&Self::key_request(OP_SESSIONS, prefix), self.timeout)?;
        let bad = || StoreError::Protocol("bad SESSIONS response".into());
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

    fn describe(&self) -> String {
        format!("the bootstrap store at {}", self.addr)
    }

    fn socket_addr(&self) -> Option<SocketAddr> {
        Some(self.addr)
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn runs_session_hooks(&self) -> bool {
        true
    }
}
