//! GPUs from NVML (the NVIDIA Management Library, loaded at run time through `nvml-wrapper`).
//!
//! Two halves:
//! * [`capture`] asks the driver (through `libnvidia-ml.so.1`) for every GPU (index, name, PCI
//!   bus id, NUMA node and CPU affinity when the driver reports them, memory, compute
//!   capability), the state and remote PCI bus id of each of its NVLinks, the PCIe common
//!   ancestor (`nvmlDeviceGetTopologyCommonAncestor`) and the P2P read status of every pair,
//!   into a plain [`NvmlSnapshot`]. Without a driver it returns [`NvmlUnavailable`], never panics.
//! * [`to_topology`] is a pure function from a snapshot to the [`Topology`] model, so the
//!   conversion is tested with hand-written snapshots of real machine types.
//!
//! Conversion rules (those of `nvidia-smi topo -m`):
//! * `NV#` between two GPUs counts the active links of one GPU whose remote end is the other
//!   GPU's bus id (the larger of the two ends' counts, so one end failing to answer loses nothing).
//! * A remote end that is not a GPU and is reached from two or more GPUs is an NVSwitch; GPUs
//!   that share a switch get `NV#` with `#` = the smaller of their switch link counts (DGX A100:
//!   12, DGX H100: 18), added to any direct links. Other remote ends (a CPU, an unknown device)
//!   are ignored.
//! * Without NVLink, the common ancestor gives the PCIe class: internal/single switch → `PIX`,
//!   several switches → `PXB`, host bridge → `PHB`, same NUMA node → `NODE`, system → `SYS`;
//!   a pair the driver did not answer for is `N/A`.

use crate::error::{Result, TopoError};
use crate::model::{CpuNode, Gpu, PathClass, Topology};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The deepest common PCIe ancestor of two GPUs, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PcieLevel {
    /// Two GPUs on one board (e.g. Tesla K80).
    Internal,
    /// At most one PCIe switch.
    Single,
    /// Several PCIe switches, no host bridge.
    Multiple,
    /// The same host bridge.
    HostBridge,
    /// The same NUMA node, possibly several host bridges.
    Node,
    /// Anywhere in the system (across NUMA nodes).
    System,
}

impl PcieLevel {
    /// The path class `nvidia-smi topo -m` prints for this level.
    pub fn class(self) -> PathClass {
        match self {
            PcieLevel::Internal | PcieLevel::Single => PathClass::Pix,
            PcieLevel::Multiple => PathClass::Pxb,
            PcieLevel::HostBridge => PathClass::Phb,
            PcieLevel::Node => PathClass::Node,
            PcieLevel::System => PathClass::Sys,
        }
    }
}

/// One NVLink of one GPU.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NvmlLink {
    /// Index of the GPU ([`Gpu::index`]) the link belongs to.
    pub gpu: u32,
    /// Link number on that GPU (0..18).
    pub link: u32,
    /// Whether the link is active.
    pub active: bool,
    /// PCI bus id of the device at the other end.
    pub remote_bus_id: Option<String>,
}

/// What NVML says about one pair of GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct NvmlPair {
    /// Index of one GPU.
    pub a: u32,
    /// Index of the other.
    pub b: u32,
    /// Common PCIe ancestor, when the driver answered.
    pub level: Option<PcieLevel>,
    /// P2P read status: `Some(false)` when the driver says peer access is not possible.
    pub p2p_ok: Option<bool>,
}

/// Everything NVML reported, as plain data.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NvmlSnapshot {
    /// GPUs, with bus ids as NVML prints them (`00000000:07:00.0`; normalised on conversion).
    pub gpus: Vec<Gpu>,
    /// NVLinks (one entry per link per GPU).
    pub nvlinks: Vec<NvmlLink>,
    /// Pairs of GPUs.
    pub paths: Vec<NvmlPair>,
}

/// Why NVML gave no GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvmlUnavailable {
    /// The library could not be loaded or the driver is not running.
    NoDriver(String),
    /// The library loaded but failed otherwise.
    Failed(String),
}

impl std::fmt::Display for NvmlUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NvmlUnavailable::NoDriver(e) => write!(f, "no driver ({e})"),
            NvmlUnavailable::Failed(e) => write!(f, "failed ({e})"),
        }
    }
}

/// Normalises a PCI bus id: lower case, 4-digit domain (`00000000:07:00.0` → `0000:07:00.0`).
pub fn normalize_bus_id(bus: &str) -> String {
    let bus = bus.trim().to_ascii_lowercase();
    match bus.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 && dom.is_ascii() => {
            format!("{}:{rest}", &dom[dom.len() - 4..])
        }
        _ => bus,
    }
}

/// A CPU bitmask (bit `i` of word `w` is CPU `64 w + i`) as a list such as `0-19,40-59`;
/// `None` when no bit is set.
pub fn cpulist_from_mask(words: &[u64]) -> Option<String> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for (w, &bits) in words.iter().enumerate() {
        for i in 0..64u64 {
            if bits & (1u64 << i) == 0 {
                continue;
            }
            let cpu = (w as u64).saturating_mul(64).saturating_add(i);
            match ranges.last_mut() {
                Some((_, hi)) if *hi + 1 == cpu => *hi = cpu,
                _ => ranges.push((cpu, cpu)),
            }
        }
    }
    if ranges.is_empty() {
        return None;
    }
    Some(
        ranges
            .iter()
            .map(|&(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// Converts a snapshot into the model: GPUs sorted by index, no NICs (discovery adds them
/// from sysfs), the path matrix, the pairs without P2P, and one CPU node per GPU NUMA node.
/// Errors on a snapshot that names a GPU twice or a pair of GPUs it does not list.
pub fn to_topology(s: &NvmlSnapshot) -> Result<Topology> {
    let bad = |m: String| TopoError::Invalid(format!("NVML snapshot: {m}"));
    let mut gpus: Vec<&Gpu> = s.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    if let Some(w) = gpus.windows(2).find(|w| w[0].index == w[1].index) {
        return Err(bad(format!("GPU {} listed twice", w[0].index)));
    }
    let n = gpus.len();
    let pos = |index: u32| gpus.iter().position(|g| g.index == index);
    let buses: Vec<Option<String>> = gpus
        .iter()
        .map(|g| g.bus_id.as_deref().map(normalize_bus_id))
        .collect();
    // Direct links per (from, to) and links to other endpoints per GPU.
    let mut direct = vec![vec![0u32; n]; n];
    let mut other: BTreeMap<String, BTreeMap<usize, u32>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for l in &s.nvlinks {
        let Some(a) = pos(l.gpu) else {
            return Err(bad(format!("link of unknown GPU {}", l.gpu)));
        };
        if !l.active || !seen.insert((a, l.link)) {
            continue;
        }
        let Some(remote) = l.remote_bus_id.as_deref().map(normalize_bus_id) else {
            continue;
        };
        match buses
            .iter()
            .position(|b| b.as_deref() == Some(remote.as_str()))
        {
            Some(b) if b != a => direct[a][b] += 1,
            Some(_) => {}
            None => *other.entry(remote).or_default().entry(a).or_default() += 1,
        }
    }
    // NVSwitches: non-GPU endpoints reached from two or more GPUs.
    let mut switch_links = vec![0u32; n];
    let mut fabric = crate::model::UnionFind::new(n);
    for per_gpu in other.values().filter(|m| m.len() >= 2) {
        let mut first = None;
        for (&g, &c) in per_gpu {
            switch_links[g] += c;
            match first {
                None => first = Some(g),
                Some(f) => fabric.union(f, g),
            }
        }
    }
    let mut level = vec![vec![None; n]; n];
    let mut p2p_missing = Vec::new();
    for p in &s.paths {
        let (Some(a), Some(b)) = (pos(p.a), pos(p.b)) else {
            return Err(bad(format!("pair of unknown GPUs {}-{}", p.a, p.b)));
        };
        if a == b {
            continue;
        }
        if let Some(l) = p.level {
            level[a][b] = Some(l);
            level[b][a] = Some(l);
        }
        if p.p2p_ok == Some(false) {
            p2p_missing.push((a.min(b), a.max(b)));
        }
    }
    p2p_missing.sort_unstable();
    p2p_missing.dedup();
    let paths = PathClass::matrix(n, |a, b| {
        let mut nv = direct[a][b].max(direct[b][a]);
        if switch_links[a] > 0 && switch_links[b] > 0 && fabric.find(a) == fabric.find(b) {
            nv += switch_links[a].min(switch_links[b]);
        }
        if nv > 0 {
            PathClass::NvLink(nv.min(64))
        } else {
            level[a][b].map_or(PathClass::Na, PcieLevel::class)
        }
    });
    let mut topo = Topology {
        source: "nvml".into(),
        gpus: gpus
            .iter()
            .zip(&buses)
            .map(|(&g, bus)| Gpu {
                bus_id: bus.clone(),
                ..g.clone()
            })
            .collect(),
        paths,
        p2p_missing,
        ..Topology::default()
    };
    for g in &topo.gpus {
        if let Some(numa) = g.numa {
            if !topo.cpus.iter().any(|c| c.numa == numa) {
                topo.cpus.push(CpuNode {
                    numa,
                    cpulist: g.cpu_affinity.clone(),
                    cpus: g.cpu_affinity.as_deref().map(crate::nvsmi::count_cpus),
                    mem_bytes: None,
                });
            }
        }
    }
    topo.cpus.sort_by_key(|c| c.numa);
    topo.validate()?;
    Ok(topo)
}

/// Most NVLinks per GPU NVML knows of (`NVML_NVLINK_MAX_LINKS`).
const MAX_LINKS: u32 = 18;

/// Reads a snapshot from the driver through the NVML library at `lib`
/// (`libnvidia-ml.so.1`). Fields the driver does not answer are left out.
pub fn capture(lib: &Path) -> std::result::Result<NvmlSnapshot, NvmlUnavailable> {
    use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::Nvml;

    let nvml = Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .map_err(|e| match e {
            NvmlError::LibloadingError(l) => NvmlUnavailable::NoDriver(l.to_string()),
            NvmlError::FailedToLoadSymbol(_)
            | NvmlError::DriverNotLoaded
            | NvmlError::LibraryNotFound
            | NvmlError::NoPermission => NvmlUnavailable::NoDriver(e.to_string()),
            e => NvmlUnavailable::Failed(e.to_string()),
        })?;
    let count = nvml
        .device_count()
        .map_err(|e| NvmlUnavailable::Failed(format!("device count: {e}")))?;
    let mut snap = NvmlSnapshot::default();
    let mut indices = Vec::new();
    for i in 0..count {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let index = d.index().unwrap_or(i);
        indices.push((i, index));
        // 16 words: 1024 CPUs on 64-bit targets. `c_ulong` is u32 on 32-bit ones.
        #[allow(clippy::useless_conversion)]
        let cpu_affinity = d
            .cpu_affinity(16)
            .ok()
            .and_then(|w| cpulist_from_mask(&w.into_iter().map(u64::from).collect::<Vec<_>>()));
        snap.gpus.push(Gpu {
            index,
            name: d.name().ok(),
            bus_id: d.pci_info().ok().map(|p| p.bus_id),
            numa: d.numa_node_id().ok(),
            cpu_affinity,
            mem_bytes: d.memory_info().ok().map(|m| m.total),
            sm: d.cuda_compute_capability().ok().and_then(|c| {
                u32::try_from(c.major.saturating_mul(10).saturating_add(c.minor)).ok()
            }),
        });
        for link in 0..MAX_LINKS {
            let l = d.link_wrapper_for(link);
            let Ok(active) = l.is_active() else {
                continue;
            };
            snap.nvlinks.push(NvmlLink {
                gpu: index,
                link,
                active,
                remote_bus_id: if active {
                    l.remote_pci_info().ok().map(|p| p.bus_id)
                } else {
                    None
                },
            });
        }
    }
    for (x, &(ia, a)) in indices.iter().enumerate() {
        for &(ib, b) in &indices[x + 1..] {
            let (Ok(da), Ok(db)) = (nvml.device_by_index(ia), nvml.device_by_index(ib)) else {
                continue;
            };
            let p2p_ok = da
                .p2p_status(&db, P2pCapabilitiesIndex::Read)
                .ok()
                .map(|s| s == P2pStatus::Ok);
            let level = da.topology_common_ancestor(db).ok().map(|l| match l {
                TopologyLevel::Internal => PcieLevel::Internal,
                TopologyLevel::Single => PcieLevel::Single,
                TopologyLevel::Multiple => PcieLevel::Multiple,
                TopologyLevel::HostBridge => PcieLevel::HostBridge,
                TopologyLevel::Node => PcieLevel::Node,
                TopologyLevel::System => PcieLevel::System,
            });
            snap.paths.push(NvmlPair {
                a,
                b,
                level,
                p2p_ok,
            });
        }
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvsmi;

    fn bus(i: u32) -> String {
        // NVML's 8-digit domain, upper case, as the driver prints it.
        format!("00000000:{:02X}:00.0", 0x07 + 0x10 * i)
    }

    fn gpus(n: u32, numa: impl Fn(u32) -> u32, aff: impl Fn(u32) -> &'static str) -> Vec<Gpu> {
        (0..n)
            .map(|i| Gpu {
                index: i,
                name: Some("Tesla V100-SXM2-32GB".into()),
                bus_id: Some(bus(i)),
                numa: Some(numa(i)),
                cpu_affinity: Some(aff(i).into()),
                mem_bytes: Some(32 << 30),
                sm: Some(70),
            })
            .collect()
    }

    /// Both ends of `count` links between GPUs `a` and `b`, numbered from each GPU's next free link.
    fn links(pairs: &[(u32, u32, u32)], n: u32) -> Vec<NvmlLink> {
        let mut next = vec![0u32; n as usize];
        let mut out = Vec::new();
        for &(a, b, count) in pairs {
            for _ in 0..count {
                for (x, y) in [(a, b), (b, a)] {
                    out.push(NvmlLink {
                        gpu: x,
                        link: next[x as usize],
                        active: true,
                        remote_bus_id: Some(bus(y)),
                    });
                    next[x as usize] += 1;
                }
            }
        }
        out
    }

    fn pairs(n: u32, level: impl Fn(u32, u32) -> PcieLevel) -> Vec<NvmlPair> {
        let mut out = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                out.push(NvmlPair {
                    a,
                    b,
                    level: Some(level(a, b)),
                    p2p_ok: Some(true),
                });
            }
        }
        out
    }

    fn fixture(name: &str) -> Topology {
        let p = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        nvsmi::parse(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn same_gpu_matrix(t: &Topology, f: &Topology) {
        assert_eq!(t.gpus.len(), f.gpus.len());
        for i in 0..t.gpus.len() {
            for j in 0..t.gpus.len() {
                assert_eq!(t.gpu_path(i, j), f.gpu_path(i, j), "GPU{i}-GPU{j}");
            }
            assert_eq!(t.gpus[i].numa, f.gpus[i].numa, "GPU{i} NUMA");
            assert_eq!(
                t.gpus[i].cpu_affinity, f.gpus[i].cpu_affinity,
                "GPU{i} CPUs"
            );
        }
        assert_eq!(
            t.socket_groups(),
            f.socket_groups()[..t.gpus.len()].to_vec()
        );
    }

    fn socket(i: u32) -> u32 {
        u32::from(i >= 4)
    }

    #[test]
    fn dgx1_hybrid_cube_mesh_matches_nvidia_smi() {
        // DGX-1 V100: 6 NVLinks per GPU, two quads joined by 0-4, 1-5, 2-6, 3-7.
        let mesh = [
            (0, 1, 1),
            (0, 2, 1),
            (0, 3, 2),
            (0, 4, 2),
            (1, 2, 2),
            (1, 3, 1),
            (1, 5, 2),
            (2, 3, 2),
            (2, 6, 1),
            (3, 7, 1),
            (4, 5, 1),
            (4, 6, 1),
            (4, 7, 2),
            (5, 6, 2),
            (5, 7, 1),
            (6, 7, 2),
        ];
        let mut nvlinks = links(&mesh, 8);
        // Idle link slots the driver still lists, and one that does not answer its remote.
        nvlinks.push(NvmlLink {
            gpu: 0,
            link: 6,
            active: false,
            remote_bus_id: None,
        });
        nvlinks.push(NvmlLink {
            gpu: 3,
            link: 6,
            active: true,
            remote_bus_id: None,
        });
        let snap = NvmlSnapshot {
            gpus: gpus(
                8,
                socket,
                |i| {
                    if i < 4 {
                        "0-19,40-59"
                    } else {
                        "20-39,60-79"
                    }
                },
            ),
            nvlinks,
            paths: pairs(8, |a, b| match (socket(a) == socket(b), a / 2 == b / 2) {
                (true, true) => PcieLevel::Single,
                (true, false) => PcieLevel::Node,
                (false, _) => PcieLevel::System,
            }),
        };
        let t = to_topology(&snap).unwrap();
        same_gpu_matrix(&t, &fixture("dgx1_v100.txt"));
        assert_eq!(t.source, "nvml");
        assert_eq!(t.gpus[2].bus_id.as_deref(), Some("0000:27:00.0"));
        assert_eq!(t.gpus[0].mem_bytes, Some(32 << 30));
        assert_eq!(t.cpus.len(), 2);
        assert_eq!(t.cpus[1].cpus, Some(40));
        assert!(t.p2p_missing.is_empty());
    }

    #[test]
    fn one_end_of_a_link_is_enough() {
        // Only GPU0's side answered: NV2 still, from either direction.
        let mut nvlinks = links(&[(0, 1, 2)], 2);
        nvlinks.retain(|l| l.gpu == 0);
        let snap = NvmlSnapshot {
            gpus: gpus(2, |_| 0, |_| "0-7"),
            nvlinks,
            paths: pairs(2, |_, _| PcieLevel::HostBridge),
        };
        let t = to_topology(&snap).unwrap();
        assert_eq!(t.gpu_path(0, 1), PathClass::NvLink(2));
        assert_eq!(t.gpu_path(1, 0), PathClass::NvLink(2));
    }

    #[test]
    fn pcie_dual_socket_matches_nvidia_smi() {
        // 8 GPUs, pairs under one switch, two switches per socket.
        let snap = NvmlSnapshot {
            gpus: gpus(
                8,
                socket,
                |i| {
                    if i < 4 {
                        "0-23,48-71"
                    } else {
                        "24-47,72-95"
                    }
                },
            ),
            nvlinks: Vec::new(),
            paths: pairs(8, |a, b| match (socket(a) == socket(b), a / 2 == b / 2) {
                (true, true) => PcieLevel::Single,
                (true, false) => PcieLevel::Node,
                (false, _) => PcieLevel::System,
            }),
        };
        same_gpu_matrix(
            &to_topology(&snap).unwrap(),
            &fixture("pcie8_dual_socket.txt"),
        );
    }

    #[test]
    fn pcie_four_gpus_two_switch_levels_match_nvidia_smi() {
        let snap = NvmlSnapshot {
            gpus: gpus(4, |_| 0, |_| "0-15"),
            nvlinks: Vec::new(),
            paths: pairs(4, |a, b| {
                if a / 2 == b / 2 {
                    PcieLevel::Single
                } else {
                    PcieLevel::Multiple
                }
            }),
        };
        same_gpu_matrix(&to_topology(&snap).unwrap(), &fixture("pcie4_pxb.txt"));
        let two = NvmlSnapshot {
            gpus: gpus(2, |_| 0, |_| "0-7"),
            nvlinks: Vec::new(),
            paths: pairs(2, |_, _| PcieLevel::HostBridge),
        };
        same_gpu_matrix(&to_topology(&two).unwrap(), &fixture("pcie2_phb.txt"));
    }

    #[test]
    fn nvswitch_fabric_matches_nvidia_smi() {
        // DGX A100: each GPU has 2 links to each of 6 NVSwitches (12 in all).
        let numa = |i: u32| [3, 3, 1, 1, 7, 7, 5, 5][i as usize];
        let aff = |i: u32| {
            [
                "48-63,176-191",
                "48-63,176-191",
                "16-31,144-159",
                "16-31,144-159",
                "112-127,240-255",
                "112-127,240-255",
                "80-95,208-223",
                "80-95,208-223",
            ][i as usize]
        };
        let mut nvlinks = Vec::new();
        for g in 0..8 {
            for link in 0..12 {
                nvlinks.push(NvmlLink {
                    gpu: g,
                    link,
                    active: true,
                    remote_bus_id: Some(format!("00000000:{:02X}:00.0", 0xC4 + link / 2)),
                });
            }
        }
        let snap = NvmlSnapshot {
            gpus: gpus(8, numa, aff),
            nvlinks,
            paths: pairs(8, |a, b| {
                if numa(a) == numa(b) {
                    PcieLevel::Multiple
                } else {
                    PcieLevel::System
                }
            }),
        };
        let t = to_topology(&snap).unwrap();
        let f = fixture("dgx_a100.txt");
        for i in 0..8 {
            for j in 0..8 {
                assert_eq!(t.gpu_path(i, j), f.gpu_path(i, j), "GPU{i}-GPU{j}");
            }
        }
    }

    #[test]
    fn p2p_missing_and_unanswered_pairs() {
        let mut paths = pairs(3, |_, _| PcieLevel::System);
        paths[0].p2p_ok = Some(false);
        paths[2].level = None;
        let snap = NvmlSnapshot {
            gpus: gpus(3, |_| 0, |_| "0-3"),
            nvlinks: Vec::new(),
            paths,
        };
        let t = to_topology(&snap).unwrap();
        assert_eq!(t.p2p_missing, vec![(0, 1)]);
        assert_eq!(t.gpu_path(1, 2), PathClass::Na);
        assert_eq!(t.gpu_path(0, 2), PathClass::Sys);
    }

    #[test]
    fn bad_snapshots_are_errors() {
        let mut s = NvmlSnapshot {
            gpus: gpus(2, |_| 0, |_| "0"),
            ..NvmlSnapshot::default()
        };
        s.gpus[1].index = 0;
        assert!(to_topology(&s).unwrap_err().to_string().contains("twice"));
        let s = NvmlSnapshot {
            gpus: gpus(1, |_| 0, |_| "0"),
            nvlinks: links(&[(0, 5, 1)], 6),
            paths: Vec::new(),
        };
        assert!(to_topology(&s).is_err());
        let s = NvmlSnapshot {
            gpus: gpus(1, |_| 0, |_| "0"),
            nvlinks: Vec::new(),
            paths: pairs(2, |_, _| PcieLevel::Node),
        };
        assert!(to_topology(&s).is_err());
        // No GPUs at all is a valid, empty topology.
        assert!(to_topology(&NvmlSnapshot::default())
            .unwrap()
            .gpus
            .is_empty());
    }

    #[test]
    fn masks_and_bus_ids() {
        assert_eq!(cpulist_from_mask(&[]), None);
        assert_eq!(cpulist_from_mask(&[0, 0]), None);
        assert_eq!(cpulist_from_mask(&[0b1011]).as_deref(), Some("0-1,3"));
        // 0-19 and 40-59, then 64-65 in the next word, and CPU 127.
        let w0 = ((1u64 << 20) - 1) | (((1u64 << 20) - 1) << 40);
        assert_eq!(
            cpulist_from_mask(&[w0, 0b11 | (1 << 63)]).as_deref(),
            Some("0-19,40-59,64-65,127")
        );
        assert_eq!(
            cpulist_from_mask(&[u64::MAX, u64::MAX]).as_deref(),
            Some("0-127")
        );
        assert_eq!(normalize_bus_id("00000000:07:00.0"), "0000:07:00.0");
        assert_eq!(normalize_bus_id("0000:B7:00.0"), "0000:b7:00.0");
        assert_eq!(normalize_bus_id("garbage"), "garbage");
        assert_eq!(normalize_bus_id("ééééé:1"), "ééééé:1");
    }

    #[test]
    fn capture_without_a_driver_is_an_error_not_a_panic() {
        let e = capture(Path::new("/nonexistent/libnvidia-ml.so.1")).unwrap_err();
        assert!(matches!(e, NvmlUnavailable::NoDriver(_)), "{e}");
        assert!(e.to_string().starts_with("no driver ("), "{e}");
    }
}
