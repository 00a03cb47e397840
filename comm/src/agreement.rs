//! The consistency check when a communicator is made: every rank announces its library
//! version and build id (the git commit it was built from), the settings that are not its own
//! ([`weftcc_settings::Agreement`]), what its network settings resolved to (the kind of interface
//! TCP listens on, the network provider), its CPU and its GPUs; rank 0 compares them ([`crate::records::agreement::compare`]) and publishes its
//! verdict, which every rank reads. A disagreement that would hang or corrupt results fails
//! `init` on every rank alike ([`Error::Inconsistent`]); a harmless one is logged by rank 0.

use crate::config::CommConfig;
use crate::error::{Error, Result};
use crate::records::agreement::{announcement_key, verdict_key, Announcement, Disagreement};
use std::time::{Duration, Instant};
use weftcc_settings::{
    Agreement, ALL, DETERMINISTIC, TEST_BUILD_ID, TEST_NET_PROVIDER, TEST_VERSION,
};
use weftcc_store::StoreClient;
use weftcc_transports::mesh::{count_out, name_the_missing, setup_get_all, Network};
use weftcc_transports::TransportError;

/// What this rank announces: with `config`'s deterministic mode (which a program may set
/// without the environment).
pub(crate) fn this_rank(rank: usize, config: &CommConfig) -> Result<Announcement> {
    let mut a = Announcement::default();
    let version = TEST_VERSION
        .value()
        .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string());
    a.set("library version", version, Agreement::Must);
    // Another build of the same version (a commit between releases, a local change) mostly
    // works with this one: a warning. `unknown` where it was built without git.
    let build = TEST_BUILD_ID
        .value()
        .unwrap_or_else(|| env!("WEFTCC_BUILD_ID").to_string());
    a.set("library build id", build, Agreement::Should);
    for setting in ALL.iter().filter(|s| s.agreement != Agreement::Own) {
        a.set(setting.name, setting.compared_value()?, setting.agreement);
    }
    let on_off = if config.deterministic { "on" } else { "off" };
    a.set(DETERMINISTIC.name, on_off, DETERMINISTIC.agreement);
    // What the network settings resolved to here (the mesh then uses the same). A rank that
    // listens on a loopback address cannot be reached from another host, one on IPv6 only
    // from an IPv4 host: ranks that differ would fail or hang connecting. A pair whose
    // providers differ connects over TCP instead (`weftcc_transports::net::select`): slower,
    // not broken.
    let network = Network::resolve(config.socket_ifname.as_deref(), &config.net)
        .map_err(|source| Error::Bootstrap { rank, source })?;
    let (interface, provider) = network.announced();
    a.set("network interface", interface, Agreement::Must);
    let provider = TEST_NET_PROVIDER.value().unwrap_or(provider);
    a.set("network provider", provider, Agreement::Should);
    let unknown = || "unknown".to_string();
    let cpu = weftcc_topology::discover::cpu_model().unwrap_or_else(unknown);
    a.set("CPU model", cpu, Agreement::Should);
    let (driver, gpus) = weftcc_topology::discover::nvidia_driver_and_gpus()
        .map_or(("none".to_string(), "none".to_string()), |(d, g)| {
            (d, g.join(", "))
        });
    a.set("GPU driver", driver, Agreement::Should);
    a.set("GPU models", gpus, Agreement::Should);
    Ok(a)
}

/// Announces `mine` and reads rank 0's verdict (rank 0 reads every rank's announcement and
/// writes it). Every rank returns the same: `Ok` with warnings logged by rank 0, or
/// [`Error::Inconsistent`] once every rank has read the verdict (so that rank 0 does not close
/// the store under a rank still reading). A rank that never announces is named, as the mesh
/// names one that never publishes its host ([`TransportError::NotJoined`]).
pub(crate) fn agree(
    store: &mut StoreClient,
    namespace: &str,
    (rank, n): (usize, usize),
    mine: &Announcement,
    timeout: Duration,
) -> Result<()> {
    let boot = |source: TransportError| Error::Bootstrap { rank, source };
    let until = Instant::now() + timeout;
    let left = || until.saturating_duration_since(Instant::now());
    let key = |r| announcement_key(namespace, r);
    // The set-up's waits: a rank's death ends them at once, naming it.
    let missing = |store: &mut StoreClient, e: TransportError| {
        boot(name_the_missing(store, namespace, &key, (rank, n), e))
    };
    store
        .set(&key(rank), &mine.encode())
        .map_err(|e| boot(e.into()))?;
    let verdict = verdict_key(namespace);
    let found: Vec<Disagreement> = if rank == 0 {
        let keys: Vec<String> = (0..n).map(key).collect();
        let raw = match setup_get_all(store, namespace, &keys, left()) {
            Ok(raw) => raw,
            Err(e) => return Err(missing(store, e)),
        };
        let all: Vec<Announcement> = raw
            .iter()
            .map(|bytes| Announcement::decode(bytes).unwrap_or_else(unreadable))
            .collect();
        let found = crate::records::agreement::compare(&all);
        let encoded = serde_json::to_vec(&found).unwrap_or_default();
        store.set(&verdict, &encoded).map_err(|e| boot(e.into()))?;
        for d in found.iter().filter(|d| d.agreement == Agreement::Should) {
            tracing::warn!(target: "weftcc::init", "ranks differ (harmless, but unusual): {d}");
        }
        found
    } else {
        let bytes = match setup_get_all(store, namespace, std::slice::from_ref(&verdict), left()) {
            Ok(mut values) => values.pop().unwrap_or_default(),
            Err(e) => return Err(missing(store, e)),
        };
        serde_json::from_slice(&bytes).map_err(|e| {
            boot(TransportError::Protocol(format!(
                "rank 0's consistency verdict does not decode: {e}"
            )))
        })?
    };
    let must: Vec<Disagreement> = found
        .into_iter()
        .filter(|d| d.agreement == Agreement::Must)
        .collect();
    if must.is_empty() {
        return Ok(());
    }
    count_out(store, namespace, "announce", n, rank == 0, left()).map_err(boot)?;
    Err(Error::Inconsistent {
        rank,
        disagreements: must,
    })
}

/// The announcement of a rank whose bytes do not decode: another library, which must differ.
fn unreadable() -> Announcement {
    let mut a = Announcement::default();
    a.set(
        "library version",
        "(unreadable announcement)",
        Agreement::Must,
    );
    a
}
