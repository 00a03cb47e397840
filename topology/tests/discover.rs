//! Discovery from a fake sysfs tree and a fake `nvidia-smi`, and on this machine.

mod common;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;
use weftcc_topology::discover::{discover, discover_with, parse_p2p, DiscoverOptions};
use weftcc_topology::{NicKind, PathClass};

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-topo-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn put(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, content).unwrap();
}

/// `rel` as a symbolic link to `target` (both under `root`), as sysfs links a device.
fn link(root: &Path, target: &str, rel: &str) {
    std::os::unix::fs::symlink(root.join(target), root.join(rel)).unwrap();
}

/// Port `port` of the InfiniBand device `mlx5_0`: its rate, state and link layer as sysfs
/// writes them.
fn ib_port(root: &Path, port: u32, rate: &str, state: &str, link_layer: &str) {
    let dir = format!("class/infiniband/mlx5_0/ports/{port}");
    put(root, &format!("{dir}/rate"), &format!("{rate}\n"));
    put(root, &format!("{dir}/state"), &format!("{state}\n"));
    put(
        root,
        &format!("{dir}/link_layer"),
        &format!("{link_layer}\n"),
    );
}

/// The PCI device `pci` (under `devices/`) on NUMA node `numa` (-1: none), which the device of
/// class `class` (`class/net/eth0`) links to.
fn pci_device(root: &Path, pci: &str, numa: i32, class: &str) {
    put(
        root,
        &format!("devices/{pci}/numa_node"),
        &format!("{numa}\n"),
    );
    fs::create_dir_all(root.join(class)).unwrap();
    link(root, &format!("devices/{pci}"), &format!("{class}/device"));
}

fn fake_sysfs(root: &Path) {
    put(root, "devices/system/node/node0/cpulist", "0-15,32-47\n");
    put(
        root,
        "devices/system/node/node0/meminfo",
        "Node 0 MemTotal:       65536 kB\nNode 0 MemFree:  1 kB\n",
    );
    put(root, "devices/system/node/node1/cpulist", "16-31,48-63\n");
    put(root, "devices/system/node/possible", "0-1\n");
    // InfiniBand device on node 1, one active 200 Gb/s port.
    ib_port(root, 1, "200 Gb/sec (4X HDR)", "4: ACTIVE", "Ethernet");
    let gid = |i: u32, gid: &str| {
        put(
            root,
            &format!("class/infiniband/mlx5_0/ports/1/gids/{i}"),
            gid,
        )
    };
    gid(0, "fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f\n");
    gid(1, "0000:0000:0000:0000:0000:0000:0000:0000\n");
    gid(3, "0000:0000:0000:0000:0000:ffff:0a00:0001\n");
    // A second port, down, faster: it must not set the device's speed.
    ib_port(root, 2, "400 Gb/sec (4X NDR)", "1: DOWN", "InfiniBand");
    pci_device(
        root,
        "pci0000:80/0000:81:00.0",
        1,
        "class/infiniband/mlx5_0",
    );
    // Physical Ethernet on node 0 (25 Gb/s), virtual docker0 and lo without a device link.
    pci_device(root, "pci0000:00/0000:01:00.0", 0, "class/net/eth0");
    put(root, "class/net/eth0/speed", "25000\n");
    put(root, "class/net/docker0/speed", "10000\n");
    put(root, "class/net/lo/speed", "-1\n");
    // A down link reports -1 and no NUMA node (-1).
    pci_device(root, "pci0000:00/0000:02:00.0", -1, "class/net/eth1");
    put(root, "class/net/eth1/speed", "-1\n");
}

/// An executable shell script `name` in `root`.
fn script(root: &Path, name: &str, body: &str) -> PathBuf {
    put(root, name, body);
    let path = root.join(name);
    let mut perm = fs::metadata(&path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    fs::set_permissions(&path, perm).unwrap();
    path
}

/// Discovery from the fake sysfs at `root` and the `nvidia_smi` given, without NVML.
fn faked(root: &Path, nvidia_smi: Option<PathBuf>, timeout: Duration) -> DiscoverOptions {
    DiscoverOptions {
        nvml: None,
        sysfs: root.to_path_buf(),
        nvidia_smi,
        shm: None,
        timeout,
    }
}

#[test]
fn cpu_only_host_from_sysfs() {
    let root = tmpdir("cpu");
    fake_sysfs(&root);
    let no_smi = Some(root.join("no-such-nvidia-smi"));
    let d = discover_with(&faked(&root, no_smi, Duration::from_secs(5)));
    let t = &d.topology;
    assert!(t.gpus.is_empty());
    assert!(
        d.notes.iter().any(|n| n.contains("no GPUs")),
        "{:?}",
        d.notes
    );
    assert_eq!(t.cpus.len(), 2);
    assert_eq!(t.cpus[0].cpus, Some(32));
    assert_eq!(t.cpus[0].mem_bytes, Some(65536 * 1024));
    let names: Vec<&str> = t.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, vec!["mlx5_0", "eth0", "eth1"]);
    assert_eq!(t.nics[0].kind, NicKind::Ib);
    assert_eq!(t.nics[0].speed_gbit, Some(200.0));
    assert_eq!(t.nics[0].numa, Some(1));
    assert_eq!(t.nics[0].bus_id.as_deref(), Some("0000:81:00.0"));
    let ports = &t.nics[0].ports;
    assert_eq!(ports.len(), 2);
    assert_eq!(
        (
            ports[0].port,
            ports[0].state.as_str(),
            ports[0].link_layer.as_str()
        ),
        (1, "ACTIVE", "Ethernet")
    );
    assert_eq!(ports[0].rate_gbit, Some(200.0));
    assert_eq!(
        ports[0].gids,
        vec![
            (0, "fe80:0000:0000:0000:0a0b:0cff:fe0d:0e0f".to_string()),
            (3, "0000:0000:0000:0000:0000:ffff:0a00:0001".to_string())
        ]
    );
    assert_eq!(
        (ports[1].state.as_str(), ports[1].rate_gbit),
        ("DOWN", Some(400.0))
    );
    let report = weftcc_topology::report::render_text(&weftcc_topology::report::build(
        t,
        &weftcc_topology::report::ReportOptions::default(),
    ));
    assert!(
        report.contains("port mlx5_0:1  ACTIVE  Ethernet  200 Gbit/s  2 GIDs  PCI 0000:81:00.0"),
        "{report}"
    );
    assert!(
        report.contains("gid 3: 0000:0000:0000:0000:0000:ffff:0a00:0001"),
        "{report}"
    );
    assert!(t.nics[1].ports.is_empty());
    assert_eq!(t.nics[1].speed_gbit, Some(25.0));
    assert_eq!(t.nics[2].speed_gbit, None);
    assert_eq!(t.nics[2].numa, None);
    assert_eq!(t.path(0, 1), PathClass::Sys);
    assert_eq!(t.path(1, 2), PathClass::Na);
    t.validate().unwrap();
    assert!(t.host.host_id.is_some());
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn gpus_from_a_fake_nvidia_smi() {
    let root = tmpdir("gpu");
    fake_sysfs(&root);
    let fixture = common::fixture_path("pcie4_nic_far.txt");
    let fixture = fixture.display();
    let smi = script(
        &root,
        "nvidia-smi",
        &format!(
            "#!/bin/sh\ncase \"$1 $2\" in\n  'topo -m') cat '{fixture}' ;;\n  'topo -p2p') printf ' \\tGPU0\\tGPU1\\tGPU2\\tGPU3\\n GPU0\\tX\\tOK\\tOK\\tOK\\n GPU1\\tOK\\tX\\tCNS\\tOK\\n GPU2\\tOK\\tCNS\\tX\\tOK\\n GPU3\\tOK\\tOK\\tOK\\tX\\n' ;;\n  *) printf '0, NVIDIA L40S, 00000000:17:00.0\\n1, NVIDIA L40S, 00000000:18:00.0\\n' ;;\nesac\n"
        ),
    );
    let d = discover_with(&faked(&root, Some(smi), Duration::from_secs(10)));
    let t = &d.topology;
    assert_eq!(t.gpus.len(), 4, "{:?}", d.notes);
    assert_eq!(t.gpus[0].name.as_deref(), Some("NVIDIA L40S"));
    assert_eq!(t.gpus[1].bus_id.as_deref(), Some("0000:18:00.0"));
    assert_eq!(t.p2p_missing, vec![(1, 2)]);
    // mlx5_0 came from nvidia-smi and got its speed from sysfs; eth0/eth1 were appended.
    assert_eq!(t.nics[0].name, "mlx5_0");
    assert_eq!(t.nics[0].speed_gbit, Some(200.0));
    assert_eq!(t.nics.len(), 3);
    assert_eq!(t.gpu_nic_path(0, 0), PathClass::Sys);
    assert_eq!(t.gpu_nic_path(0, 1), PathClass::Node);
    t.validate().unwrap();
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn a_hanging_nvidia_smi_times_out() {
    let root = tmpdir("hang");
    let smi = script(&root, "nvidia-smi", "#!/bin/sh\nsleep 30\n");
    let t0 = std::time::Instant::now();
    let d = discover_with(&faked(&root, Some(smi), Duration::from_millis(300)));
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(d.topology.gpus.is_empty());
    assert!(
        d.notes.iter().any(|n| n.contains("timed out")),
        "{:?}",
        d.notes
    );
    // No sysfs at all: one CPU node, no NICs.
    assert_eq!(d.topology.cpus.len(), 1);
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn this_machine() {
    let d = discover();
    let t = &d.topology;
    t.validate().unwrap();
    assert!(!t.cpus.is_empty());
    assert!(t.host.host_id.is_some());
    // NVML is asked first: either it gave the GPUs or a note says why not.
    assert!(
        d.notes
            .iter()
            .any(|n| n.starts_with("NVML: ") || n.starts_with("GPUs from NVML")),
        "{:?}",
        d.notes
    );
    if t.gpus.is_empty() {
        assert!(d
            .notes
            .iter()
            .any(|n| n.contains("no GPUs") || n.contains("NVML: driver loaded")));
    }
}

#[test]
fn no_nvml_driver_gives_a_note_and_falls_back() {
    let root = tmpdir("nonvml");
    fake_sysfs(&root);
    let no_smi = Some(root.join("no-such-nvidia-smi"));
    let d = discover_with(&DiscoverOptions {
        nvml: Some(root.join("no-such-libnvidia-ml.so.1")),
        ..faked(&root, no_smi, Duration::from_secs(5))
    });
    assert!(d.notes[0].starts_with("NVML: no driver ("), "{:?}", d.notes);
    assert!(d.notes[1].starts_with("no GPUs: "), "{:?}", d.notes);
    let t = &d.topology;
    assert!(t.gpus.is_empty());
    assert_eq!(t.cpus.len(), 2);
    assert_eq!(t.nics.len(), 3);
    t.validate().unwrap();
    // Both disabled: notes say so.
    let d = discover_with(&faked(&root, None, Duration::from_secs(5)));
    assert_eq!(
        d.notes,
        vec!["NVML: disabled", "no GPUs: nvidia-smi disabled"]
    );
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn p2p_matrix() {
    assert!(parse_p2p("").is_empty());
    assert_eq!(
        parse_p2p(" \tGPU0\tGPU1\n GPU0\tX\tNS\n GPU1\tNS\tX\n\nLegend:\n  X = Self\n"),
        vec![(0, 1)]
    );
}
