//! Plain TCP sockets as the transports use them: options, listening, accepting within a
//! time, dialling until the peer listens. Shared by [`crate::tcp`] and [`crate::tcp_stripes`].

use crate::error::{Result, TransportError};
use crate::util::Deadline;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Duration;

/// Socket buffer size asked for (send and receive).
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// Sets the options every connected stream gets: no delay, large buffers, keep-alive.
pub(crate) fn configure_stream(sock: &Socket) {
    let _ = sock.set_nodelay(true);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_keepalive(true);
}

/// The next connection on `listener`, waiting up to `wait_ms` for one, and the peer's address;
/// `None` when none came. A failed accept is logged (`what` names the listener) and paced, so a
/// caller's loop can simply try again.
pub(crate) fn accept_within(
    listener: &Socket,
    wait_ms: u16,
    what: &str,
) -> Option<(Socket, String)> {
    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    let _ = nix::poll::poll(&mut fds, PollTimeout::from(wait_ms));
    match listener.accept() {
        Ok((sock, from)) => {
            let from = from.as_socket().map(|a| a.to_string()).unwrap_or_default();
            Some((sock, from))
        }
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => None,
        Err(e) => {
            tracing::warn!(target: "weftcc::net", listener = what, error = %e, "accept failed");
            std::thread::sleep(Duration::from_millis(5));
            None
        }
    }
}

/// A non-blocking listening socket bound to `addr` (port 0: any), and the address it got.
/// `buffer` sets the kernel's socket buffers before `listen`, so accepted sockets inherit them
/// (window scaling is negotiated early). `what` names the listener in errors.
pub(crate) fn listen(
    addr: SocketAddr,
    buffer: Option<usize>,
    what: &str,
) -> Result<(Socket, SocketAddr)> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| TransportError::io(format!("creating the {what} socket"), e))?;
    let _ = sock.set_reuse_address(true);
    if let Some(bytes) = buffer {
        let _ = sock.set_send_buffer_size(bytes);
        let _ = sock.set_recv_buffer_size(bytes);
    }
    sock.bind(&addr.into())
        .map_err(|e| TransportError::io(format!("binding the {what} to {addr}"), e))?;
    sock.listen(1024)
        .map_err(|e| TransportError::io(format!("{what} listen"), e))?;
    sock.set_nonblocking(true)
        .map_err(|e| TransportError::io(format!("making the {what} non-blocking"), e))?;
    let local = sock
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .ok_or_else(|| TransportError::Io {
            what: format!("{what} address"),
            message: "unknown".into(),
        })?;
    Ok((sock, local))
}

/// A TCP stream connected to `peer` at `addr`, retrying while it is not listening yet, until
/// `deadline` (`timeout` is its length, for the error).
pub(crate) fn dial_socket(
    peer: usize,
    addr: SocketAddr,
    deadline: &Deadline,
    timeout: Duration,
) -> Result<Socket> {
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
                    return Err(TransportError::Timeout {
                        what: format!("connecting to rank {peer} at {addr} (last error: {e})"),
                        after: timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(20).min(deadline.remaining()));
            }
        }
    }
}
