//! `weft run`: a torchrun-compatible launcher.
//!
//! Starts `nproc_per_node` workers on this node, each with the environment torchrun would give it
//! (plus weftcc's own `WEFT_*` variables), forwards their output line by line with a `[rank]: `
//! prefix, and watches them: when one fails, the others are stopped (SIGTERM, then SIGKILL after
//! a grace period) and the job is either restarted (`--max-restarts`) or ends with the failed
//! worker's exit code. With `--elastic` a worker killed by a signal is a lost rank: the others go
//! on (they shrink), the job's store stays up, and a replacement is started for it
//! (`--max-replacements`) that joins the running job by grow.
//!
//! Nothing here blocks without a bound: worker exits are polled, every stop escalates to SIGKILL
//! after a grace period, and output readers are waited for only briefly after the workers exit
//! (a grandchild that keeps a pipe open cannot hold the launcher).

// The launcher's two OS-edge `unsafe` calls (signal handler, pre-exec hook), each with its
// `// SAFETY:` comment; the rest of the binary stays free of `unsafe`.
#[allow(unsafe_code)]
mod process;

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
pub use process::take_pending_signal;
use process::{catch_termination_signals, launch_as_worker};
use weftcc_transports::shm::remove_orphan_segments;

/// How long stopped workers get between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(3);
/// How long to wait for workers to disappear after SIGKILL before giving up on them.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long to wait for output readers to drain after every worker has exited.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Longest node 0's launcher keeps the job's store up after its own workers ended, while
/// ranks of other nodes still hold connections to it.
const STORE_LINGER: Duration = Duration::from_secs(5);
/// Interval of the exit-polling loop.
const POLL: Duration = Duration::from_millis(5);
/// How long replacements that are still waiting to join may outlive the job's other workers
/// (once one of those ended well) before they are stopped: a joined one ends with the others.
const JOINER_LINGER: Duration = Duration::from_secs(3);
/// The rendezvous port of multi-node jobs that name none (torchrun's).
pub const DEFAULT_PORT: u16 = 29500;

const AFTER_HELP: &str = "\
Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS, OMP_NUM_THREADS=1 (if unset) and weftcc's WEFT_RANK, WEFT_WORLD_SIZE,
WEFT_LOCAL_RANK, WEFT_LOCAL_WORLD_SIZE, WEFT_MASTER_ADDR, WEFT_MASTER_PORT, WEFT_JOB_TOKEN and
WEFT_STORE. Workers run in their own process groups with stdin from /dev/null, and die with the
launcher.

The job's bootstrap store (where ranks meet, publish failures and progress) is served by the
launcher of node 0 on --master-port, not by rank 0, so that any rank's death leaves it up; the
workers find it through WEFT_STORE. With WEFT_STORE set in the launcher's environment (a store
started by `weft store serve`), that one is used and no launcher serves one.

WEFT_JOB_TOKEN: taken from the launcher's environment when set there; otherwise a fresh random
token per attempt on a single node. Multi-node jobs (--nnodes > 1) should set WEFT_JOB_TOKEN to
the same secret value on every node: without it the token is derived from --master-addr and
--master-port (and the restart count), which any process that knows them can reproduce.

When a worker exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL after
3 s; the launcher then restarts all workers (up to --max-restarts times) or exits with the failed
worker's code (128+N for signal N). SIGINT/SIGTERM/SIGHUP to the launcher are forwarded.

--elastic (with `weft train --elastic` or another program that shrinks and grows its
communicator): a worker killed by a signal is a lost rank; the others are not stopped, and up to
--max-replacements replacements are started, each with the others' environment (WEFT_STORE,
WEFT_JOB_TOKEN, …) but no rank (no RANK, WEFT_RANK, LOCAL_RANK, WEFT_LOCAL_RANK, ROLE_RANK) and
WEFT_ELASTIC_JOIN=1; their output is prefixed `[+K]: `. A worker that exits non-zero does not
stop the others either, but makes the job's exit code its own. The job exits 0 when every worker
not lost exited 0; replacements still waiting to join 3 s after the others ended are stopped.";

/// Command-line arguments of `weft run`.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct RunArgs {
    /// Workers to start on this node (a number, or `auto`/`cpu` for the number of CPUs).
    #[arg(short = 'n', long, visible_alias = "nproc_per_node", default_value = "1", value_parser = parse_nproc)]
    pub nproc_per_node: usize,
    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub nnodes: u32,
    /// Rank of this node, 0 <= K < nnodes.
    #[arg(long, visible_alias = "node_rank", default_value_t = 0)]
    pub node_rank: u32,
    /// Address of node 0 (its launcher serves the job's bootstrap store).
    #[arg(long, visible_alias = "master_addr", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the job's bootstrap store on node 0. Default: a free port on a single
    /// node, 29500 with --nnodes > 1 (every node must give the same); 0 picks a free port
    /// (single-node jobs only).
    #[arg(long, visible_alias = "master_port")]
    pub master_port: Option<u16>,
    /// Do not prefix worker output with `[rank]: `; workers inherit stdout and stderr.
    #[arg(long)]
    pub no_prefix: bool,
    /// Restart all workers up to R times when one fails.
    #[arg(long, visible_alias = "max_restarts", default_value_t = 0)]
    pub max_restarts: u32,
    /// A worker killed by a signal is a lost rank: the others go on (see below).
    #[arg(long)]
    pub elastic: bool,
    /// With --elastic: start at most N replacements for lost ranks in the whole job.
    #[arg(long = "max-replacements", default_value_t = 0, requires = "elastic")]
    pub max_replacements: u32,
    /// Where workers run. `share` (the default): each worker gets its own equal block of the
    /// CPUs this launcher may use (one CPU each when there are as many workers as CPUs), so two
    /// ranks never share a CPU while another is idle; more workers than CPUs stay unbound.
    /// `core`: local rank k on the k-th CPU (like `mpirun --bind-to core`; with a multiple of
    /// the CPUs' count, dealt round-robin). `none`: placement left to the kernel (torchrun's).
    #[arg(long, value_enum, env = "WEFT_CPU_BIND", default_value = "share")]
    pub cpu_bind: CpuBind,
    /// The worker program and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROG"
    )]
    pub command: Vec<OsString>,
}

fn parse_nproc(s: &str) -> Result<usize, String> {
    match s {
        "auto" | "cpu" => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
        _ => match s.parse::<usize>() {
            Ok(0) => Err("must be at least 1".to_string()),
            Ok(n) => Ok(n),
            Err(_) => Err(format!("expected a number, `auto` or `cpu`, got {s:?}")),
        },
    }
}

/// Entry point of `weft run`.
pub fn main(args: RunArgs) -> i32 {
    let mut command = args.command.into_iter();
    let Some(program) = command.next() else {
        eprintln!("weft run: no program given");
        return 2;
    };
    let launch = Launch {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes as usize,
        node_rank: args.node_rank as usize,
        master_addr: args.master_addr,
        // One node: nobody else needs to know the port, so two jobs on one host never collide.
        master_port: args
            .master_port
            .unwrap_or(if args.nnodes == 1 { 0 } else { DEFAULT_PORT }),
        prefix: !args.no_prefix,
        max_restarts: args.max_restarts,
        elastic: args.elastic.then_some(args.max_replacements),
        cpu_bind: args.cpu_bind,
        program,
        args: command.collect(),
        label: "weft run",
    };
    if let Err(msg) = launch.validate() {
        eprintln!("weft run: {msg}");
        return 2;
    }
    launch.run()
}

/// A job to launch on this node.
#[derive(Debug, Clone)]
pub struct Launch {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// 0: pick a free port for every attempt.
    pub master_port: u16,
    pub prefix: bool,
    pub max_restarts: u32,
    /// Elastic: how many replacements for lost ranks may be started (none: not elastic).
    pub elastic: Option<u32>,
    pub cpu_bind: CpuBind,
    pub program: OsString,
    pub args: Vec<OsString>,
    /// Names the launcher in its messages (`weft run`, `weft perf`).
    pub label: &'static str,
}

/// `WEFT_SPIN_US` given to workers that have CPUs of their own (unless the user set it).
const BOUND_SPIN_US: &str = "20";

/// Where workers may run.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuBind {
    /// No binding: the kernel places and migrates workers.
    None,
    /// One CPU per worker, in the order of the CPUs the launcher may use.
    Core,
    /// Each worker its own equal block of the CPUs the launcher may use.
    Share,
}

/// The CPUs of each local worker under `bind`, or `None` where workers stay unbound.
///
/// `Core`: one CPU each; with more workers than `allowed` CPUs they are dealt round-robin
/// (worker k on CPU k mod n) when that loads every CPU equally, and left to the kernel
/// otherwise. Measured (docs/performance.md): 4 ranks dealt over 2 CPUs ran small collectives as
/// fast as or faster than unbound, and steadier; 3 ranks on 2 CPUs ran slower bound (one CPU
/// carried two of them). mpirun refuses to bind oversubscribed ranks at all.
///
/// `Share`: with at most as many workers as CPUs, worker k gets the k-th of `workers` disjoint
/// blocks of consecutive allowed CPUs (the first `n mod workers` one CPU larger); more workers
/// stay unbound. Unbound ranks that sleep and wake each other were put on one CPU by the
/// kernel's wake-up placement whenever another program kept the other CPU busy: an 8-byte
/// all-reduce then took 5 µs instead of 0.5, one context switch per exchange (issue 44).
pub fn cpu_plan(bind: CpuBind, workers: usize, allowed: &[usize]) -> Option<Vec<Vec<usize>>> {
    let n = allowed.len();
    match bind {
        CpuBind::Core if n > 0 && (workers <= n || workers.is_multiple_of(n)) => {
            Some((0..workers).map(|k| vec![allowed[k % n]]).collect())
        }
        CpuBind::Share if workers > 0 && workers <= n => {
            let (each, extra) = (n / workers, n % workers);
            let start = |k: usize| k * each + k.min(extra);
            Some(
                (0..workers)
                    .map(|k| allowed[start(k)..start(k + 1)].to_vec())
                    .collect(),
            )
        }
        _ => None,
    }
}

/// The CPUs this process may run on, in ascending order.
fn allowed_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// How one attempt ended.
enum Outcome {
    /// Every worker exited with code 0.
    Success,
    /// A worker failed; the value is the exit code to report.
    Failed(i32),
    /// The launcher was told to stop (signal) or could not start the job: no restart.
    Fatal(i32),
}

/// Catches SIGINT, SIGTERM and SIGHUP for [`take_pending_signal`]; `label` names the command in
/// what it says when it cannot.
pub fn install_signal_handlers(label: &str) {
    for (sig, e) in catch_termination_signals() {
        eprintln!("{label}: cannot install a handler for {sig}: {e}");
    }
}

/// `SIGKILL`-style name of a signal number, or `signal N`.
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_string())
}

/// The exit code a shell would report for this status (128+N for signal N).
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

/// "exited with code 3" / "was killed by signal 9 (SIGKILL)".
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        (None, None) => format!("ended with status {status}"),
    }
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// The `WEFT_*` settings of this environment (the workers inherit it) that weftcc would
/// refuse, one message each: values that do not fit their kind, then the first a
/// communicator's configuration refuses (text in a grammar of its own: `WEFT_ALGO`, …).
pub fn check_settings() -> Vec<String> {
    let bad: Vec<String> = weftcc::settings::check_all()
        .iter()
        .map(ToString::to_string)
        .collect();
    if !bad.is_empty() {
        return bad;
    }
    match weftcc::CommConfig::from_env() {
        Ok(_) => Vec::new(),
        Err(e) => vec![e.to_string()],
    }
}

/// A free TCP port on `addr` (or on 127.0.0.1 when `addr` cannot be bound here).
pub fn pick_free_port(addr: &str) -> io::Result<u16> {
    let bind = |a: &str| {
        TcpListener::bind((a, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
    };
    bind(addr).or_else(|_| bind("127.0.0.1"))
}

/// 64-bit FNV-1a, stable across builds and machines (unlike std's hasher).
fn fnv1a64(seed: u64, data: &[u8]) -> u64 {
    data.iter().fold(seed, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A token every node derives identically from the rendezvous address (multi-node jobs without
/// WEFT_JOB_TOKEN): not secret, but distinct per job endpoint and attempt.
pub fn derived_token(addr: &str, port: u16, attempt: u32) -> String {
    let text = format!("weftcc-job|{addr}|{port}|{attempt}");
    let hi = fnv1a64(0xcbf2_9ce4_8422_2325, text.as_bytes());
    let lo = fnv1a64(0x6c62_272e_07bb_0142, text.as_bytes());
    format!("{hi:016x}{lo:016x}")
}

/// One started worker.
struct Worker {
    /// "rank 3", "replacement 1".
    name: String,
    /// A replacement (elastic) that joins by grow.
    replacement: bool,
    cpus: Option<Vec<usize>>,
    child: Child,
    status: Option<ExitStatus>,
}

/// The variables of a worker's environment that give it a rank: a replacement has none.
const RANK_VARS: [&str; 5] = [
    "RANK",
    "LOCAL_RANK",
    "ROLE_RANK",
    "WEFT_RANK",
    "WEFT_LOCAL_RANK",
];

impl Worker {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Signal the worker's process group (it is the group leader), falling back to the worker.
    fn signal(&self, sig: Signal) {
        if self.status.is_some() {
            return;
        }
        let pid = self.pid() as i32;
        if signal::killpg(Pid::from_raw(pid), sig).is_err() {
            let _ = signal::kill(Pid::from_raw(pid), sig);
        }
    }
}

/// Forwards one pipe of a worker, line by line, with `prefix`, to our stdout or stderr.
fn forward_lines(pipe: impl Read, prefix: String, to_stderr: bool, done: mpsc::Sender<()>) {
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut line = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {
                out.clear();
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                if !line.ends_with(b"\n") {
                    out.push(b'\n');
                }
                // One write under the lock: lines of different workers never interleave. Errors
                // (a closed terminal, EPIPE) are ignored so the worker never blocks on its pipe.
                if to_stderr {
                    let _ = io::stderr().lock().write_all(&out);
                } else {
                    let mut stdout = io::stdout().lock();
                    let _ = stdout.write_all(&out).and_then(|_| stdout.flush());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    let _ = done.send(());
}

impl Launch {
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Checks the combination of options.
    pub fn validate(&self) -> Result<(), String> {
        if self.nproc_per_node == 0 {
            return Err("--nproc-per-node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return Err("--nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return Err(format!(
                "--node-rank {} is out of range for --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.master_port == 0 && self.nnodes > 1 {
            return Err(
                "--master-port 0 (pick a free port) only works with --nnodes 1: the other nodes \
                 could not know the port"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether rank 0 (started on this node) will be able to serve its bootstrap store on
    /// `port`: a port another job's store holds fails here, with what to do, instead of in
    /// every rank.
    fn port_is_free(&self, port: u16) -> Result<(), String> {
        // As the store binds it: every address, reusing a port in TIME_WAIT.
        match TcpListener::bind(("0.0.0.0", port)) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => Err(format!(
                "port {port} (--master-port) is in use on this host, perhaps by another job's \
                 store; {}",
                if self.nnodes == 1 {
                    "leave --master-port out or give --master-port 0 to pick a free port"
                } else {
                    "give every node the same free --master-port"
                }
            )),
            // Anything else (no IPv4 here, say) is rank 0's to report.
            Err(_) => Ok(()),
        }
    }

    /// The environment of worker `local` in attempt `attempt`.
    pub fn worker_env(
        &self,
        local: usize,
        attempt: u32,
        port: u16,
        token: &str,
        store: &str,
    ) -> Vec<(String, String)> {
        let n = self.nproc_per_node;
        let rank = self.node_rank * n + local;
        let world = self.world_size();
        let mut env: Vec<(String, String)> = vec![
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_WORLD_SIZE", n.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_NAME", "default".to_string()),
            ("ROLE_WORLD_SIZE", world.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", port.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", attempt.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("WEFT_RANK", rank.to_string()),
            ("WEFT_WORLD_SIZE", world.to_string()),
            ("WEFT_LOCAL_RANK", local.to_string()),
            ("WEFT_LOCAL_WORLD_SIZE", n.to_string()),
            ("WEFT_MASTER_ADDR", self.master_addr.clone()),
            ("WEFT_MASTER_PORT", port.to_string()),
            ("WEFT_JOB_TOKEN", token.to_string()),
            ("WEFT_STORE", store.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            env.push(("OMP_NUM_THREADS".into(), "1".into()));
        }
        env
    }

    fn job_token(&self, port: u16, attempt: u32) -> String {
        match std::env::var("WEFT_JOB_TOKEN") {
            Ok(t) if !t.is_empty() => t,
            _ if self.nnodes > 1 => derived_token(&self.master_addr, port, attempt),
            // getrandom fails only without a kernel source of randomness: the derived token
            // still tells this job from others.
            _ => weftcc::transports::random_token()
                .unwrap_or_else(|_| derived_token(&self.master_addr, port, attempt)),
        }
    }

    /// Runs the job (with restarts) and returns the exit code for the launcher.
    pub fn run(&self) -> i32 {
        // Every rank would find the same bad value: say it once, before any rank starts.
        let bad = check_settings();
        if !bad.is_empty() {
            for e in &bad {
                eprintln!("{}: {e}", self.label);
            }
            eprintln!("{}: no rank started", self.label);
            return 2;
        }
        install_signal_handlers(self.label);
        let mut attempt = 0u32;
        loop {
            match self.run_attempt(attempt) {
                Outcome::Success => return 0,
                Outcome::Fatal(code) => return code,
                Outcome::Failed(code) => {
                    if attempt < self.max_restarts {
                        attempt += 1;
                        eprintln!(
                            "{}: restarting all {} (restart {attempt} of {})",
                            self.label,
                            plural(self.nproc_per_node, "worker"),
                            self.max_restarts
                        );
                        continue;
                    }
                    if self.max_restarts > 0 {
                        eprintln!(
                            "{}: giving up after {}; exiting with code {code}",
                            self.label,
                            plural(self.max_restarts as usize, "restart")
                        );
                    }
                    return code;
                }
            }
        }
    }

    /// Starts worker `rank` (a replacement: `replacement` = its number) with `env`.
    fn spawn(
        &self,
        rank: usize,
        replacement: Option<usize>,
        env: Vec<(String, String)>,
        cpus: Option<&[usize]>,
        done: &mpsc::Sender<()>,
    ) -> io::Result<Worker> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(env)
            .stdin(Stdio::null())
            // Own process group: stopping a worker also stops what it started, and a terminal's
            // Ctrl-C reaches only the launcher, which forwards it once.
            .process_group(0);
        if self.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        // A worker with CPUs of its own (no other local worker shares them) spins longer before
        // it yields: no peer can be waiting for its CPU, and under other programs' load a rank
        // that yields after 2 µs hands its CPU over for a whole time slice (8-byte all-reduce,
        // bound, load 4-16: 0.89 / 1.30 µs with 20 µs against 1.37 / 1.86 with 2 µs; 1 MiB no
        // slower; docs/performance.md). Unbound ranks keep the library's 2 µs: placed on one
        // CPU they would spin out the whole 20 µs per exchange.
        let spin = &weftcc::settings::SPIN_US;
        if cpus.is_some() && self.nproc_per_node <= allowed_cpus().len() && !spin.is_set() {
            cmd.env(spin.name, BOUND_SPIN_US);
        }
        launch_as_worker(&mut cmd, cpus)?;
        let mut child = cmd.spawn()?;
        if self.prefix {
            let prefix = match replacement {
                Some(k) => format!("[+{k}]: "),
                None => format!("[{rank}]: "),
            };
            if let Some(out) = child.stdout.take() {
                let (p, d) = (prefix.clone(), done.clone());
                std::thread::spawn(move || forward_lines(out, p, false, d));
            }
            if let Some(err) = child.stderr.take() {
                let d = done.clone();
                std::thread::spawn(move || forward_lines(err, prefix, true, d));
            }
        }
        Ok(Worker {
            name: match replacement {
                Some(k) => format!("replacement {k}"),
                None => format!("rank {rank}"),
            },
            replacement: replacement.is_some(),
            cpus: cpus.map(<[usize]>::to_vec),
            child,
            status: None,
        })
    }

    /// The environment of replacement `k` (elastic): a worker's without a rank, and
    /// WEFT_ELASTIC_JOIN=1.
    fn replacement_env(
        &self,
        attempt: u32,
        port: u16,
        token: &str,
        store: &str,
    ) -> Vec<(String, String)> {
        let mut env = self.worker_env(0, attempt, port, token, store);
        env.retain(|(k, _)| !RANK_VARS.contains(&k.as_str()));
        env.push((weftcc::settings::ELASTIC_JOIN.name.to_string(), "1".into()));
        env
    }

    fn run_attempt(&self, attempt: u32) -> Outcome {
        if let Some(sig) = take_pending_signal() {
            eprintln!(
                "{}: received {}; not starting workers",
                self.label,
                signal_name(sig)
            );
            return Outcome::Fatal(128 + sig);
        }
        let port = if self.master_port == 0 {
            match pick_free_port(&self.master_addr) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("{}: cannot find a free port: {e}", self.label);
                    return Outcome::Fatal(1);
                }
            }
        } else {
            if self.node_rank == 0 {
                if let Err(msg) = self.port_is_free(self.master_port) {
                    eprintln!("{}: {msg}", self.label);
                    return Outcome::Fatal(1);
                }
            }
            self.master_port
        };
        let token = self.job_token(port, attempt);
        // The job's bootstrap store lives in node 0's launcher (as torchrun's agent hosts its
        // store), not in rank 0: a rank's death leaves the job's meeting point up. A store the
        // user runs (WEFT_STORE) is used as it is.
        // Not on MASTER_PORT itself: that is torch's TCPStore's (rank 0 of a torch job binds it).
        let store_port = if self.nnodes == 1 {
            0
        } else {
            port.wrapping_add(1)
        };
        let rendezvous = weftcc::comm::join_host_port(&self.master_addr, store_port);
        let users_store = weftcc::settings::STORE.value();
        let store = match (&users_store, self.node_rank) {
            (None, 0) => match weftcc::comm::serve_store(&rendezvous, &token) {
                Ok(server) => Some(server),
                Err(e) => {
                    eprintln!(
                        "{}: cannot serve the job's bootstrap store on port {port}: {e}",
                        self.label
                    );
                    return Outcome::Fatal(1);
                }
            },
            _ => None,
        };
        let store_addr = users_store.unwrap_or_else(|| match &store {
            Some(server) => {
                weftcc::comm::join_host_port(&self.master_addr, server.local_addr().port())
            }
            None => rendezvous,
        });
        let (done_tx, done_rx) = mpsc::channel();
        let mut workers: Vec<Worker> = Vec::with_capacity(self.nproc_per_node);
        let allowed = allowed_cpus();
        let cpus = cpu_plan(self.cpu_bind, self.nproc_per_node, &allowed);
        if self.cpu_bind == CpuBind::Core && self.nproc_per_node > allowed.len() && attempt == 0 {
            eprintln!(
                "{}: {} on {}: {}",
                self.label,
                plural(self.nproc_per_node, "worker"),
                plural(allowed.len(), "CPU"),
                if cpus.is_some() {
                    "binding round-robin (worker k on CPU k mod n)"
                } else {
                    "not binding to cores (that would not load every CPU equally)"
                }
            );
        }
        for local in 0..self.nproc_per_node {
            let cpu = cpus.as_ref().and_then(|c| c.get(local)).map(Vec::as_slice);
            let rank = self.node_rank * self.nproc_per_node + local;
            let env = self.worker_env(local, attempt, port, &token, &store_addr);
            match self.spawn(rank, None, env, cpu, &done_tx) {
                Ok(w) => workers.push(w),
                Err(e) => {
                    eprintln!(
                        "{}: cannot start rank {rank} ({}): {e}",
                        self.label,
                        self.program.to_string_lossy()
                    );
                    let code = match e.kind() {
                        io::ErrorKind::NotFound => 127,
                        io::ErrorKind::PermissionDenied => 126,
                        _ => 1,
                    };
                    self.stop_all(&mut workers, Signal::SIGTERM);
                    return Outcome::Fatal(code);
                }
            }
        }
        let outcome = match self.elastic {
            Some(max) => {
                let replace = |w: &Worker, k: usize| {
                    let env = self.replacement_env(attempt, port, &token, &store_addr);
                    let spawned = self.spawn(
                        self.world_size() + k,
                        Some(k),
                        env,
                        w.cpus.as_deref(),
                        &done_tx,
                    );
                    // A killed rank's shared memory goes now (segments whose maker exited).
                    remove_orphan_segments(&token, false);
                    spawned
                };
                self.watch_elastic(&mut workers, max, replace)
            }
            None => self.watch(&mut workers),
        };
        drop(done_tx);
        let readers = if self.prefix { 2 * workers.len() } else { 0 };
        if let Some(server) = &store {
            // Ranks of other nodes may still be reading the job's end (a failure's cause).
            let linger = Instant::now() + STORE_LINGER;
            while server.connections() > 0 && Instant::now() < linger {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        drop(store);
        // Every worker has exited: shared memory a killed rank could not unlink goes now. On a
        // single node nobody else uses this job's segments, so even one a worker was killed
        // while making (no header yet) goes at once; with several nodes, one may share this
        // host's /dev/shm and still be making one.
        let left = remove_orphan_segments(&token, self.nnodes == 1);
        if !left.is_empty() {
            eprintln!(
                "{}: removed {} the workers left: {}",
                self.label,
                plural(left.len(), "shared-memory segment"),
                left.join(" ")
            );
        }
        // Let the readers print what the workers wrote last; bounded, see the module comment.
        let deadline = Instant::now() + DRAIN_WAIT;
        for _ in 0..readers {
            let left = deadline.saturating_duration_since(Instant::now());
            if done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        outcome
    }

    /// Waits for the workers; on the first failure or a signal to the launcher, stops the rest.
    fn watch(&self, workers: &mut [Worker]) -> Outcome {
        loop {
            if let Some(out) = self.on_signal(workers) {
                return out;
            }
            let newly = reap(workers, self.label);
            if let Some(i) = newly
                .into_iter()
                .find(|&i| !workers[i].status.is_some_and(|s| s.success()))
            {
                let status = workers[i].status.expect("reaped");
                let running = workers.iter().filter(|w| w.status.is_none()).count();
                let others = if running == 0 {
                    "no other workers were running".to_string()
                } else {
                    format!("stopping the other {}", plural(running, "worker"))
                };
                eprintln!(
                    "{}: {} (pid {}) {} first; {others}",
                    self.label,
                    workers[i].name,
                    workers[i].pid(),
                    describe(status)
                );
                self.stop_all(workers, Signal::SIGTERM);
                return Outcome::Failed(exit_code(status));
            }
            if workers.iter().all(|w| w.status.is_some()) {
                return Outcome::Success;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Forwards a signal the launcher received to the running workers and stops them; `None`
    /// when none came.
    fn on_signal(&self, workers: &mut [Worker]) -> Option<Outcome> {
        let sig = take_pending_signal()?;
        let running = workers.iter().filter(|w| w.status.is_none()).count();
        eprintln!(
            "{}: received {}; forwarding it to {}",
            self.label,
            signal_name(sig),
            plural(running, "running worker")
        );
        let fwd = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
        self.stop_all(workers, fwd);
        Some(Outcome::Fatal(128 + sig))
    }

    /// Waits for the workers of an elastic job: a worker killed by a signal is a lost rank, the
    /// others go on and `replace` starts one of at most `max` replacements for it; a non-zero
    /// exit becomes the job's code. Replacements still running `JOINER_LINGER` after every
    /// other worker ended (one of them well) never joined and are stopped.
    fn watch_elastic(
        &self,
        workers: &mut Vec<Worker>,
        max: u32,
        replace: impl Fn(&Worker, usize) -> io::Result<Worker>,
    ) -> Outcome {
        let mut started = 0usize;
        let mut failed: Option<i32> = None;
        let mut lost: Option<i32> = None;
        let mut members_done: Option<Instant> = None;
        loop {
            if let Some(out) = self.on_signal(workers) {
                return out;
            }
            for i in reap(workers, self.label) {
                let status = workers[i].status.unwrap_or(ExitStatus::from_raw(1 << 8));
                if status.success() {
                    continue;
                }
                let w = &workers[i];
                if status.signal().is_none() {
                    eprintln!(
                        "{}: {} (pid {}) {}; the others go on (--elastic)",
                        self.label,
                        w.name,
                        w.pid(),
                        describe(status)
                    );
                    failed.get_or_insert(exit_code(status));
                    continue;
                }
                lost = Some(exit_code(status));
                if started >= max as usize {
                    eprintln!(
                        "{}: {} (pid {}) {}: lost; the others go on, no replacement left (--max-replacements {max})",
                        self.label,
                        w.name,
                        w.pid(),
                        describe(status)
                    );
                    continue;
                }
                started += 1;
                match replace(w, started) {
                    Ok(r) => {
                        eprintln!(
                            "{}: {} (pid {}) {}: lost; the others go on, replacement {started} (pid {}) joins ({started} of {max})",
                            self.label,
                            w.name,
                            w.pid(),
                            describe(status),
                            r.pid()
                        );
                        workers.push(r);
                    }
                    Err(e) => {
                        eprintln!("{}: cannot start replacement {started}: {e}", self.label);
                    }
                }
            }
            let running = |w: &&Worker| w.status.is_none();
            if workers.iter().all(|w| w.status.is_some()) {
                let ended_well = workers
                    .iter()
                    .any(|w| w.status.is_some_and(|s| s.success()));
                return match (failed, ended_well, lost) {
                    (Some(code), _, _) => Outcome::Failed(code),
                    (None, true, _) => Outcome::Success,
                    (None, false, code) => Outcome::Failed(code.unwrap_or(1)),
                };
            }
            let only_joiners = workers.iter().filter(running).all(|w| w.replacement);
            let one_ended_well = workers
                .iter()
                .any(|w| w.status.is_some_and(|s| s.success()));
            if only_joiners && one_ended_well {
                let since = *members_done.get_or_insert_with(Instant::now);
                if since.elapsed() >= JOINER_LINGER {
                    let waiting: Vec<&str> = workers
                        .iter()
                        .filter(running)
                        .map(|w| w.name.as_str())
                        .collect();
                    eprintln!(
                        "{}: the job ended; stopping {} that never joined: {}",
                        self.label,
                        plural(waiting.len(), "replacement"),
                        waiting.join(", ")
                    );
                    self.stop_all(workers, Signal::SIGTERM);
                    return match failed {
                        Some(code) => Outcome::Failed(code),
                        None => Outcome::Success,
                    };
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// Sends `sig` to every running worker, then waits for all of them to exit: SIGKILL after the
    /// grace period (or at once when the launcher gets another signal), then give up after
    /// [`KILL_WAIT`].
    fn stop_all(&self, workers: &mut [Worker], sig: Signal) {
        for w in workers.iter() {
            w.signal(sig);
        }
        let mut deadline = Instant::now() + GRACE;
        let mut killed = false;
        loop {
            reap(workers, self.label);
            let running = workers.iter().filter(|w| w.status.is_none()).count();
            if running == 0 {
                return;
            }
            let again = take_pending_signal().is_some();
            if again || Instant::now() >= deadline {
                if killed {
                    if Instant::now() >= deadline {
                        eprintln!(
                            "{}: {} did not exit after SIGKILL; leaving {}",
                            self.label,
                            plural(running, "worker"),
                            if running == 1 { "it" } else { "them" }
                        );
                        return;
                    }
                } else {
                    for w in workers.iter() {
                        w.signal(Signal::SIGKILL);
                    }
                    killed = true;
                    deadline = Instant::now() + KILL_WAIT;
                }
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Collects the exit status of every worker that has exited; returns their indices in rank order.
fn reap(workers: &mut [Worker], label: &str) -> Vec<usize> {
    let mut newly = Vec::new();
    for (i, w) in workers.iter_mut().enumerate() {
        if w.status.is_some() {
            continue;
        }
        match w.child.try_wait() {
            Ok(Some(status)) => {
                w.status = Some(status);
                newly.push(i);
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("{label}: cannot wait for {}: {e}", w.name);
                w.status = Some(ExitStatus::from_raw(1 << 8));
                newly.push(i);
            }
        }
    }
    newly
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(n: usize, nodes: usize, node: usize) -> Launch {
        Launch {
            nproc_per_node: n,
            nnodes: nodes,
            node_rank: node,
            master_addr: "10.0.0.1".into(),
            master_port: 1234,
            prefix: true,
            max_restarts: 2,
            elastic: None,
            cpu_bind: CpuBind::None,
            program: "true".into(),
            args: vec![],
            label: "weft run",
        }
    }

    #[test]
    fn cores_are_given_in_order_and_shared_evenly_or_not_at_all() {
        let allowed = [2, 3, 6, 7];
        let one = |v: &[usize]| Some(v.iter().map(|&c| vec![c]).collect::<Vec<_>>());
        assert_eq!(cpu_plan(CpuBind::Core, 3, &allowed), one(&[2, 3, 6]));
        assert_eq!(cpu_plan(CpuBind::Core, 4, &allowed), one(&[2, 3, 6, 7]));
        // More workers than CPUs: dealt round-robin when every CPU gets as many, else unbound.
        assert_eq!(
            cpu_plan(CpuBind::Core, 8, &allowed),
            one(&[2, 3, 6, 7, 2, 3, 6, 7])
        );
        assert_eq!(cpu_plan(CpuBind::Core, 6, &allowed), None);
        assert_eq!(cpu_plan(CpuBind::None, 2, &allowed), None);
        assert_eq!(cpu_plan(CpuBind::Core, 1, &[]), None);
    }

    #[test]
    fn shares_are_disjoint_blocks_covering_every_cpu_or_nothing() {
        let allowed = [2, 3, 6, 7, 9];
        assert_eq!(
            cpu_plan(CpuBind::Share, 2, &allowed),
            Some(vec![vec![2, 3, 6], vec![7, 9]])
        );
        assert_eq!(
            cpu_plan(CpuBind::Share, 5, &allowed),
            Some(vec![vec![2], vec![3], vec![6], vec![7], vec![9]])
        );
        assert_eq!(
            cpu_plan(CpuBind::Share, 1, &allowed),
            Some(vec![allowed.to_vec()])
        );
        // Oversubscribed, or nothing known: unbound.
        assert_eq!(cpu_plan(CpuBind::Share, 6, &allowed), None);
        assert_eq!(cpu_plan(CpuBind::Share, 1, &[]), None);
    }

    fn get<'a>(env: &'a [(String, String)], k: &str) -> &'a str {
        &env.iter().find(|(key, _)| key == k).unwrap().1
    }

    #[test]
    fn env_of_a_multi_node_worker() {
        let l = launch(4, 3, 2);
        let env = l.worker_env(1, 1, 1234, "abc", "10.0.0.1:1234");
        assert_eq!(get(&env, "RANK"), "9");
        assert_eq!(get(&env, "WEFT_RANK"), "9");
        assert_eq!(get(&env, "ROLE_RANK"), "9");
        assert_eq!(get(&env, "LOCAL_RANK"), "1");
        assert_eq!(get(&env, "WORLD_SIZE"), "12");
        assert_eq!(get(&env, "LOCAL_WORLD_SIZE"), "4");
        assert_eq!(get(&env, "GROUP_RANK"), "2");
        assert_eq!(get(&env, "MASTER_PORT"), "1234");
        assert_eq!(get(&env, "TORCHELASTIC_RESTART_COUNT"), "1");
        assert_eq!(get(&env, "TORCHELASTIC_MAX_RESTARTS"), "2");
        assert_eq!(get(&env, "WEFT_JOB_TOKEN"), "abc");
        assert_eq!(get(&env, "WEFT_STORE"), "10.0.0.1:1234");
    }

    #[test]
    fn a_replacement_has_the_job_but_no_rank() {
        let l = launch(4, 1, 0);
        let env = l.replacement_env(0, 1234, "abc", "10.0.0.1:1235");
        for k in RANK_VARS {
            assert!(env.iter().all(|(key, _)| key != k), "{k} in {env:?}");
        }
        assert_eq!(get(&env, "WEFT_ELASTIC_JOIN"), "1");
        assert_eq!(get(&env, "WEFT_STORE"), "10.0.0.1:1235");
        assert_eq!(get(&env, "WEFT_JOB_TOKEN"), "abc");
        assert_eq!(get(&env, "WEFT_WORLD_SIZE"), "4");
    }

    #[test]
    fn validation() {
        assert!(launch(2, 2, 1).validate().is_ok());
        assert!(launch(2, 2, 2).validate().is_err());
        let mut l = launch(2, 2, 0);
        l.master_port = 0;
        assert!(l.validate().is_err());
        l.nnodes = 1;
        assert!(l.validate().is_ok());
    }

    #[test]
    fn tokens() {
        let d = derived_token("10.0.0.1", 29500, 0);
        assert_eq!(d.len(), 32);
        assert_eq!(d, derived_token("10.0.0.1", 29500, 0));
        assert_ne!(d, derived_token("10.0.0.1", 29500, 1));
        assert_ne!(d, derived_token("10.0.0.2", 29500, 0));
    }

    #[test]
    fn exit_codes_and_names() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(
            describe(ExitStatus::from_raw(9)),
            "was killed by signal 9 (SIGKILL)"
        );
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exited with code 3");
        assert_eq!(parse_nproc("3"), Ok(3));
        assert!(parse_nproc("0").is_err());
        assert!(parse_nproc("auto").unwrap() >= 1);
    }

    #[test]
    fn free_port_is_nonzero() {
        assert_ne!(pick_free_port("127.0.0.1").unwrap(), 0);
        assert_ne!(pick_free_port("no.such.host.invalid").unwrap(), 0);
    }
}
