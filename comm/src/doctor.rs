//! The doctor's measurement: every pair of ranks over the transport the job uses between them
//! (latency of small round trips, bandwidth of one large message each way), next to the tuner's
//! prediction for that path and the limits measured on the spot (memcpy, TCP loopback, the NIC's
//! rate from sysfs); the pairs far below what the job's other pairs of the same kind achieve, the
//! host whose link every such pair crosses, and a verdict. Every rank computes the same report
//! from the same gathered figures. `weft doctor` prints it; `WEFT_RUN_DIAGNOSTICS` runs it when a
//! communicator is made ([`at_init`]).

use crate::tuning::model_input;
use crate::{Communicator, Error, Result};
use serde::Serialize;
use std::time::{Duration, Instant};
use weftcc_collectives::reduce::{divide_in_place, reduce_in_place};
use weftcc_collectives::schedule::hierarchical::HostLayout;
use weftcc_collectives::{DataType, ReduceOp};

/// What to measure and what counts as slow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Bytes of each pair's bandwidth message, each way.
    pub bytes: usize,
    /// Round trips of each pair's latency measurement (the median is reported).
    pub pings: u64,
    /// A pair below this percentage of the job's typical pair of its kind is an outlier.
    pub outlier_below: f64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            bytes: 4 << 20,
            pings: 20,
            outlier_below: 50.0,
        }
    }
}

/// One pair's figures and what they are measured against.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pair {
    pub a: usize,
    pub b: usize,
    pub transport: String,
    pub same_host: bool,
    /// One-way latency (half the median round trip), µs.
    pub latency_us: f64,
    /// The slower direction's bandwidth, GB/s.
    pub gbps: f64,
    pub gbps_a_to_b: f64,
    pub gbps_b_to_a: f64,
    /// The tuner's prediction for this path (the model the library chooses with), GB/s and µs.
    pub predicted_gbps: f64,
    pub predicted_latency_us: f64,
    /// The physical limit measured on the spot for this path, GB/s (NaN: unknown).
    pub limit_gbps: f64,
    /// `gbps` as a percentage of the job's typical pair of the same kind (the median).
    pub percent: f64,
    pub outlier: bool,
    /// The host whose link this outlier crosses, when one host is in every outlier pair.
    pub bottleneck: Option<String>,
}

/// What one rank measured of its host.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct HostLimits {
    pub memcpy_gbps: f64,
    pub tcp_loopback_gbps: f64,
    /// The chosen interface's rate from sysfs (NaN: not known, e.g. a veth's -1).
    pub nic_gbps: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub nranks: usize,
    pub hosts: Vec<String>,
    pub limits: Vec<HostLimits>,
    pub pairs: Vec<Pair>,
    /// Hosts whose link every outlier pair crosses.
    pub bottleneck_hosts: Vec<String>,
    pub verdict: String,
    pub seconds: f64,
}

impl Report {
    /// The lowest pair's percentage of the typical pair of its kind (infinity: no pair).
    pub fn worst_percent(&self) -> f64 {
        self.pairs
            .iter()
            .map(|p| p.percent)
            .fold(f64::INFINITY, f64::min)
    }
}

/// `WEFT_RUN_DIAGNOSTICS` at set-up: off (`0`, the default), `1` (measure, rank 0 logs the
/// verdict at target `weftcc::doctor` and prints it on stderr), or `FAIL` (and the communicator
/// is not made, on every rank alike, when a pair is below `WEFT_DIAGNOSTICS_BELOW` %). Both
/// settings must agree across ranks (checked before this runs). Messages of 1 MiB keep 64 ranks
/// well under 10 s; every step is bounded by the communicator's timeout.
pub(crate) fn at_init(comm: &Communicator) -> Result<()> {
    let fail = match weftcc_settings::RUN_DIAGNOSTICS.choice()? {
        None | Some("0") => return Ok(()),
        Some(word) => word == "FAIL",
    };
    let below = weftcc_settings::DIAGNOSTICS_BELOW.number()?.unwrap_or(50) as f64;
    let options = Options {
        bytes: 1 << 20,
        pings: 10,
        outlier_below: below,
    };
    let report = diagnose(comm, &options)?;
    if comm.rank() == 0 {
        let summary = format!(
            "weft diagnostics: {} ranks, {} pairs in {:.1} s: {}",
            report.nranks,
            report.pairs.len(),
            report.seconds,
            report.verdict
        );
        tracing::info!(target: "weftcc::doctor", report = %serde_json::to_string(&report).unwrap_or_default(), "{summary}");
        eprintln!("{summary}");
        for p in report.pairs.iter().filter(|p| p.outlier) {
            eprintln!("weft diagnostics: {}", p.describe());
        }
    }
    let worst = report
        .pairs
        .iter()
        .min_by(|x, y| x.percent.total_cmp(&y.percent));
    match worst {
        Some(p) if fail && p.percent < below => Err(Error::Diagnostics {
            rank: comm.rank(),
            a: p.a,
            b: p.b,
            percent: p.percent,
            below,
            verdict: report.verdict.clone(),
        }),
        _ => Ok(()),
    }
}

impl Pair {
    /// One line for a slow pair: "rank 3 ↔ rank 7 over TCP: 0.410 GB/s, predicted 2.90, limit
    /// 3.10 — 13 % of the typical pair (crosses host h2's link)".
    pub fn describe(&self) -> String {
        format!(
            "rank {} ↔ rank {} over {}: {:.3} GB/s, predicted {:.2}, limit {:.2} — {:.0} % of the typical pair{}",
            self.a,
            self.b,
            self.transport.to_uppercase(),
            self.gbps,
            self.predicted_gbps,
            self.limit_gbps,
            self.percent,
            self.bottleneck
                .as_ref()
                .map(|h| format!(" (crosses host {h}'s link)"))
                .unwrap_or_default()
        )
    }
}

/// Host labels travel in fixed-size slots.
const LABEL: usize = 64;
/// Per peer: latency µs, bandwidth to it, bandwidth from it (GB/s), transport code, the host
/// communicator's transport code, and the path's own limit, predicted GB/s and µs (NaN: none).
const PER_PEER: usize = 8;
/// The transports a report names: the host communicator's, then the device communicator's.
const TRANSPORTS: [&str; 6] = ["self", "shm", "tcp", "net", "cuda-ipc", "staged"];

/// A path's own figures for a pair, as one rank sees its side (the topology's rate for a GPU
/// path). Where a path has none, the host's limits and the communicator's model apply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathModel {
    /// The physical limit of the path, GB/s.
    pub limit_gbps: f64,
    /// The model's bandwidth and latency for it, GB/s and µs.
    pub predicted_gbps: f64,
    pub predicted_latency_us: f64,
}

/// What the doctor measures pairs over: the messages of one pair, each complete when the call
/// returns. [`diagnose`] uses the host communicator's own path ([`HostPath`]); `weft doctor
/// --device cuda` the device communicator's, with device buffers. The protocol (round trips,
/// timed messages each way, acknowledgements) is [`diagnose_over`]'s.
pub trait PairPath {
    type Error: From<Error>;
    /// The transport to `peer`, one of `shm`, `tcp`, `net`, `cuda-ipc`, `staged`.
    fn transport(&self, peer: usize) -> Option<&'static str>;
    /// Sends the small (8 bytes) or the big message to `peer`.
    fn send(&mut self, peer: usize, big: bool) -> std::result::Result<(), Self::Error>;
    /// Receives the small or the big message from `peer`.
    fn recv(&mut self, peer: usize, big: bool) -> std::result::Result<(), Self::Error>;
    /// Bytes of the big message.
    fn big_bytes(&self) -> usize;
    /// The path's own figures to `peer`, where it has them.
    fn model(&self, peer: usize) -> Option<PathModel>;
}

/// The host communicator's path: its own transports, host buffers.
pub struct HostPath<'a> {
    comm: &'a Communicator,
    small: [u8; 8],
    big: Vec<u8>,
    sink: Vec<u8>,
}

impl<'a> HostPath<'a> {
    pub fn new(comm: &'a Communicator, bytes: usize) -> HostPath<'a> {
        HostPath {
            comm,
            small: [0; 8],
            big: vec![1; bytes.max(1)],
            sink: vec![0; bytes.max(1)],
        }
    }
}

impl PairPath for HostPath<'_> {
    type Error = Error;
    fn transport(&self, peer: usize) -> Option<&'static str> {
        self.comm.transport_to(peer)
    }
    fn send(&mut self, peer: usize, big: bool) -> Result<()> {
        let buf = if big { &self.big[..] } else { &self.small[..] };
        self.comm.send(buf, peer)
    }
    fn recv(&mut self, peer: usize, big: bool) -> Result<()> {
        let buf = if big {
            &mut self.sink[..]
        } else {
            &mut self.small[..]
        };
        self.comm.recv(buf, peer)
    }
    fn big_bytes(&self) -> usize {
        self.big.len()
    }
    fn model(&self, _: usize) -> Option<PathModel> {
        None
    }
}

/// Measures every pair of `comm`'s ranks over its own transports; collective (every rank calls
/// it, and every rank returns the same report).
pub fn diagnose(comm: &Communicator, options: &Options) -> Result<Report> {
    diagnose_over(comm, options, &mut HostPath::new(comm, options.bytes))
}

/// [`diagnose`] over `path` (`comm` gathers the figures and paces the rounds).
pub fn diagnose_over<P: PairPath>(
    comm: &Communicator,
    options: &Options,
    path: &mut P,
) -> std::result::Result<Report, P::Error> {
    let start = Instant::now();
    let (rank, n) = (comm.rank(), comm.size());

    // Who is where.
    let mut label = [0u8; LABEL];
    let id = weftcc_topology::host_id();
    let id = id.split(':').next().unwrap_or(&id).as_bytes();
    label[..id.len().min(LABEL)].copy_from_slice(&id[..id.len().min(LABEL)]);
    let mut labels = vec![0u8; LABEL * n];
    comm.all_gather(&label, &mut labels)?;
    let hosts: Vec<String> = labels
        .chunks(LABEL)
        .map(|c| {
            String::from_utf8_lossy(c)
                .trim_end_matches('\0')
                .to_string()
        })
        .collect();

    // Limits of this host, then every rank's.
    let mine = measure_limits();
    let mut limits = vec![0f64; 3 * n];
    comm.all_gather(
        &[mine.memcpy_gbps, mine.tcp_loopback_gbps, mine.nic_gbps],
        &mut limits,
    )?;
    let limits: Vec<HostLimits> = limits
        .chunks(3)
        .map(|c| HostLimits {
            memcpy_gbps: c[0],
            tcp_loopback_gbps: c[1],
            nic_gbps: c[2],
        })
        .collect();

    // Every pair, a round at a time: each rank meets one peer per round (a round-robin
    // tournament: n - 1 rounds for n even).
    let mut row = vec![0f64; PER_PEER * n];
    let slots = n + n % 2;
    let code = |t: Option<&str>| {
        t.and_then(|t| TRANSPORTS.iter().position(|&x| x == t))
            .unwrap_or(0) as f64
    };
    for round in 0..slots.saturating_sub(1) {
        let Some(peer) = partner(rank, round, slots).filter(|&p| p < n) else {
            comm.barrier()?;
            continue;
        };
        let figures = measure_pair(comm, path, peer, options.pings)?;
        let model = path.model(peer);
        let own = |f: fn(&PathModel) -> f64| model.as_ref().map_or(f64::NAN, f);
        row[PER_PEER * peer..PER_PEER * peer + PER_PEER].copy_from_slice(&[
            figures.0,
            figures.1,
            figures.2,
            code(path.transport(peer)),
            code(comm.transport_to(peer)),
            own(|m| m.limit_gbps),
            own(|m| m.predicted_gbps),
            own(|m| m.predicted_latency_us),
        ]);
        // Pairs of one round share the hosts' CPUs and links; the next round starts together.
        comm.barrier()?;
    }
    let mut matrix = vec![0f64; PER_PEER * n * n];
    comm.all_gather(&row, &mut matrix)?;
    // Every rank exits alike: no rank leaves before all have the figures.
    let mut done = [1u8];
    comm.all_reduce_in_place(&mut done, ReduceOp::Sum)?;

    let layout = HostLayout::from_labels(&hosts);
    let shm = !weftcc_settings::SHM_DISABLE.flag().map_err(Error::from)?;
    let model = model_input(&layout, shm, None);
    let mut pairs = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            let at = |r: usize, p: usize, k: usize| matrix[PER_PEER * (r * n + p) + k];
            let same_host = hosts[a] == hosts[b];
            let name = |k: usize| TRANSPORTS[at(a, b, k) as usize % TRANSPORTS.len()];
            let (transport, host_transport) = (name(3).to_string(), name(4));
            let (host_gbps, host_latency_us) = if same_host {
                (model.intra_gbps, model.intra_lat_us)
            } else {
                (model.net_gbps, model.net_lat_us)
            };
            // The path's own figures: the lower of its two sides' (NaN where it has none).
            let own = |k: usize| {
                [at(a, b, k), at(b, a, k)]
                    .into_iter()
                    .filter(|x| x.is_finite())
                    .fold(f64::NAN, f64::min)
            };
            let (la, lb) = (limits[a], limits[b]);
            let host_limit = match (host_transport, same_host) {
                ("shm", _) => la.memcpy_gbps.min(lb.memcpy_gbps),
                (_, true) => la.tcp_loopback_gbps.min(lb.tcp_loopback_gbps),
                (_, false) => [
                    la.tcp_loopback_gbps,
                    lb.tcp_loopback_gbps,
                    la.nic_gbps,
                    lb.nic_gbps,
                ]
                .into_iter()
                .filter(|x| x.is_finite())
                .fold(f64::INFINITY, f64::min),
            };
            // CUDA IPC runs on the GPUs' own link; any other path (staged included) also goes
            // through the host's.
            let (limit_gbps, predicted_gbps, predicted_latency_us) = if transport == "cuda-ipc" {
                (own(5), own(6), own(7))
            } else {
                (
                    own(5).min(host_limit),
                    own(6).min(host_gbps),
                    own(7).max(host_latency_us),
                )
            };
            pairs.push(Pair {
                a,
                b,
                transport,
                same_host,
                latency_us: at(a, b, 0),
                gbps: at(a, b, 1).min(at(a, b, 2)),
                gbps_a_to_b: at(a, b, 1),
                gbps_b_to_a: at(a, b, 2),
                predicted_gbps,
                predicted_latency_us,
                limit_gbps,
                percent: f64::NAN,
                outlier: false,
                bottleneck: None,
            });
        }
    }
    let bottleneck_hosts = judge(&mut pairs, &hosts, options.outlier_below);
    let outliers = pairs.iter().filter(|p| p.outlier).count();
    let verdict = if outliers == 0 {
        format!(
            "healthy: every pair within {}% of the typical pair of its kind",
            options.outlier_below
        )
    } else if bottleneck_hosts.is_empty() {
        format!("{outliers} slow pair(s), no single host's link in common")
    } else {
        format!(
            "{outliers} slow pair(s): bottleneck is the link of host {}",
            bottleneck_hosts.join(", ")
        )
    };
    Ok(Report {
        nranks: n,
        hosts,
        limits,
        pairs,
        bottleneck_hosts,
        verdict,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The peer of `rank` in `round` of a round-robin over `slots` (even) places: slot 0 stays, the
/// others rotate. `None` for no peer (never, with an even count).
fn partner(rank: usize, round: usize, slots: usize) -> Option<usize> {
    let m = slots.checked_sub(1).filter(|&m| m > 0)?;
    let r = round % m;
    if rank == 0 {
        return Some(r + 1);
    }
    // Circle place i holds rank (i + r) % m + 1; place 0 meets the fixed slot, place i place m - i.
    let place = (rank - 1 + m - r) % m;
    if place == 0 {
        return Some(0);
    }
    Some((m - place + r) % m + 1)
}

/// Large messages each way per pair; the fastest counts.
const BANDWIDTH_TRIES: usize = 3;

/// (one-way latency µs, GB/s from the lower rank to the higher, GB/s back), over `path`; the
/// two ranks swap their figures through `comm`.
fn measure_pair<P: PairPath>(
    comm: &Communicator,
    path: &mut P,
    peer: usize,
    pings: u64,
) -> std::result::Result<(f64, f64, f64), P::Error> {
    let first = comm.rank() < peer;
    let trip = |path: &mut P| -> std::result::Result<f64, P::Error> {
        let t = Instant::now();
        if first {
            path.send(peer, false)?;
            path.recv(peer, false)?;
        } else {
            path.recv(peer, false)?;
            path.send(peer, false)?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6)
    };
    trip(path)?; // connects
    let mut trips = (0..pings)
        .map(|_| trip(path))
        .collect::<std::result::Result<Vec<f64>, P::Error>>()?;
    trips.sort_by(f64::total_cmp);
    let latency_us = trips[trips.len() / 2] / 2.0;
    // One large message each way, timed by its sender until the receiver's acknowledgement.
    let bytes = path.big_bytes() as f64;
    let one_way = |path: &mut P, sending: bool| -> std::result::Result<f64, P::Error> {
        if sending {
            let t = Instant::now();
            path.send(peer, true)?;
            path.recv(peer, false)?;
            Ok(bytes / t.elapsed().as_secs_f64() / 1e9)
        } else {
            path.recv(peer, true)?;
            path.send(peer, false)?;
            Ok(0.0)
        }
    };
    // The best of a few: the pair's path, not a moment's contention from another pair.
    let (mut forward, mut back) = (0f64, 0f64);
    for _ in 0..BANDWIDTH_TRIES {
        forward = forward.max(one_way(path, first)?);
        back = back.max(one_way(path, !first)?);
    }
    // Each side knows its own direction: swap so both know both.
    let mine = [forward.max(back)];
    let mut theirs = [0f64];
    if first {
        comm.send(&mine, peer)?;
        comm.recv(&mut theirs, peer)?;
        Ok((latency_us, mine[0], theirs[0]))
    } else {
        comm.recv(&mut theirs, peer)?;
        comm.send(&mine, peer)?;
        Ok((latency_us, theirs[0], mine[0]))
    }
}

/// Marks each pair's percentage of the typical (median) pair of its kind (transport, same host
/// or not) and the outliers below `outlier_below` %; returns the hosts in every outlier pair
/// (whose link they all cross), naming them on each outlier.
pub fn judge(pairs: &mut [Pair], hosts: &[String], outlier_below: f64) -> Vec<String> {
    let kinds: Vec<(String, bool)> = pairs
        .iter()
        .map(|p| (p.transport.clone(), p.same_host))
        .collect();
    let typical: Vec<f64> = kinds
        .iter()
        .map(|k| {
            let mut of_kind: Vec<f64> = pairs
                .iter()
                .zip(&kinds)
                .filter(|(_, q)| *q == k)
                .map(|(p, _)| p.gbps)
                .collect();
            of_kind.sort_by(f64::total_cmp);
            of_kind[of_kind.len() / 2]
        })
        .collect();
    for (p, t) in pairs.iter_mut().zip(typical) {
        p.percent = if t > 0.0 { 100.0 * p.gbps / t } else { 100.0 };
        p.outlier = p.percent < outlier_below;
    }
    let outliers: Vec<&Pair> = pairs.iter().filter(|p| p.outlier).collect();
    if outliers.is_empty() {
        return Vec::new();
    }
    let mut common: Vec<String> = hosts.to_vec();
    common.sort();
    common.dedup();
    // A host is in a pair when one of its ranks is, and the pair leaves the host.
    common.retain(|h| {
        outliers
            .iter()
            .all(|p| !p.same_host && (&hosts[p.a] == h || &hosts[p.b] == h))
    });
    // Two ranks' hosts are both in a lone outlier pair: which link is slow is not known.
    if outliers.len() == 1 && common.len() > 1 {
        common.clear();
    }
    if common.len() == 1 {
        for p in pairs.iter_mut().filter(|p| p.outlier) {
            p.bottleneck = Some(common[0].clone());
        }
    }
    common
}

fn measure_limits() -> HostLimits {
    HostLimits {
        memcpy_gbps: memcpy_gbps(),
        tcp_loopback_gbps: tcp_loopback_gbps().unwrap_or(f64::NAN),
        nic_gbps: nic_gbps().unwrap_or(f64::NAN),
    }
}

const LIMIT_BYTES: usize = 32 << 20;

/// The best of three timed passes over `LIMIT_BYTES`, GB/s; a pass returns false where its
/// kernel refuses, and NaN comes back when every pass did.
fn best_of_three_gbps(mut pass: impl FnMut() -> bool) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            if pass() {
                LIMIT_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9
            } else {
                f64::NAN
            }
        })
        .fold(f64::NAN, f64::max)
}

/// Host memory: the best of a few copies of 32 MiB (read + write), GB/s copied.
pub fn memcpy_gbps() -> f64 {
    let src = vec![1u8; LIMIT_BYTES];
    let mut dst = vec![0u8; LIMIT_BYTES];
    best_of_three_gbps(|| {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        true
    })
}

/// This host's reduction kernel, the one the executor reduces received data with
/// (`weftcc_collectives::reduce::reduce_in_place`) on `dtype` with `op`: the best of a few
/// reductions of 32 MiB into 32 MiB (two reads and a write per element), GB/s of the destination
/// reduced. NaN where the kernel refuses (it takes any type the library has).
pub fn reduce_gbps(dtype: DataType, op: ReduceOp) -> f64 {
    let src = vec![0u8; LIMIT_BYTES];
    let mut dst = vec![0u8; LIMIT_BYTES];
    best_of_three_gbps(|| {
        let done = reduce_in_place(dtype, op.combiner(), &mut dst, std::hint::black_box(&src));
        std::hint::black_box(&dst);
        done.is_ok()
    })
}

/// This host's division kernel, the last step of `Avg` (`weftcc_collectives::reduce::
/// divide_in_place`) on `dtype`: the best of a few divisions of 32 MiB in place, GB/s divided.
pub fn divide_gbps(dtype: DataType) -> f64 {
    let mut buf = vec![0u8; LIMIT_BYTES];
    best_of_three_gbps(|| {
        let done = divide_in_place(dtype, std::hint::black_box(&mut buf), 3);
        std::hint::black_box(&buf);
        done.is_ok()
    })
}

/// TCP over this host's loopback: 32 MiB through one connection, GB/s.
fn tcp_loopback_gbps() -> Option<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
    let addr = listener.local_addr().ok()?;
    let reader = std::thread::spawn(move || -> Option<()> {
        let (mut s, _) = listener.accept().ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = LIMIT_BYTES;
        while left > 0 {
            let got = s.read(&mut buf).ok()?;
            if got == 0 {
                return None;
            }
            left -= got.min(left);
        }
        s.write_all(&[1]).ok()
    });
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let chunk = vec![1u8; 1 << 20];
    let t = Instant::now();
    for _ in 0..LIMIT_BYTES / chunk.len() {
        s.write_all(&chunk).ok()?;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).ok()?;
    let secs = t.elapsed().as_secs_f64();
    reader.join().ok()??;
    Some(LIMIT_BYTES as f64 / secs / 1e9)
}

/// The link between ranks over TCP: loopback on one host; across hosts the interface's rate
/// from sysfs, else loopback (GB/s; NaN when neither is known).
pub fn link_gbps(one_host: bool) -> f64 {
    let nic = if one_host { None } else { nic_gbps() };
    nic.or_else(tcp_loopback_gbps).unwrap_or(f64::NAN)
}

/// The rate of the interface TCP uses (`WEFT_SOCKET_IFNAME`'s choice), from sysfs, GB/s.
fn nic_gbps() -> Option<f64> {
    let ifname = weftcc_settings::SOCKET_IFNAME.value();
    let name = weftcc_transports::tcp::select_interface(ifname.as_deref(), None)
        .ok()?
        .name;
    let mbit: f64 = std::fs::read_to_string(format!("/sys/class/net/{name}/speed"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (mbit > 0.0).then_some(mbit / 8e3)
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommConfig;

    /// The host path under another name with figures of its own, as the CUDA path reports
    /// them: rank 2's pairs `staged`, the others `cuda-ipc`, each side a different limit.
    struct Renamed<'a>(HostPath<'a>, usize);

    impl PairPath for Renamed<'_> {
        type Error = Error;
        fn transport(&self, peer: usize) -> Option<&'static str> {
            Some(if self.1 == 2 || peer == 2 {
                "staged"
            } else {
                "cuda-ipc"
            })
        }
        fn send(&mut self, peer: usize, big: bool) -> Result<()> {
            self.0.send(peer, big)
        }
        fn recv(&mut self, peer: usize, big: bool) -> Result<()> {
            self.0.recv(peer, big)
        }
        fn big_bytes(&self) -> usize {
            self.0.big_bytes()
        }
        fn model(&self, _: usize) -> Option<PathModel> {
            Some(PathModel {
                limit_gbps: 1000.0 + self.1 as f64,
                predicted_gbps: 500.0 + self.1 as f64,
                predicted_latency_us: 0.5,
            })
        }
    }

    /// A path with figures of its own (a GPU path's topology rates): CUDA IPC pairs are held to
    /// the path's figures alone, the lower side's; a staged pair to the lower of the path's and
    /// the host path's, which it also crosses.
    #[test]
    fn a_gpu_paths_own_figures_are_its_limit_and_prediction() {
        let config = |_| CommConfig::from_env().expect("config");
        let options = Options {
            bytes: 64 << 10,
            pings: 3,
            outlier_below: 50.0,
        };
        let reports = crate::local::run_ranks(3, config, |rank, comm| {
            let mut path = Renamed(HostPath::new(&comm, options.bytes), rank);
            diagnose_over(&comm, &options, &mut path).expect("diagnosed")
        })
        .expect("ranks");
        let r = &reports[0];
        assert_eq!(r.pairs.len(), 3);
        let ipc = &r.pairs[0];
        assert_eq!((ipc.a, ipc.b, ipc.transport.as_str()), (0, 1, "cuda-ipc"));
        assert_eq!(ipc.limit_gbps, 1000.0);
        assert_eq!((ipc.predicted_gbps, ipc.predicted_latency_us), (500.0, 0.5));
        assert!(ipc.gbps > 0.0, "{ipc:?}");
        for staged in &r.pairs[1..] {
            assert_eq!(staged.transport, "staged", "{staged:?}");
            // The host path's limit: the memcpy over shared memory, the loopback over TCP.
            let (a, b) = (r.limits[staged.a], r.limits[staged.b]);
            let host = [
                a.memcpy_gbps.min(b.memcpy_gbps),
                a.tcp_loopback_gbps.min(b.tcp_loopback_gbps),
            ];
            assert!(host.contains(&staged.limit_gbps), "{staged:?} {host:?}");
            let model = model_input(&HostLayout::from_labels(&r.hosts), true, None);
            assert_eq!(staged.predicted_gbps, model.intra_gbps.min(500.0));
        }
        // Every rank computes the same report.
        assert_eq!(reports[1].pairs, r.pairs);
    }

    #[test]
    fn every_pair_meets_once_in_the_round_robin() {
        for n in [2usize, 3, 4, 5, 8, 64] {
            let slots = n + n % 2;
            let mut met = std::collections::HashSet::new();
            for round in 0..slots - 1 {
                for rank in 0..slots {
                    let p = partner(rank, round, slots).expect("a peer");
                    assert_eq!(partner(p, round, slots), Some(rank), "n {n} round {round}");
                    assert_ne!(p, rank);
                    if rank < n && p < n {
                        met.insert((rank.min(p), rank.max(p)));
                    }
                }
            }
            assert_eq!(met.len(), n * (n - 1) / 2, "n {n}");
        }
    }

    fn pair(a: usize, b: usize, gbps: f64, same_host: bool) -> Pair {
        Pair {
            a,
            b,
            transport: "tcp".into(),
            same_host,
            latency_us: 10.0,
            gbps,
            gbps_a_to_b: gbps,
            gbps_b_to_a: gbps,
            predicted_gbps: 1.0,
            predicted_latency_us: 1.0,
            limit_gbps: 1.0,
            percent: f64::NAN,
            outlier: false,
            bottleneck: None,
        }
    }

    #[test]
    fn the_host_in_every_slow_pair_is_the_bottleneck() {
        let hosts: Vec<String> = (0..4).map(|h| format!("h{h}")).collect();
        let mut pairs = Vec::new();
        for a in 0..4 {
            for b in a + 1..4 {
                let slow = a == 2 || b == 2;
                pairs.push(pair(a, b, if slow { 0.012 } else { 0.118 }, false));
            }
        }
        assert_eq!(judge(&mut pairs, &hosts, 50.0), ["h2"]);
        for p in &pairs {
            assert_eq!(p.outlier, p.a == 2 || p.b == 2, "{p:?}");
            assert_eq!(p.bottleneck.is_some(), p.outlier);
        }
        // All alike: nothing flagged.
        let mut even: Vec<Pair> = pairs.iter().map(|p| pair(p.a, p.b, 0.1, false)).collect();
        assert!(judge(&mut even, &hosts, 50.0).is_empty());
        assert!(even.iter().all(|p| !p.outlier && p.percent == 100.0));
    }
}
