//! Shared helpers for integration tests: run N ranks as threads of this process.
#![allow(dead_code)]

use std::time::Duration;
use weftcc::{CommConfig, Communicator};

/// Which transport the ranks use between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Shm,
    Tcp,
    /// TCP over four sockets per peer on two helper threads, with stripes of 4 KiB so that
    /// messages cross sockets all the time (`WEFT_SOCKET_NTHREADS=2 WEFT_NSOCKS_PERTHREAD=2`).
    TcpStriped,
    /// Every rank a "host" of its own, connected through the network provider path
    /// (`NetConnection`) over libfabric's tcp provider (`WEFT_NET=ofi WEFT_OFI_PROVIDER=tcp`).
    Net,
    /// As `Net`, over the in-memory fabric of this process (`WEFT_NET=loopback`): the network
    /// path with no device and no libfabric.
    NetLoopback,
    /// As `Net`, over the verbs provider on the emulated RDMA device (`WEFT_NET=ib
    /// WEFT_IB_LIBRARY=<the emulator this build made>`): queue pairs, keys and completions
    /// through the shim, packets over the emulated NIC's Unix socket.
    NetVerbs,
}

/// Whether `wire`'s prerequisite is here: libfabric's tcp provider for `Wire::Net`, the
/// emulated RDMA device for `Wire::NetVerbs`. When it is not, the test skips saying so, or
/// fails where `WEFT_REQUIRE_NET_TESTS=1` (CI).
pub fn wire_available(wire: Wire) -> bool {
    let missing = match wire {
        Wire::Net => match weftcc::transports::net::ofi::OfiProvider::open(Some("tcp"), false) {
            Ok(_) => None,
            Err(e) => Some(format!("libfabric's tcp provider is not usable here: {e}")),
        },
        Wire::NetVerbs => match weftcc::transports::net::verbs::EMULATOR {
            Some(_) => None,
            None => Some(
                "the emulated RDMA device was not built (install libibverbs-dev and rebuild)"
                    .to_string(),
            ),
        },
        _ => None,
    };
    let Some(why) = missing else { return true };
    assert!(
        !weftcc_settings::REQUIRE_NET_TESTS.flag().unwrap_or(true),
        "WEFT_REQUIRE_NET_TESTS=1 and {why}"
    );
    println!("SKIPPED: {why}");
    false
}

/// Whether libfabric's tcp provider opens here ([`wire_available`] for `Wire::Net`).
pub fn net_available() -> bool {
    wire_available(Wire::Net)
}

pub fn config(wire: Wire) -> CommConfig {
    let mut c = CommConfig::from_env().expect("config from env");
    c.shm_disable = matches!(wire, Wire::Tcp | Wire::TcpStriped);
    if wire == Wire::TcpStriped {
        c.stripes = weftcc::transports::tcp_stripes::StripePlan::new(2, 2)
            .and_then(|p| p.with_stripe(4096))
            .expect("stripe plan");
    }
    c.timeout = Duration::from_secs(120);
    c.host_id = "test-host".into();
    if wire == Wire::Net {
        c.net = weftcc::transports::net::NetChoice {
            kind: weftcc::transports::net::NetKind::Ofi,
            ofi_provider: Some("tcp".into()),
            // The matrix covers the rendezvous path too (off by default).
            rendezvous: weftcc::transports::net::stream::TEST_RENDEZVOUS,
            ..weftcc::transports::net::NetChoice::default()
        };
    }
    if wire == Wire::NetVerbs {
        let mut verbs = weftcc::transports::net::verbs::VerbsConfig {
            library: weftcc::transports::net::verbs::EMULATOR.map(Into::into),
            ..c.net.verbs.clone()
        };
        if !weftcc_settings::IB_TIMEOUT.is_set() {
            // 4.096 µs × 2^14 ≈ 67 ms per retry: a lost peer fails within a second.
            verbs.timeout = 14;
        }
        c.net = weftcc::transports::net::NetChoice {
            kind: weftcc::transports::net::NetKind::Ib,
            verbs,
            rendezvous: weftcc::transports::net::stream::TEST_RENDEZVOUS,
            ..weftcc::transports::net::NetChoice::default()
        };
    }
    if wire == Wire::NetLoopback {
        c.net = weftcc::transports::net::NetChoice {
            kind: weftcc::transports::net::NetKind::Loopback,
            ..weftcc::transports::net::NetChoice::default()
        };
    }
    c
}

/// [`config`] for `rank`: over `Wire::Net` and `Wire::NetLoopback` every rank is a host of
/// its own.
pub fn rank_config(wire: Wire, rank: usize) -> CommConfig {
    let mut c = config(wire);
    if matches!(wire, Wire::Net | Wire::NetLoopback | Wire::NetVerbs) {
        c.host_id = format!("net-host-{rank}");
    }
    c
}

/// Creates `n` communicators (one per thread), runs `body(rank, &comm)` on each and returns
/// their results in rank order. Panics from a rank are re-raised with the rank named.
pub fn with_ranks<R: Send>(
    n: usize,
    wire: Wire,
    body: impl Fn(usize, &Communicator) -> R + Sync,
) -> Vec<R> {
    with_ranks_configs(n, |rank| rank_config(wire, rank), body)
}

pub fn with_ranks_config<R: Send>(
    n: usize,
    cfg: CommConfig,
    body: impl Fn(usize, &Communicator) -> R + Sync,
) -> Vec<R> {
    with_ranks_configs(n, |_| cfg.clone(), body)
}

/// Like [`with_ranks_config`] with a configuration per rank (e.g. a host id per rank, so that
/// ranks of different "hosts" use TCP between them and shared memory inside).
pub fn with_ranks_configs<R: Send>(
    n: usize,
    cfg: impl Fn(usize) -> CommConfig + Sync,
    body: impl Fn(usize, &Communicator) -> R + Sync,
) -> Vec<R> {
    weftcc::comm::run_ranks(n, cfg, |rank, comm| body(rank, &comm))
        .unwrap_or_else(|e| panic!("ranks: {e}"))
}

/// Whether this process's effective user id is 0 (from /proc, without unsafe code).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// What this process holds that a communicator could leak: open file descriptors and threads.
pub fn held_by_process() -> (usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
    (count("/proc/self/fd"), count("/proc/self/task"))
}

/// [`held_by_process`] and weftcc's /dev/shm entries (those are the machine's: only for a test
/// binary that runs nothing else at the same time).
pub fn held() -> (usize, usize, usize) {
    let (fds, threads) = held_by_process();
    let shm = std::fs::read_dir("/dev/shm").map_or(0, |d| {
        d.filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("weft"))
            .count()
    });
    (fds, threads, shm)
}

/// Waits up to `limit` for `probe` to give `before` again (helper threads end shortly after
/// their communicator); returns what it gives then.
pub fn held_again<T: PartialEq>(before: T, probe: fn() -> T, limit: Duration) -> T {
    let deadline = std::time::Instant::now() + limit;
    let mut now = probe();
    while now != before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        now = probe();
    }
    now
}

/// For a child process in a fault test: prints `{prefix}CLEAN` once this process holds the
/// descriptors and threads it held `before` its communicator was made (helper threads may take
/// a moment to see their sockets close), else `{prefix}LEAK ...`.
pub fn report_clean(before: (usize, usize), prefix: &str) {
    let after = held_again(before, held_by_process, Duration::from_secs(3));
    if after == before {
        println!("{prefix}CLEAN");
    } else {
        println!("{prefix}LEAK fds, threads {before:?} -> {after:?}");
    }
}
