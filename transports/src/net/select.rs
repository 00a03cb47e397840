//! Which network a rank uses across hosts, from the environment, and the process-wide cache of
//! opened providers.
//!
//! * `WEFT_NET=ib|ofi|socket` forces one (NCCL's `NCCL_NET`); unset, a rank uses an RDMA device
//!   where one is usable (verbs first, then libfabric with RDMA hardware) and TCP otherwise.
//! * `WEFT_IB_HCA`, `WEFT_IB_GID_INDEX`, `WEFT_IB_TIMEOUT`, `WEFT_IB_RETRY_CNT`: the verbs
//!   provider's device, GID and retry policy ([`VerbsConfig`]). A forced network that cannot be opened is an error,
//!   not a silent fall-back.
//! * `WEFT_NET=loopback`: an in-memory fabric between the ranks of one process (tests).
//! * `WEFT_IB_DISABLE=1` rules InfiniBand out of the automatic choice (NCCL's `NCCL_IB_DISABLE`).
//! * `WEFT_OFI_PROVIDER=name` picks libfabric's provider (`verbs`, `efa`, `cxi`, `tcp`); without
//!   it the automatic choice takes the first provider with RDMA hardware behind it, and
//!   `WEFT_NET=ofi` the first provider of any kind (here: `tcp;ofi_rxm`).
//! * `WEFT_NET_BUFFSIZE` sets the receive ring of each network connection (a power of two,
//!   default [`DEFAULT_RING`]).
//! * `WEFT_IB_QPS_PER_CONNECTION` (NCCL's name; any provider): endpoints (queue pairs) per
//!   connection, data writes striped over them (1 to 16, default 1).
//! * `WEFT_NET_RNDV_THRESHOLD`: the smallest pinned receive whose destination is offered to
//!   the sender for direct writes (0, the default [`DEFAULT_RENDEZVOUS`]: never).
//!
//! Both ends of a pair must have opened providers with the same [`Provider::id`] for the pair to
//! use it; otherwise (one host without the device) the pair uses TCP.

use super::verbs::{VerbsConfig, VerbsProvider};
use super::{ofi, NetError, Provider};
use crate::error::{Result, TransportError};
use crate::util::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use weftcc_settings as settings;

/// Default receive ring of a network connection.
pub const DEFAULT_RING: usize = 2 << 20;
/// Default smallest pinned receive offered to the sender as a rendezvous destination: none.
/// Over libfabric's tcp provider the ring measured as fast or faster (docs/perf/net-rndv.txt:
/// the bounce buffer keeps less in flight than the ring, and each promise waits for a delivery
/// round trip); on RDMA hardware it is unmeasured.
pub const DEFAULT_RENDEZVOUS: usize = 0;

/// The network asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum NetKind {
    /// RDMA where usable (InfiniBand verbs, then libfabric with RDMA hardware), else TCP.
    #[default]
    Auto,
    /// InfiniBand / RoCE verbs.
    Ib,
    /// libfabric.
    Ofi,
    /// TCP sockets only.
    Socket,
    /// An in-memory fabric shared by the ranks of this process ([`super::loopback`]): ranks
    /// run as threads of one test reach each other through the network path with no device.
    /// Ranks of other processes see a different provider id and use TCP.
    Loopback,
}

/// The network configuration of a rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetChoice {
    /// `WEFT_NET`.
    pub kind: NetKind,
    /// `WEFT_IB_DISABLE`.
    pub ib_disable: bool,
    /// `WEFT_OFI_PROVIDER`.
    pub ofi_provider: Option<String>,
    /// Receive ring bytes of each network connection (`WEFT_NET_BUFFSIZE`).
    pub ring: usize,
    /// The verbs provider's configuration (`WEFT_IB_*`).
    pub verbs: VerbsConfig,
    /// Endpoints per connection (`WEFT_IB_QPS_PER_CONNECTION`).
    pub streams: usize,
    /// Smallest pinned receive offered as a rendezvous destination; 0 turns rendezvous off
    /// (`WEFT_NET_RNDV_THRESHOLD`).
    pub rendezvous: usize,
}

impl Default for NetChoice {
    fn default() -> Self {
        NetChoice {
            kind: NetKind::Auto,
            ib_disable: false,
            ofi_provider: None,
            ring: DEFAULT_RING,
            verbs: VerbsConfig::default(),
            streams: 1,
            rendezvous: DEFAULT_RENDEZVOUS,
        }
    }
}

impl NetChoice {
    /// TCP only.
    pub fn socket() -> NetChoice {
        NetChoice {
            kind: NetKind::Socket,
            ..NetChoice::default()
        }
    }

    /// From `WEFT_NET`, `WEFT_IB_DISABLE`, `WEFT_OFI_PROVIDER` and `WEFT_NET_BUFFSIZE`.
    pub fn from_env() -> Result<NetChoice> {
        let streams = settings::IB_QPS_PER_CONNECTION.number()?;
        let rendezvous = settings::NET_RNDV_THRESHOLD
            .size()?
            .unwrap_or(DEFAULT_RENDEZVOUS);
        Ok(NetChoice {
            verbs: VerbsConfig::from_env()?,
            streams: streams.map_or(1, |n| n as usize),
            rendezvous,
            ..NetChoice::parse(
                settings::NET.value().as_deref(),
                settings::IB_DISABLE.value().as_deref(),
                settings::OFI_PROVIDER.value().as_deref(),
                settings::NET_BUFFSIZE.value().as_deref(),
            )?
        })
    }

    /// From the variables' values (`None` where unset).
    pub fn parse(
        net: Option<&str>,
        ib_disable: Option<&str>,
        ofi_provider: Option<&str>,
        buffsize: Option<&str>,
    ) -> Result<NetChoice> {
        let kind = match net.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
            None | Some("auto") => NetKind::Auto,
            Some("ib") | Some("verbs") | Some("rdma") => NetKind::Ib,
            Some("ofi") | Some("libfabric") => NetKind::Ofi,
            Some("socket") | Some("tcp") => NetKind::Socket,
            Some("loopback") => NetKind::Loopback,
            Some(other) => {
                return Err(TransportError::Config(format!(
                    "WEFT_NET={other:?}: expected ib, ofi, socket, loopback or auto"
                )))
            }
        };
        let ib_disable = settings::IB_DISABLE.flag_in(ib_disable, false)?;
        let ring = match settings::NET_BUFFSIZE.size_in(buffsize)? {
            None => DEFAULT_RING,
            Some(n) if n <= 1 << 30 => n.next_power_of_two(),
            Some(_) => {
                let text = buffsize.unwrap_or_default();
                return Err(settings::NET_BUFFSIZE.invalid(text, "4K to 1G").into());
            }
        };
        Ok(NetChoice {
            kind,
            ib_disable,
            ofi_provider: ofi_provider.map(|s| s.trim().to_string()),
            ring,
            verbs: VerbsConfig::default(),
            streams: 1,
            rendezvous: DEFAULT_RENDEZVOUS,
        })
    }

    /// The shape of each connection over the network this choice opens.
    pub fn link(&self) -> super::stream::NetLink {
        super::stream::NetLink {
            ring: self.ring,
            streams: self.streams,
            rendezvous: self.rendezvous,
        }
    }
}

type Cache = Mutex<HashMap<NetChoice, Option<Arc<dyn Provider>>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The provider `choice` selects on this machine, opened once per process; `None` for TCP.
/// A forced network (`WEFT_NET=ib|ofi`) that cannot be opened is an error naming why.
pub fn open(choice: &NetChoice) -> Result<Option<Arc<dyn Provider>>> {
    let mut cache = lock(cache());
    if let Some(p) = cache.get(choice) {
        return Ok(p.clone());
    }
    let forced = |e: NetError| TransportError::Net {
        peer: None,
        source: e,
    };
    let opened: Option<Arc<dyn Provider>> = match choice.kind {
        NetKind::Socket => None,
        NetKind::Loopback => Some(Arc::new(super::loopback::LoopbackProvider(
            super::loopback::Loopback::new(),
        ))),
        NetKind::Ib => Some(Arc::new(
            VerbsProvider::open(&choice.verbs).map_err(forced)?,
        )),
        NetKind::Ofi => {
            let p =
                ofi::OfiProvider::open(choice.ofi_provider.as_deref(), false).map_err(forced)?;
            Some(Arc::new(p))
        }
        NetKind::Auto => {
            let verbs = if choice.ib_disable {
                None
            } else {
                match VerbsProvider::open(&choice.verbs) {
                    Ok(p) => Some(Arc::new(p) as Arc<dyn Provider>),
                    Err(e) => {
                        tracing::debug!(target: "weftcc::net", "NET/IB: {e}");
                        None
                    }
                }
            };
            verbs.or_else(
                || match ofi::OfiProvider::open(choice.ofi_provider.as_deref(), true) {
                    Ok(p) => Some(Arc::new(p) as Arc<dyn Provider>),
                    Err(e) => {
                        tracing::debug!(target: "weftcc::net", "NET/OFI: {e}; using TCP sockets");
                        None
                    }
                },
            )
        }
    };
    cache.insert(choice.clone(), opened.clone());
    Ok(opened)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_range_is_the_stream_limit() {
        let settings::Kind::Number { min: 1, max } = settings::IB_QPS_PER_CONNECTION.kind else {
            panic!("{:?}", settings::IB_QPS_PER_CONNECTION.kind);
        };
        assert_eq!(max, super::super::stream::MAX_STREAMS as u64);
    }

    #[test]
    fn parses_the_variables() {
        let c = NetChoice::parse(Some("OFI"), Some("1"), Some("tcp"), Some("1M")).unwrap();
        assert_eq!(c.kind, NetKind::Ofi);
        assert!(c.ib_disable);
        assert_eq!(c.ofi_provider.as_deref(), Some("tcp"));
        assert_eq!(c.ring, 1 << 20);
        let d = NetChoice::parse(None, None, None, Some("3000000")).unwrap();
        assert_eq!((d.kind, d.ring), (NetKind::Auto, 4 << 20));
        assert_eq!(
            NetChoice::parse(Some("socket"), None, None, None)
                .unwrap()
                .kind,
            NetKind::Socket
        );
        for bad in [
            NetChoice::parse(Some("infiniband"), None, None, None),
            NetChoice::parse(None, Some("maybe"), None, None),
            NetChoice::parse(None, None, None, Some("1k")),
            NetChoice::parse(None, None, None, Some("lots")),
        ] {
            assert!(
                matches!(
                    bad,
                    Err(TransportError::Config(_) | TransportError::Setting(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn socket_opens_nothing_and_a_forced_network_without_a_device_is_a_clear_error() {
        assert!(open(&NetChoice::socket()).unwrap().is_none());
        let ib = NetChoice {
            kind: NetKind::Ib,
            ..NetChoice::default()
        };
        match open(&ib) {
            Err(TransportError::Net {
                source:
                    NetError::Unavailable {
                        provider: "IB",
                        detail,
                    },
                ..
            }) => eprintln!("WEFT_NET=ib here: {detail}"),
            Err(other) => panic!("expected an unavailable IB provider: {other}"),
            Ok(_) => eprintln!("an RDMA device is present: WEFT_NET=ib opened it"),
        }
    }
}
