//! Contexts, streams, events and memory: thin owners of driver handles.
//!
//! A [`Context`] is a device's primary context (shared with the CUDA runtime and other
//! libraries in the process). Every type that holds a driver handle keeps its context alive and
//! makes it current before each driver call, so they may be used from any thread.

use crate::driver::{check, device_handle, ensure_driver};
use crate::error::{CudaError, Result};
use crate::kernels::Kernels;
use cudarc::driver::sys;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use weftcc_collectives::Element;

/// Where a buffer's memory lives: what a collective needs to know to move it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary (pageable) host memory.
    Host,
    /// Page-locked host memory mapped into the device's address space.
    Pinned,
    /// Memory of the CUDA device with this ordinal.
    Device(usize),
}

struct CtxInner {
    ordinal: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    kernels: OnceLock<Result<Kernels>>,
}

// SAFETY: a CUcontext is a driver handle usable from any thread (the driver API is
// thread-safe); we only pass it to driver calls.
unsafe impl Send for CtxInner {}
// SAFETY: as above; the only interior mutability is the OnceLock.
unsafe impl Sync for CtxInner {}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // Unload the module while the primary context is still retained.
        drop(self.kernels.take());
        // SAFETY: we retained the primary context of `dev` in Context::new and release it once.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// A device's primary context. Cheap to clone.
#[derive(Clone)]
pub struct Context {
    inner: Arc<CtxInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("ordinal", &self.inner.ordinal)
            .finish()
    }
}

impl Context {
    /// Retains the primary context of device `ordinal`. Returns [`CudaError::NoDriver`] on a
    /// machine without the driver.
    pub fn new(ordinal: usize) -> Result<Context> {
        ensure_driver()?;
        let dev = device_handle(ordinal)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: driver initialised (ensure_driver); `dev` is valid; `ctx` is an out pointer.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let c = Context {
            inner: Arc::new(CtxInner {
                ordinal,
                dev,
                ctx,
                kernels: OnceLock::new(),
            }),
        };
        c.bind()?;
        Ok(c)
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    pub(crate) fn device(&self) -> sys::CUdevice {
        self.inner.dev
    }

    /// The raw `CUcontext`, for interoperation with other CUDA code.
    pub fn as_raw(&self) -> sys::CUcontext {
        self.inner.ctx
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.inner.ctx)
        })
    }

    /// The reduction kernels, compiled (once per process) and loaded (once per context).
    pub(crate) fn kernels(&self) -> Result<&Kernels> {
        self.bind()?;
        self.inner
            .kernels
            .get_or_init(Kernels::load)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Compiles and loads the kernels now rather than on the first reduction.
    pub fn load_kernels(&self) -> Result<()> {
        self.kernels().map(|_| ())
    }

    /// A new non-blocking stream (it does not synchronise with the legacy default stream).
    pub fn stream(&self) -> Result<Stream> {
        self.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: context current; `raw` is an out pointer; flag 1 = CU_STREAM_NON_BLOCKING.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream {
            ctx: self.clone(),
            raw,
            owned: true,
        })
    }

    /// A new event without timing (for ordering), or with timing (for benchmarks).
    pub fn event(&self, timing: bool) -> Result<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        Event::with_flags(self, flags)
    }

    /// Allocates `len` uninitialised elements on this device.
    pub fn alloc<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| CudaError::Other(format!("{len} elements overflow")))?;
        let ptr = raw_alloc(self, bytes)?;
        Ok(DeviceBuffer {
            ctx: self.clone(),
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// Allocates `len` zeroed elements.
    pub fn alloc_zeroed<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let b = self.alloc::<T>(len)?;
        let s = self.stream()?;
        b.memset_zero(&s)?;
        s.synchronize(Duration::from_secs(60))?;
        Ok(b)
    }

    /// Copies `data` into a new device buffer (blocking).
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = self.alloc::<T>(data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }
}

/// Allocates `bytes` of device memory in `ctx` (at least 1 byte, so every buffer has an address).
pub(crate) fn raw_alloc(ctx: &Context, bytes: usize) -> Result<u64> {
    ctx.bind()?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: context current; `ptr` is an out pointer.
    check("cuMemAlloc", unsafe {
        sys::cuMemAlloc_v2(&mut ptr, bytes.max(1))
    })?;
    Ok(ptr)
}

/// Frees device memory from [`raw_alloc`].
pub(crate) fn raw_free(ctx: &Context, ptr: u64) {
    if ctx.bind().is_ok() {
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed exactly once.
        let _ = unsafe { sys::cuMemFree_v2(ptr) };
    }
}

/// Exports `bytes` of device memory at `ptr` (in `ctx`, inside one live allocation) as a
/// dmabuf (`cuMemGetHandleForAddressRange`); address and length must be page multiples.
fn export_dmabuf(ctx: &Context, ptr: u64, bytes: usize) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let support = crate::driver::gdr_support(ctx.ordinal())?;
    if !support.dmabuf {
        return Err(CudaError::Other(format!(
            "device {} cannot export memory as a dmabuf (needs CUDA 11.7+, an open kernel \
             module and CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)",
            ctx.ordinal()
        )));
    }
    let page = weftcc_transports::shm::page_size() as u64;
    let len = bytes as u64;
    if len == 0 || !ptr.is_multiple_of(page) || !len.is_multiple_of(page) {
        return Err(CudaError::Other(format!(
            "dmabuf export needs page-aligned memory: address {ptr:#x}, {len} bytes, page {page}"
        )));
    }
    ctx.bind()?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is an out pointer of the size the dmabuf handle type writes (an int); the
    // range lies inside a live allocation (the caller's) and is page aligned (checked above);
    // the symbol exists (gdr_support checked it).
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            ptr,
            bytes,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(CudaError::Other(
            "dmabuf export returned no descriptor".into(),
        ));
    }
    // SAFETY: the driver just opened `fd` for us and nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// CUDA's id of the allocation holding `ptr` (`CU_POINTER_ATTRIBUTE_BUFFER_ID`, never reused
/// within a process).
fn buffer_id(ctx: &Context, ptr: u64) -> Result<u64> {
    ctx.bind()?;
    let mut id: u64 = 0;
    // SAFETY: a context is current; `id` is an out pointer of the attribute's size (u64).
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(
            (&mut id as *mut u64).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            ptr,
        )
    })?;
    Ok(id)
}

/// The device allocation holding an address (`cuMemGetAddressRange`), as a NIC registers it
/// (GPUDirect RDMA): whole, so that every buffer inside it finds the registration again.
pub(crate) struct DeviceAllocation {
    ctx: Context,
    base: u64,
    len: usize,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: never reused within the process.
    id: u64,
}

impl DeviceAllocation {
    /// The allocation containing `ptr`, and `ptr`'s offset in it.
    pub(crate) fn containing(ctx: &Context, ptr: u64) -> Result<(DeviceAllocation, usize)> {
        ctx.bind()?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: a context is current; both are out pointers.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        let id = buffer_id(ctx, ptr)?;
        let page = weftcc_transports::shm::page_size();
        let alloc = DeviceAllocation {
            ctx: ctx.clone(),
            id,
            base,
            // cuMemAlloc reserves whole pages (2 MiB granules): the export covers them.
            len: size.next_multiple_of(page),
        };
        Ok((alloc, (ptr - base) as usize))
    }
}

impl weftcc_transports::net::device::DeviceMemory for DeviceAllocation {
    fn address(&self) -> u64 {
        self.base
    }

    fn len(&self) -> usize {
        self.len
    }

    fn export_dmabuf(&self) -> weftcc_transports::net::NetResult<(std::os::fd::OwnedFd, u64)> {
        export_dmabuf(&self.ctx, self.base, self.len)
            .map(|fd| (fd, 0))
            .map_err(|e| weftcc_transports::net::NetError::Unavailable {
                provider: "CUDA",
                detail: e.to_string(),
            })
    }

    fn identity(&self) -> u64 {
        self.id
    }

    fn device_ordinal(&self) -> i32 {
        self.ctx.ordinal() as i32
    }

    fn peer_memory(&self) -> bool {
        crate::driver::nvidia_peermem()
    }
}

/// A CUDA stream. Work enqueued on it runs in order; collectives enqueued on it run in order
/// with that work (NCCL's semantics).
pub struct Stream {
    ctx: Context,
    raw: sys::CUstream,
    /// Destroyed on drop (false for a caller's stream borrowed by [`Stream::borrow_raw`]).
    owned: bool,
}

// SAFETY: streams are driver handles usable from any thread.
unsafe impl Send for Stream {}
// SAFETY: enqueueing on a stream from several threads is allowed by the driver.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl Stream {
    /// A caller's stream (a `CUstream` or `cudaStream_t` of `ctx`'s device), not destroyed on
    /// drop.
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx`'s device (its primary context) and outlives the value.
    pub unsafe fn borrow_raw(ctx: &Context, raw: sys::CUstream) -> Stream {
        Stream {
            ctx: ctx.clone(),
            raw,
            owned: false,
        }
    }

    /// [`Stream::borrow_raw`] after checking that `raw` belongs to `ctx`'s context
    /// (`cuStreamGetCtx`): a stream of another GPU (or context) is an error here, not a driver
    /// failure of the enqueued work.
    ///
    /// # Safety
    /// `raw` is a live stream (of any context) and outlives the value.
    pub unsafe fn borrow_checked(ctx: &Context, raw: sys::CUstream) -> Result<Stream> {
        ctx.bind()?;
        let mut owner: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `raw` is a live stream per the contract; `owner` is an out pointer.
        check("cuStreamGetCtx", unsafe {
            sys::cuStreamGetCtx(raw, &mut owner)
        })?;
        if owner != ctx.as_raw() {
            return Err(CudaError::Other(format!(
                "the stream belongs to another context than GPU {}'s primary context",
                ctx.ordinal()
            )));
        }
        // SAFETY: per the contract.
        Ok(unsafe { Stream::borrow_raw(ctx, raw) })
    }

    /// The raw `CUstream`, for interoperation with other CUDA code.
    pub fn as_raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The stream's context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// True when all work enqueued so far has finished.
    pub fn is_idle(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the stream is alive (owned by self) and its context is current.
        finished("cuStreamQuery", unsafe { sys::cuStreamQuery(self.raw) })
    }

    /// Waits until all enqueued work has finished, at most `timeout` (then an error; the work
    /// stays enqueued).
    pub fn synchronize(&self, timeout: Duration) -> Result<()> {
        wait_until(timeout, || self.is_idle(), "stream")
    }

    /// Makes later work on this stream wait for `event`'s last recording.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles are alive and belong to current contexts of this process.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned && self.ctx.bind().is_ok() {
            // SAFETY: created by cuStreamCreate and destroyed once; pending work still completes.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// A stream or event query's answer: finished, not yet, or the driver's error.
fn finished(what: &'static str, r: sys::CUresult) -> Result<bool> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => check(what, other).map(|_| false),
    }
}

/// Polls `done` until true, sleeping a little between polls; an error after `timeout`.
pub(crate) fn wait_until(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
    what: &str,
) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(1);
    loop {
        if done()? {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(CudaError::Other(format!(
                "{what} did not finish within {timeout:?}"
            )));
        }
        if pause < Duration::from_micros(200) {
            std::thread::yield_now();
            pause *= 2;
        } else {
            std::thread::sleep(pause);
        }
    }
}

/// A CUDA event.
pub struct Event {
    ctx: Context,
    raw: sys::CUevent,
}

// SAFETY: events are driver handles usable from any thread.
unsafe impl Send for Event {}
// SAFETY: recording and querying from several threads is allowed by the driver.
unsafe impl Sync for Event {}

impl Event {
    pub(crate) fn with_flags(ctx: &Context, flags: u32) -> Result<Event> {
        ctx.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: context current; `raw` is an out pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Event {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Records the event on `stream` (captures the work enqueued so far).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles alive; same process.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// True when the recorded work has finished.
    pub fn is_done(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the event is alive.
        finished("cuEventQuery", unsafe { sys::cuEventQuery(self.raw) })
    }

    /// Waits for the recorded work, at most `timeout`.
    pub fn synchronize(&self, timeout: Duration) -> Result<()> {
        wait_until(timeout, || self.is_done(), "event")
    }

    /// Milliseconds between `start` and this event (both recorded with timing).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: both events alive; `ms` is an out pointer.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime(&mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: created by cuEventCreate and destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

/// `len` elements of `T` in device memory. Memory kind [`MemoryKind::Device`].
pub struct DeviceBuffer<T: Element> {
    ctx: Context,
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.ctx.ordinal())
            .field("len", &self.len)
            .field("dtype", &T::DTYPE)
            .finish()
    }
}

impl<T: Element> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Where the memory lives.
    pub fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device(self.ctx.ordinal())
    }

    /// The device address, for interoperation with other CUDA code.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The owning context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Exports the buffer's memory as a dmabuf file descriptor (`cuMemGetHandleForAddressRange`),
    /// what `ibv_reg_dmabuf_mr` registers with a network card for GPUDirect RDMA. The address
    /// and length must be multiples of the host page size; the buffer must outlive every
    /// registration made from the descriptor.
    pub fn export_dmabuf(&self) -> Result<std::os::fd::OwnedFd> {
        export_dmabuf(&self.ctx, self.ptr, self.byte_len())
    }

    /// Copies `src` (same length) into the buffer; blocking.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        if src.len() != self.len {
            return Err(CudaError::Other(format!(
                "copy of {} elements into a device buffer of {}",
                src.len(),
                self.len
            )));
        }
        let s = self.ctx.stream()?;
        // SAFETY: the destination holds byte_len bytes (allocated so), the source slice as
        // many; the copy is complete when synchronize returns, before `src` can go away.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), self.byte_len(), s.raw)
        })?;
        s.synchronize(Duration::from_secs(600))
    }

    /// Copies the buffer into `dst` (same length); blocking.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        if dst.len() != self.len {
            return Err(CudaError::Other(format!(
                "copy of a device buffer of {} elements into {}",
                self.len,
                dst.len()
            )));
        }
        let s = self.ctx.stream()?;
        // SAFETY: as in copy_from_host, in the other direction; `dst` is exclusively borrowed
        // until the copy completed.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, self.byte_len(), s.raw)
        })?;
        s.synchronize(Duration::from_secs(600))
    }

    /// The buffer's contents as a vector; blocking.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Enqueues zero-filling on `stream`.
    pub fn memset_zero(&self, stream: &Stream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the buffer holds byte_len bytes; the stream is alive.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(self.ptr, 0, self.byte_len(), stream.raw)
        })
    }

    /// Enqueues a device-to-device copy of `src` (same length) into this buffer on `stream`.
    pub fn copy_from_device(&mut self, src: &DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        if src.len != self.len {
            return Err(CudaError::Other(
                "device copy between different lengths".into(),
            ));
        }
        self.ctx.bind()?;
        // SAFETY: both buffers hold byte_len bytes; unified addressing lets the driver find the
        // source's device.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(self.ptr, src.ptr, self.byte_len(), stream.raw)
        })
    }
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // A NIC's registration of this memory (GPUDirect RDMA) must not be found again.
        weftcc_transports::net::regcache::invalidate_everywhere(self.ptr, self.byte_len());
        raw_free(&self.ctx, self.ptr);
    }
}

/// Device memory for a NIC (GPUDirect RDMA): [`DeviceBuffer::export_dmabuf`], or its address
/// where `nvidia-peermem` is loaded. Its length is in bytes.
impl<T: Element> weftcc_transports::net::device::DeviceMemory for DeviceBuffer<T> {
    fn address(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.byte_len()
    }

    fn identity(&self) -> u64 {
        // 0 where the driver cannot say: such a registration is found again only by another
        // allocation the driver cannot name either, and it is forgotten when this buffer goes.
        buffer_id(&self.ctx, self.ptr).unwrap_or(0)
    }

    fn export_dmabuf(&self) -> weftcc_transports::net::NetResult<(std::os::fd::OwnedFd, u64)> {
        DeviceBuffer::export_dmabuf(self)
            .map(|fd| (fd, 0))
            .map_err(|e| weftcc_transports::net::NetError::Unavailable {
                provider: "CUDA",
                detail: e.to_string(),
            })
    }

    fn device_ordinal(&self) -> i32 {
        self.ctx.ordinal() as i32
    }

    fn peer_memory(&self) -> bool {
        crate::driver::nvidia_peermem()
    }
}

/// Page-locked host memory mapped for the device (`cuMemHostAlloc`), memory kind
/// [`MemoryKind::Pinned`]: the staging area of the host path and the home of the proxy's
/// release flags.
pub struct PinnedBuffer {
    ctx: Context,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is plain host memory owned by this value.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]` (or atomics, see the flags).
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` zeroed bytes (at least 1).
    pub fn new(ctx: &Context, len: usize) -> Result<PinnedBuffer> {
        ctx.bind()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: context current; `p` is an out pointer.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len.max(1), flags)
        })?;
        // SAFETY: cuMemHostAlloc returned at least len.max(1) writable bytes at `p`.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len.max(1)) };
        Ok(PinnedBuffer {
            ctx: ctx.clone(),
            ptr: p.cast(),
            len,
        })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device's address of this memory.
    pub fn device_ptr(&self) -> Result<u64> {
        self.ctx.bind()?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was allocated with DEVICEMAP; `d` is an out pointer.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr.cast(), 0)
        })?;
        Ok(d)
    }

    /// Host address.
    pub(crate) fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised bytes for as long as self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive on the host side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc and freed once.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}
