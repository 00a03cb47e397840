//! `weft topo` content: warnings on the fixtures and the four renderings.

mod common;
use common::topology;
use weftcc_topology::report::{
    build, render_dot, render_json, render_svg, render_text, ReportOptions,
};
use weftcc_topology::{GpuTransport, PathClass, Topology};

fn codes(t: &Topology, opts: &ReportOptions) -> Vec<String> {
    build(t, opts)
        .warnings
        .into_iter()
        .map(|w| w.code)
        .collect()
}

#[test]
fn socket_groups_follow_numa_and_nvlink() {
    let t = topology("dgx1_v100.txt");
    let g = t.socket_groups();
    assert_eq!(&g[..8], &[0, 0, 0, 0, 1, 1, 1, 1]);
    let t = topology("nvlink_bridged_pairs.txt");
    assert_eq!(t.socket_groups(), vec![0, 0, 1, 1]);
    let t = topology("dgx_a100.txt");
    assert_eq!(t.socket_groups()[..8].iter().max(), Some(&3));
}

#[test]
fn warnings_users_can_act_on() {
    let o = ReportOptions::default();
    assert!(codes(&topology("pcie8_dual_socket.txt"), &o).contains(&"cross_socket".to_string()));
    assert!(codes(&topology("nvlink_bridged_pairs.txt"), &o).contains(&"cross_socket".to_string()));
    assert!(!codes(&topology("dgx1_v100.txt"), &o).contains(&"cross_socket".to_string()));
    assert!(codes(&topology("pcie4_nic_far.txt"), &o).contains(&"nic_far".to_string()));
    assert!(codes(&topology("dgx_h100.txt"), &o).is_empty());
    assert!(codes(&topology("dgx_a100.txt"), &o).is_empty());

    let mut t = topology("dgx1_v100.txt");
    t.p2p_missing = vec![(0, 1), (0, 5)];
    let r = build(&t, &o);
    let w = r.warnings.iter().find(|w| w.code == "p2p_missing").unwrap();
    assert!(w.message.contains("GPU0-GPU1"));
    assert!(
        !w.message.contains("GPU0-GPU5"),
        "no NVLink there: {}",
        w.message
    );

    // 8 local ranks: 7 rings each of the runtime's 1 MiB (plus a control page), 56+ MiB in all.
    t.shm_bytes = Some(48 << 20);
    let r = build(&t, &o);
    let w = r.warnings.iter().find(|w| w.code == "shm_small").unwrap();
    assert!(
        w.message.contains("48 MiB") && w.message.contains("8×7 rings"),
        "{}",
        w.message
    );
    t.shm_bytes = Some(64 << 20);
    assert!(!codes(&t, &o).contains(&"shm_small".to_string()));
    // WEFT_BUFFSIZE=4M: 8×7 rings of 4 MiB no longer fit in 64 MiB.
    let big = ReportOptions {
        buffsize: Some(4 << 20),
        ..o.clone()
    };
    assert!(codes(&t, &big).contains(&"shm_small".to_string()));
    t.shm_bytes = Some(1 << 30);
    assert!(!codes(&t, &o).contains(&"shm_small".to_string()));

    assert_eq!(codes(&Topology::default(), &o), vec!["no_gpu".to_string()]);
}

/// DGX A100: each GPU takes the NIC on its own PCIe switch (mlx5_4/5, the storage pair on a
/// switch of their own, are nobody's), and GPUDirect RDMA applies at the default level but not
/// with WEFT_NET_GDR_LEVEL=LOC.
#[test]
fn each_gpu_gets_the_nic_on_its_switch() {
    let t = topology("dgx_a100.txt");
    let r = build(&t, &ReportOptions::default());
    let pairs: Vec<(usize, &str)> = r
        .nic_pairs
        .iter()
        .map(|p| (p.gpu, t.nics[p.nic].name.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [
            (0, "mlx5_0"),
            (1, "mlx5_1"),
            (2, "mlx5_2"),
            (3, "mlx5_3"),
            (4, "mlx5_6"),
            (5, "mlx5_7"),
            (6, "mlx5_8"),
            (7, "mlx5_9")
        ]
    );
    assert!(r
        .nic_pairs
        .iter()
        .all(|p| p.gdr && p.class == PathClass::Pix));
    let text = render_text(&r);
    assert!(
        text.contains("network: GPU4 -> mlx5_6 (PIX): GPUDirect RDMA possible (within WEFT_NET_GDR_LEVEL=PXB)"),
        "{text}"
    );
    let off = ReportOptions {
        gdr_level: PathClass::Loc,
        ..ReportOptions::default()
    };
    let r = build(&t, &off);
    assert!(r.nic_pairs.iter().all(|p| !p.gdr));
    assert!(render_text(&r).contains("GPUDirect RDMA off (WEFT_NET_GDR_LEVEL=LOC)"));
}

#[test]
fn renderings() {
    let t = topology("dgx1_v100.txt");
    let opts = ReportOptions {
        nhosts: 4,
        ..ReportOptions::default()
    };
    let r = build(&t, &opts);
    assert_eq!(r.model.nranks, 32);
    let text = render_text(&r);
    for want in [
        "link matrix",
        "NV2/40",
        "ring 0:",
        "socket crossings 0",
        "tree 1 across 4 hosts",
        "ring across 4 hosts",
        "slowest hop 40.0 GB/s",
        "trees: 2, each carrying half the data",
        "allreduce",
        "busbw",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let v: serde_json::Value = serde_json::from_str(&render_json(&r)).unwrap();
    assert_eq!(v["rings"]["rings"].as_array().unwrap().len(), 4);
    assert_eq!(v["topology"]["paths"][0][3], "NV2");
    let dot = render_dot(&r);
    assert!(dot.starts_with("graph topology {") && dot.trim_end().ends_with('}'));
    assert!(dot.contains("color=red"));
    for f in [
        "dgx1_v100.txt",
        "dgx_a100.txt",
        "pcie8_dual_socket.txt",
        "single_gpu.txt",
    ] {
        let r = build(&topology(f), &ReportOptions::default());
        let svg = render_svg(&r);
        // Well-formed XML.
        let mut rd = quick_xml::Reader::from_str(&svg);
        let mut depth = 0i32;
        loop {
            match rd.read_event().unwrap() {
                quick_xml::events::Event::Start(_) => depth += 1,
                quick_xml::events::Event::End(_) => depth -= 1,
                quick_xml::events::Event::Eof => break,
                _ => {}
            }
        }
        assert_eq!(depth, 0, "{f}");
        assert!(svg.contains("GPU0"), "{f}");
    }
    // A host without GPUs still renders.
    let r = build(&Topology::default(), &ReportOptions::default());
    assert!(render_text(&r).contains("rings: none"));
    let _ = render_svg(&r);
    let _ = render_dot(&r);
}

/// The device communicator's GPU paths: CUDA IPC over each pair's own class where every pair of
/// the host's GPUs has peer access, else every pair staged at a GPU's PCIe rate; in the text.
#[test]
fn gpu_paths_are_the_device_communicators() {
    let o = ReportOptions::default();
    let t = topology("dgx1_v100.txt");
    let r = build(&t, &o);
    assert_eq!(r.gpu_paths.len(), 8 * 7 / 2);
    for p in &r.gpu_paths {
        assert_eq!(p.transport, GpuTransport::CudaIpc, "{p:?}");
        assert_eq!(p.class, t.gpu_path(p.a, p.b));
        assert_eq!(p.gbps, o.speeds.bandwidth(p.class));
    }
    // GPU0–GPU1 are NVLink-joined on a DGX-1, GPU0–GPU5 not: their rates differ.
    let rate = |a, b| {
        r.gpu_paths
            .iter()
            .find(|p| (p.a, p.b) == (a, b))
            .unwrap()
            .gbps
    };
    assert!(rate(0, 1) > rate(0, 5), "{} {}", rate(0, 1), rate(0, 5));
    let text = render_text(&r);
    assert!(
        text.contains(&format!("GPU0 <-> GPU1: {}", r.gpu_paths[0].describe())),
        "{text}"
    );
    let mut t = t;
    t.p2p_missing = vec![(0, 5)];
    let r = build(&t, &o);
    assert!(r
        .gpu_paths
        .iter()
        .all(|p| p.transport == GpuTransport::Staged && p.gbps == o.speeds.pcie_gbps));
    assert!(render_text(&r).contains("GPU0 <-> GPU1: staged through pinned host memory"));
    assert!(build(&topology("single_gpu.txt"), &o).gpu_paths.is_empty());
    assert!(!render_text(&build(&topology("single_gpu.txt"), &o)).contains("GPU paths"));
}

/// The CUDA driver's bus id finds the topology's GPU whatever the domain's width and case.
#[test]
fn gpus_are_found_by_the_drivers_bus_id() {
    let mut t = topology("pcie4_pxb.txt");
    for (g, bus) in t.gpus.iter_mut().zip(["0000:3b:00.0", "0000:5e:00.0"]) {
        g.bus_id = Some(bus.to_string());
    }
    assert_eq!(t.gpu_by_bus_id("00000000:5E:00.0"), Some(1));
    assert_eq!(t.gpu_by_bus_id("0000:3b:00.0"), Some(0));
    assert_eq!(t.gpu_by_bus_id("0000:3b:00.1"), None);
    assert_eq!(t.gpu_by_bus_id("garbage"), None);
}
