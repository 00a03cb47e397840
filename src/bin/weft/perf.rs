//! `weft perf`: nccl-tests-compatible microbenchmarks of weftcc's collectives.
//!
//! The pure parts (size parsing and sweeps, per-collective counts and bus-bandwidth factors, the
//! validation patterns and their expected values, row formatting) live in [`spec`] with unit tests;
//! this module holds the command line and the driver that runs them on a communicator.

use std::borrow::Cow;
use std::io::Write;
use std::time::Instant;

use weftcc::collectives::with_element;
use weftcc::{Communicator, DataType, Element, Error, ReduceOp};

use crate::run::{CpuBind, Launch};

pub mod baseline;
pub mod plot;
pub mod spec;

pub(crate) mod cuda;

use spec::{Collective, Measured, Pattern};

const AFTER_HELP: &str = "\
Sizes accept K, M, G suffixes (binary: 1K = 1024). Without -i the sweep multiplies by -f (default
2); with -i it adds that many bytes. Started by `weft run`, srun or mpirun, every process is one
rank; started alone, weft perf launches --np local ranks of itself. Only rank 0 prints. -z is
accepted for compatibility (weftcc's calls are blocking). The exit code is 1 when any value was
wrong or an operation failed.";

/// Command-line arguments of `weft perf`.
#[derive(clap::Args, Debug, Clone)]
#[command(after_help = AFTER_HELP)]
pub struct PerfArgs {
    /// Collective to benchmark.
    #[arg(value_enum)]
    pub collective: Collective,
    /// Smallest size in bytes.
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = spec::parse_size)]
    pub min_bytes: u64,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "128M", value_parser = spec::parse_size)]
    pub max_bytes: u64,
    /// Multiply the size by this factor between rows (default 2, or 1 when -i is given).
    #[arg(short = 'f', long = "stepfactor")]
    pub step_factor: Option<u64>,
    /// Add this many bytes between rows instead of multiplying.
    #[arg(short = 'i', long = "stepbytes", value_parser = spec::parse_size)]
    pub step_bytes: Option<u64>,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: u64,
    /// Warm-up iterations per size.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        visible_alias = "warmup-iters",
        default_value_t = 5
    )]
    pub warmup: u64,
    /// Check results (0 or 1).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub check: u8,
    /// Reduction: sum, prod, min, max, avg or all.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Data type: int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16 or all.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub datatype: String,
    /// Root rank of broadcast and reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Time reported across ranks: 0 rank 0's, 1 average, 2 minimum, 3 maximum.
    #[arg(short = 'a', long = "average", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub average: u8,
    /// Blocking collectives (0 or 1); accepted for compatibility, weftcc's calls always block.
    #[arg(short = 'z', long = "blocking", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub blocking: u8,
    /// Ranks to launch when not started by a launcher.
    #[arg(long = "np", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub np: u32,
    /// Rank 0 writes the rows as a JSON array to this file.
    #[arg(long = "json", value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// Rank 0 draws busbw against size (log-scale x) as an SVG file.
    #[arg(long = "plot", value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
    /// Overlay a baseline on the plot: `weft baseline-json` output or a `weft perf --json` file
    /// (repeatable).
    #[arg(long = "baseline", value_name = "FILE", requires = "plot")]
    pub baseline: Vec<std::path::PathBuf>,
    /// Where the buffers live: `host` memory, or `cuda` device memory (one GPU per local rank).
    #[arg(long = "device", value_enum, default_value = "host")]
    pub device: DeviceKind,
    /// Per row, the limit measured in this run for that size (the latency floor, the
    /// bandwidth of the path: memcpy on one host, the link across hosts, and for reductions the
    /// host's reduction kernel on the row's type and operation), achieved/limit and the
    /// bounding resource (synchronisation, memory, link or CPU); also in `--json` (host buffers
    /// only).
    #[arg(long)]
    pub explain: bool,
}

/// Memory the benchmark's buffers live in.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host memory (the CPU transports).
    Host,
    /// CUDA device memory (weftcc-cuda).
    Cuda,
}

/// The parsed, validated options.
#[derive(Debug, Clone)]
struct Options {
    collective: Collective,
    min_bytes: u64,
    max_bytes: u64,
    sizes: Vec<u64>,
    step_text: String,
    dtypes: Vec<DataType>,
    ops: Vec<Option<ReduceOp>>,
    root: usize,
    iters: u64,
    warmup: u64,
    check: bool,
    average: u8,
    explain: bool,
}

fn options(args: &PerfArgs) -> Result<Options, String> {
    if args.min_bytes > args.max_bytes {
        return Err(format!(
            "-b {} is larger than -e {}",
            args.min_bytes, args.max_bytes
        ));
    }
    let (sizes, step_text) = spec::size_sweep(
        args.min_bytes,
        args.max_bytes,
        args.step_factor,
        args.step_bytes,
    )?;
    let dtypes = if args.datatype.eq_ignore_ascii_case("all") {
        DataType::ALL.to_vec()
    } else {
        vec![args
            .datatype
            .parse::<DataType>()
            .map_err(|e| e.to_string())?]
    };
    let ops = if !args.collective.reduces() {
        vec![None]
    } else if args.op.eq_ignore_ascii_case("all") {
        ReduceOp::ALL.iter().copied().map(Some).collect()
    } else {
        vec![Some(
            args.op.parse::<ReduceOp>().map_err(|e| e.to_string())?,
        )]
    };
    Ok(Options {
        collective: args.collective,
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        sizes,
        step_text,
        dtypes,
        ops,
        root: args.root,
        iters: args.iters,
        warmup: args.warmup,
        check: args.check == 1,
        average: args.average,
        explain: args.explain,
    })
}

use weftcc::comm::env::started_by_launcher;

/// Entry point of `weft perf`.
pub fn main(args: PerfArgs) -> i32 {
    let Ok(opts) = options(&args).map_err(|e| eprintln!("weft perf: {e}")) else {
        return 2;
    };
    let baselines = match args
        .baseline
        .iter()
        .map(|p| baseline::read(p))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(b) => b,
        Err(e) => {
            eprintln!("weft perf: {e}");
            return 2;
        }
    };
    if args.device == DeviceKind::Cuda {
        let outputs = Outputs {
            json: args.json.as_deref(),
            plot: args.plot.as_deref(),
            baselines: &baselines,
            limits: None,
        };
        return cuda::main(&args, &opts, &outputs);
    }
    if !started_by_launcher() {
        let np = args.np as usize;
        if let Err(e) = check_ranks(&opts, np) {
            say(&e);
            return 2;
        }
        return self_launch(np);
    }
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            say(&format!("cannot create the communicator: {e}"));
            return 1;
        }
    };
    if let Err(e) = check_ranks(&opts, comm.size()) {
        if comm.rank() == 0 {
            say(&e);
        }
        return 2;
    }
    let outputs = Outputs {
        json: args.json.as_deref(),
        plot: args.plot.as_deref(),
        baselines: &baselines,
        limits: None,
    };
    match bench(&comm, &opts, &outputs) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            say(&e.to_string());
            1
        }
    }
}

/// Prints `weft perf: {msg}` to stderr in one write, so messages of several ranks never mix.
fn say(msg: &str) {
    let _ = std::io::stderr().write_all(format!("weft perf: {msg}\n").as_bytes());
}

/// Checks the options that depend on the number of ranks.
fn check_ranks(opts: &Options, n: usize) -> Result<(), String> {
    if opts.collective == Collective::SendRecv && n < 2 {
        return Err("sendrecv needs at least 2 ranks".into());
    }
    if opts.collective.has_root() && opts.root >= n {
        return Err(format!("root {} is out of range for {n} ranks", opts.root));
    }
    Ok(())
}

/// Runs `np` copies of this very command as the ranks of a local job.
fn self_launch(np: usize) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("weft perf: cannot find my own executable to launch {np} ranks: {e}");
            return 1;
        }
    };
    // Each rank its own share of the CPUs by default, as `weft run` ([`CpuBind::Share`]):
    // unbound ranks were put on one CPU whenever another program kept the other busy (issue 44).
    let cpu_bind = weftcc::settings::CPU_BIND.parse(|v| {
        <CpuBind as clap::ValueEnum>::from_str(v, true).map_err(|_| "none, core or share")
    });
    let cpu_bind = match cpu_bind {
        Ok(b) => b.unwrap_or(CpuBind::Share),
        Err(e) => {
            eprintln!("weft perf: {e}");
            return 2;
        }
    };
    let launch = Launch {
        nproc_per_node: np,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        prefix: false,
        max_restarts: 0,
        elastic: None,
        cpu_bind,
        program: exe.into_os_string(),
        args: std::env::args_os().skip(1).collect(),
        label: "weft perf",
    };
    launch.run()
}

/// A perf failure: a library error, or a local problem (writing the JSON file).
#[derive(Debug, thiserror::Error)]
enum PerfError {
    #[error(transparent)]
    Comm(#[from] Error),
    #[error("{0}")]
    Other(String),
}

/// One row of results (rank 0's view).
#[derive(Debug, Clone)]
struct Row {
    size: u64,
    count: u64,
    dtype: DataType,
    op: Option<ReduceOp>,
    root: i64,
    nranks: usize,
    oop: Measured,
    ip: Measured,
}

/// One row of the `--json` file.
#[derive(serde::Serialize)]
struct JsonRow<'a> {
    collective: &'a str,
    size: u64,
    count: u64,
    #[serde(rename = "type")]
    dtype: &'a str,
    redop: &'a str,
    root: i64,
    nranks: usize,
    oop: JsonHalf,
    ip: JsonHalf,
    #[serde(skip_serializing_if = "Option::is_none")]
    explain: Option<Explained>,
}

/// What bounds a row (`--explain`): the limits measured in the same run, and which one the
/// row's size meets first.
#[derive(Debug, Clone)]
struct Limits {
    /// The slowest rank's memcpy (shared memory) or the path's link rate, GB/s.
    path_gbps: f64,
    /// `memory` (ranks on one host, shared memory) or `link` (TCP or a network between them).
    path: &'static str,
    /// Median barrier time: the synchronisation floor of any collective, µs.
    floor_us: f64,
    /// The slowest rank's reduction kernel per type and operation of the run (reduction
    /// collectives only), GB/s of the destination reduced.
    /// (The first operation of the run with each combination: `avg` reduces as `sum`.)
    reduce: Vec<(DataType, ReduceOp, f64)>,
    /// The slowest rank's division kernel per type, where the run has `avg` (its last step
    /// divides the result), GB/s divided.
    divide: Vec<(DataType, f64)>,
}

/// One row explained (out-of-place time).
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Explained {
    /// The bandwidth limit of the path, GB/s of bus bandwidth.
    limit_gbps: f64,
    /// The latency floor, µs.
    floor_us: f64,
    /// The reduction kernel on the row's type and operation (slowest rank), GB/s of the
    /// destination reduced; null for collectives that do not reduce.
    reduce_gbps: Option<f64>,
    /// `avg` rows: the division kernel on the row's type (slowest rank), GB/s divided.
    divide_gbps: Option<f64>,
    /// The least CPU time of this size: each rank reduces at least (n-1)/n of the buffer (the
    /// ring's share; a tree or a chain reduces more) at `reduce_gbps`, and an `avg` divides its
    /// result at `divide_gbps`, µs.
    reduce_us: Option<f64>,
    /// The time the limits allow for this size, the longest of: the floor, bytes × bus factor /
    /// path limit, and the reduction time, µs.
    limit_us: f64,
    /// limit_us / measured time (1: at the limit).
    achieved: f64,
    /// The limit that allows the least: `memory`, `link`, `CPU` (the reduction) or
    /// `synchronisation`.
    bound: &'static str,
}

impl Limits {
    /// Measured on every rank at once (as the collective runs): the slowest rank's figures.
    fn measure(comm: &Communicator, hosts: &[&str], opts: &Options) -> Result<Limits, Error> {
        let one_host = hosts.windows(2).all(|w| w[0] == w[1]);
        let shm = !weftcc::settings::SHM_DISABLE.flag().unwrap_or(false);
        let (path, mine) = if one_host && shm {
            ("memory", weftcc::comm::doctor::memcpy_gbps())
        } else {
            ("link", weftcc::comm::doctor::link_gbps(one_host))
        };
        // The reduction kernel on every type and operation of the run, measured after the
        // path so that the two do not share the memory bus on this rank.
        let mut kinds: Vec<(DataType, ReduceOp)> = Vec::new();
        if opts.collective.reduces() {
            for &dtype in &opts.dtypes {
                for &op in opts.ops.iter().flatten() {
                    let known = |&(d, o): &(DataType, ReduceOp)| {
                        d == dtype && o.combiner() == op.combiner()
                    };
                    if !kinds.iter().any(known) {
                        kinds.push((dtype, op));
                    }
                }
            }
        }
        let averages = opts.collective.reduces() && opts.ops.contains(&Some(ReduceOp::Avg));
        let divided: &[DataType] = if averages { &opts.dtypes } else { &[] };
        let mut gbps = vec![mine];
        gbps.extend(
            kinds
                .iter()
                .map(|&(dtype, op)| weftcc::comm::doctor::reduce_gbps(dtype, op)),
        );
        gbps.extend(
            divided
                .iter()
                .map(|&dtype| weftcc::comm::doctor::divide_gbps(dtype)),
        );
        comm.all_reduce_in_place(&mut gbps, ReduceOp::Min)?;
        let reduce = kinds
            .iter()
            .zip(&gbps[1..])
            .map(|(&(dtype, op), &g)| (dtype, op, g))
            .collect();
        let divide = divided
            .iter()
            .copied()
            .zip(gbps[1 + kinds.len()..].iter().copied())
            .collect();
        let mut barriers: Vec<f64> = (0..21)
            .map(|_| {
                let t = std::time::Instant::now();
                comm.barrier().map(|()| t.elapsed().as_secs_f64() * 1e6)
            })
            .collect::<Result<_, _>>()?;
        barriers.sort_by(f64::total_cmp);
        // Every rank takes rank 0's floor (the explanation is rank 0's).
        let mut floor = [barriers[barriers.len() / 2]];
        comm.broadcast_in_place(&mut floor, 0)?;
        Ok(Limits {
            path_gbps: gbps[0],
            path,
            floor_us: floor[0],
            reduce,
            divide,
        })
    }

    fn explain(&self, row: &Row, coll: Collective) -> Explained {
        let n = row.nranks as f64;
        let bus = row.size as f64 * coll.bus_factor(row.nranks as u64);
        let transfer_us = bus / (self.path_gbps * 1e3);
        let reduce_gbps = row.op.and_then(|op| {
            self.reduce
                .iter()
                .find(|(d, o, _)| *d == row.dtype && o.combiner() == op.combiner())
                .map(|(_, _, g)| *g)
        });
        let divide_gbps = (row.op == Some(ReduceOp::Avg))
            .then(|| self.divide.iter().find(|(d, _)| *d == row.dtype))
            .flatten()
            .map(|(_, g)| *g);
        // An `avg` divides its whole result: a reduce-scatter's is one rank's block.
        let divided = match coll {
            Collective::ReduceScatter => row.size as f64 / n,
            _ => row.size as f64,
        };
        let reduce_us = reduce_gbps.map(|g| {
            row.size as f64 * (n - 1.0) / n / (g * 1e3)
                + divide_gbps.map_or(0.0, |d| divided / (d * 1e3))
        });
        // The longest time is the lowest limit; on a tie the path, then the CPU, names it.
        let (limit_us, bound) = [
            (transfer_us, self.path),
            (reduce_us.unwrap_or(0.0), "CPU"),
            (self.floor_us, "synchronisation"),
        ]
        .into_iter()
        .fold(
            (0.0, self.path),
            |best, (t, what)| {
                if t > best.0 {
                    (t, what)
                } else {
                    best
                }
            },
        );
        Explained {
            limit_gbps: self.path_gbps,
            floor_us: self.floor_us,
            reduce_gbps,
            divide_gbps,
            reduce_us,
            limit_us,
            achieved: limit_us / row.oop.time_us,
            bound,
        }
    }
}

/// Out-of-place or in-place results of a `--json` row (`wrong` is null without checking).
#[derive(serde::Serialize)]
struct JsonHalf {
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: Option<u64>,
}

impl From<&Measured> for JsonHalf {
    fn from(m: &Measured) -> Self {
        JsonHalf {
            time_us: m.time_us,
            algbw: m.algbw,
            busbw: m.busbw,
            wrong: m.wrong,
        }
    }
}

impl Row {
    /// The row of one size from its aggregated times and (checked) wrong counts.
    #[allow(clippy::too_many_arguments)]
    fn new(
        coll: Collective,
        counts: spec::Counts,
        dtype: DataType,
        op: Option<ReduceOp>,
        root: usize,
        nranks: usize,
        times: [f64; 2],
        wrong: Option<[u64; 2]>,
    ) -> Row {
        let measured = |secs: f64, wrong: Option<u64>| {
            Measured::new(counts.bytes, secs, coll.bus_factor(nranks as u64), wrong)
        };
        Row {
            size: counts.bytes,
            count: counts.count,
            dtype,
            op,
            root: if coll.has_root() { root as i64 } else { -1 },
            nranks,
            oop: measured(times[0], wrong.map(|w| w[0])),
            ip: measured(times[1], wrong.map(|w| w[1])),
        }
    }

    fn json(&self, collective: Collective, limits: Option<&Limits>) -> JsonRow<'static> {
        JsonRow {
            collective: collective.name(),
            size: self.size,
            count: self.count,
            dtype: self.dtype.name(),
            redop: self.op.map_or("none", |o| o.name()),
            root: self.root,
            nranks: self.nranks,
            oop: (&self.oop).into(),
            ip: (&self.ip).into(),
            explain: limits.map(|l| l.explain(self, collective)),
        }
    }
}

/// Pid, local rank and host name of every rank, gathered to all (for the header).
fn gather_ranks(comm: &Communicator) -> Result<Vec<(u64, u64, String)>, Error> {
    const HOST: usize = 64;
    const REC: usize = 16 + HOST;
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into());
    let local = weftcc::LaunchInfo::from_env().map_or(comm.rank(), |i| i.local_rank) as u64;
    let mut mine = [0u8; REC];
    mine[..8].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    mine[8..16].copy_from_slice(&local.to_le_bytes());
    let h = host.as_bytes();
    let hl = h.len().min(HOST);
    mine[16..16 + hl].copy_from_slice(&h[..hl]);
    let mut all = vec![0u8; REC * comm.size()];
    comm.all_gather(&mine[..], &mut all[..])?;
    Ok(all
        .chunks(REC)
        .map(|r| {
            let pid = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
            let local = u64::from_le_bytes(r[8..16].try_into().expect("8 bytes"));
            let end = r[16..].iter().position(|&b| b == 0).unwrap_or(HOST);
            (
                pid,
                local,
                String::from_utf8_lossy(&r[16..16 + end]).into_owned(),
            )
        })
        .collect())
}

/// Files rank 0 writes after the sweep.
#[derive(Clone)]
struct Outputs<'a> {
    json: Option<&'a std::path::Path>,
    plot: Option<&'a std::path::Path>,
    baselines: &'a [baseline::Baseline],
    /// `--explain`'s limits, measured at the start of the run (host buffers only).
    limits: Option<Limits>,
}

/// The plot of a finished sweep: one curve per (type, op) and placement, then the baselines.
fn plot_svg(
    opts: &Options,
    nranks: usize,
    rows: &[Row],
    baselines: &[baseline::Baseline],
) -> String {
    let mut series: Vec<plot::Series> = Vec::new();
    for &dtype in &opts.dtypes {
        for &op in &opts.ops {
            let mine: Vec<&Row> = rows
                .iter()
                .filter(|r| r.dtype == dtype && r.op == op)
                .collect();
            let what = match op {
                Some(o) => format!("{} {}", dtype.name(), o.name()),
                None => dtype.name().to_string(),
            };
            for (place, pick) in [
                ("out-of-place", (|r: &Row| r.oop.busbw) as fn(&Row) -> f64),
                ("in-place", |r: &Row| r.ip.busbw),
            ] {
                series.push(plot::Series {
                    label: format!("weft {what}, {place}"),
                    points: mine.iter().map(|r| (r.size, pick(r))).collect(),
                    dashed: false,
                });
            }
        }
    }
    let mut limits = Vec::new();
    for b in baselines {
        let (curve, lims) = b.plot_parts();
        series.push(curve);
        limits.extend(lims);
    }
    let title = format!("weft perf {}, {nranks} ranks", opts.collective.name());
    plot::svg(&title, &series, &limits)
}

/// Prints one result row (rank 0).
fn print_row(out: &mut impl Write, row: &Row) {
    let line = spec::format_row(
        row.size,
        row.count,
        row.dtype.name(),
        row.op.map_or("none", |o| o.name()),
        row.root,
        &row.oop,
        &row.ip,
    );
    let _ = writeln!(out, "{line}").and_then(|_| out.flush());
}

/// Values found wrong over all rows.
fn wrong_values(rows: &[Row]) -> u64 {
    rows.iter()
        .map(|r| r.oop.wrong.unwrap_or(0) + r.ip.wrong.unwrap_or(0))
        .sum()
}

/// Rank 0's header: the title, the sweep's settings, a line per rank, the column names.
fn print_header(
    out: &mut impl Write,
    opts: &Options,
    title: String,
    rank_lines: impl Iterator<Item = String>,
) {
    let mut text = title;
    text += &format!(
        "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: 0\n#\n# Using devices\n",
        opts.min_bytes,
        opts.max_bytes,
        opts.step_text,
        opts.warmup,
        opts.iters,
        u8::from(opts.check),
    );
    for line in rank_lines {
        text += &line;
        text.push('\n');
    }
    text += "#\n";
    text += spec::COLUMN_HEADER;
    let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
}

/// Every (type, op, size) row of a sweep, measured by `row` (`None`: a combination the
/// collective skips); rank 0 prints each as it comes.
fn sweep<E>(
    opts: &Options,
    me: usize,
    out: &mut impl Write,
    mut row: impl FnMut(DataType, Option<ReduceOp>, u64) -> Result<Option<Row>, E>,
) -> Result<Vec<Row>, E> {
    let mut rows = Vec::new();
    for &dtype in &opts.dtypes {
        for &op in &opts.ops {
            for &size in &opts.sizes {
                let Some(row) = row(dtype, op, size)? else {
                    continue;
                };
                if me == 0 {
                    print_row(out, &row);
                }
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// Rank 0's end of a sweep: the footer, then the plot and the JSON rows when asked for.
fn finish(
    out: &mut impl Write,
    opts: &Options,
    nranks: usize,
    rows: &[Row],
    outputs: &Outputs<'_>,
) -> Result<(), PerfError> {
    let busbws: Vec<f64> = rows
        .iter()
        .flat_map(|r| [r.oop.busbw, r.ip.busbw])
        .collect();
    let avg = if busbws.is_empty() {
        0.0
    } else {
        busbws.iter().sum::<f64>() / busbws.len() as f64
    };
    let wrong = opts.check.then(|| wrong_values(rows));
    let _ = write!(out, "{}", spec::footer(wrong, avg));
    if let Some(limits) = &outputs.limits {
        let reduces = opts.collective.reduces();
        let reduce_note = if reduces {
            "; reduce: the reduction kernel on the row's type and operation, divide: avg's division, GB/s"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "# explain (out-of-place; limits measured in this run: {} {:.2} GB/s, barrier {:.1} us{reduce_note})\n#{:>11} {:>8} {:>6} {:>11} {:>11} {:>9} {:>7} {:>7}  bound",
            limits.path, limits.path_gbps, limits.floor_us, "size", "type", "redop", "time(us)", "limit(us)", "achieved", "reduce", "divide"
        );
        let figure = |g: Option<f64>| g.map_or("-".to_string(), |g| format!("{g:.2}"));
        for r in rows {
            let e = limits.explain(r, opts.collective);
            let reduce = figure(e.reduce_gbps);
            let divide = figure(e.divide_gbps);
            let _ = writeln!(
                out,
                "#{:>11} {:>8} {:>6} {:>11.1} {:>11.1} {:>8.0}% {:>7} {:>7}  {}",
                r.size,
                r.dtype.name(),
                r.op.map_or("none", |o| o.name()),
                r.oop.time_us,
                e.limit_us,
                100.0 * e.achieved,
                reduce,
                divide,
                e.bound
            );
        }
    }
    let _ = out.flush();
    if let Some(path) = outputs.plot {
        std::fs::write(path, plot_svg(opts, nranks, rows, outputs.baselines))
            .map_err(|e| PerfError::Other(format!("cannot write {}: {e}", path.display())))?;
    }
    if let Some(path) = outputs.json {
        let value: Vec<JsonRow> = rows
            .iter()
            .map(|r| r.json(opts.collective, outputs.limits.as_ref()))
            .collect();
        let text = serde_json::to_string_pretty(&value).expect("JSON of plain values");
        std::fs::write(path, text + "\n")
            .map_err(|e| PerfError::Other(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(())
}

/// Runs every (type, op, size) combination; returns Ok(false) when any value was wrong.
fn bench(comm: &Communicator, opts: &Options, outputs: &Outputs<'_>) -> Result<bool, PerfError> {
    let me = comm.rank();
    let n = comm.size();
    let ranks = gather_ranks(comm)?;
    let mut out = std::io::stdout().lock();
    if me == 0 {
        let title = format!(
            "# weft perf {}: weftcc {}, {n} ranks\n",
            opts.collective.name(),
            env!("CARGO_PKG_VERSION")
        );
        let lines = ranks
            .iter()
            .enumerate()
            .map(|(r, (pid, local, host))| spec::rank_line(r, *pid, host, *local));
        print_header(&mut out, opts, title, lines);
    }
    let hosts: Vec<&str> = ranks.iter().map(|(_, _, h)| h.as_str()).collect();
    let outputs = &Outputs {
        limits: if opts.explain {
            Some(Limits::measure(comm, &hosts, opts)?)
        } else {
            None
        },
        ..outputs.clone()
    };
    let rows = sweep(opts, me, &mut out, |dtype, op, size| {
        with_element!(dtype, |T| bench_size::<_, T>(comm, opts, op, size))
    })?;
    let wrong = wrong_values(&rows);
    if me == 0 {
        finish(&mut out, opts, n, &rows, outputs)?;
    }
    // Rank 0 has printed and written everything: only now may the other ranks exit (a launcher
    // stops the job when a rank exits non-zero, which they do when a value was wrong).
    comm.barrier()?;
    Ok(wrong == 0)
}

/// Where a benchmark's buffers live and how its calls run: host memory through the
/// `Communicator` here, device memory through the CUDA path (`perf/cuda.rs`). One
/// [`bench_size`] times and checks both.
trait Bench {
    type Buf<T: Element>;
    type Error: From<Error>;
    /// The host communicator: figures and counts of wrong values are combined through it.
    fn host(&self) -> &Communicator;
    /// A buffer holding `v`.
    fn buffer<T: Element>(&self, v: Vec<T>) -> Result<Self::Buf<T>, Self::Error>;
    /// Overwrites `b` with `v` (of its length).
    fn fill<T: Element>(&self, b: &mut Self::Buf<T>, v: &[T]) -> Result<(), Self::Error>;
    /// `b`'s contents once every call made so far has finished.
    fn read<'b, T: Element>(&self, b: &'b Self::Buf<T>) -> Result<Cow<'b, [T]>, Self::Error>;
    /// Waits for every call made so far (calls on the host finish before they return).
    fn settle(&self) -> Result<(), Self::Error>;
    /// The benchmarked collective out of place.
    fn run_oop<T: Element>(
        &self,
        p: &SizePlan,
        send: &Self::Buf<T>,
        recv: &mut Self::Buf<T>,
    ) -> Result<(), Self::Error>;
    /// The benchmarked collective in place.
    fn run_ip<T: Element>(&self, p: &SizePlan, buf: &mut Self::Buf<T>) -> Result<(), Self::Error>;
}

impl Bench for Communicator {
    type Buf<T: Element> = Vec<T>;
    type Error = Error;

    fn host(&self) -> &Communicator {
        self
    }

    fn buffer<T: Element>(&self, v: Vec<T>) -> Result<Vec<T>, Error> {
        Ok(v)
    }

    fn fill<T: Element>(&self, b: &mut Vec<T>, v: &[T]) -> Result<(), Error> {
        b.copy_from_slice(v);
        Ok(())
    }

    fn read<'b, T: Element>(&self, b: &'b Vec<T>) -> Result<Cow<'b, [T]>, Error> {
        Ok(Cow::Borrowed(b))
    }

    fn settle(&self) -> Result<(), Error> {
        Ok(())
    }

    fn run_oop<T: Element>(
        &self,
        p: &SizePlan,
        send: &Vec<T>,
        recv: &mut Vec<T>,
    ) -> Result<(), Error> {
        let (me, n, op, root) = (self.rank(), self.size(), p.rop, p.root);
        match p.coll {
            Collective::AllReduce => self.all_reduce(send, recv, op),
            Collective::Reduce => self.reduce(send, recv, op, root),
            Collective::Broadcast => self.broadcast(send, recv, root),
            Collective::AllGather => self.all_gather(send, recv),
            Collective::ReduceScatter => self.reduce_scatter(send, recv, op),
            Collective::AllToAll => self.all_to_all(send, recv),
            Collective::SendRecv => self
                .group()
                .send(&send[..], (me + 1) % n)
                .recv(&mut recv[..], (me + n - 1) % n)
                .run(),
        }
    }

    /// Send/recv has no in-place form that Rust's borrows allow (one buffer sent and received
    /// into at once), so its in-place variant sends the buffer's first half and receives into
    /// its second half.
    fn run_ip<T: Element>(&self, p: &SizePlan, buf: &mut Vec<T>) -> Result<(), Error> {
        let (me, n, op, root) = (self.rank(), self.size(), p.rop, p.root);
        match p.coll {
            Collective::AllReduce => self.all_reduce_in_place(buf, op),
            Collective::Reduce => self.reduce_in_place(buf, op, root),
            Collective::Broadcast => self.broadcast_in_place(buf, root),
            Collective::AllGather => self.all_gather_in_place(buf),
            Collective::ReduceScatter => self.reduce_scatter_in_place(buf, op),
            Collective::AllToAll => self.all_to_all_in_place(buf),
            Collective::SendRecv => {
                let half = buf.len() / 2;
                let (send, recv) = buf.split_at_mut(half);
                self.group()
                    .send(&*send, (me + 1) % n)
                    .recv(recv, (me + n - 1) % n)
                    .run()
            }
        }
    }
}

/// Seconds per call of `f`, timed like nccl-tests: `warmup` untimed calls, a barrier, then
/// `iters` calls and the wait for them to finish.
fn time_loop<B: Bench>(
    b: &B,
    warmup: u64,
    iters: u64,
    mut f: impl FnMut() -> Result<(), B::Error>,
) -> Result<f64, B::Error> {
    for _ in 0..warmup {
        f()?;
    }
    b.settle()?;
    b.host().barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    b.settle()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

/// What one size of one (type, op) combination runs and checks: the buffers' lengths and
/// contents and the expected results, shared by the host and the CUDA sweeps (which differ only
/// in where the buffers live).
struct SizePlan {
    coll: Collective,
    counts: spec::Counts,
    dtype: DataType,
    op: Option<ReduceOp>,
    /// The reduction the collective runs (sum where the collective does not reduce).
    rop: ReduceOp,
    root: usize,
    me: usize,
    n: usize,
    count: usize,
    send_len: usize,
    recv_len: usize,
    ip_len: usize,
    pattern: Pattern,
}

impl SizePlan {
    /// The plan of rank `me` of `n`; None when the size holds no element.
    fn new(
        opts: &Options,
        dtype: DataType,
        op: Option<ReduceOp>,
        size: u64,
        me: usize,
        n: usize,
    ) -> Option<SizePlan> {
        let coll = opts.collective;
        let counts = coll.counts(size, dtype.size() as u64, n as u64)?;
        let count = counts.count as usize;
        let (send_len, recv_len) = coll.buffer_lens(count, n);
        Some(SizePlan {
            coll,
            counts,
            dtype,
            op,
            rop: op.unwrap_or(ReduceOp::Sum),
            root: if coll.has_root() { opts.root } else { 0 },
            me,
            n,
            count,
            send_len,
            recv_len,
            ip_len: coll.in_place_len(count, n),
            pattern: Pattern::new(dtype, op, n),
        })
    }

    /// The first `len` elements of this rank's pattern.
    fn pattern_values<T: Element>(&self, len: usize) -> Vec<T> {
        (0..len)
            .map(|i| T::from_f64(self.pattern.value(self.me, i)))
            .collect()
    }

    /// The send buffer: this rank's pattern, never written.
    fn send<T: Element>(&self) -> Vec<T> {
        self.pattern_values(self.send_len)
    }

    /// The in-place buffer of the timed runs. A reduction's starts at zero so repeated
    /// reductions cannot overflow (0 is a fixed point of every reduction), which keeps integer
    /// and float arithmetic free of overflow and infinities.
    fn timed_in_place<T: Element>(&self) -> Vec<T> {
        if self.coll.reduces() {
            vec![T::from_f64(0.0); self.ip_len]
        } else {
            self.pattern_values(self.ip_len)
        }
    }

    fn expected(&self, j: usize) -> Option<f64> {
        let p = self;
        spec::expected(p.coll, &p.pattern, p.op, p.n, p.me, p.count, p.root, j)
    }

    /// The out-of-place receive buffer before the check: a value that differs from every
    /// expected element, so an element the collective forgot to write counts as wrong.
    fn sentinels<T: Element>(&self) -> Vec<T> {
        (0..self.recv_len)
            .map(|j| T::from_f64(spec::sentinel(self.expected(j))))
            .collect()
    }

    /// The in-place buffer before the check.
    fn in_place_inputs<T: Element>(&self) -> Vec<T> {
        let p = self;
        (0..p.ip_len)
            .map(|j| {
                T::from_f64(spec::in_place_input(
                    p.coll, &p.pattern, p.n, p.me, p.count, j,
                ))
            })
            .collect()
    }

    /// Wrong elements of an out-of-place result.
    fn oop_wrong<T: Element>(&self, recv: &[T]) -> u64 {
        self.count_wrong(recv)
    }

    /// Wrong elements of the part of an in-place buffer that holds the result.
    fn ip_wrong<T: Element>(&self, buf: &[T]) -> u64 {
        let (lo, hi) = self.coll.in_place_output(self.count, self.n, self.me);
        self.count_wrong(&buf[lo..hi])
    }

    /// Counts the elements of `out` that differ from what `expected(j)` says (None: unchecked).
    fn count_wrong<T: Element>(&self, out: &[T]) -> u64 {
        out.iter()
            .enumerate()
            .filter(|&(j, v)| match self.expected(j) {
                Some(e) => {
                    let tol = spec::tolerance(self.dtype, self.op, self.n, e);
                    !spec::matches(v.to_f64(), e, tol)
                }
                None => false,
            })
            .count() as u64
    }

    fn row(&self, times: [f64; 2], wrong: Option<[u64; 2]>) -> Row {
        let p = self;
        Row::new(p.coll, p.counts, p.dtype, p.op, p.root, p.n, times, wrong)
    }
}

/// Benchmarks one size of one (type, op) combination. None when the size holds no element.
fn bench_size<B: Bench, T: Element>(
    b: &B,
    opts: &Options,
    op: Option<ReduceOp>,
    size: u64,
) -> Result<Option<Row>, B::Error> {
    let host = b.host();
    let Some(p) = SizePlan::new(opts, T::DTYPE, op, size, host.rank(), host.size()) else {
        return Ok(None);
    };
    let send = b.buffer(p.send::<T>())?;
    let mut recv = b.buffer(vec![T::from_f64(0.0); p.recv_len])?;
    let oop_s = time_loop(b, opts.warmup, opts.iters, || {
        b.run_oop(&p, &send, &mut recv)
    })?;
    let mut buf = b.buffer(p.timed_in_place::<T>())?;
    let ip_s = time_loop(b, opts.warmup, opts.iters, || b.run_ip(&p, &mut buf))?;

    let times = aggregate_times(host, opts.average, [oop_s, ip_s])?;

    let wrong = if opts.check {
        b.fill(&mut recv, &p.sentinels::<T>())?;
        b.run_oop(&p, &send, &mut recv)?;
        let oop_wrong = p.oop_wrong(&b.read(&recv)?);
        b.fill(&mut buf, &p.in_place_inputs::<T>())?;
        b.run_ip(&p, &mut buf)?;
        let mut w = [oop_wrong, p.ip_wrong(&b.read(&buf)?)];
        host.all_reduce_in_place(&mut w[..], ReduceOp::Sum)?;
        Some(w)
    } else {
        None
    };
    Ok(Some(p.row(times, wrong)))
}

/// Combines every rank's (out-of-place, in-place) seconds as `-a` asks: 0 this rank's, 1 the
/// average, 2 the minimum, 3 the maximum.
fn aggregate_times(
    comm: &Communicator,
    average: u8,
    mut times: [f64; 2],
) -> Result<[f64; 2], Error> {
    match average {
        0 => {}
        1 => {
            comm.all_reduce_in_place(&mut times[..], ReduceOp::Sum)?;
            times.iter_mut().for_each(|t| *t /= comm.size() as f64);
        }
        2 => comm.all_reduce_in_place(&mut times[..], ReduceOp::Min)?,
        _ => comm.all_reduce_in_place(&mut times[..], ReduceOp::Max)?,
    }
    Ok(times)
}
