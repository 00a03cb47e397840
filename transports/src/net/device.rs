//! Device memory as a network card sees it (GPUDirect RDMA): a range with a device address and
//! a dmabuf the NIC's driver can map, and the stand-in the tests use without a GPU.
//!
//! A NIC reaches a GPU's memory in one of two ways: the GPU driver exports the range as a
//! dmabuf (`cuMemGetHandleForAddressRange`) and the NIC registers that (`ibv_reg_dmabuf_mr`),
//! or the NIC's driver asks the GPU driver itself through the `nvidia-peermem` kernel module,
//! and a plain `ibv_reg_mr` of the device address works. [`DeviceMemory`] gives both to the
//! registration cache ([`super::regcache::RegistrationCache::lease_device`]), which tries the
//! dmabuf first. [`MemfdDevice`] stands in for a GPU allocation in tests: a `memfd` is the
//! dmabuf, and its mapping in this process is the "device" (the emulated RDMA device maps the
//! memfd itself when it registers it, as a NIC driver maps a dmabuf), so the same registration
//! and ordering code runs on every machine.

use super::{Memory, NetError, NetResult};
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// A range of device memory a NIC may read and write.
pub trait DeviceMemory: Send + Sync {
    /// The range's device address: what kernels and work requests name it by (the I/O virtual
    /// address of its registration). Never dereferenced by the host.
    fn address(&self) -> u64;
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether the range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A dmabuf holding the range, and the range's offset in it; or why there is none (the
    /// driver or the GPU has no dmabuf export).
    fn export_dmabuf(&self) -> NetResult<(OwnedFd, u64)>;
    /// What tells this allocation from a later one at the same addresses (CUDA's buffer id,
    /// never reused in a process): a cached registration is found again only for the same
    /// identity, so memory freed behind the cache's back (another allocator's `cudaFree`) and
    /// allocated again never finds the old pages' registration.
    fn identity(&self) -> u64;
    /// The CUDA device ordinal owning the range (0 for the stand-in).
    fn device_ordinal(&self) -> i32 {
        0
    }
    /// Whether the NIC may register the range by its device address with `ibv_reg_mr`
    /// (`nvidia-peermem` loaded): the fallback when the dmabuf is refused.
    fn peer_memory(&self) -> bool;
}

/// Host memory standing in for a device allocation: a `memfd` (the dmabuf) mapped shared in
/// this process. Dropping it forgets its registrations in every cache (as freeing device
/// memory must), then unmaps and closes it.
pub struct MemfdDevice {
    id: u64,
    file: File,
    map: memmap2::MmapRaw,
    view: Memory,
    peer_memory: bool,
}

impl MemfdDevice {
    /// `len` zeroed bytes (at least one page is mapped). `peer_memory` says what
    /// [`DeviceMemory::peer_memory`] answers (a machine with `nvidia-peermem`).
    pub fn new(len: usize, peer_memory: bool) -> std::io::Result<MemfdDevice> {
        // SAFETY: a NUL-terminated name and valid flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"weft-gdr-emu".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len.max(1).next_multiple_of(4096) as u64)?;
        let map = memmap2::MmapOptions::new()
            .len(len.max(1).next_multiple_of(4096))
            .map_raw(&file)?;
        let ptr = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| std::io::Error::other("mmap returned NULL"))?;
        // SAFETY: the mapping is valid for `len` bytes for as long as `map`, which this value
        // owns and drops after `view` (field order); `view` never frees it.
        let view = unsafe { Memory::borrowed(ptr, len) };
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(MemfdDevice {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            file,
            map,
            view,
            peer_memory,
        })
    }

    /// The bytes as the host sees them (a GPU's consumer reads them in device code; here the
    /// stand-in consumer and the tests read them through this).
    pub fn host(&self) -> &Memory {
        &self.view
    }
}

impl DeviceMemory for MemfdDevice {
    fn address(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    fn len(&self) -> usize {
        self.view.len()
    }

    fn identity(&self) -> u64 {
        self.id
    }

    fn export_dmabuf(&self) -> NetResult<(OwnedFd, u64)> {
        let fd = self.file.try_clone().map_err(|e| NetError::Unavailable {
            provider: "memfd",
            detail: format!("cannot duplicate the memfd: {e}"),
        })?;
        Ok((fd.into(), 0))
    }

    fn peer_memory(&self) -> bool {
        self.peer_memory
    }
}

impl Drop for MemfdDevice {
    fn drop(&mut self) {
        super::regcache::invalidate_everywhere(self.address(), self.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn the_dmabuf_and_the_mapping_are_the_same_bytes() {
        let d = MemfdDevice::new(10_000, false).unwrap();
        d.host().word(4096).store(0x0102_0304, Ordering::Relaxed);
        let (fd, offset) = d.export_dmabuf().unwrap();
        assert_eq!(offset, 0);
        let other = memmap2::MmapOptions::new()
            .len(8192)
            .map_raw(&File::from(fd))
            .unwrap();
        // SAFETY: in bounds of the 8 KiB mapping; nothing writes it meanwhile.
        let seen = unsafe { std::ptr::read(other.as_ptr().add(4096).cast::<u64>()) };
        assert_eq!(
            seen, 0x0102_0304,
            "another mapping of the memfd sees the write"
        );
        assert_eq!(d.len(), 10_000);
    }
}
