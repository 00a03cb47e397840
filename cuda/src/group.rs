//! Point-to-point on device buffers: [`DeviceGroup`] collects sends and receives and enqueues
//! them together on one stream (NCCL's `ncclGroupStart` / `ncclSend` / `ncclRecv` /
//! `ncclGroupEnd`), so pairs of ranks can exchange in both directions without deadlock.
//!
//! Over CUDA IPC a group becomes one schedule of `Send` and `RecvCopy` steps, each message at
//! most one slot: sends to a peer run in order on that peer's send lane, receives on its
//! receive lane, and the lanes run concurrently, so an exchange larger than the peer's inbox
//! still drains. Over the staged transport the proxy copies the sends to pinned memory, runs
//! the host communicator's group and copies the receives back.
//!
//! As with NCCL, a receive must match the size of the peer's send (messages between an ordered
//! pair of ranks match in enqueue order); buffers must stay alive until the stream has passed
//! the group.

use crate::comm::{DevSpan, DeviceComm};
use crate::error::{CudaError, DeviceArgError, Result};
use crate::ipc::BufferMap;
use crate::memory::{DeviceBuffer, Stream};
use std::marker::PhantomData;
use std::ops::Range;
use weftcc_collectives::schedule::{Action, BufId, Region, Schedule, Step};
use weftcc_collectives::{Element, OpKind};

/// Sends and receives enqueued together by [`DeviceGroup::run`]; made by [`DeviceComm::group`].
pub struct DeviceGroup<'a> {
    comm: &'a DeviceComm,
    sends: Vec<(usize, DevSpan)>,
    recvs: Vec<(usize, DevSpan)>,
    /// The first argument error, reported by `run` (the builder methods cannot fail).
    error: Option<CudaError>,
    /// Holds the borrows of the buffers until the group is run.
    _buffers: PhantomData<&'a mut ()>,
}

impl<'a> DeviceGroup<'a> {
    pub(crate) fn new(comm: &'a DeviceComm) -> DeviceGroup<'a> {
        DeviceGroup {
            comm,
            sends: Vec::new(),
            recvs: Vec::new(),
            error: None,
            _buffers: PhantomData,
        }
    }

    /// Adds a send of `buf` to `peer`.
    pub fn send<T: Element>(mut self, buf: &'a DeviceBuffer<T>, peer: usize) -> Self {
        match self.comm.span(OpKind::SendRecv, buf) {
            Ok(s) => self.sends.push((peer, s)),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
        self
    }

    /// Adds a receive into `buf` from `peer`.
    pub fn recv<T: Element>(mut self, buf: &'a mut DeviceBuffer<T>, peer: usize) -> Self {
        match self.comm.span(OpKind::SendRecv, buf) {
            Ok(s) => self.recvs.push((peer, s)),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
        self
    }

    /// Adds, within one buffer, a send of elements `send` to `to` and a receive into elements
    /// `recv` from `from` (the in-place form: the two ranges must not overlap).
    pub fn send_recv_parts<T: Element>(
        mut self,
        buf: &'a mut DeviceBuffer<T>,
        send: Range<usize>,
        to: usize,
        recv: Range<usize>,
        from: usize,
    ) -> Self {
        let whole = match self.comm.span(OpKind::SendRecv, buf) {
            Ok(s) => s,
            Err(e) => {
                self.error.get_or_insert(e);
                return self;
            }
        };
        let len = buf.len();
        let bad = |r: &Range<usize>| r.start > r.end || r.end > len;
        let overlap = send.start < recv.end && recv.start < send.end;
        if bad(&send) || bad(&recv) || overlap {
            let reason = DeviceArgError::Parts {
                send: send.clone(),
                recv: recv.clone(),
                len,
            };
            self.error
                .get_or_insert(self.comm.invalid(OpKind::SendRecv, reason));
            return self;
        }
        let es = std::mem::size_of::<T>();
        let part = |r: &Range<usize>| DevSpan {
            ptr: whole.ptr + (r.start * es) as u64,
            bytes: (r.end - r.start) * es,
        };
        self.sends.push((to, part(&send)));
        self.recvs.push((from, part(&recv)));
        self
    }

    /// Enqueues every send and receive of the group on `stream` and returns; work enqueued on
    /// `stream` afterwards sees the received data.
    pub fn run(self, stream: &Stream) -> Result<()> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.comm.enqueue_group(self.sends, self.recvs, stream)
    }
}

/// The IPC schedule of a group (byte elements): every send and receive cut into messages of at
/// most `slot` bytes, addressed through a [`BufferMap`] that lays the group's buffers end to
/// end. Steps have no dependencies: per-peer lanes keep each direction in order. Sends and
/// receives alternate in the schedule, so the host never enqueues a long run of sends (which
/// can fill a lane's queue while the GPU waits for the peer to free slots) before the receives
/// that let the peer's sends drain.
pub(crate) fn group_schedule(
    sends: &[(usize, DevSpan)],
    recvs: &[(usize, DevSpan)],
    slot: usize,
) -> (Schedule, BufferMap) {
    let slot = slot.max(1);
    let mut sched = Schedule::default();
    let mut bufs = BufferMap::default();
    let pieces = |len: usize| (0..len).step_by(slot).map(move |o| (o, slot.min(len - o)));
    let mut send_steps = Vec::new();
    for &(peer, s) in sends {
        let start = bufs.push_input(s.ptr, s.bytes);
        for (off, len) in pieces(s.bytes) {
            let src = Region::new(BufId::Input, start + off, len);
            send_steps.push(Action::Send { peer, src });
        }
        if !sched.send_peers.contains(&peer) {
            sched.send_peers.push(peer);
        }
    }
    let mut recv_steps = Vec::new();
    for &(peer, r) in recvs {
        let start = bufs.push_output(r.ptr, r.bytes);
        for (off, len) in pieces(r.bytes) {
            let dst = Region::new(BufId::Output, start + off, len);
            recv_steps.push(Action::RecvCopy { peer, dst });
        }
        if !sched.recv_peers.contains(&peer) {
            sched.recv_peers.push(peer);
        }
    }
    let (mut sends, mut recvs) = (send_steps.into_iter(), recv_steps.into_iter());
    loop {
        let (s, r) = (sends.next(), recvs.next());
        if s.is_none() && r.is_none() {
            break;
        }
        for action in [s, r].into_iter().flatten() {
            sched.steps.push(Step {
                action,
                deps: Vec::new(),
            });
        }
    }
    (sched, bufs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(ptr: u64, bytes: usize) -> DevSpan {
        DevSpan { ptr, bytes }
    }

    /// Every message fits a slot, the messages of each buffer cover it exactly in order, each
    /// resolves to the right device address (empty buffers move nothing), and sends and
    /// receives alternate.
    #[test]
    fn group_schedule_slices_each_buffer_and_addresses_it() {
        let sends = [
            (1, span(0x10_0000, 10)),
            (2, span(0x20_0000, 0)),
            (1, span(0x30_0000, 4)),
        ];
        let recvs = [(3, span(0x40_0000, 9)), (1, span(0x50_0000, 1))];
        let (sched, bufs) = group_schedule(&sends, &recvs, 4);
        sched.check(4).expect("a valid schedule");
        let mut got = Vec::new();
        for step in &sched.steps {
            let (peer, region, dir) = match step.action {
                Action::Send { peer, src } => (peer, src, 's'),
                Action::RecvCopy { peer, dst } => (peer, dst, 'r'),
                ref other => panic!("unexpected step {other:?}"),
            };
            assert!(region.len <= 4 && region.len > 0);
            got.push((
                dir,
                peer,
                bufs.address(region.buf, region.offset, 1, 0),
                region.len,
            ));
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
        assert_eq!(sched.send_peers, vec![1, 2]);
        assert_eq!(sched.recv_peers, vec![3, 1]);
    }

    #[test]
    fn empty_group_has_no_steps() {
        let (sched, _) = group_schedule(&[], &[(1, span(0x1000, 0))], 1 << 20);
        assert!(sched.steps.is_empty());
    }
}
