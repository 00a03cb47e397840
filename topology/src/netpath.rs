//! Which network card each GPU's traffic between hosts takes, and whether GPUDirect RDMA may be
//! used on that pair: `WEFT_NET_GDR_LEVEL`, with NCCL's `NCCL_NET_GDR_LEVEL` syntax and meaning
//! (the largest GPU–NIC path class at which the NIC reads and writes GPU memory directly).

use crate::error::{Result, TopoError};
use crate::model::{class_rank, NicKind, PathClass, Topology};
use serde::{Deserialize, Serialize};

use weftcc_settings::NET_GDR_LEVEL;

/// The default limit: through PCIe switches, not through the CPU's host bridge (NCCL's usual
/// default on x86 servers).
pub const DEFAULT_GDR_LEVEL: PathClass = PathClass::Pxb;

/// Parses a GDR level: a path class name (`LOC` = never, `PIX`, `PXB`, `PHB`, `NODE`, `SYS` =
/// always; case-insensitive) or NCCL's legacy integers (0 `LOC`, 1 `PIX`, 2 `PXB`, 3 `PHB`, 4 and
/// above `SYS`).
pub fn parse_gdr_level(s: &str) -> Result<PathClass> {
    let t = s.trim();
    if let Ok(n) = t.parse::<u32>() {
        return Ok(match n {
            0 => PathClass::Loc,
            1 => PathClass::Pix,
            2 => PathClass::Pxb,
            3 => PathClass::Phb,
            _ => PathClass::Sys,
        });
    }
    match PathClass::parse(t) {
        Some(
            c @ (PathClass::Loc
            | PathClass::Pix
            | PathClass::Pxb
            | PathClass::Phb
            | PathClass::Node
            | PathClass::Sys),
        ) => Ok(c),
        _ => Err(TopoError::Invalid(format!(
            "{}={s:?}: expected LOC, PIX, PXB, PHB, NODE, SYS or 0-4",
            NET_GDR_LEVEL.name
        ))),
    }
}

/// The level from the environment (`WEFT_NET_GDR_LEVEL`, else [`DEFAULT_GDR_LEVEL`]).
pub fn gdr_level_from_env() -> Result<PathClass> {
    match NET_GDR_LEVEL.value() {
        Some(v) => parse_gdr_level(&v),
        None => Ok(DEFAULT_GDR_LEVEL),
    }
}

/// Whether a NIC at path class `class` from a GPU is close enough for GPUDirect RDMA under
/// `level` (`LOC` disables it: no NIC is the GPU itself).
pub fn gdr_allowed(class: PathClass, level: PathClass) -> bool {
    level != PathClass::Loc
        && !matches!(class, PathClass::Na | PathClass::Loc)
        && class_rank(class) <= class_rank(level)
}

/// The network card a GPU uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NicPair {
    /// Index into [`Topology::gpus`].
    pub gpu: usize,
    /// Index into [`Topology::nics`].
    pub nic: usize,
    /// Their path class.
    pub class: PathClass,
    /// An RDMA NIC within the GDR level: GPUDirect RDMA may be used on this pair.
    pub gdr: bool,
}

/// The NIC of every GPU (in GPU order; none without NICs): RDMA NICs when the host has any,
/// else every NIC; the closest by PCI path; among equally close NICs the one fewer GPUs use so
/// far (two GPUs behind a switch with two NICs get one each), then the first.
pub fn nic_pairs(topo: &Topology, level: PathClass) -> Vec<NicPair> {
    let rdma = topo.nics.iter().any(|n| n.kind == NicKind::Ib);
    let usable: Vec<usize> = (0..topo.nics.len())
        .filter(|&k| !rdma || topo.nics[k].kind == NicKind::Ib)
        .collect();
    let mut load = vec![0usize; topo.nics.len()];
    let mut pairs = Vec::new();
    for gpu in 0..topo.gpus.len() {
        let best = usable
            .iter()
            .map(|&k| (class_rank(topo.gpu_nic_path(gpu, k)), load[k], k))
            .min();
        let Some((_, _, nic)) = best else {
            continue;
        };
        load[nic] += 1;
        let class = topo.gpu_nic_path(gpu, nic);
        pairs.push(NicPair {
            gpu,
            nic,
            class,
            gdr: topo.nics[nic].kind == NicKind::Ib && gdr_allowed(class, level),
        });
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Gpu, Nic};

    /// A host of `gpus` GPUs and `nics`, `between(a, b)` the class of devices a and b (GPUs
    /// first, then NICs).
    fn topo(
        gpus: usize,
        nics: &[(NicKind, &str)],
        between: impl Fn(usize, usize) -> PathClass,
    ) -> Topology {
        Topology {
            gpus: (0..gpus)
                .map(|i| Gpu {
                    index: i as u32,
                    ..Gpu::default()
                })
                .collect(),
            nics: nics
                .iter()
                .map(|(kind, name)| Nic {
                    name: name.to_string(),
                    label: name.to_string(),
                    kind: *kind,
                    ..Nic::default()
                })
                .collect(),
            paths: PathClass::matrix(gpus + nics.len(), between),
            ..Topology::default()
        }
    }

    #[test]
    fn levels_parse_as_nccl_spells_them() {
        use PathClass::*;
        let names = [
            ("LOC", Loc),
            ("pix", Pix),
            ("PXB", Pxb),
            ("PHB", Phb),
            ("NODE", Node),
            ("SYS", Sys),
        ];
        for (s, c) in names {
            assert_eq!(parse_gdr_level(s).expect(s), c, "{s}");
        }
        // NCCL's numbers: 0-3 as the first names, 4 and above SYS.
        for (n, c) in [Loc, Pix, Pxb, Phb, Sys, Sys].into_iter().enumerate() {
            let s = n.to_string();
            assert_eq!(parse_gdr_level(&s).expect(&s), c, "{s}");
        }
        for bad in ["", "NV2", "fast", "-1", "N/A"] {
            let e = parse_gdr_level(bad).expect_err(bad).to_string();
            assert!(e.contains("WEFT_NET_GDR_LEVEL"), "{e}");
        }
    }

    #[test]
    fn gdr_is_allowed_up_to_the_level() {
        assert!(gdr_allowed(PathClass::Pix, PathClass::Pxb));
        assert!(gdr_allowed(PathClass::Pxb, PathClass::Pxb));
        assert!(!gdr_allowed(PathClass::Phb, PathClass::Pxb));
        assert!(gdr_allowed(PathClass::Sys, PathClass::Sys));
        assert!(
            !gdr_allowed(PathClass::Pix, PathClass::Loc),
            "LOC disables GDR"
        );
        assert!(!gdr_allowed(PathClass::Na, PathClass::Sys));
    }

    /// Two switches, each with two GPUs and two NICs (devices: GPU0-3, NIC0-3; GPUs 0,1 and
    /// NICs 0,1 on switch A): every GPU gets its own NIC on its switch; an Ethernet NIC closer
    /// than every RDMA one is not chosen when RDMA NICs exist.
    #[test]
    fn each_gpu_takes_its_own_closest_rdma_nic() {
        let side = |d: usize| match d {
            0 | 1 | 4 | 5 => 0,
            8 => 0,
            _ => 1,
        };
        let nics = [
            (NicKind::Ib, "mlx5_0"),
            (NicKind::Ib, "mlx5_1"),
            (NicKind::Ib, "mlx5_2"),
            (NicKind::Ib, "mlx5_3"),
            (NicKind::Ethernet, "eth0"),
        ];
        let t = topo(4, &nics, |a, b| {
            if a == 8 || b == 8 {
                return if side(a) == side(b) {
                    PathClass::Pix
                } else {
                    PathClass::Sys
                };
            }
            if side(a) == side(b) {
                PathClass::Pxb
            } else {
                PathClass::Sys
            }
        });
        let pairs = nic_pairs(&t, PathClass::Pxb);
        let chosen: Vec<(usize, usize)> = pairs.iter().map(|p| (p.gpu, p.nic)).collect();
        assert_eq!(chosen, [(0, 0), (1, 1), (2, 2), (3, 3)]);
        assert!(pairs.iter().all(|p| p.class == PathClass::Pxb && p.gdr));
        // Under PIX the same pairs are too far for GPUDirect RDMA.
        assert!(nic_pairs(&t, PathClass::Pix).iter().all(|p| !p.gdr));
    }

    /// Without RDMA NICs every NIC counts, and GPUDirect RDMA never applies; without NICs no
    /// GPU has one.
    #[test]
    fn ethernet_only_hosts_have_no_gdr() {
        let t = topo(2, &[(NicKind::Ethernet, "eth0")], |_, _| PathClass::Phb);
        let pairs = nic_pairs(&t, PathClass::Sys);
        assert_eq!(pairs.len(), 2);
        assert!(pairs.iter().all(|p| p.nic == 0 && !p.gdr));
        assert!(nic_pairs(&topo(2, &[], |_, _| PathClass::Phb), PathClass::Sys).is_empty());
    }
}
