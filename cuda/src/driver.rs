//! The guard in front of every driver call, error translation, device enumeration and the
//! driver's peer-to-peer (P2P / NVLink) information.
//!
//! cudarc loads `libcuda` lazily and panics on the first call when it is missing, so every public
//! entry point of this crate calls [`ensure_driver`] first: it checks that the library can be
//! loaded (`is_culib_present`), then runs `cuInit` once, and turns either failure into
//! [`CudaError::NoDriver`]. Types that hold driver objects ([`crate::Context`] and everything
//! made from one) can only be created after that check succeeded.

use crate::error::{CudaError, Result};
use cudarc::driver::sys;
use std::sync::OnceLock;

use weftcc_settings::CUDA_DISABLE;

/// The outcome of the one-time driver check of this process.
static DRIVER: OnceLock<std::result::Result<(), String>> = OnceLock::new();
/// The outcome of the one-time NVRTC check of this process.
static NVRTC: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// True when the CUDA driver library can be loaded and initialised (never panics). Cheap after
/// the first call (no allocation): the C ABI asks it on every host call.
pub fn driver_present() -> bool {
    DRIVER.get_or_init(probe_unless_disabled).is_ok()
}

/// Checks once per process that the driver can be loaded and initialised; every driver call in
/// this crate is reached only after this returned `Ok`.
pub fn ensure_driver() -> Result<()> {
    DRIVER
        .get_or_init(probe_unless_disabled)
        .clone()
        .map_err(CudaError::NoDriver)
}

/// [`probe_driver`] as `WEFT_CUDA_DISABLE` says (a value that does not parse is the reason
/// there is no driver).
fn probe_unless_disabled() -> std::result::Result<(), String> {
    let disabled = CUDA_DISABLE.flag().map_err(|e| e.to_string())?;
    probe_driver(disabled)
}

/// The check behind [`ensure_driver`], without the process-wide cache (`disabled` stands for
/// `WEFT_CUDA_DISABLE=1`), so tests can exercise the "absent" branch on any machine.
pub(crate) fn probe_driver(disabled: bool) -> std::result::Result<(), String> {
    if disabled {
        return Err(format!("{}=1 is set", CUDA_DISABLE.name));
    }
    // SAFETY: is_culib_present only tries to dlopen the library names and drops the handle; it
    // calls no driver function.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "libcuda.so could not be loaded (is the NVIDIA driver installed and on the loader path?)"
                .into(),
        );
    }
    // SAFETY: the library is present (checked above), so cudarc resolves cuInit without
    // panicking; cuInit takes flags 0 and may be called any number of times.
    let r = unsafe { sys::cuInit(0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuInit failed: {}", result_name(r)));
    }
    Ok(())
}

/// Checks once per process that NVRTC can be loaded.
pub fn ensure_nvrtc() -> Result<()> {
    NVRTC
        .get_or_init(|| {
            // SAFETY: as for the driver: only tries to dlopen the NVRTC library names.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                Ok(())
            } else {
                Err("libnvrtc.so could not be loaded (install the CUDA toolkit's NVRTC)".into())
            }
        })
        .clone()
        .map_err(CudaError::NoNvrtc)
}

/// The driver's name for a result code (`CUDA_ERROR_INVALID_VALUE`, ...).
pub(crate) fn result_name(r: sys::CUresult) -> String {
    format!("{r:?}")
}

/// Turns a driver result into `Ok` or a [`CudaError::Driver`] naming the call.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver {
            call,
            code: r as i32,
            name: result_name(r),
        })
    }
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize> {
    ensure_driver()?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: the driver is loaded and initialised (ensure_driver); `n` is a valid out pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// What the driver says about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal (`CUDA_VISIBLE_DEVICES` order).
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// PCI bus id, e.g. `0000:18:00.0`.
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total memory in bytes.
    pub total_mem: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
}

/// Looks up the driver handle of device `ordinal`.
pub(crate) fn device_handle(ordinal: usize) -> Result<sys::CUdevice> {
    ensure_driver()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::Other(format!(
            "CUDA device {ordinal} does not exist ({count} visible)"
        )));
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: driver initialised; ordinal < count, so it fits a c_int; `dev` is an out pointer.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as std::ffi::c_int)
    })?;
    Ok(dev)
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: driver initialised (callers got `dev` from device_handle); `v` is an out pointer.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })?;
    Ok(v)
}

/// True when the loaded driver exports `name` (resolving a missing symbol through cudarc would
/// panic). Call only after [`ensure_driver`] succeeded.
pub(crate) fn has_symbol(name: &str) -> bool {
    if ensure_driver().is_err() {
        return false;
    }
    // SAFETY: the driver library is loaded (ensure_driver succeeded), so culib() finds it; we
    // only look the symbol up, never call it through this type.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

/// The ordinal of the device whose memory `ptr` points into, or `None` for memory that is not
/// device memory (host memory, or an address the driver does not know).
pub fn device_of(ptr: u64) -> Result<Option<usize>> {
    ensure_driver()?;
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: driver initialised; `ordinal` is an out pointer of the int this attribute writes;
    // the driver only looks the address up.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut std::ffi::c_int).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
        return Ok(None);
    }
    let mut kind: std::ffi::c_uint = 0;
    // SAFETY: as above, for the memory type (an unsigned int).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut kind as *mut std::ffi::c_uint).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as std::ffi::c_uint;
    Ok((r == sys::CUresult::CUDA_SUCCESS && kind == device).then_some(ordinal as usize))
}

/// What device `ordinal` offers a network card for GPUDirect RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdrSupport {
    /// The device supports GPUDirect RDMA (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`; the
    /// NIC's driver must also take the memory, through dmabuf or nvidia-peermem).
    pub rdma: bool,
    /// Device memory can be exported as a dmabuf (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` and
    /// `cuMemGetHandleForAddressRange` present), for `ibv_reg_dmabuf_mr`.
    pub dmabuf: bool,
}

/// Whether the `nvidia-peermem` kernel module is loaded (a NIC's `ibv_reg_mr` then takes
/// device addresses: the fallback where dmabuf registration is refused).
pub fn nvidia_peermem() -> bool {
    [
        "/sys/module/nvidia_peermem",
        "/sys/kernel/mm/memory_peers/nv_mem/version",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

/// GPUDirect RDMA and dmabuf support of device `ordinal`.
pub fn gdr_support(ordinal: usize) -> Result<GdrSupport> {
    let dev = device_handle(ordinal)?;
    use sys::CUdevice_attribute as A;
    Ok(GdrSupport {
        rdma: attribute(dev, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? == 1,
        dmabuf: attribute(dev, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? == 1
            && has_symbol("cuMemGetHandleForAddressRange"),
    })
}

/// Name, PCI bus id, compute capability, memory and SM count of device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let dev = device_handle(ordinal)?;
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: driver initialised; the buffer holds 256 chars and we pass that length.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as std::ffi::c_int, dev)
    })?;
    let mut bus = [0 as std::ffi::c_char; 64];
    // SAFETY: as above, 64 chars.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as std::ffi::c_int, dev)
    })?;
    let mut mem: usize = 0;
    // SAFETY: driver initialised; `mem` is an out pointer.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut mem, dev)
    })?;
    use sys::CUdevice_attribute as A;
    Ok(DeviceInfo {
        ordinal,
        name: c_chars(&name),
        pci_bus_id: c_chars(&bus),
        compute_capability: (
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        total_mem: mem as u64,
        multiprocessors: attribute(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
    })
}

/// Every visible device.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    (0..device_count()?).map(device_info).collect()
}

/// The driver's version as `major.minor` (e.g. `12.4`).
pub fn driver_version() -> Result<String> {
    ensure_driver()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: driver initialised; `v` is an out pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
}

fn c_chars(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Peer-to-peer capability of one ordered pair of devices, from the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pLink {
    /// `cuDeviceCanAccessPeer`: the first device can map the second's memory.
    pub access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: relative performance (0 is best; NVLink
    /// pairs rank above PCIe pairs).
    pub performance_rank: i32,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: native atomics over the link (true on
    /// NVLink, false on PCIe): the driver's NVLink hint.
    pub native_atomics: bool,
}

impl P2pLink {
    /// The driver's best guess at the link kind: `NVL` for a peer link with native atomics
    /// (NVLink), `PCI` for other peer access, `SYS` without peer access.
    pub fn kind(&self) -> &'static str {
        match (self.access, self.native_atomics) {
            (true, true) => "NVL",
            (true, false) => "PCI",
            (false, _) => "SYS",
        }
    }
}

/// The P2P matrix of the visible devices: entry `[i][j]` describes `i` accessing `j`
/// (`None` on the diagonal).
pub fn p2p_matrix() -> Result<Vec<Vec<Option<P2pLink>>>> {
    let n = device_count()?;
    let handles: Vec<sys::CUdevice> = (0..n).map(device_handle).collect::<Result<_>>()?;
    let mut m = vec![vec![None; n]; n];
    for (i, &a) in handles.iter().enumerate() {
        for (j, &b) in handles.iter().enumerate() {
            if i == j {
                continue;
            }
            m[i][j] = Some(p2p_link(a, b)?);
        }
    }
    Ok(m)
}

/// P2P capability between two device handles.
pub(crate) fn p2p_link(a: sys::CUdevice, b: sys::CUdevice) -> Result<P2pLink> {
    let mut can: std::ffi::c_int = 0;
    // SAFETY: driver initialised; both handles came from cuDeviceGet; `can` is an out pointer.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, a, b)
    })?;
    let p2p_attr = |attr: sys::CUdevice_P2PAttribute| -> Result<i32> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: as above; `v` is an out pointer.
        check("cuDeviceGetP2PAttribute", unsafe {
            sys::cuDeviceGetP2PAttribute(&mut v, attr, a, b)
        })?;
        Ok(v)
    };
    use sys::CUdevice_P2PAttribute as P;
    Ok(P2pLink {
        access: can != 0,
        performance_rank: p2p_attr(P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
        native_atomics: p2p_attr(P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
    })
}

/// The P2P matrix as text in the manner of `nvidia-smi topo -m` (`X`, `NVL`, `PCI`, `SYS`).
pub fn p2p_report() -> Result<String> {
    let m = p2p_matrix()?;
    let mut s = String::from("      ");
    for j in 0..m.len() {
        s += &format!("GPU{j:<4}");
    }
    s.push('\n');
    for (i, row) in m.iter().enumerate() {
        s += &format!("GPU{i:<3}");
        for cell in row {
            s += &format!("{:<7}", cell.map_or("X", |l| l.kind()));
        }
        s.push('\n');
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_reports_no_driver_instead_of_panicking() {
        // The forced-absent branch runs on every machine.
        let e = probe_driver(true).unwrap_err();
        assert!(e.contains(CUDA_DISABLE.name), "{e}");
        // The real probe: on a machine without libcuda every entry point must return NoDriver
        // (cudarc would panic if any of them reached the FFI).
        let present = driver_present();
        let calls: [(&str, Result<()>); 5] = [
            ("ensure_driver", ensure_driver()),
            ("device_count", device_count().map(|_| ())),
            ("p2p_matrix", p2p_matrix().map(|_| ())),
            ("driver_version", driver_version().map(|_| ())),
            ("Context::new", crate::Context::new(0).map(|_| ())),
        ];
        for (name, r) in calls {
            if present {
                // With a driver only device 0's existence can make these fail.
                if let Err(e) = r {
                    assert!(!matches!(e, CudaError::NoDriver(_)), "{name}: {e}");
                }
            } else {
                match r {
                    Err(CudaError::NoDriver(msg)) => assert!(!msg.is_empty()),
                    other => panic!("{name} without a driver returned {other:?}"),
                }
            }
        }
        if !present {
            println!("no CUDA driver here: every entry point returned NoDriver");
            assert!(CudaError::NoDriver(String::new()).is_unavailable());
        }
    }
}
