//! The α-β cost model: for each (algorithm, protocol) a predicted time
//! `latency + bytes / bandwidth` from the topology's link figures, the choice of the fastest per
//! call, calibration of link α/β from measurements, and the `WEFT_ALGO` / `WEFT_PROTO` override
//! syntax (`ring,tree`, `^tree`, `allreduce:tree;broadcast:ring`).

use crate::error::{Result, TopoError};
use crate::model::{LinkSpeeds, Topology};
use crate::search::RingPlan;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use weftcc_collectives::UnknownName;

/// A collective operation the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// Broadcast.
    Broadcast,
    /// Reduce.
    Reduce,
}

impl Collective {
    /// Every collective.
    pub const ALL: [Collective; 5] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
        Collective::Reduce,
    ];

    /// NCCL-style lower-case name (`allreduce`).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reducescatter",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
        }
    }

    /// nccl-tests bus-bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
            Collective::Broadcast | Collective::Reduce => 1.0,
        }
    }
}

impl FromStr for Collective {
    type Err = TopoError;
    fn from_str(s: &str) -> Result<Self> {
        let k: String = s
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase();
        Collective::ALL
            .into_iter()
            .find(|c| c.name() == k)
            .ok_or_else(|| TopoError::Tuner(format!("unknown collective {s:?}")))
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub use weftcc_collectives::Algorithm;

/// A protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Protocol {
    /// Low latency: 8-byte stores of 4 B data + 4 B flag (50% efficiency).
    #[serde(rename = "LL")]
    Ll,
    /// 128-byte lines with 120 B data + 8 B flag.
    #[serde(rename = "LL128")]
    Ll128,
    /// Bulk data with fenced counters.
    Simple,
}

impl Protocol {
    /// Every protocol.
    pub const ALL: [Protocol; 3] = [Protocol::Ll, Protocol::Ll128, Protocol::Simple];

    /// NCCL-style name (`LL`, `LL128`, `Simple`).
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Ll => "LL",
            Protocol::Ll128 => "LL128",
            Protocol::Simple => "Simple",
        }
    }
}

impl FromStr for Protocol {
    type Err = UnknownName;
    fn from_str(s: &str) -> std::result::Result<Self, UnknownName> {
        let name = s.trim();
        let known = Protocol::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name));
        known.ok_or_else(|| UnknownName::new("protocol", s, "LL, LL128, Simple"))
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-protocol figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProtoFigures {
    /// Fixed latency of a call, µs.
    pub base_us: f64,
    /// Multiplier on a link's per-hop latency.
    pub hop_factor: f64,
    /// Fraction of link bandwidth carrying data.
    pub efficiency: f64,
}

impl Protocol {
    /// Default figures (base ≈ 6.6–8.4 µs; LL carries 50%, LL128 120/128 of a line).
    pub fn default_figures(self) -> ProtoFigures {
        match self {
            Protocol::Ll => ProtoFigures {
                base_us: 6.6,
                hop_factor: 1.0,
                efficiency: 0.5,
            },
            Protocol::Ll128 => ProtoFigures {
                base_us: 8.4,
                hop_factor: 1.5,
                efficiency: 120.0 / 128.0,
            },
            Protocol::Simple => ProtoFigures {
                base_us: 8.4,
                hop_factor: 2.8,
                efficiency: 1.0,
            },
        }
    }
}

/// A link's latency α (µs) and bandwidth 1/β (GB/s).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkFigure {
    /// α: latency per message, µs.
    pub alpha_us: f64,
    /// 1/β: bandwidth, GB/s.
    pub gbps: f64,
}

impl LinkFigure {
    /// Least-squares fit (relative errors) of `time_us = α + bytes / (gbps · 1e3)` to measured
    /// (bytes, time µs) samples. Needs two distinct sizes and a positive slope.
    pub fn fit(samples: &[(f64, f64)]) -> Result<LinkFigure> {
        if samples.len() < 2 {
            return Err(TopoError::Tuner(
                "calibration needs at least 2 samples".into(),
            ));
        }
        if samples
            .iter()
            .any(|(b, t)| !b.is_finite() || !t.is_finite() || *b < 0.0 || *t <= 0.0)
        {
            return Err(TopoError::Tuner(
                "calibration samples must be finite, sizes non-negative and times positive".into(),
            ));
        }
        // Weighted by 1/t²: relative errors count, so small sizes fix α and large ones β.
        let w: Vec<f64> = samples.iter().map(|s| 1.0 / (s.1 * s.1)).collect();
        let sw: f64 = w.iter().sum();
        let mx = samples.iter().zip(&w).map(|(s, w)| w * s.0).sum::<f64>() / sw;
        let my = samples.iter().zip(&w).map(|(s, w)| w * s.1).sum::<f64>() / sw;
        let sxx: f64 = samples
            .iter()
            .zip(&w)
            .map(|(s, w)| w * (s.0 - mx).powi(2))
            .sum();
        let sxy: f64 = samples
            .iter()
            .zip(&w)
            .map(|(s, w)| w * (s.0 - mx) * (s.1 - my))
            .sum();
        if sxx <= 0.0 || !sxx.is_finite() {
            return Err(TopoError::Tuner(
                "calibration needs at least two different sizes".into(),
            ));
        }
        let slope = sxy / sxx; // µs per byte
        if slope <= 0.0 {
            return Err(TopoError::Tuner(
                "calibration: time does not grow with size".into(),
            ));
        }
        Ok(LinkFigure {
            alpha_us: (my - slope * mx).max(0.0),
            gbps: 1.0 / (slope * 1e3),
        })
    }
}

/// Measured link figures, saved as JSON and applied over the defaults.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Calibration {
    /// Intra-host path (the ring's hops), if measured.
    pub intra: Option<LinkFigure>,
    /// Network between hosts, if measured.
    pub net: Option<LinkFigure>,
    /// Protocol figures, if tuned.
    #[serde(default)]
    pub protocols: Vec<(Protocol, ProtoFigures)>,
}

impl Calibration {
    /// Reads a calibration saved with [`Calibration::to_json`].
    pub fn from_json(s: &str) -> Result<Calibration> {
        let c: Calibration = serde_json::from_str(s)?;
        for f in c.intra.iter().chain(c.net.iter()) {
            if !(f.gbps.is_finite() && f.gbps > 0.0 && f.alpha_us.is_finite() && f.alpha_us >= 0.0)
            {
                return Err(TopoError::Tuner(format!("bad link figure {f:?}")));
            }
        }
        Ok(c)
    }

    /// JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// One measured collective (e.g. a `weft perf --json` row).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// Collective.
    pub collective: Collective,
    /// Ranks.
    pub nranks: usize,
    /// nccl-tests size, bytes.
    pub bytes: u64,
    /// Measured time, µs.
    pub time_us: f64,
}

impl Calibration {
    /// Fits the intra-host figure from measurements on one host: the bandwidth from the slope
    /// of time against bytes × bus factor, the per-hop latency from the intercept spread over
    /// the ring's steps (2(n-1) for all-reduce, n-1 otherwise). The Simple protocol's base
    /// latency and hop factor are then 0 and 1 so that the model reproduces the measurements.
    pub fn fit_intra(samples: &[Measurement]) -> Result<Calibration> {
        let usable: Vec<&Measurement> = samples.iter().filter(|m| m.nranks > 1).collect();
        let points: Vec<(f64, f64)> = usable
            .iter()
            .map(|m| {
                (
                    m.bytes as f64 * m.collective.bus_factor(m.nranks),
                    m.time_us,
                )
            })
            .collect();
        let f = LinkFigure::fit(&points)?;
        let steps = usable
            .iter()
            .map(|m| match m.collective {
                Collective::AllReduce => 2.0 * (m.nranks as f64 - 1.0),
                _ => m.nranks as f64 - 1.0,
            })
            .sum::<f64>()
            / usable.len().max(1) as f64;
        Ok(Calibration {
            intra: Some(LinkFigure {
                alpha_us: f.alpha_us / steps.max(1.0),
                gbps: f.gbps,
            }),
            net: None,
            protocols: vec![(
                Protocol::Simple,
                ProtoFigures {
                    base_us: 0.0,
                    hop_factor: 1.0,
                    efficiency: 1.0,
                },
            )],
        })
    }

    /// Reads the rows `weft perf --json` writes (`collective`, `size`, `nranks`,
    /// `oop.time_us`); rows of collectives the model does not cover are skipped.
    pub fn perf_rows(json: &str) -> Result<Vec<Measurement>> {
        #[derive(Deserialize)]
        struct Half {
            time_us: f64,
        }
        #[derive(Deserialize)]
        struct Row {
            collective: String,
            size: u64,
            nranks: usize,
            oop: Half,
        }
        let rows: Vec<Row> = serde_json::from_str(json)?;
        Ok(rows
            .into_iter()
            .filter_map(|r| {
                Some(Measurement {
                    collective: r.collective.parse().ok()?,
                    nranks: r.nranks,
                    bytes: r.size,
                    time_us: r.oop.time_us,
                })
            })
            .collect())
    }
}

/// What the model needs to know about a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInput {
    /// Ranks in the job.
    pub nranks: usize,
    /// Hosts in the job (ranks are spread evenly).
    pub nhosts: usize,
    /// Ring bandwidth inside a host (sum of the channels), GB/s.
    pub intra_gbps: f64,
    /// Latency of one hop inside a host, µs.
    pub intra_lat_us: f64,
    /// Network bandwidth per host, GB/s.
    pub net_gbps: f64,
    /// Latency of one network hop, µs.
    pub net_lat_us: f64,
    /// Speed of the reduction kernel (γ = 1 / this), GB/s of input combined; 0 when reductions
    /// cost nothing next to the links (GPUs).
    #[serde(default)]
    pub reduce_gbps: f64,
}

/// Bandwidth assumed between CPU ranks of one host (shared memory), GB/s.
pub const SHM_GBPS: f64 = 8.0;
/// Network bandwidth assumed when a host has no NIC with a known speed, GB/s (100 Gbit/s).
pub const DEFAULT_NET_GBPS: f64 = 12.5;

impl ModelInput {
    /// Figures from a host's topology and rings, for `nhosts` hosts each with as many ranks as
    /// GPUs (or `ranks_per_host` when given, e.g. CPU-only hosts).
    pub fn from_topology(
        topo: &Topology,
        plan: &RingPlan,
        speeds: &LinkSpeeds,
        nhosts: usize,
        ranks_per_host: Option<usize>,
    ) -> ModelInput {
        let local = ranks_per_host.unwrap_or(topo.gpus.len()).max(1);
        let (intra_gbps, intra_lat_us) = match plan.rings.first() {
            Some(r) if !r.hops.is_empty() => {
                let lat =
                    r.hops.iter().map(|c| speeds.latency(*c)).sum::<f64>() / r.hops.len() as f64;
                (plan.total_gbps(), lat)
            }
            _ => (SHM_GBPS, speeds.pcie_lat_us),
        };
        let nic_gbit: f64 = topo.nics.iter().filter_map(|n| n.speed_gbit).sum();
        let net_gbps = if nic_gbit > 0.0 {
            nic_gbit / 8.0
        } else {
            DEFAULT_NET_GBPS
        };
        ModelInput {
            nranks: local * nhosts.max(1),
            nhosts: nhosts.max(1),
            intra_gbps,
            intra_lat_us,
            net_gbps,
            net_lat_us: speeds.net_lat_us,
            reduce_gbps: 0.0,
        }
    }

    /// Applies measured figures.
    pub fn calibrated(mut self, c: &Calibration) -> ModelInput {
        if let Some(f) = c.intra {
            self.intra_gbps = f.gbps;
            self.intra_lat_us = f.alpha_us;
        }
        if let Some(f) = c.net {
            self.net_gbps = f.gbps;
            self.net_lat_us = f.alpha_us;
        }
        self
    }
}

/// A prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Algorithm.
    pub algo: Algorithm,
    /// Protocol.
    pub proto: Protocol,
    /// Predicted time, µs.
    pub time_us: f64,
    /// nccl-tests algorithm bandwidth (bytes / time), GB/s.
    pub algbw_gbps: f64,
    /// nccl-tests bus bandwidth, GB/s.
    pub busbw_gbps: f64,
}

/// The cost model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Model {
    /// Job figures.
    pub input: ModelInput,
    /// Protocol figures, indexed like `Protocol::ALL`.
    pub protocols: [ProtoFigures; 3],
}

fn ceil_log2(n: usize) -> f64 {
    if n <= 1 {
        0.0
    } else {
        f64::from(usize::BITS - (n - 1).leading_zeros())
    }
}

impl Model {
    /// A model with the default protocol figures (overridden by the calibration's).
    pub fn new(input: ModelInput, cal: Option<&Calibration>) -> Model {
        let mut protocols = Protocol::ALL.map(Protocol::default_figures);
        let input = match cal {
            Some(c) => {
                for (p, f) in &c.protocols {
                    if let Some(i) = Protocol::ALL.iter().position(|q| q == p) {
                        protocols[i] = *f;
                    }
                }
                input.calibrated(c)
            }
            None => input,
        };
        Model { input, protocols }
    }

    fn figures(&self, p: Protocol) -> ProtoFigures {
        let i = Protocol::ALL.iter().position(|q| *q == p).unwrap_or(2);
        self.protocols[i]
    }

    /// Predicted time of `coll` on `bytes` (nccl-tests size: the largest user buffer) with this
    /// algorithm and protocol; `None` when the algorithm does not implement the collective.
    pub fn predict(
        &self,
        coll: Collective,
        algo: Algorithm,
        proto: Protocol,
        bytes: u64,
    ) -> Option<Prediction> {
        let m = &self.input;
        let n = m.nranks.max(1);
        let hosts = m.nhosts.clamp(1, n);
        let local = n.div_ceil(hosts).max(1);
        let pf = self.figures(proto);
        let multi = hosts > 1;
        let link_bw = if multi {
            m.intra_gbps.min(m.net_gbps)
        } else {
            m.intra_gbps
        };
        let bw = (link_bw * pf.efficiency).max(1e-9) * 1e3; // bytes per µs
        let b = bytes as f64;
        // γ: µs per byte combined (0 when reductions are free).
        let gamma = if m.reduce_gbps > 0.0 {
            1.0 / (m.reduce_gbps * 1e3)
        } else {
            0.0
        };
        let time = match (algo, coll) {
            _ if n == 1 => pf.base_us,
            (Algorithm::Ring, _) => {
                // Per-hop latency averaged over the ring: (n - hosts) hops inside hosts, hosts
                // network hops when several hosts.
                let net_hops = if multi { hosts } else { 0 };
                let hop = ((n - net_hops) as f64 * m.intra_lat_us + net_hops as f64 * m.net_lat_us)
                    / n as f64
                    * pf.hop_factor;
                let steps = match coll {
                    Collective::AllReduce => 2 * (n - 1),
                    _ => n - 1,
                } as f64;
                let reduced = match coll {
                    Collective::AllReduce | Collective::ReduceScatter => (n - 1) as f64 / n as f64,
                    Collective::Reduce => 1.0,
                    _ => 0.0,
                };
                pf.base_us + steps * hop + b * coll.bus_factor(n) / bw + reduced * b * gamma
            }
            (Algorithm::Tree, Collective::AllReduce) => {
                let depth = ceil_log2(hosts);
                let lat = 2.0
                    * (depth * m.net_lat_us + (local - 1) as f64 * m.intra_lat_us)
                    * pf.hop_factor;
                // Reduce up, then broadcast down; each rank sends and receives about the whole
                // buffer in each phase (the two trees each carry half).
                // An interior rank combines two children's halves: about the whole buffer.
                pf.base_us + lat + 2.0 * b / bw + b * gamma
            }
            (Algorithm::Tree, Collective::Broadcast | Collective::Reduce) => {
                // Pipelined binary tree: depth ⌈log2 n⌉ (network levels first), interior ranks
                // send (broadcast) or combine (reduce) every slice twice.
                let depth = ceil_log2(hosts) * m.net_lat_us + ceil_log2(local) * m.intra_lat_us;
                let combine = if coll == Collective::Reduce {
                    2.0 * b * gamma
                } else {
                    0.0
                };
                pf.base_us + depth * pf.hop_factor + 2.0 * b / bw + combine
            }
            (Algorithm::Rd, Collective::AllReduce) => {
                let steps = ceil_log2(n);
                let lat = if multi { m.net_lat_us } else { m.intra_lat_us } * pf.hop_factor;
                pf.base_us + steps * (lat + b / bw + b * gamma)
            }
            (Algorithm::Rd, Collective::AllGather) => {
                // ⌈log2 n⌉ rounds exchanging 1, 2, 4, … blocks: the ring's volume in fewer,
                // unpipelined steps.
                let steps = ceil_log2(n);
                let lat = if multi { m.net_lat_us } else { m.intra_lat_us } * pf.hop_factor;
                pf.base_us + steps * lat + b * coll.bus_factor(n) / bw
            }
            (Algorithm::Rd, Collective::ReduceScatter) => {
                // Recursive halving: ⌈log2 n⌉ rounds exchanging n/2, n/4, … blocks, the ring's
                // volume and reductions in fewer, unpipelined steps.
                let steps = ceil_log2(n);
                let lat = if multi { m.net_lat_us } else { m.intra_lat_us } * pf.hop_factor;
                let reduced = (n - 1) as f64 / n as f64;
                pf.base_us + steps * lat + b * coll.bus_factor(n) / bw + reduced * b * gamma
            }
            (Algorithm::Hier, Collective::AllReduce) if multi => {
                // Ring reduce-scatter and all-gather among the host's `local` ranks, then a ring
                // all-reduce across the hosts of each 1/local shard; the shards of one host share
                // its network bandwidth.
                let l = local as f64;
                let h = hosts as f64;
                let intra_bw = (m.intra_gbps * pf.efficiency).max(1e-9) * 1e3;
                let net_bw = (m.net_gbps * pf.efficiency).max(1e-9) * 1e3;
                let intra = 2.0 * (l - 1.0) * m.intra_lat_us * pf.hop_factor
                    + 2.0 * (l - 1.0) / l * b / intra_bw
                    + (l - 1.0) / l * b * gamma;
                let cross = 2.0 * (h - 1.0) * m.net_lat_us * pf.hop_factor
                    + 2.0 * (h - 1.0) / h * b / net_bw
                    + (h - 1.0) / h * b / l * gamma;
                pf.base_us + intra + cross
            }
            _ => return None,
        };
        let algbw = if time > 0.0 { b / time / 1e3 } else { 0.0 };
        Some(Prediction {
            algo,
            proto,
            time_us: time,
            algbw_gbps: algbw,
            busbw_gbps: algbw * coll.bus_factor(n),
        })
    }

    /// The fastest allowed (algorithm, protocol) for this call; `None` when the overrides allow
    /// nothing that implements it.
    pub fn choose(
        &self,
        coll: Collective,
        bytes: u64,
        algos: &Selection<Algorithm>,
        protos: &Selection<Protocol>,
    ) -> Option<Prediction> {
        let mut best: Option<Prediction> = None;
        for a in Algorithm::ALL {
            if !algos.allows(coll, a) {
                continue;
            }
            for p in Protocol::ALL {
                if !protos.allows(coll, p) {
                    continue;
                }
                if let Some(pr) = self.predict(coll, a, p, bytes) {
                    if best.is_none_or(|b| pr.time_us < b.time_us) {
                        best = Some(pr);
                    }
                }
            }
        }
        best
    }
}

/// One rule of an override: for one collective (or all), a list of allowed or excluded items.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule<T> {
    coll: Option<Collective>,
    exclude: bool,
    items: Vec<T>,
}

/// A parsed `WEFT_ALGO` / `WEFT_PROTO` value, NCCL syntax:
/// `ring,tree` (only these), `^tree` (all but these), `allreduce:tree;broadcast:ring` (per
/// collective, `;`-separated; a collective's own rule replaces the global one), `auto` or empty
/// (no restriction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection<T> {
    rules: Vec<Rule<T>>,
}

impl<T> Default for Selection<T> {
    fn default() -> Self {
        Selection { rules: Vec::new() }
    }
}

impl<T: FromStr + PartialEq + Copy> Selection<T>
where
    T::Err: fmt::Display,
{
    /// Parses an override value.
    pub fn parse(spec: &str) -> Result<Selection<T>> {
        let mut rules: Vec<Rule<T>> = Vec::new();
        for entry in spec.split(';') {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let (coll, list) = match entry.split_once(':') {
                Some((c, l)) => (Some(c.trim().parse::<Collective>()?), l.trim()),
                None => (None, entry),
            };
            let (exclude, list) = match list.strip_prefix('^') {
                Some(rest) => (true, rest.trim()),
                None => (false, list),
            };
            if list.eq_ignore_ascii_case("auto") && !exclude {
                rules.retain(|r| r.coll != coll);
                continue;
            }
            let mut items = Vec::new();
            for name in list.split(',') {
                let name = name.trim();
                if name.is_empty() {
                    return Err(TopoError::Tuner(format!("empty name in {entry:?}")));
                }
                let v: T = name
                    .parse()
                    .map_err(|e: T::Err| TopoError::Tuner(e.to_string()))?;
                if !items.contains(&v) {
                    items.push(v);
                }
            }
            if rules.iter().any(|r| r.coll == coll) {
                return Err(TopoError::Tuner(format!(
                    "{} given twice in {spec:?}",
                    coll.map_or("the global rule".to_string(), |c| c.name().to_string())
                )));
            }
            rules.push(Rule {
                coll,
                exclude,
                items,
            });
        }
        Ok(Selection { rules })
    }

    /// Reads and parses a setting (`WEFT_ALGO`, `WEFT_PROTO`; unset or empty: no restriction).
    pub fn from_setting(setting: &weftcc_settings::Setting) -> Result<Selection<T>> {
        match setting.value() {
            Some(v) => Selection::parse(&v).map_err(|e| {
                let msg = match e {
                    TopoError::Tuner(m) => m,
                    other => other.to_string(),
                };
                TopoError::Tuner(format!("{}={v:?}: {msg}", setting.name))
            }),
            None => Ok(Selection::default()),
        }
    }

    /// Whether `item` may be used for `coll`.
    pub fn allows(&self, coll: Collective, item: T) -> bool {
        let rule = self
            .rules
            .iter()
            .find(|r| r.coll == Some(coll))
            .or_else(|| self.rules.iter().find(|r| r.coll.is_none()));
        match rule {
            None => true,
            Some(r) => r.items.contains(&item) != r.exclude,
        }
    }

    /// True when nothing is restricted.
    pub fn is_unrestricted(&self) -> bool {
        self.rules.is_empty()
    }
}
