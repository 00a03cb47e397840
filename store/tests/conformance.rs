//! One suite for every store: each behaviour is a function taking a way to make clients of one
//! store (by job token), run against the built-in store (a test each) and against a real etcd
//! started here (one etcd for all behaviours, each in a job of its own). Without `etcd` on PATH
//! the etcd cases skip, saying so, except where `WEFT_REQUIRE_ETCD=1` (CI).

use std::time::{Duration, Instant};
use weftcc_store::{StoreClient, StoreError, StoreServer};
use weftcc_testkit::etcd::Etcd;

const T: Duration = Duration::from_secs(10);

/// Makes a client of the store under test for the job `token`.
type Maker<'a> = &'a (dyn Fn(&str) -> StoreClient + Sync);

fn set_get_check_delete(make: Maker) {
    let mut c = make("job");
    assert!(!c.check("a").unwrap());
    c.set("a", b"one").unwrap();
    assert!(c.check("a").unwrap());
    assert_eq!(c.get("a", T).unwrap(), b"one");
    c.set("a", b"two").unwrap();
    assert_eq!(c.get("a", T).unwrap(), b"two");
    assert!(c.delete("a").unwrap());
    assert!(!c.delete("a").unwrap());
    assert!(!c.check("a").unwrap());
    // Empty, binary and large values round-trip; keys may hold any text.
    c.set("empty", b"").unwrap();
    assert_eq!(c.get("empty", T).unwrap(), b"");
    let binary: Vec<u8> = (0..=255u8).collect();
    c.set("c/peer/7 ünï", &binary).unwrap();
    assert_eq!(c.get("c/peer/7 ünï", T).unwrap(), binary);
    let big = vec![0xabu8; 1 << 20];
    c.set("big", &big).unwrap();
    assert_eq!(c.get("big", T).unwrap(), big);
}

fn counters_are_atomic_across_clients(make: Maker) {
    std::thread::scope(|sc| {
        for _ in 0..4 {
            sc.spawn(|| {
                let mut c = make("job");
                for _ in 0..25 {
                    c.add("counter", 1).expect("add");
                }
            });
        }
    });
    let mut c = make("job");
    assert_eq!(c.add("counter", 0).unwrap(), 100);
    assert_eq!(c.get("counter", T).unwrap(), b"100");
    assert_eq!(c.add("counter", -101).unwrap(), -1);
    assert_eq!(c.add("fresh", 5).unwrap(), 5);
    c.set("text", b"abc").unwrap();
    assert!(matches!(c.add("text", 1), Err(StoreError::Rejected(_))));
    assert_eq!(c.get("text", T).unwrap(), b"abc");
}

fn the_first_set_if_absent_wins_for_everyone(make: Maker) {
    let answers: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let racers: Vec<_> = (0..4u8)
            .map(|i| {
                sc.spawn(move || {
                    let mut c = make("job");
                    c.set_if_absent("decision", &[b'a' + i])
                        .expect("set_if_absent")
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    // Every racer reads the same winner, which is one of the values offered.
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");
    assert!((b'a'..b'e').contains(&answers[0][0]) && answers[0].len() == 1);
    let mut c = make("job");
    assert_eq!(c.get("decision", T).unwrap(), answers[0]);
    assert_eq!(c.set_if_absent("decision", b"late").unwrap(), answers[0]);
    // Deleted, the key takes a new first value; an empty value is a value.
    assert!(c.delete("decision").unwrap());
    assert_eq!(c.set_if_absent("decision", b"").unwrap(), b"");
    assert_eq!(c.set_if_absent("decision", b"x").unwrap(), b"");
}

fn get_waits_for_a_later_set(make: Maker) {
    let mut waiter = make("job");
    let start = Instant::now();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            make("job").set("later", b"v").unwrap();
        });
        assert_eq!(waiter.get("later", T).unwrap(), b"v");
    });
    let took = start.elapsed();
    // Woken soon after the set (etcd: within its polling back-off).
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_secs(2),
        "{took:?}"
    );
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            let mut c = make("job");
            c.set("w1", b"1").unwrap();
            c.set("w2", b"2").unwrap();
        });
        waiter.wait(&["later", "w1", "w2"], T).unwrap();
    });
}

fn waits_time_out_and_leave_the_client_usable(make: Maker) {
    let mut c = make("job");
    let start = Instant::now();
    let e = c.get("missing", Duration::from_millis(300)).unwrap_err();
    let StoreError::Timeout { what, after } = &e else {
        panic!("{e:?}")
    };
    assert!(what.contains("\"missing\""), "{what}");
    assert_eq!(*after, Duration::from_millis(300));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "{took:?}"
    );
    c.set("a", b"1").unwrap();
    let e = c.wait(&["a", "b"], Duration::from_millis(200)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    let keys = vec!["a".to_string(), "b".to_string()];
    let e = c.get_all(&keys, Duration::from_millis(200)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    // A zero wait answers at once.
    assert_eq!(c.get("a", Duration::ZERO).unwrap(), b"1");
    assert!(matches!(
        c.get("b", Duration::ZERO),
        Err(StoreError::Timeout { .. })
    ));
    c.set("after", b"x").unwrap();
    assert_eq!(c.get("after", T).unwrap(), b"x");
}

fn get_all_answers_in_order_and_waits(make: Maker) {
    let mut c = make("job");
    // More keys than etcd takes in one transaction: the front end splits them.
    let keys: Vec<String> = (0..300).map(|i| format!("peer/{i}")).collect();
    for (i, k) in keys.iter().enumerate().skip(1) {
        c.set(k, format!("v{i}").as_bytes()).unwrap();
    }
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            make("job").set("peer/0", b"v0").unwrap();
        });
        let values = c.get_all(&keys, T).unwrap();
        assert_eq!(values.len(), keys.len());
        for (i, v) in values.iter().enumerate() {
            assert_eq!(v, format!("v{i}").as_bytes());
        }
    });
    assert!(c.get_all(&[], T).unwrap().is_empty());
}

fn get_all_unless_ends_when_its_key_is_set(make: Maker) {
    let mut c = make("job");
    let keys = vec!["a".to_string(), "b".to_string()];
    c.set("a", b"1").unwrap();
    c.set("b", b"2").unwrap();
    assert_eq!(c.get_all_unless(&keys, "lost", T).unwrap(), [b"1", b"2"]);
    let missing = vec!["a".to_string(), "never".to_string()];
    let start = Instant::now();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            make("job").set("lost", b"3").unwrap();
        });
        let e = c.get_all_unless(&missing, "lost", T).unwrap_err();
        let StoreError::Interrupted { key, value } = &e else {
            panic!("{e:?}")
        };
        assert_eq!((key.as_str(), value.as_slice()), ("lost", &b"3"[..]));
    });
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // Already set: at once, even when the keys are there too.
    let e = c.get_all_unless(&keys, "lost", T).unwrap_err();
    assert!(matches!(e, StoreError::Interrupted { .. }), "{e:?}");
}

fn barrier_releases_everyone(make: Maker) {
    let start = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..3 {
            sc.spawn(|| make("job").barrier("b", 3, T).expect("barrier"));
        }
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let e = make("job")
        .barrier("never", 2, Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
}

fn sessions_are_listed_open_then_closed(make: Maker) {
    let mut reader = make("job");
    assert!(reader.sessions("j/rank/").unwrap().is_empty());
    let mut a = make("job");
    a.name_session("j/rank/0", b"pid 1").unwrap();
    let mut b = make("job");
    b.name_session("j/rank/1", b"pid 2").unwrap();
    let mut other = make("job");
    other.name_session("k/rank/0", b"elsewhere").unwrap();
    let s = reader.sessions("j/rank/").unwrap();
    let keys: Vec<_> = s.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys, ["j/rank/0", "j/rank/1"]);
    assert!(s.iter().all(|s| s.open && s.idle < Duration::from_secs(3)));
    assert_eq!(s[0].value, b"pid 1");
    // Naming it again updates what it says.
    a.name_session("j/rank/0", b"left").unwrap();
    assert_eq!(reader.sessions("j/rank/0").unwrap()[0].value, b"left");
    // A client that goes reads as closed, and stays listed.
    drop(a);
    let start = Instant::now();
    loop {
        let s = reader.sessions("j/rank/").unwrap();
        assert_eq!(s.len(), 2);
        if !s[0].open {
            assert!(s[1].open);
            assert_eq!(s[0].value, b"left");
            break;
        }
        assert!(
            start.elapsed() < T,
            "the dropped client still reads as open"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Sessions survive a client's other requests.
    b.set("x", b"1").unwrap();
    assert!(reader.sessions("j/rank/1").unwrap()[0].open);
}

fn jobs_do_not_meet(make: Maker) {
    let mut a = make("job-a");
    let mut b = make("job-b");
    a.set("k", b"a").unwrap();
    assert!(!b.check("k").unwrap());
    b.set("k", b"b").unwrap();
    assert_eq!(a.get("k", T).unwrap(), b"a");
    a.name_session("s", b"a").unwrap();
    assert!(b.sessions("").unwrap().is_empty());
}

/// One behaviour of the suite.
type Case = fn(Maker);

/// The suite, by name.
const SUITE: &[(&str, Case)] = &[
    ("set_get_check_delete", set_get_check_delete),
    (
        "counters_are_atomic_across_clients",
        counters_are_atomic_across_clients,
    ),
    ("get_waits_for_a_later_set", get_waits_for_a_later_set),
    (
        "waits_time_out_and_leave_the_client_usable",
        waits_time_out_and_leave_the_client_usable,
    ),
    (
        "get_all_answers_in_order_and_waits",
        get_all_answers_in_order_and_waits,
    ),
    (
        "get_all_unless_ends_when_its_key_is_set",
        get_all_unless_ends_when_its_key_is_set,
    ),
    ("barrier_releases_everyone", barrier_releases_everyone),
    (
        "sessions_are_listed_open_then_closed",
        sessions_are_listed_open_then_closed,
    ),
    ("jobs_do_not_meet", jobs_do_not_meet),
    (
        "the_first_set_if_absent_wins_for_everyone",
        the_first_set_if_absent_wins_for_everyone,
    ),
];

/// Every behaviour against a fresh built-in store (one server per job token).
#[test]
fn builtin_store_conforms() {
    for (name, case) in SUITE {
        let servers: std::sync::Mutex<Vec<(String, StoreServer)>> = Default::default();
        let make = |token: &str| {
            let addr = {
                let mut s = servers.lock().unwrap();
                if let Some((_, srv)) = s.iter().find(|(t, _)| t == token) {
                    srv.local_addr().to_string()
                } else {
                    let srv =
                        StoreServer::start("127.0.0.1:0".parse().unwrap(), token).expect("start");
                    let addr = srv.local_addr().to_string();
                    s.push((token.to_string(), srv));
                    addr
                }
            };
            let c = StoreClient::connect(&addr, token, T).expect("connect");
            assert!(c.runs_session_hooks());
            c
        };
        eprintln!("built-in store: {name}");
        case(&make);
    }
}

/// Every behaviour against one etcd, each in jobs of its own (the token prefix keeps them apart).
#[test]
fn etcd_store_conforms() {
    let Some(etcd) = Etcd::start("etcd_store_conforms") else {
        return;
    };
    let addr = etcd.store_addr();
    for (i, (name, case)) in SUITE.iter().enumerate() {
        let make = |token: &str| {
            let c =
                StoreClient::connect(&addr, &format!("{name}-{i}-{token}"), T).expect("connect");
            assert!(!c.runs_session_hooks());
            c
        };
        eprintln!("etcd store: {name}");
        case(&make);
    }
}

/// A session whose client dies without a word (no revoke: its lease is left to expire) reads as
/// closed within the lease's lifetime.
#[test]
fn etcd_session_of_a_silent_client_closes_within_the_lease() {
    let Some(etcd) = Etcd::start("etcd_session_of_a_silent_client_closes_within_the_lease") else {
        return;
    };
    let addr = etcd.store_addr();
    // A child process that names a session, then is killed.
    let exe = std::env::current_exe().expect("test binary");
    if std::env::var_os("WEFT_TEST_ETCD_CHILD").is_some() {
        return;
    }
    let mut reader = StoreClient::connect(&addr, "silent", T).expect("connect");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "etcd_child_names_a_session_and_waits",
            "--nocapture",
        ])
        .env("WEFT_TEST_ETCD_CHILD", &addr)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("child");
    let start = Instant::now();
    while reader.sessions("rank/").unwrap().is_empty() {
        assert!(start.elapsed() < T, "the child never named its session");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(reader.sessions("rank/").unwrap()[0].open);
    child.kill().expect("kill");
    child.wait().expect("wait");
    let killed = Instant::now();
    while reader.sessions("rank/").unwrap()[0].open {
        assert!(
            killed.elapsed() < weftcc_store::ETCD_LEASE_TTL + Duration::from_secs(3),
            "the dead client's session still reads as open"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = killed.elapsed();
    eprintln!("a killed client's session closed after {took:?}");
}

/// The child of the test above (does nothing unless started by it).
#[test]
fn etcd_child_names_a_session_and_waits() {
    let Some(addr) = std::env::var_os("WEFT_TEST_ETCD_CHILD") else {
        return;
    };
    let mut c = StoreClient::connect(&addr.to_string_lossy(), "silent", T).expect("connect");
    c.name_session("rank/0", b"child").expect("name");
    std::thread::sleep(Duration::from_secs(30));
}

/// Endpoints that do not answer are skipped over; when none answers, the error is typed, names
/// them, and comes within the timeout.
#[test]
fn etcd_fails_over_and_names_its_endpoints() {
    let Some(mut etcd) = Etcd::start("etcd_fails_over_and_names_its_endpoints") else {
        return;
    };
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let both = format!("etcd://{dead},{}", etcd.endpoint);
    let mut c = StoreClient::connect(&both, "failover", T).expect("connect past a dead endpoint");
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"v");
    assert!(c.describe().contains(&dead) && c.describe().contains(&etcd.endpoint));

    // The cluster goes: every request fails within its margin, naming the endpoints.
    c.set_default_timeout(Duration::from_secs(1));
    etcd.kill();
    let start = Instant::now();
    let e = c.set("k", b"w").unwrap_err();
    let StoreError::Etcd { endpoint, .. } = &e else {
        panic!("{e:?}")
    };
    assert!(endpoint.contains(&etcd.endpoint), "{e}");
    let e = c.get("k", Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, StoreError::Etcd { .. }), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    let start = Instant::now();
    let e = StoreClient::connect(&both, "failover", Duration::from_millis(500))
        .err()
        .expect("no etcd to connect to");
    let StoreError::Timeout { what, .. } = &e else {
        panic!("{e:?}")
    };
    assert!(what.contains("etcd at"), "{what}");
    assert!(start.elapsed() < Duration::from_secs(5));
    for bad in ["etcd://", "etcd://nohost", "etcd://h:1/x"] {
        assert!(matches!(
            StoreClient::connect(bad, "t", T),
            Err(StoreError::Config(_))
        ));
    }
}
