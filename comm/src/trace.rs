//! The flight recorder: the last operations of each communicator (kind, type, count, peers,
//! algorithm, start and end, state) in a ring of `WEFT_TRACE_BUFFER_SIZE` entries, written to
//! a JSON file (a [`TraceDump`]) when the communicator fails (`WEFT_TRACE_DUMP_DIR`), when a
//! job-wide request arrives through the bootstrap store (`weft trace dump`), or when asked
//! ([`crate::Communicator::dump_trace`]). [`crate::trace_merge`] lines the dumps of a job up.
//!
//! Recording costs a lock and a copy of a few words per operation, twice (start and end); the
//! ring never grows past its capacity. Times are microseconds of the system clock (UNIX epoch)
//! so that dumps from different hosts line up.

use crate::error::Error;
use crate::lock;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use weftcc_collectives::{Algorithm, DataType, OpKind, ReduceOp};

/// Entries kept per communicator when `WEFT_TRACE_BUFFER_SIZE` is not set.
pub const DEFAULT_TRACE_BUFFER: usize = 2000;

/// What every dump's file name starts with.
const FILE_PREFIX: &str = "weft-trace-";

/// The first field of every dump, naming its format.
pub const TRACE_FORMAT: &str = "weft-trace/1";

/// Peers kept per entry (the rest are counted in [`TraceEntry::npeers`]).
const PEERS_KEPT: usize = 8;

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

/// One operation as recorded (typed, copied into the ring without allocating).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceEntry {
    /// Collective sequence number, or a point-to-point group's first message number.
    pub seq: u64,
    pub kind: OpKind,
    pub dtype: DataType,
    /// Elements per rank as the call gave them (bytes for a point-to-point group).
    pub count: u64,
    /// The reduction, for collectives that reduce.
    pub redop: Option<ReduceOp>,
    /// The root, for collectives that have one.
    pub root: Option<usize>,
    /// The first [`PEERS_KEPT`] peers this rank exchanges with in the operation.
    pub peers: [u32; PEERS_KEPT],
    /// How many peers in all.
    pub npeers: u32,
    /// The algorithm of a collective.
    pub algorithm: Option<Algorithm>,
    pub start_us: u64,
    pub end_us: Option<u64>,
    pub state: TraceState,
    /// The error's kind ([`Error::kind_name`]) when the operation failed.
    pub error: Option<&'static str>,
}

impl TraceEntry {
    /// A running operation started now.
    pub fn start(kind: OpKind, seq: u64, dtype: DataType, count: u64) -> TraceEntry {
        TraceEntry {
            seq,
            kind,
            dtype,
            count,
            redop: None,
            root: None,
            peers: [0; PEERS_KEPT],
            npeers: 0,
            algorithm: None,
            start_us: now_us(),
            end_us: None,
            state: TraceState::Running,
            error: None,
        }
    }

    /// Sets the peers (the first [`PEERS_KEPT`] kept, all counted).
    pub fn with_peers(mut self, peers: impl IntoIterator<Item = usize>) -> TraceEntry {
        let mut n = 0usize;
        for p in peers {
            if let Some(slot) = self.peers.get_mut(n) {
                *slot = p as u32;
            }
            n += 1;
        }
        self.npeers = n as u32;
        self
    }

    /// The entry as written to a dump.
    pub fn record(&self) -> TraceRecord {
        let kept = (self.npeers as usize).min(PEERS_KEPT);
        TraceRecord {
            seq: self.seq,
            kind: self.kind.to_string(),
            dtype: self.dtype.to_string(),
            count: self.count,
            redop: self.redop.map(|o| o.to_string()),
            root: self.root,
            peers: self.peers[..kept].iter().map(|&p| p as usize).collect(),
            npeers: self.npeers as usize,
            algorithm: self.algorithm.map(|a| a.name().to_string()),
            start_us: self.start_us,
            end_us: self.end_us,
            state: self.state,
            error: self.error.map(str::to_string),
        }
    }
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

/// The ring of a communicator's last operations. At most one operation runs at a time (calls
/// are ordered by the communicator's state lock), so the running one is always the newest.
#[derive(Debug)]
pub struct FlightRecorder {
    capacity: usize,
    ring: Mutex<Ring>,
}

#[derive(Debug, Default)]
struct Ring {
    entries: VecDeque<TraceEntry>,
    recorded: u64,
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` operations (0 records nothing).
    pub fn new(capacity: usize) -> FlightRecorder {
        FlightRecorder {
            capacity,
            ring: Mutex::new(Ring::default()),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records the start of an operation.
    pub fn start(&self, entry: TraceEntry) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = lock(&self.ring);
        if ring.entries.len() == self.capacity {
            ring.entries.pop_front();
        }
        ring.entries.push_back(entry);
        ring.recorded += 1;
    }

    /// Changes the running operation's entry (what is known only once it is prepared).
    pub fn update_running(&self, change: impl FnOnce(&mut TraceEntry)) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = lock(&self.ring);
        if let Some(last) = ring.entries.back_mut() {
            if last.state == TraceState::Running {
                change(last);
            }
        }
    }

    /// Ends the running operation, if one is running, with `error` or success.
    pub fn end(&self, error: Option<&Error>) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = lock(&self.ring);
        if let Some(last) = ring.entries.back_mut() {
            if last.state == TraceState::Running {
                last.end_us = Some(now_us());
                last.state = if error.is_some() {
                    TraceState::Failed
                } else {
                    TraceState::Completed
                };
                last.error = error.map(Error::kind_name);
            }
        }
    }

    /// The kept entries, oldest first, and how many were recorded in all.
    pub fn snapshot(&self) -> (Vec<TraceEntry>, u64) {
        let ring = lock(&self.ring);
        (ring.entries.iter().copied().collect(), ring.recorded)
    }
}

/// Microseconds since the UNIX epoch.
pub(crate) fn now_us() -> u64 {
    crate::progress::since_epoch().as_micros() as u64
}

/// A short tag of the job with `token` (FNV-1a of the token: the same on every rank, and not
/// the token itself, which authenticates to the store).
pub(crate) fn job_tag(token: &str) -> String {
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

impl crate::communicator::Inner {
    /// This communicator's flight recorder as a dump taken now.
    pub(crate) fn trace_dump(&self, reason: DumpReason) -> TraceDump {
        let (entries, recorded) = self.trace.snapshot();
        let me = crate::status::RankIdentity::this_process(self.size);
        TraceDump {
            format: TRACE_FORMAT.into(),
            job: job_tag(&self.token),
            namespace: self.namespace.clone(),
            rank: self.rank,
            nranks: self.size,
            host: me.host,
            pid: me.pid,
            reason,
            error: self.poisoned().map(|e| e.to_string()),
            dumped_us: now_us(),
            recorded,
            capacity: self.trace.capacity(),
            entries: entries.iter().map(TraceEntry::record).collect(),
        }
    }

    /// Once the communicator has failed: writes the recorder to `WEFT_TRACE_DUMP_DIR` when that
    /// is set (and the recorder on), once. Called after the failure is published and the
    /// waiting threads woken (the end of a failed call, `abort`, the watcher, the drop).
    pub(crate) fn dump_trace_if_due(&self) {
        let Some(dir) = &self.config.trace_dump_dir else {
            return;
        };
        if self.trace.capacity() == 0
            || !self
                .trace_dump_due
                .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        match self.trace_dump(DumpReason::Failure).write_to(dir) {
            Ok(path) => {
                tracing::warn!(target: "weftcc::trace", rank = self.rank, path = %path.display(), "flight recorder written")
            }
            Err(e) => {
                tracing::warn!(target: "weftcc::trace", rank = self.rank, dir = %dir.display(), "flight recorder not written: {e}")
            }
        }
    }

    /// Answers a job-wide dump request (read by the failure watcher): takes the dump now, and
    /// on a thread of its own (a slow or hung file system must not hold up the watcher) writes
    /// it where the request says, else to `WEFT_TRACE_DUMP_DIR`, else [`default_dump_dir`], and
    /// leaves the answer (`ok HOST:PATH` or `error MESSAGE`) under [`DumpRequest::answer_key`]
    /// through a store connection of its own.
    pub(crate) fn answer_dump_request(&self, request: &DumpRequest) {
        let dir = (request.dir.clone())
            .or_else(|| self.config.trace_dump_dir.clone())
            .unwrap_or_else(default_dump_dir);
        let dump = self.trace_dump(DumpReason::Request);
        let key = DumpRequest::answer_key(request.id, &self.namespace, self.rank);
        let (addr, token) = (self.store_addr.clone(), self.token.clone());
        let spawned = std::thread::Builder::new()
            .name("weft-trace-dump".into())
            .spawn(move || {
                let answer = match dump.write_to(&dir) {
                    Ok(path) => format!("ok {}:{}", dump.host, path.display()),
                    Err(e) => format!("error {}: {e}", dir.display()),
                };
                if let Ok(mut store) = weftcc_transports::StoreClient::connect(
                    &addr,
                    &token,
                    std::time::Duration::from_secs(5),
                ) {
                    let _ = store.set(&key, answer.as_bytes());
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(target: "weftcc::trace", rank = self.rank, "dump request not answered: {e}");
        }
    }
}

/// How many job-wide dump requests were made (0 when the store cannot be read: the watcher's
/// own poll notices a lost store). No server-side wait: a lost store costs the client's margin,
/// not its timeout.
pub(crate) fn requests_made(client: &mut weftcc_transports::StoreClient) -> u64 {
    client
        .add_within(REQUESTS_KEY, 0, std::time::Duration::ZERO)
        .map_or(0, |n| u64::try_from(n).unwrap_or(0))
}

/// Request number `id`, once it is in the store.
pub(crate) fn read_request(
    client: &mut weftcc_transports::StoreClient,
    id: u64,
) -> Option<DumpRequest> {
    let value = client
        .get(&DumpRequest::key(id), std::time::Duration::ZERO)
        .ok()?;
    DumpRequest::decode(&value).filter(|r| r.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> TraceEntry {
        TraceEntry::start(OpKind::AllReduce, seq, DataType::Float32, 1024)
    }

    #[test]
    fn the_ring_keeps_the_last_entries_and_counts_all() {
        let r = FlightRecorder::new(3);
        for seq in 1..=5 {
            r.start(entry(seq));
            r.end(None);
        }
        let (kept, recorded) = r.snapshot();
        assert_eq!(recorded, 5);
        assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(kept.iter().all(|e| e.state == TraceState::Completed));
        assert!(kept
            .iter()
            .all(|e| e.end_us.is_some_and(|t| t >= e.start_us)));
    }

    #[test]
    fn end_touches_only_a_running_entry() {
        let r = FlightRecorder::new(4);
        r.start(entry(1));
        r.end(None);
        // A call refused before it started (invalid arguments) ends nothing.
        r.end(Some(&Error::Config("x".into())));
        r.start(entry(2));
        let (kept, _) = r.snapshot();
        assert_eq!(kept[0].state, TraceState::Completed);
        assert_eq!(kept[1].state, TraceState::Running);
        r.end(Some(&Error::Config("x".into())));
        let (kept, _) = r.snapshot();
        assert_eq!(kept[1].state, TraceState::Failed);
        assert_eq!(kept[1].error, Some("config"));
    }

    #[test]
    fn a_recorder_of_capacity_zero_records_nothing() {
        let r = FlightRecorder::new(0);
        r.start(entry(1));
        r.end(None);
        assert_eq!(r.snapshot(), (vec![], 0));
    }

    #[test]
    fn peers_beyond_the_kept_ones_are_counted() {
        let e = entry(1).with_peers(0..20);
        assert_eq!(e.npeers, 20);
        let rec = e.record();
        assert_eq!(rec.peers, (0..PEERS_KEPT).collect::<Vec<_>>());
        assert_eq!(rec.npeers, 20);
        let e = entry(1).with_peers([3, 1]);
        assert_eq!(e.record().peers, [3, 1]);
    }

    #[test]
    fn dumps_are_written_whole_and_read_back() {
        let dir = std::env::temp_dir().join(format!("weft-trace-test-{}", std::process::id()));
        let r = FlightRecorder::new(8);
        let mut e = entry(7).with_peers([1, 3]);
        e.redop = Some(ReduceOp::Sum);
        e.algorithm = Some(Algorithm::Ring);
        r.start(e);
        let (kept, recorded) = r.snapshot();
        let dump = TraceDump {
            format: TRACE_FORMAT.into(),
            job: job_tag("token"),
            namespace: "c/split0".into(),
            rank: 2,
            nranks: 4,
            host: "h".into(),
            pid: 1,
            reason: DumpReason::Api,
            error: None,
            dumped_us: now_us(),
            recorded,
            capacity: 8,
            entries: kept.iter().map(TraceEntry::record).collect(),
        };
        let path = dump.write_to(&dir).expect("write");
        assert!(path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with("-c.split0-rank2-api.json")));
        assert_eq!(TraceDump::read(&path).expect("read"), dump);
        assert_eq!(dump.entries[0].signature(), "all-reduce float×1024 sum");
        let leftovers = std::fs::read_dir(&dir).expect("dir").count();
        assert_eq!(leftovers, 1, "no temporary file left");
        std::fs::write(&path, "{\"format\":\"other\"}").expect("write");
        assert!(TraceDump::read(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

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
