//! Registrations of callers' memory, made once per page range and reused: the receiver of a
//! rendezvous registers its destination here.
//!
//! Registering is expensive on RDMA hardware (the kernel pins every page), so a range stays
//! registered after its use and the next use of the same buffer (the next iteration of a
//! training loop) finds it. Idle registrations beyond [`IDLE_MAX`] are dropped least recently
//! used first. A provider whose registrations pin pages ([`Provider::registrations_follow_remapping`]
//! false: verbs) keeps none idle: a buffer freed and mapped again at the same address would
//! still be backed by the old pages in its registration, and a later write would land there.
//! Its ranges are registered for each use and dropped after it.
//!
//! Device memory (GPUDirect RDMA, [`RegistrationCache::lease_device`]) is registered whole, as
//! its owner allocated it, through its dmabuf or else, where the NIC's driver reaches device
//! memory itself (`nvidia-peermem`), by its address. Such a registration stays after its use
//! whatever the provider (a dmabuf registration holds the exporter's buffer, not the address
//! range) until the owner frees the memory, which calls [`invalidate_everywhere`], or it is
//! among the least recently used beyond [`IDLE_MAX`] idle ones. It is found again only by the
//! same allocation ([`DeviceMemory::identity`]), so memory another allocator freed and
//! allocated again at the same addresses is registered anew.

use super::device::DeviceMemory;
use super::{Dmabuf, Memory, NetError, NetResult, Provider, Region, RemoteRegion};
use crate::util::lock;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, Weak};

type Caches = Mutex<HashMap<usize, Weak<RegistrationCache>>>;
/// Every provider's cache in this process, by the provider's address.
static CACHES: OnceLock<Caches> = OnceLock::new();

/// Forgets the registrations of every cache that overlap the `len` bytes at `address`: their
/// memory is being freed (leases still held keep their registration until released).
pub fn invalidate_everywhere(address: u64, len: usize) {
    let caches: Vec<_> = lock(CACHES.get_or_init(Default::default))
        .values()
        .filter_map(Weak::upgrade)
        .collect();
    for c in caches {
        c.invalidate(address, len);
    }
}

/// Most idle registrations kept per provider.
pub const IDLE_MAX: usize = 64;
const PAGE: usize = 4096;

/// The registrations of one provider.
pub struct RegistrationCache {
    provider: Arc<dyn Provider>,
    keep_idle: bool,
    entries: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    list: Vec<Entry>,
    clock: u64,
}

impl Entries {
    /// A lease of the `len` bytes at `addr` from a registration of host memory (`device`
    /// `None`) or of the device allocation with identity `device` covering them, marked as
    /// used now; the clock advances either way.
    fn cached(&mut self, addr: usize, len: usize, device: Option<u64>) -> Option<Lease> {
        self.clock += 1;
        let (now, end) = (self.clock, addr.saturating_add(len.max(1)));
        let e = self.list.iter_mut().find(|e| {
            let same = match device {
                None => e.device.is_none(),
                Some(id) => e.device.is_some() && e.identity == id,
            };
            same && e.start <= addr && end <= e.end
        })?;
        e.last_use = now;
        Some(Lease {
            region: Arc::clone(&e.region),
            offset: (addr - e.start) as u64,
            len: len as u64,
            device: e.device,
        })
    }
}

struct Entry {
    start: usize,
    end: usize,
    region: Arc<Region>,
    last_use: u64,
    /// How device memory was registered; `None` for host memory.
    device: Option<DeviceRegistration>,
    /// The device allocation's identity ([`DeviceMemory::identity`]; 0 for host memory).
    identity: u64,
}

/// How the NIC reaches a device range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRegistration {
    /// `ibv_reg_dmabuf_mr` on the dmabuf the GPU driver exported.
    Dmabuf,
    /// `ibv_reg_mr` of the device address (`nvidia-peermem`), the dmabuf having been refused.
    PeerMemory,
}

impl std::fmt::Display for DeviceRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceRegistration::Dmabuf => "dmabuf",
            DeviceRegistration::PeerMemory => "nvidia-peermem",
        })
    }
}

/// Why device memory could not be registered: the caller stages through host memory instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dmabuf registration refused ({dmabuf}); {}", match .peer_memory {
    Some(e) => format!("peer-memory registration refused ({e})"),
    None => "no peer-memory driver (nvidia-peermem) to fall back to".into(),
})]
pub struct DeviceRefused {
    /// Why the dmabuf was not registered (not exported, or refused by the NIC).
    pub dmabuf: NetError,
    /// Why registering the device address failed; `None` where it was not tried (no
    /// `nvidia-peermem`).
    pub peer_memory: Option<Box<NetError>>,
}

/// A registered range in use: the registration stays while the lease is held.
pub struct Lease {
    region: Arc<Region>,
    /// The leased address's offset in the registration.
    offset: u64,
    len: u64,
    device: Option<DeviceRegistration>,
}

impl Lease {
    /// The registration (a write's source names its range at [`Lease::offset`]).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The leased address's offset in [`Lease::region`].
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// How device memory was registered (`None` for host memory).
    pub fn device(&self) -> Option<DeviceRegistration> {
        self.device
    }

    /// What a peer needs to write the leased bytes: offset 0 is the leased address.
    pub fn remote(&self) -> RemoteRegion {
        let r = self.region.remote();
        RemoteRegion {
            base: r.base.wrapping_add(self.offset),
            key: r.key,
            len: self.len,
        }
    }
}

impl RegistrationCache {
    /// The cache of `provider` (one per provider object in this process).
    pub fn of(provider: &Arc<dyn Provider>) -> Arc<RegistrationCache> {
        let key = Arc::as_ptr(provider) as *const () as usize;
        let mut caches = lock(CACHES.get_or_init(Default::default));
        caches.retain(|_, c| c.strong_count() > 0);
        if let Some(c) = caches.get(&key).and_then(Weak::upgrade) {
            return c;
        }
        let c = Arc::new(RegistrationCache {
            provider: Arc::clone(provider),
            keep_idle: provider.registrations_follow_remapping(),
            entries: Mutex::default(),
        });
        caches.insert(key, Arc::downgrade(&c));
        c
    }

    /// A registration covering the `len` bytes at `ptr`: a cached one, or a new registration
    /// of the pages around them.
    ///
    /// # Safety
    /// The bytes must stay valid for reads and writes while the lease is held (a provider
    /// writes them on a peer's behalf); after that they may go: an idle registration is never
    /// used to move bytes.
    pub unsafe fn lease(&self, ptr: NonNull<u8>, len: usize) -> NetResult<Lease> {
        let addr = ptr.as_ptr() as usize;
        let end = addr.saturating_add(len.max(1));
        let mut entries = lock(&self.entries);
        if let Some(l) = entries.cached(addr, len, None) {
            return Ok(l);
        }
        let now = entries.clock;
        let start = addr - addr % PAGE;
        let span_end = end.next_multiple_of(PAGE);
        let base = NonNull::new(start as *mut u8).unwrap_or(ptr);
        // SAFETY: the pages around the caller's range; the caller keeps the range valid while
        // the lease is held, and nothing outside it is read or written through the
        // registration (peers write only the leased bytes, checked by `Target::address`).
        let memory = unsafe { Memory::borrowed(base, span_end - start) };
        let region = Arc::new(self.provider.register(Arc::new(memory))?);
        entries.list.push(Entry {
            start,
            end: span_end,
            region: Arc::clone(&region),
            last_use: now,
            device: None,
            identity: 0,
        });
        Ok(Lease {
            region,
            offset: (addr - start) as u64,
            len: len as u64,
            device: None,
        })
    }

    /// A registration of the device range `dev`: a cached one, else its dmabuf registered,
    /// else (where [`DeviceMemory::peer_memory`]) its address registered. It stays cached
    /// until the memory is freed ([`invalidate_everywhere`]).
    pub fn lease_device(&self, dev: &dyn DeviceMemory) -> Result<Lease, DeviceRefused> {
        let (addr, len) = (dev.address() as usize, dev.len());
        let end = addr.saturating_add(len.max(1));
        let mut entries = lock(&self.entries);
        if let Some(l) = entries.cached(addr, len, Some(dev.identity())) {
            return Ok(l);
        }
        let now = entries.clock;
        let record = || {
            let ptr = NonNull::new(addr as *mut u8).unwrap_or(NonNull::dangling());
            // SAFETY: the device range, named by its address for work requests; the host
            // never reads or writes through it (providers hand the address to the NIC), and
            // the registration is forgotten when the owner frees the memory.
            Arc::new(unsafe { Memory::borrowed(ptr, len) })
        };
        let dmabuf = dev.export_dmabuf().and_then(|(fd, offset)| {
            let d = Dmabuf {
                fd: fd.as_fd(),
                offset,
                device: dev.device_ordinal(),
            };
            self.provider.register_dmabuf(record(), d)
        });
        let (region, how) = match dmabuf {
            Ok(r) => (r, DeviceRegistration::Dmabuf),
            Err(dmabuf) if !dev.peer_memory() => {
                return Err(DeviceRefused {
                    dmabuf,
                    peer_memory: None,
                })
            }
            Err(dmabuf) => match self.provider.register(record()) {
                Ok(r) => (r, DeviceRegistration::PeerMemory),
                Err(e) => {
                    return Err(DeviceRefused {
                        dmabuf,
                        peer_memory: Some(Box::new(e)),
                    })
                }
            },
        };
        let region = Arc::new(region);
        entries.list.push(Entry {
            start: addr,
            end,
            region: Arc::clone(&region),
            last_use: now,
            device: Some(how),
            identity: dev.identity(),
        });
        Ok(Lease {
            region,
            offset: 0,
            len: len as u64,
            device: Some(how),
        })
    }

    /// Forgets the registrations overlapping the `len` bytes at `address` (their memory is
    /// being freed).
    pub fn invalidate(&self, address: u64, len: usize) {
        let start = address as usize;
        let end = start.saturating_add(len.max(1));
        lock(&self.entries)
            .list
            .retain(|e| e.end <= start || end <= e.start);
    }

    /// Ends `lease` and drops the registrations no lease holds that this cache does not keep:
    /// where registrations pin pages all of host memory, then of what is left idle the least
    /// recently used beyond [`IDLE_MAX`].
    pub fn release(&self, lease: Lease) {
        drop(lease);
        let mut entries = lock(&self.entries);
        let idle = |e: &Entry| Arc::strong_count(&e.region) == 1;
        if !self.keep_idle {
            // Device registrations stay (a dmabuf registration holds the exporter's buffer,
            // not the addresses) until their memory is freed or the bound below.
            entries.list.retain(|e| e.device.is_some() || !idle(e));
        }
        loop {
            let idle_count = entries.list.iter().filter(|e| idle(e)).count();
            if idle_count <= IDLE_MAX {
                return;
            }
            let Some(oldest) = entries
                .list
                .iter()
                .enumerate()
                .filter(|(_, e)| idle(e))
                .min_by_key(|(_, e)| e.last_use)
                .map(|(i, _)| i)
            else {
                return;
            };
            entries.list.swap_remove(oldest);
        }
    }

    /// The provider the registrations are made with.
    pub fn provider(&self) -> &dyn Provider {
        self.provider.as_ref()
    }

    /// Registrations held now (in use or idle).
    pub fn len(&self) -> usize {
        lock(&self.entries).list.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::loopback::{Loopback, LoopbackProvider};

    fn cache(keep_idle: bool) -> Arc<RegistrationCache> {
        let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::new()));
        let c = RegistrationCache::of(&p);
        assert!(
            Arc::ptr_eq(&c, &RegistrationCache::of(&p)),
            "one cache per provider"
        );
        Arc::new(RegistrationCache {
            provider: p,
            keep_idle,
            entries: Mutex::default(),
        })
    }

    fn at(buf: &mut [u8], offset: usize) -> NonNull<u8> {
        NonNull::new(buf[offset..].as_mut_ptr()).unwrap()
    }

    #[test]
    fn a_range_is_registered_once_and_found_again_inside_its_pages() {
        let c = cache(true);
        let mut buf = vec![0u8; 5 * PAGE];
        // SAFETY: `buf` outlives every lease.
        let a = unsafe { c.lease(at(&mut buf, 100), 3 * PAGE) }.unwrap();
        let key = a.remote().key;
        c.release(a);
        assert_eq!(c.len(), 1, "kept idle");
        // SAFETY: as above.
        let b = unsafe { c.lease(at(&mut buf, 200), 2 * PAGE) }.unwrap();
        assert_eq!(b.remote().key, key, "the same registration");
        assert_eq!(b.remote().len, 2 * PAGE as u64);
        let start = at(&mut buf, 100).as_ptr() as usize;
        assert_eq!(
            b.remote().base,
            (100 + start % PAGE) as u64,
            "offset from the page"
        );
        c.release(b);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn idle_registrations_beyond_the_bound_go_least_recently_used_first() {
        let c = cache(true);
        let mut bufs: Vec<Vec<u8>> = (0..IDLE_MAX + 2).map(|_| vec![0u8; 2 * PAGE]).collect();
        let mut keys = Vec::new();
        for b in &mut bufs {
            // SAFETY: the buffers outlive every lease.
            let l = unsafe { c.lease(at(b, 0), PAGE) }.unwrap();
            keys.push(l.remote().key);
            c.release(l);
        }
        assert_eq!(c.len(), IDLE_MAX, "the two oldest went");
        // SAFETY: as above.
        let first = unsafe { c.lease(at(&mut bufs[0], 0), PAGE) }.unwrap();
        assert_ne!(first.remote().key, keys[0], "registered again");
        // SAFETY: as above.
        let newest = unsafe { c.lease(at(&mut bufs[IDLE_MAX + 1], 0), PAGE) }.unwrap();
        assert_eq!(newest.remote().key, keys[IDLE_MAX + 1], "still cached");
        c.release(first);
        c.release(newest);
    }

    #[test]
    fn device_memory_without_dmabuf_is_refused_or_registered_through_peer_memory() {
        use crate::net::device::MemfdDevice;
        let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::new()));
        // Registered in the process's list, so that freeing device memory reaches it.
        let c = RegistrationCache::of(&p);
        let plain = MemfdDevice::new(3 * PAGE, false).unwrap();
        let refused = c
            .lease_device(&plain)
            .err()
            .expect("no dmabuf, no peer memory");
        assert!(
            matches!(refused.dmabuf, NetError::Unavailable { .. }) && refused.peer_memory.is_none(),
            "{refused:?}"
        );
        assert!(c.is_empty());
        let peermem = MemfdDevice::new(3 * PAGE, true).unwrap();
        let a = c.lease_device(&peermem).unwrap();
        assert_eq!(a.device(), Some(DeviceRegistration::PeerMemory));
        assert_eq!(a.remote().len, 3 * PAGE as u64);
        let key = a.remote().key;
        c.release(a);
        assert_eq!(c.len(), 1, "a device registration stays after its use");
        let b = c.lease_device(&peermem).unwrap();
        assert_eq!(b.remote().key, key, "found again");
        c.release(b);
        drop(peermem);
        assert!(c.is_empty(), "freeing the memory forgot its registration");
    }

    #[test]
    fn a_device_registration_is_found_again_only_by_the_same_allocation() {
        use crate::net::device::MemfdDevice;
        /// The same memory under another allocation's identity (memory freed behind the
        /// cache's back and allocated again at the same addresses).
        struct Renamed<'a>(&'a MemfdDevice, u64);
        impl DeviceMemory for Renamed<'_> {
            fn address(&self) -> u64 {
                self.0.address()
            }
            fn len(&self) -> usize {
                self.0.len()
            }
            fn identity(&self) -> u64 {
                self.1
            }
            fn export_dmabuf(&self) -> NetResult<(std::os::fd::OwnedFd, u64)> {
                self.0.export_dmabuf()
            }
            fn peer_memory(&self) -> bool {
                true
            }
        }
        let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::new()));
        let c = RegistrationCache::of(&p);
        let dev = MemfdDevice::new(PAGE, true).unwrap();
        let first = c.lease_device(&Renamed(&dev, 1)).unwrap();
        let key = first.remote().key;
        c.release(first);
        let again = c.lease_device(&Renamed(&dev, 1)).unwrap();
        assert_eq!(again.remote().key, key, "the same allocation: cached");
        c.release(again);
        let other = c.lease_device(&Renamed(&dev, 2)).unwrap();
        assert_ne!(
            other.remote().key,
            key,
            "another allocation: registered anew"
        );
        c.release(other);
    }

    #[test]
    fn providers_whose_registrations_pin_pages_keep_none_idle() {
        let c = cache(false);
        let mut buf = vec![0u8; 2 * PAGE];
        // SAFETY: `buf` outlives every lease.
        let a = unsafe { c.lease(at(&mut buf, 0), PAGE) }.unwrap();
        // SAFETY: as above.
        let b = unsafe { c.lease(at(&mut buf, 8), 64) }.unwrap();
        assert_eq!(a.remote().key, b.remote().key, "shared while in use");
        c.release(a);
        assert_eq!(c.len(), 1, "still leased");
        c.release(b);
        assert!(c.is_empty(), "dropped after its last use");
    }
}
