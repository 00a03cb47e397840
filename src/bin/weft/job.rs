//! Which running job a command attaches to (`weft status`, `weft trace dump`): a unique id,
//! an address and token, a rank process's environment, or this process's own.

use clap::Args;
use std::collections::HashMap;
use weftcc::{LaunchInfo, UniqueId};

/// The help paragraph on how a job is named (one text for every command that attaches).
macro_rules! which_job_help {
    () => {
        "Which job: a unique id (weft1@HOST:PORT#TOKEN, what weftGetUniqueId and UniqueId print); \
or --addr and --token; or --pid of one of the job's rank processes on this host (its rendezvous \
and token are read from its environment, whichever launcher started it: weft run, torchrun, srun, \
mpirun); or, with none of these, this process's own launcher environment."
    };
}
pub(crate) use which_job_help;

/// The arguments that name a job.
#[derive(Args, Debug)]
pub struct JobArgs {
    /// The job's unique id.
    pub id: Option<String>,
    /// Rendezvous address of the job's bootstrap store (HOST:PORT).
    #[arg(long, requires = "token", conflicts_with_all = ["id", "pid"])]
    pub addr: Option<String>,
    /// The job token (WEFT_JOB_TOKEN).
    #[arg(long, requires = "addr")]
    pub token: Option<String>,
    /// A rank process of the job on this host.
    #[arg(long, conflicts_with = "id")]
    pub pid: Option<u32>,
}

impl JobArgs {
    /// The job's rendezvous and token, from the arguments (see [`which_job_help`] for the order).
    pub fn unique_id(&self) -> Result<UniqueId, String> {
        if let Some(id) = &self.id {
            return id.parse().map_err(|e: weftcc::Error| e.to_string());
        }
        if let (Some(addr), Some(token)) = (&self.addr, &self.token) {
            return Ok(UniqueId {
                addr: addr.clone(),
                token: token.clone(),
            });
        }
        let vars: HashMap<String, String> = match self.pid {
            Some(pid) => process_environment(pid)?,
            None => weftcc::settings::process_environment(),
        };
        if let Some(id) = vars.get(weftcc::settings::UNIQUE_ID.name) {
            return id.parse().map_err(|e: weftcc::Error| e.to_string());
        }
        let info = LaunchInfo::from_vars(&vars).map_err(|e| match self.pid {
            Some(pid) => format!("process {pid} is not a rank of a weftcc job: {e}"),
            None => format!("which job? give its unique id, --addr and --token, or --pid ({e})"),
        })?;
        Ok(UniqueId {
            addr: weftcc::comm::join_host_port(&info.master_addr, info.master_port),
            token: info.token,
        })
    }
}

/// A number of seconds for `--timeout` (finite, positive; at most an hour).
pub fn seconds(text: &str) -> Result<std::time::Duration, String> {
    let s: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(s.is_finite() && s > 0.0) {
        return Err(format!("{text:?}: give a positive number of seconds"));
    }
    Ok(std::time::Duration::from_secs_f64(s.min(3600.0)))
}

/// The environment process `pid` started with (`/proc/<pid>/environ`; readable for one's own
/// processes).
fn process_environment(pid: u32) -> Result<HashMap<String, String>, String> {
    let path = format!("/proc/{pid}/environ");
    let raw = std::fs::read(&path).map_err(|e| format!("reading {path}: {e}"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect())
}
