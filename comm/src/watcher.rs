//! The failure watcher: a thread per communicator that publishes this rank's progress, reads
//! the job's failure note from the bootstrap store (a failure anywhere becomes an error here
//! within [`WATCH_PERIOD`]), notices the store's host (rank 0) going, and answers job-wide
//! flight-recorder dump requests. Its store session is the rank's sign of life; where the store
//! runs no session-closed hook (etcd), it also publishes the death of a peer whose session
//! closed.

use crate::background::Background;
use crate::bootstrap::UniqueId;
use crate::failure::WATCH_PERIOD;
use crate::inner::Inner;
use crate::records::identity::RankIdentity;
use crate::records::{progress_key, session_key, session_prefix, ABORT_KEY, SETTLED_ALL_KEY};
use crate::trace::{read_request, requests_made};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use weftcc_store::{StoreClient, StoreError};

/// Watches the store for a job-wide abort, and for the death of the store's host (rank 0).
pub(crate) fn watch(inner: Arc<Inner>, mut client: StoreClient) {
    let key = inner.failures.store_key(ABORT_KEY);
    let progress_key = progress_key(&inner.namespace, inner.rank);
    let mut published = None;
    // Dump requests made before this communicator existed are not for it.
    let mut requests = DumpRequests::new(&mut client);
    let mut closed = ClosedSessions::new(&client, &inner.namespace);
    while !inner.watcher_stop.load(Ordering::SeqCst) {
        requests.poll(&inner, &mut client);
        closed.poll(&mut client);
        // This rank's progress, when it moved (a store that fails here fails the get below; no
        // server-side wait, so a lost store costs the client's margin, not its timeout).
        let version = inner.progress.version();
        if published != Some(version)
            && client
                .set_within(
                    &progress_key,
                    inner.progress.record().encode().as_bytes(),
                    Duration::ZERO,
                )
                .is_ok()
        {
            published = Some(version);
        }
        match client.get(&key, WATCH_PERIOD) {
            Ok(value) => {
                if let Some(e) = inner.failures.remote_error(&value, inner.current.get()) {
                    inner.fail(e);
                    inner.turns.wake_all();
                }
                inner.failures.settle(&mut client);
                inner.dump_trace_if_due();
                keep_alive(&inner, &mut client, &mut requests);
                return;
            }
            Err(StoreError::Timeout { .. }) => continue,
            Err(StoreError::Closed) => return,
            Err(e) => {
                if inner.watcher_stop.load(Ordering::SeqCst) {
                    return;
                }
                let (op, seq) = inner.current.get();
                inner.fail(inner.store_lost(op, seq, e));
                inner.dump_trace_if_due();
                return;
            }
        }
    }
    inner.failures.settle(&mut client);
    leave(&inner, &mut client);
}

/// After a failure, goes on showing the store that this rank lives (`weft status` tells a dead
/// process from one that failed and is still there) until the communicator goes.
fn keep_alive(inner: &Inner, client: &mut StoreClient, requests: &mut DumpRequests) {
    while !inner.watcher_stop.load(Ordering::SeqCst) {
        // Unparked by the communicator's drop: a failed communicator replaced by its survivors'
        // goes at once, not at the next period.
        std::thread::park_timeout(WATCH_PERIOD);
        requests.poll(inner, client);
        // A request without a server-side wait: a store that is gone costs the client's margin
        // (the communicator's drop joins this thread), not its timeout.
        match client.get(&inner.failures.store_key(SETTLED_ALL_KEY), Duration::ZERO) {
            Ok(_) | Err(StoreError::Timeout { .. }) => {}
            Err(_) => return,
        }
    }
    leave(inner, client);
}

/// The watcher's view of job-wide flight-recorder dump requests: their count is read every
/// [`DumpRequests::EVERY`] polls (one small store request a second), and each request made
/// since this communicator began is answered once, in order.
struct DumpRequests {
    polls: u32,
    /// The last request answered (or made before this communicator existed).
    last: u64,
}

impl DumpRequests {
    const EVERY: u32 = 10;

    fn new(client: &mut StoreClient) -> DumpRequests {
        DumpRequests {
            polls: 0,
            last: requests_made(client),
        }
    }

    fn poll(&mut self, inner: &Inner, client: &mut StoreClient) {
        self.polls = self.polls.wrapping_add(1);
        if !self.polls.is_multiple_of(Self::EVERY) {
            return;
        }
        let made = requests_made(client);
        while self.last < made {
            // Counted but not stored yet: looked for again on the next round.
            let Some(request) = read_request(client, self.last + 1) else {
                break;
            };
            self.last += 1;
            inner.answer_dump_request(&request);
        }
    }
}

/// Where the store runs no session-closed hook of its own (etcd: a session closes when its
/// client's lease expires), the watcher runs the store's rule ([`lost_by_the_store`]) on every
/// closed session of its communicator, every [`ClosedSessions::EVERY`] polls; the rule publishes
/// a death once however many ranks see it.
///
/// [`lost_by_the_store`]: crate::failure::lost_by_the_store
struct ClosedSessions {
    /// `None`: the store runs the hook itself.
    prefix: Option<String>,
    polls: u32,
    /// Sessions already acted on.
    seen: HashSet<String>,
}

impl ClosedSessions {
    const EVERY: u32 = 5;

    fn new(client: &StoreClient, namespace: &str) -> ClosedSessions {
        ClosedSessions {
            prefix: (!client.runs_session_hooks()).then(|| session_prefix(namespace)),
            polls: 0,
            seen: HashSet::new(),
        }
    }

    fn poll(&mut self, client: &mut StoreClient) {
        let Some(prefix) = &self.prefix else {
            return;
        };
        self.polls = self.polls.wrapping_add(1);
        if !self.polls.is_multiple_of(Self::EVERY) {
            return;
        }
        let Ok(sessions) = client.sessions(prefix) else {
            return;
        };
        for s in sessions.into_iter().filter(|s| !s.open) {
            if self.seen.insert(s.key.clone()) {
                crate::failure::lost_by_the_store(&s.key, &s.value, client);
            }
        }
    }
}

/// Where the store runs no session hook (etcd), [`ClosedSessions`] on a thread of its own while
/// this rank sets up (its watcher starts only after): a rank that dies during set-up then ends
/// the others' set-up waits, naming it, as the built-in store's hook makes it. Stops when
/// dropped; `None` where the store runs the hook itself (or no client or thread could be had:
/// set-up then ends at its timeout instead).
pub(crate) fn setup_scan(
    store: &StoreClient,
    id: &UniqueId,
    namespace: &str,
    timeout: Duration,
) -> Option<Background> {
    if store.runs_session_hooks() {
        return None;
    }
    let mut client = StoreClient::connect(&id.addr, &id.token, timeout).ok()?;
    let mut closed = ClosedSessions::new(&client, namespace);
    Background::spawn("weft-setup-scan".into(), move |stop| {
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(WATCH_PERIOD);
            closed.poll(&mut client);
        }
    })
    .ok()
}

/// Marks this rank's session as left (its communicator was destroyed), so that its closing
/// connection does not read as a death.
fn leave(inner: &Inner, client: &mut StoreClient) {
    leave_session(&inner.namespace, inner.rank, inner.size, client);
}

/// Marks the session of `rank` (of `size`) under `namespace` as left: its connection closing
/// next is no death (a communicator destroyed, or a set-up that failed on this rank and
/// reported why).
pub(crate) fn leave_session(namespace: &str, rank: usize, size: usize, client: &mut StoreClient) {
    let mut me = RankIdentity::this_process(size);
    me.left = true;
    let _ = client.name_session(&session_key(namespace, rank), me.encode().as_bytes());
}
