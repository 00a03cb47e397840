//! Per-call algorithm choice: the α-β cost model of `weftcc-topology` ([`Model`]) fed with the
//! communicator's own figures (shared memory inside a host, TCP across hosts, the reduction
//! kernel's speed), restricted by `WEFT_ALGO` (NCCL_ALGO syntax, parsed by
//! [`Selection`]), and logged under the `TUNING` subsystem (`weftcc::tuning`).
//!
//! Every rank computes the same choice from the same inputs (collective, bytes, rank count, the
//! host of every rank, the configuration), so no agreement round is needed.

use std::collections::HashSet;
use std::sync::Mutex;
use weftcc_collectives::op::OpKind;
use weftcc_collectives::schedule::hierarchical::HostLayout;
use weftcc_topology::tuner::{
    Algorithm, Calibration, Collective, Model, ModelInput, Prediction, ProtoFigures, Protocol,
    Selection,
};

/// Default link figures of the CPU transports (per-hop latency in µs, bandwidth in GB/s), and of
/// the reduction kernels. Chosen so that the model reproduces what was measured on the
/// development machine: recursive doubling beats the ring up to about 64 KiB on one host.
pub mod defaults {
    /// Shared memory: per-hop latency (a handoff through the ring and a wake-up), µs.
    pub const SHM_LAT_US: f64 = 4.0;
    /// Shared memory: copy bandwidth per direction, GB/s.
    pub const SHM_GBPS: f64 = 8.0;
    /// TCP: per-hop latency, µs.
    pub const TCP_LAT_US: f64 = 15.0;
    /// TCP between ranks of one host (loopback), GB/s.
    pub const TCP_LOCAL_GBPS: f64 = 4.8;
    /// TCP across hosts when nothing better is known (10 Gbit/s), GB/s.
    pub const TCP_NET_GBPS: f64 = 1.25;
    /// Reduction kernels, GB/s of input combined.
    pub const REDUCE_GBPS: f64 = 8.0;
}

/// Largest all-gather (whole output buffer) for which recursive doubling is considered.
pub const RD_ALL_GATHER_MAX_BYTES: u64 = 64 << 10;
/// Largest reduce-scatter (whole input buffer) for which recursive halving is considered.
pub const RD_REDUCE_SCATTER_MAX_BYTES: u64 = 64 << 10;

/// The model's collective for an operation kind, if it has one.
pub fn collective_of(kind: OpKind) -> Option<Collective> {
    match kind {
        OpKind::AllReduce => Some(Collective::AllReduce),
        OpKind::AllGather => Some(Collective::AllGather),
        OpKind::ReduceScatter => Some(Collective::ReduceScatter),
        OpKind::Broadcast => Some(Collective::Broadcast),
        OpKind::Reduce => Some(Collective::Reduce),
        _ => None,
    }
}

/// The figures of a job: `layout` says which ranks share a host; `shm` whether they use shared
/// memory there (else TCP); `cal` replaces link figures with measured ones.
pub fn model_input(layout: &HostLayout, shm: bool, cal: Option<&Calibration>) -> ModelInput {
    let (intra_lat_us, intra_gbps) = if shm {
        (defaults::SHM_LAT_US, defaults::SHM_GBPS)
    } else {
        (defaults::TCP_LAT_US, defaults::TCP_LOCAL_GBPS)
    };
    let input = ModelInput {
        nranks: layout.nranks().max(1),
        nhosts: layout.hosts().max(1),
        intra_gbps,
        intra_lat_us,
        net_gbps: defaults::TCP_NET_GBPS,
        net_lat_us: defaults::TCP_LAT_US,
        reduce_gbps: defaults::REDUCE_GBPS,
    };
    match cal {
        Some(c) => input.calibrated(c),
        None => input,
    }
}

/// Chooses the algorithm of each call and logs the choices.
#[derive(Debug)]
pub struct Tuner {
    model: Model,
    algos: Selection<Algorithm>,
    layout: HostLayout,
    /// `Simple` only, and one selection per algorithm (built once: `choose` runs on every call
    /// and allocates nothing).
    simple: Selection<Protocol>,
    only: [Selection<Algorithm>; 4],
    /// (collective, size class, choice) already logged at INFO.
    logged: Mutex<HashSet<(OpKind, u32, Algorithm)>>,
}

impl Tuner {
    /// A tuner for a job with this layout. The CPU transports have one protocol (bulk copies
    /// with counters, NCCL's Simple), whose fixed costs are part of the link latencies.
    pub fn new(
        layout: HostLayout,
        shm: bool,
        algos: Selection<Algorithm>,
        cal: Option<&Calibration>,
    ) -> Tuner {
        let mut model = Model::new(model_input(&layout, shm, cal), None);
        for (p, f) in model.protocols.iter_mut().zip(Protocol::ALL) {
            if f == Protocol::Simple {
                *p = ProtoFigures {
                    base_us: 0.0,
                    hop_factor: 1.0,
                    efficiency: 1.0,
                };
            }
        }
        Tuner {
            model,
            algos,
            layout,
            simple: Selection::parse("simple").unwrap_or_default(),
            only: Algorithm::ALL.map(|a| Selection::parse(a.name()).unwrap_or_default()),
            logged: Mutex::new(HashSet::new()),
        }
    }

    /// The host layout the tuner was built for.
    pub fn layout(&self) -> &HostLayout {
        &self.layout
    }

    /// The model (for reports).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The algorithms this communicator runs for `coll` on `bytes` (nccl-tests size).
    fn implemented(&self, coll: Collective, a: Algorithm, bytes: u64) -> bool {
        match (coll, a) {
            (_, Algorithm::Ring) => true,
            (Collective::AllReduce, Algorithm::Rd | Algorithm::Tree) => true,
            // The model prices it at or below the ring at every size; it is only measured to
            // pay where latency dominates, so larger buffers keep the pipelined ring.
            (Collective::AllGather, Algorithm::Rd) => {
                self.layout.nranks().is_power_of_two() && bytes <= RD_ALL_GATHER_MAX_BYTES
            }
            (Collective::ReduceScatter, Algorithm::Rd) => {
                self.layout.nranks().is_power_of_two() && bytes <= RD_REDUCE_SCATTER_MAX_BYTES
            }
            (Collective::AllReduce, Algorithm::Hier) => self.layout.hosts() > 1,
            (Collective::Broadcast | Collective::Reduce, Algorithm::Tree) => true,
            _ => false,
        }
    }

    /// The predicted fastest implemented algorithm for `coll` on `bytes` (nccl-tests size)
    /// among those `WEFT_ALGO` allows, with its prediction; the ring when the override allows
    /// nothing implemented for this collective.
    pub fn predict(&self, coll: Collective, bytes: u64) -> (Algorithm, Option<Prediction>) {
        let mut best: Option<Prediction> = None;
        for (a, only) in Algorithm::ALL.into_iter().zip(&self.only) {
            if !self.implemented(coll, a, bytes) || !self.algos.allows(coll, a) {
                continue;
            }
            if let Some(p) = self.model.choose(coll, bytes, only, &self.simple) {
                if best.is_none_or(|b| p.time_us < b.time_us) {
                    best = Some(p);
                }
            }
        }
        match best {
            Some(p) => (p.algo, Some(p)),
            None => (
                Algorithm::Ring,
                self.model
                    .predict(coll, Algorithm::Ring, Protocol::Simple, bytes),
            ),
        }
    }

    /// The schedule to run for `kind` on a user buffer of `bytes` (nccl-tests size); logs the
    /// choice at INFO the first time it is made for a collective and size class (powers of
    /// two), at DEBUG on every call.
    pub fn choose(&self, kind: OpKind, bytes: usize, rank: usize, seq: u64) -> Algorithm {
        let Some(coll) = collective_of(kind) else {
            return Algorithm::Ring;
        };
        let (choice, pred) = self.predict(coll, bytes as u64);
        let class = usize::BITS - bytes.leading_zeros();
        let first = tracing::enabled!(target: "weftcc::tuning", tracing::Level::INFO)
            && self
                .logged
                .lock()
                .map(|mut l| l.insert((kind, class, choice)))
                .unwrap_or(false);
        let predicted_us = pred.map_or(f64::NAN, |p| p.time_us);
        if first {
            tracing::info!(
                target: "weftcc::tuning",
                rank,
                op = %kind,
                bytes,
                algo = choice.name(),
                predicted_us,
                nranks = self.layout.nranks(),
                hosts = self.layout.hosts(),
                "algorithm chosen (first call of this size class; later ones at DEBUG)"
            );
        } else {
            tracing::debug!(
                target: "weftcc::tuning",
                rank,
                op = %kind,
                seq,
                bytes,
                algo = choice.name(),
                predicted_us,
                "algorithm chosen"
            );
        }
        choice
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuner(labels: &[usize], spec: &str) -> Tuner {
        Tuner::new(
            HostLayout::from_labels(labels),
            true,
            Selection::parse(spec).unwrap(),
            None,
        )
    }

    #[test]
    fn one_host_reproduces_the_measured_rd_threshold() {
        for n in [2, 3, 4, 8] {
            let t = tuner(&vec![0; n], "");
            let pick = |b: usize| t.choose(OpKind::AllReduce, b, 0, 1);
            // The crossover moves with n (about 32 KiB at 3 ranks, where recursive doubling
            // folds a rank in, to 100 KiB at 8), around the 64 KiB measured at 2 and 4.
            for b in [8, 1024, 16 << 10] {
                assert_eq!(pick(b), Algorithm::Rd, "n {n} bytes {b}");
            }
            if n != 3 {
                assert_eq!(pick(60 << 10), Algorithm::Rd, "n {n}");
            }
            for b in [256 << 10, 1 << 20, 64 << 20] {
                assert_eq!(pick(b), Algorithm::Ring, "n {n} bytes {b}");
            }
            // Above its cap all-gather keeps the ring; the barrier only has one.
            assert_eq!(t.choose(OpKind::AllGather, 1 << 20, 0, 1), Algorithm::Ring);
            assert_eq!(t.choose(OpKind::Barrier, 0, 0, 1), Algorithm::Ring);
        }
    }

    /// All-gather (recursive doubling) and reduce-scatter (recursive halving) take `rd` on
    /// power-of-two rank counts up to their cap, the ring otherwise.
    #[test]
    fn small_block_collectives_use_rd_on_power_of_two_ranks() {
        for (kind, cap) in [
            (OpKind::AllGather, RD_ALL_GATHER_MAX_BYTES as usize),
            (OpKind::ReduceScatter, RD_REDUCE_SCATTER_MAX_BYTES as usize),
        ] {
            for n in [4, 8, 16] {
                let t = tuner(&vec![0; n], "");
                for b in [8 * n, 2048, cap] {
                    assert_eq!(t.choose(kind, b, 0, 1), Algorithm::Rd, "{kind} n {n} b {b}");
                }
                assert_eq!(
                    t.choose(kind, cap + 1, 0, 1),
                    Algorithm::Ring,
                    "{kind} n {n}"
                );
            }
            // (With 2 ranks both are one exchange: the model's tie keeps the ring.)
            for n in [2, 3, 5, 6] {
                let t = tuner(&vec![0; n], "");
                assert_eq!(t.choose(kind, 8 * n, 0, 1), Algorithm::Ring, "{kind} n {n}");
            }
            // WEFT_ALGO=ring still rules it out.
            let t = tuner(&[0; 4], "ring");
            assert_eq!(t.choose(kind, 32, 0, 1), Algorithm::Ring, "{kind}");
        }
    }

    #[test]
    fn several_hosts_choose_hierarchical_for_large_all_reduce() {
        let t = tuner(&[0, 0, 1, 1], "");
        assert_eq!(t.choose(OpKind::AllReduce, 64 << 20, 0, 1), Algorithm::Hier);
        let (c, p) = t.predict(Collective::AllReduce, 64 << 20);
        assert_eq!(c, Algorithm::Hier);
        let ring = t
            .model()
            .predict(
                Collective::AllReduce,
                Algorithm::Ring,
                Protocol::Simple,
                64 << 20,
            )
            .unwrap();
        assert!(p.unwrap().time_us < ring.time_us);
        // One host: never hierarchical, even when asked for.
        let one = tuner(&[0, 0, 0], "hier");
        assert_eq!(
            one.choose(OpKind::AllReduce, 64 << 20, 0, 1),
            Algorithm::Ring
        );
    }

    #[test]
    fn overrides_restrict_the_choice() {
        let t = tuner(&[0, 0, 0, 0], "tree");
        assert_eq!(t.choose(OpKind::AllReduce, 8, 0, 1), Algorithm::Tree);
        assert_eq!(t.choose(OpKind::Broadcast, 8 << 20, 0, 1), Algorithm::Tree);
        // Nothing implemented is allowed for all-gather: the ring.
        assert_eq!(t.choose(OpKind::AllGather, 8, 0, 1), Algorithm::Ring);
        let t = tuner(&[0, 0, 0, 0], "^rd");
        assert_eq!(t.choose(OpKind::AllReduce, 8, 0, 1), Algorithm::Ring);
        let t = tuner(&[0, 0, 1, 1], "allreduce:ring;broadcast:tree");
        assert_eq!(t.choose(OpKind::AllReduce, 64 << 20, 0, 1), Algorithm::Ring);
        assert_eq!(t.choose(OpKind::Broadcast, 8, 0, 1), Algorithm::Tree);
    }
}
