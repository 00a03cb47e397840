//! Making a network connection: the hello over the side connection, the endpoints connected
//! and warmed up, and the ready byte ([`NetConnection::establish`]).

use super::connection::NetConnection;
use super::endpoints::{progress_all, registry, EndpointState};
use super::layout::{
    NetLink, CLOSED_IN, CONNECTED, CONTROL, HEAD_IN, HELLO_FIXED, MAGIC, MAX_STREAMS,
    PROMISE_SOURCE, PROMISE_WORDS, READY, RING_MAX, RING_MIN, TAIL_IN, WORD_SLOT, WORD_SLOTS,
};
use crate::conn::Connection;
use crate::error::{Result, TransportError};
use crate::net::regcache::RegistrationCache;
use crate::net::{Memory, NetError, Posted, Provider, RemoteRegion};
use crate::ring::{RecvCursor, SendCursor};
use crate::util::{lock, Deadline};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

impl NetConnection {
    /// Makes the connection to `peer` over `provider`, shaped by `link`, by a handshake over
    /// `side` (a connected stream to the same peer, kept open afterwards). Both sides call this
    /// at about the same time.
    pub(crate) fn establish(
        peer: usize,
        mut side: Box<dyn Connection>,
        provider: &Arc<dyn Provider>,
        link: NetLink,
        deadline: &Deadline,
    ) -> Result<NetConnection> {
        let NetLink {
            ring: cap,
            streams,
            rendezvous,
        } = link;
        let cache = RegistrationCache::of(provider);
        let provider = provider.as_ref();
        let name = provider.name();
        let net = |e: NetError| TransportError::Net {
            peer: Some(peer),
            source: e,
        };
        if !cap.is_power_of_two() || (cap as u64) < RING_MIN || cap as u64 > RING_MAX {
            return Err(TransportError::Config(format!(
                "network ring of {cap} bytes: expected a power of two from {RING_MIN} to \
                 {RING_MAX}"
            )));
        }
        let alloc = |len: usize| {
            Memory::new(len).map(Arc::new).ok_or_else(|| {
                TransportError::Config(format!(
                    "cannot allocate {len} bytes of registered memory for rank {peer}"
                ))
            })
        };
        let memory = alloc(cap + CONTROL)?;
        // Both counters start at 0, with their complements.
        for at in [HEAD_IN, TAIL_IN] {
            memory.word(cap + at + 8).store(!0, Ordering::Relaxed);
        }
        let landing = provider.register(memory).map_err(net)?;
        if !(1..=MAX_STREAMS).contains(&streams) {
            return Err(TransportError::Config(format!(
                "{streams} endpoints per network connection: expected 1 to {MAX_STREAMS}"
            )));
        }
        let mut eps = Vec::with_capacity(streams);
        let mut addresses = Vec::new();
        addresses.extend_from_slice(&(streams as u32).to_le_bytes());
        for _ in 0..streams {
            let ep = provider.endpoint().map_err(net)?;
            let address = ep.address().map_err(net)?;
            addresses.extend_from_slice(&(address.len() as u32).to_le_bytes());
            addresses.extend_from_slice(&address);
            eps.push(ep);
        }

        let mut hello = Vec::with_capacity(HELLO_FIXED + addresses.len());
        let r = landing.remote();
        hello.extend_from_slice(MAGIC);
        for v in [cap as u64, r.base, r.key, r.len] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        hello.extend_from_slice(&(addresses.len() as u32).to_le_bytes());
        hello.extend_from_slice(&addresses);
        send_all(side.as_mut(), &hello, deadline, "sending the network hello")?;

        let mut fixed = [0u8; HELLO_FIXED];
        recv_exact(
            side.as_mut(),
            &mut fixed,
            deadline,
            "reading the network hello",
        )?;
        let bad =
            |what: String| TransportError::Protocol(format!("rank {peer}'s network hello: {what}"));
        if &fixed[..8] != MAGIC {
            return Err(bad("bad magic".into()));
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&fixed[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(b)
        };
        let (remote_cap, base, key, len) = (word(0), word(1), word(2), word(3));
        if !remote_cap.is_power_of_two()
            || !(RING_MIN..=RING_MAX).contains(&remote_cap)
            || len < remote_cap + CONTROL as u64
        {
            return Err(bad(format!(
                "ring of {remote_cap} bytes in a {len}-byte region"
            )));
        }
        let mut alen = [0u8; 4];
        alen.copy_from_slice(&fixed[HELLO_FIXED - 4..]);
        let alen = u32::from_le_bytes(alen) as usize;
        if alen > 4096 * (MAX_STREAMS + 1) {
            return Err(bad(format!("addresses of {alen} bytes")));
        }
        let mut block = vec![0u8; alen];
        recv_exact(
            side.as_mut(),
            &mut block,
            deadline,
            "reading the network addresses",
        )?;
        let peer_addresses =
            parse_addresses(&block).ok_or_else(|| bad("bad address list".into()))?;
        // Both sides use as many endpoints as the one with fewer has.
        eps.truncate(peer_addresses.len().min(streams));
        for (ep, address) in eps.iter_mut().zip(&peer_addresses) {
            ep.connect(address).map_err(net)?;
        }
        let staging = provider
            .register(alloc(remote_cap as usize)?)
            .map_err(net)?;

        // No write before both sides' endpoints are connected: on verbs a write that reaches
        // a queue pair not yet in RTR is dropped and resent only after the ACK timeout (about
        // 4 s at WEFT_IB_TIMEOUT=20), or fails without retries. Each side says CONNECTED once
        // its own endpoints are, and waits for the peer's.
        send_all(
            side.as_mut(),
            &[CONNECTED],
            deadline,
            "sending network connected",
        )?;
        let mut connected = [0u8; 1];
        recv_exact(
            side.as_mut(),
            &mut connected,
            deadline,
            "waiting for the peer's endpoints to connect",
        )?;
        if connected[0] != CONNECTED {
            return Err(bad("bad connected byte".into()));
        }

        // Then each side writes a zero into the peer's close word on every endpoint and waits
        // for the writes to complete, polling all the while so that the peer's connection
        // set-up progresses too (libfabric's rxm connects on the first write), and only then
        // says READY: neither side writes data before the other's endpoints carried a write.
        let peer_region = RemoteRegion { base, key, len };
        let close_word = remote_cap + CLOSED_IN as u64;
        let mut posted = vec![false; eps.len()];
        let mut warmed = vec![false; eps.len()];
        let mut sent_ready = false;
        let mut ready = [0u8; 1];
        let mut got_ready = false;
        let mut done = Vec::new();
        let warm_id = |k: usize| u64::MAX - k as u64;
        // Sources of the warm-up writes for endpoints without inline writes: one zeroed slot
        // each, untouched until the write completes.
        let words = Arc::new(
            provider
                .register(alloc(PROMISE_SOURCE + 8 * PROMISE_WORDS)?)
                .map_err(net)?,
        );
        while !(warmed.iter().all(|&w| w) && got_ready) {
            for (k, ep) in eps.iter_mut().enumerate() {
                if !posted[k] {
                    let zero = 0u64.to_le_bytes();
                    let r = if zero.len() <= ep.inline_max() {
                        ep.write_inline(&zero, peer_region.at(close_word), warm_id(k))
                    } else {
                        ep.write(
                            words.range(k * WORD_SLOT, 8),
                            peer_region.at(close_word),
                            warm_id(k),
                        )
                    };
                    posted[k] = r.map_err(net)? == Posted::Yes;
                }
                done.clear();
                ep.poll(&mut done).map_err(net)?;
                for c in &done {
                    c.result.clone().map_err(net)?;
                    warmed[k] |= c.wr_id == warm_id(k);
                }
            }
            if warmed.iter().all(|&w| w) && !sent_ready {
                send_all(side.as_mut(), &[READY], deadline, "sending network ready")?;
                sent_ready = true;
            }
            if !got_ready && side.try_recv_into(&mut ready)? == 1 {
                if ready[0] != READY {
                    return Err(bad("bad ready byte".into()));
                }
                got_ready = true;
            }
            if deadline.expired() {
                return Err(deadline
                    .timeout_error(format!("connecting the network endpoints to rank {peer}")));
            }
            if !(warmed.iter().all(|&w| w) && got_ready) {
                progress_all();
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        let max_outstanding = eps
            .iter()
            .map(|e| e.max_outstanding())
            .min()
            .unwrap_or(4)
            .max(4);
        let n_eps = eps.len();
        let ordered = n_eps == 1 && eps.iter().all(|e| e.placement_ordered());
        let (landing, staging) = (Arc::new(landing), Arc::new(staging));
        let io = Arc::new(Mutex::new(EndpointState {
            eps,
            _regions: [Arc::clone(&landing), Arc::clone(&staging)],
            words,
            slots: [None; WORD_SLOTS],
            ordered,
            outstanding: vec![0; n_eps],
            rr: 0,
            next_wr: 0,
            heads: VecDeque::new(),
            head_done: 0,
            data: VecDeque::new(),
            data_done: 0,
            direct: VecDeque::new(),
            direct_done: 0,
            direct_words: VecDeque::new(),
            direct_word_done: 0,
            promise_wr: None,
            bounce: None,
            failed: None,
            done: Vec::new(),
            remote: peer_region,
            remote_cap: remote_cap as usize,
            max_outstanding,
            head_want: 0,
            head_posted: 0,
            tail_want: 0,
            tail_posted: 0,
            direct_want: 0,
            direct_posted: 0,
        }));
        lock(registry()).push(Arc::downgrade(&io));
        Ok(NetConnection {
            peer,
            provider: name,
            io,
            side: Some(side),
            landing,
            staging,
            cap,
            remote: peer_region,
            remote_cap: remote_cap as usize,
            send: SendCursor::default(),
            recv: RecvCursor::at(0),
            head_sent: 0,
            max_outstanding,
            pin: None,
            lost: None,
            side_lost_at: None,
            closed_sent: false,
            sent: 0,
            read: 0,
            rendezvous,
            cache,
            promise_out: None,
            promise_seq: 0,
            promise_in: None,
            promise_seen: 0,
            bounce_next: 0,
            direct_seen: 0,
            answer_seen: 0,
            direct_received: 0,
        })
    }
}

/// A wait of the handshake: the other connections of this process progress meanwhile. A peer
/// may wait for bytes this rank's last operation sent on another connection, whose head goes
/// out only when polled (after its data's completion where placement is relaxed, or over
/// several endpoints), before it answers this handshake.
fn idle() {
    progress_all();
    std::thread::sleep(Duration::from_micros(100));
}

fn send_all(
    c: &mut dyn Connection,
    mut data: &[u8],
    deadline: &Deadline,
    what: &str,
) -> Result<()> {
    while !data.is_empty() {
        let n = c.try_send(data)?;
        data = &data[n..];
        if n == 0 {
            if deadline.expired() {
                return Err(deadline.timeout_error(what.to_string()));
            }
            idle();
        }
    }
    Ok(())
}

fn recv_exact(
    c: &mut dyn Connection,
    buf: &mut [u8],
    deadline: &Deadline,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = c.try_recv_into(&mut buf[got..])?;
        got += n;
        if n == 0 {
            c.check_peer()?;
            if deadline.expired() {
                return Err(deadline.timeout_error(what.to_string()));
            }
            idle();
        }
    }
    Ok(())
}

/// The endpoint addresses of a hello: a count, then each address with its length.
pub(super) fn parse_addresses(block: &[u8]) -> Option<Vec<Vec<u8>>> {
    let take = |at: &mut usize, n: usize| -> Option<&[u8]> {
        let s = block.get(*at..at.checked_add(n)?)?;
        *at += n;
        Some(s)
    };
    let mut at = 0;
    let count = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?) as usize;
    if count == 0 || count > MAX_STREAMS {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?) as usize;
        out.push(take(&mut at, len)?.to_vec());
    }
    (at == block.len()).then_some(out)
}
