//! The verbs provider's queue pairs on the emulated RDMA device (`csrc/ibemu.c`), below the
//! stream protocol: what the device enforces reaches the provider as the completion a device
//! gives. (The stream protocol over it runs in `conformance.rs`.)
//!
//! Every test needs the emulator, which is built where libibverbs-dev is installed: without it
//! each test skips saying so, and fails where `WEFT_REQUIRE_NET_TESTS=1` (CI).

use std::sync::Arc;
use std::time::{Duration, Instant};
use weftcc_transports::net::verbs::{VerbsConfig, VerbsProvider, EMULATOR};
use weftcc_transports::net::{Completion, Endpoint, Memory, NetError, Posted, Provider, Region};

/// `IBV_WC_*` statuses the tests expect.
const REM_ACCESS_ERR: i64 = 10;
const RETRY_EXC_ERR: i64 = 12;
const WR_FLUSH_ERR: i64 = 5;

/// The provider on the emulated device with ACK timeout exponent `timeout` and `retries`.
fn provider(timeout: u8, retries: u8) -> Option<VerbsProvider> {
    weftcc_transports::net::verbs::emulated_for_tests(timeout, retries)
}

fn region(p: &dyn Provider, len: usize, fill: u8) -> Region {
    let m = Arc::new(Memory::new(len).expect("memory"));
    // SAFETY: nothing else uses the fresh allocation yet.
    unsafe { m.write(0, &vec![fill; len]) };
    p.register(m).expect("register")
}

/// Two endpoints of `p`; `connect_b` says whether the second is connected back (else it stays
/// in INIT: not ready to receive).
fn pair(p: &dyn Provider, connect_b: bool) -> (Box<dyn Endpoint>, Box<dyn Endpoint>) {
    let (mut a, mut b) = (p.endpoint().expect("a"), p.endpoint().expect("b"));
    let (aa, ba) = (a.address().expect("address"), b.address().expect("address"));
    a.connect(&ba).expect("connect a");
    if connect_b {
        b.connect(&aa).expect("connect b");
    }
    (a, b)
}

/// Polls `ep` until a completion arrives (at most 10 s).
fn completion(ep: &mut dyn Endpoint) -> Completion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = Vec::new();
    loop {
        ep.poll(&mut done).expect("poll");
        if let Some(c) = done.pop() {
            assert!(done.is_empty(), "one completion at a time here: {done:?}");
            return c;
        }
        assert!(Instant::now() < deadline, "no completion within 10 s");
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn status(c: &Completion) -> i64 {
    match &c.result {
        Err(NetError::WorkFailed { status, .. }) => *status,
        other => panic!("expected a failed work request, got {other:?}"),
    }
}

fn bytes(r: &Region, offset: usize, len: usize) -> Vec<u8> {
    // SAFETY: the test's writes into the region completed (or failed) before this reads it.
    unsafe { r.memory.read(offset, len, <[u8]>::to_vec) }
}

#[test]
fn a_write_lands_in_the_peers_region_and_completes() {
    let Some(p) = provider(14, 7) else { return };
    let (src, dst) = (region(&p, 8192, 7), region(&p, 8192, 0));
    let (mut a, _b) = pair(&p, true);
    let target = dst.remote().at(1000);
    assert_eq!(
        a.write(src.range(10, 5000), target, 1).unwrap(),
        Posted::Yes
    );
    let c = completion(a.as_mut());
    assert_eq!((c.wr_id, c.result), (1, Ok(())));
    assert_eq!(bytes(&dst, 1000, 5000), vec![7; 5000]);
    assert_eq!(bytes(&dst, 999, 1), vec![0], "nothing before the target");
    assert_eq!(bytes(&dst, 6000, 1), vec![0], "nothing after it");
    // Inline: the bytes are copied at post time.
    assert_eq!(a.inline_max(), 64, "the emulator's default inline limit");
    a.write_inline(&[9; 16], dst.remote().at(0), 2).unwrap();
    assert_eq!(completion(a.as_mut()).result, Ok(()));
    assert_eq!(bytes(&dst, 0, 16), vec![9; 16]);
}

#[test]
fn a_wrong_key_is_a_remote_access_error_and_both_queue_pairs_fail() {
    let Some(p) = provider(14, 7) else { return };
    let (src, dst) = (region(&p, 4096, 1), region(&p, 4096, 0));
    let (mut a, mut b) = pair(&p, true);
    let mut bad = dst.remote();
    bad.key ^= 0x5a5a;
    a.write(src.range(0, 64), bad.at(0), 1).unwrap();
    let c = completion(a.as_mut());
    assert_eq!((c.wr_id, status(&c)), (1, REM_ACCESS_ERR), "{c:?}");
    // The requester's queue pair is in ERR: later work is flushed.
    a.write(src.range(0, 64), dst.remote().at(0), 2).unwrap();
    assert_eq!(status(&completion(a.as_mut())), WR_FLUSH_ERR);
    // So is the responder's.
    b.write(src.range(0, 64), dst.remote().at(0), 3).unwrap();
    assert_eq!(status(&completion(b.as_mut())), WR_FLUSH_ERR);
    assert_eq!(bytes(&dst, 0, 64), vec![0; 64], "nothing was placed");
}

#[test]
fn bytes_outside_the_registered_region_are_a_remote_access_error() {
    let Some(p) = provider(14, 7) else { return };
    let (src, dst) = (region(&p, 8192, 1), region(&p, 4096, 0));
    let (mut a, _b) = pair(&p, true);
    // A peer that claims a longer region than it registered: the provider's own bounds check
    // passes, the device's does not.
    let mut longer = dst.remote();
    longer.len = 8192;
    a.write(src.range(0, 128), longer.at(4096 - 64), 1).unwrap();
    let c = completion(a.as_mut());
    assert_eq!(status(&c), REM_ACCESS_ERR, "{c:?}");
    assert_eq!(
        bytes(&dst, 4096 - 64, 64),
        vec![0; 64],
        "nothing was placed"
    );
}

#[test]
fn a_peer_not_ready_to_receive_drops_the_write_until_the_retries_are_spent() {
    // 4.096 µs × 2^10 ≈ 4.2 ms per ACK timeout, two resends: the write fails after three.
    let Some(p) = provider(10, 2) else { return };
    let (src, dst) = (region(&p, 4096, 1), region(&p, 4096, 0));
    let (mut a, _b) = pair(&p, false);
    let t = Instant::now();
    a.write(src.range(0, 64), dst.remote().at(0), 1).unwrap();
    let c = completion(a.as_mut());
    let took = t.elapsed();
    assert_eq!(status(&c), RETRY_EXC_ERR, "{c:?}");
    assert!(
        took >= Duration::from_micros(3 * 4096 * 1024 / 1000),
        "failed after {took:?}: before three ACK timeouts"
    );
    assert_eq!(bytes(&dst, 0, 64), vec![0; 64], "nothing was placed");
}

#[test]
fn a_write_dropped_before_the_peer_is_ready_is_resent_after_the_ack_timeout() {
    // 4.096 µs × 2^14 ≈ 67 ms per ACK timeout, seven resends.
    let Some(p) = provider(14, 7) else { return };
    let (src, dst) = (region(&p, 4096, 3), region(&p, 4096, 0));
    let (mut a, mut b) = (p.endpoint().unwrap(), p.endpoint().unwrap());
    let (aa, ba) = (a.address().unwrap(), b.address().unwrap());
    a.connect(&ba).unwrap();
    let t = Instant::now();
    a.write(src.range(0, 256), dst.remote().at(0), 1).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    b.connect(&aa).unwrap();
    let c = completion(a.as_mut());
    let took = t.elapsed();
    assert_eq!(c.result, Ok(()));
    assert!(
        took >= Duration::from_millis(60),
        "completed after {took:?}: the first send was not dropped"
    );
    assert_eq!(bytes(&dst, 0, 256), vec![3; 256]);
}

#[test]
fn a_full_send_queue_says_full_and_takes_work_again_once_polled() {
    let Some(p) = provider(14, 7) else { return };
    let (src, dst) = (region(&p, 4096, 1), region(&p, 4096, 0));
    let (mut a, _b) = pair(&p, true);
    let mut posted = 0u64;
    while a
        .write(src.range(0, 8), dst.remote().at(0), posted)
        .unwrap()
        == Posted::Yes
    {
        posted += 1;
        assert!(posted <= 100_000, "the send queue never filled");
    }
    assert_eq!(
        posted as usize,
        a.max_outstanding(),
        "full at the queue's depth"
    );
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.len() < posted as usize {
        a.poll(&mut done).unwrap();
        assert!(
            Instant::now() < deadline,
            "{} of {posted} completed",
            done.len()
        );
    }
    assert!(done.iter().all(|c| c.result.is_ok()));
    let ids: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    assert_eq!(
        ids,
        (0..posted).collect::<Vec<_>>(),
        "completions in posting order"
    );
    assert_eq!(
        a.write(src.range(0, 8), dst.remote().at(0), posted)
            .unwrap(),
        Posted::Yes
    );
}

#[test]
fn the_emulated_device_is_a_roce_port_beside_the_systems_library() {
    // The system's library first (no device here: Unavailable; a device where there is one),
    // then the emulated device in the same process; a library that is not there: Unavailable,
    // never a panic.
    match VerbsProvider::open(&VerbsConfig::default()) {
        Err(NetError::Unavailable { detail, .. }) => eprintln!("libibverbs.so.1: {detail}"),
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(other) => eprintln!("an RDMA device is present: {}", other.name()),
    }
    let Some(p) = provider(14, 7) else { return };
    assert_eq!(p.name(), "IB/weftemu0:1");
    assert_eq!(p.id(), "ib:roce");
    let missing = VerbsConfig {
        library: Some("/nonexistent/libibverbs-elsewhere.so".into()),
        ..VerbsConfig::default()
    };
    match VerbsProvider::open(&missing) {
        Err(NetError::Unavailable { detail, .. }) => {
            assert!(detail.contains("cannot load"), "{detail}")
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("a missing library opened"),
    }
    // The emulated device still works after both.
    let (src, dst) = (region(&p, 4096, 5), region(&p, 4096, 0));
    let (mut a, _b) = pair(&p, true);
    a.write(src.range(0, 64), dst.remote().at(0), 1).unwrap();
    assert_eq!(completion(a.as_mut()).result, Ok(()));
    assert_eq!(bytes(&dst, 0, 64), vec![5; 64]);
}

/// The emulator's own checks through the verbs API (`csrc/ibemu_check.c`), for what the
/// provider does not use: SEND and receiver-not-ready, write-with-immediate completing only
/// after every earlier write is placed under relaxed placement, completion-queue overflow,
/// `ibv_reg_dmabuf_mr`, the state machine and the inline limit.
#[test]
fn the_emulators_own_checks_pass() {
    let Some(lib) = EMULATOR else {
        let _ = provider(14, 7);
        return;
    };
    let Some(check) = option_env!("WEFTCC_IBEMU_CHECK") else {
        panic!("the emulator was built but its checks were not (see transports/build.rs)");
    };
    let out = std::process::Command::new(check)
        .arg(lib)
        .output()
        .expect("run ibemu_check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "ibemu_check failed:\n{text}");
    assert!(text.contains("checks passed"), "{text}");
}

/// GPUDirect RDMA's registration on the emulated device: a memfd stands in for device memory
/// and is registered by its dmabuf (`ibv_reg_dmabuf_mr`: the emulator maps the descriptor, as a
/// NIC driver maps a GPU's dmabuf); the NIC writes into it and reads out of it by the range's
/// device address; the registration is cached until the memory is freed.
#[test]
fn device_memory_registered_by_its_dmabuf_is_written_and_read_by_the_nic() {
    use weftcc_transports::net::device::{DeviceMemory, MemfdDevice};
    use weftcc_transports::net::regcache::{DeviceRegistration, RegistrationCache};
    let Some(p) = provider(14, 7) else { return };
    let p: Arc<dyn Provider> = Arc::new(p);
    let cache = RegistrationCache::of(&p);
    let dev = MemfdDevice::new(3 * 4096, false).unwrap();
    let lease = cache.lease_device(&dev).expect("dmabuf registration");
    assert_eq!(lease.device(), Some(DeviceRegistration::Dmabuf));
    assert_eq!(
        lease.remote().base,
        dev.address(),
        "named by its device address"
    );
    let src = region(p.as_ref(), 8192, 3);
    let dst = region(p.as_ref(), 8192, 0);
    let (mut a, _b) = pair(p.as_ref(), true);
    // Into the device memory…
    a.write(src.range(0, 5000), lease.remote().at(4000), 1)
        .unwrap();
    assert_eq!(completion(a.as_mut()).result, Ok(()));
    // SAFETY: the write completed; nothing else writes the memory.
    let seen = unsafe { dev.host().read(3999, 5002, <[u8]>::to_vec) };
    assert_eq!(seen[0], 0);
    assert_eq!(&seen[1..5001], &[3u8; 5000][..]);
    assert_eq!(seen[5001], 0);
    // …and out of it.
    a.write(lease.region().range(4000, 5000), dst.remote().at(10), 2)
        .unwrap();
    assert_eq!(completion(a.as_mut()).result, Ok(()));
    assert_eq!(bytes(&dst, 10, 5000), vec![3; 5000]);
    // Past its end: the device refuses as for any region.
    a.write(src.range(0, 64), lease.remote().at(3 * 4096 - 32), 3)
        .unwrap_err();
    let key = lease.remote().key;
    cache.release(lease);
    let again = cache.lease_device(&dev).unwrap();
    assert_eq!(again.remote().key, key, "cached after its use");
    cache.release(again);
    drop(dev);
    assert!(
        cache.is_empty(),
        "freeing the memory forgot the registration"
    );
}
