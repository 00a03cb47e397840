//! An in-memory provider: endpoints of one [`Loopback`] fabric (threads standing in for ranks)
//! write into each other's registered memory when they poll, in the order posted, as a reliable
//! connection would. Faults can be injected: a write that fails, completions delivered out of
//! order, a peer that vanishes between two writes.

use super::{
    check_inline, Completion, Endpoint, Memory, NetError, NetResult, Posted, Provider, Region,
    Registration, RemoteRegion, Source, Target,
};
use crate::util::lock;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) const PROVIDER: &str = "loopback";

/// Faults a [`Loopback`] fabric injects.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The write posted as this one (counting from 0 across the fabric) completes with an error
    /// and is not placed.
    pub fail_write: Option<u64>,
    /// Completions of one poll are reported in reverse order.
    pub reverse_completions: bool,
    /// After this many writes have been placed (across the fabric), every endpoint vanishes:
    /// later writes fail as if the peer had died.
    pub vanish_after: Option<u64>,
    /// Most work requests an endpoint holds (posting more answers [`Posted::Full`]).
    pub queue_depth: Option<usize>,
    /// Every write of more than two bytes lands in two pieces, its first two bytes in one poll
    /// and the rest in the next (as a provider copying from a socket may), so a reader can see
    /// a counter half written.
    pub split_writes: bool,
    /// Writes of more than 64 bytes (data, not control words) land two polls later than they
    /// would, while each endpoint still lands its writes in order: across endpoints, a later
    /// small write can land well before an earlier large one.
    pub slow_data: bool,
    /// Endpoints take no inline writes (as some providers), so control words go from
    /// registered memory.
    pub no_inline: bool,
}

/// An in-memory fabric: registered regions and live endpoints, shared by the endpoints made
/// from it.
#[derive(Default)]
pub struct Loopback {
    regions: Mutex<HashMap<u64, Arc<Memory>>>,
    endpoints: Mutex<HashMap<u64, Arc<Mutex<bool>>>>,
    next_id: AtomicU64,
    posted: AtomicU64,
    placed: AtomicU64,
    faults: Faults,
    /// While set, no data write (more than 64 bytes) lands, whoever polls: lets a test see a
    /// write posted and not landed although another thread polls every endpoint.
    data_held: AtomicBool,
    /// Which fabric of this process this is (part of the provider id).
    serial: u64,
}

impl Loopback {
    /// A fabric without faults.
    pub fn new() -> Arc<Loopback> {
        Self::with_faults(Faults::default())
    }

    /// A fabric that injects `faults`.
    pub fn with_faults(faults: Faults) -> Arc<Loopback> {
        static FABRICS: AtomicU64 = AtomicU64::new(0);
        Arc::new(Loopback {
            faults,
            next_id: AtomicU64::new(1),
            serial: FABRICS.fetch_add(1, Ordering::Relaxed),
            ..Default::default()
        })
    }

    /// Holds every data write back (`true`) until called with `false`.
    pub fn hold_data(&self, held: bool) {
        self.data_held.store(held, Ordering::SeqCst);
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

struct LoopRegistration {
    fabric: Arc<Loopback>,
    key: u64,
    len: u64,
}

impl Registration for LoopRegistration {
    fn local_descriptor(&self) -> u64 {
        self.key
    }
    fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            base: 0,
            key: self.key,
            len: self.len,
        }
    }
}

impl Drop for LoopRegistration {
    fn drop(&mut self) {
        lock(&self.fabric.regions).remove(&self.key);
    }
}

/// [`Provider`] over a shared [`Loopback`] fabric.
#[derive(Clone)]
pub struct LoopbackProvider(pub Arc<Loopback>);

impl Provider for LoopbackProvider {
    fn name(&self) -> String {
        PROVIDER.into()
    }
    fn id(&self) -> String {
        // Only the ranks that opened this fabric can reach each other through it (not those of
        // another process, nor those of this one that opened another).
        format!("{PROVIDER}:{}:{}", std::process::id(), self.0.serial)
    }
    fn registrations_follow_remapping(&self) -> bool {
        // Bytes are copied through the registered pointer when a write is placed.
        true
    }
    fn register(&self, memory: Arc<Memory>) -> NetResult<Region> {
        let key = self.0.id();
        let len = memory.len() as u64;
        lock(&self.0.regions).insert(key, Arc::clone(&memory));
        Ok(Region {
            memory,
            registration: Box::new(LoopRegistration {
                fabric: Arc::clone(&self.0),
                key,
                len,
            }),
        })
    }
    fn endpoint(&self) -> NetResult<Box<dyn Endpoint>> {
        let id = self.0.id();
        let alive = Arc::new(Mutex::new(true));
        lock(&self.0.endpoints).insert(id, Arc::clone(&alive));
        Ok(Box::new(LoopEndpoint {
            fabric: Arc::clone(&self.0),
            id,
            alive,
            peer: None,
            queue: VecDeque::new(),
            broken: false,
        }))
    }
}

/// A posted write: the bytes (copied at post time, which is allowed: the source only has to
/// stay unchanged until completion) and where they go.
struct Pending {
    wr_id: u64,
    data: Vec<u8>,
    dst: RemoteRegion,
    offset: u64,
    fail: bool,
    /// Bytes already placed (see [`Faults::split_writes`]).
    landed: usize,
    /// Polls it was held back for (see [`Faults::slow_data`]).
    held: u8,
}

struct LoopEndpoint {
    fabric: Arc<Loopback>,
    id: u64,
    /// Whether this endpoint is open; a writer holds it while it places bytes, so that once
    /// the endpoint is dropped nothing more lands in its side's memory.
    alive: Arc<Mutex<bool>>,
    peer: Option<Arc<Mutex<bool>>>,
    queue: VecDeque<Pending>,
    /// A write failed: like a reliable connection in the error state, every later one fails.
    broken: bool,
}

impl Drop for LoopEndpoint {
    fn drop(&mut self) {
        *lock(&self.alive) = false;
        lock(&self.fabric.endpoints).remove(&self.id);
    }
}

impl LoopEndpoint {
    fn post(&mut self, data: Vec<u8>, dst: Target, wr_id: u64) -> NetResult<Posted> {
        if self.peer.is_none() {
            return Err(NetError::NotConnected { provider: PROVIDER });
        }
        if self.queue.len() >= self.max_outstanding() {
            return Ok(Posted::Full);
        }
        // Regions are addressed from 0: the address is the offset in the registered memory.
        let offset = dst.address(PROVIDER, data.len())?;
        let n = self.fabric.posted.fetch_add(1, Ordering::Relaxed);
        self.queue.push_back(Pending {
            wr_id,
            data,
            dst: dst.region,
            offset,
            fail: self.fabric.faults.fail_write == Some(n),
            landed: 0,
            held: 0,
        });
        Ok(Posted::Yes)
    }

    /// Places bytes `from..to` of one write in the peer's memory, as its device would.
    fn place(&self, w: &Pending, from: usize, to: usize) -> std::result::Result<(), NetError> {
        let failed = |status: i64, detail: &str| NetError::WorkFailed {
            provider: PROVIDER,
            wr_id: w.wr_id,
            status,
            detail: detail.into(),
        };
        if w.fail {
            return Err(failed(-5, "injected failure"));
        }
        let vanished = self
            .fabric
            .faults
            .vanish_after
            .is_some_and(|n| self.fabric.placed.load(Ordering::Relaxed) >= n);
        // Held until the bytes are placed (see `LoopEndpoint::alive`).
        let peer_open = self.peer.as_ref().map(|p| lock(p));
        if vanished || !peer_open.as_ref().is_some_and(|open| **open) {
            return Err(failed(-107, "remote endpoint gone"));
        }
        let Some(mem) = lock(&self.fabric.regions).get(&w.dst.key).cloned() else {
            return Err(failed(-13, "remote access error: no region with this key"));
        };
        let end = w.offset.checked_add(w.data.len() as u64);
        if end.is_none_or(|e| e > mem.len() as u64) {
            return Err(failed(
                -13,
                "remote access error: out of the region's bounds",
            ));
        }
        let off = w.offset as usize;
        if w.data.len() <= 64 && w.data.len().is_multiple_of(8) && off.is_multiple_of(8) {
            // Control words the reader polls are stored atomically, a word at a time in
            // ascending order, as a device lands an aligned write; a word only partly in
            // `from..to` gets just those bytes.
            for k in from / 8..to.div_ceil(8) {
                let word = mem.word(off + 8 * k);
                let mut v = word.load(Ordering::Relaxed).to_le_bytes();
                for (b, byte) in v.iter_mut().enumerate() {
                    if (from..to).contains(&(8 * k + b)) {
                        *byte = w.data[8 * k + b];
                    }
                }
                word.store(u64::from_le_bytes(v), Ordering::Release);
            }
        } else {
            // SAFETY: in bounds (checked above); the stream protocol gives the writer this
            // range exclusively until it publishes it with a later word store (Release).
            unsafe { mem.write(off + from, &w.data[from..to]) };
            std::sync::atomic::fence(Ordering::Release);
        }
        if to == w.data.len() {
            self.fabric.placed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

impl Endpoint for LoopEndpoint {
    fn address(&self) -> NetResult<Vec<u8>> {
        Ok(self.id.to_le_bytes().to_vec())
    }

    fn connect(&mut self, peer: &[u8]) -> NetResult<()> {
        let id = <[u8; 8]>::try_from(peer)
            .map(u64::from_le_bytes)
            .map_err(|_| NetError::Call {
                provider: PROVIDER,
                call: "connect",
                code: -22,
                detail: format!("bad address of {} bytes", peer.len()),
            })?;
        let alive = lock(&self.fabric.endpoints).get(&id).cloned();
        self.peer = Some(alive.ok_or_else(|| NetError::Call {
            provider: PROVIDER,
            call: "connect",
            code: -111,
            detail: format!("no endpoint {id}"),
        })?);
        Ok(())
    }

    fn max_outstanding(&self) -> usize {
        self.fabric.faults.queue_depth.unwrap_or(64)
    }

    fn inline_max(&self) -> usize {
        if self.fabric.faults.no_inline {
            0
        } else {
            64
        }
    }

    fn write(&mut self, src: Source<'_>, dst: Target, wr_id: u64) -> NetResult<Posted> {
        src.check(PROVIDER)?;
        // The peer's bounds are its device's to check (a remote access error, see `place`).
        // SAFETY: in bounds; the caller keeps the source unchanged until completion.
        let data = unsafe { src.region.memory.read(src.offset, src.len, <[u8]>::to_vec) };
        self.post(data, dst, wr_id)
    }

    fn write_inline(&mut self, data: &[u8], dst: Target, wr_id: u64) -> NetResult<Posted> {
        check_inline(PROVIDER, data.len(), self.inline_max())?;
        self.post(data.to_vec(), dst, wr_id)
    }

    fn poll(&mut self, done: &mut Vec<Completion>) -> NetResult<()> {
        let first = done.len();
        while let Some(mut w) = self.queue.pop_front() {
            if w.data.len() > 64 && self.fabric.data_held.load(Ordering::SeqCst) {
                self.queue.push_front(w);
                break;
            }
            if self.fabric.faults.slow_data && !self.broken && w.held < 2 && w.data.len() > 64 {
                w.held += 1;
                self.queue.push_front(w);
                break;
            }
            if self.fabric.faults.split_writes
                && !self.broken
                && w.landed == 0
                && w.data.len() > 2
                && self.place(&w, 0, 2).is_ok()
            {
                // The rest lands on the next poll; nothing after it lands before.
                w.landed = 2;
                self.queue.push_front(w);
                break;
            }
            let result = if self.broken {
                Err(NetError::WorkFailed {
                    provider: PROVIDER,
                    wr_id: w.wr_id,
                    status: -125,
                    detail: "flushed: an earlier write failed".into(),
                })
            } else {
                self.place(&w, w.landed, w.data.len())
            };
            self.broken |= result.is_err();
            done.push(Completion {
                wr_id: w.wr_id,
                result,
            });
        }
        if self.fabric.faults.reverse_completions {
            done[first..].reverse();
        }
        Ok(())
    }
}
