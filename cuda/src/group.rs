//! Point-to-point on device buffers: [`DeviceGroup`] collects sends and receives and enqueues
//! them together on one stream (NCCL's `ncclGroupStart` / `ncclSend` / `ncclRecv` /
//! `ncclGroupEnd`), so pairs of ranks can exchange in both directions without deadlock.
//!
//! Over CUDA IPC a group becomes the core's group schedule
//! ([`weftcc_collectives::schedule::p2p`]), each message at most one slot: sends to a peer run
//! in order on that peer's send lane, receives on its receive lane, and the lanes run
//! concurrently, so an exchange larger than the peer's inbox still drains. Over the staged transport the proxy copies the sends to pinned memory, runs
//! the host communicator's group and copies the receives back.
//!
//! As with NCCL, a receive must match the size of the peer's send (messages between an ordered
//! pair of ranks match in enqueue order); buffers must stay alive until the stream has passed
//! the group.

use crate::comm::{DevSpan, DeviceComm};
use crate::error::{CudaError, DeviceArgError, Result};
use crate::memory::{DeviceBuffer, Stream};
use std::marker::PhantomData;
use std::ops::Range;
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
