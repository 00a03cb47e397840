//! Memory that a network device (or, in tests, another thread) writes into behind the
//! compiler's back: a page-aligned, zeroed allocation reached only through raw pointers, atomic
//! words, and ranges the caller's protocol says nobody else writes while it looks.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// Alignment of every allocation: a page, as registration wants.
const PAGE: usize = 4096;

/// A zeroed, page-aligned allocation that may be registered with a provider, or a caller's
/// memory lent for a registration ([`Memory::borrowed`]).
pub struct Memory {
    ptr: NonNull<u8>,
    len: usize,
    /// Allocated by [`Memory::new`] and freed on drop (a borrowed range is not).
    owned: bool,
}

// SAFETY: `Memory` owns its allocation, or borrows a caller's range under the contract of
// `Memory::borrowed`; all access goes through raw pointers whose users follow the protocol
// documented on each method (disjoint ranges, atomic words), as with shared memory between
// processes.
unsafe impl Send for Memory {}
// SAFETY: as for `Send`: shared access is to atomic words or to ranges the protocol keeps
// disjoint between writer and reader.
unsafe impl Sync for Memory {}

impl Memory {
    /// `len` zeroed bytes (at least one page's worth is reserved), or `None` when the
    /// allocation fails.
    pub fn new(len: usize) -> Option<Memory> {
        let layout = Layout::from_size_align(len.max(1).next_multiple_of(PAGE), PAGE).ok()?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(Memory {
            ptr: NonNull::new(raw)?,
            len,
            owned: true,
        })
    }

    /// The caller's `len` bytes at `ptr`, to be registered (a rendezvous destination). Never
    /// freed by this value.
    ///
    /// # Safety
    /// The range must be valid for reads and writes whenever this `Memory` (or a registration
    /// of it) is used to move bytes: the registration cache lends it only while the caller's
    /// promise holds the memory, and a provider touches it only on behalf of such a use.
    pub unsafe fn borrowed(ptr: NonNull<u8>, len: usize) -> Memory {
        Memory {
            ptr,
            len,
            owned: false,
        }
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the usable length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte's address (for registration).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} outside {} bytes",
            self.len
        );
    }

    /// The 8-byte word at `offset` (a multiple of 8), for counters a peer writes.
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8);
        assert!(
            (self.ptr.as_ptr() as usize + offset).is_multiple_of(8),
            "unaligned word at {offset}"
        );
        // SAFETY: in bounds and 8-aligned (checked); the allocation lives as
        // long as `self`, and every access to this word is atomic (peers' writers store it with
        // an atomic or a device write of one aligned word).
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU64) }
    }

    /// Lends `len` bytes at `offset` to `f`.
    ///
    /// # Safety
    /// Nobody may write the range while `f` runs (the stream protocol: the sender writes only
    /// past the head the reader has seen).
    pub unsafe fn read<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check(offset, len);
        // SAFETY: in bounds; the caller guarantees no concurrent writer of the range.
        f(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// Copies `data` to `offset`.
    ///
    /// # Safety
    /// Nobody may read or write the range meanwhile (the sender's staging area: a range is
    /// written only once the write that read it out has completed).
    pub unsafe fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: in bounds; the caller guarantees exclusive use of the range; `data` cannot
        // overlap this allocation's range as the caller holds it exclusively.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let layout = Layout::from_size_align(self.len.max(1).next_multiple_of(PAGE), PAGE)
            .expect("layout was valid at allocation");
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn zeroed_aligned_and_bounded() {
        let m = Memory::new(100).unwrap();
        assert_eq!(m.as_ptr() as usize % PAGE, 0);
        // SAFETY: single-threaded test.
        unsafe { m.read(0, 100, |s| assert!(s.iter().all(|&b| b == 0))) };
        m.word(8).store(7, Ordering::Relaxed);
        // SAFETY: single-threaded test.
        unsafe { m.read(8, 1, |s| assert_eq!(s[0], 7)) };
        // SAFETY: single-threaded test.
        unsafe { m.write(96, &[1, 2, 3, 4]) };
        // SAFETY: single-threaded test.
        unsafe { m.read(96, 4, |s| assert_eq!(s, &[1, 2, 3, 4])) };
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_range_is_refused() {
        let m = Memory::new(16).unwrap();
        let _ = m.word(16);
    }
}
