//! Cost of the 40-byte operation header that makes mismatched collectives detectable: a
//! shared-memory ping-pong of an 8-byte payload, alone and preceded by a header, between two
//! threads. The difference is what every operation pays per connection and direction.

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use weftcc::transports::{shm, Connection};

const HEADER: usize = weftcc::HEADER_LEN;

fn send_all(c: &mut dyn Connection, mut data: &[u8]) {
    while !data.is_empty() {
        let n = c.try_send(data).expect("send");
        data = &data[n..];
    }
}

fn recv_exact(c: &mut dyn Connection, mut want: usize) {
    while want > 0 {
        want -= c.try_recv(want, &mut |s: &[u8]| s.len()).expect("recv");
    }
}

fn ping_pong(c: &mut Criterion) {
    let mut g = c.benchmark_group("shm_round_trip_8B");
    for with_header in [false, true] {
        let ((mut a, _), (mut b, _)) = shm::local_pair(0, 1, 1 << 20).expect("shm pair");
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let per_message = 8 + if with_header { HEADER } else { 0 };
        // The echo side spins: this measures the protocol, not the scheduler.
        let echo = std::thread::spawn(move || {
            let buf = vec![0u8; per_message];
            while !stop2.load(Ordering::Relaxed) {
                let got = b
                    .try_recv(per_message, &mut |s: &[u8]| s.len())
                    .unwrap_or(0);
                if got > 0 {
                    recv_exact(&mut b, per_message - got);
                    send_all(&mut b, &buf);
                }
            }
        });
        let msg = vec![7u8; 8];
        let header = vec![1u8; HEADER];
        let name = if with_header {
            "header+payload"
        } else {
            "payload only"
        };
        g.bench_function(name, |bench| {
            bench.iter(|| {
                if with_header {
                    send_all(&mut a, &header);
                }
                send_all(&mut a, &msg);
                recv_exact(&mut a, per_message);
            })
        });
        stop.store(true, Ordering::Relaxed);
        let _ = echo.join();
    }
    g.finish();
}

criterion_group!(benches, ping_pong);
criterion_main!(benches);
