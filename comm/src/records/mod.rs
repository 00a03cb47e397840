//! What ranks leave in the job's bootstrap store and in their dumps, and how it is read: the
//! store's key names and the record formats, in one place for the runtime that writes them and
//! the readers (`weft status`, `weft trace merge`) that interpret them. Pure: no store, socket or
//! thread here, only names, encodings and the rules that read them.
//!
//! | module | record |
//! |---|---|
//! | [`progress`] | where a rank is ([`progress::ProgressRecord`]), who is behind ([`progress::Behind`]) |
//! | [`note`] | why a communicator failed ([`note::FailureNote`]), as the store and farewells carry it |
//! | [`identity`] | who a rank is ([`identity::RankIdentity`]), its store session's value |
//! | [`trace`] | flight-recorder dumps and job-wide dump requests |
//! | [`agreement`] | what a rank announces at set-up ([`agreement::Announcement`]) and where ranks disagree |
//! | [`recovery`] | the survivors' agreed failed sets, newcomers' tickets and places ([`recovery::Place`]) |

pub mod agreement;
pub mod identity;
pub mod note;
pub mod progress;
pub mod recovery;
pub mod trace;

/// `name` under a communicator's `namespace` in the bootstrap store.
pub fn store_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// Keys of a communicator's failure (under its namespace, [`store_key`]): the published note;
/// the count of ranks that competed to publish one (`abort-count`); the count of watchers done
/// with it, and the flag the last of them sets.
pub const ABORT_KEY: &str = "abort";
pub const SETTLED_KEY: &str = "settled";
pub const SETTLED_ALL_KEY: &str = "settled-all";

/// The counter beside [`ABORT_KEY`] that the first failing rank wins.
pub fn abort_count_key(abort_key: &str) -> String {
    format!("{abort_key}-count")
}

/// The store session a rank's failure watcher names (see `weftcc_store`): its
/// connection's requests, one every a tenth of a second, are the rank's signs of
/// life.
pub fn session_key(namespace: &str, rank: usize) -> String {
    format!("{}{rank}", session_prefix(namespace))
}

/// Store key of rank `rank`'s published progress under `namespace`.
pub fn progress_key(namespace: &str, rank: usize) -> String {
    format!("{namespace}/progress/{rank}")
}

/// What the [`session_key`]s of `namespace` start with.
pub fn session_prefix(namespace: &str) -> String {
    format!("{namespace}/rank/")
}

/// The rank of a session named by [`session_key`] under `namespace`.
pub fn session_rank(key: &str, namespace: &str) -> Option<usize> {
    key.strip_prefix(&session_prefix(namespace))?.parse().ok()
}

/// The namespace and rank of any [`session_key`].
pub fn split_session_key(key: &str) -> Option<(&str, usize)> {
    let (namespace, rank) = key.rsplit_once("/rank/")?;
    Some((namespace, rank.parse().ok()?))
}
