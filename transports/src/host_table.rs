//! The host table of a communicator's set-up: every rank's [`PeerHost`] (host id, network
//! namespace, shared memory allowed, network provider), which every rank needs.
//!
//! Gathered at rank 0 through the store and spread down a binary tree of direct TCP connections
//! among the ranks, as NCCL's bootstrap spreads its tables among the ranks rather than through
//! its root: the store serves each rank's entry once to rank 0 and each rank its parent's
//! address, `O(n)` requests and bytes, where every rank reading the table from the store would
//! make it serve `O(n²)` bytes.
//! 1. Every rank listens on a port of its own for the tree and publishes its entry
//!    (`<ns>/host/<rank>`) and that address (`<ns>/tree/<rank>`).
//! 2. Rank 0 reads all entries in one request and encodes the table (distinct entries once,
//!    then each rank's index: `4n` bytes plus the distinct hosts).
//! 3. Every other rank reads its parent's address (`(rank - 1) / 2`), connects, presents the job
//!    token, namespace and its rank, and receives the table; then every rank sends it to the
//!    children that connect (`2 rank + 1`, `2 rank + 2`). Depth `⌈log2 n⌉`.
//!
//! A rank that dies before it has joined ends every wait here through the store
//! ([`setup_lost_key`]).

use crate::dial::PeerHost;
use crate::error::{Result, TransportError};
use crate::mesh::{name_the_missing, setup_error, setup_get_all, setup_lost_key};
use crate::util::Deadline;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use weftcc_store::StoreClient;

/// Magic of a child's hello on the tree.
const TREE_MAGIC: [u8; 4] = *b"WFHT";
/// How often a rank waiting on the tree asks the store whether a rank died in set-up.
const DEATH_CHECK: Duration = Duration::from_millis(500);
/// Longest a tree connection's hello may take to arrive.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Store key of rank `rank`'s host entry.
pub fn entry_key(ns: &str, rank: usize) -> String {
    format!("{ns}/host/{rank}")
}

/// Store key of rank `rank`'s tree listener.
pub fn tree_key(ns: &str, rank: usize) -> String {
    format!("{ns}/tree/{rank}")
}

/// The parent of `rank` (> 0) in the tree.
pub fn parent(rank: usize) -> usize {
    (rank - 1) / 2
}

/// The children of `rank` among `n` ranks.
pub fn children(rank: usize, n: usize) -> impl Iterator<Item = usize> {
    [2 * rank + 1, 2 * rank + 2]
        .into_iter()
        .filter(move |&c| c < n)
}

/// Step 1's store part: publishes this rank's entry and tree address.
pub fn publish(
    store: &mut StoreClient,
    ns: &str,
    rank: usize,
    me: &PeerHost,
    tree: SocketAddr,
) -> Result<()> {
    store.set(&entry_key(ns, rank), encode_host(me).as_bytes())?;
    store.set(&tree_key(ns, rank), tree.to_string().as_bytes())?;
    Ok(())
}

/// Step 2: rank 0 reads every entry and encodes the table.
pub fn root_table(
    store: &mut StoreClient,
    ns: &str,
    n: usize,
    deadline: &Deadline,
) -> Result<Vec<u8>> {
    let keys: Vec<String> = (0..n).map(|r| entry_key(ns, r)).collect();
    Ok(encode_block(&setup_get_all(
        store,
        ns,
        &keys,
        deadline.remaining(),
    )?))
}

/// Step 3's store part: the tree address of `rank`'s parent.
pub fn parent_address(
    store: &mut StoreClient,
    ns: &str,
    rank: usize,
    deadline: &Deadline,
) -> Result<SocketAddr> {
    let p = parent(rank);
    let raw = setup_get_all(store, ns, &[tree_key(ns, p)], deadline.remaining())?;
    let text = String::from_utf8_lossy(raw.first().map_or(&[][..], Vec::as_slice)).into_owned();
    text.parse().map_err(|_| {
        TransportError::Protocol(format!("rank {p} published a bad tree address {text:?}"))
    })
}

/// The host table: every rank's entry, indexed by rank (see the module docs). `ip` is the
/// interface this rank listens on.
pub fn gather(
    store: &mut StoreClient,
    ns: &str,
    token: &str,
    (rank, n): (usize, usize),
    me: &PeerHost,
    ip: IpAddr,
    deadline: &Deadline,
) -> Result<Vec<PeerHost>> {
    let (listener, addr) =
        weftcc_base::socket::listen(SocketAddr::new(ip, 0), None, "host-table tree")?;
    publish(store, ns, rank, me, addr)?;
    let table = if rank == 0 {
        root_table(store, ns, n, deadline).map_err(|e| {
            let entry = |r| entry_key(ns, r);
            name_the_missing(store, ns, &entry, (rank, n), e)
        })
    } else {
        parent_address(store, ns, rank, deadline)
            .and_then(|from| receive(store, ns, token, rank, from, n, deadline))
    };
    let table = match table {
        Ok(table) => table,
        Err(e) => {
            // The children wait on this rank: they get the same cause, typed, when it is one
            // every rank would find (a rank missing or dead), else a closed connection.
            if let Some(message) = encode_failure(&e) {
                let linger = Deadline::after(FAILURE_LINGER.min(deadline.remaining()));
                let _ = serve_children(store, ns, token, (rank, n), &listener, &message, &linger);
            }
            return Err(e);
        }
    };
    let hosts = decode_table(&table, n)?;
    let mut message = (table.len() as u32).to_le_bytes().to_vec();
    message.extend_from_slice(&table);
    serve_children(store, ns, token, (rank, n), &listener, &message, deadline)?;
    Ok(hosts)
}

/// The length word that says a failure follows instead of a table.
const FAILURE: u32 = u32::MAX;
/// Longest a rank whose set-up failed waits for its children to fetch the cause.
const FAILURE_LINGER: Duration = Duration::from_secs(2);

/// The tree message telling the children of a failure every rank meets alike, if `e` is one.
fn encode_failure(e: &TransportError) -> Option<Vec<u8>> {
    let mut v = FAILURE.to_le_bytes().to_vec();
    match e {
        TransportError::NotJoined {
            missing,
            more,
            nranks,
            after,
        } => {
            v.push(1);
            v.extend_from_slice(&(missing.len() as u32).to_le_bytes());
            for &r in missing {
                v.extend_from_slice(&(r as u32).to_le_bytes());
            }
            v.extend_from_slice(&(*more as u32).to_le_bytes());
            v.extend_from_slice(&(*nranks as u32).to_le_bytes());
            v.extend_from_slice(&(after.as_millis() as u64).to_le_bytes());
        }
        TransportError::DiedInSetup { peer } => {
            v.push(2);
            v.extend_from_slice(&(*peer as u32).to_le_bytes());
        }
        _ => return None,
    }
    Some(v)
}

/// The failure a parent sent after [`FAILURE`] (its body, length word excluded).
fn decode_failure(mut b: &[u8]) -> Option<TransportError> {
    let u32_ = |b: &mut &[u8]| -> Option<u32> {
        let (h, t) = b.split_first_chunk::<4>()?;
        *b = t;
        Some(u32::from_le_bytes(*h))
    };
    let (&kind, rest) = b.split_first()?;
    b = rest;
    let e = match kind {
        1 => {
            let count = u32_(&mut b)? as usize;
            if count > crate::mesh::MAX_NAMED_MISSING {
                return None;
            }
            let mut missing = Vec::with_capacity(count);
            for _ in 0..count {
                missing.push(u32_(&mut b)? as usize);
            }
            let more = u32_(&mut b)? as usize;
            let nranks = u32_(&mut b)? as usize;
            let (ms, rest) = b.split_first_chunk::<8>()?;
            b = rest;
            TransportError::NotJoined {
                missing,
                more,
                nranks,
                after: Duration::from_millis(u64::from_le_bytes(*ms)),
            }
        }
        2 => TransportError::DiedInSetup {
            peer: u32_(&mut b)? as usize,
        },
        _ => return None,
    };
    b.is_empty().then_some(e)
}

/// The table's entries, checked to be `n`.
fn decode_table(table: &[u8], n: usize) -> Result<Vec<PeerHost>> {
    let bad = || TransportError::Protocol("malformed host table".into());
    let hosts = decode_block(table)
        .ok_or_else(bad)?
        .iter()
        .map(|text| decode_host(text).ok_or_else(bad))
        .collect::<Result<Vec<PeerHost>>>()?;
    if hosts.len() != n {
        return Err(TransportError::Protocol(format!(
            "host table has {} entries for {n} ranks",
            hosts.len()
        )));
    }
    Ok(hosts)
}

/// Largest table `n` ranks can have: a host entry is a few dozen bytes.
fn table_limit(n: usize) -> usize {
    n.saturating_mul(4 + 1024).saturating_add(64)
}

/// Whether the store has a rank's death in set-up, as the error to return.
fn death(store: &mut StoreClient, ns: &str, wait: Duration) -> Option<TransportError> {
    match store.get(&setup_lost_key(ns), wait) {
        Ok(value) => Some(setup_error(weftcc_store::StoreError::Interrupted {
            key: setup_lost_key(ns),
            value,
        })),
        Err(_) => None,
    }
}

/// Receives the table from the parent at `from`.
fn receive(
    store: &mut StoreClient,
    ns: &str,
    token: &str,
    rank: usize,
    from: SocketAddr,
    n: usize,
    deadline: &Deadline,
) -> Result<Vec<u8>> {
    let p = parent(rank);
    let broken = |store: &mut StoreClient, what: String| {
        // A parent that died shows in the store within moments.
        death(store, ns, Duration::from_secs(1)).unwrap_or(TransportError::Protocol(format!(
            "host-table tree: rank {p} at {from}: {what}"
        )))
    };
    let sock = match connect(from, deadline) {
        Ok(s) => s,
        Err(e) => return Err(broken(store, format!("connecting: {e}"))),
    };
    let mut hello = TREE_MAGIC.to_vec();
    for field in [token.as_bytes(), ns.as_bytes()] {
        hello.extend_from_slice(&(field.len() as u16).to_le_bytes());
        hello.extend_from_slice(field);
    }
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    if let Err(e) = (&sock).write_all(&hello) {
        return Err(broken(store, format!("sending the hello: {e}")));
    }
    let mut len = [0u8; 4];
    read_waiting(store, ns, &sock, &mut len, deadline, p)?;
    if u32::from_le_bytes(len) == FAILURE {
        // The cause is short: what arrives within a moment is all of it.
        let mut body = vec![0u8; 1 + 4 * (3 + crate::mesh::MAX_NAMED_MISSING) + 8];
        let got = read_some(&sock, &mut body);
        return Err(decode_failure(&body[..got]).unwrap_or_else(|| {
            TransportError::Protocol(format!(
                "host-table tree: rank {p} sent a malformed failure"
            ))
        }));
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > table_limit(n) {
        return Err(TransportError::Protocol(format!(
            "host-table tree: rank {p} sent a table of {len} bytes for {n} ranks"
        )));
    }
    let mut table = vec![0u8; len];
    read_waiting(store, ns, &sock, &mut table, deadline, p)?;
    Ok(table)
}

/// Reads `buf` in full from the parent `p`, looking at the store for a death in set-up while
/// it waits.
fn read_waiting(
    store: &mut StoreClient,
    ns: &str,
    sock: &Socket,
    buf: &mut [u8],
    deadline: &Deadline,
    p: usize,
) -> Result<()> {
    let mut got = 0;
    let mut next_check = Deadline::after(DEATH_CHECK);
    while got < buf.len() {
        match (&*sock).read(&mut buf[got..]) {
            Ok(0) => {
                return Err(death(store, ns, Duration::from_secs(1)).unwrap_or_else(|| {
                    TransportError::Protocol(format!(
                        "host-table tree: rank {p} closed the connection before sending the table"
                    ))
                }))
            }
            Ok(k) => got += k,
            Err(e) if passing(&e) => {}
            Err(e) => {
                return Err(death(store, ns, Duration::from_secs(1)).unwrap_or_else(|| {
                    TransportError::io(format!("host-table tree: reading from rank {p}"), e)
                }))
            }
        }
        if deadline.expired() {
            return Err(deadline.timeout_error(format!("waiting for the host table from rank {p}")));
        }
        if next_check.expired() {
            if let Some(e) = death(store, ns, Duration::ZERO) {
                return Err(e);
            }
            next_check = Deadline::after(DEATH_CHECK);
        }
    }
    Ok(())
}

/// Whether a read failed only for now: its timeout ran out, or a signal came.
fn passing(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
    )
}

/// Reads what `sock` sends until it closes or `buf` is full (at most a second); the count.
fn read_some(sock: &Socket, buf: &mut [u8]) -> usize {
    let until = Deadline::after(Duration::from_secs(1));
    let mut got = 0;
    while got < buf.len() && !until.expired() {
        match (&*sock).read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if passing(&e) => {}
            Err(_) => break,
        }
    }
    got
}

/// A connection to `to`, blocking with short read and write timeouts.
fn connect(to: SocketAddr, deadline: &Deadline) -> std::io::Result<Socket> {
    let sock = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))?;
    let slice = deadline.remaining().max(Duration::from_millis(1));
    sock.connect_timeout(&SockAddr::from(to), slice)?;
    let _ = sock.set_nodelay(true);
    sock.set_read_timeout(Some(Duration::from_millis(100)))?;
    sock.set_write_timeout(Some(HELLO_TIMEOUT))?;
    Ok(sock)
}

/// Sends `message` (the table, or a failure) to each child of this rank as it connects.
fn serve_children(
    store: &mut StoreClient,
    ns: &str,
    token: &str,
    (rank, n): (usize, usize),
    listener: &Socket,
    message: &[u8],
    deadline: &Deadline,
) -> Result<()> {
    let mut waiting: Vec<usize> = children(rank, n).collect();
    let mut next_check = Deadline::after(DEATH_CHECK);
    while !waiting.is_empty() {
        if deadline.expired() {
            return Err(deadline.timeout_error(format!(
                "waiting for ranks {waiting:?} to fetch the host table"
            )));
        }
        if next_check.expired() {
            if let Some(e) = death(store, ns, Duration::ZERO) {
                return Err(e);
            }
            next_check = Deadline::after(DEATH_CHECK);
        }
        let Some((sock, from)) =
            weftcc_base::socket::accept_within(listener, 50, "host-table tree")
        else {
            continue;
        };
        match child_hello(&sock, token, ns) {
            Ok(child) if waiting.contains(&child) => {
                if let Err(e) = (&sock).write_all(message) {
                    tracing::warn!(target: "weftcc::net", rank, child, error = %e, "host-table tree: sending the table failed");
                    continue;
                }
                waiting.retain(|&c| c != child);
            }
            Ok(other) => {
                tracing::warn!(target: "weftcc::net", rank, from = %from, other, "host-table tree: a rank that is no child of this one connected");
            }
            Err(why) => {
                tracing::warn!(target: "weftcc::net", rank, from = %from, reason = %why, "host-table tree: refused a connection");
            }
        }
    }
    Ok(())
}

/// Reads a child's hello and returns its rank; the token and namespace must be this job's.
fn child_hello(sock: &Socket, token: &str, ns: &str) -> std::result::Result<usize, String> {
    let _ = sock.set_nonblocking(false);
    let _ = sock.set_read_timeout(Some(HELLO_TIMEOUT));
    let _ = sock.set_write_timeout(Some(HELLO_TIMEOUT));
    let mut magic = [0u8; 4];
    (&*sock).read_exact(&mut magic).map_err(|e| e.to_string())?;
    if magic != TREE_MAGIC {
        return Err("bad magic".into());
    }
    for (want, what) in [(token.as_bytes(), "token"), (ns.as_bytes(), "namespace")] {
        let mut len = [0u8; 2];
        (&*sock).read_exact(&mut len).map_err(|e| e.to_string())?;
        let len = u16::from_le_bytes(len) as usize;
        if len != want.len() {
            return Err(format!("wrong {what}"));
        }
        let mut got = vec![0u8; len];
        (&*sock).read_exact(&mut got).map_err(|e| e.to_string())?;
        if got != want {
            return Err(format!("wrong {what}"));
        }
    }
    let mut child = [0u8; 4];
    (&*sock).read_exact(&mut child).map_err(|e| e.to_string())?;
    Ok(u32::from_le_bytes(child) as usize)
}

pub(crate) fn encode_host(h: &PeerHost) -> String {
    format!("{:x}/{}/{}/{}", h.netns, u8::from(h.shm), h.net, h.host_id)
}

pub(crate) fn decode_host(text: &str) -> Option<PeerHost> {
    let mut it = text.splitn(4, '/');
    let netns = u64::from_str_radix(it.next()?, 16).ok()?;
    let shm = match it.next()? {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    let net = it.next()?.to_string();
    Some(PeerHost {
        host_id: it.next()?.to_string(),
        netns,
        shm,
        net,
    })
}

/// A table of entries: its distinct entries, then each rank's index among them.
pub(crate) fn encode_block(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut distinct: Vec<&[u8]> = Vec::new();
    let mut by_value: std::collections::HashMap<&[u8], u32> = std::collections::HashMap::new();
    let mut index = Vec::with_capacity(entries.len());
    for e in entries {
        let i = *by_value.entry(e.as_slice()).or_insert_with(|| {
            distinct.push(e);
            (distinct.len() - 1) as u32
        });
        index.push(i);
    }
    let mut v = Vec::new();
    v.extend_from_slice(&(distinct.len() as u32).to_le_bytes());
    for d in &distinct {
        v.extend_from_slice(&(d.len() as u32).to_le_bytes());
        v.extend_from_slice(d);
    }
    v.extend_from_slice(&(index.len() as u32).to_le_bytes());
    for i in index {
        v.extend_from_slice(&i.to_le_bytes());
    }
    v
}

pub(crate) fn decode_block(b: &[u8]) -> Option<Vec<String>> {
    let mut rest = b;
    let u32_ = |rest: &mut &[u8]| -> Option<usize> {
        let (h, t) = rest.split_first_chunk::<4>()?;
        *rest = t;
        Some(u32::from_le_bytes(*h) as usize)
    };
    let nd = u32_(&mut rest)?;
    let mut distinct = Vec::with_capacity(nd.min(1024));
    for _ in 0..nd {
        let len = u32_(&mut rest)?;
        if rest.len() < len {
            return None;
        }
        distinct.push(String::from_utf8(rest[..len].to_vec()).ok()?);
        rest = &rest[len..];
    }
    let count = u32_(&mut rest)?;
    let mut out = Vec::with_capacity(count.min(rest.len() / 4));
    for _ in 0..count {
        out.push(distinct.get(u32_(&mut rest)?)?.clone());
    }
    rest.is_empty().then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_entries_and_tables_round_trip() {
        let h = PeerHost {
            host_id: "node/7:boot".into(),
            netns: 0xf00d,
            shm: true,
            net: "ofi:tcp;ofi_rxm".into(),
        };
        assert_eq!(decode_host(&encode_host(&h)), Some(h));
        let entries: Vec<Vec<u8>> = ["a", "b", "a", "a", "c"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        let enc = encode_block(&entries);
        assert_eq!(
            decode_block(&enc),
            Some(
                vec!["a", "b", "a", "a", "c"]
                    .into_iter()
                    .map(String::from)
                    .collect()
            )
        );
        // Three distinct entries stored once each.
        assert_eq!(enc.len(), 4 + 3 * 5 + 4 + 5 * 4);
        for cut in 0..enc.len() {
            assert!(decode_block(&enc[..cut]).is_none());
        }
        let mut bad_index = enc.clone();
        let last = bad_index.len() - 4;
        bad_index[last] = 9;
        assert!(decode_block(&bad_index).is_none());
    }

    #[test]
    fn failures_travel_down_the_tree_typed() {
        for e in [
            TransportError::NotJoined {
                missing: vec![3, 9],
                more: 4,
                nranks: 64,
                after: Duration::from_millis(1500),
            },
            TransportError::DiedInSetup { peer: 7 },
        ] {
            let message = encode_failure(&e).expect("encodable");
            assert_eq!(message[..4], FAILURE.to_le_bytes());
            let back = decode_failure(&message[4..]).expect("decodes");
            assert_eq!(format!("{back:?}"), format!("{e:?}"));
            for cut in 4..message.len() {
                assert!(decode_failure(&message[4..cut]).is_none(), "cut at {cut}");
            }
        }
        assert!(encode_failure(&TransportError::Aborted).is_none());
    }

    #[test]
    fn the_tree_reaches_every_rank_once() {
        for n in 1..200 {
            let mut reached = vec![0; n];
            reached[0] = 1;
            for r in 0..n {
                for c in children(r, n) {
                    assert_eq!(parent(c), r);
                    reached[c] += 1;
                }
            }
            assert!(reached.iter().all(|&k| k == 1), "n = {n}");
        }
    }
}
