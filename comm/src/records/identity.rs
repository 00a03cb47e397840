//! Who a rank is: the value of its failure watcher's store session, which `weft status` reads
//! to name a rank's host and process and to tell a rank that left from one that died.

/// Namespace of the communicator every job has (the one made by `init`; splits live under it).
pub const WORLD_NAMESPACE: &str = "c";

/// Who a rank is, as its watcher's store session says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankIdentity {
    /// Ranks of its communicator.
    pub nranks: usize,
    /// Its process id (on `host`).
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// Whether it destroyed its communicator (left) rather than running.
    pub left: bool,
}

impl RankIdentity {
    const MAGIC: &'static str = "weft-rank/1";

    /// This process, a rank of `nranks`.
    pub fn this_process(nranks: usize) -> RankIdentity {
        RankIdentity {
            nranks,
            pid: std::process::id(),
            host: weftcc_topology::discover::hostname().unwrap_or_else(|| "?".into()),
            left: false,
        }
    }

    pub fn encode(&self) -> String {
        let state = if self.left { "left" } else { "run" };
        format!(
            "{} {} {} {state} {}",
            Self::MAGIC,
            self.nranks,
            self.pid,
            self.host
        )
    }

    pub fn decode(bytes: &[u8]) -> Option<RankIdentity> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut f = text.splitn(5, ' ');
        if f.next()? != Self::MAGIC {
            return None;
        }
        let nranks = f.next()?.parse().ok()?;
        let pid = f.next()?.parse().ok()?;
        let left = match f.next()? {
            "run" => false,
            "left" => true,
            _ => return None,
        };
        Some(RankIdentity {
            nranks,
            pid,
            host: f.next()?.to_string(),
            left,
        })
    }
}
