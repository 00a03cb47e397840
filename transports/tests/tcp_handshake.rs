//! TCP establishment: bad handshakes are refused while legitimate peers still get through.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};
use weftcc_transports::tcp::{encode_hello, namespace_hash, read_hello, TcpEndpoint};
use weftcc_transports::{Connection, TransportError};

const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn closed_without_reply(mut s: TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(0) | Err(_))
}

#[test]
fn bad_connectors_are_refused_and_legitimate_peers_connect() {
    let ns_hash = namespace_hash("ns");
    let server = TcpEndpoint::bind(LO, 3, "tok", "ns").unwrap();
    let addr = server.local_addr();
    std::thread::scope(|s| {
        let acceptor = s.spawn(|| server.accept_peers(&[0, 1], Duration::from_secs(20)));

        // A silent connector that never speaks must not stall the others.
        let _silent = TcpStream::connect(addr).unwrap();
        // Garbage, wrong magic, wrong version, wrong token, wrong namespace.
        let mut cases: Vec<Vec<u8>> = vec![b"GET / HTTP/1.1\r\n\r\n".to_vec()];
        let good = encode_hello("tok", 0, ns_hash).unwrap();
        let mut v = good.clone();
        v[1] = b'X';
        cases.push(v);
        let mut v = good.clone();
        v[4] = 99;
        cases.push(v);
        cases.push(encode_hello("wrong", 0, ns_hash).unwrap());
        cases.push(encode_hello("tok", 0, 12345).unwrap());
        let mut v = good.clone();
        v[6] = 255; // token length beyond the maximum
        cases.push(v);
        let mut refused = Vec::new();
        for c in cases {
            let mut st = TcpStream::connect(addr).unwrap();
            st.write_all(&c).unwrap();
            refused.push(st);
        }
        for st in refused {
            assert!(closed_without_reply(st), "a bad handshake got a reply");
        }
        // Positive control: a correct handshake from a rank nobody expects is answered (then
        // dropped by the acceptor as unexpected).
        let mut st = TcpStream::connect(addr).unwrap();
        st.write_all(&encode_hello("tok", 7, ns_hash).unwrap())
            .unwrap();
        st.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let reply = read_hello(&mut st).expect("reply to a valid handshake");
        assert_eq!(reply.rank, 3);

        // Legitimate peers 0 and 1 still connect.
        let p0 = TcpEndpoint::bind(LO, 0, "tok", "ns").unwrap();
        let p1 = TcpEndpoint::bind(LO, 1, "tok", "ns").unwrap();
        let mut c0 = p0
            .connect_peer(3, addr, Duration::from_secs(10))
            .expect("rank 0 connects");
        let mut c1 = p1
            .connect_peer(3, addr, Duration::from_secs(10))
            .expect("rank 1 connects");
        let mut accepted = acceptor.join().unwrap().expect("accept");
        assert_eq!(
            accepted.iter().map(|c| c.peer()).collect::<Vec<_>>(),
            vec![0, 1]
        );

        // And the connections carry data both ways.
        assert_eq!(c0.try_send(b"hi from 0").unwrap(), 9);
        assert_eq!(c1.try_send(b"hi from 1").unwrap(), 9);
        for (i, c) in accepted.iter_mut().enumerate() {
            let mut buf = [0u8; 9];
            let mut got = 0;
            let t = Instant::now();
            while got < 9 {
                got += c.try_recv_into(&mut buf[got..]).unwrap();
                assert!(t.elapsed() < Duration::from_secs(5));
            }
            assert_eq!(&buf, format!("hi from {i}").as_bytes());
        }

        // A peer in another communicator (namespace) or with another token cannot connect.
        let other_ns = TcpEndpoint::bind(LO, 2, "tok", "other").unwrap();
        let server2 = TcpEndpoint::bind(LO, 4, "tok", "ns").unwrap();
        let a2 = server2.local_addr();
        let h = s.spawn(move || server2.accept_peers(&[2], Duration::from_millis(800)));
        let e = other_ns
            .connect_peer(4, a2, Duration::from_secs(2))
            .err()
            .expect("wrong namespace");
        assert!(!matches!(e, TransportError::Config(_)), "{e:?}");
        assert!(matches!(
            h.join().unwrap(),
            Err(TransportError::Timeout { .. })
        ));
    });
}

#[test]
fn connector_checks_the_acceptor_identity() {
    // Rank 0 expects rank 5 at this address, but rank 4 listens there.
    let wrong = TcpEndpoint::bind(LO, 4, "tok", "ns").unwrap();
    let me = TcpEndpoint::bind(LO, 0, "tok", "ns").unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| wrong.accept_peers(&[0], Duration::from_secs(5)));
        let e = me
            .connect_peer(5, wrong.local_addr(), Duration::from_secs(5))
            .err()
            .expect("identity check");
        assert!(matches!(e, TransportError::Protocol(_)), "{e:?}");
        let _ = h.join();
    });
}

#[test]
fn connect_to_nobody_times_out() {
    let me = TcpEndpoint::bind(LO, 0, "tok", "ns").unwrap();
    let free = TcpEndpoint::bind(LO, 1, "tok", "ns").unwrap().local_addr();
    let t = Instant::now();
    let e = me
        .connect_peer(1, free, Duration::from_millis(300))
        .err()
        .expect("nobody listens");
    assert!(matches!(e, TransportError::Timeout { .. }), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn long_tokens_are_rejected_cleanly() {
    let e = TcpEndpoint::bind(LO, 0, &"x".repeat(65), "ns")
        .err()
        .expect("too long");
    assert!(matches!(e, TransportError::Config(_)));
}
