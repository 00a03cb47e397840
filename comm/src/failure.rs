//! The failure protocol: the first fatal error poisons the communicator and is published to
//! the bootstrap store as a typed note; a watcher thread on every rank reads it, so a dead or
//! failing rank becomes an error on all ranks within a fraction of a second instead of a hang.
//! Rank 0, which hosts the store, keeps it up after a failure until every rank's watcher has read
//! it (at most [`SETTLE_TIMEOUT`]).

use crate::communicator::Inner;
use crate::error::{Error, Result};
use crate::lock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weftcc_transports::store::StoreClient;
use weftcc_transports::TransportError;

/// How often the watcher thread re-polls the store for a job-wide abort.
pub(crate) const WATCH_PERIOD: Duration = Duration::from_millis(100);
/// Longest a failure report waits on the store.
pub(crate) const ALARM_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest the store's host, dropping a failed communicator, waits for the other ranks' watchers
/// to read the failure (a rank that died never does).
pub(crate) const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Store keys (under a communicator's namespace, [`Inner::store_key`]): the published failure;
/// the count of watchers done with it, and the flag the last of them sets.
pub(crate) const ABORT_KEY: &str = "abort";
pub(crate) const SETTLED_KEY: &str = "settled";
pub(crate) const SETTLED_ALL_KEY: &str = "settled-all";

/// The error that stopped the communicator, and the operation running when it did.
pub(crate) struct Poison {
    pub(crate) error: Mutex<Option<Error>>,
    pub(crate) set: AtomicBool,
}

impl Inner {
    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        if !self.poison.set.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison.error).clone()
    }

    /// Fails at once when the communicator is poisoned.
    pub(crate) fn check(&self) -> Result<()> {
        match self.poisoned() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records the first fatal error and tells the other ranks.
    ///
    /// The job agrees on one root cause: the first rank to fail wins a counter in the store and
    /// publishes its error; a rank failing later (often because of that first failure, e.g. a
    /// neighbour that exited) adopts the published cause instead of its own.
    pub(crate) fn fail(&self, e: Error) {
        if self.poison.set.load(Ordering::Acquire) {
            return;
        }
        let e = self.adopt_farewell(e);
        let local = !matches!(&e, Error::Aborted { by: Some(_), .. })
            && !matches!(&e, Error::PeerLost { detail, .. } if detail.starts_with("reported by"));
        // A local abort() is its own root cause: poison at once, so neither the caller of
        // abort() nor anyone waiting depends on how fast the store answers.
        if matches!(&e, Error::Aborted { by: None, .. }) {
            if self.poison_with(e.clone()) && self.size > 1 {
                let _ = self.publish_or_adopt(e);
            }
            return;
        }
        let e = if local && self.size > 1 {
            self.publish_or_adopt(e)
        } else {
            e
        };
        self.poison_with(e);
    }

    /// Sets the poison if it is not set yet; returns whether this call set it.
    pub(crate) fn poison_with(&self, e: Error) -> bool {
        {
            let mut slot = lock(&self.poison.error);
            if slot.is_some() {
                return false;
            }
            tracing::warn!(target: "weftcc::error", rank = self.rank, "{e}");
            *slot = Some(e);
            self.poison.set.store(true, Ordering::Release);
        }
        self.turn.wake_all();
        true
    }

    /// On rank 0, as this communicator goes: if its failure was published in the store, leaves
    /// the key that the other ranks' watchers set once they have all read it, and if no split
    /// relative still holds the store, waits for every such key before the store closes
    /// ([`StoreHost::settle`]; a relative dropped later waits for this one's too).
    pub(crate) fn settle_before_the_store_closes(&self) {
        let Some(host) = &self.store_host else {
            return;
        };
        let Ok(mut store) = self.alarm.try_lock() else {
            return;
        };
        if self.size > 1
            && self.poison.set.load(Ordering::Acquire)
            && matches!(store.check(&self.store_key(ABORT_KEY)), Ok(true))
        {
            lock(&host.unsettled).push(self.store_key(SETTLED_ALL_KEY));
        }
        if Arc::strong_count(host) == 1 {
            host.settle(Some(&mut store));
        }
    }

    /// `name` under this communicator's namespace in the bootstrap store.
    pub(crate) fn store_key(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }

    pub(crate) fn publish_or_adopt(&self, e: Error) -> Error {
        let Ok(mut store) = self.alarm.try_lock() else {
            return e;
        };
        let key = self.store_key(ABORT_KEY);
        match store.add(&format!("{key}-count"), 1) {
            Ok(1) => {
                let _ = store.set(&key, self.note_of(&e).as_bytes());
                e
            }
            Ok(_) => match store.get(&key, ALARM_TIMEOUT) {
                Ok(v) => remote_error(self, &String::from_utf8_lossy(&v)).unwrap_or(e),
                Err(_) => e,
            },
            Err(_) => e,
        }
    }

    /// `e` as the store and farewell notes carry it, for [`remote_error`] to read back:
    /// `abort <rank> <reason>` or `lost <peer> <reporting rank> <detail>`, naming the rank where
    /// the failure started (this one, or the one an adopted error came from).
    pub(crate) fn note_of(&self, e: &Error) -> String {
        match e {
            Error::Aborted {
                by: Some(by),
                reason,
                ..
            } => {
                let prefix = format!("rank {by} failed: ");
                format!(
                    "abort {by} {}",
                    reason.strip_prefix(&prefix).unwrap_or(reason)
                )
            }
            Error::PeerLost { peer, detail, .. } => {
                match detail
                    .strip_prefix("reported by rank ")
                    .and_then(|d| d.split_once(": "))
                {
                    Some((by, rest)) => format!("lost {peer} {by} {rest}"),
                    None => format!("lost {peer} {} {detail}", self.rank),
                }
            }
            other => format!("abort {} {other}", self.rank),
        }
    }

    /// For a peer that closed its connection after failing, the cause it left there (see
    /// [`Inner::leave_farewell`]): the root cause, which the store may no longer be able to
    /// tell (it lives with rank 0). Any other error is returned as it is.
    pub(crate) fn adopt_farewell(&self, e: Error) -> Error {
        let peer = match &e {
            Error::PeerLost { peer, detail, .. } if !detail.starts_with("reported by") => *peer,
            _ => return e,
        };
        let Some(st) = self.try_lock_state() else {
            return e;
        };
        let note = st.mesh.farewell(peer);
        drop(st);
        note.and_then(|n| remote_error(self, &n)).unwrap_or(e)
    }

    /// Leaves the poison's cause on every connection, once, for peers that see this rank close
    /// (shared memory keeps it; see [`weftcc_transports::Connection::leave_farewell`]). Skipped
    /// while an operation holds the state; the next call (at the latest the communicator's
    /// drop) leaves it.
    pub(crate) fn leave_farewell(&self) {
        if self.farewell_left.load(Ordering::Acquire) {
            return;
        }
        let Some(e) = self.poisoned() else { return };
        let Some(mut st) = self.try_lock_state() else {
            return;
        };
        st.mesh.leave_farewell(&self.note_of(&e));
        self.farewell_left.store(true, Ordering::Release);
    }
}

/// Watches the store for a job-wide abort, and for the death of the store's host (rank 0).
pub(crate) fn watch(inner: Arc<Inner>, mut client: StoreClient) {
    let key = inner.store_key(ABORT_KEY);
    while !inner.watcher_stop.load(Ordering::SeqCst) {
        match client.get(&key, WATCH_PERIOD) {
            Ok(value) => {
                let text = String::from_utf8_lossy(&value).to_string();
                if let Some(e) = remote_error(&inner, &text) {
                    inner.fail(e);
                    inner.turn.wake_all();
                }
                settle(&inner, &mut client);
                return;
            }
            Err(TransportError::Timeout { .. }) => continue,
            Err(TransportError::StoreClosed) => return,
            Err(e) => {
                if inner.watcher_stop.load(Ordering::SeqCst) {
                    return;
                }
                let (op, seq) = inner.current.get();
                inner.fail(Error::PeerLost {
                    rank: inner.rank,
                    peer: 0,
                    op,
                    seq,
                    detail: format!("reported by the watcher: the bootstrap store on rank 0 is unreachable ({e})"),
                });
                return;
            }
        }
    }
    settle(&inner, &mut client);
}

/// Counts this rank's watcher as done with the store (it read the failure, or its communicator
/// is going away); the last one to count says so, for [`StoreHost::settle`].
pub(crate) fn settle(inner: &Inner, client: &mut StoreClient) {
    if let Ok(n) = client.add_within(&inner.store_key(SETTLED_KEY), 1, WATCH_PERIOD) {
        if n == inner.size as i64 {
            let _ = client.set(&inner.store_key(SETTLED_ALL_KEY), b"1");
        }
    }
}

/// Turns a failure published by another rank into this rank's error.
pub(crate) fn remote_error(inner: &Inner, text: &str) -> Option<Error> {
    let (op, seq) = inner.current.get();
    let mut parts = text.splitn(4, ' ');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("lost"), Some(peer), Some(by), detail) => {
            let peer = peer.parse().ok()?;
            if peer == inner.rank {
                return None;
            }
            Some(Error::PeerLost {
                rank: inner.rank,
                peer,
                op,
                seq,
                detail: format!("reported by rank {by}: {}", detail.unwrap_or("")),
            })
        }
        (Some("abort"), Some(by), first, rest) => {
            let by: usize = by.parse().ok()?;
            if by == inner.rank {
                return None;
            }
            let reason = [first.unwrap_or(""), rest.unwrap_or("")].join(" ");
            Some(Error::Aborted {
                rank: inner.rank,
                by: Some(by),
                reason: format!("rank {by} failed: {}", reason.trim()),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommConfig, Communicator, UniqueId};
    use std::time::Instant;

    #[test]
    fn a_failed_communicator_dropped_before_its_split_child_leaves_its_settle_to_the_child() {
        let id = UniqueId::new().expect("unique id");
        let left = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let id = id.clone();
                    s.spawn(move || {
                        let parent = Communicator::init_with(
                            rank,
                            2,
                            &id,
                            CommConfig::from_env().expect("config"),
                        )
                        .expect("init");
                        let child = parent.split(Some(0), 0).expect("split").expect("member");
                        if rank == 1 {
                            let start = Instant::now();
                            while parent.error().is_none()
                                && start.elapsed() < Duration::from_secs(10)
                            {
                                std::thread::sleep(Duration::from_millis(2));
                            }
                            return Vec::new();
                        }
                        let host = parent.inner.store_host.clone().expect("rank 0 hosts");
                        parent.abort();
                        drop(parent);
                        let left = lock(&host.unsettled).clone();
                        drop(child);
                        left
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect::<Vec<_>>()
        });
        assert_eq!(left[0], vec![format!("c/{SETTLED_ALL_KEY}")]);
    }
}
