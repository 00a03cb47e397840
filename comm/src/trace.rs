//! The flight recorder: the last operations of each communicator (kind, type, count, peers,
//! algorithm, start and end, state) in a ring of `WEFT_TRACE_BUFFER_SIZE` entries, written to
//! a JSON file (a [`crate::records::trace::TraceDump`]) when the communicator fails (`WEFT_TRACE_DUMP_DIR`), when a
//! job-wide request arrives through the bootstrap store (`weft trace dump`), or when asked
//! ([`crate::Communicator::dump_trace`]). `weft trace merge` lines the dumps of a job up.
//!
//! Recording costs a lock and one copy of the entry when an operation starts, and an atomic
//! store when it ends without error; the ring never grows past its capacity. Times are
//! microseconds of the system clock (UNIX epoch) so that dumps from different hosts line up.

use crate::error::Error;
use crate::records::trace::{DumpRequest, TraceRecord, TraceState, REQUESTS_KEY};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use weftcc_collectives::{Algorithm, DataType, OpKind, ReduceOp};
use weftcc_store::StoreClient;
use weftcc_transports::lock;

/// Entries kept per communicator when `WEFT_TRACE_BUFFER_SIZE` is not set.
pub const DEFAULT_TRACE_BUFFER: usize = 2000;

/// Peers kept per entry (the rest are counted in [`TraceEntry::npeers`]).
const PEERS_KEPT: usize = 8;

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
        TraceEntry::started_at(kind, seq, dtype, count, now_us())
    }

    /// A running operation started at `start_us` (microseconds since the UNIX epoch).
    pub fn started_at(
        kind: OpKind,
        seq: u64,
        dtype: DataType,
        count: u64,
        start_us: u64,
    ) -> TraceEntry {
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
            start_us,
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

/// The ring of a communicator's last operations. At most one operation runs at a time (calls
/// are ordered by the communicator's state lock), so the running one is always the newest.
///
/// A successful end is one atomic store ([`FlightRecorder::end`]): the newest entry's end time
/// waits in `ended` until the next start, a failed end or a snapshot applies it under the lock.
/// An 8-byte all-reduce then takes the recorder's lock once instead of twice.
#[derive(Debug)]
pub struct FlightRecorder {
    capacity: usize,
    ring: Mutex<Ring>,
    /// When the newest entry completed without error (µs since the epoch); 0 while it runs or
    /// once applied.
    ended: AtomicU64,
}

/// The entries in a vector that, once full, is overwritten from its oldest entry on (`oldest`):
/// a start then costs one copy of the entry, where a `VecDeque` also popped the front.
#[derive(Debug, Default)]
struct Ring {
    entries: Vec<TraceEntry>,
    oldest: usize,
    recorded: u64,
}

impl Ring {
    fn push(&mut self, entry: TraceEntry, capacity: usize) {
        if self.entries.len() < capacity {
            self.entries.push(entry);
        } else if let Some(slot) = self.entries.get_mut(self.oldest) {
            *slot = entry;
            self.oldest += 1;
            if self.oldest == self.entries.len() {
                self.oldest = 0;
            }
        }
        self.recorded += 1;
    }

    fn newest_mut(&mut self) -> Option<&mut TraceEntry> {
        // The entry before the oldest, around the ring (no division: this runs every call).
        let at = self
            .oldest
            .checked_sub(1)
            .or(self.entries.len().checked_sub(1))?;
        self.entries.get_mut(at)
    }

    /// Oldest first.
    fn in_order(&self) -> impl Iterator<Item = &TraceEntry> {
        let (newer, older) = self.entries.split_at(self.oldest);
        older.iter().chain(newer)
    }
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` operations (0 records nothing).
    pub fn new(capacity: usize) -> FlightRecorder {
        FlightRecorder {
            capacity,
            ring: Mutex::new(Ring::default()),
            ended: AtomicU64::new(0),
        }
    }

    /// Applies a successful end stored in `ended` to the newest entry, if that one still runs.
    ///
    /// A load and a store rather than a swap (no locked instruction per call): callers hold the
    /// ring's lock, so no other settle runs, and [`FlightRecorder::end`] stores only while
    /// `ended` is 0, so nothing changes it between the two.
    fn settle(&self, ring: &mut Ring) {
        let end_us = self.ended.load(Ordering::Acquire);
        if end_us == 0 {
            return;
        }
        self.ended.store(0, Ordering::Relaxed);
        if let Some(last) = ring.newest_mut() {
            if last.state == TraceState::Running {
                last.end_us = Some(end_us);
                last.state = TraceState::Completed;
            }
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
        self.settle(&mut ring);
        ring.push(entry, self.capacity);
    }

    /// Changes the running operation's entry (what is known only once it is prepared).
    pub fn update_running(&self, change: impl FnOnce(&mut TraceEntry)) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = lock(&self.ring);
        if let Some(last) = ring.newest_mut() {
            if last.state == TraceState::Running {
                change(last);
            }
        }
    }

    /// Ends the running operation, if one is running, at `end_us` with `error` or success.
    pub fn end(&self, error: Option<&Error>, end_us: u64) {
        if self.capacity == 0 {
            return;
        }
        if error.is_none() {
            // Applied under the lock later (`settle`), and only to an entry still running. Ends
            // come one at a time (under the communicator's state lock); one pending already
            // belongs to the newest entry, and a call that recorded no entry must not move it.
            if self.ended.load(Ordering::Relaxed) == 0 {
                self.ended.store(end_us.max(1), Ordering::Release);
            }
            return;
        }
        let mut ring = lock(&self.ring);
        self.settle(&mut ring);
        if let Some(last) = ring.newest_mut() {
            if last.state == TraceState::Running {
                last.end_us = Some(end_us);
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
        let mut ring = lock(&self.ring);
        self.settle(&mut ring);
        (ring.in_order().copied().collect(), ring.recorded)
    }
}

pub use crate::records::progress::now_us;

/// How many job-wide dump requests were made (0 when the store cannot be read: the watcher's
/// own poll notices a lost store). No server-side wait: a lost store costs the client's margin,
/// not its timeout.
pub(crate) fn requests_made(client: &mut StoreClient) -> u64 {
    client
        .add_within(REQUESTS_KEY, 0, Duration::ZERO)
        .map_or(0, |n| u64::try_from(n).unwrap_or(0))
}

/// Request number `id`, once it is in the store.
pub(crate) fn read_request(client: &mut StoreClient, id: u64) -> Option<DumpRequest> {
    let value = client.get(&DumpRequest::key(id), Duration::ZERO).ok()?;
    DumpRequest::decode(&value).filter(|r| r.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::trace::{job_tag, DumpReason, TraceDump, TRACE_FORMAT};

    fn entry(seq: u64) -> TraceEntry {
        TraceEntry::start(OpKind::AllReduce, seq, DataType::Float32, 1024)
    }

    #[test]
    fn the_ring_keeps_the_last_entries_and_counts_all() {
        let r = FlightRecorder::new(3);
        for seq in 1..=5 {
            r.start(entry(seq));
            r.end(None, now_us());
        }
        let (kept, recorded) = r.snapshot();
        assert_eq!(recorded, 5);
        assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(kept.iter().all(|e| e.state == TraceState::Completed));
        assert!(kept
            .iter()
            .all(|e| e.end_us.is_some_and(|t| t >= e.start_us)));
        // Around the ring more than once, the newest still running.
        for seq in 6..=10 {
            r.start(entry(seq));
            if seq < 10 {
                r.end(None, now_us());
            }
        }
        let (kept, recorded) = r.snapshot();
        assert_eq!(recorded, 10);
        assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), [8, 9, 10]);
        assert_eq!(kept[2].state, TraceState::Running);
        r.end(None, now_us());
        assert_eq!(r.snapshot().0[2].state, TraceState::Completed);
    }

    #[test]
    fn end_touches_only_a_running_entry() {
        let r = FlightRecorder::new(4);
        r.start(entry(1));
        r.end(None, now_us());
        // A call refused before it started (invalid arguments) ends nothing.
        r.end(Some(&Error::Config("x".into())), now_us());
        r.start(entry(2));
        let (kept, _) = r.snapshot();
        assert_eq!(kept[0].state, TraceState::Completed);
        assert_eq!(kept[1].state, TraceState::Running);
        r.end(Some(&Error::Config("x".into())), now_us());
        let (kept, _) = r.snapshot();
        assert_eq!(kept[1].state, TraceState::Failed);
        assert_eq!(kept[1].error, Some("config"));
    }

    #[test]
    fn a_successful_end_lands_on_its_own_entry_only() {
        let r = FlightRecorder::new(4);
        r.start(entry(1));
        r.end(None, 10);
        // A call that recorded no entry (a split's barrier) ends too: entry 1 keeps its time.
        r.end(None, 20);
        let (kept, _) = r.snapshot();
        assert_eq!(
            (kept[0].state, kept[0].end_us),
            (TraceState::Completed, Some(10))
        );
        r.end(None, 30);
        r.start(entry(2));
        let (kept, _) = r.snapshot();
        assert_eq!(kept[0].end_us, Some(10));
        assert_eq!((kept[1].state, kept[1].end_us), (TraceState::Running, None));
        r.end(None, 40);
        let (kept, _) = r.snapshot();
        assert_eq!(
            (kept[1].state, kept[1].end_us),
            (TraceState::Completed, Some(40))
        );
    }

    #[test]
    fn a_recorder_of_capacity_zero_records_nothing() {
        let r = FlightRecorder::new(0);
        r.start(entry(1));
        r.end(None, now_us());
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
            lineage: Vec::new(),
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
}
