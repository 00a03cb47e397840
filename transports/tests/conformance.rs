//! One conformance suite, run against every transport (mem, shm, tcp over IPv4 and IPv6).
//!
//! Every scenario uses two threads standing in for two ranks, and every wait is bounded: a
//! scenario that would hang fails with a deadline message instead.

use std::sync::Arc;
use std::time::{Duration, Instant};
use weftcc_transports::mux::{channel_id, Mux};
use weftcc_transports::{
    mem, net, shm, tcp, tcp_stripes, Connection, IdleWaiter, Interest, TransportError,
};

type End = (Box<dyn Connection>, Box<dyn IdleWaiter>);

/// Small ring sizes so that wrap-around happens constantly.
const SMALL_RING: usize = 64 << 10;
const DEADLINE: Duration = Duration::from_secs(30);

fn make_mem() -> Option<(End, End)> {
    let (a, b) = mem::pair(0, 1, SMALL_RING);
    let (wa, wb) = (a.waiter(), b.waiter());
    Some(((Box::new(a), Box::new(wa)), (Box::new(b), Box::new(wb))))
}

fn make_shm() -> Option<(End, End)> {
    let ((a, wa), (b, wb)) = shm::local_pair(0, 1, SMALL_RING).expect("shm pair");
    Some(((Box::new(a), Box::new(wa)), (Box::new(b), Box::new(wb))))
}

fn make_tcp(family: tcp::Family) -> Option<(End, End)> {
    match tcp::local_pair(0, 1, tcp::loopback(family)) {
        Ok((a, b)) => {
            let (wa, wb) = (a.waiter(), b.waiter());
            Some(((Box::new(a), Box::new(wa)), (Box::new(b), Box::new(wb))))
        }
        Err(e) if family == tcp::Family::Inet6 => {
            eprintln!("skipping: no IPv6 loopback ({e})");
            None
        }
        Err(e) => panic!("tcp pair: {e}"),
    }
}

fn make_tcp4() -> Option<(End, End)> {
    make_tcp(tcp::Family::Inet)
}

fn make_tcp6() -> Option<(End, End)> {
    make_tcp(tcp::Family::Inet6)
}

/// A transport's pair seen through one channel of a [`Mux`] on each side (how every
/// communicator of a family talks), so the frames must keep every promise of the trait.
fn over_mux(pair: Option<(End, End)>) -> Option<(End, End)> {
    let ((a, wa), (b, wb)) = pair?;
    let ca = Mux::new(a)
        .channel(channel_id("c"), 1, None)
        .expect("channel");
    let cb = Mux::new(b)
        .channel(channel_id("c"), 0, None)
        .expect("channel");
    Some(((Box::new(ca), wa), (Box::new(cb), wb)))
}

/// Rings written with one-sided writes ([`net::NetConnection`]) over `provider`.
fn make_net(provider: Option<Arc<dyn net::Provider>>) -> Option<(End, End)> {
    let provider = provider?;
    let (a, b) = net::stream::local_pair(provider, SMALL_RING).expect("network pair");
    Some((
        (Box::new(a), Box::new(net::NetWaiter)),
        (Box::new(b), Box::new(net::NetWaiter)),
    ))
}

fn make_net_loopback() -> Option<(End, End)> {
    make_net(Some(Arc::new(net::loopback::LoopbackProvider(
        net::loopback::Loopback::new(),
    ))))
}

/// libfabric's `tcp;ofi_rxm` provider with three endpoints per connection, writes striped.
fn make_net_ofi_tcp_striped() -> Option<(End, End)> {
    let provider: Arc<dyn net::Provider> = match net::ofi::OfiProvider::open(Some("tcp"), false) {
        Ok(p) => Arc::new(p),
        Err(e) => return missing(&format!("libfabric's tcp provider is not usable here: {e}")),
    };
    let (a, b) = net::stream::local_pair_striped(provider, SMALL_RING, 3).expect("network pair");
    Some((
        (Box::new(a), Box::new(net::NetWaiter)),
        (Box::new(b), Box::new(net::NetWaiter)),
    ))
}

/// libfabric's `tcp;ofi_rxm` provider: real RMA writes through libfabric on any machine.
fn make_net_ofi_tcp() -> Option<(End, End)> {
    match net::ofi::OfiProvider::open(Some("tcp"), false) {
        Ok(p) => make_net(Some(Arc::new(p))),
        Err(e) => missing(&format!("libfabric's tcp provider is not usable here: {e}")),
    }
}

/// A network provider's prerequisite is missing: skipped on a developer's machine, a failure
/// where `WEFT_REQUIRE_NET_TESTS=1` (CI), so that CI never passes by skipping.
fn missing(what: &str) -> Option<(End, End)> {
    if weftcc_settings::REQUIRE_NET_TESTS.flag().unwrap_or(true) {
        panic!("WEFT_REQUIRE_NET_TESTS=1 and {what}");
    }
    eprintln!("skipping: {what}");
    None
}

/// The verbs provider on the emulated RDMA device (`csrc/ibemu.c`): real queue pairs, keys
/// and completions through the shim, packets between emulated NICs over Unix sockets.
fn verbs_emulated() -> Option<Arc<dyn net::Provider>> {
    let Some(lib) = net::verbs::EMULATOR else {
        missing("the emulated RDMA device was not built (install libibverbs-dev and rebuild)");
        return None;
    };
    let mut cfg = net::verbs::VerbsConfig::from_env().expect("verbs settings");
    cfg.library = Some(lib.into());
    if !weftcc_settings::IB_TIMEOUT.is_set() {
        // 4.096 µs × 2^14 ≈ 67 ms per retry: a lost packet fails within a second.
        cfg.timeout = 14;
    }
    match net::verbs::VerbsProvider::open(&cfg) {
        Ok(p) => Some(Arc::new(p)),
        Err(e) => panic!("the emulated RDMA device does not open: {e}"),
    }
}

fn make_net_verbs_emulated() -> Option<(End, End)> {
    make_net(Some(verbs_emulated()?))
}

fn make_net_verbs_emulated_striped() -> Option<(End, End)> {
    let provider = verbs_emulated()?;
    let (a, b) = net::stream::local_pair_striped(provider, SMALL_RING, 3).expect("network pair");
    Some((
        (Box::new(a), Box::new(net::NetWaiter)),
        (Box::new(b), Box::new(net::NetWaiter)),
    ))
}

/// TCP over several sockets driven by helper threads ([`tcp_stripes`]), with stripes small
/// enough that messages cross sockets all the time.
fn make_tcp_stripes(threads: usize, per_thread: usize, stripe: usize) -> Option<(End, End)> {
    let plan = tcp_stripes::StripePlan::new(threads, per_thread)
        .and_then(|p| p.with_stripe(stripe))
        .expect("plan");
    let (a, b) = tcp::local_pair_striped(0, 1, tcp::loopback(tcp::Family::Inet), plan)
        .expect("striped tcp pair");
    assert_eq!(a.shape(), (threads * per_thread, threads));
    let (wa, wb) = (a.waiter(), b.waiter());
    Some(((Box::new(a), Box::new(wa)), (Box::new(b), Box::new(wb))))
}

/// One socket, but written and read by a helper thread.
fn make_tcp_one_helper() -> Option<(End, End)> {
    make_tcp_stripes(1, 1, 4096)
}

/// Four sockets on two helpers, stripes of 1,000 bytes (not a power of two).
fn make_tcp_four_sockets() -> Option<(End, End)> {
    make_tcp_stripes(2, 2, 1000)
}

/// Three sockets on one helper, stripes of 64 bytes (every message crosses sockets).
fn make_tcp_three_sockets_tiny_stripes() -> Option<(End, End)> {
    make_tcp_stripes(1, 3, 64)
}

fn make_mux_tcp_four_sockets() -> Option<(End, End)> {
    over_mux(make_tcp_four_sockets())
}

fn make_mux_mem() -> Option<(End, End)> {
    over_mux(make_mem())
}

fn make_mux_shm() -> Option<(End, End)> {
    over_mux(make_shm())
}

fn make_mux_tcp4() -> Option<(End, End)> {
    over_mux(make_tcp4())
}

/// xorshift64*: deterministic randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The byte at stream offset `off` of a stream seeded with `seed`.
fn pattern(seed: u64, off: u64) -> u8 {
    let x = (off ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x >> 56) as u8 ^ (off as u8)
}

fn fill(seed: u64, start: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(seed, start + i as u64);
    }
}

/// Checks that `bytes` are the pattern's bytes from stream offset `base` on.
fn assert_pattern(seed: u64, base: usize, bytes: &[u8]) {
    for (i, &x) in bytes.iter().enumerate() {
        assert_eq!(x, pattern(seed, (base + i) as u64), "byte {}", base + i);
    }
}

/// How long a scenario waits for its peer: it fails once `limit` has passed since `since`, and
/// each wait blocks for at most `each`.
#[derive(Clone, Copy)]
struct Patience {
    since: Instant,
    limit: Duration,
    each: Duration,
}

impl Patience {
    /// From now on.
    fn new(limit: Duration, each: Duration) -> Patience {
        Patience {
            since: Instant::now(),
            limit,
            each,
        }
    }

    /// After an attempt that moved nothing: fails with `stuck()` once the limit has passed, else
    /// waits on `waiter` for the peer to signal `interest`.
    fn idle(
        &self,
        waiter: &mut dyn IdleWaiter,
        interest: &[Interest],
        stuck: impl FnOnce() -> String,
    ) {
        assert!(self.since.elapsed() < self.limit, "{}", stuck());
        waiter.wait(interest, self.each).expect("wait");
    }
}

/// After a receive that got nothing: fails once `DEADLINE` has passed since `start`, else waits
/// for the peer to signal.
fn wait_for_data(end: &mut End, start: Instant, stalled: impl FnOnce() -> String) {
    let patience = Patience {
        since: start,
        limit: DEADLINE,
        each: Duration::from_millis(20),
    };
    patience.idle(&mut *end.1, &recv_interest(0), stalled);
}

fn send_interest(peer: usize) -> [Interest; 1] {
    [Interest {
        peer,
        recv: false,
        send: true,
    }]
}

fn recv_interest(peer: usize) -> [Interest; 1] {
    [Interest {
        peer,
        recv: true,
        send: false,
    }]
}

/// Sends all of `data`, waiting for space when the transport is full; `pinned` sends it as the
/// engine does (`try_send_pinned`: shared memory then lets the peer copy it out of `data`).
fn send_all(end: &mut End, data: &[u8], start: Instant, pinned: bool) {
    let peer = end.0.peer();
    let mut off = 0;
    while off < data.len() {
        let n = if pinned {
            end.0
                .try_send_pinned(&data[off..])
                .expect("try_send_pinned")
        } else {
            end.0.try_send(&data[off..]).expect("try_send")
        };
        off += n;
        if n == 0 {
            let patience = Patience {
                since: start,
                limit: DEADLINE,
                each: Duration::from_millis(100),
            };
            patience.idle(&mut *end.1, &send_interest(peer), || {
                format!("send stalled at {off}/{}", data.len())
            });
            end.0.check_peer().expect("check_peer");
        }
    }
}

/// Sends messages of the lengths `msgs`, the stream's bytes patterned from `seed`, back to back
/// from `end`, and hands `end` back (to be kept alive until the receiver is done: dropping it
/// early is its own test). `lag(i)` says whether the sender pauses before message `i`, so that
/// the receiver waits first.
fn send_messages(
    mut end: End,
    seed: u64,
    msgs: &[usize],
    start: Instant,
    pinned: bool,
    lag: impl Fn(usize) -> bool,
) -> End {
    let mut off = 0u64;
    for (i, &m) in msgs.iter().enumerate() {
        let mut buf = vec![0u8; m];
        fill(seed, off, &mut buf);
        if lag(i) {
            std::thread::sleep(Duration::from_millis(2));
        }
        send_all(&mut end, &buf, start, pinned);
        off += m as u64;
    }
    end
}

fn sizes(rng: &mut Rng, count: usize, align8: bool) -> Vec<usize> {
    (0..count)
        .map(|_| {
            let s = match rng.below(12) {
                0..=3 => 1 + rng.below(64),
                4 | 5 => 1 + rng.below(600),
                6..=8 => 1 + rng.below(64 << 10),
                9 | 10 => 1 + rng.below(512 << 10),
                _ => 1 + rng.below(3 << 20),
            } as usize;
            if align8 {
                s.div_ceil(8) * 8
            } else {
                s
            }
        })
        .collect()
}

/// Ordered delivery of many messages of random sizes, with partial consumption and
/// `try_recv_into` on the receiving side.
fn ordered_random(make: fn() -> Option<(End, End)>, pinned: bool) {
    let mut rng = Rng(0x1234_5678);
    ordered_delivery(make, pinned, &sizes(&mut rng, 60, false));
}

/// Thousands of small writes (shared memory's low-latency slots fill and drain), now and then a
/// large one that goes through the ring or by reference between them.
fn small_writes_between_large(make: fn() -> Option<(End, End)>, pinned: bool) {
    let mut rng = Rng(0x5eed);
    let msgs: Vec<usize> = (0..3000)
        .map(|i| match i % 97 {
            0 => 1 + rng.below(300 << 10) as usize,
            1..=5 => 1 + rng.below(8 << 10) as usize,
            _ => 1 + rng.below(500) as usize,
        })
        .collect();
    ordered_delivery(make, pinned, &msgs);
}

/// Sends `msgs` (their lengths) from one end and checks every byte at the other.
fn ordered_delivery(make: fn() -> Option<(End, End)>, pinned: bool, msgs: &[usize]) {
    let Some((a, mut b)) = make() else { return };
    let seed = 0x1234_5678;
    let total: usize = msgs.iter().sum();
    let start = Instant::now();
    std::thread::scope(|s| {
        // Bound, so `a` (returned) lives until this closure ends: an unbound handle drops the
        // result, and with it the sending end, as soon as the sender thread finishes.
        let _sender = s.spawn(move || send_messages(a, seed, msgs, start, pinned, |_| false));
        let mut rng = Rng(seed ^ 0xdead);
        let mut got = 0usize;
        let mut scratch = vec![0u8; 1 << 20];
        while got < total {
            let n = if rng.below(4) == 0 {
                let want = 1 + rng.below(scratch.len() as u64) as usize;
                let want = want.min(total - got);
                let n =
                    b.0.try_recv_into(&mut scratch[..want])
                        .expect("try_recv_into");
                assert_pattern(seed, got, &scratch[..n]);
                n
            } else {
                let max = 1 + rng.below(2 << 20) as usize;
                let frac = rng.below(5);
                let base = got;
                b.0.try_recv(max.min(total - got), &mut |sl: &[u8]| {
                    assert!(sl.len() <= max);
                    // Consume everything, nothing, or a random prefix.
                    let take = match frac {
                        0 => 0,
                        1 => sl.len() / 2,
                        _ => sl.len(),
                    };
                    assert_pattern(seed, base, &sl[..take]);
                    take
                })
                .expect("try_recv")
            };
            got += n;
            if n == 0 {
                wait_for_data(&mut b, start, || {
                    format!("receive stalled at {got}/{total}")
                });
            }
        }
        assert_eq!(got, total);
    });
}

/// The engine's copies: each message is read into its own destination with
/// `try_recv_into_pinned`, called with the rest of it until it is full (a network connection
/// then offers the destination to the sender for direct writes), while the sender may be ahead
/// or behind.
fn pinned_receives(make: fn() -> Option<(End, End)>, pinned: bool) {
    let Some((a, mut b)) = make() else { return };
    let mut rng = Rng(0xfeed);
    let msgs = sizes(&mut rng, 50, false);
    let seed = 0x77;
    let start = Instant::now();
    std::thread::scope(|s| {
        let msgs_ = &msgs;
        // Bound, so `a` (returned) lives until this closure ends: an unbound handle drops the
        // result, and with it the sending end, as soon as the sender thread finishes.
        // Now and then the sender lags, so that the receiver waits first.
        let lag = |i| i % 7 == 3;
        let _sender = s.spawn(move || send_messages(a, seed, msgs_, start, pinned, lag));
        let mut off = 0usize;
        for &m in &msgs {
            let mut dst = vec![0u8; m];
            let mut filled = 0;
            while filled < m {
                // SAFETY: `dst` is asked for again, to its end, before anything else.
                let n = unsafe { b.0.try_recv_into_pinned(&mut dst[filled..]) }
                    .expect("try_recv_into_pinned");
                filled += n;
                if n == 0 {
                    wait_for_data(&mut b, start, || {
                        format!("pinned receive stalled at {filled}/{m} of message at {off}")
                    });
                }
            }
            assert_pattern(seed, off, &dst);
            off += m;
        }
    });
}

/// The engine's reductions: every message holds elements of 1, 2, 4 or 8 bytes, padded to a
/// multiple of 8 by a separate write, and the reader takes whole elements only, leaving a partial
/// one in the transport until the rest of it can be lent with it. That must never stall.
fn element_wise_reader(make: fn() -> Option<(End, End)>, pinned: bool) {
    let Some((mut a, mut b)) = make() else { return };
    let seed = 0xe1e;
    let mut rng = Rng(seed);
    // (element size, message bytes) with lengths up to a few ring-fulls.
    let msgs: Vec<(usize, usize)> = (0..400)
        .map(|_| {
            let esize = 1usize << rng.below(4);
            let count = match rng.below(6) {
                0..=2 => rng.below(80),
                3 | 4 => rng.below(20_000),
                _ => rng.below(700_000),
            } as usize;
            (esize, count * esize)
        })
        .collect();
    let total: usize = msgs.iter().map(|&(_, len)| len.div_ceil(8) * 8).sum();
    let start = Instant::now();
    std::thread::scope(|s| {
        let msgs = &msgs;
        // Bound, so `a` (returned) lives until this closure ends: an unbound handle drops the
        // result, and with it the sending end, as soon as the sender thread finishes.
        let _sender = s.spawn(move || {
            let mut off = 0u64;
            for &(_, len) in msgs {
                let padded = len.div_ceil(8) * 8;
                let mut buf = vec![0u8; padded];
                fill(seed, off, &mut buf);
                send_all(&mut a, &buf[..len], start, pinned);
                send_all(&mut a, &buf[len..], start, false);
                off += padded as u64;
            }
            a
        });
        let mut got = 0usize;
        for &(esize, len) in msgs {
            let padded = len.div_ceil(8) * 8;
            let mut at = 0usize;
            while at < padded {
                // Data: whole elements; padding: any bytes.
                let (want, unit) = if at < len {
                    (len - at, esize)
                } else {
                    (padded - at, 1)
                };
                let base = got;
                let n =
                    b.0.try_recv(want, &mut |sl: &[u8]| {
                        let take = sl.len().min(want) / unit * unit;
                        assert_pattern(seed, base, &sl[..take]);
                        take
                    })
                    .expect("try_recv");
                at += n;
                got += n;
                if n == 0 {
                    wait_for_data(&mut b, start, || {
                        format!(
                            "element-wise reader stalled at {got}/{total} ({esize}-byte elements)"
                        )
                    });
                }
            }
        }
        assert_eq!(got, total);
    });
}

/// Messages whose lengths are multiples of 8 are lent 8-aligned when consumed in multiples of 8.
fn aligned_lending(make: fn() -> Option<(End, End)>, pinned: bool) {
    let Some((a, mut b)) = make() else { return };
    let seed = 77;
    let mut rng = Rng(seed);
    let msgs = sizes(&mut rng, 40, true);
    let total: usize = msgs.iter().sum();
    let start = Instant::now();
    std::thread::scope(|s| {
        let msgs = &msgs;
        // Bound, so `a` (returned) lives until this closure ends: an unbound handle drops the
        // result, and with it the sending end, as soon as the sender thread finishes.
        let _sender = s.spawn(move || send_messages(a, seed, msgs, start, pinned, |_| false));
        let mut got = 0usize;
        let mut rng = Rng(99);
        while got < total {
            let max = (8 + rng.below(1 << 20) as usize) & !7;
            let base = got;
            let n =
                b.0.try_recv(max.min(total - got), &mut |sl: &[u8]| {
                    let take = sl.len() & !7;
                    if take > 0 {
                        assert_eq!(
                            sl.as_ptr() as usize % 8,
                            0,
                            "lent slice not 8-aligned at {base}"
                        );
                    }
                    assert_pattern(seed, base, &sl[..take]);
                    take
                })
                .expect("try_recv");
            got += n;
            if n == 0 {
                wait_for_data(&mut b, start, || {
                    format!("receive stalled at {got}/{total}")
                });
            }
        }
    });
}

/// Both ends send and receive at the same time, more than any buffer holds.
/// `try_send_whole` takes all of a message or none of it: small messages written whole while
/// nobody reads, until the transport refuses one (at once where it keeps the default), then the
/// refused message through `try_send`, arrive in order with nothing of the refusal between them.
fn whole_writes(make: fn() -> Option<(End, End)>) {
    const MSG: usize = 48;
    let Some((mut a, mut b)) = make() else { return };
    let seed = 5;
    let start = Instant::now();
    let mut msg = [0u8; MSG];
    let mut off = 0usize;
    loop {
        fill(seed, off as u64, &mut msg);
        if off >= 8 << 20 || !a.0.try_send_whole(&msg).expect("try_send_whole") {
            break;
        }
        off += MSG;
    }
    let total = off + MSG;
    std::thread::scope(|s| {
        let _sender = s.spawn(move || {
            send_all(&mut a, &msg, start, false);
            a
        });
        let mut got = 0usize;
        while got < total {
            let base = got;
            let n =
                b.0.try_recv(total - got, &mut |sl: &[u8]| {
                    assert_pattern(seed, base, sl);
                    sl.len()
                })
                .expect("try_recv");
            got += n;
            if n == 0 {
                wait_for_data(&mut b, start, || {
                    format!("receive stalled at {got}/{total}")
                });
            }
        }
    });
}

fn bidirectional(make: fn() -> Option<(End, End)>) {
    let Some((a, b)) = make() else { return };
    const BYTES: usize = 12 << 20;
    let patience = Patience::new(DEADLINE, Duration::from_millis(100));
    let run = |mut end: End, my_seed: u64, peer_seed: u64| {
        let peer = end.0.peer();
        let mut out = vec![0u8; BYTES];
        fill(my_seed, 0, &mut out);
        let (mut sent, mut got) = (0usize, 0usize);
        while sent < BYTES || got < BYTES {
            let mut progress = false;
            if sent < BYTES {
                let n = end
                    .0
                    .try_send(&out[sent..(sent + 300_000).min(BYTES)])
                    .expect("send");
                sent += n;
                progress |= n > 0;
            }
            if got < BYTES {
                let base = got;
                let n = end
                    .0
                    .try_recv(BYTES - got, &mut |sl: &[u8]| {
                        for (i, &x) in sl.iter().enumerate() {
                            assert_eq!(x, pattern(peer_seed, (base + i) as u64));
                        }
                        sl.len()
                    })
                    .expect("recv");
                got += n;
                progress |= n > 0;
            }
            if !progress {
                let i = [Interest {
                    peer,
                    recv: got < BYTES,
                    send: sent < BYTES,
                }];
                patience.idle(&mut *end.1, &i, || {
                    format!("bidirectional stalled: sent {sent} got {got}")
                });
            }
        }
        end
    };
    std::thread::scope(|s| {
        let h = s.spawn(move || run(a, 1, 2));
        let b = run(b, 2, 1);
        let a = h.join().expect("thread");
        drop((a, b));
    });
}

/// A long wait returns promptly when data arrives, and when space is freed.
fn wakes_on_data_and_space(make: fn() -> Option<(End, End)>) {
    let Some((mut a, mut b)) = make() else { return };
    // Data: b waits (up to 10 s per call) while a sends after 200 ms.
    let data_wait = Patience::new(Duration::from_secs(5), Duration::from_secs(10));
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(a.0.try_send(b"x").expect("send"), 1);
        });
        let mut got = 0;
        while got == 0 {
            got = b.0.try_recv(1, &mut |sl: &[u8]| sl.len()).expect("recv");
            if got == 0 {
                data_wait.idle(&mut *b.1, &recv_interest(0), || {
                    "waiter missed the data wake-up".into()
                });
            }
        }
    });
    assert!(data_wait.since.elapsed() < data_wait.limit);

    // Space: fill a's direction, then b drains after 200 ms while a waits for room.
    let chunk = vec![7u8; 256 << 10];
    let fill_start = Instant::now();
    let mut zeros = 0;
    while zeros < 2 {
        if a.0.try_send(&chunk).expect("send") == 0 {
            // TCP may need a moment for the kernel to move data into the peer's buffer, and a
            // transport with helper threads for them to hand buffers back: full is when two
            // waits in a row bring no room.
            zeros += 1;
            a.1.wait(&send_interest(1), Duration::from_millis(20))
                .expect("wait");
        } else {
            zeros = 0;
        }
        assert!(
            fill_start.elapsed() < Duration::from_secs(10),
            "could not fill the connection"
        );
    }
    let space_wait = Patience::new(Duration::from_secs(5), Duration::from_secs(10));
    let t1 = space_wait.since;
    let room_seen = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            // Drains until a saw room: a transport may bring the rest of the buffered bytes
            // in only as the reader takes them.
            while !room_seen.load(std::sync::atomic::Ordering::Acquire) {
                let n =
                    b.0.try_recv(usize::MAX, &mut |sl: &[u8]| sl.len())
                        .expect("drain");
                if n == 0 {
                    b.1.wait(&recv_interest(0), Duration::from_millis(10))
                        .expect("wait");
                }
                assert!(t1.elapsed() < Duration::from_secs(10), "drain never ended");
            }
        });
        loop {
            let n = a.0.try_send(b"y").expect("send");
            if n > 0 {
                room_seen.store(true, std::sync::atomic::Ordering::Release);
                break;
            }
            space_wait.idle(&mut *a.1, &send_interest(1), || {
                "waiter missed the space wake-up".into()
            });
        }
    });
    assert!(space_wait.since.elapsed() < space_wait.limit);
}

/// Ping-pong where every wait may last 5 s: a single lost wake-up would show as a slow round.
fn no_lost_wakeup(make: fn() -> Option<(End, End)>) {
    let Some((a, b)) = make() else { return };
    const ROUNDS: u64 = 3000;
    let pong = |mut end: End, first: bool| {
        let peer = end.0.peer();
        let mut worst = Duration::ZERO;
        for i in 0..ROUNDS {
            let msg = i.to_le_bytes();
            if first {
                assert_eq!(end.0.try_send(&msg).expect("send"), 8);
            }
            let round = Patience::new(Duration::from_secs(4), Duration::from_secs(5));
            let t = round.since;
            let mut buf = [0u8; 8];
            let mut got = 0;
            while got < 8 {
                let n = end.0.try_recv_into(&mut buf[got..]).expect("recv");
                got += n;
                if n == 0 {
                    round.idle(&mut *end.1, &recv_interest(peer), || {
                        format!("lost wake-up in round {i}")
                    });
                }
            }
            assert_eq!(u64::from_le_bytes(buf), i);
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "round {i} took {:?}: lost wake-up",
                t.elapsed()
            );
            worst = worst.max(t.elapsed());
            if !first {
                assert_eq!(end.0.try_send(&msg).expect("send"), 8);
            }
        }
        (end, worst)
    };
    std::thread::scope(|s| {
        let h = s.spawn(move || pong(a, true));
        let (_b, worst_b) = pong(b, false);
        let (_a, worst_a) = h.join().expect("thread");
        assert!(
            worst_a.max(worst_b) < Duration::from_secs(3),
            "worst round {:?}",
            worst_a.max(worst_b)
        );
    });
}

/// A dropped peer is reported as `PeerLost` once its buffered bytes were read, never earlier.
fn peer_dropped(make: fn() -> Option<(End, End)>) {
    let Some((mut a, mut b)) = make() else { return };
    let mut data = vec![0u8; 40_000];
    fill(5, 0, &mut data);
    send_all(&mut a, &data, Instant::now(), false);
    drop(a);
    let patience = Patience::new(Duration::from_secs(5), Duration::from_millis(50));
    // Buffered bytes must still be readable.
    b.0.check_peer()
        .expect("peer must not count as lost while bytes are buffered");
    let mut got = Vec::new();
    let lost = loop {
        match b.0.try_recv(usize::MAX, &mut |sl: &[u8]| {
            got.extend_from_slice(sl);
            sl.len()
        }) {
            Ok(0) => patience.idle(&mut *b.1, &recv_interest(0), || {
                "no PeerLost after drop".into()
            }),
            Ok(_) => {}
            Err(e) => break e,
        }
    };
    assert_eq!(
        got, data,
        "buffered bytes must be delivered before PeerLost"
    );
    assert!(
        matches!(lost, TransportError::PeerLost { peer: 0, .. }),
        "{lost:?}"
    );
    assert!(matches!(
        b.0.check_peer(),
        Err(TransportError::PeerLost { .. })
    ));
    // Sending to the dropped peer fails too (TCP may accept a first write before the reset).
    let t = Instant::now();
    loop {
        match b.0.try_send(&data) {
            Err(TransportError::PeerLost { .. }) => break,
            Err(e) => panic!("unexpected {e:?}"),
            Ok(_) => {
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "send to dropped peer never failed"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// A pinned write whose receiver goes away half-way ends in `PeerLost`, never a hang.
fn pinned_write_to_dropped_peer(make: fn() -> Option<(End, End)>) {
    let Some((mut a, mut b)) = make() else { return };
    // More than any transport buffers (TCP: both socket buffers and the staging).
    let data = vec![5u8; 48 << 20];
    let mut off = a.0.try_send_pinned(&data).expect("first pinned write");
    // The receiver takes a little, then disappears.
    let mut got = 0;
    let start = Instant::now();
    while got < 1000 {
        let mut buf = [0u8; 100];
        got += b.0.try_recv_into(&mut buf).expect("recv");
        off += a.0.try_send_pinned(&data[off..]).expect("pinned write");
        assert!(start.elapsed() < DEADLINE, "nothing arrived");
    }
    drop(b);
    loop {
        match a.0.try_send_pinned(&data[off..]) {
            Ok(n) => off += n,
            Err(TransportError::PeerLost { .. }) => return,
            Err(e) => panic!("expected PeerLost, got {e}"),
        }
        assert!(off < data.len(), "a dropped peer accepted everything");
        assert!(
            start.elapsed() < DEADLINE,
            "no PeerLost after the peer dropped"
        );
        let _ = a.1.wait(&send_interest(1), Duration::from_millis(10));
        if let Err(e) = a.0.check_peer() {
            assert!(matches!(e, TransportError::PeerLost { .. }), "{e}");
            return;
        }
    }
}

macro_rules! suites {
    ($($name:ident: $make:expr,)*) => {$(
        mod $name {
            use super::*;
            #[test]
            fn ordered_random_sizes() {
                ordered_random($make, false);
            }
            #[test]
            fn element_wise_reader_never_stalls() {
                element_wise_reader($make, false);
            }
            #[test]
            fn element_wise_reader_never_stalls_pinned() {
                element_wise_reader($make, true);
            }
            #[test]
            fn whole_writes_are_all_or_nothing() {
                whole_writes($make);
            }
            #[test]
            fn small_writes_between_large_ones() {
                small_writes_between_large($make, false);
            }
            #[test]
            fn small_writes_between_large_ones_pinned() {
                small_writes_between_large($make, true);
            }
            #[test]
            fn ordered_random_sizes_pinned() {
                ordered_random($make, true);
            }
            #[test]
            fn aligned_lending_for_8_byte_messages() {
                aligned_lending($make, false);
            }
            #[test]
            fn aligned_lending_for_8_byte_messages_pinned() {
                aligned_lending($make, true);
            }
            #[test]
            fn pinned_receives_of_plain_sends() {
                pinned_receives($make, false);
            }
            #[test]
            fn pinned_receives_of_pinned_sends() {
                pinned_receives($make, true);
            }
            #[test]
            fn pinned_write_to_dropped_peer_fails() {
                pinned_write_to_dropped_peer($make);
            }
            #[test]
            fn bidirectional_traffic() {
                bidirectional($make);
            }
            #[test]
            fn waiter_wakes_on_data_and_space() {
                wakes_on_data_and_space($make);
            }
            #[test]
            fn ping_pong_never_loses_a_wakeup() {
                no_lost_wakeup($make);
            }
            #[test]
            fn dropped_peer_is_lost_after_draining() {
                peer_dropped($make);
            }
        }
    )*};
}

suites! {
    mem_transport: make_mem,
    shm_transport: make_shm,
    tcp4_transport: make_tcp4,
    tcp6_transport: make_tcp6,
    tcp_one_socket_one_helper: make_tcp_one_helper,
    tcp_four_sockets_two_helpers: make_tcp_four_sockets,
    tcp_three_sockets_tiny_stripes: make_tcp_three_sockets_tiny_stripes,
    mux_over_mem: make_mux_mem,
    mux_over_tcp_four_sockets: make_mux_tcp_four_sockets,
    mux_over_shm: make_mux_shm,
    mux_over_tcp4: make_mux_tcp4,
    net_over_loopback: make_net_loopback,
    net_over_ofi_tcp: make_net_ofi_tcp,
    net_over_ofi_tcp_striped: make_net_ofi_tcp_striped,
    net_over_verbs_emulated: make_net_verbs_emulated,
    net_over_verbs_emulated_striped: make_net_verbs_emulated_striped,
}

// ---------------------------------------------------------------------------------------------
// The emulated RDMA device's fault knobs: the emulator reads them when a process first opens
// it, so each runs conformance cases in a child process of this binary.
// ---------------------------------------------------------------------------------------------

/// Runs the conformance cases `cases` (exact names) of this binary in a child process with
/// `env`; panics with the child's output unless every one passed. Returns how many ran.
fn run_cases_with(cases: &[&str], env: &[(&str, &str)]) -> usize {
    if net::verbs::EMULATOR.is_none() {
        missing("the emulated RDMA device was not built (install libibverbs-dev and rebuild)");
        return 0;
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("exe"));
    cmd.args(cases)
        .args(["--exact", "--test-threads=1"])
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null());
    let started = Instant::now();
    let out = cmd.output().expect("run the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let passed = text.matches(" ... ok").count();
    assert!(
        out.status.success() && passed == cases.len(),
        "{cases:?} with {env:?}: {passed} of {} passed ({:?}):\n{text}",
        cases.len(),
        out.status
    );
    println!(
        "{} cases with {env:?} passed in {:.1} s",
        passed,
        started.elapsed().as_secs_f64()
    );
    passed
}

/// The set-up race: of each connection's two queue pairs one reaches RTR 300 ms late. A write
/// sent to it before then is dropped and resent only after the ACK timeout; with no retries
/// the write fails. Both sides must wait until both queue pairs are ready before writing.
#[test]
fn verbs_emulated_no_write_before_both_queue_pairs_are_ready() {
    run_cases_with(
        &[
            "net_over_verbs_emulated::bidirectional_traffic",
            "net_over_verbs_emulated_striped::ordered_random_sizes",
        ],
        &[
            ("WEFT_IBEMU_RTR_DELAY_MS", "300"),
            ("WEFT_IB_RETRY_CNT", "0"),
        ],
    );
}

/// Relaxed placement: writes of more than 64 bytes land 2 ms after they arrive, the small ones
/// behind them at once. A head that follows its data on the same queue pair would be seen
/// before the data: every byte read must still be the byte sent.
#[test]
fn verbs_emulated_flag_never_seen_before_its_data() {
    run_cases_with(
        &[
            "net_over_verbs_emulated::ordered_random_sizes",
            "net_over_verbs_emulated::bidirectional_traffic",
            "net_over_verbs_emulated::small_writes_between_large_ones",
            "net_over_verbs_emulated::pinned_receives_of_plain_sends",
            "net_over_verbs_emulated_striped::ordered_random_sizes",
        ],
        &[("WEFT_IBEMU_DELAY_WRITES_US", "2000")],
    );
}

/// A device that takes 8 bytes inline: queue pairs are made without inline data and the
/// control words (16 bytes) go from registered slots.
#[test]
fn verbs_emulated_small_inline_limit() {
    run_cases_with(
        &[
            "net_over_verbs_emulated::ordered_random_sizes",
            "net_over_verbs_emulated::pinned_receives_of_pinned_sends",
            "net_over_verbs_emulated_striped::bidirectional_traffic",
        ],
        &[("WEFT_IBEMU_MAX_INLINE", "8")],
    );
}

/// Completions that become visible late change nothing but time.
#[test]
fn verbs_emulated_late_completions() {
    run_cases_with(
        &[
            "net_over_verbs_emulated::ordered_random_sizes_pinned",
            "net_over_verbs_emulated_striped::bidirectional_traffic",
        ],
        &[("WEFT_IBEMU_CQE_DELAY_US", "500")],
    );
}

// ---------------------------------------------------------------------------------------------
// A peer process killed with SIGKILL.
// ---------------------------------------------------------------------------------------------

const CHILD_ENV: &str = "WEFT_TEST_SHM_CHILD_TOKEN";

fn socket_name(token: &str) -> std::os::unix::net::SocketAddr {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(format!("weft-test-{token}").as_bytes())
        .expect("abstract name")
}

fn child_role(token: &str) {
    // Rank 1 in a child process: connect to rank 0, say hello, then wait to be killed.
    let ep = shm::ShmEndpoint::create(token, "kill", 1, SMALL_RING).expect("child endpoint");
    let stream = std::os::unix::net::UnixStream::connect_addr(&socket_name(token))
        .expect("child connects to the parent's socket");
    let mut conn = ep
        .connect_over(0, &stream, Duration::from_secs(10))
        .expect("child connect");
    assert_eq!(conn.try_send(b"childok!").expect("child send"), 8);
    // Never exit on our own within the test's lifetime (the parent kills us); give up after 60 s
    // so an orphan cannot linger.
    std::thread::sleep(Duration::from_secs(60));
    std::process::exit(3);
}

#[test]
fn shm_child_killed_is_peer_lost() {
    if let Ok(token) = std::env::var(CHILD_ENV) {
        child_role(&token);
        return;
    }
    let token = format!("kill{}", std::process::id());
    let seg = shm::ShmEndpoint::create(&token, "kill", 0, SMALL_RING).expect("endpoint");
    let listener =
        std::os::unix::net::UnixListener::bind_addr(&socket_name(&token)).expect("listen");
    let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--exact",
            "shm_child_killed_is_peer_lost",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &token)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn child");
    let hello = Patience::new(Duration::from_secs(20), Duration::from_millis(100));
    let (stream, _) = listener.accept().expect("child dials");
    let mut conn = match seg.connect_over(1, &stream, Duration::from_secs(15)) {
        Ok(c) => c,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("parent connect: {e}");
        }
    };
    let mut waiter = seg.waiter();
    let mut buf = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        let n = conn.try_recv_into(&mut buf[got..]).expect("recv hello");
        got += n;
        if n == 0 {
            hello.idle(&mut waiter, &recv_interest(1), || {
                "no hello from child".into()
            });
        }
    }
    assert_eq!(&buf, b"childok!");
    conn.check_peer().expect("child is alive");

    child.kill().expect("SIGKILL"); // not reaped yet: the child is a zombie, which must count as dead
    let killed = Patience::new(Duration::from_secs(2), Duration::from_millis(20));
    let err = loop {
        match conn.check_peer() {
            Err(e) => break e,
            Ok(()) => killed.idle(&mut waiter, &recv_interest(1), || {
                "killed peer not detected within 2 s".into()
            }),
        }
    };
    assert!(
        matches!(err, TransportError::PeerLost { peer: 1, .. }),
        "{err:?}"
    );
    assert!(matches!(
        conn.try_send(b"z"),
        Err(TransportError::PeerLost { .. })
    ));
    let _ = child.wait();
    drop(seg);
    // Nothing was ever left under a name, the killed child's memory included.
    let left = weftcc_testkit::shm_names(&format!("weft-{token}-"));
    assert!(left.is_empty(), "{left:?}");
}

/// GPUDirect RDMA over libfabric: a provider without `FI_HMEM` (`tcp;ofi_rxm`) refuses device
/// memory, so a ring over it stages (the registration's refusal names the provider).
#[test]
fn libfabric_without_fi_hmem_refuses_device_memory() {
    use weftcc_transports::net::device::MemfdDevice;
    use weftcc_transports::net::regcache::RegistrationCache;
    let provider: Arc<dyn net::Provider> = match net::ofi::OfiProvider::open(Some("tcp"), false) {
        Ok(p) => Arc::new(p),
        Err(e) => {
            missing(&format!("libfabric's tcp provider is not usable here: {e}"));
            return;
        }
    };
    let dev = MemfdDevice::new(4096, false).unwrap();
    let refused = RegistrationCache::of(&provider)
        .lease_device(&dev)
        .err()
        .expect("refused");
    match &refused.dmabuf {
        net::NetError::Unavailable {
            provider: "OFI",
            detail,
        } => {
            assert!(detail.contains("no FI_HMEM"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert!(refused.peer_memory.is_none());
}
