//! Connects every pair of ranks of a communicator, choosing the transport per pair.
//!
//! [`Mesh::establish`] runs these steps, all through the bootstrap store under the communicator's
//! key prefix (`namespace`), which is single-use: a new communicator needs a new namespace.
//! 1. Listen for TCP on the selected interface ([`crate::tcp::select_interface`] with
//!    `socket_ifname` and `WEFT_SOCKET_FAMILY`), publish `<namespace>/info/<rank>` (host id,
//!    pid, TCP address, shared-memory segment name, whether shared memory is enabled) and read
//!    every rank's in one request (`GET_ALL`: n requests to rank 0's store in all).
//! 2. A pair uses shared memory when both ranks report the same host id and both have shared
//!    memory enabled, TCP otherwise. Each choice is logged with `tracing::info!`.
//! 3. Shared memory: create this rank's segment with one ring per local peer, publish
//!    `<namespace>/shm/<rank>` (`ok` or the error), map each local peer's segment.
//! 4. TCP: accept from lower ranks while connecting to higher ranks.
//! 5. A store barrier (`<namespace>/mesh/ready`); then the segment names are unlinked (the
//!    mappings stay).
//! 6. Departure: every rank counts itself out (`<namespace>/mesh/left`) and rank 0 returns only
//!    once all have. The store usually lives in rank 0's process: a rank 0 that returned and
//!    dropped its communicator straight away used to shut the store down while another rank's
//!    last request was still on its way ("bootstrap store closed" during init).

use crate::conn::{Connection, IdleWaiter, Interest};
use crate::error::{Result, TransportError};
use crate::mem::{self, Doorbell, MemWaiter};
use crate::shm::{self, ShmSegment, ShmWaiter};
use crate::store::StoreClient;
use crate::tcp::{self, Family, TcpEndpoint, TcpWaiter};
use crate::util::Deadline;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Default bootstrap timeout of [`MeshConfig::from_env`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest slice the mesh waiter sleeps on the futex before looking at TCP sockets again when it
/// waits for both kinds of peers.
pub const MIXED_WAIT_SLICE: Duration = Duration::from_micros(200);

/// How to connect one rank into a communicator.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub nranks: usize,
    /// Ranks with equal host ids may use shared memory (see [`host_id`]).
    pub host_id: String,
    /// Use TCP even between ranks on the same host.
    pub shm_disable: bool,
    /// `WEFT_SOCKET_IFNAME`-style interface selection; `None` for the default policy.
    pub socket_ifname: Option<String>,
    /// Job token, checked in every TCP handshake (at most 64 bytes).
    pub token: String,
    /// Store key prefix of this communicator, so that several communicators (splits) can share
    /// one store; also hashed into segment names and TCP handshakes.
    pub namespace: String,
    /// Limit for the whole establishment.
    pub timeout: Duration,
    /// Shared-memory ring capacity in bytes (normalized by [`shm::ring_capacity`]).
    pub buffsize: usize,
    /// Largest write sent over shared memory as a low-latency message (see [`shm`]); 0 sends
    /// every write through the ring.
    pub shm_ll_max: usize,
}

/// What each rank publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PeerInfo {
    host_id: String,
    pid: u32,
    tcp_addr: String,
    segment: String,
    shm_enabled: bool,
}

const INFO_VERSION: u8 = 1;

impl PeerInfo {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![INFO_VERSION, u8::from(self.shm_enabled)];
        v.extend_from_slice(&self.pid.to_le_bytes());
        for s in [&self.host_id, &self.tcp_addr, &self.segment] {
            v.extend_from_slice(&(s.len() as u32).to_le_bytes());
            v.extend_from_slice(s.as_bytes());
        }
        v
    }

    fn decode(b: &[u8]) -> Option<PeerInfo> {
        if b.len() < 6 || b[0] != INFO_VERSION {
            return None;
        }
        let shm_enabled = b[1] != 0;
        let pid = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let mut rest = &b[6..];
        let mut fields = Vec::new();
        for _ in 0..3 {
            if rest.len() < 4 {
                return None;
            }
            let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            rest = &rest[4..];
            if rest.len() < n {
                return None;
            }
            fields.push(String::from_utf8(rest[..n].to_vec()).ok()?);
            rest = &rest[n..];
        }
        let segment = fields.pop()?;
        let tcp_addr = fields.pop()?;
        let host_id = fields.pop()?;
        Some(PeerInfo {
            host_id,
            pid,
            tcp_addr,
            segment,
            shm_enabled,
        })
    }
}

/// The [`IdleWaiter`] of a [`Mesh`]: the futex doorbell for shared-memory peers, `poll()` for TCP
/// peers, alternating short waits of at most [`MIXED_WAIT_SLICE`] when the interest list holds
/// both; the in-process doorbell for in-memory meshes.
pub struct MeshWaiter {
    shm: Option<ShmWaiter>,
    tcp: TcpWaiter,
    mem: Option<MemWaiter>,
    shm_peers: Vec<bool>,
}

impl MeshWaiter {
    fn wants(&self, interest: &[Interest]) -> (bool, bool) {
        if interest.is_empty() {
            return (self.shm.is_some(), !self.tcp.is_empty());
        }
        let shm = interest
            .iter()
            .any(|i| self.shm_peers.get(i.peer).copied().unwrap_or(false));
        let tcp = interest.iter().any(|i| self.tcp.has_peer(i.peer));
        (shm, tcp)
    }
}

impl IdleWaiter for MeshWaiter {
    fn wait(&mut self, interest: &[Interest], max: Duration) -> Result<()> {
        if let Some(m) = &mut self.mem {
            return m.wait(interest, max);
        }
        let (want_shm, want_tcp) = self.wants(interest);
        match (&mut self.shm, want_shm, want_tcp) {
            (Some(s), true, false) => {
                s.wait_doorbell(max);
                Ok(())
            }
            (Some(s), true, true) => {
                let deadline = Deadline::after(max);
                loop {
                    if self.tcp.poll_for(interest, Duration::ZERO)? {
                        return Ok(());
                    }
                    let left = deadline.remaining();
                    if left.is_zero() {
                        return Ok(());
                    }
                    if s.wait_doorbell(left.min(MIXED_WAIT_SLICE)) {
                        return Ok(());
                    }
                }
            }
            (_, _, true) => self.tcp.poll_for(interest, max).map(|_| ()),
            (shm, _, false) => {
                // Nothing known to wait on: sleep on whatever exists, bounded by `max`.
                match shm {
                    Some(s) => {
                        s.wait_doorbell(max);
                    }
                    None => std::thread::sleep(max.min(Duration::from_millis(10))),
                }
                Ok(())
            }
        }
    }
}

/// Connections from one rank to every other rank of a communicator, plus its waiter.
pub struct Mesh {
    rank: usize,
    nranks: usize,
    conns: Vec<Option<Box<dyn Connection>>>,
    kinds: Vec<Option<&'static str>>,
    waiter: MeshWaiter,
    /// Host id of every rank, as each published it.
    host_ids: Vec<String>,
}

impl Mesh {
    /// Connects this rank to all others (see the module docs for the steps).
    pub fn establish(store: &mut StoreClient, cfg: &MeshConfig) -> Result<Mesh> {
        if cfg.nranks == 0 || cfg.rank >= cfg.nranks || cfg.nranks > u32::MAX as usize {
            return Err(TransportError::Config(format!(
                "rank {} out of range for {} ranks",
                cfg.rank, cfg.nranks
            )));
        }
        let deadline = Deadline::after(cfg.timeout);
        let (rank, n, ns) = (cfg.rank, cfg.nranks, cfg.namespace.as_str());

        // 1. Listen, publish, learn.
        let family = Family::from_env()?;
        let ip = tcp::select_interface(cfg.socket_ifname.as_deref(), family)?;
        let endpoint = TcpEndpoint::bind(ip, rank, &cfg.token, ns)?;
        let me = PeerInfo {
            host_id: cfg.host_id.clone(),
            pid: std::process::id(),
            tcp_addr: endpoint.local_addr().to_string(),
            segment: shm::segment_name(&cfg.token, ns, rank),
            shm_enabled: !cfg.shm_disable,
        };
        store.set(&format!("{ns}/info/{rank}"), &me.encode())?;
        // Every rank's record in one request (n requests to rank 0 in all, not n²).
        let keys: Vec<String> = (0..n).map(|r| format!("{ns}/info/{r}")).collect();
        let mut infos = Vec::with_capacity(n);
        for (r, raw) in store
            .get_all(&keys, deadline.remaining())?
            .iter()
            .enumerate()
        {
            let info = PeerInfo::decode(raw).ok_or_else(|| {
                TransportError::Protocol(format!("malformed mesh info of rank {r}"))
            })?;
            infos.push(info);
        }

        store.add(&format!("{ns}/info-read"), 1)?;

        // 2. Choose.
        let use_shm = |p: usize| {
            let o = &infos[p];
            me.shm_enabled && o.shm_enabled && o.host_id == me.host_id
        };
        let local: Vec<usize> = (0..n).filter(|&p| p != rank && use_shm(p)).collect();
        let remote: Vec<usize> = (0..n).filter(|&p| p != rank && !use_shm(p)).collect();

        // A socket per remote peer and a pidfd per local one stay open for the mesh's lifetime.
        crate::process::ensure_open_files((local.len() + remote.len()) as u64)?;

        let mut conns: Vec<Option<Box<dyn Connection>>> = (0..n).map(|_| None).collect();
        let mut kinds: Vec<Option<&'static str>> = vec![None; n];
        let mut shm_peers = vec![false; n];
        let mut shm_waiter = None;
        let mut tcp_waiter = TcpWaiter::new();

        // 3. Shared memory.
        let segment = if local.is_empty() {
            None
        } else {
            let (shm_size, memory) = shm::host_shm_limits();
            let per_ring = shm::ring_bytes(cfg.buffsize);
            if let Err(e) = shm::check_host_shm(local.len() + 1, per_ring, shm_size, memory) {
                // Every rank of the host fails alike. Rank 0 serves the store: it leaves only
                // once every rank has its peer records, so that none of them reports the
                // store closing instead of this reason.
                if rank == 0 {
                    while store.add(&format!("{ns}/info-read"), 0)? < n as i64
                        && !deadline.expired()
                    {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                }
                return Err(e);
            }
            let seg = match ShmSegment::create_named(&me.segment, rank, &local, cfg.buffsize) {
                Ok(s) => {
                    store.set(&format!("{ns}/shm/{rank}"), b"ok")?;
                    s
                }
                Err(e) => {
                    let _ = store.set(&format!("{ns}/shm/{rank}"), format!("err:{e}").as_bytes());
                    return Err(e);
                }
            };
            for &p in &local {
                let status = store.get(&format!("{ns}/shm/{p}"), deadline.remaining())?;
                if status != b"ok" {
                    let msg =
                        String::from_utf8_lossy(status.strip_prefix(b"err:").unwrap_or(&status))
                            .into_owned();
                    return Err(TransportError::SharedMemory(format!(
                        "rank {p} on this host could not set up shared memory: {msg}"
                    )));
                }
                let mut c = seg.connect(p, &infos[p].segment)?;
                c.set_low_latency_max(cfg.shm_ll_max);
                tracing::info!(target: "weftcc::init", rank, peer = p, transport = "shm", "mesh connection");
                conns[p] = Some(Box::new(c));
                kinds[p] = Some("shm");
                shm_peers[p] = true;
            }
            shm_waiter = Some(seg.waiter());
            Some(seg)
        };

        // 4. TCP: accept from lower ranks while connecting to higher ones.
        let lower: Vec<usize> = remote.iter().copied().filter(|&p| p < rank).collect();
        let higher: Vec<usize> = remote.iter().copied().filter(|&p| p > rank).collect();
        let mut addrs: Vec<Option<SocketAddr>> = vec![None; n];
        for &p in &higher {
            let a: SocketAddr = infos[p].tcp_addr.parse().map_err(|_| {
                TransportError::Protocol(format!(
                    "rank {p} published a bad TCP address {:?}",
                    infos[p].tcp_addr
                ))
            })?;
            addrs[p] = Some(a);
        }
        let cancel = AtomicBool::new(false);
        let (accepted, connected) = std::thread::scope(|s| {
            let acceptor = if lower.is_empty() {
                None
            } else {
                let ep = &endpoint;
                let lower = &lower;
                let left = deadline.remaining();
                let cancel = &cancel;
                Some(s.spawn(move || ep.accept_peers_until(lower, left, Some(cancel))))
            };
            let mut connected = Vec::new();
            let mut err = None;
            for &p in &higher {
                let Some(a) = addrs[p] else { continue };
                match endpoint.connect_peer(p, a, deadline.remaining()) {
                    Ok(c) => connected.push(c),
                    Err(e) => {
                        // No point waiting for the lower ranks any longer.
                        cancel.store(true, Ordering::Release);
                        err = Some(e);
                        break;
                    }
                }
            }
            let accepted = match acceptor {
                None => Ok(Vec::new()),
                Some(h) => h.join().unwrap_or_else(|_| {
                    Err(TransportError::Io {
                        what: "TCP accept thread".into(),
                        message: "panicked".into(),
                    })
                }),
            };
            (
                accepted,
                match err {
                    Some(e) => Err(e),
                    None => Ok(connected),
                },
            )
        });
        // A connect error is the root cause; the acceptor then only reports being aborted.
        let connected = connected?;
        for c in connected.into_iter().chain(accepted?) {
            let p = c.peer();
            tracing::info!(target: "weftcc::init", rank, peer = p, transport = "tcp", "mesh connection");
            tcp_waiter.add(c.poll_handle());
            kinds[p] = Some("tcp");
            conns[p] = Some(Box::new(c));
        }

        // 5. Everyone has mapped every segment: barrier, then unlink.
        store.barrier(&format!("{ns}/mesh/ready"), n, deadline.remaining())?;
        drop(segment);

        // 6. No store request of this communicator's set-up may be in flight when rank 0
        // returns: the last to count itself out says so, and rank 0 waits for that.
        let all_left = format!("{ns}/mesh/all-left");
        if store.add(&format!("{ns}/mesh/left"), 1)? >= n as i64 {
            store.set(&all_left, b"1")?;
        }
        if rank == 0 {
            store.wait(&[&all_left], deadline.remaining())?;
        }

        Ok(Mesh {
            host_ids: infos.iter().map(|i| i.host_id.clone()).collect(),
            rank,
            nranks: n,
            conns,
            kinds,
            waiter: MeshWaiter {
                shm: shm_waiter,
                tcp: tcp_waiter,
                mem: None,
                shm_peers,
            },
        })
    }

    /// `nranks` meshes connected in memory, one per rank (hand each to its own thread); every
    /// direction buffers `capacity` bytes.
    pub fn in_memory(nranks: usize, capacity: usize) -> Vec<Mesh> {
        let bells: Vec<Doorbell> = (0..nranks).map(|_| Doorbell::new()).collect();
        let mut conns: Vec<Vec<Option<Box<dyn Connection>>>> = (0..nranks)
            .map(|_| (0..nranks).map(|_| None).collect())
            .collect();
        for a in 0..nranks {
            for b in a + 1..nranks {
                let (ca, cb) = mem::pair_with(a, &bells[a], b, &bells[b], capacity);
                conns[a][b] = Some(Box::new(ca));
                conns[b][a] = Some(Box::new(cb));
            }
        }
        conns
            .into_iter()
            .enumerate()
            .map(|(r, c)| Mesh {
                host_ids: vec!["mem".to_string(); nranks],
                rank: r,
                nranks,
                kinds: (0..nranks)
                    .map(|p| if p == r { None } else { Some("mem") })
                    .collect(),
                conns: c,
                waiter: MeshWaiter {
                    shm: None,
                    tcp: TcpWaiter::new(),
                    mem: Some(bells[r].waiter()),
                    shm_peers: vec![false; nranks],
                },
            })
            .collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The transport used to reach `peer` (`"shm"`, `"tcp"`, `"mem"`); `None` for this rank or
    /// an out-of-range peer.
    pub fn transport_name(&self, peer: usize) -> Option<&'static str> {
        self.kinds.get(peer).copied().flatten()
    }

    /// The host id every rank published (see [`host_id`]), indexed by rank: ranks with equal
    /// ids are on one host.
    pub fn host_ids(&self) -> &[String] {
        &self.host_ids
    }

    /// The connection to `peer`, if any.
    pub fn connection(&mut self, peer: usize) -> Option<&mut (dyn Connection + 'static)> {
        self.conns.get_mut(peer).and_then(|c| c.as_deref_mut())
    }

    /// Leaves `note` on every connection (see [`Connection::leave_farewell`]).
    pub fn leave_farewell(&mut self, note: &str) {
        for conn in self.conns.iter_mut().flatten() {
            conn.leave_farewell(note);
        }
    }

    /// The note `peer` left before closing its connection to this rank, if any.
    pub fn farewell(&self, peer: usize) -> Option<String> {
        self.conns.get(peer)?.as_ref()?.farewell()
    }

    /// Connections indexed by peer (`None` for this rank) and the waiter, borrowed together so
    /// the engine can poll and wait.
    pub fn parts(&mut self) -> (&mut [Option<Box<dyn Connection>>], &mut dyn IdleWaiter) {
        (&mut self.conns, &mut self.waiter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_roundtrip() {
        let i = PeerInfo {
            host_id: "h:1".into(),
            pid: 42,
            tcp_addr: "[::1]:5".into(),
            segment: "/weft-x".into(),
            shm_enabled: true,
        };
        assert_eq!(PeerInfo::decode(&i.encode()), Some(i.clone()));
        let e = i.encode();
        for cut in 0..e.len() {
            assert!(PeerInfo::decode(&e[..cut]).is_none());
        }
    }
}
