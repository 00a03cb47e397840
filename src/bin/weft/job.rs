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
            Some(pid) => job_environment(pid)?,
            None => weftcc::settings::process_environment(),
        };
        if let Some(id) = vars.get(weftcc::settings::UNIQUE_ID.name) {
            return id.parse().map_err(|e: weftcc::Error| e.to_string());
        }
        let info = LaunchInfo::from_vars(&vars).map_err(|e| match self.pid {
            Some(pid) => format!(
                "process {pid} is neither a rank of a weftcc job nor the launcher of one: {e}"
            ),
            None => format!("which job? give its unique id, --addr and --token, or --pid ({e})"),
        })?;
        // The store the ranks meet at (WEFT_STORE, e.g. `weft run`'s launcher's), else rank 0's.
        let addr = info
            .store
            .clone()
            .unwrap_or_else(|| weftcc::comm::join_host_port(&info.master_addr, info.master_port));
        Ok(UniqueId {
            addr,
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

/// Whether `vars` name a job: a unique id, or a launcher's rank variables.
fn names_a_job(vars: &HashMap<String, String>) -> bool {
    vars.contains_key(weftcc::settings::UNIQUE_ID.name) || LaunchInfo::from_vars(vars).is_ok()
}

/// The environment that names process `pid`'s job: its own when it is a rank; when it is a
/// launcher (`weft run`, `weft perf`, torchrun: the pid a user has), that of the first of its
/// children that is a rank.
fn job_environment(pid: u32) -> Result<HashMap<String, String>, String> {
    let proc_dir = format!("/proc/{pid}");
    if !std::path::Path::new(&proc_dir).exists() {
        return Err(format!("no such process: {pid}"));
    }
    let own = process_environment(pid)?;
    if names_a_job(&own) {
        return Ok(own);
    }
    let rank = children(pid)
        .into_iter()
        .filter_map(|child| process_environment(child).ok())
        .find(names_a_job);
    Ok(rank.unwrap_or(own))
}

/// The processes whose parent is `pid`, in pid order (read from `/proc/*/stat`).
fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut kids: Vec<u32> = dir
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| parent_of(p) == Some(pid))
        .collect();
    kids.sort_unstable();
    kids
}

/// The parent of process `pid`: the 4th field of `/proc/<pid>/stat`, after the command name
/// (which may hold spaces and parentheses, so the fields are counted from its last `)`).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_parent(&stat)
}

fn parse_parent(stat: &str) -> Option<u32> {
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(1)?.parse().ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_is_read_after_the_command_name() {
        assert_eq!(parse_parent("42 (weft) S 7 42 42 0"), Some(7));
        assert_eq!(parse_parent("42 (a) b) (c) R 9 1"), Some(9));
        assert_eq!(parse_parent("42 (weft"), None);
    }

    #[test]
    fn this_process_is_a_child_of_its_parent() {
        let me = std::process::id();
        let parent = parent_of(me).expect("own stat");
        assert!(children(parent).contains(&me));
    }
}
