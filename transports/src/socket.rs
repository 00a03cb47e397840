//! Plain TCP sockets as the transports use them: options and dialling until the peer listens;
//! listening and accepting within a time come from `weftcc-base` (the store listens the same
//! way). Shared by [`crate::tcp`] and [`crate::tcp_stripes`].

use crate::error::{Result, TransportError};
use crate::util::Deadline;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::net::SocketAddr;
use std::time::Duration;
pub(crate) use weftcc_base::socket::{accept_within, listen};

/// Socket buffer size asked for (send and receive).
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// Sets the options every connected stream gets: no delay, large buffers, keep-alive.
pub(crate) fn configure_stream(sock: &Socket) {
    let _ = sock.set_nodelay(true);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_keepalive(true);
}

/// A TCP stream connected to `peer` at `addr`, retrying while it is not listening yet, until
/// `deadline`.
pub(crate) fn dial_socket(peer: usize, addr: SocketAddr, deadline: &Deadline) -> Result<Socket> {
    let target = SockAddr::from(addr);
    loop {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| TransportError::io("creating socket", e))?;
        configure_stream(&sock);
        let slice = deadline
            .remaining()
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(1));
        match sock.connect_timeout(&target, slice) {
            Ok(()) => return Ok(sock),
            Err(e) => {
                if deadline.expired() {
                    return Err(deadline.timeout_error(format!(
                        "connecting to rank {peer} at {addr} (last error: {e})"
                    )));
                }
                std::thread::sleep(Duration::from_millis(20).min(deadline.remaining()));
            }
        }
    }
}
