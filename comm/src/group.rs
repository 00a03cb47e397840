//! Grouped sends and receives, run together as one operation (so pairs of ranks can exchange
//! without deadlock).

use crate::communicator::{Communicator, Inner, State};
use crate::engine::{Area, Layout, Prepared};
use crate::error::Result;
use weftcc_collectives::call::{self};
use weftcc_collectives::header::{OpDesc, NO_ROOT};
use weftcc_collectives::schedule::{Action, BufId, Region, Schedule, Step};
use weftcc_collectives::{DataType, Element, OpKind, ReduceOp};

/// A grouped set of sends and receives, run together by [`Group::run`].
pub struct Group<'a> {
    pub(crate) comm: &'a Communicator,
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
        self.comm.inner.check()?;
        self.comm.inner.run_group(&self.sends, &mut self.recvs)
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
        let slice = self.config.slice_bytes.max(8);
        let mut sched = Schedule::default();
        let mut areas: Vec<Area<'_>> = Vec::with_capacity(sends.len() + recvs.len());
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        // Per peer: (messages, total bytes, fingerprint of the message sizes).
        let mut out_meta: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut in_meta: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut virtual_in = 0usize;
        for &(peer, buf) in sends {
            inputs.push((virtual_in, areas.len()));
            areas.push(Area::ReadOnly(buf));
            push_sliced(&mut sched, buf.len(), slice, |off, len| Action::Send {
                peer,
                src: Region::new(BufId::Input, virtual_in + off, len),
            });
            virtual_in += buf.len();
            meta_push(&mut out_meta, peer, buf.len());
        }
        let mut virtual_out = 0usize;
        for (peer, buf) in recvs.iter_mut() {
            let peer = *peer;
            let len = buf.len();
            outputs.push((virtual_out, areas.len()));
            areas.push(Area::ReadWrite(buf));
            push_sliced(&mut sched, len, slice, |off, l| Action::RecvCopy {
                peer,
                dst: Region::new(BufId::Output, virtual_out + off, l),
            });
            virtual_out += len;
            meta_push(&mut in_meta, peer, len);
        }
        sched.send_peers = out_meta.iter().map(|(p, _)| *p).collect();
        sched.recv_peers = in_meta.iter().map(|(p, _)| *p).collect();
        let layout = Layout::Concatenated { inputs, outputs };
        // One header per peer and direction: the pair's message sequence number, total bytes and
        // a fingerprint of the message sizes, so mismatched sends and receives are detected.
        let desc_for = |seq: u64, sizes: &[usize]| OpDesc {
            kind: OpKind::SendRecv,
            seq,
            dtype: DataType::Uint8,
            count: sizes.iter().sum::<usize>() as u64,
            redop: 0xff,
            root: fingerprint(sizes),
        };
        let mut headers: Vec<(usize, OpDesc, OpDesc)> = Vec::new();
        let peers: Vec<usize> = {
            let mut p: Vec<usize> = sched
                .send_peers
                .iter()
                .chain(sched.recv_peers.iter())
                .copied()
                .collect();
            p.sort_unstable();
            p.dedup();
            p
        };
        for &p in &peers {
            let out_sizes = out_meta
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, s)| s.clone())
                .unwrap_or_default();
            let in_sizes = in_meta
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, s)| s.clone())
                .unwrap_or_default();
            headers.push((
                p,
                desc_for(st.send_seq[p], &out_sizes),
                desc_for(st.recv_seq[p], &in_sizes),
            ));
        }
        for (p, sizes) in &out_meta {
            st.send_seq[*p] += sizes.len() as u64;
        }
        for (p, sizes) in &in_meta {
            st.recv_seq[*p] += sizes.len() as u64;
        }
        let first_seq = headers.first().map(|h| h.1.seq).unwrap_or(0);
        self.current.set(OpKind::SendRecv, first_seq);
        let prepared = Prepared::new(sched);
        let State {
            mesh,
            workspace,
            coll_seq,
            ..
        } = st;
        self.execute(
            mesh,
            desc_for(first_seq, &[]),
            DataType::Uint8,
            ReduceOp::Sum,
            &prepared,
            &layout,
            &mut areas,
            &headers,
            workspace,
            *coll_seq,
        )
    }
}

pub(crate) fn meta_push(meta: &mut Vec<(usize, Vec<usize>)>, peer: usize, len: usize) {
    match meta.iter_mut().find(|(p, _)| *p == peer) {
        Some((_, sizes)) => sizes.push(len),
        None => meta.push((peer, vec![len])),
    }
}

/// A fingerprint of a list of message sizes, carried in the header's root field (never
/// [`NO_ROOT`]).
pub(crate) fn fingerprint(sizes: &[usize]) -> u32 {
    let h =
        weftcc_collectives::header::fnv1a32(sizes.iter().flat_map(|s| (*s as u64).to_le_bytes()));
    if h == NO_ROOT {
        0
    } else {
        h
    }
}

/// Appends steps moving `len` elements in slices of at most `slice`.
pub(crate) fn push_sliced(
    sched: &mut Schedule,
    len: usize,
    slice: usize,
    mut make: impl FnMut(usize, usize) -> Action,
) {
    let mut off = 0;
    while off < len {
        let l = slice.min(len - off);
        sched.steps.push(Step {
            action: make(off, l),
            deps: Vec::new(),
        });
        off += l;
    }
}
