//! The native InfiniBand / RoCE provider: reliable-connection queue pairs over rdma-core's
//! verbs, one queue pair and completion queue per connection, RDMA writes (inline for the
//! control words), the peer reached by LID on InfiniBand and by GID on RoCE.
//!
//! `csrc/ibv_shim.c` compiles the inline data path (`ibv_post_send`, `ibv_poll_cq`) against the
//! system headers (`cfg(weft_ibv)`, Debian `libibverbs-dev`) and loads `libibverbs.so.1` at run
//! time. With no device (this machine: no RDMA in the kernel), opening fails with
//! [`NetError::Unavailable`] and the automatic choice moves on.
//!
//! Configuration, NCCL's names with `WEFT_`:
//! * `WEFT_IB_HCA`: devices and ports ([`HcaSpec`]): `mlx5_0:1,mlx5_1` (prefixes, optional
//!   port), `^mlx5_1` (all but), `=mlx5_0` (exact names).
//! * `WEFT_IB_GID_INDEX`: the GID table entry for RoCE (default: the first RoCE v2 entry with an
//!   IPv4-mapped address, else the first RoCE v2 entry, else 0; see [`choose_gid`]).
//! * `WEFT_IB_TIMEOUT` (1–31, default 20: 4.096 µs × 2^20 ≈ 4 s per retry) and
//!   `WEFT_IB_RETRY_CNT` (0–7, default 7): how long a queue pair retries before its writes fail,
//!   which the connection turns into `PeerLost` naming the peer.
//!
//! * `WEFT_IB_LIBRARY`: the library loaded instead of `libibverbs.so.1` (the tests load the
//!   emulated RDMA device, [`EMULATOR`], this way).
//!
//! Run on the emulated RDMA device (`csrc/ibemu.c`: the conformance suite, the queue-pair tests
//! of `tests/verbs_emulated.rs`, the collectives matrix, the fault tests), never on RDMA
//! hardware: none has been available to this project.

use super::NetResult;
use crate::error::{Result, TransportError};

const PROVIDER: &str = "IB";

/// One entry of `WEFT_IB_HCA`: a device name (prefix, or exact with `=`) and optional port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HcaEntry {
    /// Device name or prefix.
    pub name: String,
    /// Port, when given (`mlx5_0:1`).
    pub port: Option<u32>,
}

/// `WEFT_IB_HCA`, NCCL's `NCCL_IB_HCA` syntax.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct HcaSpec {
    /// Entries; empty means every device.
    pub entries: Vec<HcaEntry>,
    /// `^`: the entries are excluded rather than selected.
    pub exclude: bool,
    /// `=`: names match exactly rather than as prefixes.
    pub exact: bool,
}

impl HcaSpec {
    /// Parses `[^][=]name[:port][,name[:port]...]`.
    pub fn parse(text: &str) -> Result<HcaSpec> {
        let list = crate::util::NcclList::parse(text);
        let mut entries = Vec::new();
        for item in list.items {
            let (name, port) = match item.split_once(':') {
                Some((n, p)) => {
                    let port = p.parse::<u32>().ok().filter(|&p| p > 0).ok_or_else(|| {
                        TransportError::Config(format!(
                            "WEFT_IB_HCA={text:?}: port {p:?} of {n:?} is not a port number"
                        ))
                    })?;
                    (n, Some(port))
                }
                None => (item, None),
            };
            if name.is_empty() {
                return Err(TransportError::Config(format!(
                    "WEFT_IB_HCA={text:?}: an entry has no device name"
                )));
            }
            entries.push(HcaEntry {
                name: name.to_string(),
                port,
            });
        }
        Ok(HcaSpec {
            entries,
            exclude: list.exclude,
            exact: list.exact,
        })
    }

    fn entry_matches(&self, e: &HcaEntry, device: &str, port: u32) -> bool {
        crate::util::NcclList::name_matches(self.exact, &e.name, device)
            && e.port.is_none_or(|p| p == port)
    }

    /// Whether port `port` of `device` may be used.
    pub fn allows(&self, device: &str, port: u32) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let listed = self
            .entries
            .iter()
            .any(|e| self.entry_matches(e, device, port));
        listed != self.exclude
    }
}

/// The verbs configuration of a rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VerbsConfig {
    /// `WEFT_IB_HCA`.
    pub hca: HcaSpec,
    /// `WEFT_IB_GID_INDEX`; `None` chooses ([`choose_gid`]).
    pub gid_index: Option<u32>,
    /// `WEFT_IB_TIMEOUT` (the queue pair's local ACK timeout exponent).
    pub timeout: u8,
    /// `WEFT_IB_RETRY_CNT`.
    pub retry_cnt: u8,
    /// `WEFT_IB_LIBRARY`: the verbs library to load instead of `libibverbs.so.1` from the
    /// search path (the tests' emulated device, [`EMULATOR`]).
    pub library: Option<std::path::PathBuf>,
}

/// The emulated RDMA device this build made (`csrc/ibemu.c`, built where the verbs headers
/// are installed): a stand-in for `libibverbs.so.1` whose wire runs over Unix sockets between
/// the processes of this machine. Loaded only when [`VerbsConfig::library`] names it.
pub const EMULATOR: Option<&str> = option_env!("WEFTCC_IBEMU_LIBRARY");

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            hca: HcaSpec::default(),
            gid_index: None,
            timeout: 20,
            retry_cnt: 7,
            library: None,
        }
    }
}

impl VerbsConfig {
    /// From `WEFT_IB_HCA`, `WEFT_IB_GID_INDEX`, `WEFT_IB_TIMEOUT`, `WEFT_IB_RETRY_CNT`,
    /// `WEFT_IB_LIBRARY`.
    pub fn from_env() -> Result<VerbsConfig> {
        use weftcc_settings::{IB_GID_INDEX, IB_HCA, IB_LIBRARY, IB_RETRY_CNT, IB_TIMEOUT};
        Ok(VerbsConfig {
            library: IB_LIBRARY.path(),
            ..VerbsConfig::parse(
                IB_HCA.value().as_deref(),
                IB_GID_INDEX.value().as_deref(),
                IB_TIMEOUT.value().as_deref(),
                IB_RETRY_CNT.value().as_deref(),
            )?
        })
    }

    /// From the variables' values (`None` where unset).
    pub fn parse(
        hca: Option<&str>,
        gid_index: Option<&str>,
        timeout: Option<&str>,
        retry_cnt: Option<&str>,
    ) -> Result<VerbsConfig> {
        use weftcc_settings::{IB_GID_INDEX, IB_RETRY_CNT, IB_TIMEOUT};
        let d = VerbsConfig::default();
        Ok(VerbsConfig {
            hca: hca.map(HcaSpec::parse).transpose()?.unwrap_or_default(),
            gid_index: IB_GID_INDEX.number_in(gid_index)?.map(|v| v as u32),
            timeout: IB_TIMEOUT
                .number_in(timeout)?
                .map_or(d.timeout, |v| v as u8),
            retry_cnt: IB_RETRY_CNT
                .number_in(retry_cnt)?
                .map_or(d.retry_cnt, |v| v as u8),
            library: None,
        })
    }
}

/// What the device choice needs to know of a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Device name (`mlx5_0`).
    pub device: String,
    /// Port number.
    pub port: u32,
    /// The port is ACTIVE.
    pub active: bool,
    /// Ethernet link layer (RoCE) rather than InfiniBand.
    pub roce: bool,
}

/// The first active port `spec` allows, in the order given (devices as the library lists them).
pub fn choose_port<'a>(ports: &'a [PortInfo], spec: &HcaSpec) -> Option<&'a PortInfo> {
    ports
        .iter()
        .find(|p| p.active && spec.allows(&p.device, p.port))
}

/// The GID index to use on a RoCE port, from its table as (index, GID bytes, type as sysfs
/// writes it: `RoCE v2`, `IB/RoCE v1`): the first RoCE v2 entry whose address is IPv4-mapped
/// (`::ffff:a.b.c.d`, routable as NCCL prefers), else the first RoCE v2 entry, else 0.
pub fn choose_gid(table: &[(u32, [u8; 16], String)]) -> u32 {
    let v2 = |t: &String| t.trim().eq_ignore_ascii_case("RoCE v2");
    let mapped = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    table
        .iter()
        .find(|(_, g, t)| v2(t) && mapped(g))
        .or_else(|| {
            table
                .iter()
                .find(|(_, g, t)| v2(t) && g.iter().any(|&b| b != 0))
        })
        .map_or(0, |(i, _, _)| *i)
}

/// The GID table of `device` port `port` as sysfs shows it (`gids/<i>`, `gid_attrs/types/<i>`),
/// non-zero entries only.
pub fn gid_table_from_sysfs(
    sysfs: &std::path::Path,
    device: &str,
    port: u32,
) -> Vec<(u32, [u8; 16], String)> {
    let dir = sysfs.join(format!("class/infiniband/{device}/ports/{port}"));
    let Ok(entries) = std::fs::read_dir(dir.join("gids")) else {
        return Vec::new();
    };
    let mut out: Vec<(u32, [u8; 16], String)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let index: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            let gid = parse_gid(text.trim())?;
            gid.iter().any(|&b| b != 0).then_some(())?;
            let kind = std::fs::read_to_string(dir.join(format!("gid_attrs/types/{index}")))
                .unwrap_or_default();
            Some((index, gid, kind.trim().to_string()))
        })
        .collect();
    out.sort_by_key(|e| e.0);
    out
}

/// `fe80:0000:...:0e0f` (eight groups of four hex digits) as bytes.
pub fn parse_gid(text: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = text.split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut gid = [0u8; 16];
    for (k, g) in groups.iter().enumerate() {
        let v = u16::from_str_radix(g, 16).ok()?;
        gid[2 * k..2 * k + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(gid)
}

/// The emulated RDMA device ([`EMULATOR`]) opened for a test, with ACK timeout exponent
/// `timeout` and `retry_cnt` retries. Where it was not built: `None` after saying so, or a panic
/// where `WEFT_REQUIRE_NET_TESTS=1` (CI never passes by skipping).
#[doc(hidden)]
pub fn emulated_for_tests(timeout: u8, retry_cnt: u8) -> Option<VerbsProvider> {
    let Some(lib) = EMULATOR else {
        let why = "the emulated RDMA device was not built (install libibverbs-dev and rebuild)";
        assert!(
            !weftcc_settings::REQUIRE_NET_TESTS.flag().unwrap_or(true),
            "WEFT_REQUIRE_NET_TESTS=1 and {why}"
        );
        eprintln!("skipping: {why}");
        return None;
    };
    let cfg = VerbsConfig {
        library: Some(lib.into()),
        timeout,
        retry_cnt,
        ..VerbsConfig::default()
    };
    Some(VerbsProvider::open(&cfg).expect("the emulated device opens"))
}

/// The verbs provider: a device port opened for this process.
pub struct VerbsProvider {
    #[cfg(weft_ibv)]
    inner: sys::Opened,
    name: String,
    roce: bool,
}

impl VerbsProvider {
    /// Opens the first active port `cfg.hca` allows.
    pub fn open(cfg: &VerbsConfig) -> NetResult<VerbsProvider> {
        #[cfg(weft_ibv)]
        {
            let (inner, name, roce) = sys::Opened::open(cfg)?;
            Ok(VerbsProvider { inner, name, roce })
        }
        #[cfg(not(weft_ibv))]
        {
            let _ = cfg;
            Err(super::NetError::Unavailable {
                provider: PROVIDER,
                detail: "this build has no verbs support (libibverbs-dev was not installed when \
                         it was compiled)"
                    .into(),
            })
        }
    }
}

impl super::Provider for VerbsProvider {
    fn name(&self) -> String {
        format!("{PROVIDER}/{}", self.name)
    }

    fn id(&self) -> String {
        if self.roce { "ib:roce" } else { "ib:ib" }.into()
    }

    fn register(&self, memory: std::sync::Arc<super::Memory>) -> NetResult<super::Region> {
        #[cfg(weft_ibv)]
        {
            self.inner.register(memory)
        }
        #[cfg(not(weft_ibv))]
        {
            let _ = memory;
            Err(not_built())
        }
    }

    fn register_dmabuf(
        &self,
        memory: std::sync::Arc<super::Memory>,
        dmabuf: super::Dmabuf<'_>,
    ) -> NetResult<super::Region> {
        #[cfg(weft_ibv)]
        {
            self.inner.register_dmabuf(memory, dmabuf)
        }
        #[cfg(not(weft_ibv))]
        {
            let _ = (memory, dmabuf);
            Err(not_built())
        }
    }

    fn endpoint(&self) -> NetResult<Box<dyn super::Endpoint>> {
        #[cfg(weft_ibv)]
        {
            Ok(Box::new(self.inner.endpoint()?))
        }
        #[cfg(not(weft_ibv))]
        {
            Err(not_built())
        }
    }
}

#[cfg(not(weft_ibv))]
fn not_built() -> super::NetError {
    super::NetError::Unavailable {
        provider: PROVIDER,
        detail: "not compiled in".into(),
    }
}

#[cfg(weft_ibv)]
mod sys {
    //! The shim's C interface and the safe types over it.

    use super::{choose_gid, choose_port, gid_table_from_sysfs, PortInfo, VerbsConfig, PROVIDER};
    use crate::net::{
        check_inline, Completion, Dmabuf, Endpoint, Memory, NetError, NetResult, Posted, Region,
        Registration, RemoteRegion, Source, Target,
    };
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::os::fd::AsRawFd;
    use std::sync::Arc;

    #[repr(C)]
    pub struct RawLib {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub struct RawCtx {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub struct RawQp {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub struct RawMr {
        _private: [u8; 0],
    }

    #[repr(C)]
    #[derive(Default)]
    struct RawPortInfo {
        state: u32,
        link_layer: u32,
        active_mtu: u32,
        lid: u32,
        gid_table_len: u32,
    }

    #[repr(C)]
    #[derive(Default)]
    struct RawPeer {
        qpn: u32,
        psn: u32,
        lid: u32,
        gid: [u8; 16],
        use_gid: u32,
        gid_index: u32,
        mtu: u32,
        timeout: u32,
        retry_cnt: u32,
        my_psn: u32,
    }

    extern "C" {
        fn weft_ibv_load(
            path: *const c_char,
            out: *mut *const RawLib,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        fn weft_ibv_status_str(c: *mut RawCtx, status: c_int) -> *const c_char;
        fn weft_ibv_devices(lib: *const RawLib, names: *mut c_char, len: usize) -> c_int;
        fn weft_ibv_open(
            lib: *const RawLib,
            name: *const c_char,
            out: *mut *mut RawCtx,
            ports: *mut c_int,
        ) -> c_int;
        fn weft_ibv_close(c: *mut RawCtx);
        fn weft_ibv_port(c: *mut RawCtx, port: c_int, info: *mut RawPortInfo) -> c_int;
        fn weft_ibv_gid(c: *mut RawCtx, port: c_int, index: c_int, gid: *mut u8) -> c_int;
        fn weft_ibv_reg(
            c: *mut RawCtx,
            buf: *mut c_void,
            len: usize,
            mr: *mut *mut RawMr,
            lkey: *mut u32,
            rkey: *mut u32,
        ) -> c_int;
        fn weft_ibv_reg_dmabuf(
            c: *mut RawCtx,
            offset: u64,
            len: usize,
            iova: u64,
            fd: c_int,
            mr: *mut *mut RawMr,
            lkey: *mut u32,
            rkey: *mut u32,
        ) -> c_int;
        fn weft_ibv_dereg(c: *mut RawCtx, mr: *mut RawMr);
        fn weft_ibv_qp_open(
            c: *mut RawCtx,
            port: c_int,
            depth: c_int,
            out: *mut *mut RawQp,
            qpn: *mut u32,
            max_inline: *mut u32,
        ) -> c_int;
        fn weft_ibv_qp_close(q: *mut RawQp);
        fn weft_ibv_qp_connect(q: *mut RawQp, peer: *const RawPeer) -> c_int;
        fn weft_ibv_write(
            q: *mut RawQp,
            buf: *const c_void,
            len: usize,
            lkey: u32,
            raddr: u64,
            rkey: u32,
            wr_id: u64,
            inline_data: c_int,
        ) -> c_int;
        fn weft_ibv_poll(q: *mut RawQp, ids: *mut u64, status: *mut i32, max: c_int) -> c_int;
    }

    /// `IBV_PORT_ACTIVE` and `IBV_LINK_LAYER_ETHERNET`.
    const PORT_ACTIVE: u32 = 4;
    const LINK_LAYER_ETHERNET: u32 = 2;
    const QUEUE_DEPTH: usize = 256;
    /// Bytes of an endpoint address: qpn, psn, lid, mtu, then the GID.
    const ADDRESS: usize = 16 + 16;

    fn errno_error(call: &'static str, rc: c_int) -> NetError {
        NetError::Call {
            provider: PROVIDER,
            call,
            code: rc.into(),
            detail: std::io::Error::from_raw_os_error(-rc).to_string(),
        }
    }

    /// An opened device context and protection domain (closed on drop, after everything that
    /// holds it through an `Arc`).
    struct Ctx(*mut RawCtx);

    // SAFETY: verbs contexts and protection domains are thread-safe in rdma-core; the pointer
    // is owned and closed once.
    unsafe impl Send for Ctx {}
    // SAFETY: as for `Send`.
    unsafe impl Sync for Ctx {}

    impl Drop for Ctx {
        fn drop(&mut self) {
            // SAFETY: opened by `weft_ibv_open`, closed once, after every queue pair and
            // registration (which hold `Arc`s to this).
            unsafe { weft_ibv_close(self.0) }
        }
    }

    /// How this process reaches peers: the chosen port and its addressing.
    pub struct Opened {
        ctx: Arc<Ctx>,
        port: u32,
        lid: u32,
        mtu: u32,
        gid: [u8; 16],
        gid_index: u32,
        roce: bool,
        cfg: VerbsConfig,
    }

    impl Opened {
        pub fn open(cfg: &VerbsConfig) -> NetResult<(Opened, String, bool)> {
            let unavailable = |detail: String| NetError::Unavailable {
                provider: PROVIDER,
                detail,
            };
            let mut err = [0u8; 512];
            let path = match &cfg.library {
                Some(p) => {
                    Some(CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| {
                        unavailable(format!("WEFT_IB_LIBRARY={p:?} holds a NUL byte"))
                    })?)
                }
                None => None,
            };
            let path_ptr = path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
            let mut lib: *const RawLib = std::ptr::null();
            // SAFETY: `err` is writable for its length; `path_ptr` is NULL or a C string that
            // outlives the call; `lib` is a valid out-pointer. A loaded library is never
            // unloaded: `lib` stays valid for the process's life.
            if unsafe { weft_ibv_load(path_ptr, &mut lib, err.as_mut_ptr().cast(), err.len()) } != 0
            {
                let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
                return Err(unavailable(
                    String::from_utf8_lossy(&err[..end]).into_owned(),
                ));
            }
            let mut names = vec![0u8; 4096];
            // SAFETY: `names` is writable for its length; the shim NUL-separates names in it.
            let n = unsafe { weft_ibv_devices(lib, names.as_mut_ptr().cast(), names.len()) };
            if n < 0 {
                return Err(unavailable(format!(
                    "no RDMA device ({})",
                    std::io::Error::from_raw_os_error(-n)
                )));
            }
            let devices: Vec<String> = names
                .split(|&b| b == 0)
                .take(n as usize)
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            if devices.is_empty() {
                return Err(unavailable("no RDMA device".into()));
            }
            // Open each device in turn until one has a port the configuration allows.
            for device in &devices {
                let Ok(cname) = CString::new(device.as_str()) else {
                    continue;
                };
                let (mut raw, mut nports) = (std::ptr::null_mut(), 0);
                // SAFETY: valid C string and out-pointers.
                if unsafe { weft_ibv_open(lib, cname.as_ptr(), &mut raw, &mut nports) } != 0 {
                    continue;
                }
                let ctx = Arc::new(Ctx(raw));
                let mut infos = Vec::new();
                let mut raw_infos = Vec::new();
                for port in 1..=nports.max(0) as u32 {
                    let mut info = RawPortInfo::default();
                    // SAFETY: the context is open; `info` is a valid out-pointer.
                    if unsafe { weft_ibv_port(ctx.0, port as c_int, &mut info) } != 0 {
                        continue;
                    }
                    infos.push(PortInfo {
                        device: device.clone(),
                        port,
                        active: info.state == PORT_ACTIVE,
                        roce: info.link_layer == LINK_LAYER_ETHERNET,
                    });
                    raw_infos.push(info);
                }
                let Some(chosen) = choose_port(&infos, &cfg.hca) else {
                    continue;
                };
                let info = &raw_infos[infos.iter().position(|p| p == chosen).unwrap_or(0)];
                let gid_index = match (cfg.gid_index, chosen.roce) {
                    (Some(i), _) => i,
                    (None, true) => choose_gid(&gid_table_from_sysfs(
                        std::path::Path::new("/sys"),
                        device,
                        chosen.port,
                    )),
                    (None, false) => 0,
                };
                let mut gid = [0u8; 16];
                // SAFETY: the context is open; `gid` holds 16 bytes.
                let rc = unsafe {
                    weft_ibv_gid(
                        ctx.0,
                        chosen.port as c_int,
                        gid_index as c_int,
                        gid.as_mut_ptr(),
                    )
                };
                if rc != 0 && chosen.roce {
                    return Err(errno_error("ibv_query_gid", rc));
                }
                let name = format!("{device}:{}", chosen.port);
                let roce = chosen.roce;
                return Ok((
                    Opened {
                        ctx,
                        port: chosen.port,
                        lid: info.lid,
                        mtu: info.active_mtu,
                        gid,
                        gid_index,
                        roce,
                        cfg: cfg.clone(),
                    },
                    name,
                    roce,
                ));
            }
            Err(unavailable(format!(
                "no active port among {} allowed by WEFT_IB_HCA",
                devices.join(", ")
            )))
        }

        pub fn register(&self, memory: Arc<Memory>) -> NetResult<Region> {
            let (ptr, len) = (memory.as_ptr(), memory.len());
            self.registered(memory, "ibv_reg_mr", |mr, lkey, rkey| {
                // SAFETY: `memory` is a live allocation that the returned `Region` keeps alive
                // until after the registration is dropped; out-pointers are valid.
                unsafe { weft_ibv_reg(self.ctx.0, ptr.cast(), len, mr, lkey, rkey) }
            })
        }

        /// Registers the dmabuf range `dmabuf` whose device address (iova) is `memory`'s.
        pub fn register_dmabuf(
            &self,
            memory: Arc<Memory>,
            dmabuf: Dmabuf<'_>,
        ) -> NetResult<Region> {
            let (iova, len) = (memory.as_ptr() as u64, memory.len());
            self.registered(memory, "ibv_reg_dmabuf_mr", |mr, lkey, rkey| {
                // SAFETY: the descriptor is open for the call (borrowed); the driver maps the
                // dmabuf itself and names it by `iova`, which is never dereferenced here; the
                // returned `Region` keeps `memory` (the owner's record of the range) until after
                // the registration is dropped; out-pointers are valid.
                unsafe {
                    let fd = dmabuf.fd.as_raw_fd();
                    weft_ibv_reg_dmabuf(self.ctx.0, dmabuf.offset, len, iova, fd, mr, lkey, rkey)
                }
            })
        }

        /// `memory` registered by `reg` (a shim call filling the region and its keys; `call`
        /// names it in errors).
        fn registered(
            &self,
            memory: Arc<Memory>,
            call: &'static str,
            reg: impl FnOnce(&mut *mut RawMr, &mut u32, &mut u32) -> c_int,
        ) -> NetResult<Region> {
            let (mut mr, mut lkey, mut rkey) = (std::ptr::null_mut(), 0u32, 0u32);
            let rc = reg(&mut mr, &mut lkey, &mut rkey);
            if rc != 0 {
                return Err(errno_error(call, rc));
            }
            Ok(self.region(memory, mr, lkey, rkey))
        }

        fn region(&self, memory: Arc<Memory>, mr: *mut RawMr, lkey: u32, rkey: u32) -> Region {
            let remote = RemoteRegion {
                base: memory.as_ptr() as u64,
                key: rkey.into(),
                len: memory.len() as u64,
            };
            Region {
                registration: Box::new(VerbsRegistration {
                    mr,
                    lkey,
                    remote,
                    _ctx: Arc::clone(&self.ctx),
                }),
                memory,
            }
        }

        pub fn endpoint(&self) -> NetResult<VerbsEndpoint> {
            let (mut qp, mut qpn, mut max_inline) = (std::ptr::null_mut(), 0u32, 0u32);
            // SAFETY: the context is open; out-pointers are valid.
            let rc = unsafe {
                weft_ibv_qp_open(
                    self.ctx.0,
                    self.port as c_int,
                    QUEUE_DEPTH as c_int,
                    &mut qp,
                    &mut qpn,
                    &mut max_inline,
                )
            };
            if rc != 0 {
                return Err(errno_error("ibv_create_qp", rc));
            }
            let mut psn = [0u8; 4];
            let _ = getrandom::getrandom(&mut psn);
            Ok(VerbsEndpoint {
                qp,
                qpn,
                psn: u32::from_le_bytes(psn) & 0xff_ffff,
                max_inline: max_inline as usize,
                lid: self.lid,
                mtu: self.mtu,
                gid: self.gid,
                gid_index: self.gid_index,
                roce: self.roce,
                timeout: self.cfg.timeout,
                retry_cnt: self.cfg.retry_cnt,
                connected: false,
                _ctx: Arc::clone(&self.ctx),
            })
        }
    }

    struct VerbsRegistration {
        mr: *mut RawMr,
        lkey: u32,
        remote: RemoteRegion,
        _ctx: Arc<Ctx>,
    }

    // SAFETY: the registration is only deregistered (once, on drop).
    unsafe impl Send for VerbsRegistration {}
    // SAFETY: shared access reads copied keys only.
    unsafe impl Sync for VerbsRegistration {}

    impl Registration for VerbsRegistration {
        fn local_descriptor(&self) -> u64 {
            self.lkey.into()
        }
        fn remote(&self) -> RemoteRegion {
            self.remote
        }
    }

    impl Drop for VerbsRegistration {
        fn drop(&mut self) {
            // SAFETY: registered by `weft_ibv_reg`, deregistered once, before the memory (see
            // `Region`) and after the queue pairs that used it (`EndpointState`).
            unsafe { weft_ibv_dereg(self._ctx.0, self.mr) }
        }
    }

    pub struct VerbsEndpoint {
        qp: *mut RawQp,
        qpn: u32,
        psn: u32,
        max_inline: usize,
        lid: u32,
        mtu: u32,
        gid: [u8; 16],
        gid_index: u32,
        roce: bool,
        timeout: u8,
        retry_cnt: u8,
        connected: bool,
        _ctx: Arc<Ctx>,
    }

    // SAFETY: one owner at a time (`&mut self`); the context is thread-safe.
    unsafe impl Send for VerbsEndpoint {}

    impl Drop for VerbsEndpoint {
        fn drop(&mut self) {
            // SAFETY: created by `weft_ibv_qp_open`, destroyed once.
            unsafe { weft_ibv_qp_close(self.qp) }
        }
    }

    impl VerbsEndpoint {
        fn post(&mut self, call: &'static str, rc: c_int) -> NetResult<Posted> {
            match rc {
                0 => Ok(Posted::Yes),
                // A full send queue.
                rc if rc == -libc::ENOMEM => Ok(Posted::Full),
                rc => Err(errno_error(call, rc)),
            }
        }

        fn bounds(&self, dst: Target, len: usize) -> NetResult<u64> {
            if !self.connected {
                return Err(NetError::NotConnected { provider: PROVIDER });
            }
            dst.address(PROVIDER, len)
        }
    }

    impl Endpoint for VerbsEndpoint {
        fn address(&self) -> NetResult<Vec<u8>> {
            let mut a = Vec::with_capacity(ADDRESS);
            for v in [self.qpn, self.psn, self.lid, self.mtu] {
                a.extend_from_slice(&v.to_le_bytes());
            }
            a.extend_from_slice(&self.gid);
            Ok(a)
        }

        fn connect(&mut self, peer: &[u8]) -> NetResult<()> {
            if peer.len() != ADDRESS {
                return Err(errno_error("connect", -libc::EINVAL));
            }
            let word = |i: usize| {
                let mut b = [0u8; 4];
                b.copy_from_slice(&peer[4 * i..4 * i + 4]);
                u32::from_le_bytes(b)
            };
            let mut gid = [0u8; 16];
            gid.copy_from_slice(&peer[16..32]);
            let raw = RawPeer {
                qpn: word(0),
                psn: word(1),
                lid: word(2),
                // Both ends use the smaller of their MTUs.
                mtu: word(3).min(self.mtu).max(1),
                gid,
                use_gid: u32::from(self.roce),
                gid_index: self.gid_index,
                timeout: self.timeout.into(),
                retry_cnt: self.retry_cnt.into(),
                my_psn: self.psn,
            };
            // SAFETY: the queue pair is open; `raw` is a valid peer description.
            let rc = unsafe { weft_ibv_qp_connect(self.qp, &raw) };
            if rc != 0 {
                return Err(errno_error("ibv_modify_qp", rc));
            }
            self.connected = true;
            Ok(())
        }

        fn max_outstanding(&self) -> usize {
            QUEUE_DEPTH
        }

        fn inline_max(&self) -> usize {
            self.max_inline
        }

        fn placement_ordered(&self) -> bool {
            // A reliable connection delivers writes in order, but a CPU polling the peer's
            // memory may see a later write placed before an earlier one (relaxed ordering):
            // flags wait for their data's completion.
            false
        }

        fn write(&mut self, src: Source<'_>, dst: Target, wr_id: u64) -> NetResult<Posted> {
            let raddr = self.bounds(dst, src.len)?;
            src.check(PROVIDER)?;
            // SAFETY: the source range is inside the registered allocation (checked), kept
            // unchanged and alive until the write completes; the remote range was checked.
            let rc = unsafe {
                weft_ibv_write(
                    self.qp,
                    src.region.memory.as_ptr().add(src.offset).cast(),
                    src.len,
                    src.region.registration.local_descriptor() as u32,
                    raddr,
                    dst.region.key as u32,
                    wr_id,
                    0,
                )
            };
            self.post("ibv_post_send", rc)
        }

        fn write_inline(&mut self, data: &[u8], dst: Target, wr_id: u64) -> NetResult<Posted> {
            let raddr = self.bounds(dst, data.len())?;
            check_inline(PROVIDER, data.len(), self.max_inline)?;
            // SAFETY: IBV_SEND_INLINE copies `data` before the call returns.
            let rc = unsafe {
                weft_ibv_write(
                    self.qp,
                    data.as_ptr().cast(),
                    data.len(),
                    0,
                    raddr,
                    dst.region.key as u32,
                    wr_id,
                    1,
                )
            };
            self.post("ibv_post_send", rc)
        }

        fn poll(&mut self, done: &mut Vec<Completion>) -> NetResult<()> {
            let mut ids = [0u64; 64];
            let mut status = [0i32; 64];
            loop {
                // SAFETY: the arrays hold 64 entries.
                let n =
                    unsafe { weft_ibv_poll(self.qp, ids.as_mut_ptr(), status.as_mut_ptr(), 64) };
                if n < 0 {
                    return Err(errno_error("ibv_poll_cq", n));
                }
                for i in 0..n as usize {
                    done.push(Completion {
                        wr_id: ids[i],
                        result: if status[i] == 0 {
                            Ok(())
                        } else {
                            // SAFETY: the shim returns a static string for any status.
                            let text = unsafe {
                                CStr::from_ptr(weft_ibv_status_str(self._ctx.0, status[i]))
                            }
                            .to_string_lossy()
                            .into_owned();
                            Err(NetError::WorkFailed {
                                provider: PROVIDER,
                                wr_id: ids[i],
                                status: status[i].into(),
                                detail: text,
                            })
                        },
                    });
                }
                if (n as usize) < ids.len() {
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::NetError;

    #[test]
    fn hca_spec_follows_nccl_syntax() {
        let s = HcaSpec::parse("mlx5_0:1,mlx5_2").unwrap();
        assert!(s.allows("mlx5_0", 1));
        assert!(!s.allows("mlx5_0", 2), "port 1 only");
        assert!(s.allows("mlx5_2", 2));
        assert!(s.allows("mlx5_20", 1), "prefix match");
        assert!(!s.allows("mlx5_1", 1));
        let x = HcaSpec::parse("^mlx5_1").unwrap();
        assert!(x.allows("mlx5_0", 1) && !x.allows("mlx5_1", 1) && !x.allows("mlx5_10", 1));
        let e = HcaSpec::parse("=mlx5_1").unwrap();
        assert!(e.allows("mlx5_1", 1) && !e.allows("mlx5_10", 1));
        let xe = HcaSpec::parse("^=mlx5_1").unwrap();
        assert!(!xe.allows("mlx5_1", 1) && xe.allows("mlx5_10", 1));
        assert!(HcaSpec::parse("").unwrap().allows("anything", 3));
        for bad in ["mlx5_0:x", "mlx5_0:0", ":1"] {
            assert!(HcaSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn configuration_is_parsed_and_checked() {
        let c = VerbsConfig::parse(Some("=mlx5_0"), Some("3"), Some("22"), Some("5")).unwrap();
        assert_eq!((c.gid_index, c.timeout, c.retry_cnt), (Some(3), 22, 5));
        assert!(c.hca.exact);
        let d = VerbsConfig::parse(None, None, None, None).unwrap();
        assert_eq!(d, VerbsConfig::default());
        assert!(VerbsConfig::parse(None, None, Some("32"), None).is_err());
        assert!(VerbsConfig::parse(None, None, None, Some("8")).is_err());
        assert!(VerbsConfig::parse(None, Some("x"), None, None).is_err());
    }

    #[test]
    fn the_first_active_allowed_port_is_chosen() {
        let port = |d: &str, p: u32, active: bool| PortInfo {
            device: d.into(),
            port: p,
            active,
            roce: false,
        };
        let ports = [
            port("mlx5_0", 1, false),
            port("mlx5_0", 2, true),
            port("mlx5_1", 1, true),
        ];
        let any = HcaSpec::default();
        assert_eq!(
            choose_port(&ports, &any).map(|p| (p.device.as_str(), p.port)),
            Some(("mlx5_0", 2))
        );
        let not0 = HcaSpec::parse("^mlx5_0").unwrap();
        assert_eq!(
            choose_port(&ports, &not0).map(|p| p.device.as_str()),
            Some("mlx5_1")
        );
        let down = HcaSpec::parse("mlx5_0:1").unwrap();
        assert!(
            choose_port(&ports, &down).is_none(),
            "the only allowed port is down"
        );
    }

    #[test]
    fn roce_v2_with_an_ipv4_address_is_the_default_gid() {
        let gid = |t: &str| parse_gid(t).unwrap();
        let link_local = gid("fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f");
        let v4 = gid("0000:0000:0000:0000:0000:ffff:0a00:0001");
        let table = vec![
            (0, link_local, "IB/RoCE v1".to_string()),
            (1, link_local, "RoCE v2".to_string()),
            (2, v4, "IB/RoCE v1".to_string()),
            (3, v4, "RoCE v2".to_string()),
        ];
        assert_eq!(choose_gid(&table), 3);
        assert_eq!(
            choose_gid(&table[..3]),
            1,
            "no IPv4-mapped v2 entry: the first v2"
        );
        assert_eq!(choose_gid(&table[..1]), 0);
        assert_eq!(parse_gid("fe80::1"), None, "sysfs writes all eight groups");
    }

    #[test]
    fn gid_table_is_read_from_sysfs() {
        let root = std::env::temp_dir().join(format!("weft-gid-{}", std::process::id()));
        let port = root.join("class/infiniband/mlx5_0/ports/1");
        std::fs::create_dir_all(port.join("gids")).unwrap();
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        let put = |rel: &str, text: &str| std::fs::write(port.join(rel), text).unwrap();
        put("gids/0", "fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f\n");
        put("gid_attrs/types/0", "IB/RoCE v1\n");
        put("gids/1", "0000:0000:0000:0000:0000:0000:0000:0000\n");
        put("gids/2", "0000:0000:0000:0000:0000:ffff:0a00:0001\n");
        put("gid_attrs/types/2", "RoCE v2\n");
        let table = gid_table_from_sysfs(&root, "mlx5_0", 1);
        assert_eq!(table.iter().map(|e| e.0).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(choose_gid(&table), 2);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn no_device_is_a_clear_unavailable_error() {
        // No RDMA in this machine's kernel (or no library): never a panic.
        match VerbsProvider::open(&VerbsConfig::default()) {
            Err(NetError::Unavailable { detail, .. }) => eprintln!("verbs: {detail}"),
            Err(other) => panic!("expected Unavailable, got {other}"),
            Ok(p) => eprintln!(
                "an RDMA device is present: {}",
                super::super::Provider::name(&p)
            ),
        }
    }
}
