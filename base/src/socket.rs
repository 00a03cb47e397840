//! Listening TCP sockets as weftcc's servers use them (the bootstrap store, the TCP transports'
//! listeners): binding, and accepting within a time.

use crate::OsError;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use socket2::{Domain, Protocol, Socket, Type};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Duration;

/// The next connection on `listener`, waiting up to `wait_ms` for one, and the peer's address;
/// `None` when none came. A failed accept is logged (`what` names the listener) and paced, so a
/// caller's loop can simply try again.
pub fn accept_within(listener: &Socket, wait_ms: u16, what: &str) -> Option<(Socket, String)> {
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
pub fn listen(
    addr: SocketAddr,
    buffer: Option<usize>,
    what: &str,
) -> Result<(Socket, SocketAddr), OsError> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| OsError::new(format!("creating the {what} socket"), e))?;
    let _ = sock.set_reuse_address(true);
    if let Some(bytes) = buffer {
        let _ = sock.set_send_buffer_size(bytes);
        let _ = sock.set_recv_buffer_size(bytes);
    }
    sock.bind(&addr.into())
        .map_err(|e| OsError::new(format!("binding the {what} to {addr}"), e))?;
    sock.listen(1024)
        .map_err(|e| OsError::new(format!("{what} listen"), e))?;
    sock.set_nonblocking(true)
        .map_err(|e| OsError::new(format!("making the {what} non-blocking"), e))?;
    let local = sock
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .ok_or_else(|| OsError::new(format!("{what} address"), std::io::Error::other("unknown")))?;
    Ok((sock, local))
}
