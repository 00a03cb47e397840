//! Fuzzing on stable Rust: proptest with many cases over what peers and users hand this crate
//! (the bootstrap store's frames, the TCP handshake, `WEFT_*` values). Every case must end in a
//! value or a typed error: never a panic, never a hang, and the store keeps serving its other
//! clients. `WEFT_FUZZ_CASES` sets the cases per target (default 1000); each target prints how
//! many it ran.

use proptest::prelude::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use weftcc_store::{StoreClient, StoreServer, MAX_FRAME, STORE_VERSION};
use weftcc_testkit::fuzz::fuzz;
use weftcc_transports::tcp::{self, IfnameSpec};
use weftcc_transports::tcp_stripes::StripePlan;
use weftcc_transports::{net, parse_size, ConnectMode};

const TOKEN: &str = "fuzz-token";

fn store_hello(token: &str) -> Vec<u8> {
    let mut v = b"WFST".to_vec();
    v.extend_from_slice(&STORE_VERSION.to_le_bytes());
    v.extend_from_slice(&(token.len() as u16).to_le_bytes());
    v.extend_from_slice(token.as_bytes());
    v
}

/// A request frame: a real opcode (or an unknown one) with fields of random shape (lengths that lie, keys longer
/// than the frame, waits of at most 20 ms so that no case parks the server for long), or bytes.
fn request() -> impl Strategy<Value = Vec<u8>> {
    let key = prop::collection::vec(any::<u8>(), 0..24);
    let claimed = prop_oneof![Just(None), any::<u32>().prop_map(Some)];
    let frame_body = (
        0u8..12,
        0u64..20,
        0u32..4,
        key,
        claimed,
        prop::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(op, wait_ms, count, key, claimed, rest)| {
            let mut p = vec![op];
            if matches!(op, 2 | 3 | 7) {
                p.extend_from_slice(&wait_ms.to_le_bytes());
            }
            if matches!(op, 3 | 7) {
                p.extend_from_slice(&count.to_le_bytes());
            }
            if op == 4 {
                p.extend_from_slice(&(wait_ms as i64 - 10).to_le_bytes());
            }
            let len = claimed.unwrap_or(key.len() as u32);
            p.extend_from_slice(&len.to_le_bytes());
            p.extend_from_slice(&key);
            p.extend_from_slice(&rest);
            p
        });
    let framed = (
        frame_body,
        prop_oneof![Just(None), any::<u32>().prop_map(Some)],
    )
        .prop_map(|(body, lie)| {
            let len = lie.map_or(body.len() as u32, |l| l % (MAX_FRAME as u32 + 16));
            let mut f = len.to_le_bytes().to_vec();
            f.extend_from_slice(&body);
            f
        });
    prop_oneof![4 => framed, 1 => prop::collection::vec(any::<u8>(), 0..64)]
}

/// Reads what the server answers until it closes or goes quiet for 100 ms.
fn drain(s: &mut TcpStream) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let mut buf = [0u8; 4096];
    let mut total = 0usize;
    while let Ok(n) = s.read(&mut buf) {
        total += n;
        if n == 0 || total > (1 << 20) {
            break;
        }
    }
}

#[test]
fn store_frames_never_take_the_store_down() {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN).expect("store");
    let addr = server.local_addr().to_string();
    let client = std::sync::Mutex::new(
        StoreClient::connect(&addr, TOKEN, Duration::from_secs(10)).expect("legit client"),
    );
    let case = AtomicU64::new(0);
    fuzz(
        "store frames",
        (any::<bool>(), prop::collection::vec(request(), 1..6)),
        |(good_hello, frames)| {
            let mut s = TcpStream::connect(&addr).expect("connect");
            s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            let hello = if good_hello {
                store_hello(TOKEN)
            } else {
                store_hello("not-the-token")
            };
            let _ = s.write_all(&hello);
            for f in &frames {
                if s.write_all(f).is_err() {
                    break;
                }
            }
            drain(&mut s);
            drop(s);
            // The store still answers everyone else.
            let n = case.fetch_add(1, Ordering::Relaxed);
            let key = format!("fuzz/check/{n}");
            let mut client = client.lock().unwrap();
            client
                .set(&key, &n.to_le_bytes())
                .map_err(|e| TestCaseError::fail(format!("store stopped serving: {e}")))?;
            let v = client
                .get(&key, Duration::from_secs(5))
                .map_err(|e| TestCaseError::fail(format!("store stopped serving: {e}")))?;
            prop_assert_eq!(v, n.to_le_bytes().to_vec());
            Ok(())
        },
    );
    server.shutdown();
}

#[test]
fn tcp_handshakes_read_or_refuse() {
    fuzz(
        "tcp handshake bytes",
        prop::collection::vec(any::<u8>(), 0..96),
        |bytes| {
            let _ = tcp::read_hello(&mut &bytes[..]);
            Ok(())
        },
    );
    fuzz(
        "tcp handshake round trip",
        ("[ -~]{0,80}", any::<u32>(), any::<u64>(), 0usize..40),
        |(token, rank, hash, cut)| {
            match tcp::encode_hello(&token, rank, hash) {
                Ok(frame) => {
                    prop_assert!(token.len() <= tcp::MAX_TOKEN_LEN);
                    let h = tcp::read_hello(&mut &frame[..]).expect("own frame");
                    prop_assert_eq!(h.token, token.as_bytes().to_vec());
                    prop_assert_eq!((h.rank, h.namespace_hash), (rank, hash));
                    // Any cut of a good frame is refused, not misread.
                    let short = &frame[..frame.len().saturating_sub(cut + 1)];
                    prop_assert!(tcp::read_hello(&mut &short[..]).is_err());
                }
                Err(_) => prop_assert!(token.len() > tcp::MAX_TOKEN_LEN),
            }
            Ok(())
        },
    );
}

#[test]
fn weft_values_parse_or_give_a_typed_error() {
    let text = || {
        prop_oneof![
            ".{0,24}",
            "[0-9 ]{0,12}[kKmMgGtTiIbB]{0,3}",
            "[\\^=a-z0-9_:,]{0,24}"
        ]
    };
    fuzz(
        "WEFT_* values",
        (text(), text(), text(), text()),
        |(a, b, c, d)| {
            let _ = parse_size(&a);
            let _ = IfnameSpec::parse(&b);
            let _ = tcp::Family::parse(&c);
            let _ = ConnectMode::parse(&d);
            let _ = net::verbs::VerbsConfig::parse(Some(&a), Some(&b), Some(&c), Some(&d));
            let _ = net::verbs::parse_gid(&a);
            let _ = net::select::NetChoice::parse(Some(&a), Some(&b), Some(&c), Some(&d));
            Ok(())
        },
    );
    fuzz(
        "sizes with suffixes",
        (
            0u64..1 << 20,
            prop::sample::select(vec![
                ("", 1u64),
                ("K", 1 << 10),
                ("M", 1 << 20),
                ("G", 1 << 30),
            ]),
        ),
        |(n, (suffix, unit))| {
            let got = parse_size(&format!("{n}{suffix}"))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(got as u64, n * unit);
            Ok(())
        },
    );
    fuzz(
        "stripe plans",
        (any::<usize>(), any::<usize>(), any::<usize>()),
        |(t, s, bytes)| {
            if let Ok(p) = StripePlan::new(t % 80, s % 80) {
                prop_assert!((1..=64).contains(&p.sockets()));
                let _ = p.with_stripe(bytes % (32 << 20));
            }
            Ok(())
        },
    );
}
