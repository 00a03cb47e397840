//! The bootstrap store: operations across threads, timeouts, hostile clients, shutdown.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use weftcc_store::{StoreClient, StoreError, StoreServer, MAX_FRAME};

const TOKEN: &str = "store-test-token";
const T: Duration = Duration::from_secs(10);

fn server() -> (StoreServer, String) {
    let s = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN).expect("start");
    let addr = s.local_addr().to_string();
    (s, addr)
}

fn client(addr: &str) -> StoreClient {
    StoreClient::connect(addr, TOKEN, T).expect("connect")
}

fn hello(token: &str) -> Vec<u8> {
    let mut v = b"WFST".to_vec();
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&(token.len() as u16).to_le_bytes());
    v.extend_from_slice(token.as_bytes());
    v
}

/// Reads until the server closes the connection; returns what it sent. Fails after 10 s.
fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return out,
            Err(e) => panic!("server did not close the connection: {e}"),
        }
    }
}

/// A new client, checked to work (`tag` set and read back).
fn working_client(addr: &str, tag: &str) -> StoreClient {
    let mut c = client(addr);
    still_works(&mut c, tag);
    c
}

fn still_works(c: &mut StoreClient, tag: &str) {
    c.set(tag, tag.as_bytes())
        .expect("set after hostile client");
    assert_eq!(
        c.get(tag, T).expect("get after hostile client"),
        tag.as_bytes()
    );
}

#[test]
fn operations_across_threads() {
    let (_s, addr) = server();
    std::thread::scope(|sc| {
        for t in 0..4 {
            let addr = addr.clone();
            sc.spawn(move || {
                let mut c = client(&addr);
                for _ in 0..50 {
                    c.add("counter", 1).expect("add");
                }
                c.set(&format!("done/{t}"), &[t as u8]).expect("set");
                // Waits for a key another thread sets later.
                let v = c.get(&format!("done/{}", (t + 1) % 4), T).expect("get");
                assert_eq!(v, [((t + 1) % 4) as u8]);
                c.wait(&["done/0", "done/1", "done/2", "done/3"], T)
                    .expect("wait");
            });
        }
    });
    let mut c = client(&addr);
    assert_eq!(c.add("counter", 0).unwrap(), 200);
    assert_eq!(c.get("counter", T).unwrap(), b"200");
    assert_eq!(c.add("counter", -201).unwrap(), -1);
    assert!(c.check("done/0").unwrap());
    assert!(c.delete("done/0").unwrap());
    assert!(!c.check("done/0").unwrap());
    assert!(!c.delete("done/0").unwrap());
    c.set("text", b"abc").unwrap();
    assert!(matches!(c.add("text", 1), Err(StoreError::Rejected(_))));
    // Empty values and large values round-trip.
    c.set("empty", b"").unwrap();
    assert_eq!(c.get("empty", T).unwrap(), b"");
    let big = vec![0xabu8; 4 << 20];
    c.set("big", &big).unwrap();
    assert_eq!(c.get("big", T).unwrap(), big);
    // The connection is still usable after all that.
    still_works(&mut c, "after");
}

#[test]
fn server_side_wait_is_not_polling_and_wakes() {
    let (_s, addr) = server();
    let mut waiter = client(&addr);
    let t = Instant::now();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            client(&addr).set("later", b"v").unwrap();
        });
        assert_eq!(waiter.get("later", T).unwrap(), b"v");
    });
    assert!(t.elapsed() >= Duration::from_millis(150) && t.elapsed() < Duration::from_secs(5));
}

#[test]
fn get_and_wait_time_out() {
    let (_s, addr) = server();
    let mut c = client(&addr);
    let t = Instant::now();
    let e = c.get("missing", Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    assert!(t.elapsed() >= Duration::from_millis(250) && t.elapsed() < Duration::from_secs(5));
    c.set("a", b"1").unwrap();
    let e = c.wait(&["a", "b"], Duration::from_millis(200)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    // A timeout leaves the connection usable.
    still_works(&mut c, "after-timeout");
}

#[test]
fn connect_retries_until_the_server_is_up_and_resolves_names() {
    // Find a free port, then start the server on it a little later.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        StoreServer::start(SocketAddr::from(([127, 0, 0, 1], port)), TOKEN).expect("late start")
    });
    let mut c =
        StoreClient::connect(&format!("localhost:{port}"), TOKEN, T).expect("connect with retry");
    let _server = h.join().unwrap();
    still_works(&mut c, "late");
    // Wrong format and unreachable servers fail within the timeout.
    assert!(StoreClient::connect("no-port-here", TOKEN, Duration::from_millis(300)).is_err());
    let t = Instant::now();
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    assert!(matches!(
        StoreClient::connect(
            &format!("127.0.0.1:{free}"),
            TOKEN,
            Duration::from_millis(400)
        ),
        Err(StoreError::Timeout { .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn ipv6_store() {
    let Ok(s) = StoreServer::start("[::1]:0".parse().unwrap(), TOKEN) else {
        eprintln!("skipping: no IPv6 loopback");
        return;
    };
    let addr = format!("[::1]:{}", s.local_addr().port());
    working_client(&addr, "v6");
}

#[test]
fn hostile_clients_are_refused_and_others_keep_working() {
    let (_s, addr) = server();
    let mut good = working_client(&addr, "before");

    // Wrong token through the real client: refused at once, not retried until the timeout.
    let t = Instant::now();
    let e = StoreClient::connect(&addr, "wrong", T)
        .err()
        .expect("wrong token must fail");
    assert!(matches!(e, StoreError::Refused { .. }), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(3));

    // A silent connection must not stall anyone (kept open throughout).
    let _silent = TcpStream::connect(&addr).unwrap();

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("wrong token", hello("nope")),
        ("wrong magic", {
            let mut h = hello(TOKEN);
            h[0] = b'X';
            h
        }),
        ("wrong version", {
            let mut h = hello(TOKEN);
            h[4] = 9;
            h
        }),
        (
            "garbage",
            (0..200u32).map(|i| (i * 37 % 251) as u8).collect(),
        ),
        ("huge token length", {
            let mut h = b"WFST".to_vec();
            h.extend_from_slice(&1u16.to_le_bytes());
            h.extend_from_slice(&u16::MAX.to_le_bytes());
            h
        }),
        ("oversized frame", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&0xFFFF_FFFFu32.to_le_bytes());
            h
        }),
        ("frame just over the limit", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&((MAX_FRAME + 1) as u32).to_le_bytes());
            h
        }),
        ("zero-length frame", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&0u32.to_le_bytes());
            h
        }),
        ("unknown opcode", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&1u32.to_le_bytes());
            h.push(200);
            h
        }),
        ("key length beyond frame", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&5u32.to_le_bytes());
            h.push(1); // SET
            h.extend_from_slice(&u32::MAX.to_le_bytes());
            h
        }),
        ("wait with absurd key count", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&13u32.to_le_bytes());
            h.push(3); // WAIT
            h.extend_from_slice(&0u64.to_le_bytes());
            h.extend_from_slice(&u32::MAX.to_le_bytes());
            h
        }),
    ];
    for (what, bytes) in cases {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&bytes).unwrap();
        let answer = read_until_closed(&mut s);
        // At most the refusal byte (wrong token) or the handshake OK byte comes back; never data.
        assert!(answer.len() <= 1, "{what}: server answered {answer:?}");
        still_works(&mut good, what);
    }

    // Truncated handshake and truncated frames: the client goes away mid-message.
    for (what, bytes) in [
        ("truncated handshake", hello(TOKEN)[..5].to_vec()),
        ("truncated frame", {
            let mut h = hello(TOKEN);
            h.extend_from_slice(&100u32.to_le_bytes());
            h.extend_from_slice(&[1, 2, 3]);
            h
        }),
    ] {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&bytes).unwrap();
        drop(s);
        still_works(&mut good, what);
    }

    // A truncated frame from a client that stays connected is dropped by the server's I/O timeout
    // (checked without waiting for it: other clients are served meanwhile).
    let mut stalled = TcpStream::connect(&addr).unwrap();
    let mut h = hello(TOKEN);
    h.extend_from_slice(&100u32.to_le_bytes());
    h.extend_from_slice(&[1, 2, 3]);
    stalled.write_all(&h).unwrap();
    working_client(&addr, "while-stalled");
    still_works(&mut good, "end");
}

#[test]
fn shutdown_answers_waiting_clients_with_store_closed() {
    let (s, addr) = server();
    let mut idle = working_client(&addr, "x");
    let t = Instant::now();
    std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let mut c = client(&addr);
            c.get("never", Duration::from_secs(30))
        });
        let h2 = sc.spawn(|| {
            let mut c = client(&addr);
            c.wait(&["never1", "never2"], Duration::from_secs(30))
        });
        std::thread::sleep(Duration::from_millis(300));
        s.shutdown();
        let r = h.join().unwrap();
        assert!(matches!(r, Err(StoreError::Closed)), "{r:?}");
        let r = h2.join().unwrap();
        assert!(matches!(r, Err(StoreError::Closed)), "{r:?}");
    });
    assert!(t.elapsed() < Duration::from_secs(10));
    // An idle client learns it on its next call (and never hangs).
    let t = Instant::now();
    let e = idle.set("y", b"1").unwrap_err();
    assert!(
        matches!(e, StoreError::Closed | StoreError::Lost { .. }),
        "{e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(15));
    drop(s);
}

/// A value set just before the server shuts down still reaches a client that was waiting for
/// it (a rank that publishes an abort and then exits must not lose it to the store closing).
#[test]
fn value_set_just_before_shutdown_reaches_a_waiting_client() {
    for round in 0..30 {
        let (s, addr) = server();
        let mut setter = client(&addr);
        std::thread::scope(|sc| {
            let waiter = sc.spawn(|| {
                let mut c = client(&addr);
                let v = c.get("alarm", Duration::from_secs(30));
                let w = c.wait(&["alarm"], Duration::from_secs(30));
                (v, w)
            });
            std::thread::sleep(Duration::from_millis(20));
            setter.set("alarm", b"abort 0").expect("set");
            s.shutdown();
            let (v, w) = waiter.join().unwrap();
            assert_eq!(v.expect("get"), b"abort 0", "round {round}");
            // The wait, sent after the shutdown, may find the store closed or the key there.
            assert!(
                matches!(
                    w,
                    Ok(()) | Err(StoreError::Closed | StoreError::Lost { .. })
                ),
                "round {round}: {w:?}"
            );
        });
    }
}

#[test]
fn get_all_answers_in_key_order_once_every_key_is_set() {
    let (_s, addr) = server();
    let mut c = client(&addr);
    let keys: Vec<String> = ["b", "a", "c"].iter().map(|k| k.to_string()).collect();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut setter = client(&addr);
            for k in ["a", "b", "c"] {
                std::thread::sleep(Duration::from_millis(20));
                setter.set(k, k.repeat(3).as_bytes()).unwrap();
            }
        });
        let values = c.get_all(&keys, T).expect("get_all");
        assert_eq!(values, [b"bbb".to_vec(), b"aaa".to_vec(), b"ccc".to_vec()]);
    });
    let missing = vec!["never".to_string()];
    assert!(matches!(
        c.get_all(&missing, Duration::from_millis(100)),
        Err(StoreError::Timeout { .. })
    ));
}

/// An answer larger than one frame: the server refuses to build it (TOO_LARGE) and the client asks
/// again in halves, so the caller still gets every value, in order. Without the server's check
/// the client would reject an oversized frame; without the halving it would get StoreTooLarge.
#[test]
fn get_all_larger_than_a_frame_is_answered_in_parts() {
    let (_s, addr) = server();
    let mut c = client(&addr);
    let big = MAX_FRAME / 3 + 1024;
    let keys: Vec<String> = (0..4).map(|i| format!("big/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.set(k, &vec![i as u8 + 1; big]).expect("set");
    }
    let values = c.get_all(&keys, T).expect("get_all over the frame limit");
    assert_eq!(values.len(), 4);
    for (i, v) in values.iter().enumerate() {
        assert!(
            v.len() == big && v.iter().all(|&b| b == i as u8 + 1),
            "value {i}"
        );
    }
    // The connection is still usable afterwards.
    c.set("small", b"x").unwrap();
    assert_eq!(
        c.get_all(&["small".to_string()], T).unwrap(),
        [b"x".to_vec()]
    );
}

/// 4,096 clients (a rank each) publish a record and fetch everyone's: what a 4,096-rank job's
/// bootstrap asks of rank 0's store, with one request per rank for the records.
#[test]
fn four_thousand_clients_all_gather_their_records() {
    const CLIENTS: usize = 4096;
    // Each client's socket and the server's end of it, in this one process.
    if let Err(e) = raise_open_files(2 * CLIENTS as u64 + 64) {
        eprintln!("skipping: {e}");
        return;
    }
    let (_s, addr) = server();
    let keys: Vec<String> = (0..CLIENTS).map(|r| format!("j/info/{r}")).collect();
    let wrong = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for r in 0..CLIENTS {
            let (addr, keys, wrong) = (&addr, &keys, &wrong);
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn_scoped(sc, move || {
                    let mut c = client(addr);
                    c.set(&keys[r], format!("record of rank {r}").as_bytes())
                        .unwrap();
                    let all = c.get_all(keys, Duration::from_secs(120)).unwrap();
                    let bad = all
                        .iter()
                        .enumerate()
                        .filter(|(p, v)| v.as_slice() != format!("record of rank {p}").as_bytes())
                        .count();
                    wrong.fetch_add(bad, std::sync::atomic::Ordering::Relaxed);
                })
                .expect("spawn a client thread");
        }
    });
    assert_eq!(wrong.into_inner(), 0);
}

#[test]
fn a_named_session_is_alive_while_it_polls_and_closed_once_its_client_goes() {
    let (_s, addr) = server();
    let mut watcher = client(&addr);
    watcher.name_session("job/rank/1", b"pid 42").expect("name");
    let mut quiet = client(&addr);
    quiet.name_session("job/rank/0", b"pid 41").expect("name");
    let mut other = client(&addr);
    other.name_session("elsewhere/rank/0", b"x").expect("name");
    let mut status = client(&addr);

    // rank 1 polls, rank 0 stays silent.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(600) {
        let _ = watcher.check("job/anything").expect("poll");
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = status.sessions("job/").expect("sessions");
    assert_eq!(
        s.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(),
        ["job/rank/0", "job/rank/1"],
        "listed by name, only under the prefix"
    );
    assert!(s.iter().all(|s| s.open));
    assert_eq!(s[0].value, b"pid 41");
    assert!(s[0].idle >= Duration::from_millis(550), "{:?}", s[0]);
    assert!(s[1].idle < Duration::from_millis(300), "{:?}", s[1]);

    // A client that goes (a process that dies) leaves a closed session behind.
    drop(watcher);
    let deadline = Instant::now() + T;
    loop {
        let s = status.sessions("job/rank/1").expect("sessions");
        assert_eq!(s.len(), 1);
        if !s[0].open {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the closed connection was not seen"
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    // Renaming moves the connection's one name; the old one reads as closed.
    quiet.name_session("job/rank/2", b"pid 43").expect("rename");
    let s = status.sessions("job/").expect("sessions");
    let open: Vec<(&str, bool)> = s.iter().map(|s| (s.key.as_str(), s.open)).collect();
    assert_eq!(
        open,
        [
            ("job/rank/0", false),
            ("job/rank/1", false),
            ("job/rank/2", true)
        ]
    );
    assert!(status.sessions("nothing/").expect("sessions").is_empty());
}

/// Raises this process's soft open-files limit to `want` when the hard limit allows it.
fn raise_open_files(want: u64) -> Result<(), String> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| e.to_string())?;
    if want <= soft {
        return Ok(());
    }
    if want > hard {
        return Err(format!("needs {want} open files, the hard limit is {hard}"));
    }
    setrlimit(Resource::RLIMIT_NOFILE, want, hard).map_err(|e| e.to_string())
}
