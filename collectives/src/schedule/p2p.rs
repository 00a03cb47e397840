//! Grouped point-to-point: a group's sends and receives as one schedule (NCCL's
//! `ncclGroupStart` / `ncclSend` / `ncclRecv` / `ncclGroupEnd`), so pairs of ranks can exchange
//! in both directions without deadlock. The host runtime and the CUDA path run the same
//! schedule.
//!
//! Elements are bytes. Input is the send buffers laid end to end, Output the receive buffers
//! ([`BufferMap`]); every buffer is cut into messages of at most `slice` bytes. Steps have no
//! dependencies: sends to one peer go out in step order and receives from one peer match in
//! step order, which is all a group promises (messages between an ordered pair of ranks match
//! in call order, and a receive must have the size of the matching send). Sends and receives
//! alternate, so an executor that queues steps per peer (the GPU's lanes) never queues a long
//! run of sends before the receives that let the peer's sends drain.

use super::build::slices;
use super::layout::BufferMap;
use super::{Action, BufId, Region, Schedule, Step};

/// A group's schedule, where its buffers lie, and the message sizes per peer (for the header
/// that lets each side check the other's sizes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSchedule<P> {
    pub schedule: Schedule,
    pub buffers: BufferMap<P>,
    /// Per peer sent to, in order of first appearance: the length of each send buffer.
    pub sent: PerPeer,
    /// Per peer received from: the length of each receive buffer.
    pub received: PerPeer,
}

/// Buffer lengths per peer, peers in order of first appearance.
pub type PerPeer = Vec<(usize, Vec<usize>)>;

/// The schedule of a group of `sends` and `recvs`, each `(peer, place, bytes)` in call order.
pub fn group_schedule<P: Copy>(
    sends: &[(usize, P, usize)],
    recvs: &[(usize, P, usize)],
    slice: usize,
) -> GroupSchedule<P> {
    let mut buffers = BufferMap::default();
    let (send_pieces, sent) = messages(sends, BufId::Input, slice, |at, len| {
        buffers.push_input(at, len)
    });
    let (recv_pieces, received) = messages(recvs, BufId::Output, slice, |at, len| {
        buffers.push_output(at, len)
    });
    let send_steps = send_pieces
        .into_iter()
        .map(|(peer, src)| Action::Send { peer, src });
    let recv_steps = recv_pieces
        .into_iter()
        .map(|(peer, dst)| Action::RecvCopy { peer, dst });
    let mut schedule = Schedule {
        send_peers: sent.iter().map(|(p, _)| *p).collect(),
        recv_peers: received.iter().map(|(p, _)| *p).collect(),
        ..Schedule::default()
    };
    let (mut s, mut r) = (send_steps, recv_steps);
    loop {
        let (a, b) = (s.next(), r.next());
        if a.is_none() && b.is_none() {
            break;
        }
        for action in [a, b].into_iter().flatten() {
            schedule.steps.push(Step {
                action,
                deps: Vec::new(),
            });
        }
    }
    GroupSchedule {
        schedule,
        buffers,
        sent,
        received,
    }
}

/// One side of a group: its buffers cut into messages of at most `slice` bytes, `(peer, region
/// of `buf`)` each, and the buffer lengths per peer. `place(at, len)` lays a buffer into `buf`
/// and returns where it starts.
fn messages<P: Copy>(
    list: &[(usize, P, usize)],
    buf: BufId,
    slice: usize,
    mut place: impl FnMut(P, usize) -> usize,
) -> (Vec<(usize, Region)>, PerPeer) {
    let mut pieces = Vec::new();
    let mut per_peer = Vec::new();
    for &(peer, at, len) in list {
        let start = place(at, len);
        pieces.extend(slices(start, len, slice).map(|(o, l)| (peer, Region::new(buf, o, l))));
        add_message(&mut per_peer, peer, len);
    }
    (pieces, per_peer)
}

fn add_message(per_peer: &mut PerPeer, peer: usize, len: usize) {
    match per_peer.iter_mut().find(|(p, _)| *p == peer) {
        Some((_, sizes)) => sizes.push(len),
        None => per_peer.push((peer, vec![len])),
    }
}

/// A fingerprint of a list of message sizes (carried in a group header's root field; never
/// [`crate::header::NO_ROOT`]).
pub fn fingerprint(sizes: &[usize]) -> u32 {
    let h = crate::header::fnv1a32(sizes.iter().flat_map(|s| (*s as u64).to_le_bytes()));
    if h == crate::header::NO_ROOT {
        0
    } else {
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message fits a slice, the messages of each buffer cover it exactly in order, each
    /// resolves to the right place (empty buffers move nothing), and sends and receives
    /// alternate.
    #[test]
    fn slices_each_buffer_and_addresses_it() {
        let sends = [(1, 0x10_0000u64, 10), (2, 0x20_0000, 0), (1, 0x30_0000, 4)];
        let recvs = [(3, 0x40_0000u64, 9), (1, 0x50_0000, 1)];
        let g = group_schedule(&sends, &recvs, 4);
        g.schedule.check(4).expect("a valid schedule");
        let mut got = Vec::new();
        for step in &g.schedule.steps {
            let (peer, region, dir) = match step.action {
                Action::Send { peer, src } => (peer, src, 's'),
                Action::RecvCopy { peer, dst } => (peer, dst, 'r'),
                ref other => panic!("unexpected step {other:?}"),
            };
            assert!(region.len <= 4 && region.len > 0);
            let (at, i) = g.buffers.locate(region.buf, region.offset).unwrap();
            got.push((dir, peer, at + i as u64, region.len));
        }
        assert_eq!(
            got,
            vec![
                ('s', 1, 0x10_0000, 4),
                ('r', 3, 0x40_0000, 4),
                ('s', 1, 0x10_0004, 4),
                ('r', 3, 0x40_0004, 4),
                ('s', 1, 0x10_0008, 2),
                ('r', 3, 0x40_0008, 1),
                ('s', 1, 0x30_0000, 4),
                ('r', 1, 0x50_0000, 1),
            ]
        );
        assert_eq!(g.schedule.send_peers, vec![1, 2]);
        assert_eq!(g.schedule.recv_peers, vec![3, 1]);
        assert_eq!(g.sent, vec![(1, vec![10, 4]), (2, vec![0])]);
        assert_eq!(g.received, vec![(3, vec![9]), (1, vec![1])]);
    }

    #[test]
    fn empty_group_has_no_steps() {
        let g = group_schedule::<u64>(&[], &[(1, 0x1000, 0)], 1 << 20);
        assert!(g.schedule.steps.is_empty());
        assert_eq!(g.schedule.recv_peers, vec![1]);
    }

    #[test]
    fn fingerprints_tell_size_lists_apart() {
        assert_ne!(fingerprint(&[4, 8]), fingerprint(&[8, 4]));
        assert_ne!(fingerprint(&[]), crate::header::NO_ROOT);
    }
}
