//! Where a process learns its rank, the job size and the rendezvous point.
//!
//! [`LaunchInfo::from_vars`] reads, in this order: weftcc's own launcher variables (`WEFT_RANK`,
//! ...), torchrun's (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...), SLURM's (`SLURM_PROCID`, ...) and
//! Open MPI's (`OMPI_COMM_WORLD_RANK`, ...). It is a pure function of the variables so every rule
//! is unit-tested without touching the process environment.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::time::Duration;

/// Default rendezvous port (torchrun's).
pub const DEFAULT_PORT: u16 = 29500;
/// Default per-operation timeout (`WEFT_TIMEOUT`, seconds).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Weft,
    Torchrun,
    Slurm,
    OpenMpi,
}

/// Rank, size and rendezvous of this process, as given by its launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchInfo {
    pub launcher: Launcher,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Rendezvous host (name or address) where rank 0 serves the bootstrap store.
    pub master_addr: String,
    pub master_port: u16,
    /// Job token all ranks share (rejects connections from other jobs).
    pub token: String,
    /// A running store the ranks meet at (`WEFT_STORE`), instead of rank 0 serving one at the
    /// rendezvous address.
    pub store: Option<String>,
}

/// Whether a launcher (weft run, torchrun, srun, mpirun) started this process as one rank of a
/// job: one of their rank variables is set.
pub fn started_by_launcher() -> bool {
    let vars = weftcc_settings::process_environment();
    ["WEFT_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"]
        .iter()
        .any(|k| vars.contains_key(*k))
}

impl LaunchInfo {
    /// Reads the process environment.
    pub fn from_env() -> Result<LaunchInfo> {
        Self::from_vars(&weftcc_settings::process_environment())
    }

    /// Reads launch information from a map of environment variables.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<LaunchInfo> {
        let get = |k: &str| vars.get(k).map(|s| s.trim()).filter(|s| !s.is_empty());
        let num = |k: &str| -> Result<Option<usize>> {
            get(k)
                .map(|v| {
                    v.parse::<usize>().map_err(|_| {
                        Error::Config(format!("{k}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let port = |k: &str| -> Result<Option<u16>> {
            get(k)
                .map(|v| {
                    v.parse::<u16>()
                        .map_err(|_| Error::Config(format!("{k}={v:?} is not a port number")))
                })
                .transpose()
        };
        let explicit_addr = get("WEFT_MASTER_ADDR")
            .or(get("MASTER_ADDR"))
            .map(str::to_string);
        let explicit_port = match port("WEFT_MASTER_PORT")? {
            Some(p) => Some(p),
            None => port("MASTER_PORT")?,
        };

        // `weft run` (WEFT_RANK, …) and torchrun (RANK, …) give rank and sizes directly.
        let direct = |prefix: &str| -> Result<Option<[usize; 4]>> {
            let var = |name: &str| num(&format!("{prefix}{name}"));
            Ok(match (var("RANK")?, var("WORLD_SIZE")?) {
                (Some(r), Some(n)) => Some([
                    r,
                    n,
                    var("LOCAL_RANK")?.unwrap_or(r),
                    var("LOCAL_WORLD_SIZE")?.unwrap_or(n),
                ]),
                _ => None,
            })
        };
        let (launcher, rank, world, local_rank, local_world, addr, port_no) =
            if let Some([r, n, lr, lw]) = direct("WEFT_")? {
                let addr = explicit_addr.clone();
                (Launcher::Weft, r, n, lr, lw, addr, explicit_port)
            } else if let Some([r, n, lr, lw]) = direct("")? {
                let addr = explicit_addr.clone();
                // torchrun's agent serves its own store on MASTER_PORT (it says so with
                // TORCHELASTIC_USE_AGENT_STORE): weftcc's goes on the port after it, unless
                // WEFT_MASTER_PORT names one.
                let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
                let port_no = match port("WEFT_MASTER_PORT")? {
                    Some(p) => Some(p),
                    None if agent_store => explicit_port.map(port_after_agent_store),
                    None => explicit_port,
                };
                (Launcher::Torchrun, r, n, lr, lw, addr, port_no)
            } else if let (Some(r), Some(n)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
                let head = get("SLURM_JOB_NODELIST")
                    .or(get("SLURM_NODELIST"))
                    .map(first_host)
                    .transpose()?;
                let job_port = num("SLURM_JOB_ID")?.map(|id| {
                    let step = num("SLURM_STEP_ID").ok().flatten().unwrap_or(0);
                    // Distinct jobs and steps on one node get distinct ports in 20000..=29999.
                    (20000 + (id * 7 + step) % 10000) as u16
                });
                let local_world = match num("SLURM_NTASKS_PER_NODE")? {
                    Some(v) => v,
                    None => first_count(get("SLURM_TASKS_PER_NODE")).unwrap_or(n),
                };
                (
                    Launcher::Slurm,
                    r,
                    n,
                    num("SLURM_LOCALID")?.unwrap_or(0),
                    local_world,
                    explicit_addr.clone().or(head),
                    explicit_port.or(job_port),
                )
            } else if let (Some(r), Some(n)) =
                (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
            {
                let local_world = num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(n);
                // All ranks on one host: the rendezvous is local.
                let addr = explicit_addr
                    .clone()
                    .or_else(|| (local_world == n).then(|| "127.0.0.1".to_string()));
                (
                    Launcher::OpenMpi,
                    r,
                    n,
                    num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
                    local_world,
                    addr,
                    explicit_port,
                )
            } else {
                return Err(Error::Config(
                    "no launcher environment found: start the program with `weft run`, torchrun, \
                     srun or mpirun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                        .into(),
                ));
            };
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} is out of range for world size {world}"
            )));
        }
        let master_addr = match addr {
            Some(a) => a,
            None if world == 1 => "127.0.0.1".to_string(),
            // A store the ranks meet at needs no other rendezvous address: its host stands in.
            None if get("WEFT_STORE").is_some_and(|s| !weftcc_store::is_etcd_address(s)) => {
                let store = get("WEFT_STORE").unwrap_or_default();
                store
                    .rsplit_once(':')
                    .map_or(store, |(host, _)| host)
                    .trim_matches(['[', ']'])
                    .to_string()
            }
            None if get("WEFT_STORE").is_some() => "127.0.0.1".to_string(),
            None => {
                return Err(Error::Config(format!(
                    "{launcher:?} launch without a rendezvous address: set MASTER_ADDR (and MASTER_PORT)"
                )))
            }
        };
        let master_port = port_no.unwrap_or(DEFAULT_PORT);
        // Ranks that were not given a token by `weft run` derive the same one from what they
        // share, so that at least stray connections from other jobs are refused.
        let token = match get("WEFT_JOB_TOKEN") {
            Some(t) => t.to_string(),
            None => {
                let job = get("SLURM_JOB_ID")
                    .or(get("TORCHELASTIC_RUN_ID"))
                    .or(get("OMPI_MCA_ess_base_jobid"))
                    .unwrap_or("none");
                let shared = format!("{launcher:?}-{master_addr}-{master_port}-{job}");
                // Hashed: transports accept tokens of at most 64 bytes.
                let h = weftcc_collectives::header::fnv1a32(shared.bytes());
                let h2 = weftcc_collectives::header::fnv1a32(shared.bytes().rev());
                format!("{}-{h:08x}{h2:08x}", format!("{launcher:?}").to_lowercase())
            }
        };
        Ok(LaunchInfo {
            launcher,
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world,
            master_addr,
            master_port,
            token,
            store: get("WEFT_STORE").map(str::to_string),
        })
    }
}

/// The port of weftcc's store under torchrun, whose agent holds `master_port` with its own:
/// the next one (the one before for 65535).
pub fn port_after_agent_store(master_port: u16) -> u16 {
    master_port.checked_add(1).unwrap_or(master_port - 1)
}

/// First host of a SLURM node list: `node[001-004,7],gpu9` → `node001`.
pub fn first_host(list: &str) -> Result<String> {
    let list = list.trim();
    let bad = || Error::Config(format!("cannot parse SLURM node list {list:?}"));
    // The first entry ends at a comma outside brackets.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    match entry.find('[') {
        None if !entry.is_empty() => Ok(entry.to_string()),
        None => Err(bad()),
        Some(open) => {
            let close = entry[open..].find(']').map(|c| open + c).ok_or_else(bad)?;
            let prefix = &entry[..open];
            let suffix = &entry[close + 1..];
            let first = entry[open + 1..close].split(',').next().ok_or_else(bad)?;
            let first = first.split('-').next().ok_or_else(bad)?;
            if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
                return Err(bad());
            }
            Ok(format!("{prefix}{first}{suffix}"))
        }
    }
}

/// First count of SLURM_TASKS_PER_NODE (`4(x2),3` → 4).
fn first_count(v: Option<&str>) -> Option<usize> {
    let v = v?;
    let digits: String = v.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// Reads `WEFT_TIMEOUT` (seconds, fractions allowed; [`DEFAULT_TIMEOUT`] when unset).
pub fn timeout_from_env() -> Result<Duration> {
    Ok(weftcc_settings::TIMEOUT
        .seconds()?
        .unwrap_or(DEFAULT_TIMEOUT))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An environment from `KEY=value` words.
    fn vars(words: &str) -> HashMap<String, String> {
        words
            .split_whitespace()
            .map(|w| w.split_once('=').expect("KEY=value"))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn weft_variables_win_over_torchrun() {
        let v = vars(
            "WEFT_RANK=1 WEFT_WORLD_SIZE=4 WEFT_LOCAL_RANK=1 \
            WEFT_LOCAL_WORLD_SIZE=2 WEFT_MASTER_ADDR=10.0.0.1 \
            WEFT_MASTER_PORT=1234 WEFT_JOB_TOKEN=abc RANK=3 WORLD_SIZE=8",
        );
        let i = LaunchInfo::from_vars(&v).unwrap();
        assert_eq!(i.launcher, Launcher::Weft);
        assert_eq!(
            (i.rank, i.world_size, i.local_rank, i.local_world_size),
            (1, 4, 1, 2)
        );
        assert_eq!(
            (i.master_addr.as_str(), i.master_port, i.token.as_str()),
            ("10.0.0.1", 1234, "abc")
        );
    }

    #[test]
    fn torchrun_variables() {
        let v = vars(
            "RANK=3 WORLD_SIZE=8 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=head \
            MASTER_PORT=29400",
        );
        let i = LaunchInfo::from_vars(&v).unwrap();
        assert_eq!(i.launcher, Launcher::Torchrun);
        assert_eq!((i.rank, i.world_size, i.local_rank), (3, 8, 1));
        assert_eq!((i.master_addr.as_str(), i.master_port), ("head", 29400));
        // Same inputs give the same derived token on every rank.
        assert_eq!(i.token, LaunchInfo::from_vars(&v).unwrap().token);
    }

    #[test]
    fn under_torchruns_agent_store_weftcc_takes_the_next_port() {
        let v = vars(
            "RANK=0 WORLD_SIZE=2 MASTER_ADDR=head MASTER_PORT=29400 \
            TORCHELASTIC_USE_AGENT_STORE=True",
        );
        assert_eq!(LaunchInfo::from_vars(&v).unwrap().master_port, 29401);
        let mut v = v;
        v.insert("WEFT_MASTER_PORT".into(), "30000".into());
        assert_eq!(LaunchInfo::from_vars(&v).unwrap().master_port, 30000);
        assert_eq!(port_after_agent_store(65535), 65534);
    }

    #[test]
    fn slurm_variables_take_first_host_and_job_port() {
        let v = vars(
            "SLURM_PROCID=5 SLURM_NTASKS=8 SLURM_LOCALID=1 \
            SLURM_TASKS_PER_NODE=4(x2) SLURM_JOB_NODELIST=gpu[017-020,33],cpu1 \
            SLURM_JOB_ID=4242",
        );
        let i = LaunchInfo::from_vars(&v).unwrap();
        assert_eq!(i.launcher, Launcher::Slurm);
        assert_eq!(
            (i.rank, i.world_size, i.local_rank, i.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(i.master_addr, "gpu017");
        assert!((20000..30000).contains(&i.master_port));
        let mut with_port = v.clone();
        with_port.insert("MASTER_PORT".into(), "4000".into());
        assert_eq!(LaunchInfo::from_vars(&with_port).unwrap().master_port, 4000);
    }

    #[test]
    fn open_mpi_on_one_host_uses_loopback() {
        let v = vars(
            "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 \
            OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=2",
        );
        let i = LaunchInfo::from_vars(&v).unwrap();
        assert_eq!(
            (i.launcher, i.master_addr.as_str()),
            (Launcher::OpenMpi, "127.0.0.1")
        );
        let multi =
            vars("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_SIZE=1");
        assert!(LaunchInfo::from_vars(&multi).is_err());
    }

    #[test]
    fn bad_values_are_config_errors() {
        assert!(LaunchInfo::from_vars(&vars("")).is_err());
        assert!(LaunchInfo::from_vars(&vars("RANK=x WORLD_SIZE=2")).is_err());
        assert!(LaunchInfo::from_vars(&vars("RANK=2 WORLD_SIZE=2 MASTER_ADDR=a")).is_err());
        assert!(LaunchInfo::from_vars(&vars(
            "RANK=0 WORLD_SIZE=2 MASTER_ADDR=a MASTER_PORT=99999"
        ))
        .is_err());
    }

    #[test]
    fn node_lists() {
        assert_eq!(first_host("node001").unwrap(), "node001");
        assert_eq!(first_host("n[3-5]").unwrap(), "n3");
        assert_eq!(first_host("a,b").unwrap(), "a");
        assert_eq!(first_host("rack[1,4]-x").unwrap(), "rack1-x");
        assert!(first_host("n[").is_err());
        assert!(first_host("").is_err());
        assert!(first_host("n[a-b]").is_err());
    }
}
