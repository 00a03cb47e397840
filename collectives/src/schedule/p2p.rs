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
use crate::header::OpDesc;
use crate::{DataType, OpKind};

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

/// The header of one direction between a pair of ranks in a group: the pair's message sequence
/// number in that direction (`seq`, the messages exchanged before), the total bytes and a
/// fingerprint of the message sizes (in the root field). The sender computes it from its sends,
/// the receiver from its receives: equal headers mean matching messages.
pub fn pair_header(seq: u64, sizes: &[usize]) -> OpDesc {
    OpDesc {
        kind: OpKind::SendRecv,
        seq,
        dtype: DataType::Uint8,
        count: sizes.iter().sum::<usize>() as u64,
        redop: None,
        root: fingerprint(sizes),
    }
}

/// A group's headers for each peer it touches, peers ascending: `(peer, out, in)`, `out` for
/// what this rank sends the peer and `in` for what it receives from it
/// ([`pair_header`]), numbered from the messages exchanged with that peer so far
/// (`send_seq[peer]`, `recv_seq[peer]`), which are advanced by the group's. The host engine
/// sends `out` with the first message to the peer and compares the peer's with its `in`; the
/// CUDA IPC path exchanges both before enqueuing anything.
pub fn pair_headers<P>(
    group: &GroupSchedule<P>,
    send_seq: &mut [u64],
    recv_seq: &mut [u64],
) -> Vec<(usize, OpDesc, OpDesc)> {
    let mut peers: Vec<usize> = (group.sent.iter().chain(group.received.iter()))
        .map(|(p, _)| *p)
        .collect();
    peers.sort_unstable();
    peers.dedup();
    let sizes = |list: &PerPeer, p: usize| -> Vec<usize> {
        list.iter()
            .find(|(q, _)| *q == p)
            .map(|(_, s)| s.clone())
            .unwrap_or_default()
    };
    let headers = peers
        .iter()
        .map(|&p| {
            (
                p,
                pair_header(
                    send_seq.get(p).copied().unwrap_or(0),
                    &sizes(&group.sent, p),
                ),
                pair_header(
                    recv_seq.get(p).copied().unwrap_or(0),
                    &sizes(&group.received, p),
                ),
            )
        })
        .collect();
    for (list, seqs) in [(&group.sent, send_seq), (&group.received, recv_seq)] {
        for (p, sizes) in list {
            if let Some(seq) = seqs.get_mut(*p) {
                *seq += sizes.len() as u64;
            }
        }
    }
    headers
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

    proptest::proptest! {
        /// Rank 0's header for what it sends rank 1 equals rank 1's for what it receives from
        /// rank 0 exactly when the message sizes agree, whatever else each group holds; each
        /// end's pair counters advance by the pair's messages.
        #[test]
        fn pair_headers_agree_exactly_when_the_messages_do(
            sizes in proptest::collection::vec(0usize..5000, 0..6),
            other in proptest::collection::vec(0usize..5000, 0..6),
            before in 0u64..1000,
            extra in proptest::collection::vec((2usize..4, 0usize..100), 0..4),
        ) {
            let list = |p: usize, l: &[usize]| -> Vec<(usize, u64, usize)> {
                l.iter().map(|&b| (p, 0u64, b)).collect()
            };
            let mut a_sends = list(1, &sizes);
            // Messages to other peers interleaved: they must not change the pair's header.
            a_sends.extend(extra.iter().map(|&(p, b)| (p, 0u64, b)));
            let a = group_schedule(&a_sends, &[], 64);
            let b = group_schedule(&[], &list(0, &other), 64);
            let (mut a_sent, mut a_recvd) = (vec![before; 4], vec![0; 4]);
            let (mut b_sent, mut b_recvd) = (vec![0; 4], vec![before; 4]);
            let ha = pair_headers(&a, &mut a_sent, &mut a_recvd);
            let hb = pair_headers(&b, &mut b_sent, &mut b_recvd);
            let a_to_1 = ha.iter().find(|h| h.0 == 1).map(|h| h.1);
            let b_from_0 = hb.iter().find(|h| h.0 == 0).map(|h| h.2);
            match (a_to_1, b_from_0) {
                (Some(out), Some(inbound)) => {
                    proptest::prop_assert_eq!(out == inbound, sizes == other);
                    proptest::prop_assert_eq!(out.seq, before);
                }
                // No message to the peer on one side: only when that side's list is empty.
                (None, Some(_)) => proptest::prop_assert!(sizes.is_empty()),
                (Some(_), None) => proptest::prop_assert!(other.is_empty()),
                (None, None) => proptest::prop_assert!(sizes.is_empty() && other.is_empty()),
            }
            proptest::prop_assert_eq!(a_sent[1], before + sizes.len() as u64);
            proptest::prop_assert_eq!(b_recvd[0], before + other.len() as u64);
            let mut peers: Vec<usize> = ha.iter().map(|h| h.0).collect();
            peers.dedup();
            proptest::prop_assert!(peers.windows(2).all(|w| w[0] < w[1]), "peers ascending, once each");
        }
    }

    #[test]
    fn fingerprints_tell_size_lists_apart() {
        assert_ne!(fingerprint(&[4, 8]), fingerprint(&[8, 4]));
        assert_ne!(fingerprint(&[]), crate::header::NO_ROOT);
    }
}
