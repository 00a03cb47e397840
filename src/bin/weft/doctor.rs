//! `weft doctor`: run as every rank of a job (under `weft run`, srun, torchrun or mpirun), it
//! measures every pair of ranks ([`weftcc::comm::doctor`], the same check `WEFT_RUN_DIAGNOSTICS`
//! runs at set-up) and prints the report (`--json`, `--svg` heat map). Every rank computes the
//! same verdict from the same gathered figures, so every rank exits alike (`--fail-below`).

use crate::perf::DeviceKind;
use clap::Args;
use std::path::PathBuf;
use weftcc::comm::doctor::{diagnose, Options, Report};
use weftcc::Communicator;

mod cuda;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Bytes of each pair's bandwidth message, each way.
    #[arg(long, default_value = "4M", value_parser = crate::perf::spec::parse_size)]
    bytes: u64,
    /// Round trips of each pair's latency measurement (the median is reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pings: u64,
    /// A pair below this percentage of the job's typical pair of its kind is an outlier.
    #[arg(long, default_value_t = 50.0)]
    outlier_below: f64,
    /// Exit 1 (on every rank) when a pair is below this percentage of the typical pair.
    #[arg(long)]
    fail_below: Option<f64>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Write a rank×rank heat map of the bandwidth (% of the typical pair) to this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// The buffers the pairs are measured with: `host` memory over the host transports, or
    /// `cuda` device memory over the device communicator (CUDA IPC or staged; one GPU per local
    /// rank), compared with the topology's NVLink/PCIe rates.
    #[arg(long, value_enum, default_value = "host")]
    device: DeviceKind,
}

pub fn main(args: DoctorArgs) -> i32 {
    let options = Options {
        bytes: args.bytes.max(1) as usize,
        pings: args.pings,
        outlier_below: args.outlier_below,
    };
    if args.device == DeviceKind::Cuda {
        // Every rank fails alike before any communicator is made.
        if let Err(e) = weftcc_cuda::ensure_driver() {
            eprintln!("weft doctor: --device cuda: {e}");
            return 2;
        }
    }
    let report = Communicator::from_env()
        .map_err(|e| e.to_string())
        .and_then(|comm| {
            let rank0 = comm.rank() == 0;
            let report = match args.device {
                DeviceKind::Host => diagnose(&comm, &options).map_err(|e| e.to_string()),
                DeviceKind::Cuda => {
                    cuda::diagnose(comm, &options).map_err(|e| format!("--device cuda: {e}"))
                }
            }?;
            Ok((rank0, report))
        });
    match report {
        Ok((rank0, report)) => {
            if rank0 {
                print_report(&report, &args);
                if let Some(path) = &args.svg {
                    if let Err(e) = std::fs::write(path, svg(&report)) {
                        eprintln!("weft doctor: {}: {e}", path.display());
                    }
                }
            }
            match args.fail_below {
                Some(pct) if report.worst_percent() < pct => 1,
                _ => 0,
            }
        }
        Err(e) => {
            eprintln!("weft doctor: {e}");
            2
        }
    }
}

fn print_report(r: &Report, args: &DoctorArgs) {
    if args.json {
        println!("{}", serde_json::to_string_pretty(r).unwrap_or_default());
        return;
    }
    println!(
        "weft doctor: {} ranks on {} host(s), {} pairs measured in {:.1} s",
        r.nranks,
        {
            let mut h = r.hosts.clone();
            h.sort();
            h.dedup();
            h.len()
        },
        r.pairs.len(),
        r.seconds
    );
    println!("limits measured here (GB/s): rank host memcpy tcp-loopback nic");
    for (rank, (l, h)) in r.limits.iter().zip(&r.hosts).enumerate() {
        println!(
            "  {rank:>4} {h} {:.2} {:.2} {}",
            l.memcpy_gbps,
            l.tcp_loopback_gbps,
            if l.nic_gbps.is_finite() {
                format!("{:.2}", l.nic_gbps)
            } else {
                "unknown".into()
            }
        );
    }
    println!(
        "{:>5} {:>5} {:>9} {:>10} {:>9} {:>10} {:>9} {:>9} {:>7}",
        "a", "b", "transport", "lat(us)", "GB/s", "pred GB/s", "pred(us)", "limit", "% typ"
    );
    for p in &r.pairs {
        println!(
            "{:>5} {:>5} {:>9} {:>10.1} {:>9.3} {:>10.2} {:>9.1} {:>9.2} {:>6.0}%{}",
            p.a,
            p.b,
            p.transport,
            p.latency_us,
            p.gbps,
            p.predicted_gbps,
            p.predicted_latency_us,
            p.limit_gbps,
            p.percent,
            if p.outlier { "  SLOW" } else { "" }
        );
    }
    for p in r.pairs.iter().filter(|p| p.outlier) {
        println!("{}", p.describe());
    }
    println!("verdict: {}", r.verdict);
}

/// A rank×rank heat map: each cell the pair's bandwidth as % of the typical pair.
fn svg(r: &Report) -> String {
    let (cell, margin) = (24usize, 40usize);
    let side = margin + cell * r.nranks + 10;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{side}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"10\">\n",
        side + 20
    );
    for p in &r.pairs {
        let pct = p.percent.clamp(0.0, 100.0);
        let (red, green) = (
            (255.0 * (1.0 - pct / 100.0)) as u8,
            (200.0 * pct / 100.0) as u8,
        );
        for (x, y) in [(p.a, p.b), (p.b, p.a)] {
            out += &format!(
                "<rect x=\"{}\" y=\"{}\" width=\"{cell}\" height=\"{cell}\" fill=\"rgb({red},{green},60)\"><title>rank {} ↔ rank {}: {:.3} GB/s, {:.0} %</title></rect>\n",
                margin + x * cell,
                margin + y * cell,
                p.a,
                p.b,
                p.gbps,
                p.percent
            );
        }
    }
    for i in 0..r.nranks {
        out += &format!(
            "<text x=\"{}\" y=\"{}\">{i}</text><text x=\"4\" y=\"{}\">{i}</text>\n",
            margin + i * cell + 6,
            margin - 6,
            margin + i * cell + 16
        );
    }
    out += &format!(
        "<text x=\"4\" y=\"{}\">{}</text>\n</svg>\n",
        side + 14,
        r.verdict.replace('&', "&amp;").replace('<', "&lt;")
    );
    out
}
