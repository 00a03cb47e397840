//! Connected pairs inside this process, for tests and benchmarks.

use super::connection::NetConnection;
use super::layout::NetLink;
use crate::error::{Result, TransportError};
use crate::net::Provider;
use crate::util::Deadline;
use std::sync::Arc;
use std::time::Duration;

/// Two connected ends over `provider` for tests and benchmarks (ranks 0 and 1 in this process),
/// each with a `cap`-byte ring, their handshakes over a loopback TCP pair (rendezvous from
/// [`TEST_RENDEZVOUS`]).
pub fn local_pair(
    provider: Arc<dyn Provider>,
    cap: usize,
) -> Result<(NetConnection, NetConnection)> {
    local_pair_striped(provider, cap, 1)
}

/// Smallest pinned receive offered for rendezvous by the pairs made for tests and benchmarks
/// ([`local_pair`]), so that the conformance suite covers the path.
pub const TEST_RENDEZVOUS: usize = 64 << 10;

/// [`local_pair`] with `streams` endpoints per connection (rendezvous from
/// [`TEST_RENDEZVOUS`]).
pub fn local_pair_striped(
    provider: Arc<dyn Provider>,
    cap: usize,
    streams: usize,
) -> Result<(NetConnection, NetConnection)> {
    local_pair_shaped(
        provider,
        NetLink {
            ring: cap,
            streams,
            rendezvous: TEST_RENDEZVOUS,
        },
    )
}

/// [`local_pair`] with connections shaped by `link`.
pub fn local_pair_shaped(
    provider: Arc<dyn Provider>,
    link: NetLink,
) -> Result<(NetConnection, NetConnection)> {
    let (a, b) = crate::tcp::local_pair(0, 1, crate::tcp::loopback(crate::tcp::Family::Inet))?;
    let deadline = Deadline::after(Duration::from_secs(30));
    let p = Arc::clone(&provider);
    let d = deadline;
    let other = std::thread::spawn(move || NetConnection::establish(0, Box::new(b), &p, link, &d));
    let mine = NetConnection::establish(1, Box::new(a), &provider, link, &deadline);
    let theirs = other
        .join()
        .map_err(|_| TransportError::Protocol("network handshake thread panicked".into()))?;
    Ok((mine?, theirs?))
}
