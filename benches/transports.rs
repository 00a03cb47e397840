//! Transport limits, measured through the same `Connection` trait the engine uses:
//! * shared-memory ping-pong latency (8 B and 4 KiB round trips between two spinning threads),
//! * shared-memory small messages one way, back to back (8, 64 and 256 B, 1000 per sample):
//!   the floor per call of a pipelined small collective such as a broadcast,
//! * one-way stream rate over shared memory and over loopback TCP (64 MiB pushed in 1 MiB writes,
//!   the receiver acknowledging the end), to compare with `iperf3` and `memcpy` from
//!   `benches/baseline.sh`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;
use weftcc::transports::tcp::TcpConnection;
use weftcc::transports::{shm, Connection};

fn send_all(c: &mut dyn Connection, mut data: &[u8]) {
    while !data.is_empty() {
        let n = c.try_send(data).expect("send");
        data = &data[n..];
        if n == 0 {
            std::hint::spin_loop();
        }
    }
}

fn recv_exact(c: &mut dyn Connection, mut want: usize) {
    while want > 0 {
        let n = c.try_recv(want, &mut |s: &[u8]| s.len()).expect("recv");
        want -= n;
        if n == 0 {
            std::hint::spin_loop();
        }
    }
}

type Pair = (Box<dyn Connection>, Box<dyn Connection>);

fn shm_pair() -> Pair {
    let ((a, _), (b, _)) = shm::local_pair(0, 1, 4 << 20).expect("shm pair");
    (Box::new(a), Box::new(b))
}

fn tcp_pair() -> Pair {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let client = TcpStream::connect(addr).expect("connect");
    let (server, _) = listener.accept().expect("accept");
    let a = TcpConnection::from_socket(1, client.into()).expect("tcp a");
    let b = TcpConnection::from_socket(0, server.into()).expect("tcp b");
    (Box::new(a), Box::new(b))
}

/// Runs `serve` on `b` in a thread for the duration of `body`.
fn with_peer(
    pair: Pair,
    serve: impl FnOnce(Box<dyn Connection>, mpsc::Receiver<()>) + Send + 'static,
    body: impl FnOnce(&mut dyn Connection),
) {
    let (mut a, b) = pair;
    let (stop_tx, stop_rx) = mpsc::channel();
    let peer = std::thread::spawn(move || serve(b, stop_rx));
    body(a.as_mut());
    let _ = stop_tx.send(());
    drop(a);
    let _ = peer.join();
}

/// A peer that consumes `total` bytes at a time and answers each `total` with one byte.
fn sink(total: usize) -> impl FnOnce(Box<dyn Connection>, mpsc::Receiver<()>) + Send + 'static {
    move |mut b, stop| {
        let mut left = total;
        while stop.try_recv().is_err() {
            let Ok(n) = b.try_recv(left, &mut |s: &[u8]| s.len()) else {
                return;
            };
            left -= n;
            if left == 0 {
                send_all(b.as_mut(), &[1]);
                left = total;
            }
        }
    }
}

fn round_trips(c: &mut Criterion) {
    let mut g = c.benchmark_group("shm_round_trip");
    for size in [8usize, 4096] {
        let echo = move |mut b: Box<dyn Connection>, stop: mpsc::Receiver<()>| {
            let buf = vec![0u8; size];
            while stop.try_recv().is_err() {
                let got = b.try_recv(size, &mut |s: &[u8]| s.len()).unwrap_or(0);
                if got > 0 {
                    recv_exact(b.as_mut(), size - got);
                    send_all(b.as_mut(), &buf);
                }
            }
        };
        with_peer(shm_pair(), echo, |a| {
            let msg = vec![7u8; size];
            g.bench_function(BenchmarkId::from_parameter(size), |bench| {
                bench.iter(|| {
                    send_all(a, &msg);
                    recv_exact(a, size);
                })
            });
        });
    }
    g.finish();
}

fn streams(c: &mut Criterion) {
    const TOTAL: usize = 64 << 20;
    const WRITE: usize = 1 << 20;
    let mut g = c.benchmark_group("stream_64MiB");
    g.throughput(Throughput::Bytes(TOTAL as u64))
        .sample_size(10)
        .measurement_time(Duration::from_secs(4));
    for (name, make) in [("shm", shm_pair as fn() -> Pair), ("tcp", tcp_pair)] {
        with_peer(make(), sink(TOTAL), |a| {
            let chunk = vec![3u8; WRITE];
            g.bench_function(name, |bench| {
                bench.iter(|| {
                    for _ in 0..TOTAL / WRITE {
                        send_all(a, &chunk);
                    }
                    recv_exact(a, 1);
                })
            });
        });
    }
    g.finish();
}

/// Small messages one way, back to back, as a broadcast's root sends them: the rate the
/// transport allows a pipelined small collective (its floor per call).
fn small_streams(c: &mut Criterion) {
    const MESSAGES: usize = 1000;
    let mut g = c.benchmark_group("shm_one_way_1000");
    for size in [8usize, 64, 256] {
        with_peer(shm_pair(), sink(MESSAGES * size), |a| {
            let msg = vec![5u8; size];
            g.bench_function(BenchmarkId::from_parameter(size), |bench| {
                bench.iter(|| {
                    for _ in 0..MESSAGES {
                        send_all(a, &msg);
                    }
                    recv_exact(a, 1);
                })
            });
        });
    }
    g.finish();
}

criterion_group!(benches, round_trips, streams, small_streams);
criterion_main!(benches);
