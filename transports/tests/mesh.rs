//! Establishing meshes over a store (shared memory, TCP, both) and exchanging data on every pair.

use std::time::{Duration, Instant};
use weftcc_store::{StoreClient, StoreServer};
use weftcc_transports::mesh::{ConnectMode, Mesh, MeshConfig};
use weftcc_transports::{shm, Interest};

const N: usize = 4;

fn byte(from: usize, to: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (from * 7 + to * 13)) as u8
}

/// Every rank sends `bytes` to every other rank and checks what it receives, polling all
/// connections and sleeping in the mesh's waiter when nothing moves.
fn all_to_all(mesh: &mut Mesh, bytes: usize) {
    let me = mesh.rank();
    let n = mesh.nranks();
    let out: Vec<Vec<u8>> = (0..n)
        .map(|p| (0..bytes).map(|i| byte(me, p, i)).collect())
        .collect();
    let mut sent = vec![0usize; n];
    let mut got: Vec<Vec<u8>> = vec![Vec::new(); n];
    let (conns, waiter) = mesh.parts();
    let start = Instant::now();
    loop {
        let mut progress = false;
        let mut interest = Vec::new();
        for p in (0..n).filter(|&p| p != me) {
            let c = conns[p].as_mut().expect("connection to every peer");
            if sent[p] < bytes {
                let k = c.try_send(&out[p][sent[p]..]).expect("send");
                sent[p] += k;
                progress |= k > 0;
            }
            if got[p].len() < bytes {
                let want = bytes - got[p].len();
                let g = &mut got[p];
                let k = c
                    .try_recv(want, &mut |s: &[u8]| {
                        g.extend_from_slice(s);
                        s.len()
                    })
                    .expect("recv");
                progress |= k > 0;
            }
            if sent[p] < bytes || got[p].len() < bytes {
                interest.push(Interest {
                    peer: p,
                    recv: got[p].len() < bytes,
                    send: sent[p] < bytes,
                });
            }
        }
        if interest.is_empty() {
            break;
        }
        if !progress {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "rank {me} stalled: {interest:?}"
            );
            waiter
                .wait(&interest, Duration::from_millis(100))
                .expect("wait");
            for i in &interest {
                conns[i.peer]
                    .as_mut()
                    .unwrap()
                    .check_peer()
                    .expect("peer alive");
            }
        }
    }
    for p in (0..n).filter(|&p| p != me) {
        assert!(
            got[p].iter().enumerate().all(|(i, &b)| b == byte(p, me, i)),
            "data from {p} to {me}"
        );
    }
}

/// Runs `N` ranks in threads; `host` gives each rank's host id; `share` frames every connection
/// for channels of splits ([`MeshConfig::share_splits`]).
fn run_mesh(
    share: bool,
    shm_disable: bool,
    ifname: Option<&str>,
    host: fn(usize) -> String,
    expect: fn(usize, usize) -> &'static str,
) -> String {
    let token = weftcc_transports::random_token().unwrap();
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token).unwrap();
    let addr = server.local_addr().to_string();
    std::thread::scope(|s| {
        for rank in 0..N {
            let (addr, token) = (addr.clone(), token.clone());
            let ifname = ifname.map(str::to_string);
            s.spawn(move || {
                let mut store =
                    StoreClient::connect(&addr, &token, Duration::from_secs(10)).unwrap();
                let cfg = MeshConfig {
                    rank,
                    nranks: N,
                    host_id: host(rank),
                    shm_disable,
                    socket_ifname: ifname,
                    token: token.clone(),
                    namespace: "world".into(),
                    timeout: Duration::from_secs(20),
                    buffsize: Some(256 << 10),
                    shm_ll_max: shm::LL_MAX,
                    connect: ConnectMode::OnDemand,
                    share_splits: share,
                    net: weftcc_transports::net::NetChoice::socket(),
                    stripes: weftcc_transports::tcp_stripes::StripePlan::SINGLE,
                };
                let mut mesh = Mesh::establish(&mut store, &cfg).expect("establish");
                assert_eq!((mesh.rank(), mesh.nranks()), (rank, N));
                assert_eq!(
                    mesh.connected_peers(),
                    0,
                    "nothing connected before it is needed"
                );
                // Ring neighbours first, in opposite orders on even and odd ranks, so that pairs
                // dial each other at once; then everyone.
                let mut ring = vec![(rank + 1) % N, (rank + N - 1) % N];
                if rank % 2 == 1 {
                    ring.reverse();
                }
                let wait = Duration::from_secs(20);
                mesh.connect(&ring, &mut store, wait, &|| false)
                    .expect("connect ring neighbours");
                assert_eq!(mesh.connected_peers(), 2);
                let everyone: Vec<usize> = (0..N).rev().collect();
                mesh.connect(&everyone, &mut store, wait, &|| false)
                    .expect("connect everyone");
                assert_eq!(mesh.connected_peers(), N - 1);
                assert_eq!(mesh.transport_name(rank), None);
                for p in (0..N).filter(|&p| p != rank) {
                    assert_eq!(
                        mesh.transport_name(p),
                        Some(expect(rank, p)),
                        "rank {rank} -> {p}"
                    );
                }
                all_to_all(&mut mesh, 3 << 20);
                // A second communicator (a "split") over the same store, in its own namespace.
                let cfg2 = MeshConfig {
                    namespace: "world/split1".into(),
                    connect: ConnectMode::Eager,
                    ..cfg
                };
                let mut mesh2 = Mesh::establish(&mut store, &cfg2).expect("establish split");
                assert_eq!(mesh2.connected_peers(), N - 1, "eager connects everyone");
                all_to_all(&mut mesh2, 100_000);
                // Keep the meshes until every rank is done with its traffic.
                store
                    .barrier("test/done", N, Duration::from_secs(20))
                    .unwrap();
            });
        }
    });
    token
}

fn same_host(_: usize) -> String {
    "testhost".into()
}

#[test]
fn four_ranks_over_shared_memory() {
    let token = run_mesh(false, false, None, same_host, |_, _| "shm");
    // Objects are unlinked as they are made: nothing of the job in /dev/shm.
    let left = weftcc_testkit::shm_names(&format!("weft-{token}"));
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn four_ranks_over_tcp() {
    let _ = run_mesh(false, true, Some("=lo"), same_host, |_, _| "tcp");
}

#[test]
fn four_ranks_over_framed_connections() {
    let _ = run_mesh(true, false, None, same_host, |_, _| "shm");
    let _ = run_mesh(true, true, Some("=lo"), same_host, |_, _| "tcp");
}

#[test]
fn four_ranks_mixed_shm_and_tcp() {
    // Ranks 0,1 on "host A", ranks 2,3 on "host B".
    let _ = run_mesh(
        true,
        false,
        Some("=lo"),
        |r| if r < 2 { "A".into() } else { "B".into() },
        |a, b| if (a < 2) == (b < 2) { "shm" } else { "tcp" },
    );
}

#[test]
fn in_memory_mesh() {
    let meshes = Mesh::in_memory(N, 64 << 10);
    let done = std::sync::Barrier::new(N);
    std::thread::scope(|s| {
        for mut m in meshes {
            let done = &done;
            s.spawn(move || {
                for p in (0..N).filter(|&p| p != m.rank()) {
                    assert_eq!(m.transport_name(p), Some("mem"));
                }
                all_to_all(&mut m, 1 << 20);
                done.wait();
            });
        }
    });
}

#[test]
fn establish_times_out_when_a_rank_is_missing() {
    let token = weftcc_transports::random_token().unwrap();
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), &token).unwrap();
    let mut store = StoreClient::connect(
        &server.local_addr().to_string(),
        &token,
        Duration::from_secs(5),
    )
    .unwrap();
    let cfg = MeshConfig {
        rank: 0,
        nranks: 2,
        host_id: "h".into(),
        shm_disable: false,
        socket_ifname: Some("=lo".into()),
        token: token.clone(),
        namespace: "lonely".into(),
        timeout: Duration::from_millis(500),
        buffsize: Some(64 << 10),
        shm_ll_max: 0,
        connect: ConnectMode::OnDemand,
        share_splits: false,
        net: weftcc_transports::net::NetChoice::socket(),
        stripes: weftcc_transports::tcp_stripes::StripePlan::SINGLE,
    };
    let t = Instant::now();
    let e = Mesh::establish(&mut store, &cfg)
        .err()
        .expect("must time out");
    // Named: rank 1 never wrote its host record.
    assert!(
        matches!(
            &e,
            weftcc_transports::TransportError::NotJoined { missing, more: 0, nranks: 2, .. }
                if missing == &[1]
        ),
        "{e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let bad = MeshConfig { rank: 2, ..cfg };
    assert!(Mesh::establish(&mut store, &bad).is_err());
}
