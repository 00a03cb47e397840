//! The libfabric provider: reliable-datagram endpoints (`FI_EP_RDM`) with RMA writes placed in
//! order (`FI_ORDER_RMA_WAW`), one endpoint, completion queue and address vector per connection.
//!
//! libfabric's data path is inline C; `csrc/ofi_shim.c` compiles it against the system headers
//! (built where `libfabric-dev` is installed: `cfg(weft_ofi)`) and loads `libfabric.so.1` at run
//! time, so a machine without libfabric gets [`NetError::Unavailable`], never a failed start.
//! `tcp;ofi_rxm` runs on any machine (CI tests the whole RDMA path with it); on clusters
//! `WEFT_OFI_PROVIDER` picks `verbs`, `efa` or `cxi`.

use super::{Endpoint, NetResult, Provider};

const PROVIDER: &str = "OFI";

/// An opened libfabric fabric and domain.
pub struct OfiProvider {
    #[cfg(weft_ofi)]
    inner: std::sync::Arc<sys::Domain>,
    name: String,
}

impl OfiProvider {
    /// Opens the provider named `prov` (or the first that fits; with `hardware_only`, the first
    /// with RDMA hardware behind it: not `tcp`, `sockets`, `udp` or `shm`).
    pub fn open(prov: Option<&str>, hardware_only: bool) -> NetResult<OfiProvider> {
        #[cfg(weft_ofi)]
        {
            let (domain, name) = sys::Domain::open(prov, hardware_only)?;
            Ok(OfiProvider {
                inner: std::sync::Arc::new(domain),
                name,
            })
        }
        #[cfg(not(weft_ofi))]
        {
            let _ = (prov, hardware_only);
            Err(super::NetError::Unavailable {
                provider: PROVIDER,
                detail: "this build has no libfabric support (libfabric-dev was not installed \
                         when it was compiled)"
                    .into(),
            })
        }
    }

    /// libfabric's name of the provider (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`).
    pub fn provider_name(&self) -> &str {
        &self.name
    }
}

impl Provider for OfiProvider {
    fn name(&self) -> String {
        format!("{PROVIDER}/{}", self.name)
    }

    fn id(&self) -> String {
        format!("ofi:{}", self.name.replace('/', "_"))
    }

    fn registrations_follow_remapping(&self) -> bool {
        // Software providers copy through the registered addresses when bytes move; providers
        // over RDMA hardware pin pages.
        #[cfg(weft_ofi)]
        {
            sys::is_software(&self.name)
        }
        #[cfg(not(weft_ofi))]
        {
            false
        }
    }

    fn register(&self, memory: std::sync::Arc<super::Memory>) -> NetResult<super::Region> {
        #[cfg(weft_ofi)]
        {
            sys::register(&self.inner, memory)
        }
        #[cfg(not(weft_ofi))]
        {
            let _ = memory;
            unreachable_provider()
        }
    }

    fn register_dmabuf(
        &self,
        memory: std::sync::Arc<super::Memory>,
        dmabuf: super::Dmabuf<'_>,
    ) -> NetResult<super::Region> {
        #[cfg(weft_ofi)]
        {
            sys::register_hmem(&self.inner, &self.name, memory, dmabuf.device)
        }
        #[cfg(not(weft_ofi))]
        {
            let _ = (memory, dmabuf);
            unreachable_provider()
        }
    }

    fn endpoint(&self) -> NetResult<Box<dyn Endpoint>> {
        #[cfg(weft_ofi)]
        {
            Ok(Box::new(sys::OfiEndpoint::open(&self.inner)?))
        }
        #[cfg(not(weft_ofi))]
        {
            unreachable_provider()
        }
    }
}

#[cfg(not(weft_ofi))]
fn unreachable_provider<T>() -> NetResult<T> {
    Err(super::NetError::Unavailable {
        provider: PROVIDER,
        detail: "not compiled in".into(),
    })
}

#[cfg(weft_ofi)]
mod sys {
    //! The shim's C interface and the safe types over it.

    use super::PROVIDER;
    use crate::net::{
        check_inline, Completion, Endpoint, Memory, NetError, NetResult, Posted, Region,
        Registration, RemoteRegion, Source, Target,
    };
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::sync::Arc;

    /// Whether libfabric's provider `name` moves bytes with the CPU (the shim's list).
    pub fn is_software(name: &str) -> bool {
        let Ok(name) = CString::new(name) else {
            return false;
        };
        // SAFETY: a NUL-terminated string the call only reads.
        unsafe { weft_ofi_is_software(name.as_ptr()) != 0 }
    }

    #[repr(C)]
    pub struct RawDomain {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub struct RawEp {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub struct RawMr {
        _private: [u8; 0],
    }

    /// A registration as `weft_ofi_mr_reg` fills it in (`struct weft_ofi_mr`).
    #[repr(C)]
    struct RawRegistration {
        mr: *mut RawMr,
        desc: u64,
        key: u64,
        base: u64,
    }

    extern "C" {
        fn weft_ofi_is_software(prov: *const c_char) -> c_int;
        fn weft_ofi_strerror(code: c_int) -> *const c_char;
        fn weft_ofi_open(
            prov: *const c_char,
            hardware_only: c_int,
            out: *mut *mut RawDomain,
            name: *mut c_char,
            namelen: usize,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        fn weft_ofi_close_domain(d: *mut RawDomain);
        fn weft_ofi_mr_reg(
            d: *mut RawDomain,
            buf: *mut c_void,
            len: usize,
            cuda_device: c_int,
            out: *mut RawRegistration,
        ) -> c_int;
        fn weft_ofi_mr_close(mr: *mut RawMr);
        fn weft_ofi_ep_open(
            d: *mut RawDomain,
            out: *mut *mut RawEp,
            depth: *mut u64,
            inject: *mut u64,
        ) -> c_int;
        fn weft_ofi_ep_close(e: *mut RawEp);
        fn weft_ofi_ep_name(e: *mut RawEp, buf: *mut c_void, len: *mut usize) -> c_int;
        fn weft_ofi_ep_connect(e: *mut RawEp, addr: *const c_void) -> c_int;
        fn weft_ofi_write(
            e: *mut RawEp,
            buf: *const c_void,
            len: usize,
            desc: u64,
            raddr: u64,
            rkey: u64,
            ctx: u64,
        ) -> isize;
        fn weft_ofi_write_inline(
            e: *mut RawEp,
            buf: *const c_void,
            len: usize,
            raddr: u64,
            rkey: u64,
            ctx: u64,
        ) -> isize;
        fn weft_ofi_poll(
            e: *mut RawEp,
            ctx: *mut u64,
            status: *mut i64,
            max: usize,
            err: *mut c_char,
            errlen: usize,
        ) -> isize;
    }

    /// libfabric's `-FI_EAGAIN`.
    const EAGAIN: isize = -11;

    fn strerror(code: i64) -> String {
        // SAFETY: the shim returns a static, NUL-terminated string for any code.
        unsafe { CStr::from_ptr(weft_ofi_strerror(code as c_int)) }
            .to_string_lossy()
            .into_owned()
    }

    fn call_error(call: &'static str, code: i64) -> NetError {
        NetError::Call {
            provider: PROVIDER,
            call,
            code,
            detail: strerror(code),
        }
    }

    fn text(buf: &[u8]) -> String {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }

    /// An opened fabric and domain (closed on drop, after every endpoint and registration,
    /// which hold it through an `Arc`).
    pub struct Domain(*mut RawDomain);

    // SAFETY: the domain is opened with FI_THREAD_SAFE, so libfabric serializes calls on it;
    // the pointer is owned and freed once.
    unsafe impl Send for Domain {}
    // SAFETY: as for `Send` (FI_THREAD_SAFE).
    unsafe impl Sync for Domain {}

    impl Domain {
        pub fn open(prov: Option<&str>, hardware_only: bool) -> NetResult<(Domain, String)> {
            let prov = prov
                .map(|p| {
                    CString::new(p).map_err(|_| NetError::Unavailable {
                        provider: PROVIDER,
                        detail: format!("provider name {p:?} contains NUL"),
                    })
                })
                .transpose()?;
            let mut raw = std::ptr::null_mut();
            let mut name = [0u8; 128];
            let mut err = [0u8; 512];
            // SAFETY: every pointer is valid for the lengths given; the shim writes at most
            // `len - 1` bytes plus NUL into the buffers and stores the domain in `raw`.
            let rc = unsafe {
                weft_ofi_open(
                    prov.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                    c_int::from(hardware_only),
                    &mut raw,
                    name.as_mut_ptr().cast(),
                    name.len(),
                    err.as_mut_ptr().cast(),
                    err.len(),
                )
            };
            if rc != 0 || raw.is_null() {
                return Err(NetError::Unavailable {
                    provider: PROVIDER,
                    detail: text(&err),
                });
            }
            Ok((Domain(raw), text(&name)))
        }
    }

    impl Drop for Domain {
        fn drop(&mut self) {
            // SAFETY: opened by `weft_ofi_open`, closed once; nothing uses it any more (the
            // endpoints and registrations held `Arc`s to it).
            unsafe { weft_ofi_close_domain(self.0) }
        }
    }

    struct OfiRegistration {
        mr: *mut RawMr,
        desc: u64,
        remote: RemoteRegion,
        _domain: Arc<Domain>,
    }

    // SAFETY: the registration is only closed (once, on drop); the domain is thread-safe.
    unsafe impl Send for OfiRegistration {}
    // SAFETY: shared access only reads the copied descriptor and keys.
    unsafe impl Sync for OfiRegistration {}

    impl Registration for OfiRegistration {
        fn local_descriptor(&self) -> u64 {
            self.desc
        }
        fn remote(&self) -> RemoteRegion {
            self.remote
        }
    }

    impl Drop for OfiRegistration {
        fn drop(&mut self) {
            // SAFETY: registered by `weft_ofi_mr_reg`, closed once, before the memory: the
            // `Region` declares its registration before its memory, and endpoints that may
            // still use the region close first (`EndpointState` in `stream.rs`).
            unsafe { weft_ofi_mr_close(self.mr) }
        }
    }

    /// Registers host memory for remote writes.
    pub fn register(domain: &Arc<Domain>, memory: Arc<Memory>) -> NetResult<Region> {
        register_on(domain, memory, -1).map_err(|rc| call_error("fi_mr_reg", rc.into()))
    }

    /// Registers CUDA device memory (`memory` names it by its device address) through
    /// `FI_HMEM`; a domain without that capability refuses.
    pub fn register_hmem(
        domain: &Arc<Domain>,
        name: &str,
        memory: Arc<Memory>,
        device: i32,
    ) -> NetResult<Region> {
        register_on(domain, memory, device).map_err(|rc| match rc {
            rc if rc == -libc::EOPNOTSUPP => NetError::Unavailable {
                provider: PROVIDER,
                detail: format!("{name} has no FI_HMEM (device memory registration)"),
            },
            rc => call_error("fi_mr_regattr", rc.into()),
        })
    }

    /// Registers `memory`: host memory (`cuda_device` < 0) or that device's; the shim's code
    /// when it fails.
    fn register_on(
        domain: &Arc<Domain>,
        memory: Arc<Memory>,
        cuda_device: i32,
    ) -> Result<Region, c_int> {
        let mut raw = RawRegistration {
            mr: std::ptr::null_mut(),
            desc: 0,
            key: 0,
            base: 0,
        };
        // SAFETY: host memory is a live allocation of `len` bytes; device memory is named by
        // its address (never dereferenced by the host here); the returned `Region` keeps
        // `memory` (the owner's record of the range) at least as long as the registration;
        // `raw` is a valid out-pointer.
        let rc = unsafe {
            weft_ofi_mr_reg(
                domain.0,
                memory.as_ptr().cast(),
                memory.len(),
                cuda_device,
                &mut raw,
            )
        };
        if rc != 0 {
            return Err(rc);
        }
        let len = memory.len() as u64;
        Ok(Region {
            memory,
            registration: Box::new(OfiRegistration {
                mr: raw.mr,
                desc: raw.desc,
                remote: RemoteRegion {
                    base: raw.base,
                    key: raw.key,
                    len,
                },
                _domain: Arc::clone(domain),
            }),
        })
    }

    pub struct OfiEndpoint {
        ep: *mut RawEp,
        depth: usize,
        inject: usize,
        connected: bool,
        _domain: Arc<Domain>,
    }

    // SAFETY: the endpoint is used by one owner at a time (`&mut self`); the domain is
    // FI_THREAD_SAFE.
    unsafe impl Send for OfiEndpoint {}

    impl OfiEndpoint {
        pub fn open(domain: &Arc<Domain>) -> NetResult<OfiEndpoint> {
            let (mut ep, mut depth, mut inject) = (std::ptr::null_mut(), 0u64, 0u64);
            // SAFETY: the domain is open; the out-pointers are valid.
            let rc = unsafe { weft_ofi_ep_open(domain.0, &mut ep, &mut depth, &mut inject) };
            if rc != 0 {
                return Err(call_error("fi_endpoint", rc.into()));
            }
            Ok(OfiEndpoint {
                ep,
                depth: (depth as usize).clamp(4, 1024),
                inject: inject as usize,
                connected: false,
                _domain: Arc::clone(domain),
            })
        }

        fn posted(&self, call: &'static str, rc: isize) -> NetResult<Posted> {
            match rc {
                0 => Ok(Posted::Yes),
                EAGAIN => Ok(Posted::Full),
                code => Err(call_error(call, code as i64)),
            }
        }

        fn check_connected(&self) -> NetResult<()> {
            if self.connected {
                Ok(())
            } else {
                Err(NetError::NotConnected { provider: PROVIDER })
            }
        }
    }

    impl Drop for OfiEndpoint {
        fn drop(&mut self) {
            // SAFETY: opened by `weft_ofi_ep_open`, closed once.
            unsafe { weft_ofi_ep_close(self.ep) }
        }
    }

    impl Endpoint for OfiEndpoint {
        fn address(&self) -> NetResult<Vec<u8>> {
            let mut buf = vec![0u8; 256];
            let mut len = buf.len();
            // SAFETY: `buf` holds `len` writable bytes; the shim writes at most that and
            // stores the address length in `len`.
            let rc = unsafe { weft_ofi_ep_name(self.ep, buf.as_mut_ptr().cast(), &mut len) };
            if rc != 0 {
                return Err(call_error("fi_getname", rc.into()));
            }
            buf.truncate(len);
            Ok(buf)
        }

        fn connect(&mut self, peer: &[u8]) -> NetResult<()> {
            // fi_av_insert reads an address of the provider's own length: a peer's address
            // of another length would be read out of bounds.
            if peer.len() != self.address()?.len() {
                return Err(call_error("fi_av_insert", -22));
            }
            // SAFETY: `peer` is an address as the peer's `fi_getname` produced it (the
            // provider's own format and length, checked to be non-empty).
            let rc = unsafe { weft_ofi_ep_connect(self.ep, peer.as_ptr().cast()) };
            if rc != 0 {
                return Err(call_error("fi_av_insert", rc.into()));
            }
            self.connected = true;
            Ok(())
        }

        fn max_outstanding(&self) -> usize {
            self.depth
        }

        fn inline_max(&self) -> usize {
            self.inject
        }

        fn write(&mut self, src: Source<'_>, dst: Target, wr_id: u64) -> NetResult<Posted> {
            self.check_connected()?;
            src.check(PROVIDER)?;
            let raddr = dst.address(PROVIDER, src.len)?;
            // SAFETY: the source range is inside the registered allocation, which the caller
            // keeps unchanged (and `src` alive) until the write completes; the remote range
            // was checked against the peer's region.
            let rc = unsafe {
                weft_ofi_write(
                    self.ep,
                    src.region.memory.as_ptr().add(src.offset).cast(),
                    src.len,
                    src.region.registration.local_descriptor(),
                    raddr,
                    dst.region.key,
                    wr_id,
                )
            };
            self.posted("fi_write", rc)
        }

        fn write_inline(&mut self, data: &[u8], dst: Target, wr_id: u64) -> NetResult<Posted> {
            self.check_connected()?;
            check_inline(PROVIDER, data.len(), self.inject)?;
            let raddr = dst.address(PROVIDER, data.len())?;
            // SAFETY: `data` is valid for the call, and FI_INJECT copies it before returning.
            let rc = unsafe {
                weft_ofi_write_inline(
                    self.ep,
                    data.as_ptr().cast(),
                    data.len(),
                    raddr,
                    dst.region.key,
                    wr_id,
                )
            };
            self.posted("fi_writemsg(FI_INJECT)", rc)
        }

        fn poll(&mut self, done: &mut Vec<Completion>) -> NetResult<()> {
            let mut ctx = [0u64; 64];
            let mut status = [0i64; 64];
            let mut err = [0u8; 256];
            loop {
                // SAFETY: the arrays hold 64 entries and `err` its length; the shim fills at
                // most `max` entries.
                let n = unsafe {
                    weft_ofi_poll(
                        self.ep,
                        ctx.as_mut_ptr(),
                        status.as_mut_ptr(),
                        ctx.len(),
                        err.as_mut_ptr().cast(),
                        err.len(),
                    )
                };
                if n < 0 {
                    return Err(call_error("fi_cq_read", n as i64));
                }
                let n = n as usize;
                for i in 0..n {
                    done.push(Completion {
                        wr_id: ctx[i],
                        result: if status[i] == 0 {
                            Ok(())
                        } else {
                            Err(NetError::WorkFailed {
                                provider: PROVIDER,
                                wr_id: ctx[i],
                                status: status[i],
                                detail: format!("{}: {}", strerror(status[i]), text(&err)),
                            })
                        },
                    });
                }
                if n < ctx.len() {
                    return Ok(());
                }
            }
        }
    }
}
