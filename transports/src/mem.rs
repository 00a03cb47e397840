//! In-process transport for tests: two threads stand in for two ranks.
//!
//! Each direction is a byte ring behind a `Mutex`; each rank has a [`Doorbell`] (a counter with a
//! `Condvar`) that its peers ring after sending data or freeing space, and a [`MemWaiter`] that
//! sleeps on it. Dropping one end marks it closed; the other end reads what was buffered and then
//! sees [`TransportError::PeerLost`].

use crate::conn::{Connection, IdleWaiter, Interest};
use crate::error::{Result, TransportError};
use crate::util::lock;
use crate::util::AlignedBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct BellInner {
    count: Mutex<u64>,
    cv: Condvar,
}

/// A per-rank wake-up counter shared by all of that rank's in-process connections.
#[derive(Clone)]
pub struct Doorbell {
    inner: Arc<BellInner>,
}

impl Default for Doorbell {
    fn default() -> Self {
        Self::new()
    }
}

impl Doorbell {
    /// A new doorbell with count 0.
    pub fn new() -> Self {
        Doorbell {
            inner: Arc::new(BellInner {
                count: Mutex::new(0),
                cv: Condvar::new(),
            }),
        }
    }

    /// A waiter that sleeps until this doorbell is rung (it counts rings from now on).
    pub fn waiter(&self) -> MemWaiter {
        let last = *lock(&self.inner.count);
        MemWaiter {
            bell: self.inner.clone(),
            last,
        }
    }

    fn ring(&self) {
        let mut c = lock(&self.inner.count);
        *c = c.wrapping_add(1);
        drop(c);
        self.inner.cv.notify_all();
    }
}

/// [`IdleWaiter`] for in-process connections: sleeps on its rank's [`Doorbell`].
pub struct MemWaiter {
    bell: Arc<BellInner>,
    last: u64,
}

impl IdleWaiter for MemWaiter {
    fn wait(&mut self, _interest: &[Interest], max: Duration) -> Result<()> {
        let start = Instant::now();
        let mut c = lock(&self.bell.count);
        while *c == self.last {
            let left = max.saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            c = match self.bell.cv.wait_timeout(c, left) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        self.last = *c;
        Ok(())
    }
}

struct Ring {
    buf: AlignedBuf,
    head: u64,
    tail: u64,
}

impl Ring {
    fn cap(&self) -> usize {
        self.buf.len()
    }
    fn used(&self) -> usize {
        self.head.wrapping_sub(self.tail) as usize
    }
}

struct Shared {
    /// `rings[i]` carries bytes sent by end `i`.
    rings: [Ring; 2],
    /// `closed[i]`: end `i` was dropped.
    closed: [bool; 2],
}

/// One end of an in-process connection (see [`pair`]).
pub struct MemConnection {
    shared: Arc<Mutex<Shared>>,
    side: usize,
    peer: usize,
    my_bell: Doorbell,
    peer_bell: Doorbell,
}

/// Creates a connected pair between `rank_a` and `rank_b`, each direction buffering up to
/// `capacity_bytes` (rounded up to a multiple of 8, at least 8). Each end gets its own new
/// [`Doorbell`]; use [`MemConnection::waiter`] to wait on it.
pub fn pair(rank_a: usize, rank_b: usize, capacity_bytes: usize) -> (MemConnection, MemConnection) {
    pair_with(
        rank_a,
        &Doorbell::new(),
        rank_b,
        &Doorbell::new(),
        capacity_bytes,
    )
}

/// Like [`pair`], but ringing the given per-rank doorbells, so that one [`MemWaiter`] per rank
/// covers all of that rank's connections.
pub fn pair_with(
    rank_a: usize,
    bell_a: &Doorbell,
    rank_b: usize,
    bell_b: &Doorbell,
    capacity_bytes: usize,
) -> (MemConnection, MemConnection) {
    let cap = capacity_bytes.max(8).div_ceil(8).saturating_mul(8);
    let ring = || Ring {
        buf: AlignedBuf::new(cap),
        head: 0,
        tail: 0,
    };
    let shared = Arc::new(Mutex::new(Shared {
        rings: [ring(), ring()],
        closed: [false, false],
    }));
    let a = MemConnection {
        shared: shared.clone(),
        side: 0,
        peer: rank_b,
        my_bell: bell_a.clone(),
        peer_bell: bell_b.clone(),
    };
    let b = MemConnection {
        shared,
        side: 1,
        peer: rank_a,
        my_bell: bell_b.clone(),
        peer_bell: bell_a.clone(),
    };
    (a, b)
}

impl MemConnection {
    /// A waiter on this end's doorbell (woken by this connection's peer, and by any other
    /// connection that shares the doorbell).
    pub fn waiter(&self) -> MemWaiter {
        self.my_bell.waiter()
    }

    fn lost(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer,
            detail: "in-process peer closed its end".into(),
        }
    }
}

impl Connection for MemConnection {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        let mut g = lock(&self.shared);
        if g.closed[1 - self.side] {
            return Err(self.lost());
        }
        let ring = &mut g.rings[self.side];
        let cap = ring.cap();
        let n = data.len().min(cap - ring.used());
        if n == 0 {
            return Ok(0);
        }
        let off = (ring.head % cap as u64) as usize;
        let first = n.min(cap - off);
        let buf = ring.buf.as_mut_slice();
        buf[off..off + first].copy_from_slice(&data[..first]);
        buf[..n - first].copy_from_slice(&data[first..n]);
        ring.head = ring.head.wrapping_add(n as u64);
        drop(g);
        self.peer_bell.ring();
        Ok(n)
    }

    fn try_recv(&mut self, max: usize, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize> {
        let mut g = lock(&self.shared);
        let peer_closed = g.closed[1 - self.side];
        let ring = &mut g.rings[1 - self.side];
        let avail = ring.used();
        if avail == 0 {
            return if peer_closed { Err(self.lost()) } else { Ok(0) };
        }
        if max == 0 {
            return Ok(0);
        }
        let cap = ring.cap();
        let off = (ring.tail % cap as u64) as usize;
        let n = avail.min(cap - off).min(max);
        let used = consume(&ring.buf.as_slice()[off..off + n]).min(n);
        ring.tail = ring.tail.wrapping_add(used as u64);
        drop(g);
        if used > 0 {
            self.peer_bell.ring();
        }
        Ok(used)
    }

    fn check_peer(&mut self) -> Result<()> {
        let g = lock(&self.shared);
        if g.closed[1 - self.side] && g.rings[1 - self.side].used() == 0 {
            return Err(self.lost());
        }
        Ok(())
    }
}

impl Drop for MemConnection {
    fn drop(&mut self) {
        lock(&self.shared).closed[self.side] = true;
        self.peer_bell.ring();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_close() {
        let (mut a, mut b) = pair(0, 1, 16);
        assert_eq!(a.try_send(b"hello world, this is long").unwrap(), 16);
        let mut got = Vec::new();
        b.try_recv(100, &mut |s| {
            got.extend_from_slice(s);
            s.len()
        })
        .unwrap();
        assert_eq!(&got, b"hello world, thi");
        drop(a);
        assert!(b.check_peer().is_err());
        assert!(matches!(
            b.try_recv(1, &mut |s| s.len()),
            Err(TransportError::PeerLost { .. })
        ));
    }
}
