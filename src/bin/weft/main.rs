//! `weft`: weftcc's command-line tool.
//!
//! * `weft run`: a torchrun-compatible launcher that starts one worker process per local rank,
//!   forwards their output with a `[rank]: ` prefix and stops (or restarts) the job when a worker
//!   fails.
//! * `weft perf`: nccl-tests-compatible microbenchmarks of the collectives (`--plot` draws them,
//!   `--baseline` overlays a peer's curve converted by `weft baseline-json`).
//! * `weft doctor`: run as every rank of a job, measures each pair of ranks over the job's
//!   transport against the model's prediction and the limits measured on the spot, and names
//!   the slow links.
//! * `weft status`: a running job's ranks (host, pid, state, progress, liveness) and a verdict,
//!   read from its bootstrap store.
//! * `weft trace`: ask a running job's ranks to write their flight recorders (`dump`), and line
//!   the files up (`merge`).
//! * `weft store`: a job's bootstrap store as a process of its own (`serve`), and a load test of
//!   it with simulated ranks (`load`).

// `deny` rather than `forbid`: `weft run`'s process control (run/process.rs) opts in for its
// signal handler and pre-exec hook.
#![deny(unsafe_code)]

mod doctor;
mod job;
mod job_status;
mod perf;
mod run;
mod status;
mod store;
mod topo;
mod trace;
mod trace_merge;
mod train;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "weft",
    version,
    about = "weftcc: collective communication for CPUs and GPUs",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Launch N worker processes per node with the environment torchrun would give them.
    Run(run::RunArgs),
    /// Benchmark a collective, printing nccl-tests-compatible tables.
    Perf(perf::PerfArgs),
    /// Convert baseline.sh or nccl-tests output into JSON for `weft perf --baseline`.
    BaselineJson(perf::baseline::BaselineArgs),
    /// Show the machine's topology, the rings and trees chosen, predictions and warnings.
    Topo(topo::TopoArgs),
    /// Measure every pair of the job's ranks against its prediction and limits; name the slow links.
    Doctor(doctor::DoctorArgs),
    /// Show a running job's ranks and what is wrong (TIMEOUT, MISMATCH, DEAD, BEHIND, ...).
    Status(status::StatusArgs),
    /// Flight recorder: dump a running job's last operations, merge dumps to find who is behind.
    Trace(trace::TraceArgs),
    /// Train the reference MLP data-parallel (DDP reducer, checkpoints, resume).
    Train(train::TrainArgs),
    /// A bootstrap store as a process of its own (`serve`), and its load test (`load`).
    Store(store::StoreArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run(args) => run::main(args),
        Command::Perf(args) => perf::main(args),
        Command::BaselineJson(args) => perf::baseline::main(args),
        Command::Topo(args) => topo::main(args),
        Command::Train(args) => train::main(args),
        Command::Status(args) => status::main(args),
        Command::Doctor(args) => doctor::main(args),
        Command::Trace(args) => trace::main(args),
        Command::Store(args) => store::main(args),
    };
    std::process::exit(code);
}
