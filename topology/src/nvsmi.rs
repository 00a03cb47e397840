//! Parser for the text `nvidia-smi topo -m` prints.
//!
//! Accepts any number of GPUs and NICs, `NV#` counts, `X`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`
//! (and the old `SOC`), `N/A`, the `CPU Affinity` / `NUMA Affinity` / `GPU NUMA ID` columns, tabs
//! or spaces, terminal colour codes, NIC columns named `NIC#` (resolved through the
//! `NIC Legend`) or directly (`mlx5_0`), and any text after the matrix.

use crate::error::{Result, TopoError};
use crate::model::{CpuNode, Gpu, Nic, NicKind, PathClass, Topology};

/// Removes ANSI escape sequences (`ESC [ ... letter`), which recent `nvidia-smi` versions print.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            if it.peek() == Some(&'[') {
                it.next();
                for d in it.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Most devices (GPUs + NICs) one host may have.
pub const MAX_DEVICES: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    CpuAffinity,
    NumaAffinity,
    GpuNuma,
}

fn gpu_index(label: &str) -> Option<u32> {
    let n = label.strip_prefix("GPU")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

fn is_nic_label(label: &str) -> bool {
    label
        .strip_prefix("NIC")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

fn parse_extras(tokens: &[&str], line: usize) -> Result<Vec<Extra>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let rest = &tokens[i..];
        let eq = |words: &[&str]| {
            rest.len() >= words.len()
                && words
                    .iter()
                    .zip(rest)
                    .all(|(w, t)| t.eq_ignore_ascii_case(w))
        };
        if eq(&["CPU", "Affinity"]) {
            out.push(Extra::CpuAffinity);
            i += 2;
        } else if eq(&["NUMA", "Affinity"]) {
            out.push(Extra::NumaAffinity);
            i += 2;
        } else if eq(&["GPU", "NUMA", "ID"]) {
            out.push(Extra::GpuNuma);
            i += 3;
        } else {
            return Err(TopoError::smi(
                line,
                format!("unknown column title starting at {:?}", rest[0]),
            ));
        }
    }
    Ok(out)
}

fn valid_cpulist(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_digit() || b == b',' || b == b'-')
        && s.bytes().next().is_some_and(|b| b.is_ascii_digit())
}

fn parse_numa(s: &str, line: usize, what: &str) -> Result<Option<u32>> {
    if s.eq_ignore_ascii_case("N/A") {
        return Ok(None);
    }
    if !valid_cpulist(s) {
        return Err(TopoError::smi(line, format!("bad {what} value {s:?}")));
    }
    let first = s.split([',', '-']).next().unwrap_or("");
    first
        .parse()
        .map(Some)
        .map_err(|_| TopoError::smi(line, format!("bad {what} value {s:?}")))
}

/// Guess of the NIC kind from its name.
pub fn nic_kind_from_name(name: &str) -> NicKind {
    const VERBS: [&str; 8] = [
        "mlx", "bnxt_re", "irdma", "hfi", "qedr", "efa", "ionic", "rxe",
    ];
    if VERBS.iter().any(|p| name.starts_with(p)) {
        NicKind::Ib
    } else if name.starts_with("eth") || name.starts_with("en") || name.starts_with("ib") {
        NicKind::Ethernet
    } else {
        NicKind::Unknown
    }
}

/// Parses the output of `nvidia-smi topo -m`.
pub fn parse(text: &str) -> Result<Topology> {
    let text = strip_ansi(text);
    let lines: Vec<&str> = text.lines().collect();
    // The header: the first line whose first word is GPU<n>.
    let (hline, header) = lines
        .iter()
        .enumerate()
        .find_map(|(i, l)| {
            let t: Vec<&str> = l.split_whitespace().collect();
            (t.first().and_then(|f| gpu_index(f)).is_some()).then_some((i, t))
        })
        .ok_or_else(|| {
            TopoError::smi(
                0,
                "no header line (expected a line starting with GPU0)".to_string(),
            )
        })?;
    let ncols = header
        .iter()
        .position(|t| {
            ["CPU", "NUMA", "GPU"]
                .iter()
                .any(|w| t.eq_ignore_ascii_case(w))
        })
        .unwrap_or(header.len());
    let cols: Vec<String> = header[..ncols].iter().map(|s| s.to_string()).collect();
    let extras = parse_extras(&header[ncols..], hline + 1)?;
    for (i, c) in cols.iter().enumerate() {
        if cols[..i].contains(c) {
            return Err(TopoError::smi(
                hline + 1,
                format!("column {c} appears twice"),
            ));
        }
        if c.starts_with("GPU") && gpu_index(c).is_none() {
            return Err(TopoError::smi(hline + 1, format!("bad GPU column {c:?}")));
        }
    }
    if cols.len() > MAX_DEVICES {
        return Err(TopoError::smi(
            hline + 1,
            format!("more than {MAX_DEVICES} device columns"),
        ));
    }

    let mut cells: Vec<Option<Vec<PathClass>>> = vec![None; ncols];
    let mut extra_vals: Vec<Vec<Option<String>>> = vec![Vec::new(); ncols];
    let mut legend: Vec<(String, String)> = Vec::new();
    let mut in_rows = true;
    for (i, l) in lines.iter().enumerate().skip(hline + 1) {
        let lineno = i + 1;
        let t: Vec<&str> = l.split_whitespace().collect();
        let Some(first) = t.first() else {
            if cells.iter().any(|c| c.is_some()) {
                in_rows = false;
            }
            continue;
        };
        if in_rows {
            let col = cols.iter().position(|c| c == first);
            let looks_like_row = gpu_index(first).is_some() || is_nic_label(first);
            match col {
                Some(r) => {
                    if cells[r].is_some() {
                        return Err(TopoError::smi(lineno, format!("row {first} appears twice")));
                    }
                    if t.len() < 1 + ncols {
                        return Err(TopoError::smi(
                            lineno,
                            format!("row {first} has {} cells, expected {ncols}", t.len() - 1),
                        ));
                    }
                    let mut row = Vec::with_capacity(ncols);
                    for (k, s) in t[1..=ncols].iter().enumerate() {
                        let c = PathClass::parse(s).ok_or_else(|| {
                            TopoError::smi(
                                lineno,
                                format!("row {first}, column {}: unknown link {s:?}", cols[k]),
                            )
                        })?;
                        row.push(c);
                    }
                    let rest = &t[1 + ncols..];
                    if rest.len() > extras.len() {
                        return Err(TopoError::smi(
                            lineno,
                            format!(
                                "row {first} has {} values after the matrix, the header names {}",
                                rest.len(),
                                extras.len()
                            ),
                        ));
                    }
                    cells[r] = Some(row);
                    extra_vals[r] = rest.iter().map(|s| Some(s.to_string())).collect();
                    continue;
                }
                None if looks_like_row => {
                    return Err(TopoError::smi(
                        lineno,
                        format!("row {first} has no column in the header"),
                    ));
                }
                None => in_rows = false,
            }
        }
        // Legend text: only "NIC<n>: name" lines matter.
        let trimmed = l.trim();
        if let Some((label, name)) = trimmed.split_once(':') {
            let label = label.trim();
            let name = name.trim();
            if is_nic_label(label) && !name.is_empty() && !name.contains(char::is_whitespace) {
                legend.push((label.to_string(), name.to_string()));
            }
        }
    }

    // Devices: GPUs first (in column order), then NICs.
    let mut order: Vec<usize> = (0..ncols)
        .filter(|&c| gpu_index(&cols[c]).is_some())
        .collect();
    let ngpu = order.len();
    order.extend((0..ncols).filter(|&c| gpu_index(&cols[c]).is_none()));
    if ngpu == 0 {
        return Err(TopoError::smi(hline + 1, "no GPU columns"));
    }
    for &c in &order[..ngpu] {
        if cells[c].is_none() {
            return Err(TopoError::smi(0, format!("missing row for {}", cols[c])));
        }
    }
    // NIC rows may be absent in old versions: take the transpose.
    for &c in &order[ngpu..] {
        if cells[c].is_none() {
            let mut row = Vec::with_capacity(ncols);
            for (k, other) in cells.iter().enumerate() {
                row.push(match other {
                    _ if k == c => PathClass::Loc,
                    Some(r) => r[c],
                    None => PathClass::Na,
                });
            }
            cells[c] = Some(row);
        }
    }
    let mut topo = Topology {
        source: "nvidia-smi".into(),
        ..Topology::default()
    };
    for (pos, &c) in order.iter().enumerate() {
        let vals = &extra_vals[c];
        let get = |kind: Extra| -> Option<&str> {
            extras
                .iter()
                .position(|e| *e == kind)
                .and_then(|p| vals.get(p))
                .and_then(|v| v.as_deref())
        };
        if pos < ngpu {
            let cpu = match get(Extra::CpuAffinity) {
                None => None,
                Some(v) if v.eq_ignore_ascii_case("N/A") => None,
                Some(v) if valid_cpulist(v) => Some(v.to_string()),
                Some(v) => {
                    return Err(TopoError::smi(
                        0,
                        format!("{}: bad CPU affinity {v:?}", cols[c]),
                    ))
                }
            };
            let numa = match get(Extra::NumaAffinity) {
                Some(v) => parse_numa(v, 0, "NUMA affinity")?,
                None => None,
            };
            if let Some(v) = get(Extra::GpuNuma) {
                parse_numa(v, 0, "GPU NUMA ID")?;
            }
            topo.gpus.push(Gpu {
                index: gpu_index(&cols[c]).unwrap_or(pos as u32),
                cpu_affinity: cpu,
                numa,
                ..Gpu::default()
            });
        } else {
            let label = cols[c].clone();
            let name = legend
                .iter()
                .find(|(l, _)| *l == label)
                .map(|(_, n)| n.clone())
                .unwrap_or_else(|| label.clone());
            topo.nics.push(Nic {
                kind: nic_kind_from_name(&name),
                name,
                label,
                ..Nic::default()
            });
        }
    }
    topo.paths = order
        .iter()
        .map(|&r| {
            let row = cells[r].as_deref().unwrap_or(&[]);
            order
                .iter()
                .map(|&c| row.get(c).copied().unwrap_or(PathClass::Na))
                .collect()
        })
        .collect();
    topo.validate()
        .map_err(|e| TopoError::smi(0, e.to_string()))?;
    // CPU nodes: one per distinct NUMA affinity (or per socket group when not given).
    let groups = topo.socket_groups();
    for (i, g) in topo.gpus.clone().iter().enumerate() {
        let numa = g.numa.unwrap_or(groups[i] as u32);
        if !topo.cpus.iter().any(|c| c.numa == numa) {
            topo.cpus.push(CpuNode {
                numa,
                cpulist: g.cpu_affinity.clone(),
                cpus: g.cpu_affinity.as_deref().map(count_cpus),
                mem_bytes: None,
            });
        }
    }
    topo.cpus.sort_by_key(|c| c.numa);
    Ok(topo)
}

/// Number of CPUs in a list such as `0-19,40-59` (0 for malformed parts).
pub fn count_cpus(list: &str) -> u32 {
    list.split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => match (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                (Ok(a), Ok(b)) if b >= a => (b - a).saturating_add(1),
                _ => 0,
            },
            None => u32::from(part.trim().parse::<u32>().is_ok()),
        })
        .fold(0u32, |acc, n| acc.saturating_add(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_parse() {
        assert_eq!(PathClass::parse("NV12"), Some(PathClass::NvLink(12)));
        assert_eq!(PathClass::parse(" X "), Some(PathClass::Loc));
        assert_eq!(PathClass::parse("SOC"), Some(PathClass::Sys));
        assert_eq!(PathClass::parse("NV0"), None);
        assert_eq!(PathClass::parse("NV"), None);
        assert_eq!(PathClass::parse("NVx"), None);
        assert_eq!(PathClass::parse("PCI"), None);
    }

    #[test]
    fn ansi_is_stripped() {
        assert_eq!(strip_ansi("\u{1b}[4mGPU0\u{1b}[0m\tX"), "GPU0\tX");
    }

    #[test]
    fn cpu_counts() {
        assert_eq!(count_cpus("0-19,40-59"), 40);
        assert_eq!(count_cpus("3"), 1);
        assert_eq!(count_cpus("5-2"), 0);
        assert_eq!(count_cpus("0-4294967295"), u32::MAX);
        assert_eq!(count_cpus("0-4294967295,0-4294967295"), u32::MAX);
    }
}
