//! NCCL's topology XML (the format of `NCCL_TOPO_FILE` / `NCCL_TOPO_DUMP_FILE`): reading dumps
//! into a [`Topology`] and writing one so NCCL-aware tools can load weftcc's discovery.
//!
//! The elements used: `system` › `cpu` (`numaid`, `affinity`, `arch`) › `pci` (`busid`, `class`,
//! nested for switches) › `gpu` (`dev`, `sm`, `rank`, `gdr`) › `nvlink` (`target`, `count`,
//! `tclass`), and `nic` › `net` (`name`, `dev`, `speed` in Mbit/s, `port`, `gdr`). Classes
//! follow PCI: `0x0604..` bridge/switch, `0x0600..` host bridge, `0x03....` GPU, `0x02....` NIC,
//! NVLink target class `0x068000` is an NVSwitch.

use crate::error::{Result, TopoError};
use crate::graph::{nvswitch_links, pci_tree, PciElem};
use crate::model::{CpuNode, Gpu, Nic, NicKind, PathClass, Topology};
use crate::nvsmi::{count_cpus, nic_kind_from_name, MAX_DEVICES};
use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;
use std::collections::HashMap;
use std::fmt::Write as _;

const CLASS_HOST_BRIDGE: &str = "0x060000";
const CLASS_SWITCH: &str = "0x060400";
const CLASS_GPU: &str = "0x030200";
const CLASS_NIC_IB: &str = "0x020700";
const CLASS_NIC_ETH: &str = "0x020000";
const CLASS_NVSWITCH: &str = "0x068000";
const NVSWITCH_BUSID: &str = "ffffffff:ff:ff.0";
const MAX_DEPTH: usize = 64;
const MAX_ELEMENTS: usize = 100_000;

#[derive(Debug, Clone)]
struct Pci {
    busid: String,
    class: String,
    parent: Option<usize>,
}

#[derive(Debug, Clone)]
struct Placed {
    cpu: Option<usize>,
    pci: Option<usize>,
}

#[derive(Debug, Clone)]
enum Frame {
    System,
    Cpu,
    Pci(usize),
    Gpu(usize),
    Nic,
    Other,
}

fn attrs(e: &BytesStart<'_>, pos: u64) -> Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    for a in e.attributes() {
        let a = a.map_err(|err| TopoError::Xml(format!("at byte {pos}: {err}")))?;
        let key = String::from_utf8_lossy(a.key.as_ref()).into_owned();
        let v = a
            .unescape_value()
            .map_err(|err| TopoError::Xml(format!("at byte {pos}: {err}")))?
            .into_owned();
        out.insert(key, v);
    }
    Ok(out)
}

fn num<T: std::str::FromStr>(
    m: &HashMap<String, String>,
    key: &str,
    elem: &str,
    pos: u64,
) -> Result<Option<T>> {
    match m.get(key) {
        None => Ok(None),
        Some(v) => {
            let v = v.trim();
            let parsed = if let Some(h) = v.strip_prefix("0x") {
                u64::from_str_radix(h, 16)
                    .ok()
                    .and_then(|x| x.to_string().parse().ok())
            } else {
                v.parse().ok()
            };
            parsed.map(Some).ok_or_else(|| {
                TopoError::Xml(format!(
                    "at byte {pos}: <{elem}> attribute {key}={v:?} is not a number"
                ))
            })
        }
    }
}

fn norm_bus(s: &str) -> String {
    s.trim().to_ascii_lowercase()
}

/// Reads NCCL topology XML.
pub fn read(text: &str) -> Result<Topology> {
    let mut reader = Reader::from_str(text);
    reader.config_mut().trim_text(true);
    let mut stack: Vec<Frame> = Vec::new();
    let mut cpus: Vec<CpuNode> = Vec::new();
    let mut pcis: Vec<Pci> = Vec::new();
    let mut gpus: Vec<(Gpu, Placed)> = Vec::new();
    let mut nvlinks: Vec<(u32, String, u32, String)> = Vec::new();
    let mut nics: Vec<(Nic, Placed)> = Vec::new();
    let mut nic_dev: Vec<u32> = Vec::new();
    let mut seen_system = false;
    let mut elements = 0usize;
    loop {
        let pos = reader.buffer_position();
        let ev = reader
            .read_event()
            .map_err(|e| TopoError::Xml(format!("at byte {pos}: {e}")))?;
        let (e, empty) = match ev {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(_) => {
                stack.pop();
                continue;
            }
            Event::Eof => break,
            _ => continue,
        };
        elements += 1;
        if elements > MAX_ELEMENTS {
            return Err(TopoError::Xml(format!("more than {MAX_ELEMENTS} elements")));
        }
        if stack.len() >= MAX_DEPTH {
            return Err(TopoError::Xml(format!("nesting deeper than {MAX_DEPTH}")));
        }
        let name = String::from_utf8_lossy(e.name().as_ref()).to_ascii_lowercase();
        let a = attrs(&e, pos)?;
        let cur_cpu = stack.iter().rev().find_map(|f| match f {
            Frame::Cpu => Some(cpus.len().wrapping_sub(1)),
            _ => None,
        });
        let cur_pci = stack.iter().rev().find_map(|f| match f {
            Frame::Pci(i) => Some(*i),
            _ => None,
        });
        let frame =
            match name.as_str() {
                "system" => {
                    if !stack.is_empty() {
                        return Err(TopoError::Xml(format!("at byte {pos}: nested <system>")));
                    }
                    seen_system = true;
                    Frame::System
                }
                _ if !seen_system || stack.is_empty() => {
                    return Err(TopoError::Xml(format!(
                        "at byte {pos}: <{name}> outside <system> (not an NCCL topology file)"
                    )))
                }
                "cpu" => {
                    let id: i64 = num(&a, "numaid", "cpu", pos)?.ok_or_else(|| {
                        TopoError::Xml(format!("at byte {pos}: <cpu> without numaid"))
                    })?;
                    // numaid="-1" (unknown): the first id not taken.
                    let numa = match u32::try_from(id) {
                        Ok(n) => {
                            if cpus.iter().any(|c| c.numa == n) {
                                return Err(TopoError::Xml(format!(
                                    "at byte {pos}: two <cpu numaid=\"{n}\">"
                                )));
                            }
                            n
                        }
                        Err(_) => (0u32..)
                            .find(|n| !cpus.iter().any(|c| c.numa == *n))
                            .unwrap_or(0),
                    };
                    let aff = a.get("affinity").map(|m| mask_to_cpulist(m));
                    cpus.push(CpuNode {
                        numa,
                        cpus: aff.as_deref().map(count_cpus),
                        cpulist: aff,
                        mem_bytes: None,
                    });
                    Frame::Cpu
                }
                "pci" => {
                    let busid = a.get("busid").map(|b| norm_bus(b)).ok_or_else(|| {
                        TopoError::Xml(format!("at byte {pos}: <pci> without busid"))
                    })?;
                    pcis.push(Pci {
                        busid,
                        class: a
                            .get("class")
                            .map(|c| c.to_ascii_lowercase())
                            .unwrap_or_default(),
                        parent: cur_pci,
                    });
                    Frame::Pci(pcis.len() - 1)
                }
                "gpu" => {
                    if gpus.len() + nics.len() >= MAX_DEVICES {
                        return Err(TopoError::Xml(format!("more than {MAX_DEVICES} devices")));
                    }
                    let dev: Option<u32> = num(&a, "dev", "gpu", pos)?;
                    let sm: Option<u32> = num(&a, "sm", "gpu", pos)?;
                    let index = dev.unwrap_or(gpus.len() as u32);
                    if gpus.iter().any(|(g, _)| g.index == index) {
                        return Err(TopoError::Xml(format!(
                            "at byte {pos}: two GPUs with dev={index}"
                        )));
                    }
                    let bus_id = cur_pci.map(|p| pcis[p].busid.clone());
                    let numa = cur_cpu.and_then(|c| cpus.get(c)).map(|c| c.numa);
                    let aff = cur_cpu
                        .and_then(|c| cpus.get(c))
                        .and_then(|c| c.cpulist.clone());
                    gpus.push((
                        Gpu {
                            index,
                            name: None,
                            bus_id,
                            cpu_affinity: aff,
                            numa,
                            sm,
                            mem_bytes: None,
                        },
                        Placed {
                            cpu: cur_cpu,
                            pci: cur_pci,
                        },
                    ));
                    Frame::Gpu(gpus.len() - 1)
                }
                "nvlink" => {
                    let Some(&Frame::Gpu(g)) = stack.last() else {
                        return Err(TopoError::Xml(format!(
                            "at byte {pos}: <nvlink> outside <gpu>"
                        )));
                    };
                    let target = a.get("target").map(|t| norm_bus(t)).ok_or_else(|| {
                        TopoError::Xml(format!("at byte {pos}: <nvlink> without target"))
                    })?;
                    let count: u32 = num(&a, "count", "nvlink", pos)?.unwrap_or(1);
                    if count == 0 || count > 64 {
                        return Err(TopoError::Xml(format!(
                            "at byte {pos}: <nvlink count=\"{count}\"> out of range"
                        )));
                    }
                    let tclass = a
                        .get("tclass")
                        .map(|c| c.to_ascii_lowercase())
                        .unwrap_or_default();
                    nvlinks.push((gpus[g].0.index, target, count, tclass));
                    Frame::Other
                }
                "nic" => Frame::Nic,
                "net" => {
                    if gpus.len() + nics.len() >= MAX_DEVICES {
                        return Err(TopoError::Xml(format!("more than {MAX_DEVICES} devices")));
                    }
                    let name = a.get("name").cloned().ok_or_else(|| {
                        TopoError::Xml(format!("at byte {pos}: <net> without name"))
                    })?;
                    let speed: Option<f64> =
                        num::<u64>(&a, "speed", "net", pos)?.map(|m| m as f64 / 1000.0);
                    let dev: Option<u32> = num(&a, "dev", "net", pos)?;
                    nic_dev.push(dev.unwrap_or(u32::MAX));
                    let pci_class = cur_pci.map(|p| pcis[p].class.clone()).unwrap_or_default();
                    let kind = if pci_class.starts_with("0x0207") {
                        NicKind::Ib
                    } else if pci_class.starts_with("0x0200") {
                        NicKind::Ethernet
                    } else {
                        nic_kind_from_name(&name)
                    };
                    nics.push((
                        Nic {
                            label: name.clone(),
                            name,
                            speed_gbit: speed,
                            numa: cur_cpu.and_then(|c| cpus.get(c)).map(|c| c.numa),
                            bus_id: cur_pci.map(|p| pcis[p].busid.clone()),
                            kind,
                            ports: Vec::new(),
                        },
                        Placed {
                            cpu: cur_cpu,
                            pci: cur_pci,
                        },
                    ));
                    Frame::Other
                }
                _ => Frame::Other,
            };
        if !empty {
            stack.push(frame);
        }
    }
    if !seen_system {
        return Err(TopoError::Xml("no <system> element".into()));
    }
    if !stack.is_empty() {
        return Err(TopoError::Xml(
            "unexpected end of file (unclosed elements)".into(),
        ));
    }
    gpus.sort_by_key(|(g, _)| g.index);
    // NICs in NCCL's net device order (stable for equal or missing `dev`).
    let mut order: Vec<usize> = (0..nics.len()).collect();
    order.sort_by_key(|&i| nic_dev[i]);
    let nics: Vec<(Nic, Placed)> = order.into_iter().map(|i| nics[i].clone()).collect();
    let placed: Vec<&Placed> = gpus
        .iter()
        .map(|(_, p)| p)
        .chain(nics.iter().map(|(_, p)| p))
        .collect();
    let n = placed.len();
    // PCI chains (root first) for every device.
    let chain = |p: &Placed| -> Vec<usize> {
        let mut v = Vec::new();
        let mut cur = p.pci;
        while let Some(i) = cur {
            v.push(i);
            cur = pcis[i].parent;
            if v.len() > MAX_DEPTH {
                break;
            }
        }
        v.reverse();
        v
    };
    let chains: Vec<Vec<usize>> = placed.iter().map(|p| chain(p)).collect();
    let mut paths = PathClass::matrix(n, |a, b| {
        pci_class(placed[a], placed[b], &chains[a], &chains[b], &pcis)
    });
    // NVLink between GPUs.
    let ng = gpus.len();
    let mut counts = vec![vec![0u32; ng]; ng];
    let mut nvs = vec![0u32; ng];
    for (owner, target, count, tclass) in &nvlinks {
        let Some(src) = gpus.iter().position(|(g, _)| g.index == *owner) else {
            continue;
        };
        if tclass == CLASS_NVSWITCH {
            nvs[src] += count;
        } else if let Some(dst) = gpus
            .iter()
            .position(|(g, _)| g.bus_id.as_deref() == Some(target.as_str()))
        {
            if dst != src {
                counts[src][dst] += count;
            }
        }
    }
    for i in 0..ng {
        for j in 0..ng {
            if i == j {
                continue;
            }
            let direct = counts[i][j].max(counts[j][i]);
            let k = if nvs[i] > 0 && nvs[j] > 0 {
                nvs[i].min(nvs[j]) + direct
            } else {
                direct
            };
            if k > 0 {
                paths[i][j] = PathClass::NvLink(k.min(64));
            }
        }
    }
    let topo = Topology {
        source: "xml".into(),
        cpus: {
            let mut c = cpus;
            c.sort_by_key(|c| c.numa);
            c
        },
        gpus: gpus.into_iter().map(|(g, _)| g).collect(),
        nics: nics.into_iter().map(|(n, _)| n).collect(),
        paths,
        ..Topology::default()
    };
    topo.validate()
        .map_err(|e| TopoError::Xml(format!("inconsistent topology: {e}")))?;
    Ok(topo)
}

fn pci_class(a: &Placed, b: &Placed, ca: &[usize], cb: &[usize], pcis: &[Pci]) -> PathClass {
    match (a.cpu, b.cpu) {
        (Some(x), Some(y)) if x == y => {}
        _ => return PathClass::Sys,
    }
    if a.pci.is_some() && a.pci == b.pci {
        return PathClass::Pix;
    }
    // Ancestors, excluding the devices' own PCI nodes.
    let aa = &ca[..ca.len().saturating_sub(1)];
    let bb = &cb[..cb.len().saturating_sub(1)];
    let common = aa.iter().zip(bb).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return PathClass::Node;
    }
    let lca = aa[common - 1];
    if pcis[lca].class.starts_with("0x0600") {
        return PathClass::Phb;
    }
    if aa.len() == common && bb.len() == common {
        PathClass::Pix
    } else {
        PathClass::Pxb
    }
}

/// NCCL writes CPU affinity as a Linux cpumask (`0000ffff,ffffffff`: 32-bit hex groups, most
/// significant first). Turns one into a list (`0-47`); anything that is not a mask is kept.
pub fn mask_to_cpulist(mask: &str) -> String {
    let m = mask.trim();
    let groups: Vec<&str> = m.split(',').collect();
    let is_mask = groups.len() <= 1024
        && groups
            .iter()
            .all(|g| !g.is_empty() && g.len() <= 8 && g.bytes().all(|b| b.is_ascii_hexdigit()))
        && (groups.len() > 1 || m.len() == 8 || m.bytes().any(|b| b.is_ascii_alphabetic()));
    if !is_mask {
        return m.to_string();
    }
    let mut cpus = Vec::new();
    for (gi, g) in groups.iter().rev().enumerate() {
        let v = u32::from_str_radix(g, 16).unwrap_or(0);
        for bit in 0..32 {
            if v & (1 << bit) != 0 {
                cpus.push(gi as u32 * 32 + bit);
            }
        }
    }
    list_ranges(cpus.into_iter().map(|c| c as usize))
}

/// Numbers as a Linux list of ranges (`0-2,5,9-10`), sorted, each once: CPU lists here, rank
/// lists in weftcc's reports.
pub fn list_ranges(values: impl IntoIterator<Item = usize>) -> String {
    let mut v: Vec<usize> = values.into_iter().collect();
    v.sort_unstable();
    v.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The reverse of [`mask_to_cpulist`]: `0-19,40-59` as a cpumask; kept as is when malformed.
pub fn cpulist_to_mask(list: &str) -> String {
    let mut cpus: Vec<u32> = Vec::new();
    for part in list.trim().split(',') {
        let range = match part.split_once('-') {
            Some((a, b)) => a
                .trim()
                .parse::<u32>()
                .ok()
                .zip(b.trim().parse::<u32>().ok()),
            None => part.trim().parse::<u32>().ok().map(|a| (a, a)),
        };
        match range {
            Some((a, b)) if a <= b && b < 32 * 1024 => cpus.extend(a..=b),
            _ => return list.to_string(),
        }
    }
    let ngroups = cpus.iter().max().map_or(1, |m| m / 32 + 1) as usize;
    let mut groups = vec![0u32; ngroups];
    for c in cpus {
        groups[(c / 32) as usize] |= 1 << (c % 32);
    }
    groups
        .iter()
        .rev()
        .map(|g| format!("{g:08x}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `s` with the characters XML (and SVG and DOT labels) cannot carry escaped.
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Writes NCCL topology XML. Bus ids that are not known are made up (unique, stable).
pub fn write(topo: &Topology) -> String {
    let ng = topo.gpus.len();
    let mut next_bus = 0x10u32;
    let mut fresh = || {
        let b = format!("{:04x}:{:02x}:00.0", next_bus / 0x100, next_bus % 0x100);
        next_bus += 1;
        b
    };
    // Device bus ids: known ones, else fresh ones (avoiding collisions with known ones).
    let known: Vec<String> = (0..topo.ndevices())
        .filter_map(|d| dev_bus(topo, d))
        .collect();
    let mut bus: Vec<String> = Vec::new();
    for d in 0..topo.ndevices() {
        match dev_bus(topo, d) {
            Some(b) if !bus.contains(&b) => bus.push(b),
            _ => loop {
                let b = fresh();
                if !known.contains(&b) && !bus.contains(&b) {
                    bus.push(b);
                    break;
                }
            },
        }
    }
    let nvs = nvswitch_links(topo);
    let mut gen = BusGen {
        next: 0x8000,
        taken: known.iter().chain(bus.iter()).cloned().collect(),
    };
    let mut o = String::from("<system version=\"1\">\n");
    for s in pci_tree(topo) {
        let aff = topo
            .cpus
            .iter()
            .find(|c| c.numa == s.numa)
            .and_then(|c| c.cpulist.clone())
            .or_else(|| {
                topo.gpus
                    .iter()
                    .find(|g| g.numa == Some(s.numa))
                    .and_then(|g| g.cpu_affinity.clone())
            });
        let _ = write!(o, "  <cpu numaid=\"{}\"", s.numa);
        if let Some(a) = aff {
            let _ = write!(o, " affinity=\"{}\"", escape(&cpulist_to_mask(&a)));
        }
        o.push_str(" arch=\"x86_64\">\n");
        for e in &s.children {
            write_elem(&mut o, topo, e, 2, &bus, &mut gen, nvs, ng);
        }
        o.push_str("  </cpu>\n");
    }
    o.push_str("</system>\n");
    o
}

fn dev_bus(topo: &Topology, d: usize) -> Option<String> {
    if d < topo.gpus.len() {
        topo.gpus[d].bus_id.as_deref().map(norm_bus)
    } else {
        topo.nics
            .get(d - topo.gpus.len())
            .and_then(|n| n.bus_id.as_deref())
            .map(norm_bus)
    }
}

/// A generator of switch bus ids distinct from every device's.
struct BusGen {
    next: u32,
    taken: Vec<String>,
}

impl BusGen {
    fn take(&mut self) -> String {
        loop {
            let b = format!("{:04x}:{:02x}:00.0", self.next / 0x100, self.next % 0x100);
            self.next += 1;
            if !self.taken.contains(&b) {
                self.taken.push(b.clone());
                return b;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn write_elem(
    o: &mut String,
    topo: &Topology,
    e: &PciElem,
    depth: usize,
    bus: &[String],
    gen: &mut BusGen,
    nvs: Option<u32>,
    ng: usize,
) {
    let pad = "  ".repeat(depth);
    match e {
        PciElem::HostBridge(ch) | PciElem::Switch(ch) => {
            let class = if matches!(e, PciElem::HostBridge(_)) {
                CLASS_HOST_BRIDGE
            } else {
                CLASS_SWITCH
            };
            let _ = writeln!(
                o,
                "{pad}<pci busid=\"{}\" class=\"{class}\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">",
                gen.take()
            );
            for c in ch {
                write_elem(o, topo, c, depth + 1, bus, gen, nvs, ng);
            }
            let _ = writeln!(o, "{pad}</pci>");
        }
        PciElem::Device(d) if *d < ng => {
            let g = &topo.gpus[*d];
            let _ = writeln!(
                o,
                "{pad}<pci busid=\"{}\" class=\"{CLASS_GPU}\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">",
                bus[*d]
            );
            let _ = write!(o, "{pad}  <gpu dev=\"{}\"", g.index);
            if let Some(sm) = g.sm {
                let _ = write!(o, " sm=\"{sm}\"");
            }
            let _ = writeln!(o, " rank=\"{}\" gdr=\"1\">", g.index);
            if let Some(k) = nvs {
                let _ = writeln!(
                    o,
                    "{pad}    <nvlink target=\"{NVSWITCH_BUSID}\" count=\"{k}\" tclass=\"{CLASS_NVSWITCH}\"/>"
                );
            } else {
                for (j, target) in bus.iter().enumerate().take(ng) {
                    if let PathClass::NvLink(k) = topo.gpu_path(*d, j) {
                        let _ = writeln!(
                            o,
                            "{pad}    <nvlink target=\"{target}\" count=\"{k}\" tclass=\"{CLASS_GPU}\"/>"
                        );
                    }
                }
            }
            let _ = writeln!(o, "{pad}  </gpu>");
            let _ = writeln!(o, "{pad}</pci>");
        }
        PciElem::Device(d) => {
            let Some(n) = topo.nics.get(*d - ng) else {
                return;
            };
            let class = if n.kind == NicKind::Ethernet {
                CLASS_NIC_ETH
            } else {
                CLASS_NIC_IB
            };
            let _ = writeln!(
                o,
                "{pad}<pci busid=\"{}\" class=\"{class}\" link_speed=\"16.0 GT/s PCIe\" link_width=\"16\">",
                bus[*d]
            );
            let _ = writeln!(o, "{pad}  <nic>");
            let _ = write!(
                o,
                "{pad}    <net name=\"{}\" dev=\"{}\"",
                escape(&n.name),
                d - ng
            );
            if let Some(s) = n.speed_gbit {
                let _ = write!(o, " speed=\"{}\"", (s * 1000.0).round() as u64);
            }
            let _ = writeln!(o, " port=\"1\" gdr=\"1\"/>");
            let _ = writeln!(o, "{pad}  </nic>");
            let _ = writeln!(o, "{pad}</pci>");
        }
    }
}
