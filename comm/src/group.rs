//! Grouped sends and receives, run together as one operation (so pairs of ranks can exchange
//! without deadlock).

use crate::error::Result;
use crate::executor::{Area, Prepared};
use crate::inner::{Inner, Run, State};
use crate::trace::TraceEntry;
use weftcc_collectives::call;
use weftcc_collectives::schedule::layout::Placement;
use weftcc_collectives::schedule::p2p;
use weftcc_collectives::{DataType, Element, OpKind, ReduceOp};

/// A grouped set of sends and receives, run together by [`Group::run`].
pub struct Group<'a> {
    pub(crate) inner: &'a Inner,
    pub(crate) sends: Vec<(usize, &'a [u8])>,
    pub(crate) recvs: Vec<(usize, &'a mut [u8])>,
}

impl<'a> Group<'a> {
    /// Adds a send of `buf` to `peer`.
    pub fn send<T: Element>(mut self, buf: &'a [T], peer: usize) -> Self {
        self.sends.push((peer, bytemuck::cast_slice(buf)));
        self
    }

    /// Adds a receive into `buf` from `peer`.
    pub fn recv<T: Element>(mut self, buf: &'a mut [T], peer: usize) -> Self {
        self.recvs.push((peer, bytemuck::cast_slice_mut(buf)));
        self
    }

    /// Runs every send and receive of the group; returns when all completed.
    pub fn run(mut self) -> Result<()> {
        self.inner.check()?;
        self.inner.run_group(&self.sends, &mut self.recvs)
    }
}

impl Inner {
    /// Runs grouped sends and receives as one operation.
    pub(crate) fn run_group(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        let kind = OpKind::SendRecv;
        let peers = sends
            .iter()
            .map(|(p, _)| *p)
            .chain(recvs.iter().map(|(p, _)| *p));
        for peer in peers {
            call::check_peer(self.rank, self.size, peer).map_err(|e| self.invalid(kind, e))?;
        }
        self.check()?;
        self.run_blocking(kind, |inner, st| inner.run_group_locked(st, sends, recvs))
    }

    pub(crate) fn run_group_locked(
        &self,
        st: &mut State,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        let slice = self.slice_bytes().max(8);
        // Bytes sent and received, for the flight recorder.
        let moved: usize = (sends.iter().map(|(_, b)| b.len()))
            .chain(recvs.iter().map(|(_, b)| b.len()))
            .sum();
        // Areas: the sends, then the receives, in call order.
        let send_places: Vec<_> = (sends.iter().enumerate())
            .map(|(i, (peer, buf))| (*peer, Placement::new(i, 0), buf.len()))
            .collect();
        let recv_places: Vec<_> = (recvs.iter().enumerate())
            .map(|(i, (peer, buf))| (*peer, Placement::new(sends.len() + i, 0), buf.len()))
            .collect();
        let group = p2p::group_schedule(&send_places, &recv_places, slice);
        let mut areas: Vec<Area<'_>> = Vec::with_capacity(sends.len() + recvs.len());
        areas.extend(sends.iter().map(|(_, buf)| Area::ReadOnly(buf)));
        areas.extend(recvs.iter_mut().map(|(_, buf)| Area::ReadWrite(buf)));
        // One header per peer and direction: the pair's message sequence number, total bytes and
        // a fingerprint of the message sizes, so mismatched sends and receives are detected.
        let headers = p2p::pair_headers(&group, &mut st.send_seq, &mut st.recv_seq);
        let (sched, layout) = (group.schedule, group.buffers);
        let first_seq = headers.first().map(|h| h.1.seq).unwrap_or(0);
        self.current.set(OpKind::SendRecv, first_seq);
        self.trace.start(
            TraceEntry::start(OpKind::SendRecv, first_seq, DataType::Uint8, moved as u64)
                .with_peers(headers.iter().map(|h| h.0)),
        );
        let prepared = Prepared::new(sched);
        let State {
            mesh,
            workspace,
            coll_seq,
            ..
        } = st;
        let run = Run {
            desc: p2p::pair_header(first_seq, &[]),
            dtype: DataType::Uint8,
            op: ReduceOp::Sum,
            prepared: &prepared,
            layout: &layout,
            headers: &headers,
            collective_seq: *coll_seq,
        };
        self.execute(mesh, workspace, &run, &mut areas)
    }
}
