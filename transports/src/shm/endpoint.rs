//! This rank's shared memory ([`ShmEndpoint`]): its doorbell, its incoming rings, and the
//! exchange of their descriptors with a peer.

use super::connection::ShmConnection;
use super::doorbell::ShmWaiter;
use super::segment::{create_object, Mapping};
use super::space::ring_capacity;
use crate::error::{Result, TransportError};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// This rank's shared memory: its doorbell (a header-only object every connected peer maps) and
/// the factory of its incoming rings, one per connected peer.
///
/// Every object is created under a unique name in /dev/shm and unlinked at once: peers receive
/// its file descriptor over a Unix socket ([`ShmEndpoint::connect_over`]) instead of opening a
/// name, so the memory lives exactly as long as a process holds a descriptor or mapping of it,
/// and a job killed with SIGKILL leaves nothing in /dev/shm. /dev/shm's size still bounds it (an
/// unlinked tmpfs file keeps its pages until the last mapping goes).
pub struct ShmEndpoint {
    bell: Arc<Mapping>,
    bell_fd: OwnedFd,
    token: String,
    namespace: String,
    rank: usize,
    capacity: usize,
}

/// A ring this rank made for one peer to write into, not yet connected.
pub struct IncomingRing {
    fd: OwnedFd,
    map: Mapping,
    peer: usize,
}

impl IncomingRing {
    /// The descriptor the peer maps.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl ShmEndpoint {
    /// Creates this rank's doorbell; rings made later hold `capacity` bytes (normalized by
    /// [`ring_capacity`]).
    pub fn create(
        token: &str,
        namespace: &str,
        rank: usize,
        capacity: usize,
    ) -> Result<ShmEndpoint> {
        if rank > u32::MAX as usize {
            return Err(TransportError::Config(format!(
                "rank {rank} too large for shared memory"
            )));
        }
        let capacity = ring_capacity(capacity);
        let (bell_fd, bell) = create_object(token, namespace, rank, &[], capacity)?;
        Ok(ShmEndpoint {
            bell: Arc::new(bell),
            bell_fd,
            token: token.to_string(),
            namespace: namespace.to_string(),
            rank,
            capacity,
        })
    }

    /// The rank this endpoint belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ring capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The doorbell's descriptor (peers map it to wake this rank).
    pub fn bell_fd(&self) -> BorrowedFd<'_> {
        self.bell_fd.as_fd()
    }

    /// Makes the ring `peer` will write into; /dev/shm's free space is checked first.
    pub fn incoming_ring(&self, peer: usize) -> Result<IncomingRing> {
        if peer == self.rank || peer > u32::MAX as usize {
            return Err(TransportError::Config(format!(
                "invalid peer rank {peer} for shared memory"
            )));
        }
        let (fd, map) = create_object(
            &self.token,
            &self.namespace,
            self.rank,
            &[peer],
            self.capacity,
        )?;
        Ok(IncomingRing { fd, map, peer })
    }

    /// Connects to `peer` given this rank's ring for it and the peer's doorbell and ring for this
    /// rank (descriptors it sent): maps them, checks they are what they claim, and attaches.
    pub fn connect(
        &self,
        incoming: IncomingRing,
        peer_bell: OwnedFd,
        peer_ring: OwnedFd,
    ) -> Result<ShmConnection> {
        let peer = incoming.peer;
        let bell = Mapping::from_fd(peer_bell, &format!("rank {peer}'s doorbell"))?;
        let remote = Mapping::from_fd(peer_ring, &format!("rank {peer}'s ring"))?;
        if bell.owner_rank() as usize != peer || bell.layout.nslots != 0 {
            return Err(TransportError::SharedMemory(format!(
                "rank {peer} sent a doorbell of rank {} with {} rings",
                bell.owner_rank(),
                bell.layout.nslots
            )));
        }
        if remote.owner_rank() as usize != peer
            || remote.layout.nslots != 1
            || remote.slot_rank(0) as usize != self.rank
        {
            return Err(TransportError::SharedMemory(format!(
                "rank {peer} sent a ring of rank {} for rank {}, expected its ring for rank {}",
                remote.owner_rank(),
                remote.slot_rank(0),
                self.rank
            )));
        }
        ShmConnection::attach(
            peer,
            Arc::new(incoming.map),
            Arc::new(remote),
            Arc::new(bell),
        )
    }

    /// Connects to `peer` over a connected Unix stream whose other end runs this same call:
    /// each side makes its incoming ring, sends its doorbell's and that ring's descriptors,
    /// receives the peer's, and attaches. Waits at most `timeout` for the peer.
    pub fn connect_over(
        &self,
        peer: usize,
        stream: &UnixStream,
        timeout: Duration,
    ) -> Result<ShmConnection> {
        let incoming = self.incoming_ring(peer)?;
        let io = |e: std::io::Error| {
            TransportError::io(format!("exchanging shared memory with rank {peer}"), e)
        };
        stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io)?;
        stream
            .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io)?;
        let mut frame = [0u8; 8];
        frame[..4].copy_from_slice(&FD_FRAME_MAGIC.to_le_bytes());
        frame[4..].copy_from_slice(&(self.rank as u32).to_le_bytes());
        crate::util::send_fds(stream, &frame, &[self.bell_fd.as_fd(), incoming.fd()]).map_err(
            |e| TransportError::io_with(peer, format!("sending shared memory to rank {peer}"), e),
        )?;
        let mut got = [0u8; 8];
        let fds = crate::util::recv_fds(stream, &mut got, 2).map_err(|e| {
            TransportError::io_with(peer, format!("receiving shared memory from rank {peer}"), e)
        })?;
        let magic = u32::from_le_bytes([got[0], got[1], got[2], got[3]]);
        let from = u32::from_le_bytes([got[4], got[5], got[6], got[7]]) as usize;
        if magic != FD_FRAME_MAGIC || from != peer || fds.len() != 2 {
            return Err(TransportError::Protocol(format!(
                "rank {peer} sent a malformed shared-memory frame (rank {from}, {} descriptors)",
                fds.len()
            )));
        }
        let mut fds = fds.into_iter();
        let (Some(bell), Some(ring)) = (fds.next(), fds.next()) else {
            return Err(TransportError::Protocol(format!(
                "rank {peer} sent too few descriptors"
            )));
        };
        self.connect(incoming, bell, ring)
    }

    /// This rank's one-shot outbox (in its doorbell object).
    pub fn outbox(&self) -> Option<super::Outbox> {
        super::Outbox::of(&self.bell)
    }

    /// The idle waiter of this rank: sleeps on its doorbell.
    pub fn waiter(&self) -> ShmWaiter {
        let last = self.bell.doorbell().load(Ordering::SeqCst);
        ShmWaiter {
            map: self.bell.clone(),
            last,
        }
    }
}

/// Tags the frame that carries a doorbell's and a ring's descriptors.
const FD_FRAME_MAGIC: u32 = 0x5746_4453; // "WFDS"
/// Two connected shared-memory ends inside this process (for tests and benchmarks): two
/// endpoints under a random token, their rings exchanged as descriptors.
pub fn local_pair(
    rank_a: usize,
    rank_b: usize,
    capacity: usize,
) -> Result<((ShmConnection, ShmWaiter), (ShmConnection, ShmWaiter))> {
    let token = crate::util::random_hex(8)?;
    let ea = ShmEndpoint::create(&token, "local_pair", rank_a, capacity)?;
    let eb = ShmEndpoint::create(&token, "local_pair", rank_b, capacity)?;
    let (ra, rb) = (ea.incoming_ring(rank_b)?, eb.incoming_ring(rank_a)?);
    let dup = |fd: BorrowedFd<'_>| {
        fd.try_clone_to_owned()
            .map_err(|e| TransportError::io("duplicating a shared-memory descriptor", e))
    };
    let (bell_a, bell_b) = (dup(ea.bell_fd())?, dup(eb.bell_fd())?);
    let (ring_a, ring_b) = (dup(ra.fd())?, dup(rb.fd())?);
    let a = ea.connect(ra, bell_b, ring_b)?;
    let b = eb.connect(rb, bell_a, ring_a)?;
    Ok(((a, ea.waiter()), (b, eb.waiter())))
}
