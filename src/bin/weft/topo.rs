//! `weft topo`: the topology diagnostic. Describes this machine (or an `nvidia-smi topo -m`
//! dump, or an NCCL topology XML), the rings and trees weftcc would choose with their
//! bottleneck bandwidth, predicted time and bus bandwidth per collective, and warnings.

use clap::{Args, ValueEnum};
use std::io::Read;
use std::path::{Path, PathBuf};
use weftcc_topology::discover::discover;
use weftcc_topology::report::{
    build, render_dot, render_json, render_svg, render_text, ReportOptions,
};
use weftcc_topology::tuner::{Calibration, Selection};
use weftcc_topology::{nvsmi, xml, Topology};

/// Output format of `weft topo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Human-readable report.
    Text,
    /// Everything, machine-readable.
    Json,
    /// Graphviz DOT of the topology with the first ring.
    Dot,
}

#[derive(Args, Debug)]
pub struct TopoArgs {
    /// Read an `nvidia-smi topo -m` dump ("-" for stdin) instead of discovering this machine.
    #[arg(long = "nvidia-smi", value_name = "FILE", conflicts_with = "xml")]
    nvidia_smi: Option<PathBuf>,
    /// Read an NCCL topology XML (e.g. from NCCL_TOPO_DUMP_FILE; "-" for stdin).
    #[arg(long, value_name = "FILE")]
    xml: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Also write a drawing of the topology with the chosen ring (SVG).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Also write the topology as NCCL-compatible XML (usable as NCCL_TOPO_FILE).
    #[arg(long = "dump-xml", value_name = "FILE")]
    dump_xml: Option<PathBuf>,
    /// Hosts to model (trees and predictions across hosts like this one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    hosts: u32,
    /// Ranks per host (default: one per GPU, or 2 on a host without GPUs).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    ranks: Option<u32>,
    /// Measured link figures (JSON, see docs/topology.md).
    #[arg(long, value_name = "FILE", conflicts_with = "calibrate")]
    calibration: Option<PathBuf>,
    /// Fit the link figures from `weft perf --json` rows measured on this host.
    #[arg(long, value_name = "PERF_JSON")]
    calibrate: Option<PathBuf>,
    /// Write the link figures in use (from --calibrate or --calibration) to this file.
    #[arg(long = "save-calibration", value_name = "FILE")]
    save_calibration: Option<PathBuf>,
    /// Run as one rank of a job (under `weft run`, srun, torchrun, mpirun): every rank
    /// describes its host, rank 0 gathers them through the communicator and prints the job's
    /// hosts, ranks per host, the ring and trees across hosts and the tuner's choices.
    #[arg(long, conflicts_with_all = ["nvidia_smi", "xml", "calibrate", "save_calibration"])]
    job: bool,
}

/// What one rank of a job tells rank 0 about its host.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct RankHost {
    host_id: String,
    hostname: String,
    gpus: usize,
    nics: Vec<String>,
    shm_bytes: Option<u64>,
    /// The device communicator's path between each pair of the host's GPUs (the model's).
    #[serde(default)]
    gpu_paths: Vec<weftcc_topology::GpuPairPath>,
}

/// `weft topo --job`: gathers every rank's host description on rank 0 and prints the job's
/// topology and the tuner's predictions. Returns the text rank 0 prints (empty elsewhere).
fn job_report(args: &TopoArgs) -> Result<String, String> {
    use std::fmt::Write as _;
    use weftcc::collectives::schedule::hierarchical::HostLayout;
    use weftcc::{CommConfig, Communicator, Tuner};
    use weftcc_topology::tuner::Collective;

    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let config = CommConfig::from_env().map_err(|e| e.to_string())?;
    let d = discover();
    let me = RankHost {
        // The id the transports use (WEFT_HOST_ID, else hostname + boot id).
        host_id: config.host_id.clone(),
        hostname: d.topology.host.hostname.clone().unwrap_or_default(),
        gpus: d.topology.gpus.len(),
        nics: d
            .topology
            .nics
            .iter()
            .map(|n| match n.speed_gbit {
                Some(g) => format!("{} {g} Gbit/s", n.name),
                None => n.name.clone(),
            })
            .collect(),
        shm_bytes: d.topology.shm_bytes,
        gpu_paths: d
            .topology
            .gpu_pair_paths(&weftcc_topology::LinkSpeeds::default()),
    };
    let mine = serde_json::to_vec(&me).map_err(|e| e.to_string())?;
    // Lengths first, then every description padded to the longest.
    let n = comm.size();
    let mut lens = vec![0u64; n];
    comm.all_gather(&[mine.len() as u64], &mut lens)
        .map_err(|e| e.to_string())?;
    let width = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = mine.clone();
    padded.resize(width, 0);
    let mut all = vec![0u8; width * n];
    comm.all_gather(&padded, &mut all)
        .map_err(|e| e.to_string())?;
    if comm.rank() != 0 {
        return Ok(String::new());
    }
    let mut ranks: Vec<RankHost> = Vec::with_capacity(n);
    for (r, len) in lens.iter().enumerate() {
        let bytes = &all[r * width..r * width + *len as usize];
        ranks.push(
            serde_json::from_slice(bytes)
                .map_err(|e| format!("rank {r} sent a bad host description: {e}"))?,
        );
    }
    let layout = HostLayout::from_labels(&ranks.iter().map(|r| &r.host_id).collect::<Vec<_>>());
    let mut out = String::new();
    let _ = writeln!(out, "job: {n} ranks on {} host(s)", layout.hosts());
    for h in 0..layout.hosts() {
        let members = layout.members(h);
        let first = &ranks[members[0]];
        let list: Vec<String> = members.iter().map(|r| r.to_string()).collect();
        let _ = writeln!(
            out,
            "host {h}: {} ({})  ranks {}  ({} rank(s))  gpus {}  nics [{}]  /dev/shm {}",
            first.hostname,
            first.host_id,
            list.join(","),
            members.len(),
            first.gpus,
            first.nics.join(", "),
            first
                .shm_bytes
                .map_or("unknown".to_string(), |b| format!("{} MiB", b >> 20))
        );
        // The GPUs this host's ranks use with `--device cuda` (local rank mod GPUs) and the
        // device communicator's path between them.
        let used = members.len().min(first.gpus);
        for p in first.gpu_paths.iter().filter(|p| p.b < used) {
            let _ = writeln!(
                out,
                "host {h}: GPU{} <-> GPU{}: {} (predicted by the model)",
                p.a,
                p.b,
                p.describe()
            );
        }
    }
    let ring: Vec<String> = (0..layout.hosts())
        .flat_map(|h| layout.members(h).iter().map(|r| r.to_string()))
        .collect();
    let _ = writeln!(
        out,
        "ring across hosts: {} > {}  (each host's ranks in a row, one network hop per host)",
        ring.join(" > "),
        ring.first().cloned().unwrap_or_default()
    );
    let trees = weftcc_topology::search::double_binary_tree(layout.hosts());
    for (t, tree) in trees.iter().enumerate() {
        let edges: Vec<String> = tree
            .parent
            .iter()
            .enumerate()
            .filter_map(|(c, p)| p.map(|p| format!("{c}->{p}")))
            .collect();
        let _ = writeln!(
            out,
            "tree {t} across hosts: root host {}, edges (child->parent) {}",
            tree.root,
            if edges.is_empty() {
                "none".to_string()
            } else {
                edges.join(" ")
            }
        );
    }
    let tuner = Tuner::new(
        layout.clone(),
        !config.shm_disable,
        config.algo.clone(),
        config.calibration.as_ref(),
    );
    let _ = writeln!(
        out,
        "predicted by the tuner's model, not measured (intra-host {} GB/s, {} us/hop; network {} GB/s, {} us/hop; reduce {} GB/s):",
        tuner.model().input.intra_gbps,
        tuner.model().input.intra_lat_us,
        tuner.model().input.net_gbps,
        tuner.model().input.net_lat_us,
        tuner.model().input.reduce_gbps,
    );
    let _ = writeln!(
        out,
        "  {:<14} {:>9}  {:<5} {:>11} {:>11}",
        "collective", "size", "algo", "time(us)", "busbw(GB/s)"
    );
    for coll in Collective::ALL {
        for bytes in [8u64, 64 << 10, 1 << 20, 16 << 20, 256 << 20] {
            let (choice, pred) = tuner.predict(coll, bytes);
            let (t, bw) = pred.map_or((f64::NAN, f64::NAN), |p| (p.time_us, p.busbw_gbps));
            let _ = writeln!(
                out,
                "  {:<14} {:>9}  {:<5} {:>11.1} {:>11.2}",
                coll.name(),
                human(bytes),
                choice.name(),
                t,
                bw
            );
        }
    }
    let _ = args;
    Ok(out)
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn read_input(p: &Path) -> Result<String, String> {
    if p.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| format!("stdin: {e}"))?;
        return Ok(s);
    }
    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))
}

fn load(args: &TopoArgs) -> Result<(Topology, Vec<String>), String> {
    if let Some(p) = &args.nvidia_smi {
        let t = nvsmi::parse(&read_input(p)?).map_err(|e| format!("{}: {e}", p.display()))?;
        return Ok((t, Vec::new()));
    }
    if let Some(p) = &args.xml {
        let t = xml::read(&read_input(p)?).map_err(|e| format!("{}: {e}", p.display()))?;
        return Ok((t, Vec::new()));
    }
    let d = discover();
    Ok((d.topology, d.notes))
}

fn run(args: TopoArgs) -> Result<(), String> {
    if args.job {
        print!("{}", job_report(&args)?);
        return Ok(());
    }
    let (topo, notes) = load(&args)?;
    let mut opts = ReportOptions {
        nhosts: args.hosts as usize,
        ranks_per_host: args.ranks.map(|r| r as usize),
        algos: Selection::from_setting(&weftcc::settings::ALGO).map_err(|e| e.to_string())?,
        protos: Selection::from_setting(&weftcc::settings::PROTO).map_err(|e| e.to_string())?,
        gdr_level: weftcc_topology::netpath::gdr_level_from_env().map_err(|e| e.to_string())?,
        ..ReportOptions::default()
    };
    if let Some(bytes) = weftcc::settings::BUFFSIZE
        .size()
        .map_err(|e| e.to_string())?
    {
        opts.buffsize = Some(bytes as u64);
    }
    if let Some(p) = &args.calibration {
        opts.calibration = Some(
            Calibration::from_json(&read_input(p)?).map_err(|e| format!("{}: {e}", p.display()))?,
        );
    }
    if let Some(p) = &args.calibrate {
        let rows =
            Calibration::perf_rows(&read_input(p)?).map_err(|e| format!("{}: {e}", p.display()))?;
        opts.calibration =
            Some(Calibration::fit_intra(&rows).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    if let Some(p) = &args.save_calibration {
        let cal = opts
            .calibration
            .as_ref()
            .ok_or("--save-calibration needs --calibrate or --calibration")?;
        std::fs::write(p, cal.to_json() + "\n").map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let mut report = build(&topo, &opts);
    if topo.gpus.is_empty() {
        tuners_predictions(&mut report, &opts)?;
    }
    let out = match args.format {
        Format::Text => {
            let mut s = render_text(&report);
            for n in &notes {
                s.push_str(&format!("note: {n}\n"));
            }
            s
        }
        Format::Json => render_json(&report) + "\n",
        Format::Dot => render_dot(&report),
    };
    print!("{out}");
    if let Some(p) = &args.svg {
        std::fs::write(p, render_svg(&report)).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = &args.dump_xml {
        std::fs::write(p, xml::write(&topo)).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

/// CPU ranks: the predictions are the communicator's own (`Tuner`: its model figures, the
/// algorithms it implements for each collective and size, `WEFT_ALGO`, `WEFT_CALIBRATION`), with
/// the one bulk protocol of the CPU transports (`Simple`), for the hosts and ranks modelled.
fn tuners_predictions(
    report: &mut weftcc_topology::report::Report,
    opts: &ReportOptions,
) -> Result<(), String> {
    use weftcc::collectives::schedule::hierarchical::HostLayout;
    use weftcc_topology::report::PredictionRow;
    use weftcc_topology::tuner::Collective;
    let rph = report.ranks_per_host;
    let labels: Vec<usize> = (0..report.nhosts * rph).map(|r| r / rph).collect();
    let shm = !weftcc::settings::SHM_DISABLE
        .flag()
        .map_err(|e| e.to_string())?;
    let tuner = weftcc::Tuner::new(
        HostLayout::from_labels(&labels),
        shm,
        opts.algos.clone(),
        opts.calibration.as_ref(),
    );
    report.model = tuner.model().input.clone();
    report.predictions = Collective::ALL
        .into_iter()
        .flat_map(|c| opts.sizes.iter().map(move |&bytes| (c, bytes)))
        .filter_map(|(collective, bytes)| {
            let p = tuner.predict(collective, bytes).1?;
            Some(PredictionRow {
                collective,
                bytes,
                algo: p.algo,
                proto: p.proto,
                time_us: p.time_us,
                busbw_gbps: p.busbw_gbps,
            })
        })
        .collect();
    Ok(())
}

/// Entry point: 0 on success, 1 on error (message on stderr).
pub fn main(args: TopoArgs) -> i32 {
    let this_machine =
        args.nvidia_smi.is_none() && args.xml.is_none() && args.format == Format::Text;
    match run(args) {
        Ok(()) => {
            if this_machine {
                cuda_p2p_section();
            }
            0
        }
        Err(e) => {
            eprintln!("weft topo: {e}");
            1
        }
    }
}

/// When a CUDA driver is present, the driver's own peer-to-peer view (access, NVLink hint,
/// performance rank) after the report; nothing without a driver.
fn cuda_p2p_section() {
    if !weftcc_cuda::driver_present() {
        return;
    }
    match weftcc_cuda::p2p_report() {
        Ok(m) => print!("\nCUDA driver P2P matrix (NVL: peer access with native atomics, PCI: peer access, SYS: none)\n{m}"),
        Err(e) => eprintln!("weft topo: CUDA driver P2P query failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> Vec<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("topology/tests/fixtures");
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .collect();
        v.sort();
        v
    }

    fn args(nvidia_smi: Option<PathBuf>, xml: Option<PathBuf>, format: Format) -> TopoArgs {
        TopoArgs {
            nvidia_smi,
            xml,
            format,
            svg: None,
            dump_xml: None,
            hosts: 2,
            ranks: None,
            calibration: None,
            calibrate: None,
            save_calibration: None,
            job: false,
        }
    }

    #[test]
    fn every_fixture_in_every_format_and_back_through_xml() {
        let tmp = std::env::temp_dir().join(format!("weft-topo-cli-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        for f in fixtures() {
            for format in [Format::Text, Format::Json, Format::Dot] {
                let mut a = args(Some(f.clone()), None, format);
                a.svg = Some(tmp.join("t.svg"));
                a.dump_xml = Some(tmp.join("t.xml"));
                run(a).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            }
            let svg = std::fs::read_to_string(tmp.join("t.svg")).unwrap();
            assert!(svg.starts_with("<svg"));
            run(args(None, Some(tmp.join("t.xml")), Format::Text)).unwrap();
        }
        let _ = std::fs::remove_dir_all(&tmp);
    }

    #[test]
    fn errors_are_reported_not_panics() {
        let e = run(args(Some("/nonexistent/file".into()), None, Format::Text)).unwrap_err();
        assert!(e.contains("/nonexistent/file"));
        let bad = std::env::temp_dir().join(format!("weft-topo-bad-{}", std::process::id()));
        std::fs::write(&bad, "GPU0 GPU1\nGPU0 X NV1\n").unwrap();
        let e = run(args(Some(bad.clone()), None, Format::Text)).unwrap_err();
        assert!(e.contains("missing row for GPU1"), "{e}");
        let e = run(args(None, Some(bad.clone()), Format::Json)).unwrap_err();
        assert!(e.contains("NCCL topology XML"), "{e}");
        let _ = std::fs::remove_file(&bad);
    }

    /// Issue 42: for CPU ranks `weft topo` showed its own model (8 GB/s for 1 MiB all-reduce)
    /// and an LL128 column; it now shows the tuner's choices and figures, protocol Simple.
    #[test]
    fn cpu_predictions_are_the_tuners_own_with_the_protocol_the_transports_use() {
        use weftcc::collectives::schedule::hierarchical::HostLayout;
        use weftcc_topology::report::render_text;
        use weftcc_topology::tuner::Protocol;
        let opts = ReportOptions {
            nhosts: 2,
            ranks_per_host: Some(4),
            ..ReportOptions::default()
        };
        let mut report = build(&Topology::default(), &opts);
        tuners_predictions(&mut report, &opts).unwrap();
        let tuner = weftcc::Tuner::new(
            HostLayout::from_labels(&[0, 0, 0, 0, 1, 1, 1, 1]),
            true,
            Selection::default(),
            None,
        );
        assert_eq!(report.model, tuner.model().input);
        assert_eq!(report.predictions.len(), 5 * opts.sizes.len());
        for row in &report.predictions {
            let (algo, p) = tuner.predict(row.collective, row.bytes);
            assert_eq!((row.algo, row.proto), (algo, Protocol::Simple), "{row:?}");
            assert_eq!(Some(row.time_us), p.map(|p| p.time_us), "{row:?}");
        }
        let text = render_text(&report);
        assert!(
            !text.contains("LL") && text.contains("not measured"),
            "{text}"
        );
    }

    #[test]
    fn this_machine() {
        run(args(None, None, Format::Json)).unwrap();
    }
}
