//! A communicator's settings, from the `WEFT_*` variables or given explicitly.

use crate::env;
use crate::error::{Error, Result};
use std::time::Duration;
use weftcc_collectives::{Algorithm, OpKind};
use weftcc_topology::tuner::{Calibration, Protocol, Selection};
use weftcc_transports::TransportError;
pub use weftcc_transports::{parse_size, ConnectMode, InvalidSize};

/// Default largest message (slice) of a pipelined transfer, in bytes (`WEFT_SLICE_BYTES`).
pub const DEFAULT_SLICE_BYTES: usize = 256 * 1024;

/// Settings of a communicator. [`CommConfig::from_env`] reads the `WEFT_*` variables.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// How long an operation may go without progress before it fails with `Error::Timeout`
    /// (`WEFT_TIMEOUT` seconds, default 600).
    pub timeout: Duration,
    /// Force TCP between ranks of one host (`WEFT_SHM_DISABLE=1`).
    pub shm_disable: bool,
    /// Interfaces for TCP (`WEFT_SOCKET_IFNAME`, NCCL_SOCKET_IFNAME syntax).
    pub socket_ifname: Option<String>,
    /// Host identity; ranks with equal ids use shared memory (`WEFT_HOST_ID`).
    pub host_id: String,
    /// Shared-memory ring size per connected peer (`WEFT_BUFFSIZE`); `None` sizes rings by the
    /// ranks sharing the host ([`weftcc_transports::shm::auto_capacity`]: 1 MiB up to 32 ranks).
    pub buffsize: Option<usize>,
    /// When peers are connected (`WEFT_CONNECT=eager` connects all at init; the default connects
    /// each when an operation first needs it).
    pub connect: ConnectMode,
    /// Splits of this communicator share its connections, one per pair of processes, each
    /// communicator in its own channel (`WEFT_SPLIT_SHARE=1`, NCCL's `splitShare`). Off by
    /// default: every message then carries a 16-byte frame header (measured: about 0.2 µs more
    /// per small message over shared memory). Every rank must choose alike.
    pub split_share: bool,
    /// The network across hosts (`WEFT_NET`, `WEFT_IB_DISABLE`, `WEFT_OFI_PROVIDER`,
    /// `WEFT_NET_BUFFSIZE`): RDMA where usable, else TCP.
    pub net: weftcc_transports::net::NetChoice,
    /// Sockets and helper threads of a TCP connection (`WEFT_SOCKET_NTHREADS`,
    /// `WEFT_NSOCKS_PERTHREAD`; default one socket driven by the rank's own thread).
    pub stripes: weftcc_transports::tcp_stripes::StripePlan,
    /// Largest message of a pipelined transfer (`WEFT_SLICE_BYTES`).
    pub slice_bytes: usize,
    /// Idle policy while waiting: spin (`WEFT_SPIN_US`), then yield (`WEFT_YIELD_US`), then
    /// sleep until a peer signals.
    pub backoff: Backoff,
    /// Spin used instead of `backoff.spin` when this host runs more ranks than it has CPUs: a
    /// spinning rank then only delays the peer it waits for (see docs/performance.md).
    /// `None` keeps `backoff.spin`; `from_env` sets `None` when `WEFT_SPIN_US` is given.
    pub oversubscribed_spin: Option<Duration>,
    /// Largest operation (its largest buffer, bytes) whose messages are sent pinned, i.e. single
    /// copy over shared memory (`WEFT_SHM_CMA_MAX_OP`); only collectives whose receivers copy
    /// (all-gather, broadcast, all-to-all, send/recv) use it. `None` keeps the defaults: no
    /// bound for all-gather, all-to-all and send/recv, [`DEFAULT_PINNED_MAX_BYTES`] for
    /// broadcast, whose pipelined cross-memory copies of data no longer in cache are slower than
    /// the ring for large buffers.
    pub pinned_max_bytes: Option<usize>,
    /// Algorithms the tuner may choose (`WEFT_ALGO`, NCCL_ALGO syntax: `ring`, `tree`, `rd`,
    /// `hier`, `^tree`, `allreduce:tree;broadcast:ring`); unrestricted by default.
    pub algo: Selection<Algorithm>,
    /// Protocols (`WEFT_PROTO`, NCCL_PROTO syntax). The CPU transports move bulk data with
    /// `Simple` (a value that excludes it is reported once and otherwise ignored); shared memory
    /// sends writes of up to [`weftcc_transports::shm::LL_MAX`] bytes as `LL` messages unless the
    /// value excludes `LL` for every collective (the transport does not know the collective).
    pub proto: Selection<Protocol>,
    /// Measured link figures for the tuner (`WEFT_CALIBRATION=FILE`, as saved by
    /// `weft topo --save-calibration`); built-in figures otherwise.
    pub calibration: Option<Calibration>,
    /// Most bytes a rank reads of the others' contributions in a collective run one-shot
    /// through the ranks' outboxes when every rank shares memory with every other
    /// (`WEFT_SHM_ONESHOT_MAX`, default 1 KiB; unused when [`CommConfig::algo`] restricts the
    /// algorithms).
    pub one_shot_max: usize,
    /// Deterministic reductions (`WEFT_DETERMINISTIC=1`): floating-point all-reduce, reduce and
    /// reduce-scatter fold every element in rank order (`Algorithm::Ordered`), so results are
    /// bitwise identical whatever the algorithm `WEFT_ALGO` or the tuner would pick, the slice
    /// size, the host layout, the transport, or CPU or GPU execution. Integers are exact anyway
    /// and keep the tuner's choice.
    pub deterministic: bool,
    /// Operations kept by the flight recorder (`WEFT_TRACE_BUFFER_SIZE`, default
    /// [`crate::trace::DEFAULT_TRACE_BUFFER`]; 0 records nothing).
    pub trace_buffer: usize,
    /// Where the flight recorder is written when the communicator fails
    /// (`WEFT_TRACE_DUMP_DIR`; unset: not written on failure). A job-wide request
    /// (`weft trace dump`) without a directory of its own writes here too.
    pub trace_dump_dir: Option<std::path::PathBuf>,
}

impl CommConfig {
    /// Defaults overridden by the environment (the settings of `weftcc-settings`).
    pub fn from_env() -> Result<CommConfig> {
        use weftcc_settings as s;
        let backoff = Backoff::default();
        let calibration = match s::CALIBRATION.path() {
            Some(path) => {
                let read = |e: String| s::CALIBRATION.invalid(&path.to_string_lossy(), e);
                let text = std::fs::read_to_string(&path).map_err(|e| read(e.to_string()))?;
                Some(Calibration::from_json(&text).map_err(|e| read(e.to_string()))?)
            }
            None => None,
        };
        let proto = Selection::from_setting(&s::PROTO).map_err(|e| Error::Config(e.to_string()))?;
        // Read again by each communicator's set-up; checked here so that a bad value fails
        // where every other setting does, before any rank waits for another.
        shm_low_latency_max(&proto)?;
        // The logger is installed without a way to fail: its level is checked here.
        s::DEBUG.choice()?;
        s::DEBUG_SUBSYS.parse(crate::logging::check_subsystems)?;
        Ok(CommConfig {
            timeout: env::timeout_from_env()?,
            shm_disable: s::SHM_DISABLE.flag()?,
            socket_ifname: s::SOCKET_IFNAME.value(),
            host_id: weftcc_topology::host_id(),
            buffsize: s::BUFFSIZE.size()?,
            split_share: s::SPLIT_SHARE.flag()?,
            deterministic: s::DETERMINISTIC.flag()?,
            one_shot_max: s::SHM_ONESHOT_MAX
                .size()?
                .unwrap_or(DEFAULT_ONE_SHOT_MAX_BYTES),
            net: weftcc_transports::net::NetChoice::from_env().map_err(config_error)?,
            stripes: weftcc_transports::tcp_stripes::StripePlan::from_env()
                .map_err(config_error)?,
            connect: s::CONNECT
                .parse(|v| ConnectMode::parse(v).map_err(|_| "eager or on-demand"))?
                .unwrap_or_default(),
            slice_bytes: s::SLICE_BYTES.size()?.unwrap_or(DEFAULT_SLICE_BYTES),
            algo: Selection::from_setting(&s::ALGO).map_err(|e| Error::Config(e.to_string()))?,
            proto,
            calibration,
            backoff: Backoff {
                spin: s::SPIN_US.micros()?.unwrap_or(backoff.spin),
                yield_for: s::YIELD_US.micros()?.unwrap_or(backoff.yield_for),
            },
            oversubscribed_spin: (!s::SPIN_US.is_set()).then_some(Duration::ZERO),
            pinned_max_bytes: s::SHM_CMA_MAX_OP.size()?,
            trace_buffer: s::TRACE_BUFFER_SIZE
                .number()?
                .map_or(crate::trace::DEFAULT_TRACE_BUFFER, |n| n as usize),
            trace_dump_dir: s::TRACE_DUMP_DIR.path(),
        })
    }
}

/// A transport's configuration error as the communicator's: a setting that does not parse
/// stays typed.
fn config_error(e: TransportError) -> Error {
    match e {
        TransportError::Setting(s) => Error::Setting(s),
        other => Error::Config(other.to_string()),
    }
}

/// The largest write shared memory sends as a low-latency message: `WEFT_SHM_LL_MAX` (default
/// [`weftcc_transports::shm::LL_MAX`]), or 0 when `proto` excludes `LL` for every collective.
pub(crate) fn shm_low_latency_max(proto: &Selection<Protocol>) -> Result<usize> {
    let ll_allowed = weftcc_topology::tuner::Collective::ALL
        .into_iter()
        .any(|c| proto.allows(c, Protocol::Ll));
    if ll_allowed {
        weftcc_transports::shm::ll_max_bytes().map_err(config_error)
    } else {
        Ok(0)
    }
}

/// Logs (once per process) that `WEFT_PROTO` excludes the only bulk protocol the CPU
/// transports implement for some collective.
pub(crate) fn warn_unimplemented_protocols(proto: &Selection<Protocol>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let excluded: Vec<&str> = weftcc_topology::tuner::Collective::ALL
        .into_iter()
        .filter(|&c| !proto.allows(c, Protocol::Simple))
        .map(|c| c.name())
        .collect();
    if !excluded.is_empty() {
        ONCE.call_once(|| {
            tracing::warn!(
                target: "weftcc::tuning",
                collectives = %excluded.join(","),
                "WEFT_PROTO excludes Simple, the only protocol of the CPU transports; ignored"
            );
        });
    }
}

/// The idle policy: spin briefly (a peer on another core answers within a microsecond), then
/// yield (a peer waiting for this core gets it), then sleep on the transport's waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub spin: Duration,
    pub yield_for: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        // Measured with 4 ranks on 2 cores (all-reduce, 8 B … 64 KiB): a long yield phase lets
        // the peer that holds the core run; sleeping early pays a futex wake-up per hop, and
        // spinning long starves the peer outright.
        Backoff {
            spin: Duration::from_micros(2),
            yield_for: Duration::from_micros(1000),
        }
    }
}

/// Default of `WEFT_SHM_ONESHOT_MAX` ([`CommConfig::one_shot_max`]): the most bytes a rank
/// reads of the others' contributions in a collective run one-shot. Reading another core's lines
/// is slower than a pipelined schedule once they are many (2-core VM, 2 ranks, alternating
/// rounds: one-shot faster up to 1 KiB of all-reduce, slower from 2 KiB on).
pub const DEFAULT_ONE_SHOT_MAX_BYTES: usize = 1024;

/// Broadcast's bound on single copy when [`CommConfig::pinned_max_bytes`] is `None`.
pub const DEFAULT_PINNED_MAX_BYTES: usize = 1 << 20;

/// Whether an operation of `kind` whose largest buffer has `largest` bytes sends pinned (see
/// [`CommConfig::pinned_max_bytes`]).
pub(crate) fn sends_pinned(kind: OpKind, largest: usize, bound: Option<usize>) -> bool {
    match kind {
        // Single copy pays where the receiver copies into place; a receiver that reduces copies
        // referenced bytes to a staging block first, and was measured slower.
        OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter | OpKind::Barrier => false,
        OpKind::Broadcast => largest <= bound.unwrap_or(DEFAULT_PINNED_MAX_BYTES),
        OpKind::AllGather | OpKind::AllToAll | OpKind::SendRecv => {
            bound.is_none_or(|b| largest <= b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_copy_bounds_per_collective() {
        let (big, mib) = (1usize << 30, DEFAULT_PINNED_MAX_BYTES);
        for kind in [OpKind::AllReduce, OpKind::Reduce, OpKind::ReduceScatter] {
            assert!(!sends_pinned(kind, 8, None) && !sends_pinned(kind, 8, Some(big)));
        }
        assert!(sends_pinned(OpKind::Broadcast, mib, None));
        assert!(!sends_pinned(OpKind::Broadcast, mib + 1, None));
        for kind in [OpKind::AllGather, OpKind::AllToAll, OpKind::SendRecv] {
            assert!(sends_pinned(kind, big, None));
            assert!(!sends_pinned(kind, mib + 1, Some(mib)));
        }
        assert!(sends_pinned(OpKind::Broadcast, big, Some(big)));
    }

    #[test]
    fn weft_proto_turns_shared_memory_low_latency_messages_off_only_when_excluded_everywhere() {
        let ll = weftcc_transports::shm::ll_max_bytes().expect("WEFT_SHM_LL_MAX");
        assert!(ll > 0);
        for (spec, want) in [
            ("", ll),
            ("LL,Simple", ll),
            ("allreduce:Simple", ll),
            ("Simple", 0),
            ("^LL", 0),
        ] {
            let proto = Selection::parse(spec).expect("spec");
            assert_eq!(
                shm_low_latency_max(&proto).expect("settings"),
                want,
                "WEFT_PROTO={spec:?}"
            );
        }
    }
}
