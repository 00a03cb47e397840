//! The wire format both ends share (see the crate docs): opcodes, answer statuses, frames.

use socket2::Socket;
use std::io::{ErrorKind, Read, Write};
use weftcc_base::Deadline;

// Request opcodes.
pub(crate) const OP_SET: u8 = 1;
pub(crate) const OP_GET: u8 = 2;
pub(crate) const OP_WAIT: u8 = 3;
pub(crate) const OP_ADD: u8 = 4;
pub(crate) const OP_CHECK: u8 = 5;
pub(crate) const OP_DELETE: u8 = 6;
pub(crate) const OP_GET_ALL: u8 = 7;
pub(crate) const OP_NAME: u8 = 8;
pub(crate) const OP_SESSIONS: u8 = 9;
pub(crate) const OP_GET_ALL_UNLESS: u8 = 10;
pub(crate) const OP_SET_IF_ABSENT: u8 = 11;

// Answer statuses.
pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_TIMEOUT: u8 = 1;
pub(crate) const ST_CLOSED: u8 = 2;
pub(crate) const ST_ERROR: u8 = 3;
pub(crate) const ST_TOO_LARGE: u8 = 5;
pub(crate) const ST_REFUSED: u8 = 4;
pub(crate) const ST_INTERRUPTED: u8 = 6;

/// Whether a socket error is its read or write timeout running out.
pub(crate) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Reads exactly `buf.len()` bytes, retrying socket timeouts until `deadline`.
pub(crate) fn read_full(sock: &Socket, buf: &mut [u8], deadline: &Deadline) -> std::io::Result<()> {
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

pub(crate) fn write_frame(sock: &Socket, payload: &[u8]) -> std::io::Result<()> {
    let mut v = Vec::with_capacity(4 + payload.len());
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    (&*sock).write_all(&v)
}

/// A cursor over a request or response payload that never reads past its end.
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Some(a)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Some(u64::from_le_bytes(a))
    }
    pub(crate) fn key(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
    /// `Some` when everything was read (a request carries nothing more).
    pub(crate) fn end(&self) -> Option<()> {
        self.buf.is_empty().then_some(())
    }
}

pub(crate) fn put_key(v: &mut Vec<u8>, key: &[u8]) {
    v.extend_from_slice(&(key.len() as u32).to_le_bytes());
    v.extend_from_slice(key);
}
