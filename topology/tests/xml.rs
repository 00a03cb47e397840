//! NCCL topology XML: round trips of every fixture, a hand-written NCCL-style dump, malformed input.

mod common;
use common::{fixture, fixtures};
use weftcc_topology::{nvsmi, xml, NicKind, PathClass, TopoError};

#[test]
fn round_trip_keeps_every_path_class() {
    for f in &fixtures() {
        let t = nvsmi::parse(&fixture(f)).unwrap();
        let text = xml::write(&t);
        let back = xml::read(&text).unwrap_or_else(|e| panic!("{f}: {e}\n{text}"));
        assert_eq!(back.gpus.len(), t.gpus.len(), "{f}");
        assert_eq!(back.nics.len(), t.nics.len(), "{f}");
        for d in 0..t.ndevices() {
            for e in 0..t.ndevices() {
                assert_eq!(
                    back.path(d, e),
                    t.path(d, e),
                    "{f}: {} - {}\n{text}",
                    t.device_label(d),
                    t.device_label(e)
                );
            }
        }
        for (a, b) in t.nics.iter().zip(&back.nics) {
            assert_eq!(a.name, b.name, "{f}");
        }
        // Writing the read-back gives the same text (stable output).
        assert_eq!(xml::write(&back), text, "{f}");
    }
}

const NCCL_DUMP: &str = r#"<?xml version="1.0"?>
<!-- written by hand in the shape of an NCCL_TOPO_DUMP_FILE of a 2-socket, 4-GPU server -->
<system version="1">
  <cpu numaid="0" affinity="00000000,0000ffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="85">
    <pci busid="0000:17:00.0" class="0x060400" vendor="0x10b5" device="0x8747" link_speed="8.0 GT/s PCIe" link_width="16">
      <pci busid="0000:18:00.0" class="0x030200" vendor="0x10de" device="0x1db4" link_speed="8.0 GT/s PCIe" link_width="16">
        <gpu dev="0" sm="70" rank="0" gdr="1">
          <nvlink target="0000:3b:00.0" count="2" tclass="0x030200"/>
        </gpu>
      </pci>
      <pci busid="0000:19:00.0" class="0x020700" vendor="0x15b3" link_speed="8.0 GT/s PCIe" link_width="16">
        <nic>
          <net name="mlx5_0" dev="0" speed="100000" port="1" latency="0.000000" guid="0x1" maxconn="262144" gdr="1"/>
        </nic>
      </pci>
    </pci>
    <pci busid="0000:3b:00.0" class="0x030200" link_speed="8.0 GT/s PCIe" link_width="16">
      <gpu dev="1" sm="70" rank="1" gdr="1">
        <nvlink target="0000:18:00.0" count="2" tclass="0x030200"/>
      </gpu>
    </pci>
  </cpu>
  <cpu numaid="1" affinity="ffff0000,00000000" arch="x86_64">
    <pci busid="0000:86:00.0" class="0x030200">
      <gpu dev="3" sm="70" rank="3" gdr="1"/>
    </pci>
    <pci busid="0000:AF:00.0" class="0x030200">
      <gpu dev="2" sm="70" rank="2" gdr="1"/>
    </pci>
    <nic>
      <net name="eth0" dev="1" speed="25000" port="1"/>
    </nic>
  </cpu>
</system>
"#;

#[test]
fn reads_an_nccl_style_dump() {
    let t = xml::read(NCCL_DUMP).unwrap();
    assert_eq!(t.gpus.len(), 4);
    assert_eq!(
        t.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(t.gpus[0].sm, Some(70));
    assert_eq!(t.gpus[2].bus_id.as_deref(), Some("0000:af:00.0"));
    assert_eq!(t.gpu_path(0, 1), PathClass::NvLink(2));
    assert_eq!(t.gpu_path(2, 3), PathClass::Node);
    assert_eq!(t.gpu_path(0, 2), PathClass::Sys);
    assert_eq!(t.gpu_nic_path(0, 0), PathClass::Pix);
    assert_eq!(t.gpu_nic_path(1, 0), PathClass::Node);
    assert_eq!(t.nics[0].kind, NicKind::Ib);
    assert_eq!(t.nics[0].speed_gbit, Some(100.0));
    assert_eq!(t.nics[1].speed_gbit, Some(25.0));
    assert_eq!(t.cpus.len(), 2);
    assert_eq!(t.gpus[3].numa, Some(1));
    // NCCL's cpumask affinity becomes a CPU list.
    assert_eq!(t.cpus[0].cpulist.as_deref(), Some("0-15"));
    assert_eq!(t.cpus[1].cpulist.as_deref(), Some("48-63"));
    assert_eq!(t.cpus[1].cpus, Some(16));
}

#[test]
fn cpumasks() {
    use weftcc_topology::xml::{cpulist_to_mask, mask_to_cpulist};
    assert_eq!(mask_to_cpulist("00000000,0000ffff"), "0-15");
    assert_eq!(mask_to_cpulist("ffff0000,00000000"), "48-63");
    assert_eq!(mask_to_cpulist("0000000f,00f00000"), "20-23,32-35");
    assert_eq!(mask_to_cpulist("0-3"), "0-3");
    assert_eq!(mask_to_cpulist("5"), "5");
    assert_eq!(cpulist_to_mask("0-19,40-59"), "0fffff00,000fffff");
    assert_eq!(cpulist_to_mask("0-63"), "ffffffff,ffffffff");
    assert_eq!(cpulist_to_mask("x"), "x");
    assert_eq!(cpulist_to_mask("5-2"), "5-2");
    for l in ["0-19,40-59", "0-55,112-167", "3", "0,2,4-7"] {
        assert_eq!(mask_to_cpulist(&cpulist_to_mask(l)), l);
    }
    // numaid="-1" is accepted.
    let t = xml::read(
        "<system><cpu numaid=\"-1\"><pci busid=\"1\"><gpu dev=\"0\"/></pci></cpu></system>",
    )
    .unwrap();
    assert_eq!(t.cpus[0].numa, 0);
}

/// Reading `text` fails with an XML error whose message contains `want`.
fn assert_xml_rejects(text: &str, want: &str) {
    match xml::read(text) {
        Err(e @ TopoError::Xml(_)) => assert!(e.to_string().contains(want), "{text:?}: {e}"),
        other => panic!("expected an XML error about {want:?} for {text:?}, got {other:?}"),
    }
}

#[test]
fn malformed_xml_gives_clear_errors() {
    let cases = [
        ("", "no <system>"),
        ("<foo/>", "outside <system>"),
        ("<system><cpu numaid=\"0\">", "unclosed"),
        ("<system><cpu numaid=\"0\"></pci></system>", "byte"),
        ("<system><cpu></cpu></system>", "without numaid"),
        ("<system><cpu numaid=\"x\"></cpu></system>", "not a number"),
        ("<system><cpu numaid=\"0\"/><cpu numaid=\"0\"/></system>", "two <cpu"),
        ("<system><cpu numaid=\"0\"><pci class=\"0x0\"/></cpu></system>", "without busid"),
        ("<system><cpu numaid=\"0\"><nvlink target=\"a\"/></cpu></system>", "outside <gpu>"),
        ("<system><cpu numaid=\"0\"><gpu dev=\"0\"/><gpu dev=\"0\"/></cpu></system>", "two GPUs"),
        ("<system><cpu numaid=\"0\"><gpu dev=\"0\"><nvlink target=\"a\" count=\"0\"/></gpu></cpu></system>", "out of range"),
        ("<system><cpu numaid=\"0\"><nic><net/></nic></cpu></system>", "without name"),
        ("<system><system/></system>", "nested"),
        ("<system><cpu numaid=\"0\" a=\"1\" a=\"2\"/></system>", "byte"),
    ];
    for (text, want) in cases {
        assert_xml_rejects(text, want);
    }
    let deep = format!(
        "<system><cpu numaid=\"0\">{}",
        "<pci busid=\"1\">".repeat(100)
    );
    assert_xml_rejects(&deep, "deeper");
    // Unknown elements and attributes are ignored.
    let t = xml::read("<system version=\"1\"><cpu numaid=\"0\"><pci busid=\"1\"><foo/><gpu dev=\"0\" extra=\"y\"/></pci></cpu><bar/></system>").unwrap();
    assert_eq!(t.gpus.len(), 1);
}

#[test]
fn garbage_xml_never_panics() {
    let base: Vec<char> = NCCL_DUMP.chars().collect();
    let mut seed: u64 = 0x1234_5678_9abc_def1;
    for _ in 0..3000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut s = base.clone();
        let pos = (seed % s.len() as u64) as usize;
        match (seed >> 32) % 3 {
            0 => {
                s.remove(pos);
            }
            1 => s.insert(
                pos,
                ['<', '>', '"', '/', '=', 'x', '&'][((seed >> 40) % 7) as usize],
            ),
            _ => s.truncate(pos),
        }
        let text: String = s.into_iter().collect();
        if let Ok(t) = xml::read(&text) {
            t.validate().unwrap();
        }
    }
}
