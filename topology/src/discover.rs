//! Local discovery: CPUs and NUMA nodes from sysfs, NICs (with speed and NUMA node) from
//! /sys/class/net and /sys/class/infiniband, /dev/shm size, the weftcc host id, and GPUs from
//! the first source that answers:
//!
//! 1. NVML ([`crate::nvml`]: `libnvidia-ml.so.1` loaded at run time; GPUs, NVLinks per pair,
//!    PCIe common ancestors, P2P status),
//! 2. `nvidia-smi topo -m` on the PATH (also names the NICs it sees),
//! 3. none.
//!
//! [`Discovered::notes`] says which source was used and why each earlier one was skipped
//! (`NVML: no driver (...)`). On a machine without GPUs this still describes the host.
//! Discovery never fails: what cannot be read is left out (and listed in the notes).

use crate::error::{Result, TopoError};
use crate::model::{CpuNode, HostInfo, Nic, NicKind, PathClass, RdmaPort, Topology};
use crate::nvml;
use crate::nvsmi::{self, count_cpus};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where discovery looks.
#[derive(Debug, Clone)]
pub struct DiscoverOptions {
    /// sysfs mount point (`/sys`).
    pub sysfs: PathBuf,
    /// The NVML library (`libnvidia-ml.so.1`, found by the dynamic loader); `None` skips NVML.
    pub nvml: Option<PathBuf>,
    /// The `nvidia-smi` program (`nvidia-smi`, found on the PATH); `None` skips it.
    pub nvidia_smi: Option<PathBuf>,
    /// Shared-memory mount whose size is reported (`/dev/shm`).
    pub shm: Option<PathBuf>,
    /// Longest time `nvidia-smi` may take per call.
    pub timeout: Duration,
}

impl Default for DiscoverOptions {
    fn default() -> Self {
        DiscoverOptions {
            sysfs: PathBuf::from("/sys"),
            nvml: Some(PathBuf::from("libnvidia-ml.so.1")),
            nvidia_smi: Some(PathBuf::from("nvidia-smi")),
            shm: Some(PathBuf::from("/dev/shm")),
            timeout: Duration::from_secs(20),
        }
    }
}

/// A discovered topology with notes on what could not be found.
#[derive(Debug, Clone, PartialEq)]
pub struct Discovered {
    /// The host.
    pub topology: Topology,
    /// The GPU source used, and things that were skipped and why (`NVML: no driver (...)`,
    /// `no GPUs: nvidia-smi topo -m: No such file or directory`, ...).
    pub notes: Vec<String>,
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// A NIC found under sysfs: `dev` is its `device` directory.
fn sysfs_nic(name: String, dev: &Path, speed_gbit: Option<f64>, kind: NicKind) -> Nic {
    Nic {
        label: name.clone(),
        name,
        speed_gbit,
        numa: read_numa(dev),
        bus_id: bus_of(dev),
        kind,
        ports: Vec::new(),
    }
}

/// The ports of the RDMA device at `<sysfs>/class/infiniband/<dev>`.
fn rdma_ports(dev: &Path) -> Vec<RdmaPort> {
    let zero = "0000:0000:0000:0000:0000:0000:0000:0000";
    sorted_dir(&dev.join("ports"))
        .into_iter()
        .filter_map(|(name, port)| {
            let number = name.parse::<u32>().ok()?;
            let gids = sorted_dir(&port.join("gids"))
                .into_iter()
                .filter_map(|(i, p)| {
                    let gid = read_trim(&p)?;
                    (gid != zero && !gid.is_empty()).then(|| Some((i.parse().ok()?, gid)))?
                })
                .collect();
            Some(RdmaPort {
                port: number,
                // "4: ACTIVE"
                state: read_trim(&port.join("state"))
                    .map(|s| s.rsplit(':').next().unwrap_or("").trim().to_string())
                    .unwrap_or_default(),
                rate_gbit: read_trim(&port.join("rate")).and_then(|r| {
                    r.split_whitespace()
                        .next()
                        .and_then(|n| n.parse::<f64>().ok())
                }),
                link_layer: read_trim(&port.join("link_layer")).unwrap_or_default(),
                gids,
            })
        })
        .collect()
}

fn read_numa(dev: &Path) -> Option<u32> {
    read_trim(&dev.join("numa_node"))
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|n| if n >= 0 { u32::try_from(n).ok() } else { None })
}

fn bus_of(dev: &Path) -> Option<String> {
    std::fs::canonicalize(dev)
        .ok()
        .and_then(|p| {
            p.file_name()
                .map(|f| f.to_string_lossy().to_ascii_lowercase())
        })
        .filter(|b| b.contains(':'))
}

fn sorted_dir(p: &Path) -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> = std::fs::read_dir(p)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|a| natural_key(&a.0));
    v
}

fn natural_key(s: &str) -> (String, u64) {
    let digits: String = s
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_digit())
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let head = s[..s.len() - digits.len()].to_string();
    (head, digits.parse().unwrap_or(0))
}

/// CPU sockets / NUMA nodes from `<sysfs>/devices/system/node`.
pub fn cpus_from_sysfs(sysfs: &Path) -> Vec<CpuNode> {
    let mut out = Vec::new();
    for (name, path) in sorted_dir(&sysfs.join("devices/system/node")) {
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let cpulist = read_trim(&path.join("cpulist")).filter(|s| !s.is_empty());
        let mem_bytes = read_trim(&path.join("meminfo")).and_then(|m| {
            m.lines().find_map(|l| {
                let mut it = l.split_whitespace();
                // "Node 0 MemTotal:  12345 kB"
                let (_, _, key, val) = (it.next()?, it.next()?, it.next()?, it.next()?);
                (key == "MemTotal:")
                    .then(|| val.parse::<u64>().ok())
                    .flatten()
                    .map(|kb| kb.saturating_mul(1024))
            })
        });
        out.push(CpuNode {
            numa: id,
            cpus: cpulist.as_deref().map(count_cpus),
            cpulist,
            mem_bytes,
        });
    }
    if out.is_empty() {
        let cpulist = read_trim(&sysfs.join("devices/system/cpu/online")).filter(|s| !s.is_empty());
        out.push(CpuNode {
            numa: 0,
            cpus: cpulist.as_deref().map(count_cpus),
            cpulist,
            mem_bytes: None,
        });
    }
    out
}

/// NICs: verbs devices from `<sysfs>/class/infiniband` (speed from the first active port's
/// rate) and physical interfaces from `<sysfs>/class/net` (speed in Mbit/s; virtual interfaces
/// such as lo, docker0 and veth pairs have no `device` link and are left out).
pub fn nics_from_sysfs(sysfs: &Path) -> Vec<Nic> {
    let mut out = Vec::new();
    for (name, path) in sorted_dir(&sysfs.join("class/infiniband")) {
        let dev = path.join("device");
        let ports = rdma_ports(&path);
        // The fastest active port (a port of unknown state counts).
        let speed = ports
            .iter()
            .filter(|p| p.state.is_empty() || p.state == "ACTIVE")
            .filter_map(|p| p.rate_gbit)
            .reduce(f64::max);
        let mut nic = sysfs_nic(name, &dev, speed, NicKind::Ib);
        nic.ports = ports;
        out.push(nic);
    }
    for (name, path) in sorted_dir(&sysfs.join("class/net")) {
        let dev = path.join("device");
        if name == "lo" || !dev.exists() {
            continue;
        }
        let speed = read_trim(&path.join("speed"))
            .and_then(|s| s.parse::<i64>().ok())
            .filter(|&s| s > 0)
            .map(|mbit| mbit as f64 / 1000.0);
        out.push(sysfs_nic(name, &dev, speed, NicKind::Ethernet));
    }
    out
}

/// Runs a program with a time limit; stdout on success.
fn run(prog: &Path, args: &[&str], timeout: Duration) -> Result<String> {
    let io = |e: std::io::Error| TopoError::Io {
        path: format!("{} {}", prog.display(), args.join(" ")),
        source: e,
    };
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(io)?;
    let mut stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        if let Some(out) = stdout.as_mut() {
            let _ = out.take(16 << 20).read_to_end(&mut s);
        }
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait().map_err(io)? {
            Some(s) => break s,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "timed out",
                )));
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let out = reader.join().unwrap_or_default();
    if !status.success() {
        return Err(io(std::io::Error::other(format!("exited with {status}"))));
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Parses `nvidia-smi topo -p2p r`: pairs of GPU positions whose status is not `OK`.
pub fn parse_p2p(text: &str) -> Vec<(usize, usize)> {
    let mut cols: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for l in text.lines() {
        let t: Vec<&str> = l.split_whitespace().collect();
        if t.is_empty() {
            continue;
        }
        if cols.is_empty() {
            if t.iter().all(|x| x.starts_with("GPU")) {
                cols = t.iter().map(|s| s.to_string()).collect();
            }
            continue;
        }
        let Some(i) = cols.iter().position(|c| c == t[0]) else {
            if !cols.is_empty() {
                continue;
            }
            continue;
        };
        for (j, cell) in t.iter().skip(1).take(cols.len()).enumerate() {
            if i != j && !cell.eq_ignore_ascii_case("OK") && !cell.eq_ignore_ascii_case("X") {
                out.push((i.min(j), i.max(j)));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn shm_size(p: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(p).ok()?;
    Some((s.blocks() as u64).saturating_mul(s.fragment_size() as u64))
}

/// Discovers this host with the default options.
pub fn discover() -> Discovered {
    discover_with(&DiscoverOptions::default())
}

/// This host's identity: `WEFT_HOST_ID` if set, else `<hostname>:<boot id>` (the boot id tells
/// apart containers that share a host name but not a kernel; it is empty where
/// `/proc/sys/kernel/random/boot_id` is unreadable). Ranks with equal ids share a host: the
/// communicator connects them with shared memory and lays out hierarchical algorithms by it.
pub fn host_id() -> String {
    if let Some(id) = weftcc_settings::HOST_ID.value() {
        return id;
    }
    let host = hostname().unwrap_or_else(|| "unknown-host".into());
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    format!("{host}:{boot}")
}

/// The CPU's model name (`/proc/cpuinfo`'s first `model name`), when the kernel says.
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    first_field(&text, "model name")
}

/// The NVIDIA driver's version and its GPUs' models, from `/proc/driver/nvidia` (no driver
/// library is loaded): `None` where the driver is not loaded.
pub fn nvidia_driver_and_gpus() -> Option<(String, Vec<String>)> {
    let root = Path::new("/proc/driver/nvidia");
    let version = std::fs::read_to_string(root.join("version")).ok()?;
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    let driver = version
        .lines()
        .next()?
        .split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))?
        .to_string();
    let mut gpus: Vec<(String, String)> = std::fs::read_dir(root.join("gpus"))
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| {
                    let info = std::fs::read_to_string(e.path().join("information")).ok()?;
                    Some((
                        e.file_name().to_string_lossy().into_owned(),
                        first_field(&info, "Model")?,
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    gpus.sort();
    Some((driver, gpus.into_iter().map(|(_, model)| model).collect()))
}

/// The value of the first `key: value` line whose key is `key`.
fn first_field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// This host's name, as the kernel has it.
pub fn hostname() -> Option<String> {
    nix::unistd::gethostname()
        .ok()
        .map(|h| h.to_string_lossy().into_owned())
}

/// Discovers a host with the given sysfs root, `nvidia-smi` program and /dev/shm.
pub fn discover_with(opts: &DiscoverOptions) -> Discovered {
    let mut notes = Vec::new();
    let mut topo = Topology {
        source: "discovery".into(),
        host: HostInfo {
            hostname: hostname(),
            host_id: Some(host_id()),
        },
        ..Topology::default()
    };
    // GPUs: NVML first.
    let mut have_gpus = false;
    match &opts.nvml {
        None => notes.push("NVML: disabled".into()),
        Some(lib) => match nvml::capture(lib)
            .map_err(|e| e.to_string())
            .and_then(|snap| nvml::to_topology(&snap).map_err(|e| format!("failed ({e})")))
        {
            Ok(t) if t.gpus.is_empty() => notes.push("NVML: driver loaded, no GPUs".into()),
            Ok(t) => {
                notes.push(format!("GPUs from NVML ({} GPUs)", t.gpus.len()));
                topo.gpus = t.gpus;
                topo.paths = t.paths;
                topo.p2p_missing = t.p2p_missing;
                have_gpus = true;
            }
            Err(e) => notes.push(format!("NVML: {e}")),
        },
    }
    // Else GPUs (and the NICs nvidia-smi knows about) from nvidia-smi.
    let smi = if have_gpus {
        None
    } else {
        opts.nvidia_smi.as_ref()
    };
    if let Some(prog) = smi {
        match run(prog, &["topo", "-m"], opts.timeout).and_then(|t| nvsmi::parse(&t)) {
            Ok(t) => {
                notes.push(format!("GPUs from nvidia-smi ({} GPUs)", t.gpus.len()));
                topo.gpus = t.gpus;
                topo.nics = t.nics;
                topo.paths = t.paths;
                if let Ok(q) = run(
                    prog,
                    &["--query-gpu=index,name,pci.bus_id", "--format=csv,noheader"],
                    opts.timeout,
                ) {
                    for line in q.lines() {
                        let f: Vec<&str> = line.split(',').map(|s| s.trim()).collect();
                        if let [idx, name, bus] = f[..] {
                            if let Some(g) = topo
                                .gpus
                                .iter_mut()
                                .find(|g| idx.parse::<u32>().ok() == Some(g.index))
                            {
                                g.name = Some(name.to_string());
                                // nvidia-smi prints 8-digit domains: 00000000:07:00.0
                                g.bus_id = Some(nvml::normalize_bus_id(bus));
                            }
                        }
                    }
                }
                if let Ok(p) = run(prog, &["topo", "-p2p", "r"], opts.timeout) {
                    topo.p2p_missing = parse_p2p(&p);
                }
            }
            Err(e) => notes.push(format!("no GPUs: {e}")),
        }
    } else if !have_gpus {
        notes.push("no GPUs: nvidia-smi disabled".into());
    }
    // CPUs.
    topo.cpus = cpus_from_sysfs(&opts.sysfs);
    for g in topo.gpus.iter_mut() {
        if g.numa.is_none() {
            // The GPU's own PCI device in sysfs.
            g.numa = g
                .bus_id
                .as_ref()
                .and_then(|b| read_numa(&opts.sysfs.join("bus/pci/devices").join(b)));
        }
        if g.numa.is_none() {
            if let Some(aff) = &g.cpu_affinity {
                g.numa = topo
                    .cpus
                    .iter()
                    .find(|c| c.cpulist.as_deref() == Some(aff.as_str()))
                    .map(|c| c.numa);
            }
        }
    }
    // NICs: merge sysfs figures into the ones nvidia-smi named, append the others.
    let ng = topo.gpus.len();
    for nic in nics_from_sysfs(&opts.sysfs) {
        if let Some(k) = topo.nics.iter().position(|n| n.name == nic.name) {
            let n = &mut topo.nics[k];
            n.speed_gbit = nic.speed_gbit.or(n.speed_gbit);
            n.numa = nic.numa.or(n.numa);
            n.bus_id = nic.bus_id.or(n.bus_id.take());
            if !nic.ports.is_empty() {
                n.ports = nic.ports;
            }
            continue;
        }
        // A new device: its paths from NUMA nodes (NODE on the same node, SYS across).
        let d = topo.ndevices();
        let numa = |x: usize, t: &Topology| -> Option<u32> {
            if x < ng {
                t.gpus[x].numa
            } else {
                t.nics.get(x - ng).and_then(|n| n.numa)
            }
        };
        topo.nics.push(nic);
        let n = topo.ndevices();
        for row in topo.paths.iter_mut() {
            row.push(PathClass::Na);
        }
        topo.paths.push(vec![PathClass::Na; n]);
        for other in 0..n {
            let c = if other == d {
                PathClass::Loc
            } else {
                match (numa(d, &topo), numa(other, &topo)) {
                    (Some(a), Some(b)) if a == b => PathClass::Node,
                    (Some(_), Some(_)) => PathClass::Sys,
                    _ => PathClass::Na,
                }
            };
            topo.paths[d][other] = c;
            topo.paths[other][d] = c;
        }
    }
    if let Some(shm) = &opts.shm {
        topo.shm_bytes = shm_size(shm);
        if topo.shm_bytes.is_none() {
            notes.push(format!("{}: size unknown", shm.display()));
        }
    }
    if let Err(e) = topo.validate() {
        notes.push(format!("inconsistent discovery ({e}); paths dropped"));
        let n = topo.ndevices();
        topo.paths = PathClass::matrix(n, |_, _| PathClass::Na);
    }
    Discovered {
        topology: topo,
        notes,
    }
}
