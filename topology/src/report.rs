//! What `weft topo` prints: the link matrix, the rings and trees chosen, predictions per
//! collective, and warnings a user can act on; as text, JSON, Graphviz DOT or SVG.

use crate::model::{class_rank, LinkKind, LinkSpeeds, NodeKind, PathClass, Topology};
use crate::netpath::{nic_pairs, NicPair};
use crate::search::{double_binary_tree, host_chain, network_order, rings, RingPlan, Tree};
use crate::tuner::{Algorithm, Calibration, Collective, Model, ModelInput, Protocol, Selection};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// Options of a report.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// Link figures.
    pub speeds: LinkSpeeds,
    /// Hosts to model (trees are built across them).
    pub nhosts: usize,
    /// Ranks per host (default: the GPUs, or 2 on a host without GPUs).
    pub ranks_per_host: Option<usize>,
    /// Shared-memory ring per connected peer, bytes (`WEFT_BUFFSIZE`); `None` sizes rings as the
    /// runtime does for the ranks of one host ([`weftcc_transports::shm::auto_capacity`]).
    pub buffsize: Option<u64>,
    /// Measured link figures.
    pub calibration: Option<Calibration>,
    /// `WEFT_ALGO`.
    pub algos: Selection<Algorithm>,
    /// `WEFT_PROTO`.
    pub protos: Selection<Protocol>,
    /// Message sizes to predict.
    pub sizes: Vec<u64>,
    /// The GPUDirect RDMA distance limit (`WEFT_NET_GDR_LEVEL`).
    pub gdr_level: PathClass,
}

impl Default for ReportOptions {
    fn default() -> Self {
        ReportOptions {
            speeds: LinkSpeeds::default(),
            nhosts: 1,
            ranks_per_host: None,
            buffsize: None,
            calibration: None,
            algos: Selection::default(),
            protos: Selection::default(),
            sizes: vec![8, 64 << 10, 1 << 20, 16 << 20, 256 << 20],
            gdr_level: crate::netpath::DEFAULT_GDR_LEVEL,
        }
    }
}

/// A warning with a stable code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Warning {
    /// Stable identifier (`cross_socket`, `nic_far`, `p2p_missing`, `shm_small`, `no_gpu`).
    pub code: String,
    /// What is wrong and what to do.
    pub message: String,
}

/// One predicted row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictionRow {
    /// Collective.
    pub collective: Collective,
    /// Size, bytes.
    pub bytes: u64,
    /// Algorithm chosen.
    pub algo: Algorithm,
    /// Protocol chosen.
    pub proto: Protocol,
    /// Time, µs.
    pub time_us: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbps: f64,
}

/// Everything `weft topo` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The machine.
    pub topology: Topology,
    /// Link figures used.
    pub speeds: LinkSpeeds,
    /// Rings through the host's GPUs.
    pub rings: RingPlan,
    /// Chain through the host's GPUs used by tree algorithms (its first GPU is the one next
    /// to the network).
    pub chain: Vec<usize>,
    /// Slowest hop of the chain, GB/s (0 with fewer than 2 GPUs).
    pub chain_gbps: f64,
    /// The host's part of a ring through several hosts: from the GPU receiving from the
    /// previous host to the one sending to the next (the first ring opened next to the NICs).
    pub host_ring: Vec<usize>,
    /// Hosts modelled.
    pub nhosts: usize,
    /// Ranks per host modelled.
    pub ranks_per_host: usize,
    /// Double binary tree across the hosts.
    pub trees: [Tree; 2],
    /// Model figures.
    pub model: ModelInput,
    /// Predictions.
    pub predictions: Vec<PredictionRow>,
    /// Warnings.
    pub warnings: Vec<Warning>,
    /// The NIC each GPU uses between hosts, and whether GPUDirect RDMA applies.
    #[serde(default)]
    pub nic_pairs: Vec<NicPair>,
    /// The GPUDirect RDMA distance limit the pairs were judged with.
    #[serde(default = "default_gdr_level")]
    pub gdr_level: PathClass,
    /// The device communicator's path between each pair of the host's GPUs
    /// ([`Topology::gpu_pair_paths`]).
    #[serde(default)]
    pub gpu_paths: Vec<crate::model::GpuPairPath>,
}

fn default_gdr_level() -> PathClass {
    crate::netpath::DEFAULT_GDR_LEVEL
}

fn list(v: &[usize]) -> String {
    v.iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Human size (`8 B`, `64 KiB`, `1 MiB`, `11.2 GiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    while u + 1 < UNITS.len() && b >= 1u64 << (10 * (u + 1)) {
        u += 1;
    }
    let unit = 1u64 << (10 * u);
    if b.is_multiple_of(unit) {
        format!("{} {}", b / unit, UNITS[u])
    } else {
        format!("{:.1} {}", b as f64 / unit as f64, UNITS[u])
    }
}

/// Warnings a user can act on.
pub fn warnings(topo: &Topology, opts: &ReportOptions, ranks_per_host: usize) -> Vec<Warning> {
    let mut out = Vec::new();
    let ng = topo.gpus.len();
    if ng == 0 {
        out.push(Warning {
            code: "no_gpu".into(),
            message: "no GPUs found: ranks on this host use shared memory between CPU \
                      processes (and TCP between hosts)"
                .into(),
        });
    }
    // Socket groups of GPUs that meet only across sockets (no NVLink between the groups).
    let groups = topo.socket_groups();
    let ngroups = groups[..ng].iter().copied().max().map_or(0, |m| m + 1);
    for a in 0..ngroups {
        for b in (a + 1)..ngroups {
            let ga: Vec<usize> = (0..ng).filter(|&i| groups[i] == a).collect();
            let gb: Vec<usize> = (0..ng).filter(|&i| groups[i] == b).collect();
            let nvlinked = ga
                .iter()
                .any(|&i| gb.iter().any(|&j| topo.gpu_path(i, j).is_nvlink()));
            if !nvlinked && !ga.is_empty() && !gb.is_empty() {
                out.push(Warning {
                    code: "cross_socket".into(),
                    message: format!(
                        "GPUs {} and GPUs {} meet only across sockets (SYS, about {:.0} GB/s): \
                         rings cross the socket link; for jobs that fit, bind the ranks to one \
                         socket's GPUs (CUDA_VISIBLE_DEVICES={})",
                        list(&ga),
                        list(&gb),
                        opts.speeds.inter_socket_gbps,
                        list(&ga)
                    ),
                });
            }
        }
    }
    // GPUs whose nearest NIC is across a socket.
    if !topo.nics.is_empty() {
        let far: Vec<usize> = (0..ng)
            .filter(|&i| {
                topo.closest_nic(i)
                    .is_some_and(|(_, c)| class_rank(c) >= class_rank(PathClass::Sys))
            })
            .collect();
        if !far.is_empty() {
            out.push(Warning {
                code: "nic_far".into(),
                message: format!(
                    "GPUs {} have no NIC on their socket: traffic between hosts crosses the \
                     socket link and GPUDirect RDMA is not usable; use a NIC on their PCIe \
                     switch or socket, or restrict WEFT_SOCKET_IFNAME / the job to close GPUs",
                    list(&far)
                ),
            });
        }
    }
    // NVLink without P2P.
    let mut missing: Vec<String> = topo
        .p2p_missing
        .iter()
        .filter(|&&(i, j)| i < ng && j < ng && topo.gpu_path(i, j).is_nvlink())
        .map(|&(i, j)| format!("GPU{}-GPU{}", topo.gpus[i].index, topo.gpus[j].index))
        .collect();
    missing.dedup();
    if !missing.is_empty() {
        out.push(Warning {
            code: "p2p_missing".into(),
            message: format!(
                "{} have NVLink but no peer-to-peer access: traffic goes through host memory; \
                 check the driver, IOMMU/ACS settings, and that the GPUs are in one container",
                missing.join(", ")
            ),
        });
    }
    // /dev/shm too small for the rings between local ranks: the runtime's own budget (a ring
    // per connected local peer, peers connected on demand).
    if let Some(shm) = topo.shm_bytes {
        use weftcc_transports::{mesh::typical_peers, shm as rings};
        let r = ranks_per_host;
        let n = r * opts.nhosts.max(1);
        let capacity = opts
            .buffsize
            .map_or_else(|| rings::auto_capacity(r), |b| b as usize);
        let per_ring = rings::ring_bytes(capacity);
        let per_rank = r.saturating_sub(1).min(typical_peers(n)) as u64;
        let need = (r as u64).saturating_mul(per_rank).saturating_mul(per_ring);
        if r > 1 && shm < need {
            out.push(Warning {
                code: "shm_small".into(),
                message: format!(
                    "/dev/shm has {} but {r} local ranks need {} ({r}×{per_rank} rings of {}: \
                     one per connected local peer): enlarge it (docker run --shm-size={}, or \
                     mount -o remount,size=... /dev/shm) or lower WEFT_BUFFSIZE",
                    human_bytes(shm),
                    human_bytes(need),
                    human_bytes(per_ring),
                    human_bytes(need.next_power_of_two()),
                ),
            });
        }
    }
    out
}

/// Builds the report.
pub fn build(topo: &Topology, opts: &ReportOptions) -> Report {
    let plan = rings(topo, &opts.speeds);
    let host_ring = plan
        .rings
        .first()
        .map(|r| network_order(topo, r))
        .unwrap_or_default();
    let chain = if host_ring.is_empty() {
        host_chain(&plan, topo.gpus.len())
    } else {
        host_ring.clone()
    };
    let chain_gbps = chain
        .windows(2)
        .map(|w| opts.speeds.bandwidth(topo.gpu_path(w[0], w[1])))
        .fold(None, |m: Option<f64>, b| Some(m.map_or(b, |x| x.min(b))))
        .unwrap_or(0.0);
    let nhosts = opts.nhosts.max(1);
    let rph = opts
        .ranks_per_host
        .unwrap_or(if topo.gpus.is_empty() {
            2
        } else {
            topo.gpus.len()
        })
        .max(1);
    let input = ModelInput::from_topology(topo, &plan, &opts.speeds, nhosts, Some(rph));
    let model = Model::new(input, opts.calibration.as_ref());
    let mut predictions = Vec::new();
    for coll in Collective::ALL {
        for &bytes in &opts.sizes {
            if let Some(p) = model.choose(coll, bytes, &opts.algos, &opts.protos) {
                predictions.push(PredictionRow {
                    collective: coll,
                    bytes,
                    algo: p.algo,
                    proto: p.proto,
                    time_us: p.time_us,
                    busbw_gbps: p.busbw_gbps,
                });
            }
        }
    }
    Report {
        topology: topo.clone(),
        speeds: opts.speeds,
        rings: plan,
        chain,
        chain_gbps,
        host_ring,
        nhosts,
        ranks_per_host: rph,
        trees: double_binary_tree(nhosts),
        model: model.input,
        predictions,
        warnings: warnings(topo, opts, rph),
        nic_pairs: nic_pairs(topo, opts.gdr_level),
        gdr_level: opts.gdr_level,
        gpu_paths: topo.gpu_pair_paths(&opts.speeds),
    }
}

fn ring_text(topo: &Topology, order: &[usize]) -> String {
    let mut s: Vec<String> = order
        .iter()
        .map(|&g| topo.gpus.get(g).map_or(g, |x| x.index as usize).to_string())
        .collect();
    if let Some(f) = s.first().cloned() {
        s.push(f);
    }
    s.join(" > ")
}

/// What a GPU–NIC pair allows, for people.
fn gdr_verdict(r: &Report, p: &NicPair) -> String {
    let rdma = r
        .topology
        .nics
        .get(p.nic)
        .is_some_and(|n| n.kind == crate::model::NicKind::Ib);
    let level = if r.gdr_level == PathClass::Loc {
        "LOC".to_string()
    } else {
        r.gdr_level.label()
    };
    if p.gdr {
        format!("GPUDirect RDMA possible (within WEFT_NET_GDR_LEVEL={level})")
    } else if !rdma {
        "no RDMA: staged through host memory".into()
    } else if r.gdr_level == PathClass::Loc {
        "GPUDirect RDMA off (WEFT_NET_GDR_LEVEL=LOC)".into()
    } else {
        format!(
            "staged through host memory ({} is beyond WEFT_NET_GDR_LEVEL={level})",
            p.class.label()
        )
    }
}

/// An optional field of a line: `{before}{value}{after}`, or nothing where it is not known.
fn known(before: &str, value: Option<impl std::fmt::Display>, after: &str) -> String {
    value.map_or(String::new(), |v| format!("{before}{v}{after}"))
}

/// Plain-text rendering.
pub fn render_text(r: &Report) -> String {
    let t = &r.topology;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "host: {}   host id: {}   source: {}",
        t.host.hostname.as_deref().unwrap_or("?"),
        t.host.host_id.as_deref().unwrap_or("?"),
        t.source
    );
    for c in &t.cpus {
        let _ = writeln!(
            o,
            "cpu: NUMA node {}  cpus {}{}{}",
            c.numa,
            c.cpulist.as_deref().unwrap_or("?"),
            known(" (", c.cpus, ")"),
            known("  memory ", c.mem_bytes.map(human_bytes), "")
        );
    }
    for g in &t.gpus {
        let _ = writeln!(
            o,
            "gpu: GPU{}{}{}{}",
            g.index,
            known("  ", g.name.as_deref(), ""),
            known("  bus ", g.bus_id.as_deref(), ""),
            known("  NUMA ", g.numa, "")
        );
    }
    for n in &t.nics {
        let _ = writeln!(
            o,
            "nic: {}{}  {:?}{}{}",
            n.label,
            if n.label != n.name {
                format!(" ({})", n.name)
            } else {
                String::new()
            },
            n.kind,
            known("  ", n.speed_gbit, " Gbit/s"),
            known("  NUMA ", n.numa, "")
        );
        for p in &n.ports {
            let _ = writeln!(
                o,
                "  port {}:{}  {}  {}{}  {} GID{}{}",
                n.name,
                p.port,
                if p.state.is_empty() { "?" } else { &p.state },
                if p.link_layer.is_empty() {
                    "?"
                } else {
                    &p.link_layer
                },
                known("  ", p.rate_gbit, " Gbit/s"),
                p.gids.len(),
                if p.gids.len() == 1 { "" } else { "s" },
                known("  PCI ", n.bus_id.as_deref(), "")
            );
            for (i, gid) in &p.gids {
                let _ = writeln!(o, "    gid {i}: {gid}");
            }
        }
    }
    if let Some(shm) = t.shm_bytes {
        let _ = writeln!(o, "/dev/shm: {}", human_bytes(shm));
    }
    for p in &r.nic_pairs {
        let gpu = t.gpus.get(p.gpu).map_or(p.gpu as u32, |g| g.index);
        let nic = t.nics.get(p.nic).map_or("?", |n| n.name.as_str());
        let _ = writeln!(
            o,
            "network: GPU{gpu} -> {nic} ({}): {}",
            p.class.label(),
            gdr_verdict(r, p)
        );
    }
    if r.nic_pairs.iter().any(|p| p.gdr) {
        let _ = writeln!(
            o,
            "  (weftcc's device communicator runs all-reduces between hosts on its GPUDirect \
             RDMA ring where every rank's NIC takes its GPU memory, and stages the rest through \
             pinned host memory; WEFT_DEBUG=INFO says GDRDMA per peer)"
        );
    }
    if !r.gpu_paths.is_empty() {
        let _ = writeln!(
            o,
            "\nGPU paths of the device communicator (predicted by the model, not measured; \
             `weft doctor --device cuda` measures them):"
        );
        for p in &r.gpu_paths {
            let label = |g: usize| t.gpus.get(g).map_or(g as u32, |x| x.index);
            let _ = writeln!(
                o,
                "  GPU{} <-> GPU{}: {}",
                label(p.a),
                label(p.b),
                p.describe()
            );
        }
    }
    let nd = t.ndevices();
    if nd > 0 {
        let _ = writeln!(o, "\nlink matrix (class / GB/s per direction):");
        let w = (0..nd)
            .map(|d| t.device_label(d).len())
            .max()
            .unwrap_or(4)
            .max(9);
        let _ = write!(o, "{:w$}", "");
        for d in 0..nd {
            let _ = write!(o, " {:>w$}", t.device_label(d));
        }
        o.push('\n');
        for a in 0..nd {
            let _ = write!(o, "{:w$}", t.device_label(a));
            for b in 0..nd {
                let c = t.path(a, b);
                let cell = if c == PathClass::Loc || c == PathClass::Na {
                    c.label()
                } else {
                    format!("{}/{:.0}", c.label(), r.speeds.bandwidth(c))
                };
                let _ = write!(o, " {cell:>w$}");
            }
            o.push('\n');
        }
        let mut seen: Vec<PathClass> = Vec::new();
        for a in 0..nd {
            for b in 0..nd {
                let c = t.path(a, b);
                let key = match c {
                    PathClass::NvLink(_) => PathClass::NvLink(1),
                    x => x,
                };
                if !seen.contains(&key) {
                    seen.push(key);
                }
            }
        }
        seen.sort_by_key(|c| class_rank(*c));
        for c in seen {
            let label = if c.is_nvlink() {
                "NV#".into()
            } else {
                c.label()
            };
            let _ = writeln!(o, "  {label:>4} = {}", c.describe());
        }
    }
    let _ = writeln!(o);
    if r.rings.rings.is_empty() || r.rings.rings[0].order.len() < 2 {
        let _ = writeln!(
            o,
            "rings: none to search ({} GPU): ranks follow rank order",
            t.gpus.len()
        );
    } else {
        let _ = writeln!(
            o,
            "rings: {} channel(s), {:.1} GB/s per GPU and direction in total",
            r.rings.rings.len(),
            r.rings.total_gbps()
        );
        for (k, ring) in r.rings.rings.iter().enumerate() {
            let hops: Vec<String> = ring.hops.iter().map(|c| c.label()).collect();
            let _ = writeln!(
                o,
                "  ring {k}: {}   bottleneck {:.1} GB/s   hops {}   socket crossings {}",
                ring_text(t, &ring.order),
                ring.bottleneck_gbps,
                hops.join(" "),
                ring.socket_crossings()
            );
        }
    }
    if !r.chain.is_empty() {
        let chain: Vec<String> = r
            .chain
            .iter()
            .map(|&g| t.gpus.get(g).map_or(g, |x| x.index as usize).to_string())
            .collect();
        if chain.len() > 1 {
            let _ = writeln!(
                o,
                "tree chain inside the host: {}   slowest hop {:.1} GB/s",
                chain.join(" - "),
                r.chain_gbps
            );
        } else {
            let _ = writeln!(o, "tree chain inside the host: {}", chain.join(" - "));
        }
    }
    if r.nhosts > 1 && r.host_ring.len() > 1 {
        let part: Vec<String> = r
            .host_ring
            .iter()
            .map(|&g| t.gpus.get(g).map_or(g, |x| x.index as usize).to_string())
            .collect();
        let near = |g: usize| {
            t.closest_nic(g).map_or(String::new(), |(k, c)| {
                format!(" ({} {})", t.nics[k].name, c.label())
            })
        };
        let _ = writeln!(
            o,
            "ring across {} hosts: each host runs {}; enters at GPU{}{}, leaves from GPU{}{}",
            r.nhosts,
            part.join(" > "),
            part[0],
            near(r.host_ring[0]),
            part[part.len() - 1],
            near(r.host_ring[r.host_ring.len() - 1])
        );
    }
    if r.nhosts > 1 {
        let net = r.model.net_gbps;
        let tree_bw = if r.chain.len() > 1 {
            r.chain_gbps.min(net)
        } else {
            net
        };
        let _ = writeln!(
            o,
            "trees: 2, each carrying half the data; bottleneck {tree_bw:.1} GB/s (chain inside \
             the host and network {net:.1} GB/s)"
        );
        for (k, tree) in r.trees.iter().enumerate() {
            let edges: Vec<String> = (0..tree.parent.len())
                .filter_map(|h| tree.parent[h].map(|p| format!("{h}->{p}")))
                .collect();
            let _ = writeln!(
                o,
                "tree {k} across {} hosts: root host {}, depth {}, edges (child->parent) {}",
                r.nhosts,
                tree.root,
                tree.depth(),
                edges.join(" ")
            );
        }
    }
    let m = &r.model;
    let _ = writeln!(
        o,
        "\npredicted by the model, not measured ({} ranks on {} host(s); intra-host {:.1} GB/s, \
         {:.1} us/hop; network {:.1} GB/s, {:.1} us/hop):",
        m.nranks, m.nhosts, m.intra_gbps, m.intra_lat_us, m.net_gbps, m.net_lat_us
    );
    let _ = writeln!(
        o,
        "  {:<14} {:>9} {:>5} {:>7} {:>11} {:>11}",
        "collective", "size", "algo", "proto", "time(us)", "busbw(GB/s)"
    );
    for p in &r.predictions {
        let _ = writeln!(
            o,
            "  {:<14} {:>9} {:>5} {:>7} {:>11.1} {:>11.2}",
            p.collective.name(),
            human_bytes(p.bytes),
            p.algo.name(),
            p.proto.name(),
            p.time_us,
            p.busbw_gbps
        );
    }
    if r.warnings.is_empty() {
        let _ = writeln!(o, "\nwarnings: none");
    } else {
        let _ = writeln!(o, "\nwarnings:");
        for w in &r.warnings {
            let _ = writeln!(o, "  [{}] {}", w.code, w.message);
        }
    }
    o
}

/// JSON rendering.
pub fn render_json(r: &Report) -> String {
    serde_json::to_string_pretty(r).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

fn node_label(t: &Topology, k: &NodeKind) -> String {
    match k {
        NodeKind::Cpu { numa } => format!("CPU / NUMA {numa}"),
        NodeKind::PciSwitch { id } => format!("PCIe switch {id}"),
        NodeKind::HostBridge { id } => format!("host bridge {id}"),
        NodeKind::NvSwitch { id } => format!("NVSwitch {id}"),
        NodeKind::Gpu { gpu } => {
            format!("GPU{}", t.gpus.get(*gpu).map_or(*gpu as u32, |g| g.index))
        }
        NodeKind::Nic { nic } => t.nics.get(*nic).map_or(String::new(), |n| {
            if n.name != n.label {
                format!("{} ({})", n.label, n.name)
            } else {
                n.name.clone()
            }
        }),
    }
}

fn link_label(k: LinkKind) -> String {
    match k {
        LinkKind::NvLink { count } => format!("NV{count}"),
        LinkKind::PcieSwitch => "PCIe".into(),
        LinkKind::PcieBridge => "PCIe bridge".into(),
        LinkKind::HostBridge => "host bridge".into(),
        LinkKind::InterSocket => "inter-socket".into(),
    }
}

/// Graphviz DOT rendering: the graph, with the first ring in red.
pub fn render_dot(r: &Report) -> String {
    let t = &r.topology;
    let g = t.graph(&r.speeds);
    let mut o = String::from("graph topology {\n  node [fontname=\"Helvetica\"];\n");
    for n in &g.nodes {
        let shape = match n.kind {
            NodeKind::Cpu { .. } => "box3d",
            NodeKind::PciSwitch { .. } | NodeKind::HostBridge { .. } => "diamond",
            NodeKind::NvSwitch { .. } => "hexagon",
            NodeKind::Gpu { .. } => "box",
            NodeKind::Nic { .. } => "ellipse",
        };
        let _ = writeln!(
            o,
            "  \"{}\" [label=\"{}\", shape={shape}];",
            n.id,
            node_label(t, &n.kind).replace('"', "'")
        );
    }
    for l in &g.links {
        let style = match l.kind {
            LinkKind::NvLink { .. } => "color=green4, penwidth=2",
            LinkKind::InterSocket => "color=orange, style=dashed",
            _ => "color=gray40",
        };
        let _ = writeln!(
            o,
            "  \"{}\" -- \"{}\" [label=\"{} {:.0} GB/s\", {style}];",
            g.nodes[l.a].id,
            g.nodes[l.b].id,
            link_label(l.kind),
            l.bw_gbps
        );
    }
    if let Some(ring) = r.rings.rings.first() {
        let n = ring.order.len();
        if n > 1 {
            for k in 0..n {
                let _ = writeln!(
                    o,
                    "  \"gpu{}\" -- \"gpu{}\" [color=red, dir=forward, constraint=false, label=\"ring {k}\"];",
                    ring.order[k],
                    ring.order[(k + 1) % n]
                );
            }
        }
    }
    o.push_str("}\n");
    o
}

/// SVG rendering: the PCI tree (CPUs on top, devices at the bottom), NVLinks in green and the
/// first ring in red.
pub fn render_svg(r: &Report) -> String {
    let t = &r.topology;
    let g = t.graph(&r.speeds);
    let n = g.nodes.len();
    // Tree structure: links other than NVLink / inter-socket go child (a) → parent (b).
    let mut parent = vec![None; n];
    let mut children = vec![Vec::new(); n];
    for l in &g.links {
        if matches!(l.kind, LinkKind::NvLink { .. } | LinkKind::InterSocket) {
            continue;
        }
        if parent[l.a].is_none() {
            parent[l.a] = Some(l.b);
            children[l.b].push(l.a);
        }
    }
    let depth_of = |mut v: usize| {
        let mut d = 0;
        while let Some(p) = parent[v] {
            v = p;
            d += 1;
            if d > n {
                break;
            }
        }
        d
    };
    let mut x = vec![0.0f64; n];
    let mut y = vec![0.0f64; n];
    let mut next_leaf = 0.0;
    fn place(v: usize, children: &[Vec<usize>], x: &mut [f64], next_leaf: &mut f64, guard: usize) {
        if children[v].is_empty() || guard == 0 {
            x[v] = *next_leaf;
            *next_leaf += 1.0;
            return;
        }
        for &c in &children[v] {
            place(c, children, x, next_leaf, guard - 1);
        }
        let xs: Vec<f64> = children[v].iter().map(|&c| x[c]).collect();
        x[v] = xs.iter().sum::<f64>() / xs.len() as f64;
    }
    let roots: Vec<usize> = (0..n)
        .filter(|&v| parent[v].is_none() && !matches!(g.nodes[v].kind, NodeKind::NvSwitch { .. }))
        .collect();
    for &root in &roots {
        place(root, &children, &mut x, &mut next_leaf, n + 1);
    }
    let max_depth = (0..n).map(depth_of).max().unwrap_or(0);
    for v in 0..n {
        y[v] = depth_of(v) as f64;
        if matches!(g.nodes[v].kind, NodeKind::NvSwitch { .. }) {
            x[v] = (next_leaf - 1.0).max(0.0) / 2.0;
            y[v] = max_depth as f64 + 2.0;
        }
    }
    let (dx, dy, mx, my) = (110.0, 90.0, 70.0, 50.0);
    let px = |v: usize| mx + x[v] * dx;
    let py = |v: usize| my + y[v] * dy;
    let width = mx * 2.0 + (next_leaf - 1.0).max(0.0) * dx;
    let height = my * 2.0 + (max_depth as f64 + 2.5) * dy;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
         font-family=\"Helvetica,Arial,sans-serif\" font-size=\"11\">"
    );
    let _ = writeln!(
        o,
        "<defs><marker id=\"arrow\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"6\" \
         markerHeight=\"6\" orient=\"auto-start-reverse\"><path d=\"M0,0 L10,5 L0,10 z\" \
         fill=\"red\"/></marker></defs>"
    );
    let _ = writeln!(o, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    for l in &g.links {
        let (a, b) = (l.a, l.b);
        match l.kind {
            LinkKind::NvLink { count } => {
                // Curve below the devices.
                let (x1, y1, x2, y2) = (px(a), py(a), px(b), py(b));
                let bend = if y1 == y2 {
                    y1 + 25.0 + (x2 - x1).abs() * 0.25
                } else {
                    (y1 + y2) / 2.0
                };
                let _ = writeln!(
                    o,
                    "<path d=\"M{x1:.1},{y1:.1} Q{:.1},{bend:.1} {x2:.1},{y2:.1}\" fill=\"none\" \
                     stroke=\"#2a9d3a\" stroke-width=\"{:.1}\"><title>NV{count}</title></path>",
                    (x1 + x2) / 2.0,
                    (1.0 + f64::from(count) * 0.4).min(6.0)
                );
            }
            LinkKind::InterSocket => {
                let _ = writeln!(
                    o,
                    "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"orange\" \
                     stroke-dasharray=\"6,4\" stroke-width=\"2\"><title>inter-socket</title></line>",
                    px(a),
                    py(a),
                    px(b),
                    py(b)
                );
            }
            _ => {
                let _ = writeln!(
                    o,
                    "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#777\" \
                     stroke-width=\"1.5\"><title>{}</title></line>",
                    px(a),
                    py(a),
                    px(b),
                    py(b),
                    link_label(l.kind)
                );
            }
        }
    }
    if let Some(ring) = r.rings.rings.first() {
        let m = ring.order.len();
        if m > 1 {
            for k in 0..m {
                let (a, b) = (ring.order[k], ring.order[(k + 1) % m]);
                let (x1, y1, x2, y2) = (px(a), py(a) + 14.0, px(b), py(b) + 14.0);
                let bend = y1 + 40.0 + (x2 - x1).abs() * 0.15;
                let _ = writeln!(
                    o,
                    "<path d=\"M{x1:.1},{y1:.1} Q{:.1},{bend:.1} {x2:.1},{y2:.1}\" fill=\"none\" \
                     stroke=\"red\" stroke-width=\"1.5\" marker-end=\"url(#arrow)\"><title>ring 0 \
                     hop {k}: {}</title></path>",
                    (x1 + x2) / 2.0,
                    ring.hops.get(k).map_or(String::new(), |c| c.label())
                );
            }
        }
    }
    for v in 0..n {
        let (fill, w) = match g.nodes[v].kind {
            NodeKind::Cpu { .. } => ("#cfe2ff", 96.0),
            NodeKind::PciSwitch { .. } | NodeKind::HostBridge { .. } => ("#eeeeee", 90.0),
            NodeKind::NvSwitch { .. } => ("#c9f2c7", 96.0),
            NodeKind::Gpu { .. } => ("#b6f0a8", 60.0),
            NodeKind::Nic { .. } => ("#ffe3b3", 96.0),
        };
        let _ = writeln!(
            o,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{w:.0}\" height=\"26\" rx=\"5\" fill=\"{fill}\" \
             stroke=\"#333\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            px(v) - w / 2.0,
            py(v) - 13.0,
            px(v),
            py(v) + 4.0,
            crate::xml::escape(&node_label(t, &g.nodes[v].kind))
        );
    }
    if let Some(ring) = r.rings.rings.first() {
        let _ = writeln!(
            o,
            "<text x=\"10\" y=\"{:.0}\" fill=\"red\">ring 0: {} ({:.1} GB/s bottleneck; {} \
             channel(s), {:.1} GB/s total)</text>",
            height - 10.0,
            crate::xml::escape(&ring_text(t, &ring.order)),
            ring.bottleneck_gbps,
            r.rings.rings.len(),
            r.rings.total_gbps()
        );
    }
    o.push_str("</svg>\n");
    o
}
