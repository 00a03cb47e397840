//! `nvidia-smi topo -m` parser: real-looking fixtures and malformed inputs.

mod common;
use common::{fixture, fixtures, gpu_matrix, topology};
use weftcc_topology::{nvsmi, NicKind, PathClass, TopoError};

#[test]
fn every_fixture_parses_and_is_consistent() {
    for f in &fixtures() {
        let t = nvsmi::parse(&fixture(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        t.validate().unwrap();
        assert!(!t.gpus.is_empty(), "{f}");
        assert!(!t.cpus.is_empty(), "{f}");
    }
}

#[test]
fn dgx1_hybrid_cube_mesh() {
    let t = topology("dgx1_v100.txt");
    assert_eq!((t.gpus.len(), t.nics.len(), t.cpus.len()), (8, 4, 2));
    // Old style: NIC columns named after the device.
    assert_eq!(t.nics[0].name, "mlx5_0");
    assert_eq!(t.nics[1].name, "mlx5_2");
    assert_eq!(t.nics[0].kind, NicKind::Ib);
    assert_eq!(t.gpu_path(0, 3), PathClass::NvLink(2));
    assert_eq!(t.gpu_path(0, 1), PathClass::NvLink(1));
    assert_eq!(t.gpu_path(0, 5), PathClass::Sys);
    assert_eq!(t.gpu_nic_path(0, 0), PathClass::Pix);
    assert_eq!(t.gpus[4].cpu_affinity.as_deref(), Some("20-39,60-79"));
    assert_eq!(t.gpus[4].numa, Some(1));
    assert_eq!(t.cpus[0].cpus, Some(40));
    // Each GPU has 6 NVLinks.
    for i in 0..8 {
        let links: u32 = (0..8)
            .map(|j| match t.gpu_path(i, j) {
                PathClass::NvLink(n) => n,
                _ => 0,
            })
            .sum();
        assert_eq!(links, 6, "GPU{i}");
    }
}

#[test]
fn dgx_a100_nic_legend_and_numa() {
    let t = topology("dgx_a100.txt");
    assert_eq!((t.gpus.len(), t.nics.len(), t.cpus.len()), (8, 10, 4));
    assert_eq!(t.nics[4].label, "NIC4");
    assert_eq!(t.nics[4].name, "mlx5_4");
    assert_eq!(t.gpu_path(2, 7), PathClass::NvLink(12));
    assert_eq!(t.gpus[0].numa, Some(3));
    assert_eq!(t.gpus[0].cpu_affinity.as_deref(), Some("48-63,176-191"));
    assert_eq!(t.gpu_nic_path(0, 0), PathClass::Pix);
    assert_eq!(t.gpu_nic_path(0, 1), PathClass::Pxb);
    assert_eq!(t.gpu_nic_path(0, 2), PathClass::Sys);
}

#[test]
fn spaces_and_colour_codes() {
    let a = nvsmi::parse(&fixture("pcie4_one_socket.txt")).unwrap();
    let b = nvsmi::parse(&fixture("pcie4_spaces_ansi.txt")).unwrap();
    assert_eq!(a.paths, b.paths);
    assert_eq!(b.gpus[0].cpu_affinity.as_deref(), Some("0-31"));
    // Without the legend the NIC keeps its label.
    assert_eq!(b.nics[0].name, "NIC0");
    assert_eq!(a.nics[0].name, "mlx5_0");
}

#[test]
fn single_gpu() {
    let t = nvsmi::parse(&fixture("single_gpu.txt")).unwrap();
    assert_eq!(t.gpus.len(), 1);
    assert_eq!(t.paths, vec![vec![PathClass::Loc]]);
}

#[test]
fn minimal_inputs() {
    let t = nvsmi::parse("GPU0 GPU1\nGPU0 X NV4\nGPU1 NV4 X\n").unwrap();
    assert_eq!(t.gpu_path(0, 1), PathClass::NvLink(4));
    assert!(t.gpus[0].cpu_affinity.is_none());
    // Old name SOC for SYS, N/A cells, CRLF line ends, leading junk.
    let t = nvsmi::parse(
        "some banner\r\n\tGPU0\tGPU1\tCPU Affinity\r\nGPU0\t X \tSOC\t0-3\r\nGPU1\tSOC\t X \tN/A\r\n",
    )
    .unwrap();
    assert_eq!(t.gpu_path(0, 1), PathClass::Sys);
    assert!(t.gpus[1].cpu_affinity.is_none());
    // NIC rows missing: taken from the columns.
    let t = nvsmi::parse("GPU0 NIC0\nGPU0 X PIX\n\nNIC Legend:\n  NIC0: mlx5_3\n").unwrap();
    assert_eq!(t.nics[0].name, "mlx5_3");
    assert_eq!(t.gpu_nic_path(0, 0), PathClass::Pix);
}

fn err(text: &str) -> String {
    match nvsmi::parse(text) {
        Ok(t) => panic!("expected an error for {text:?}, got {t:?}"),
        Err(e @ TopoError::NvidiaSmi { .. }) => e.to_string(),
        Err(e) => panic!("wrong error type: {e}"),
    }
}

#[test]
fn malformed_inputs_give_clear_errors() {
    assert!(err("").contains("no header"));
    assert!(err("hello world\nnothing here\n").contains("no header"));
    assert!(err("GPU0 GPU1\nGPU0 X NV2\n").contains("missing row for GPU1"));
    assert!(err("GPU0 GPU1\nGPU0 X NV2\nGPU1 NV2\n").contains("has 1 cells, expected 2"));
    assert!(err("GPU0 GPU1\nGPU0 X FOO\nGPU1 NV2 X\n").contains("unknown link \"FOO\""));
    assert!(err("GPU0 GPU1\nGPU0 X NV2\nGPU1 NV1 X\n").contains("asymmetric"));
    assert!(err("GPU0 GPU1\nGPU0 PIX NV2\nGPU1 NV2 X\n").contains("expected X"));
    assert!(err("GPU0 GPU1\nGPU0 X X\nGPU1 X X\n").contains("different devices"));
    assert!(err("GPU0 GPU0\nGPU0 X X\n").contains("appears twice"));
    assert!(err("GPU0 GPU1\nGPU0 X PIX\nGPU0 X PIX\nGPU1 PIX X\n").contains("appears twice"));
    assert!(err("GPU0 GPU1\nGPU0 X PIX\nGPU7 PIX X\n").contains("GPU7 has no column"));
    assert!(err("GPU0 CPU Bogus\nGPU0 X 0-3\n").contains("unknown column title"));
    assert!(err("GPU0 CPU Affinity\nGPU0 X 0-3 extra\n").contains("values after the matrix"));
    assert!(err("GPU0 CPU Affinity\nGPU0 X abc\n").contains("bad CPU affinity"));
    assert!(err("GPU0 NUMA Affinity\nGPU0 X x1\n").contains("bad NUMA affinity"));
    assert!(err("GPU0 NIC0\nGPU0 X NV0\n").contains("unknown link"));
    assert!(err("GPU0\n").contains("missing row for GPU0"));
    assert!(err("GPU0 GPU1x\nGPU0 X PIX\n").contains("bad GPU column"));
}

#[test]
fn garbage_never_panics() {
    // Deterministic pseudo-random mutations of the fixtures: every result is Ok or a typed error.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let alphabet: Vec<char> = "GPUNICX \t\n0123456789NVPIXSYSNODE/A:-,\u{1b}[m"
        .chars()
        .collect();
    for f in &fixtures() {
        let base: Vec<char> = fixture(f).chars().collect();
        for _ in 0..150 {
            let mut s = base.clone();
            for _ in 0..(1 + next() % 6) {
                if s.is_empty() {
                    break;
                }
                let pos = (next() % s.len() as u64) as usize;
                match next() % 3 {
                    0 => {
                        s.remove(pos);
                    }
                    1 => s.insert(pos, alphabet[(next() % alphabet.len() as u64) as usize]),
                    _ => s.truncate(pos),
                }
            }
            let text: String = s.into_iter().collect();
            if let Ok(t) = nvsmi::parse(&text) {
                t.validate().unwrap();
            }
        }
    }
    // Non-UTF-8-ish and huge inputs.
    let _ = nvsmi::parse(&"GPU0 ".repeat(5000));
    let _ = nvsmi::parse("\u{0}\u{1}\u{2}GPU0\u{ffff}");
}

#[test]
fn hostile_values_do_not_overflow() {
    let t = nvsmi::parse(
        "GPU0 GPU1 CPU Affinity NUMA Affinity\nGPU0 X NV64 0-4294967295 4294967295\nGPU1 NV64 X 0 0\n",
    )
    .unwrap();
    assert_eq!(
        t.cpus.iter().map(|c| c.cpus.unwrap_or(0)).max(),
        Some(u32::MAX)
    );
    let _ = weftcc_topology::search::rings(&t, &weftcc_topology::LinkSpeeds::default());
    let r = weftcc_topology::report::build(&t, &Default::default());
    let _ = weftcc_topology::report::render_text(&r);
    let _ = weftcc_topology::xml::write(&t);
    // A big all-NVLink host (beyond the exact search) stays fast.
    let text = gpu_matrix(64, |i, j| if (i + j) % 3 == 0 { "NV2" } else { "SYS" });
    let t = nvsmi::parse(&text).unwrap();
    let t0 = std::time::Instant::now();
    let plan = weftcc_topology::search::rings(&t, &weftcc_topology::LinkSpeeds::default());
    assert!(t0.elapsed().as_secs() < 20, "{:?}", t0.elapsed());
    assert!(!plan.rings.is_empty());
}
