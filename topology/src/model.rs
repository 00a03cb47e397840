//! The topology model: devices (GPUs, NICs, CPU/NUMA nodes), the path class between every pair of
//! devices (as `nvidia-smi topo -m` and NCCL classify them), link speeds, and a derived graph with
//! PCI switches, NVSwitches and typed links.

use serde::{Deserialize, Serialize};
use std::fmt;

/// How two devices reach each other, best first (`nvidia-smi topo -m` and NCCL vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum PathClass {
    /// The device itself (`X`).
    Loc,
    /// A bonded set of this many NVLinks (`NV#`).
    NvLink(u32),
    /// NVLink through an intermediate GPU (NCCL's NVB; `nvidia-smi` does not print it).
    Nvb,
    /// At most one PCIe switch (`PIX`).
    Pix,
    /// Several PCIe switches, not through a host bridge (`PXB`).
    Pxb,
    /// Through a PCIe host bridge, typically the CPU (`PHB`).
    Phb,
    /// Across PCIe host bridges within one NUMA node (`NODE`).
    Node,
    /// Across NUMA nodes / sockets, over QPI/UPI/xGMI (`SYS`, old `SOC`).
    Sys,
    /// No path reported (`N/A`).
    Na,
}

impl PathClass {
    /// The `n × n` matrix of classes: `Loc` on the diagonal, `between(a, b)` elsewhere.
    pub fn matrix(n: usize, mut between: impl FnMut(usize, usize) -> PathClass) -> Vec<Vec<Self>> {
        (0..n)
            .map(|a| {
                (0..n)
                    .map(|b| {
                        if a == b {
                            PathClass::Loc
                        } else {
                            between(a, b)
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Parses one `nvidia-smi topo -m` cell (case-insensitive); `None` when unknown.
    pub fn parse(s: &str) -> Option<PathClass> {
        let u = s.trim().to_ascii_uppercase();
        Some(match u.as_str() {
            "X" | "LOC" => PathClass::Loc,
            "NVB" => PathClass::Nvb,
            "PIX" => PathClass::Pix,
            "PXB" | "PSB" => PathClass::Pxb,
            "PHB" => PathClass::Phb,
            "NODE" => PathClass::Node,
            "SYS" | "SOC" => PathClass::Sys,
            "N/A" | "NA" => PathClass::Na,
            _ => {
                let n = u.strip_prefix("NV")?;
                let count: u32 = n.parse().ok()?;
                if count == 0 || count > 64 {
                    return None;
                }
                PathClass::NvLink(count)
            }
        })
    }

    /// The label `nvidia-smi` prints.
    pub fn label(self) -> String {
        match self {
            PathClass::Loc => "X".into(),
            PathClass::NvLink(n) => format!("NV{n}"),
            PathClass::Nvb => "NVB".into(),
            PathClass::Pix => "PIX".into(),
            PathClass::Pxb => "PXB".into(),
            PathClass::Phb => "PHB".into(),
            PathClass::Node => "NODE".into(),
            PathClass::Sys => "SYS".into(),
            PathClass::Na => "N/A".into(),
        }
    }

    /// True for direct NVLink (`NV#`).
    pub fn is_nvlink(self) -> bool {
        matches!(self, PathClass::NvLink(_))
    }

    /// A short human description of the link type.
    pub fn describe(self) -> &'static str {
        match self {
            PathClass::Loc => "self",
            PathClass::NvLink(_) => "NVLink",
            PathClass::Nvb => "NVLink through another GPU",
            PathClass::Pix => "PCIe, one switch",
            PathClass::Pxb => "PCIe, several switches",
            PathClass::Phb => "PCIe through the host bridge (CPU)",
            PathClass::Node => "PCIe across host bridges, same NUMA node",
            PathClass::Sys => "across sockets (QPI/UPI/xGMI)",
            PathClass::Na => "no path",
        }
    }
}

impl fmt::Display for PathClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

impl From<PathClass> for String {
    fn from(c: PathClass) -> String {
        c.label()
    }
}

impl TryFrom<String> for PathClass {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        PathClass::parse(&s).ok_or_else(|| format!("unknown path class {s:?}"))
    }
}

/// Bandwidth (GB/s, 1e9 bytes/s, one direction) and latency (µs per hop) of each path class.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkSpeeds {
    /// One NVLink (A100/H100 generations ≈ 20 GB/s usable per link and direction).
    pub nvlink_gbps: f64,
    /// A PCIe path through switches (Gen4 x16 ≈ 24 GB/s).
    pub pcie_gbps: f64,
    /// A PCIe path through the CPU's host bridge(s).
    pub host_bridge_gbps: f64,
    /// A path across sockets.
    pub inter_socket_gbps: f64,
    /// Latency of one NVLink hop, µs.
    pub nvlink_lat_us: f64,
    /// Latency of one PCIe hop, µs.
    pub pcie_lat_us: f64,
    /// Latency of one inter-socket hop, µs.
    pub inter_socket_lat_us: f64,
    /// Latency of one network hop, µs.
    pub net_lat_us: f64,
}

impl Default for LinkSpeeds {
    fn default() -> Self {
        LinkSpeeds {
            nvlink_gbps: 20.0,
            pcie_gbps: 24.0,
            host_bridge_gbps: 18.0,
            inter_socket_gbps: 10.0,
            nvlink_lat_us: 0.6,
            pcie_lat_us: 1.0,
            inter_socket_lat_us: 2.0,
            net_lat_us: 5.0,
        }
    }
}

impl LinkSpeeds {
    /// Bandwidth of a path of this class, GB/s (0 for `N/A` and self).
    pub fn bandwidth(&self, c: PathClass) -> f64 {
        match c {
            PathClass::Loc | PathClass::Na => 0.0,
            PathClass::NvLink(n) => self.nvlink_gbps * f64::from(n),
            PathClass::Nvb => self.nvlink_gbps,
            PathClass::Pix | PathClass::Pxb => self.pcie_gbps,
            PathClass::Phb | PathClass::Node => self.host_bridge_gbps,
            PathClass::Sys => self.inter_socket_gbps,
        }
    }

    /// A GPU's data staged through pinned host memory: the GPU's PCIe link to its host (copied
    /// out on one side, in on the other), GB/s and µs.
    pub fn staged(&self) -> (f64, f64) {
        let pcie = PathClass::Pix;
        (self.bandwidth(pcie), 2.0 * self.latency(pcie))
    }

    /// Latency of a path of this class, µs.
    pub fn latency(&self, c: PathClass) -> f64 {
        match c {
            PathClass::Loc => 0.0,
            PathClass::NvLink(_) => self.nvlink_lat_us,
            PathClass::Nvb => 2.0 * self.nvlink_lat_us,
            PathClass::Pix | PathClass::Pxb | PathClass::Phb | PathClass::Node => self.pcie_lat_us,
            PathClass::Sys => self.inter_socket_lat_us,
            PathClass::Na => f64::INFINITY,
        }
    }
}

/// A GPU.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Gpu {
    /// Index as the driver numbers it (`GPU3` → 3).
    pub index: u32,
    /// Product name when known.
    pub name: Option<String>,
    /// PCI bus id (`0000:07:00.0`) when known.
    pub bus_id: Option<String>,
    /// CPU affinity list (`0-19,40-59`) when known.
    pub cpu_affinity: Option<String>,
    /// NUMA node of the CPUs close to it when known.
    pub numa: Option<u32>,
    /// Compute capability × 10 (e.g. 90) when known.
    pub sm: Option<u32>,
    /// Device memory in bytes when known (NVML).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_bytes: Option<u64>,
}

/// What kind of network device a NIC is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicKind {
    /// InfiniBand / RoCE verbs device (`mlx5_0`).
    Ib,
    /// Ethernet interface.
    Ethernet,
    /// Not known.
    #[default]
    Unknown,
}

/// A network interface.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Nic {
    /// Device name (`mlx5_0`, `eth0`).
    pub name: String,
    /// Column label in `nvidia-smi topo -m` (`NIC0`), or the name.
    pub label: String,
    /// Speed, Gbit/s, when known.
    pub speed_gbit: Option<f64>,
    /// NUMA node when known.
    pub numa: Option<u32>,
    /// PCI bus id when known.
    pub bus_id: Option<String>,
    /// Kind.
    pub kind: NicKind,
    /// Ports of an RDMA device (`/sys/class/infiniband/<dev>/ports`); empty for others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<RdmaPort>,
}

/// One port of an RDMA device, as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RdmaPort {
    /// Port number (`mlx5_0:1` is port 1).
    pub port: u32,
    /// `ACTIVE`, `DOWN`, `INIT`, … (sysfs `state` without its number).
    pub state: String,
    /// Rate in Gbit/s when known (sysfs `rate`, "100 Gb/sec (4X EDR)").
    pub rate_gbit: Option<f64>,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// The GID table's non-zero entries as (index, GID): RoCE v2 needs one of them
    /// (`WEFT_IB_GID_INDEX`).
    pub gids: Vec<(u32, String)>,
}

/// A CPU socket / NUMA node.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CpuNode {
    /// NUMA node id.
    pub numa: u32,
    /// CPU list (`0-19,40-59`) when known.
    pub cpulist: Option<String>,
    /// Number of logical CPUs when known.
    pub cpus: Option<u32>,
    /// Memory of the node in bytes when known.
    pub mem_bytes: Option<u64>,
}

/// Identity of the host this topology describes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct HostInfo {
    /// Host name when known.
    pub hostname: Option<String>,
    /// weftcc host id ([`crate::discover::host_id`]: WEFT_HOST_ID, else hostname + boot id).
    pub host_id: Option<String>,
}

/// A machine: devices and the path class between every pair of devices.
///
/// Devices are numbered GPUs first, then NICs: device `d < gpus.len()` is `gpus[d]`, device
/// `gpus.len() + k` is `nics[k]`. `paths[a][b]` is the class between devices `a` and `b`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Topology {
    /// Where this came from (`nvidia-smi`, `xml`, `discovery`).
    pub source: String,
    /// Host identity.
    pub host: HostInfo,
    /// CPU sockets / NUMA nodes.
    pub cpus: Vec<CpuNode>,
    /// GPUs.
    pub gpus: Vec<Gpu>,
    /// NICs.
    pub nics: Vec<Nic>,
    /// Path class matrix over devices (GPUs then NICs).
    pub paths: Vec<Vec<PathClass>>,
    /// GPU pairs (indices into `gpus`) known to lack peer-to-peer access.
    pub p2p_missing: Vec<(usize, usize)>,
    /// Size of /dev/shm in bytes when known.
    pub shm_bytes: Option<u64>,
}

impl Topology {
    /// Number of devices (GPUs + NICs).
    pub fn ndevices(&self) -> usize {
        self.gpus.len() + self.nics.len()
    }

    /// Label of a device (`GPU0`, `NIC1`).
    pub fn device_label(&self, d: usize) -> String {
        if d < self.gpus.len() {
            format!("GPU{}", self.gpus[d].index)
        } else if let Some(n) = self.nics.get(d - self.gpus.len()) {
            n.label.clone()
        } else {
            format!("dev{d}")
        }
    }

    /// Path class between devices `a` and `b` (`N/A` when out of range).
    pub fn path(&self, a: usize, b: usize) -> PathClass {
        if a == b && a < self.ndevices() {
            return PathClass::Loc;
        }
        self.paths
            .get(a)
            .and_then(|r| r.get(b))
            .copied()
            .unwrap_or(PathClass::Na)
    }

    /// Path class between GPUs `i` and `j` (indices into `gpus`).
    pub fn gpu_path(&self, i: usize, j: usize) -> PathClass {
        self.path(i, j)
    }

    /// Path class between GPU `i` and NIC `k` (indices into `gpus` and `nics`).
    pub fn gpu_nic_path(&self, i: usize, k: usize) -> PathClass {
        self.path(i, self.gpus.len() + k)
    }

    /// Checks that the matrix is square, sized to the devices, symmetric and `X` on the diagonal.
    pub fn validate(&self) -> crate::Result<()> {
        let n = self.ndevices();
        if self.paths.len() != n || self.paths.iter().any(|r| r.len() != n) {
            return Err(crate::TopoError::Invalid(format!(
                "path matrix is not {n}x{n} for {n} devices"
            )));
        }
        for a in 0..n {
            for b in 0..n {
                let c = self.paths[a][b];
                if a == b && c != PathClass::Loc {
                    return Err(crate::TopoError::Invalid(format!(
                        "{} to itself is {c}, expected X",
                        self.device_label(a)
                    )));
                }
                if a != b && c == PathClass::Loc {
                    return Err(crate::TopoError::Invalid(format!(
                        "{} to {} is X but they are different devices",
                        self.device_label(a),
                        self.device_label(b)
                    )));
                }
                if self.paths[b][a] != c {
                    return Err(crate::TopoError::Invalid(format!(
                        "asymmetric matrix: {} to {} is {c} but {} to {} is {}",
                        self.device_label(a),
                        self.device_label(b),
                        self.device_label(b),
                        self.device_label(a),
                        self.paths[b][a]
                    )));
                }
            }
        }
        Ok(())
    }

    /// Socket group of every device. Devices joined by a PCIe class (`PIX`, `PXB`, `PHB`,
    /// `NODE`) or reporting the same NUMA node share a group; groups joined by NVLink merge
    /// unless something says they are apart (a `SYS` pair between them, or different NUMA
    /// nodes). Groups are numbered 0.. in order of first appearance.
    pub fn socket_groups(&self) -> Vec<usize> {
        let n = self.ndevices();
        let numa = |d: usize| -> Option<u32> {
            if d < self.gpus.len() {
                self.gpus[d].numa
            } else {
                self.nics[d - self.gpus.len()].numa
            }
        };
        let mut uf = UnionFind::new(n);
        for a in 0..n {
            for b in (a + 1)..n {
                let pci = matches!(
                    self.path(a, b),
                    PathClass::Pix | PathClass::Pxb | PathClass::Phb | PathClass::Node
                );
                let same_numa = matches!((numa(a), numa(b)), (Some(x), Some(y)) if x == y);
                if pci || same_numa {
                    uf.union(a, b);
                }
            }
        }
        loop {
            let mut apart = std::collections::HashSet::new();
            for a in 0..n {
                for b in (a + 1)..n {
                    let differ = matches!((numa(a), numa(b)), (Some(x), Some(y)) if x != y);
                    if differ || self.path(a, b) == PathClass::Sys {
                        let (ra, rb) = (uf.find(a), uf.find(b));
                        apart.insert((ra.min(rb), ra.max(rb)));
                    }
                }
            }
            let mut merged = false;
            'search: for a in 0..n {
                for b in (a + 1)..n {
                    if matches!(self.path(a, b), PathClass::NvLink(_) | PathClass::Nvb) {
                        let (ra, rb) = (uf.find(a), uf.find(b));
                        if ra != rb && !apart.contains(&(ra.min(rb), ra.max(rb))) {
                            uf.union(ra, rb);
                            merged = true;
                            break 'search;
                        }
                    }
                }
            }
            if !merged {
                break;
            }
        }
        let mut ids = vec![usize::MAX; n];
        let mut next = 0;
        let mut out = vec![0; n];
        for (d, o) in out.iter_mut().enumerate() {
            let r = uf.find(d);
            if ids[r] == usize::MAX {
                ids[r] = next;
                next += 1;
            }
            *o = ids[r];
        }
        out
    }

    /// The NIC closest to GPU `i`, with its class (`None` without NICs).
    pub fn closest_nic(&self, i: usize) -> Option<(usize, PathClass)> {
        (0..self.nics.len())
            .map(|k| (k, self.gpu_nic_path(i, k)))
            .min_by_key(|&(_, c)| class_rank(c))
    }

    /// The graph view: CPU nodes, PCI switches, NVSwitches, GPUs and NICs with typed links,
    /// derived from the path matrix.
    pub fn graph(&self, speeds: &LinkSpeeds) -> Graph {
        crate::graph::derive(self, speeds)
    }

    /// The GPU (index into `gpus`) with PCI bus id `bus` as the CUDA driver writes it; bus ids
    /// differ in their domain's width and case (`00000000:3B:00.0`, `0000:3b:00.0`), so the
    /// bus, device and function are compared.
    pub fn gpu_by_bus_id(&self, bus: &str) -> Option<usize> {
        let tail = |s: &str| {
            s.rsplit_once(':').map(|(a, b)| {
                let bus = a.rsplit(':').next().unwrap_or(a);
                format!("{}:{}", bus.to_ascii_lowercase(), b.to_ascii_lowercase())
            })
        };
        let me = tail(bus)?;
        self.gpus
            .iter()
            .position(|g| g.bus_id.as_deref().and_then(tail).as_ref() == Some(&me))
    }

    /// The path the device communicator's data takes between GPUs `i` and `j` of this host
    /// (indices into `gpus`) and what the model gives it. The device communicator chooses for
    /// the whole host: CUDA IPC peer copies when every pair of its GPUs has peer access (then
    /// over the pair's own path class), else staged through pinned host memory (a copy out of
    /// one GPU and into the other, each over a GPU's PCIe link).
    pub fn gpu_pair_path(&self, i: usize, j: usize, speeds: &LinkSpeeds) -> GpuPairPath {
        let class = self.gpu_path(i, j);
        let ipc = self.p2p_missing.is_empty() && class != PathClass::Na;
        let (transport, gbps, latency_us) = if ipc {
            (
                GpuTransport::CudaIpc,
                speeds.bandwidth(class),
                speeds.latency(class),
            )
        } else {
            let (gbps, lat) = speeds.staged();
            (GpuTransport::Staged, gbps, lat)
        };
        GpuPairPath {
            a: i,
            b: j,
            transport,
            class,
            gbps,
            latency_us,
        }
    }

    /// [`Topology::gpu_pair_path`] of every pair of this host's GPUs.
    pub fn gpu_pair_paths(&self, speeds: &LinkSpeeds) -> Vec<GpuPairPath> {
        let n = self.gpus.len();
        (0..n)
            .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
            .map(|(i, j)| self.gpu_pair_path(i, j, speeds))
            .collect()
    }
}

/// How the device communicator moves data between two GPUs of one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuTransport {
    /// Peer copies between the GPUs' memories (CUDA IPC).
    CudaIpc,
    /// Through pinned host memory.
    Staged,
}

impl GpuTransport {
    /// `cuda-ipc` or `staged`, as `weft doctor` names the transport.
    pub fn name(self) -> &'static str {
        match self {
            GpuTransport::CudaIpc => "cuda-ipc",
            GpuTransport::Staged => "staged",
        }
    }
}

/// A pair of GPUs of one host, the device communicator's path between them and the model's
/// figures for it (a prediction: `weft doctor --device cuda` measures it).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GpuPairPath {
    /// The lower GPU (index into `gpus`).
    pub a: usize,
    /// The higher GPU.
    pub b: usize,
    /// What carries the pair's data.
    pub transport: GpuTransport,
    /// The pair's path class (what CUDA IPC runs over).
    pub class: PathClass,
    /// The model's bandwidth of the path, GB/s per direction.
    pub gbps: f64,
    /// The model's latency of the path, µs.
    pub latency_us: f64,
}

impl GpuPairPath {
    /// `CUDA IPC over NV12, 240 GB/s, 0.6 us`, or the staged path's.
    pub fn describe(&self) -> String {
        let how = match self.transport {
            GpuTransport::CudaIpc => format!("CUDA IPC over {}", self.class.label()),
            GpuTransport::Staged => {
                "staged through pinned host memory (not every pair of the host's GPUs has peer \
                 access)"
                    .to_string()
            }
        };
        format!("{how}, {:.0} GB/s, {:.1} us", self.gbps, self.latency_us)
    }
}

/// Sort key of a class: lower is better.
pub fn class_rank(c: PathClass) -> u32 {
    match c {
        PathClass::Loc => 0,
        PathClass::NvLink(n) => 100 - n.min(99),
        PathClass::Nvb => 150,
        PathClass::Pix => 200,
        PathClass::Pxb => 300,
        PathClass::Phb => 400,
        PathClass::Node => 500,
        PathClass::Sys => 600,
        PathClass::Na => 1000,
    }
}

/// A vertex of the topology graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum NodeKind {
    /// A CPU socket / NUMA node.
    Cpu {
        /// NUMA node id.
        numa: u32,
    },
    /// A PCIe switch (synthesised from PIX/PXB groups when not known).
    PciSwitch {
        /// Sequence number.
        id: usize,
    },
    /// A PCIe host bridge shared by devices that meet at `PHB`.
    HostBridge {
        /// Sequence number.
        id: usize,
    },
    /// An NVSwitch fabric (all GPUs joined with the same NVLink count).
    NvSwitch {
        /// Sequence number.
        id: usize,
    },
    /// A GPU (index into `Topology::gpus`).
    Gpu {
        /// Index into `Topology::gpus`.
        gpu: usize,
    },
    /// A NIC (index into `Topology::nics`).
    Nic {
        /// Index into `Topology::nics`.
        nic: usize,
    },
}

/// Type of a graph edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LinkKind {
    /// NVLink with this many links.
    NvLink {
        /// Number of links.
        count: u32,
    },
    /// A PCIe link below a switch.
    PcieSwitch,
    /// A PCIe link between switches (bridge).
    PcieBridge,
    /// A PCIe link to the CPU's host bridge.
    HostBridge,
    /// The link between sockets (QPI/UPI/xGMI).
    InterSocket,
}

/// A graph vertex.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GraphNode {
    /// Stable name (`cpu0`, `sw1`, `nvs0`, `gpu3`, `nic0`).
    pub id: String,
    /// What it is.
    pub kind: NodeKind,
}

/// A graph edge, with the bandwidth (GB/s) and latency (µs) of the link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GraphLink {
    /// Index of one end in `Graph::nodes`.
    pub a: usize,
    /// Index of the other end.
    pub b: usize,
    /// Link type.
    pub kind: LinkKind,
    /// Bandwidth, GB/s per direction.
    pub bw_gbps: f64,
    /// Latency, µs.
    pub lat_us: f64,
}

/// The topology as a graph.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Graph {
    /// Vertices.
    pub nodes: Vec<GraphNode>,
    /// Edges.
    pub links: Vec<GraphLink>,
}

/// Union-find over `0..n`.
#[derive(Debug, Clone)]
pub(crate) struct UnionFind {
    parent: Vec<usize>,
}

impl UnionFind {
    pub(crate) fn new(n: usize) -> Self {
        UnionFind {
            parent: (0..n).collect(),
        }
    }
    pub(crate) fn find(&mut self, mut x: usize) -> usize {
        while self.parent[x] != x {
            self.parent[x] = self.parent[self.parent[x]];
            x = self.parent[x];
        }
        x
    }
    pub(crate) fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            let (lo, hi) = if ra < rb { (ra, rb) } else { (rb, ra) };
            self.parent[hi] = lo;
        }
    }
}
