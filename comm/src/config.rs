//! A communicator's settings, from the `WEFT_*` variables or given explicitly.

use crate::env;
use crate::error::{Error, Result};
use std::time::Duration;
use weftcc_collectives::{Algorithm, OpKind};
use weftcc_topology::tuner::{Calibration, Protocol, Selection};
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
    /// Defaults overridden by the environment.
    pub fn from_env() -> Result<CommConfig> {
        let size = |name: &str, default: usize| -> Result<usize> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => parse_size(&v)
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| Error::Config(format!("{name}={v:?} is not a positive size"))),
                _ => Ok(default),
            }
        };
        let micros = |name: &str, default: Duration| -> Result<Duration> {
            match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => v
                    .trim()
                    .parse::<u64>()
                    .map(Duration::from_micros)
                    .map_err(|_| {
                        Error::Config(format!("{name}={v:?} is not a number of microseconds"))
                    }),
                _ => Ok(default),
            }
        };
        Ok(CommConfig {
            timeout: env::timeout_from_env()?,
            shm_disable: env::flag("WEFT_SHM_DISABLE"),
            socket_ifname: std::env::var("WEFT_SOCKET_IFNAME")
                .ok()
                .filter(|s| !s.is_empty()),
            host_id: weftcc_topology::host_id(),
            buffsize: match std::env::var("WEFT_BUFFSIZE") {
                Ok(v) if !v.trim().is_empty() => Some(size("WEFT_BUFFSIZE", 0)?),
                _ => None,
            },
            split_share: env::flag("WEFT_SPLIT_SHARE"),
            deterministic: env::flag("WEFT_DETERMINISTIC"),
            net: weftcc_transports::net::NetChoice::from_env()
                .map_err(|e| Error::Config(e.to_string()))?,
            stripes: weftcc_transports::tcp_stripes::StripePlan::from_env()
                .map_err(|e| Error::Config(e.to_string()))?,
            connect: match std::env::var("WEFT_CONNECT") {
                Ok(v) if !v.trim().is_empty() => {
                    ConnectMode::parse(&v).map_err(|e| Error::Config(e.to_string()))?
                }
                _ => ConnectMode::default(),
            },
            slice_bytes: size("WEFT_SLICE_BYTES", DEFAULT_SLICE_BYTES)?,
            algo: Selection::from_env("WEFT_ALGO").map_err(|e| Error::Config(e.to_string()))?,
            proto: Selection::from_env("WEFT_PROTO").map_err(|e| Error::Config(e.to_string()))?,
            calibration: match std::env::var("WEFT_CALIBRATION") {
                Ok(path) if !path.trim().is_empty() => {
                    let text = std::fs::read_to_string(path.trim())
                        .map_err(|e| Error::Config(format!("WEFT_CALIBRATION={path:?}: {e}")))?;
                    Some(
                        Calibration::from_json(&text).map_err(|e| {
                            Error::Config(format!("WEFT_CALIBRATION={path:?}: {e}"))
                        })?,
                    )
                }
                _ => None,
            },
            backoff: Backoff {
                spin: micros("WEFT_SPIN_US", Backoff::default().spin)?,
                yield_for: micros("WEFT_YIELD_US", Backoff::default().yield_for)?,
            },
            oversubscribed_spin: match std::env::var("WEFT_SPIN_US") {
                Ok(v) if !v.trim().is_empty() => None,
                _ => Some(Duration::ZERO),
            },
            pinned_max_bytes: match std::env::var("WEFT_SHM_CMA_MAX_OP") {
                Ok(v) if !v.trim().is_empty() => Some(size("WEFT_SHM_CMA_MAX_OP", 0)?),
                _ => None,
            },
            trace_buffer: match std::env::var("WEFT_TRACE_BUFFER_SIZE") {
                Ok(v) if !v.trim().is_empty() => v.trim().parse::<usize>().map_err(|_| {
                    Error::Config(format!(
                        "WEFT_TRACE_BUFFER_SIZE={v:?} is not a number of operations"
                    ))
                })?,
                _ => crate::trace::DEFAULT_TRACE_BUFFER,
            },
            trace_dump_dir: std::env::var_os("WEFT_TRACE_DUMP_DIR")
                .filter(|d| !d.is_empty())
                .map(std::path::PathBuf::from),
        })
    }
}

/// The largest write shared memory sends as a low-latency message: `WEFT_SHM_LL_MAX` (default
/// [`weftcc_transports::shm::LL_MAX`]), or 0 when `proto` excludes `LL` for every collective.
pub(crate) fn shm_low_latency_max(proto: &Selection<Protocol>) -> usize {
    let ll_allowed = weftcc_topology::tuner::Collective::ALL
        .into_iter()
        .any(|c| proto.allows(c, Protocol::Ll));
    if ll_allowed {
        weftcc_transports::shm::ll_max_bytes()
    } else {
        0
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
        let ll = weftcc_transports::shm::ll_max_bytes();
        assert!(ll > 0);
        for (spec, want) in [
            ("", ll),
            ("LL,Simple", ll),
            ("allreduce:Simple", ll),
            ("Simple", 0),
            ("^LL", 0),
        ] {
            let proto = Selection::parse(spec).expect("spec");
            assert_eq!(shm_low_latency_max(&proto), want, "WEFT_PROTO={spec:?}");
        }
    }
}
