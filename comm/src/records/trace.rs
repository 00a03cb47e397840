//! Flight-recorder dumps as written to files (JSON, [`TRACE_FORMAT`]) and the job-wide dump
//! requests left in the bootstrap store (`weft trace dump`).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use weftcc_collectives::OpKind;

/// What every dump's file name starts with.
const FILE_PREFIX: &str = "weft-trace-";

/// The first field of every dump, naming its format.
pub const TRACE_FORMAT: &str = "weft-trace/1";

/// Where an operation stood when the entry was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceState {
    /// Started and not ended (the operation a hung rank is in).
    Running,
    /// Ended without error.
    Completed,
    /// Ended with an error (named in [`TraceRecord::error`]).
    Failed,
}

/// One operation in a dump.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    pub seq: u64,
    pub kind: String,
    pub dtype: String,
    pub count: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redop: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<usize>,
    #[serde(default)]
    pub peers: Vec<usize>,
    #[serde(default)]
    pub npeers: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    pub start_us: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_us: Option<u64>,
    pub state: TraceState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl TraceRecord {
    /// Whether this is a collective (point-to-point groups have no job-wide sequence).
    pub fn is_collective(&self) -> bool {
        self.kind != OpKind::SendRecv.to_string()
    }

    /// What every rank must call alike: kind, type, count, reduction and root.
    pub fn signature(&self) -> String {
        let mut s = format!("{} {}×{}", self.kind, self.dtype, self.count);
        if let Some(op) = &self.redop {
            s += &format!(" {op}");
        }
        if let Some(root) = self.root {
            s += &format!(" root {root}");
        }
        s
    }
}

/// Why a dump was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DumpReason {
    /// The communicator failed (its error is in [`TraceDump::error`]).
    Failure,
    /// A job-wide request through the bootstrap store (`weft trace dump`).
    Request,
    /// The program asked ([`crate::Communicator::dump_trace`]).
    Api,
}

/// One rank's flight recorder, as written to its file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceDump {
    /// [`TRACE_FORMAT`].
    pub format: String,
    /// A tag of the job (the same on every rank of one job, different across jobs).
    pub job: String,
    /// The communicator's namespace in the job's store (`c` for the job's own).
    pub namespace: String,
    pub rank: usize,
    pub nranks: usize,
    pub host: String,
    pub pid: u32,
    pub reason: DumpReason,
    /// The communicator's error when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the dump was taken (µs since the UNIX epoch).
    pub dumped_us: u64,
    /// Operations recorded since the communicator was made (older ones fell out of the ring).
    pub recorded: u64,
    /// The ring's capacity.
    pub capacity: usize,
    /// The kept operations, oldest first.
    pub entries: Vec<TraceRecord>,
    /// How this communicator came from the job's first ones (shrinks and grows, oldest first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lineage: Vec<super::recovery::RecoveryEvent>,
}

impl TraceDump {
    /// The file name of a dump: job tag, namespace (`/` as `.`), rank and why it was taken (a
    /// request's dump does not replace the one taken at the failure).
    pub fn file_name(job: &str, namespace: &str, rank: usize, reason: DumpReason) -> String {
        let ns: String = namespace
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '.' })
            .collect();
        let reason = match reason {
            DumpReason::Failure => "failure",
            DumpReason::Request => "request",
            DumpReason::Api => "api",
        };
        format!("{FILE_PREFIX}{job}-{ns}-rank{rank}-{reason}.json")
    }

    /// Whether a file name is that of a written dump ([`TraceDump::file_name`]; temporary files
    /// of a write in progress are not).
    pub fn is_dump_file(name: &str) -> bool {
        name.starts_with(FILE_PREFIX) && name.ends_with(".json")
    }

    /// Writes the dump into `dir` (made if missing), through a temporary file of its own
    /// renamed into place, so a reader never sees half a dump. Returns the file's path.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<PathBuf> {
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        std::fs::create_dir_all(dir)?;
        let path = dir.join(Self::file_name(
            &self.job,
            &self.namespace,
            self.rank,
            self.reason,
        ));
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("json.{}.{n}.tmp", std::process::id()));
        let text = serde_json::to_string(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    /// Reads a dump written by [`TraceDump::write_to`].
    pub fn read(path: &Path) -> Result<TraceDump, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let dump: TraceDump =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if dump.format != TRACE_FORMAT {
            return Err(format!(
                "{}: format {:?}, expected {TRACE_FORMAT:?}",
                path.display(),
                dump.format
            ));
        }
        Ok(dump)
    }
}

/// A short tag of the job with `token` (FNV-1a of the token: the same on every rank, and not
/// the token itself, which authenticates to the store).
pub fn job_tag(token: &str) -> String {
    format!("{:08x}", weftcc_transports::fnv1a64(token.as_bytes()) >> 32)
}

/// The store counter of job-wide dump requests (outside every communicator's namespace: every
/// communicator of the job answers them). Request `n` (counting from 1) is under
/// [`DumpRequest::key`]; numbered, so that two requests close together are both answered.
pub const REQUESTS_KEY: &str = "weft-trace/requests";

/// A job-wide request to dump: its number, and the directory to write to (`None`: each rank's
/// `WEFT_TRACE_DUMP_DIR`, else [`default_dump_dir`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpRequest {
    pub id: u64,
    pub dir: Option<PathBuf>,
}

impl DumpRequest {
    const MAGIC: &'static str = "weft-trace-request/1";

    pub fn encode(&self) -> String {
        match &self.dir {
            Some(d) => format!("{} {} {}", Self::MAGIC, self.id, d.display()),
            None => format!("{} {}", Self::MAGIC, self.id),
        }
    }

    pub fn decode(bytes: &[u8]) -> Option<DumpRequest> {
        let text = std::str::from_utf8(bytes).ok()?;
        let rest = text.strip_prefix(Self::MAGIC)?.strip_prefix(' ')?;
        let (id, dir) = match rest.split_once(' ') {
            Some((id, dir)) if !dir.is_empty() => (id, Some(PathBuf::from(dir))),
            Some(_) => return None,
            None => (rest, None),
        };
        Some(DumpRequest {
            id: id.parse().ok()?,
            dir,
        })
    }

    /// The key request `id` is stored under.
    pub fn key(id: u64) -> String {
        format!("weft-trace/request/{id}")
    }

    /// The key a rank of `namespace` answers request `id` under: `ok HOST:PATH` or
    /// `error MESSAGE`.
    pub fn answer_key(id: u64, namespace: &str, rank: usize) -> String {
        format!("weft-trace/answer/{id}/{namespace}/{rank}")
    }
}

/// Where dumps go when neither the request nor `WEFT_TRACE_DUMP_DIR` says.
pub fn default_dump_dir() -> PathBuf {
    std::env::temp_dir().join("weft-trace")
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn any_request_round_trips_and_any_bytes_decode_or_are_refused(
            id in proptest::prelude::any::<u64>(),
            dir in proptest::option::of("[^\\x00]{1,40}"),
            garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let req = DumpRequest { id, dir: dir.map(PathBuf::from) };
            proptest::prop_assert_eq!(DumpRequest::decode(req.encode().as_bytes()), Some(req));
            let _ = DumpRequest::decode(&garbage);
            let mut framed = b"weft-trace-request/1 ".to_vec();
            framed.extend_from_slice(&garbage);
            let _ = DumpRequest::decode(&framed);
        }
    }

    #[test]
    fn requests_round_trip_and_garbage_is_refused() {
        for req in [
            DumpRequest { id: 7, dir: None },
            DumpRequest {
                id: u64::MAX,
                dir: Some("/shared/dumps with space".into()),
            },
        ] {
            assert_eq!(DumpRequest::decode(req.encode().as_bytes()), Some(req));
        }
        for bad in [
            "",
            "weft-trace-request/1",
            "weft-trace-request/1 x",
            "weft-trace-request/1 7 ",
            "weft-trace-request/2 7",
        ] {
            assert_eq!(DumpRequest::decode(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(job_tag("a"), job_tag("a"));
        assert_ne!(job_tag("a"), job_tag("b"));
    }
}
