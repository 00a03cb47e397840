//! `weft status`: attach to a running job through its bootstrap store and print each rank's
//! host, pid, state, current operation, time since progress and liveness, and a verdict.

use crate::job::{which_job_help, JobArgs};
use crate::job_status::{JobStatus, Liveness, RankStatus, Verdict};
use clap::Args;
use std::time::Duration;
use weftcc::comm::records::identity::WORLD_NAMESPACE;
use weftcc::UniqueId;

#[derive(Args, Debug)]
#[command(after_help = concat!(which_job_help!(), "

Exit status: 0 when the verdict is OK, JOINING or FINISHED; 1 for any other verdict; 2 when the
job cannot be read."))]
pub struct StatusArgs {
    #[command(flatten)]
    pub job: JobArgs,
    /// Communicator to show (its namespace in the store; the job's own by default).
    #[arg(long, default_value = WORLD_NAMESPACE)]
    pub comm: String,
    /// Show the job's first communicator itself, not the newest one its recoveries (shrinks
    /// and grows) made from it.
    #[arg(long)]
    pub no_follow: bool,
    /// Seconds to wait for the store.
    #[arg(long, default_value = "5", value_parser = crate::job::seconds)]
    pub timeout: Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: StatusArgs) -> i32 {
    let id = match args.job.unique_id() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("weft status: {e}");
            return 2;
        }
    };
    let timeout = args.timeout;
    // The job's own communicator is followed through its recoveries to the survivors' one.
    let read = if args.comm == WORLD_NAMESPACE && !args.no_follow {
        JobStatus::read_current(&id, &args.comm, timeout)
    } else {
        JobStatus::read_namespace(&id, &args.comm, timeout)
    };
    let status = match read {
        Ok(s) => s,
        Err(e) => {
            eprintln!("weft status: {e}");
            return 2;
        }
    };
    if args.json {
        println!("{}", json(&id, &status));
    } else {
        print!("{}", table(&id, &status));
    }
    match status.verdict {
        Verdict::Ok | Verdict::Joining { .. } | Verdict::Finished => 0,
        _ => 1,
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn alive(l: Liveness) -> String {
    match l {
        Liveness::Alive => "yes".into(),
        Liveness::Silent(d) => format!("silent {}", secs(d)),
        Liveness::Dead(d) => format!("dead {}", secs(d)),
        Liveness::Left(d) => format!("left {}", secs(d)),
        Liveness::Absent => "-".into(),
    }
}

fn row(r: &RankStatus) -> [String; 7] {
    let (host, pid) = match &r.identity {
        Some(i) => (i.host.clone(), i.pid.to_string()),
        None => ("-".into(), "-".into()),
    };
    let last = r
        .progress
        .and_then(|p| p.record.completed)
        .map_or("-".into(), |(k, s)| format!("{k} #{s}"));
    let since = r.progress.map_or("-".into(), |p| secs(p.since));
    [
        r.rank.to_string(),
        host,
        pid,
        r.state(),
        last,
        since,
        alive(r.liveness),
    ]
}

fn table(id: &UniqueId, s: &JobStatus) -> String {
    let head = [
        "rank",
        "host",
        "pid",
        "state",
        "last completed",
        "since",
        "alive",
    ]
    .map(String::from);
    let rows: Vec<[String; 7]> = std::iter::once(head)
        .chain(s.ranks.iter().map(row))
        .collect();
    let widths: Vec<usize> = (0..7)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = format!(
        "job {} · communicator {} · {} ranks\n",
        id.addr, s.namespace, s.nranks
    );
    for e in &s.lineage {
        out.push_str(&format!("recovered: {}\n", e.describe()));
    }
    for r in &rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (v, w))| {
                if c == 0 {
                    format!("{v:>w$}")
                } else {
                    format!("{v:<w$}")
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&format!("verdict: {}\n", s.verdict));
    out
}

fn json(id: &UniqueId, s: &JobStatus) -> serde_json::Value {
    let op = |o: Option<(weftcc::OpKind, u64)>| {
        o.map(|(k, s)| serde_json::json!({"op": k.to_string(), "seq": s}))
    };
    let ranks: Vec<serde_json::Value> = s
        .ranks
        .iter()
        .map(|r| {
            let (alive, for_s) = match r.liveness {
                Liveness::Alive => ("alive", None),
                Liveness::Silent(d) => ("silent", Some(d)),
                Liveness::Dead(d) => ("dead", Some(d)),
                Liveness::Left(d) => ("left", Some(d)),
                Liveness::Absent => ("absent", None),
            };
            serde_json::json!({
                "rank": r.rank,
                "host": r.identity.as_ref().map(|i| i.host.clone()),
                "pid": r.identity.as_ref().map(|i| i.pid),
                "state": r.state(),
                "current": op(r.progress.and_then(|p| p.current())),
                "last_completed": op(r.progress.and_then(|p| p.record.completed)),
                "since_s": r.progress.map(|p| p.since.as_secs_f64()),
                "liveness": alive,
                "liveness_for_s": for_s.map(|d| d.as_secs_f64()),
            })
        })
        .collect();
    serde_json::json!({
        "job": id.addr,
        "communicator": s.namespace,
        "nranks": s.nranks,
        "ranks": ranks,
        "lineage": s.lineage,
        "verdict": s.verdict.word(),
        "detail": s.verdict.to_string(),
    })
}
