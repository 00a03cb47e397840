//! weftcc's bootstrap key-value store: rank 0 serves it ([`StoreServer`]), every rank talks to it
//! with a [`StoreClient`]; ranks exchange their addresses, failure notes and progress through it,
//! and its sessions say which ranks live. Every failure is a [`StoreError`].
//!
//! A [`StoreClient`] is one front end over a [`StoreBackend`]: the built-in store's TCP protocol
//! (below) for a `host:port` address, or an etcd v3 cluster for `etcd://host:port[,host:port…]`
//! (see the `etcd` module: leases for sessions, polling waits, failover across endpoints). Both
//! pass the same conformance tests (`store/tests/conformance.rs`).
//!
//! The crate sits below the transports (their mesh exchanges addresses through a client) and
//! needs only `weftcc-base` (lock, deadlines, listening sockets).
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
//!  10 GET_ALL_UNLESS timeout_ms u64 | unless key | count u32 | keys
//!                                                 as GET_ALL | INTERRUPTED value of `unless`
//!  11 SET_IF_ABSENT key | value (rest of frame)   OK value the key holds (the first writer's)
//!   key = length u32 | bytes;  status: 0 OK, 1 TIMEOUT, 2 CLOSED, 3 ERROR (body = message),
//!   5 TOO_LARGE (body = bytes u64: a GET_ALL answer would exceed MAX_FRAME), 6 INTERRUPTED
//! ```
//!
//! [`StoreClient::get_all`] answers any number of keys: a request or an answer that would not
//! fit one frame is split in halves and asked again, so only a single value larger than a frame
//! (which SET cannot store) could fail, with [`StoreError::TooLarge`].
//!
//! The server is one thread running an event loop (epoll) over every connection, whatever their
//! number: a wait is a pending answer, indexed by the first key it misses and by its deadline,
//! given when that key is set or the time is up; nobody polls. An oversized length, a frame or
//! handshake that does not arrive in full within [`STORE_IO_TIMEOUT`], an unknown opcode or
//! garbage closes that one connection (logged with `tracing::warn!`) without allocating the
//! claimed length; other clients are unaffected. On shutdown every pending wait is
//! answered with CLOSED (the client reports [`StoreError::Closed`]) and every connection
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

#![forbid(unsafe_code)]

mod backend;
mod client;
mod error;
mod etcd;
mod server;
mod tcp;
mod wire;

pub use backend::{SessionInfo, SessionStore, StoreBackend};
pub use client::StoreClient;
pub use error::{Result, StoreError};
pub use server::{LocalStore, SessionHook, StoreServer, Traffic};

use std::time::Duration;

/// Magic bytes of the store handshake.
pub const STORE_MAGIC: [u8; 4] = *b"WFST";
/// Version of the store protocol.
pub const STORE_VERSION: u16 = 1;
/// Largest frame accepted in either direction (16 MiB).
pub const MAX_FRAME: usize = 16 << 20;
/// Most simultaneous connections one server keeps (each rank holds three; the process's
/// open-files limit must allow them too).
pub const MAX_CONNECTIONS: usize = 1 << 17;
/// Longest token accepted.
pub const MAX_STORE_TOKEN: usize = 1024;
/// Most sessions ([`StoreClient::name_session`]) one server keeps, closed ones included.
pub const MAX_SESSIONS: usize = 1 << 16;
/// Time a new connection has to present its handshake, and a started frame to arrive in full.
pub const STORE_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Lifetime of an etcd store client's lease: a client that dies reads as closed within it.
pub const ETCD_LEASE_TTL: Duration = Duration::from_secs(3);
/// How often an etcd store client renews its lease and stamps its session's record: well under
/// a second, so that a live client's session never reads as a second silent (what `weft status`
/// and timeouts call a rank that gives no sign of life).
pub const ETCD_KEEPALIVE_EVERY: Duration = Duration::from_millis(400);

/// Whether `addr` names an etcd cluster (`etcd://…`), a store that no rank serves.
pub fn is_etcd_address(addr: &str) -> bool {
    addr.starts_with(etcd::ETCD_SCHEME)
}
