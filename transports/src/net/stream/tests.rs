use super::handshake::parse_addresses;
use super::layout::PROMISE_WORDS;
use super::promise::Promise;
use super::*;
use crate::conn::{Connection, IdleWaiter};
use crate::error::{Result, TransportError};
use crate::net::loopback::{Faults, Loopback, LoopbackProvider};
use crate::net::{Provider, RemoteRegion};
use crate::util::lock;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pair(faults: Faults) -> (NetConnection, NetConnection) {
    striped(faults, 1)
}

fn striped(faults: Faults, streams: usize) -> (NetConnection, NetConnection) {
    let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::with_faults(faults)));
    local_pair_striped(p, 4096, streams).expect("pair")
}

/// How the receiving side of [`transfer`] reads.
#[derive(Clone, Copy)]
enum Reads {
    /// `try_recv_into` in 777-byte pieces.
    Small,
    /// `try_recv_into_pinned` of this many bytes at a time, each to its end.
    Pinned(usize),
}

fn patterned(total: usize) -> Vec<u8> {
    (0..total).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// Sends `total` patterned bytes from `a` to `b` (pinned or plain, in uneven pieces) on two
/// threads; returns what `b` read and the receiving end, or the first error either side saw.
fn transfer_with(
    a: NetConnection,
    b: NetConnection,
    total: usize,
    pinned: bool,
    reads: Reads,
) -> Result<(Vec<u8>, NetConnection)> {
    let data = patterned(total);
    let expect = data.clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    let sender = std::thread::spawn(move || -> Result<NetConnection> {
        let mut a = a;
        let mut off = 0;
        let mut piece = 1;
        while off < data.len() {
            let end = (off + piece).min(data.len());
            let n = if pinned {
                a.try_send_pinned(&data[off..end])?
            } else {
                a.try_send(&data[off..end])?
            };
            off += n;
            if n == end - off + n {
                piece = piece * 3 % 50_000 + 1;
            }
            if n == 0 {
                a.check_peer()?;
                assert!(Instant::now() < deadline, "send stuck at {off}");
                NetWaiter.wait(&[], Duration::from_millis(1))?;
            }
        }
        Ok(a)
    });
    let mut b = b;
    let mut got = vec![0u8; total];
    let mut filled = 0;
    let result = loop {
        if filled == total {
            break Ok(());
        }
        let r = match reads {
            Reads::Small => {
                let end = (filled + 777).min(total);
                b.try_recv_into(&mut got[filled..end])
            }
            Reads::Pinned(size) => {
                // The rest of the current message, as the engine asks.
                let end = (filled / size * size + size).min(total);
                recv_pinned(&mut b, &mut got[filled..end])
            }
        };
        match r {
            Ok(0) => {
                if let Err(e) = b.check_peer() {
                    break Err(e);
                }
                assert!(Instant::now() < deadline, "receive stuck at {filled}");
                NetWaiter.wait(&[], Duration::from_millis(1))?;
            }
            Ok(n) => filled += n,
            Err(e) => break Err(e),
        }
    };
    let sent = sender.join().expect("sender thread");
    result?;
    drop(sent?);
    if let Some(i) = got.iter().zip(&expect).position(|(g, e)| g != e) {
        panic!(
            "byte {i} of {total} is wrong: {} instead of {}",
            got[i], expect[i]
        );
    }
    Ok((got, b))
}

fn transfer(a: NetConnection, b: NetConnection, total: usize, pinned: bool) -> Result<Vec<u8>> {
    transfer_with(a, b, total, pinned, Reads::Small).map(|(got, _)| got)
}

fn shaped(faults: Faults, streams: usize, rendezvous: usize) -> (NetConnection, NetConnection) {
    let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(Loopback::with_faults(faults)));
    let link = NetLink {
        ring: 4096,
        streams,
        rendezvous,
    };
    local_pair_shaped(p, link).expect("pair")
}

#[test]
fn completions_out_of_order_and_a_shallow_queue_keep_the_stream() {
    for pinned in [false, true] {
        let faults = Faults {
            reverse_completions: true,
            queue_depth: Some(4),
            ..Faults::default()
        };
        let (a, b) = pair(faults);
        transfer(a, b, 300_000, pinned).expect("transfer");
    }
}

#[test]
fn writes_landing_in_pieces_never_expose_a_half_written_counter() {
    // Counters cross 64 KiB boundaries many times: a head or tail read with only its low
    // two bytes new would be far off (and caught as corrupt, or read as bytes not there).
    for pinned in [false, true] {
        let (a, b) = pair(Faults {
            split_writes: true,
            ..Faults::default()
        });
        transfer(a, b, 3 << 20, pinned).expect("transfer");
    }
}

/// Every fault that reorders or splits writes: completions reversed, writes landing in pieces,
/// data held back, shallow queues.
fn reordering_and_splitting() -> Faults {
    Faults {
        reverse_completions: true,
        split_writes: true,
        slow_data: true,
        queue_depth: Some(6),
        ..Faults::default()
    }
}

#[test]
fn several_endpoints_keep_the_stream_whatever_order_writes_land_in() {
    // Completions reversed, writes landing in pieces, shallow queues, three endpoints: the
    // head never covers a byte whose write is still on its way.
    for pinned in [false, true] {
        let faults = reordering_and_splitting();
        let (a, b) = striped(faults, 3);
        transfer(a, b, 1 << 20, pinned).expect("transfer");
    }
}

#[test]
fn endpoints_without_inline_writes_send_control_words_from_registered_slots() {
    for streams in [1, 2] {
        let faults = Faults {
            no_inline: true,
            reverse_completions: true,
            ..Faults::default()
        };
        let (a, b) = striped(faults, streams);
        transfer(a, b, 300_000, true).expect("transfer");
    }
}

/// A pinned receive: every caller here asks again for the rest of `dst`, before anything
/// else, until it is full, and keeps `dst` alive until its connection is dropped.
fn recv_pinned(c: &mut NetConnection, dst: &mut [u8]) -> Result<usize> {
    // SAFETY: as above.
    unsafe { c.try_recv_into_pinned(dst) }
}

/// Polls `c` until `done` holds (the loopback places a side's writes when it polls).
fn poll_until(c: &mut NetConnection, mut done: impl FnMut(&mut NetConnection) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(c) {
        assert!(Instant::now() < deadline, "condition never held");
        progress_all();
    }
}

/// The in-memory provider, and libfabric's tcp provider where it opens.
fn providers() -> Vec<Arc<dyn Provider>> {
    let mut all: Vec<Arc<dyn Provider>> = vec![Arc::new(LoopbackProvider(Loopback::new()))];
    match crate::net::ofi::OfiProvider::open(Some("tcp"), false) {
        Ok(p) => all.push(Arc::new(p)),
        Err(e) => eprintln!("libfabric's tcp provider not usable here ({e}): loopback only"),
    }
    all
}

#[test]
fn a_waiting_pinned_receive_gets_the_bytes_written_straight_into_it() {
    for (provider, streams) in providers()
        .into_iter()
        .flat_map(|p| [(p.clone(), 1), (p, 3)])
    {
        let link = NetLink {
            ring: 4096,
            streams,
            rendezvous: 1024,
        };
        let (mut a, mut b) = local_pair_shaped(provider, link).expect("pair");
        let data = patterned(300_000);
        let mut got = vec![0u8; data.len()];
        // The receiver waits first: its destination is promised, and the promise lands.
        assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
        poll_until(&mut b, |b| lock(&b.io).promise_wr.is_none());
        let (mut sent, mut filled) = (0, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while filled < got.len() {
            if sent < data.len() {
                sent += a.try_send_pinned(&data[sent..]).unwrap();
            }
            filled += recv_pinned(&mut b, &mut got[filled..]).unwrap();
            assert!(Instant::now() < deadline, "stuck at {filled}");
            progress_all();
        }
        assert!(got == data, "{streams} endpoints: the bytes differ");
        assert_eq!(
            b.direct_received(),
            data.len() as u64,
            "not one byte through the ring"
        );
        assert_eq!(b.recv.tail, 0, "the ring was never used");
        let deadline = Instant::now() + Duration::from_secs(10);
        while sent < data.len() {
            sent += a.try_send_pinned(&data[sent..]).unwrap();
            if Instant::now() > deadline {
                let io = lock(&a.io);
                panic!(
                    "sender stuck at {sent}: promise {:?}, direct done {} word done {} want {} posted {} words {:?}",
                    a.promise_in, io.direct_done, io.direct_word_done, io.direct_want, io.direct_posted, io.direct_words
                );
            }
        }
        // The stream goes on through the ring after the promise.
        a.try_send(b"after").unwrap();
        let mut tail = [0u8; 5];
        poll_until(&mut b, |b| b.try_recv_into(&mut tail).unwrap() == 5);
        assert_eq!(&tail, b"after");
    }
}

#[test]
fn direct_bytes_are_read_after_the_sender_closed() {
    // The answer, the bytes, their word and the close mark all land before the receiver
    // looks again: a liveness check must see the bytes, not a closed peer.
    let (mut a, mut b) = shaped(Faults::default(), 1, 1024);
    let data = patterned(100_000);
    let mut got = vec![0u8; data.len()];
    assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
    poll_until(&mut b, |b| lock(&b.io).promise_wr.is_none());
    let mut sent = 0;
    poll_until(&mut a, |a| {
        sent += a.try_send_pinned(&data[sent..]).unwrap();
        sent == data.len()
    });
    drop(a);
    b.check_peer()
        .expect("bytes are waiting: the peer is not lost yet");
    let mut filled = 0;
    while filled < got.len() {
        filled += recv_pinned(&mut b, &mut got[filled..]).unwrap();
    }
    assert!(got == data, "the bytes differ");
    assert_eq!(b.direct_received(), data.len() as u64);
    assert!(b.check_peer().is_err(), "closed and read to the end");
}

#[test]
fn a_promise_the_sender_passed_over_is_read_from_the_ring() {
    let fabric = Loopback::new();
    let p: Arc<dyn Provider> = Arc::new(LoopbackProvider(fabric.clone()));
    let link = NetLink {
        ring: 4096,
        streams: 1,
        rendezvous: 1024,
    };
    let (mut a, mut b) = local_pair_shaped(p, link).expect("pair");
    // The sender writes first: its bytes are in the ring (posted, not landed yet) when the
    // receiver offers its destination. Held, since other tests' `progress_all` polls these
    // endpoints too and would land them at any moment.
    fabric.hold_data(true);
    let data = patterned(3000);
    assert_eq!(a.try_send(&data).unwrap(), 3000);
    let mut got = vec![0u8; 3000];
    assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
    assert!(b.promise_out.is_some(), "offered: the ring looked empty");
    fabric.hold_data(false);
    let mut filled = 0;
    poll_until(&mut b, |b| {
        filled += recv_pinned(b, &mut got[filled..]).unwrap();
        filled == 3000
    });
    assert_eq!(got, data);
    assert_eq!(b.direct_received(), 0);
    assert!(b.promise_out.is_none(), "the passed-over promise is closed");
    // The stale promise in the sender's landing is never taken later.
    poll_until(&mut a, |a| a.promise_written().is_some());
    a.try_send_pinned(&data[..8]).unwrap();
    assert!(a.promise_in.is_none());
}

#[test]
fn rendezvous_and_ring_interleave_without_losing_a_byte() {
    // Messages of 40 000 bytes read pinned while the sender sends in uneven pieces: some
    // promises are taken, some passed over, under every fault that reorders or splits.
    for (streams, pinned) in [(1, true), (1, false), (3, true)] {
        let faults = reordering_and_splitting();
        let (a, b) = shaped(faults, streams, 1000);
        let (_, b) = transfer_with(a, b, 2 << 20, pinned, Reads::Pinned(40_000)).expect("transfer");
        assert!(b.read == 2 << 20);
        assert!(b.direct_received() > 0, "no promise was taken");
    }
}

#[test]
fn a_reader_of_whole_words_is_never_stalled_after_a_direct_message_of_odd_length() {
    // Messages of 5004 bytes (copied: offered to the sender) alternate with 2400 bytes of
    // 8-byte elements (reduced: lent, whole elements only) through a 4 KiB ring. Were the
    // direct bytes not whole words, the ring would hold the elements 4 bytes off their
    // stream alignment and lend half an element at its end, which the reader never takes.
    let (mut a, mut b) = shaped(Faults::default(), 1, 1024);
    let (odd, words, rounds) = (5004, 2400, 40);
    let message = move |r: usize| -> Vec<u8> {
        let total = odd + 4 + words; // padded to 8, as the engine does
        (0..total).map(|i| (i * 13 + r * 7) as u8).collect()
    };
    let sender = std::thread::spawn(move || {
        for r in 0..rounds {
            let m = message(r);
            let mut off = 0;
            let deadline = Instant::now() + Duration::from_secs(10);
            while off < m.len() {
                off += a.try_send(&m[off..]).unwrap();
                assert!(Instant::now() < deadline, "send stuck");
                progress_all();
            }
        }
        a
    });
    let mut direct = 0;
    for r in 0..rounds {
        let m = message(r);
        let mut got = vec![0u8; odd];
        let mut filled = 0;
        poll_until(&mut b, |b| {
            filled += recv_pinned(b, &mut got[filled..]).unwrap();
            filled == odd
        });
        assert!(got[..] == m[..odd], "round {r}: copied bytes differ");
        let mut pad = [0u8; 4];
        let mut n = 0;
        poll_until(&mut b, |b| {
            n += b.try_recv_into(&mut pad[n..]).unwrap();
            n == 4
        });
        let mut elements = Vec::new();
        poll_until(&mut b, |b| {
            let want = words - elements.len();
            b.try_recv(want, &mut |s: &[u8]| {
                let whole = s.len() / 8 * 8;
                elements.extend_from_slice(&s[..whole]);
                whole
            })
            .unwrap();
            elements.len() == words
        });
        assert!(elements[..] == m[odd + 4..], "round {r}: elements differ");
        direct = b.direct_received();
    }
    drop(sender.join().expect("sender"));
    assert!(direct > 0, "no message went direct");
}

#[test]
fn a_peer_that_vanishes_between_direct_bytes_and_their_word_is_lost() {
    for vanish in [12, 20, 40] {
        let (a, b) = shaped(
            Faults {
                vanish_after: Some(vanish),
                ..Faults::default()
            },
            1,
            1000,
        );
        let err = transfer_with(a, b, 1 << 20, true, Reads::Pinned(100_000))
            .map(|_| ())
            .expect_err("the peer vanished");
        assert!(matches!(err, TransportError::PeerLost { .. }), "{err:?}");
    }
}

#[test]
fn a_cancelled_pinned_receive_is_never_written_again() {
    let (mut a, mut b) = shaped(Faults::default(), 1, 1024);
    let mut got = vec![0u8; 200_000];
    assert_eq!(recv_pinned(&mut b, &mut got).unwrap(), 0);
    poll_until(&mut b, |b| lock(&b.io).promise_wr.is_none());
    let data = vec![7u8; 200_000];
    // The sender takes the promise and has some bytes on their way.
    let first = a.try_send_pinned(&data).unwrap();
    assert!(a.promise_in.is_some(), "taken");
    b.cancel_pinned();
    let before = got.clone();
    // Whatever the sender does now fails, and the destination stays as it was.
    let mut sent = first;
    let err = loop {
        progress_all();
        match a.try_send_pinned(&data[sent..]).and_then(|n| {
            sent += n;
            a.check_peer()
        }) {
            Ok(()) => assert!(sent < data.len(), "all accepted after the cancel"),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, TransportError::PeerLost { .. }), "{err:?}");
    assert!(got == before, "written after the cancel");
    assert!(
        b.try_recv_into(&mut got).is_err(),
        "the connection is closed"
    );
}

#[test]
fn promises_are_whole_or_not_at_all() {
    let p = Promise {
        seq: 3,
        start: 100,
        end: 4196,
        remote: RemoteRegion {
            base: 0x7000,
            key: 42,
            len: 4096,
        },
    };
    let words = p.words();
    assert_eq!(Promise::from_words(&words), Some(p));
    for i in 0..PROMISE_WORDS {
        let mut torn = words;
        torn[i] ^= 1 << (i * 5);
        assert_eq!(Promise::from_words(&torn), None, "word {i} changed");
    }
    assert_eq!(
        Promise::from_words(&[0; PROMISE_WORDS]),
        None,
        "nothing written"
    );
}

#[test]
fn hello_address_lists_are_checked() {
    let mut block = Vec::new();
    block.extend_from_slice(&2u32.to_le_bytes());
    for a in [&b"abc"[..], &b"de"[..]] {
        block.extend_from_slice(&(a.len() as u32).to_le_bytes());
        block.extend_from_slice(a);
    }
    assert_eq!(
        parse_addresses(&block),
        Some(vec![b"abc".to_vec(), b"de".to_vec()])
    );
    assert_eq!(parse_addresses(&block[..block.len() - 1]), None, "short");
    let mut long = block.clone();
    long.push(0);
    assert_eq!(parse_addresses(&long), None, "trailing bytes");
    assert_eq!(parse_addresses(&0u32.to_le_bytes()), None, "no endpoint");
    assert_eq!(parse_addresses(&99u32.to_le_bytes()), None, "too many");
}

#[test]
fn a_failed_write_or_a_vanished_peer_is_peer_lost_on_both_ends_not_a_hang() {
    // Write 40 is a data write well into the stream (the handshake wrote 2).
    let failed = Faults {
        fail_write: Some(40),
        ..Faults::default()
    };
    // The fabric dies after 31 placed writes: some data without its head, at the latest.
    let vanished = Faults {
        vanish_after: Some(31),
        ..Faults::default()
    };
    for (faults, pinned) in [(failed, true), (vanished, false)] {
        let (a, b) = pair(faults);
        let err = transfer(a, b, 1 << 20, pinned).expect_err("the transfer should have failed");
        assert!(
            matches!(&err, TransportError::PeerLost { detail, .. } if detail.contains("injected") || detail.contains("closed") || detail.contains("gone")),
            "{err:?}"
        );
    }
}

#[test]
fn pinned_bytes_are_accepted_only_once_written() {
    let (mut a, mut b) = pair(Faults::default());
    let data = [9u8; 1000];
    // Posted, but the loopback places writes only when polled: nothing is accepted before
    // the completions are seen.
    let first = a.try_send_pinned(&data).unwrap();
    assert_eq!(first, 0, "accepted before the write completed");
    let mut accepted = first;
    while accepted < data.len() {
        accepted += a.try_send_pinned(&data[accepted..]).unwrap();
    }
    let mut got = [0u8; 1000];
    let mut n = 0;
    while n < got.len() {
        n += b.try_recv_into(&mut got[n..]).unwrap();
    }
    assert_eq!(got, data);
}
