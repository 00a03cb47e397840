use super::layout::{Layout, H_PID};
use super::segment::{create_exclusive, init_object, job_prefix, Mapping};
use super::space::MIB;
use super::*;
use crate::conn::{Connection, FAREWELL_MAX};
use crate::error::TransportError;
use std::path::Path;
use std::sync::atomic::Ordering;

#[test]
fn a_farewell_is_read_by_the_peer_after_the_close() {
    let ((mut a, _), (mut b, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
    let ((c, _), (d, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
    a.leave_farewell("abort 0 timed out");
    a.leave_farewell("abort 0 a consequence"); // the first note stays
    drop(a);
    assert!(matches!(
        b.check_peer(),
        Err(TransportError::PeerLost { peer: 0, .. })
    ));
    assert_eq!(b.farewell().as_deref(), Some("abort 0 timed out"));
    // No note: none read. A long one: cut at FAREWELL_MAX bytes.
    drop(c);
    assert_eq!(d.farewell(), None);
    let ((mut e, _), (f, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
    let long: String = (0..FAREWELL_MAX + 50)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    e.leave_farewell(&long);
    assert_eq!(f.farewell().as_deref(), Some(&long[..FAREWELL_MAX]));
}

#[test]
fn the_tail_reaches_the_sender_when_the_reader_stops_short_or_runs_dry() {
    let ((mut a, mut wake_a), (mut b, _)) = local_pair(0, 1, MIN_BUFFSIZE).unwrap();
    a.set_low_latency_max(0); // ring bytes only
    let fill = |a: &mut ShmConnection| {
        let chunk = [7u8; 4096];
        let mut sent = 0;
        loop {
            match a.try_send(&chunk).unwrap() {
                0 => return sent,
                n => sent += n,
            }
        }
    };
    assert_eq!(fill(&mut a), MIN_BUFFSIZE);
    wake_a.poll_doorbell();
    // A reader that takes fewer bytes than it is offered may not come back soon: the space
    // it freed is published (and the sender woken) at once.
    let took = b.try_recv(usize::MAX, &mut |_: &[u8]| 100).unwrap();
    assert_eq!(took, 100);
    assert!(wake_a.poll_doorbell());
    assert_eq!(fill(&mut a), 100);
    // A reader that took every byte it knows of, in pieces well under an eighth of the ring,
    // has released the whole ring, without a further look that finds nothing.
    let mut total = 0;
    while total < MIN_BUFFSIZE {
        let n = b.try_recv(1000, &mut |sl: &[u8]| sl.len()).unwrap();
        assert!(n > 0);
        total += n;
    }
    assert!(wake_a.poll_doorbell());
    assert_eq!(fill(&mut a), MIN_BUFFSIZE);
    // A look that asks for nothing releases what the reader took before.
    let took = b.try_recv(1000, &mut |sl: &[u8]| sl.len()).unwrap();
    assert_eq!(took, 1000);
    assert_eq!(fill(&mut a), 0);
    assert_eq!(b.try_recv(0, &mut |sl: &[u8]| sl.len()).unwrap(), 0);
    assert_eq!(fill(&mut a), 1000);
}

/// An object left under a name, as a rank killed between creating and unlinking it would.
fn leave_named(token: &str, rank: usize) -> (String, Mapping) {
    let name = format!("/{}left-{rank}", job_prefix(token));
    let fd = create_exclusive(&name).expect("create");
    let layout = Layout::new(1, MIN_BUFFSIZE).unwrap();
    let (_, map) = init_object(fd, &name, layout, rank, &[rank + 1], None).expect("init");
    (name, map)
}

#[test]
fn segments_of_a_dead_creator_are_removed_and_live_ones_kept() {
    let token = format!("orphans{}", std::process::id());
    let (live, _live_map) = leave_named(&token, 0);
    let (dead, dead_map) = leave_named(&token, 1);
    // A process that has exited and been reaped stands in for a killed rank.
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let gone = child.id();
    child.wait().expect("wait");
    dead_map.u32_at(H_PID).store(gone, Ordering::Relaxed);
    let removed = remove_orphan_segments(&token, false);
    assert_eq!(removed, vec![dead.clone()]);
    assert!(Path::new(&format!("/dev/shm{live}")).exists());
    nix::sys::mman::shm_unlink(live.as_str()).expect("unlink");
    assert!(remove_orphan_segments(&token, false).is_empty());
    // A fresh segment whose header was never written: kept while someone may still be
    // making it, removed once nobody is left.
    let fresh = format!("/{}fresh", job_prefix(&token));
    let fd = nix::sys::mman::shm_open(
        fresh.as_str(),
        nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_RDWR,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .expect("shm_open");
    drop(fd);
    assert!(remove_orphan_segments(&token, false).is_empty());
    assert_eq!(remove_orphan_segments(&token, true), vec![fresh]);
}

#[test]
fn objects_are_unlinked_as_soon_as_they_are_made() {
    let token = format!("unlinked{}", std::process::id());
    let ep = ShmEndpoint::create(&token, "a", 0, MIN_BUFFSIZE).unwrap();
    let ring = ep.incoming_ring(1).unwrap();
    let prefix = job_prefix(&token);
    let left = weftcc_testkit::shm_names(&prefix);
    assert!(left.is_empty(), "{left:?}");
    drop((ep, ring));
}

#[test]
fn a_host_that_cannot_hold_every_ring_is_refused_before_anything_is_made() {
    let ring = ring_bytes(1 << 20);
    let gib = 1u64 << 30;
    // 256 ranks of 1 MiB rings need 64 GiB: refused on a 24 GiB host.
    let e = check_host_shm(256, 255, ring, Some(24 * gib), Some(24 * gib)).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("256 ranks on this host need"), "{text}");
    assert!(
        text.contains("65280 rings") && text.contains("WEFT_BUFFSIZE"),
        "{text}"
    );
    // 128 ranks (16 GiB) fit; the same with a small /dev/shm does not.
    assert!(check_host_shm(128, 127, ring, Some(24 * gib), Some(24 * gib)).is_ok());
    assert!(check_host_shm(128, 127, ring, Some(gib), Some(24 * gib)).is_err());
    // Connected on demand (20 rings each) at the automatic ring size, 256 ranks fit in 1 GiB.
    let small = ring_bytes(auto_capacity(256));
    assert!(check_host_shm(256, 20, small, Some(gib), Some(24 * gib)).is_ok());
    // Nothing known: no refusal.
    assert!(check_host_shm(4096, 4095, ring, None, None).is_ok());
}

#[test]
fn automatic_ring_sizes_shrink_with_the_ranks_of_a_host() {
    assert_eq!(auto_capacity(1), DEFAULT_BUFFSIZE);
    assert_eq!(auto_capacity(32), DEFAULT_BUFFSIZE);
    assert_eq!(auto_capacity(33), DEFAULT_BUFFSIZE / 2);
    assert_eq!(auto_capacity(256), 128 << 10);
    assert_eq!(auto_capacity(100_000), MIN_BUFFSIZE);
}

#[test]
fn capacity_rounding() {
    assert_eq!(ring_capacity(0), MIN_BUFFSIZE);
    assert_eq!(ring_capacity(100_000), 128 << 10);
    assert_eq!(ring_capacity(4 << 20), 4 << 20);
    assert_eq!(ring_capacity(usize::MAX), MAX_BUFFSIZE);
}

#[test]
fn space_message() {
    let e = check_shm_space(64 * MIB, 7, 16 * MIB)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "/dev/shm has 64 MiB free but this communicator needs 112 MiB (7 peers × 16 MiB)"
        ),
        "{e}"
    );
    assert!(e.contains("WEFT_SHM_DISABLE=1"));
    assert!(check_shm_space(112 * MIB, 7, 16 * MIB).is_ok());
}
