//! `weft trace`: the flight recorder from outside a job. `dump` asks every rank of a running
//! job (through its bootstrap store) to write its recorder; `merge` lines dump files up and
//! names the ranks that are behind or disagree.

use crate::job::{which_job_help, JobArgs};
use crate::job_status::{JobStatus, Liveness};
use crate::trace_merge::{merge, rank_set};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weftcc::comm::records::identity::WORLD_NAMESPACE;
use weftcc::comm::records::trace::{DumpRequest, TraceDump, REQUESTS_KEY};
use weftcc::store::StoreClient;

#[derive(Args, Debug)]
pub struct TraceArgs {
    #[command(subcommand)]
    pub command: TraceCommand,
}

#[derive(Subcommand, Debug)]
pub enum TraceCommand {
    /// Ask every rank of a running job to write its flight recorder.
    Dump(DumpArgs),
    /// Line dump files up: the furthest collective, the ranks behind it, the calls that differ.
    Merge(MergeArgs),
}

#[derive(Args, Debug)]
#[command(after_help = concat!(which_job_help!(), "

Each rank's failure watcher looks for the request once a second and writes its file even while
the rank is stuck in an operation (it runs on a thread of its own); a rank that does not answer
is dead, stopped or not yet joined. Every communicator of the job writes its own file.

Exit status: 0 when every rank of the communicator answered with a file; 1 otherwise; 2 when
the job cannot be reached."))]
pub struct DumpArgs {
    #[command(flatten)]
    pub job: JobArgs,
    /// Directory the ranks write to, as seen from their hosts (a shared file system for a job
    /// across hosts). Default: each rank's WEFT_TRACE_DUMP_DIR, else its temporary directory's
    /// weft-trace/.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Communicator whose answers to wait for (the job's own by default).
    #[arg(long, default_value = WORLD_NAMESPACE)]
    pub comm: String,
    /// Seconds to wait for the answers.
    #[arg(long, default_value = "10", value_parser = crate::job::seconds)]
    pub timeout: Duration,
}

#[derive(Args, Debug)]
#[command(after_help = "\
Exit status: 0 when the dumps show nothing wrong (every rank dumped, none behind, none
disagreeing, nothing failed); 1 otherwise; 2 when no dump could be read.")]
pub struct MergeArgs {
    /// Dump files, or directories holding them (weft-trace-*.json).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: TraceArgs) -> i32 {
    match args.command {
        TraceCommand::Dump(a) => dump(a),
        TraceCommand::Merge(a) => merge_files(a),
    }
}

fn dump(args: DumpArgs) -> i32 {
    let fail = |e: String| {
        eprintln!("weft trace dump: {e}");
        2
    };
    let id = match args.job.unique_id() {
        Ok(id) => id,
        Err(e) => return fail(e),
    };
    let timeout = args.timeout;
    let status = match JobStatus::read_namespace(&id, &args.comm, timeout) {
        Ok(s) => s,
        Err(e) => return fail(e.to_string()),
    };
    let mut store = match StoreClient::connect(&id.addr, &id.token, timeout) {
        Ok(s) => s,
        Err(e) => return fail(e.to_string()),
    };
    // Each rank resolves the directory on its own host: make it absolute here.
    let dir = match args.dir.as_deref().map(std::path::absolute).transpose() {
        Ok(d) => d,
        Err(e) => return fail(format!("--dir: {e}")),
    };
    // Numbered: two requests close together are both answered.
    let id = match store.add(REQUESTS_KEY, 1) {
        Ok(n) => n as u64,
        Err(e) => return fail(e.to_string()),
    };
    let request = DumpRequest {
        id,
        dir: dir.clone(),
    };
    if let Err(e) = store.set(&DumpRequest::key(id), request.encode().as_bytes()) {
        return fail(e.to_string());
    }
    let n = status.nranks;
    let mut answers: Vec<Option<String>> = vec![None; n];
    let deadline = Instant::now() + timeout;
    while answers.iter().any(Option::is_none) && Instant::now() < deadline {
        for (rank, slot) in answers.iter_mut().enumerate() {
            if slot.is_some() {
                continue;
            }
            let key = DumpRequest::answer_key(request.id, &args.comm, rank);
            if let Ok(true) = store.check(&key) {
                *slot = store
                    .get(&key, Duration::from_millis(500))
                    .ok()
                    .map(|v| String::from_utf8_lossy(&v).into_owned());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut written = 0;
    let mut silent = Vec::new();
    for (rank, answer) in answers.iter().enumerate() {
        match answer.as_deref() {
            Some(a) if a.starts_with("ok ") => {
                written += 1;
                println!("rank {rank}: {}", &a[3..]);
            }
            Some(a) => println!("rank {rank}: {}", a.strip_prefix("error ").unwrap_or(a)),
            None => {
                silent.push(rank);
                let why = match status.ranks.get(rank).map(|r| r.liveness) {
                    Some(Liveness::Dead(_)) => "its process is dead",
                    Some(Liveness::Silent(_)) => "its process gives no sign of life",
                    Some(Liveness::Left(_)) => "it has left",
                    Some(Liveness::Absent) | None => "it never reached the store",
                    Some(Liveness::Alive) => "no answer in time",
                };
                println!("rank {rank}: no dump ({why})");
            }
        }
    }
    println!(
        "{written} of {n} ranks of communicator {} wrote their flight recorder{}",
        args.comm,
        match &dir {
            Some(d) => format!("; merge with: weft trace merge {}", d.display()),
            None => String::new(),
        }
    );
    if !silent.is_empty() {
        println!("no answer from rank(s) {}", rank_set(&silent));
    }
    i32::from(written != n)
}

fn merge_files(args: MergeArgs) -> i32 {
    let mut files = Vec::new();
    for p in &args.paths {
        if p.is_dir() {
            match std::fs::read_dir(p) {
                Ok(entries) => {
                    let mut found: Vec<PathBuf> = entries
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|f| {
                            f.file_name()
                                .is_some_and(|n| TraceDump::is_dump_file(&n.to_string_lossy()))
                        })
                        .collect();
                    found.sort();
                    files.extend(found);
                }
                Err(e) => eprintln!("weft trace merge: {}: {e}", p.display()),
            }
        } else {
            files.push(p.clone());
        }
    }
    let mut dumps = Vec::new();
    for f in &files {
        match TraceDump::read(f) {
            Ok(d) => dumps.push(d),
            Err(e) => eprintln!("weft trace merge: skipped {e}"),
        }
    }
    if dumps.is_empty() {
        eprintln!("weft trace merge: no dump could be read");
        return 2;
    }
    let reports = merge(&dumps);
    if args.json {
        match serde_json::to_string_pretty(&reports) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("weft trace merge: {e}");
                return 2;
            }
        }
    } else {
        for r in &reports {
            print!("{r}");
        }
    }
    i32::from(!reports.iter().all(|r| r.consistent()))
}
