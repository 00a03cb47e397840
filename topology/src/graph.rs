//! Deriving a physical-looking tree (sockets → host bridges → PCIe switches → devices) and the
//! typed graph from a path-class matrix. The same tree feeds the NCCL XML writer.

use crate::model::{
    Graph, GraphLink, GraphNode, LinkKind, LinkSpeeds, NodeKind, PathClass, Topology, UnionFind,
};

/// One element of the PCI tree under a socket.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PciElem {
    /// A device (index into the topology's device list).
    Device(usize),
    /// A host bridge shared by devices meeting at PHB.
    HostBridge(Vec<PciElem>),
    /// A PCIe switch.
    Switch(Vec<PciElem>),
}

/// A socket with its NUMA id and its PCI tree.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SocketTree {
    pub numa: u32,
    pub children: Vec<PciElem>,
}

fn groups(devs: &[usize], topo: &Topology, joined: impl Fn(PathClass) -> bool) -> Vec<Vec<usize>> {
    let mut uf = UnionFind::new(devs.len());
    for a in 0..devs.len() {
        for b in (a + 1)..devs.len() {
            if joined(topo.path(devs[a], devs[b])) {
                uf.union(a, b);
            }
        }
    }
    let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
    for (i, &d) in devs.iter().enumerate() {
        let r = uf.find(i);
        match out.iter_mut().find(|(root, _)| *root == r) {
            Some((_, v)) => v.push(d),
            None => out.push((r, vec![d])),
        }
    }
    out.into_iter().map(|(_, v)| v).collect()
}

/// Builds the socket/PCI tree implied by the path classes.
pub(crate) fn pci_tree(topo: &Topology) -> Vec<SocketTree> {
    let sock = topo.socket_groups();
    let nsock = sock.iter().copied().max().map_or(0, |m| m + 1);
    let mut out = Vec::new();
    let mut used_numa: Vec<u32> = Vec::new();
    for s in 0..nsock {
        let devs: Vec<usize> = (0..topo.ndevices()).filter(|&d| sock[d] == s).collect();
        // NUMA id: the first one a device of the group reports, if not already taken.
        let known = devs.iter().find_map(|&d| {
            if d < topo.gpus.len() {
                topo.gpus[d].numa
            } else {
                topo.nics[d - topo.gpus.len()].numa
            }
        });
        let numa = match known {
            Some(n) if !used_numa.contains(&n) => n,
            _ => (0u32..).find(|n| !used_numa.contains(n)).unwrap_or(0),
        };
        used_numa.push(numa);
        let mut children = Vec::new();
        for phb in groups(&devs, topo, |c| {
            matches!(c, PathClass::Pix | PathClass::Pxb | PathClass::Phb)
        }) {
            let pxbs = groups(&phb, topo, |c| matches!(c, PathClass::Pix | PathClass::Pxb));
            let mut phb_children = Vec::new();
            for pxb in &pxbs {
                let pixes = groups(pxb, topo, |c| c == PathClass::Pix);
                let leaf = |g: &Vec<usize>, force_switch: bool| -> PciElem {
                    if g.len() == 1 && !force_switch {
                        PciElem::Device(g[0])
                    } else {
                        PciElem::Switch(g.iter().map(|&d| PciElem::Device(d)).collect())
                    }
                };
                if pixes.len() == 1 {
                    phb_children.push(leaf(&pixes[0], false));
                } else {
                    phb_children.push(PciElem::Switch(
                        pixes.iter().map(|g| leaf(g, true)).collect(),
                    ));
                }
            }
            if phb_children.len() == 1 {
                children.extend(phb_children);
            } else {
                children.push(PciElem::HostBridge(phb_children));
            }
        }
        out.push(SocketTree { numa, children });
    }
    out
}

/// Most NVLinks one GPU has (H100: 18). More links than this to all peers together means the
/// links go to an NVSwitch, not directly to each peer.
pub(crate) const MAX_GPU_NVLINKS: u32 = 18;

/// The NVLink count of an NVSwitch system: every pair of GPUs is joined by the same count `k`
/// and either there are 8 or more GPUs or `k × (n-1)` exceeds what one GPU has (a direct
/// all-to-all mesh of 4 GPUs with NV4 or NV6 is not a switch).
pub(crate) fn nvswitch_links(topo: &Topology) -> Option<u32> {
    let n = topo.gpus.len();
    if n < 3 {
        return None;
    }
    let first = match topo.gpu_path(0, 1) {
        PathClass::NvLink(k) => k,
        _ => return None,
    };
    for i in 0..n {
        for j in (i + 1)..n {
            if topo.gpu_path(i, j) != PathClass::NvLink(first) {
                return None;
            }
        }
    }
    let direct_links = u64::from(first) * (n as u64 - 1);
    (n >= 8 || direct_links > u64::from(MAX_GPU_NVLINKS)).then_some(first)
}

pub(crate) fn derive(topo: &Topology, speeds: &LinkSpeeds) -> Graph {
    let mut g = Graph::default();
    let mut dev_node = vec![usize::MAX; topo.ndevices()];
    for (i, _) in topo.gpus.iter().enumerate() {
        dev_node[i] = g.nodes.len();
        g.nodes.push(GraphNode {
            id: format!("gpu{i}"),
            kind: NodeKind::Gpu { gpu: i },
        });
    }
    for (k, _) in topo.nics.iter().enumerate() {
        dev_node[topo.gpus.len() + k] = g.nodes.len();
        g.nodes.push(GraphNode {
            id: format!("nic{k}"),
            kind: NodeKind::Nic { nic: k },
        });
    }
    let tree = pci_tree(topo);
    let mut counters = (0usize, 0usize);
    let mut cpu_nodes = Vec::new();
    for s in &tree {
        let cpu = g.nodes.len();
        cpu_nodes.push(cpu);
        g.nodes.push(GraphNode {
            id: format!("cpu{}", s.numa),
            kind: NodeKind::Cpu { numa: s.numa },
        });
        for c in &s.children {
            add_elem(&mut g, c, cpu, true, &dev_node, &mut counters, speeds);
        }
    }
    for a in 0..cpu_nodes.len() {
        for b in (a + 1)..cpu_nodes.len() {
            g.links.push(GraphLink {
                a: cpu_nodes[a],
                b: cpu_nodes[b],
                kind: LinkKind::InterSocket,
                bw_gbps: speeds.inter_socket_gbps,
                lat_us: speeds.inter_socket_lat_us,
            });
        }
    }
    if let Some(k) = nvswitch_links(topo) {
        let nvs = g.nodes.len();
        g.nodes.push(GraphNode {
            id: "nvs0".into(),
            kind: NodeKind::NvSwitch { id: 0 },
        });
        for &gpu in dev_node.iter().take(topo.gpus.len()) {
            g.links.push(GraphLink {
                a: gpu,
                b: nvs,
                kind: LinkKind::NvLink { count: k },
                bw_gbps: speeds.bandwidth(PathClass::NvLink(k)),
                lat_us: speeds.nvlink_lat_us,
            });
        }
    } else {
        for i in 0..topo.gpus.len() {
            for j in (i + 1)..topo.gpus.len() {
                if let PathClass::NvLink(k) = topo.gpu_path(i, j) {
                    g.links.push(GraphLink {
                        a: dev_node[i],
                        b: dev_node[j],
                        kind: LinkKind::NvLink { count: k },
                        bw_gbps: speeds.bandwidth(PathClass::NvLink(k)),
                        lat_us: speeds.nvlink_lat_us,
                    });
                }
            }
        }
    }
    g
}

fn add_elem(
    g: &mut Graph,
    e: &PciElem,
    parent: usize,
    parent_is_cpu: bool,
    dev_node: &[usize],
    counters: &mut (usize, usize),
    speeds: &LinkSpeeds,
) {
    let up_kind = |is_cpu: bool, child_is_dev: bool| {
        if is_cpu {
            LinkKind::HostBridge
        } else if child_is_dev {
            LinkKind::PcieSwitch
        } else {
            LinkKind::PcieBridge
        }
    };
    let bw = |k: LinkKind| match k {
        LinkKind::HostBridge => speeds.host_bridge_gbps,
        _ => speeds.pcie_gbps,
    };
    match e {
        PciElem::Device(d) => {
            let kind = up_kind(parent_is_cpu, true);
            g.links.push(GraphLink {
                a: dev_node[*d],
                b: parent,
                kind,
                bw_gbps: bw(kind),
                lat_us: speeds.pcie_lat_us,
            });
        }
        PciElem::HostBridge(ch) | PciElem::Switch(ch) => {
            let me = g.nodes.len();
            let kind = if matches!(e, PciElem::HostBridge(_)) {
                counters.1 += 1;
                g.nodes.push(GraphNode {
                    id: format!("hb{}", counters.1 - 1),
                    kind: NodeKind::HostBridge { id: counters.1 - 1 },
                });
                LinkKind::HostBridge
            } else {
                counters.0 += 1;
                g.nodes.push(GraphNode {
                    id: format!("sw{}", counters.0 - 1),
                    kind: NodeKind::PciSwitch { id: counters.0 - 1 },
                });
                up_kind(parent_is_cpu, false)
            };
            g.links.push(GraphLink {
                a: me,
                b: parent,
                kind,
                bw_gbps: bw(kind),
                lat_us: speeds.pcie_lat_us,
            });
            for c in ch {
                add_elem(g, c, me, false, dev_node, counters, speeds);
            }
        }
    }
}
