//! Ring search on the fixtures: NVLink where it exists, sockets crossed at most once each way.

mod common;
use common::{gpu_matrix, topology};
use weftcc_topology::search::{double_binary_tree, global_ring, host_chain, network_order, rings};
use weftcc_topology::{nvsmi, LinkSpeeds, PathClass, Topology};

fn assert_valid_ring(t: &Topology, order: &[usize]) {
    let mut seen = order.to_vec();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..t.gpus.len()).collect::<Vec<_>>(),
        "ring visits every GPU once"
    );
}

#[test]
fn dgx1_rings_use_only_nvlink_and_several_channels() {
    let t = topology("dgx1_v100.txt");
    let plan = rings(&t, &LinkSpeeds::default());
    assert!(plan.rings.len() >= 4, "{plan:?}");
    for r in &plan.rings {
        assert_valid_ring(&t, &r.order);
        assert!(r.all_nvlink(), "{r:?}");
        assert_eq!(r.socket_crossings(), 0);
    }
    // First ring on NV2 bundles only: 2 × 20 GB/s.
    assert!((plan.rings[0].bottleneck_gbps - 40.0).abs() < 1e-6);
    // All 6 links of every GPU used: 120 GB/s per GPU and direction.
    assert!(
        (plan.total_gbps() - 120.0).abs() < 1e-6,
        "{}",
        plan.total_gbps()
    );
}

#[test]
fn nvswitch_systems_get_full_nvlink_bandwidth() {
    for (f, links) in [
        ("dgx_a100.txt", 12.0),
        ("dgx_h100.txt", 18.0),
        ("dgx2_v100.txt", 6.0),
    ] {
        let t = topology(f);
        let plan = rings(&t, &LinkSpeeds::default());
        assert!(!plan.rings.is_empty());
        for r in &plan.rings {
            assert_valid_ring(&t, &r.order);
            assert!(r.all_nvlink(), "{f}: {r:?}");
        }
        assert!((plan.total_gbps() - links * 20.0).abs() < 1e-6, "{f}");
    }
}

#[test]
fn pcie_dual_socket_crosses_once_each_way() {
    for f in [
        "pcie8_dual_socket.txt",
        "nvlink_bridged_pairs.txt",
        "nvlink_pairs8_dual_socket.txt",
    ] {
        let t = topology(f);
        let plan = rings(&t, &LinkSpeeds::default());
        assert!(!plan.rings.is_empty(), "{f}");
        for r in &plan.rings {
            assert_valid_ring(&t, &r.order);
            assert_eq!(r.socket_crossings(), 2, "{f}: {r:?}");
        }
        let first = &plan.rings[0];
        // Pairs joined by NVLink or one PCIe switch are neighbours in the ring.
        let nvl = first.hops.iter().filter(|c| c.is_nvlink()).count();
        let expect_nvl = (0..t.gpus.len())
            .flat_map(|i| (i + 1..t.gpus.len()).map(move |j| (i, j)))
            .filter(|&(i, j)| t.gpu_path(i, j).is_nvlink())
            .count();
        assert_eq!(
            nvl, expect_nvl,
            "{f}: every NVLink pair adjacent: {first:?}"
        );
    }
}

#[test]
fn pcie_single_socket_prefers_switch_neighbours() {
    for f in ["pcie4_one_socket.txt", "pcie4_pxb.txt", "pcie4_nic_far.txt"] {
        let t = topology(f);
        let plan = rings(&t, &LinkSpeeds::default());
        let r = &plan.rings[0];
        assert_valid_ring(&t, &r.order);
        assert_eq!(r.socket_crossings(), 0, "{f}");
        assert_eq!(
            r.hops.iter().filter(|c| **c == PathClass::Pix).count(),
            2,
            "{f}: {r:?}"
        );
    }
}

#[test]
fn tiny_hosts() {
    let t = topology("single_gpu.txt");
    let plan = rings(&t, &LinkSpeeds::default());
    assert_eq!(plan.rings.len(), 1);
    assert_eq!(plan.rings[0].order, vec![0]);
    let t = topology("pcie2_phb.txt");
    let plan = rings(&t, &LinkSpeeds::default());
    assert_eq!(plan.rings[0].hops, vec![PathClass::Phb, PathClass::Phb]);
    assert_eq!(host_chain(&plan, 2).len(), 2);
    let empty = Topology::default();
    assert!(rings(&empty, &LinkSpeeds::default()).rings.is_empty());
}

#[test]
fn large_host_uses_backtracking() {
    // 24 GPUs on an NVSwitch (beyond the exact search's 16).
    let text = gpu_matrix(24, |_, _| "NV18");
    let t = nvsmi::parse(&text).unwrap();
    let plan = rings(&t, &LinkSpeeds::default());
    assert_valid_ring(&t, &plan.rings[0].order);
    assert!(plan.rings[0].all_nvlink());
}

#[test]
fn trees_for_host_counts() {
    for n in [1, 2, 3, 4, 5, 8, 16, 33] {
        let [a, b] = double_binary_tree(n);
        assert_eq!(a.parent.len(), n);
        assert_eq!(b.parent.len(), n);
        if n > 2 {
            assert_ne!(a.root, b.root, "n={n}");
        }
    }
}

#[test]
fn rings_across_hosts_enter_and_leave_next_to_the_nics() {
    let t = topology("pcie8_dual_socket.txt");
    let plan = rings(&t, &LinkSpeeds::default());
    let order = network_order(&t, &plan.rings[0]);
    assert_valid_ring(&t, &order);
    let (first, last) = (order[0], order[order.len() - 1]);
    assert_eq!(t.closest_nic(first).unwrap().1, PathClass::Pix, "{order:?}");
    assert_eq!(t.closest_nic(last).unwrap().1, PathClass::Pix, "{order:?}");
    // The socket crossing left inside the host is the only SYS hop of the open chain.
    let sys = order
        .windows(2)
        .filter(|w| t.gpu_path(w[0], w[1]) == PathClass::Sys)
        .count();
    assert_eq!(sys, 1, "{order:?}");
    // Consecutive hops of the open chain are ring hops (same order, rotated).
    let r = &plan.rings[0].order;
    let pos = r.iter().position(|&g| g == order[0]).unwrap();
    for (i, g) in order.iter().enumerate() {
        assert_eq!(*g, r[(pos + i) % r.len()]);
    }
    let global = global_ring(&[order.clone(), order.clone()]);
    assert_eq!(global.len(), 16);
    // Without NICs the slowest hop is cut.
    let t = topology("nvlink_bridged_pairs.txt");
    let plan = rings(&t, &LinkSpeeds::default());
    let order = network_order(&t, &plan.rings[0]);
    assert_ne!(t.gpu_path(order[3], order[0]), PathClass::NvLink(4));
}

#[test]
fn direct_nvlink_mesh_gets_several_channels() {
    // 4 GPUs, every pair NV4 directly (no NVSwitch): 12 links = 240 GB/s per GPU.
    let t = topology("hgx_a100_4gpu.txt");
    let plan = rings(&t, &LinkSpeeds::default());
    for r in &plan.rings {
        assert_valid_ring(&t, &r.order);
        assert!(r.all_nvlink());
    }
    // Two rings at 80 GB/s would leave the 0-2 and 1-3 bundles idle; six at 40 use them all.
    assert!((plan.total_gbps() - 240.0).abs() < 1e-6, "{plan:?}");
    let g = t.graph(&LinkSpeeds::default());
    assert!(!g
        .nodes
        .iter()
        .any(|n| matches!(n.kind, weftcc_topology::NodeKind::NvSwitch { .. })));
}
