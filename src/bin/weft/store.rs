//! `weft store`: a job's bootstrap store as a process of its own (`serve`), and a load test of
//! a store with simulated ranks (`load`).

use crate::run::{signal_name, take_pending_signal};
use clap::{Args, Subcommand};
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use weftcc::comm::records::identity::{RankIdentity, WORLD_NAMESPACE};
use weftcc::comm::records::{progress_key, session_key, store_key, ABORT_KEY};
use weftcc_store::{StoreClient, StoreError};
use weftcc_transports::host_table;
use weftcc_transports::mesh::{addr_key, count_out};

#[derive(Args, Debug)]
pub struct StoreArgs {
    #[command(subcommand)]
    pub command: StoreCommand,
}

#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// Serve a bootstrap store until SIGINT or SIGTERM. Ranks started by any launcher meet there
    /// when their environment has WEFT_STORE=HOST:PORT and WEFT_JOB_TOKEN (both printed).
    Serve(ServeArgs),
    /// Load-test a store: simulated ranks in this one process (three connections each, as the
    /// library's ranks hold) run the store's part of the library's set-up; prints time, the
    /// store's peak memory and the bytes it sent, per rank count.
    Load(LoadArgs),
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "0.0.0.0:29400")]
    pub listen: SocketAddr,
    /// The job token clients must present. Default: WEFT_JOB_TOKEN, else a random one.
    #[arg(long)]
    pub token: Option<String>,
}

#[derive(Args, Debug)]
pub struct LoadArgs {
    /// Simulated ranks, a run per value.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384")]
    pub ranks: Vec<usize>,
    /// Threads driving the simulated ranks.
    #[arg(long, default_value_t = 64)]
    pub threads: usize,
    /// Store connections per simulated rank: 3 as the library's ranks hold (a set-up client, the
    /// failure watcher's session, the alarm), or 1 carrying all of a rank's requests (more ranks
    /// within a process's open-files limit).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub connections: u8,
    /// Seconds each run may take.
    #[arg(long, default_value = "120", value_parser = crate::job::seconds)]
    pub timeout: Duration,
}

pub fn main(args: StoreArgs) -> i32 {
    match args.command {
        StoreCommand::Serve(a) => serve(a),
        StoreCommand::Load(a) => load(a),
    }
}

/// Raises this process's open-files limit as far as it may go (root: the hard limit too), for
/// tens of thousands of connections; the limit in force.
fn raise_open_files() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return 0;
    };
    let want = (weftcc_store::MAX_CONNECTIONS as u64 + 1024).max(hard);
    if setrlimit(Resource::RLIMIT_NOFILE, want, want).is_ok() {
        return want;
    }
    if setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return hard;
    }
    soft
}

fn serve(args: ServeArgs) -> i32 {
    let token = args
        .token
        .or_else(|| weftcc::settings::JOB_TOKEN.value())
        .map_or_else(weftcc_transports::random_token, Ok);
    let token = match token {
        Ok(t) => t,
        Err(e) => {
            eprintln!("weft store serve: no job token: {e}");
            return 1;
        }
    };
    weftcc::comm::init_logging();
    let files = raise_open_files();
    crate::run::install_signal_handlers("weft store serve");
    let server = match weftcc::comm::serve_store(&args.listen.to_string(), &token) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("weft store serve: {e}");
            return 1;
        }
    };
    // The address ranks dial: the one asked for, or this host's chosen interface.
    let ip: IpAddr = if args.listen.ip().is_unspecified() {
        weftcc_transports::tcp::select_interface(
            weftcc::settings::SOCKET_IFNAME.value().as_deref(),
            None,
        )
        .map_or(args.listen.ip(), |i| i.addr)
    } else {
        args.listen.ip()
    };
    let addr = weftcc::comm::join_host_port(&ip.to_string(), server.local_addr().port());
    // Whoever started it may stop reading: the store goes on serving.
    let say = |line: String| {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
    };
    say(format!("WEFT_STORE={addr}"));
    say(format!("WEFT_JOB_TOKEN={token}"));
    eprintln!("weft store serve: serving at {addr} (open-files limit {files}); SIGINT or SIGTERM stops it");
    loop {
        if let Some(sig) = take_pending_signal() {
            let t = server.traffic();
            eprintln!("weft store serve: {}: stopping", signal_name(sig));
            // For `weft store load`, which reads it from the last line.
            say(format!(
                "served {} requests, sent {} B, received {} B, at most {} connections",
                t.requests, t.sent, t.received, t.peak_connections
            ));
            server.shutdown();
            return 0;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One load run's figures.
struct Figures {
    ranks: usize,
    seconds: f64,
    peak_rss_kib: u64,
    sent_bytes: u64,
    received_bytes: u64,
    requests: u64,
    peak_connections: u64,
    threads: u64,
}

fn load(args: LoadArgs) -> i32 {
    raise_open_files();
    println!(
        "# weft store load: simulated ranks in one process, {} store connection(s) each; the \
         store in a `weft store serve` child per run",
        args.connections
    );
    println!(
        "{:>7} {:>7} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "ranks",
        "conns",
        "time-s",
        "requests",
        "sent-KiB",
        "recv-KiB",
        "sent-B/rk",
        "RSS-MiB",
        "RSS-KiB/rk",
        "threads"
    );
    for &n in &args.ranks {
        match load_run(n, args.connections, args.threads.max(1), args.timeout) {
            Ok(f) => println!(
                "{:>7} {:>7} {:>8.2} {:>9} {:>10.1} {:>10.1} {:>10.0} {:>10.1} {:>10.2} {:>8}",
                f.ranks,
                f.peak_connections,
                f.seconds,
                f.requests,
                f.sent_bytes as f64 / 1024.0,
                f.received_bytes as f64 / 1024.0,
                f.sent_bytes as f64 / f.ranks as f64,
                f.peak_rss_kib as f64 / 1024.0,
                f.peak_rss_kib as f64 / f.ranks as f64,
                f.threads
            ),
            Err(e) => {
                eprintln!("weft store load: {n} ranks: {e}");
                return 1;
            }
        }
    }
    0
}

/// The store child: `weft store serve` on a free loopback port.
struct StoreChild {
    child: Child,
    addr: String,
    out: BufReader<std::process::ChildStdout>,
}

/// What the store child used and served in a run.
struct Usage {
    peak_rss_kib: u64,
    threads: u64,
    /// The numbers of its last line: requests, bytes sent, bytes received, most connections.
    served: Vec<u64>,
}

impl StoreChild {
    fn start(token: &str) -> Result<StoreChild, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args([
                "store",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--token",
                token,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting weft store serve: {e}"))?;
        let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        let addr = line
            .trim()
            .strip_prefix("WEFT_STORE=")
            .ok_or_else(|| format!("weft store serve said {line:?}"))?
            .to_string();
        Ok(StoreChild { child, addr, out })
    }

    /// Stops the store and says what it used and served.
    fn finish(mut self) -> Usage {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        let (peak_rss_kib, threads) = (field("VmHWM:"), field("Threads:"));
        self.stop();
        let mut last = String::new();
        for line in (&mut self.out).lines().map_while(Result::ok) {
            last = line;
        }
        let served = last
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        let _ = self.child.wait();
        Usage {
            peak_rss_kib,
            threads,
            served,
        }
    }

    fn stop(&self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
}

impl Drop for StoreChild {
    fn drop(&mut self) {
        self.stop();
        let _ = self.child.wait();
    }
}

/// A simulated rank's three connections, as `Communicator::build` makes them.
struct SimRank {
    rank: usize,
    client: StoreClient,
    /// The watcher's session; `None`: on `client`.
    watch: Option<StoreClient>,
    _alarm: Option<StoreClient>,
}

impl SimRank {
    fn watch(&mut self) -> &mut StoreClient {
        self.watch.as_mut().unwrap_or(&mut self.client)
    }
}

fn load_run(
    n: usize,
    connections: u8,
    threads: usize,
    timeout: Duration,
) -> Result<Figures, String> {
    let token = weftcc_transports::random_token().map_err(|e| e.to_string())?;
    let store = StoreChild::start(&token)?;
    let ns = WORLD_NAMESPACE;
    let start = Instant::now();
    let failed: Vec<String> = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads.min(n))
            .map(|t| {
                let (addr, token) = (&store.addr, &token);
                std::thread::Builder::new()
                    .stack_size(1 << 20)
                    .spawn_scoped(sc, move || {
                        // Rank 0 last: its waits need every other rank's requests.
                        let mine: Vec<usize> = (t..n).step_by(threads).rev().collect();
                        simulate(&mine, (n, connections), ns, addr, token, timeout)
                            .err()
                            .map(|e| format!("thread {t}: {e}"))
                    })
                    .expect("spawn a load thread")
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().unwrap_or(Some("a load thread panicked".into())))
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    if !failed.is_empty() {
        // The first to fail makes others fail (its ranks' sessions close): say them all.
        return Err(failed.join("; "));
    }
    let usage = store.finish();
    let [requests, sent_bytes, received_bytes, peak_connections] = usage.served[..] else {
        return Err(format!(
            "the store did not say what it served: {:?}",
            usage.served
        ));
    };
    Ok(Figures {
        ranks: n,
        seconds,
        peak_rss_kib: usage.peak_rss_kib,
        sent_bytes,
        received_bytes,
        requests,
        peak_connections,
        threads: usage.threads,
    })
}

/// The store's part of the set-up of `ranks` (of `n`), phase by phase as a rank runs it:
/// connections and session, the published addresses and host entry, rank 0 gathering the host
/// table and the others their tree parent's address, the closing count-out, the watcher's first
/// round, and leaving.
fn simulate(
    ranks: &[usize],
    (n, connections): (usize, u8),
    ns: &str,
    addr: &str,
    token: &str,
    timeout: Duration,
) -> Result<(), StoreError> {
    let deadline = weftcc_transports::Deadline::after(timeout);
    let entry = weftcc_transports::dial::PeerHost::this_process("load", true);
    let fake: SocketAddr = "127.0.0.1:9".parse().expect("an address");
    let mut sims = Vec::with_capacity(ranks.len());
    let connect = || StoreClient::connect(addr, token, timeout);
    for &rank in ranks {
        let client = connect()?;
        let watch = if connections > 1 {
            Some(connect()?)
        } else {
            None
        };
        let alarm = if connections > 2 {
            Some(connect()?)
        } else {
            None
        };
        let mut sim = SimRank {
            rank,
            client,
            watch,
            _alarm: alarm,
        };
        sim.watch().name_session(
            &session_key(ns, rank),
            RankIdentity::this_process(n).encode().as_bytes(),
        )?;
        sim.client
            .set(&addr_key(ns, rank), fake.to_string().as_bytes())?;
        host_table::publish(&mut sim.client, ns, rank, &entry, fake).map_err(store_error)?;
        sims.push(sim);
    }
    for s in &mut sims {
        if s.rank == 0 {
            host_table::root_table(&mut s.client, ns, n, &deadline).map_err(store_error)?;
        } else {
            host_table::parent_address(&mut s.client, ns, s.rank, &deadline)
                .map_err(store_error)?;
        }
        s.client.add(&format!("{ns}/hosts-read"), 1)?;
    }
    for s in &mut sims {
        count_out(&mut s.client, ns, "mesh", n, s.rank == 0, timeout).map_err(store_error)?;
    }
    for s in &mut sims {
        let rank = s.rank;
        s.watch().set(&progress_key(ns, rank), b"0")?;
        match s.watch().get(&store_key(ns, ABORT_KEY), Duration::ZERO) {
            Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(e),
            Ok(_) => return Err(StoreError::Protocol("an abort was published".into())),
        }
        let mut left = RankIdentity::this_process(n);
        left.left = true;
        s.watch()
            .name_session(&session_key(ns, rank), left.encode().as_bytes())?;
    }
    Ok(())
}

/// A transport error of the simulated set-up as the store error it is.
fn store_error(e: weftcc_transports::TransportError) -> StoreError {
    match e {
        weftcc_transports::TransportError::Store(e) => e,
        e => StoreError::Protocol(e.to_string()),
    }
}
