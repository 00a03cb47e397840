//! The staged transport's plan: a call on device buffers as pieces, each a host operation on
//! pinned staging memory with the caller's stream copying its bytes in before and back after.
//!
//! Element-wise collectives (all-reduce, broadcast, reduce) larger than the chunk size
//! (`WEFT_CUDA_STAGE_CHUNK`) are cut into chunks, each a host operation of its own: the stream
//! enqueues every chunk's copy in first, then for each chunk its wait for the proxy and its
//! copy back, so the proxy works on one chunk while the GPU copies the next one in or the
//! previous one out. Everything else is one piece. [`pieces`] is pure (every rank cuts a call
//! alike); [`enqueue`] is the stream's side of it, the same loop for the GPU
//! ([`crate::comm`]) and for the tests, which run it with host memory standing in for the
//! device.

use crate::comm::{DevSpan, Work};
use crate::error::{CudaError, Result};
use crate::proxy::{Job, Outcome, ProxyThread, Ready, StagingMemory};
use std::sync::Arc;
use std::time::Duration;
use weftcc_collectives::{OpKind, RawOp};

/// Which staging buffer a copy fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Input,
    Output,
}

/// One piece of a staged call.
#[derive(Debug)]
pub(crate) struct Piece {
    /// The host side's call (its spans give the lengths; their addresses are the device's).
    pub(crate) work: Work,
    /// Where the piece's bytes start in the input and the output staging buffer.
    pub(crate) input_at: usize,
    pub(crate) output_at: usize,
    /// Device → staging copies before the host side: device span, buffer, offset.
    pub(crate) copy_in: Vec<(DevSpan, Side, usize)>,
    /// Staging output → device copies after it: offset, device span.
    pub(crate) copy_back: Vec<(usize, DevSpan)>,
}

/// The chunks of an element-wise call of more than `chunk_bytes`: `(chunk, byte offset)`, whole
/// elements, at least one per chunk; anything else whole. 0 turns chunking off.
pub(crate) fn chunks(op: &RawOp, chunk_bytes: usize) -> Vec<(RawOp, usize)> {
    let size = op.dtype.size();
    let per = (chunk_bytes / size).max(1);
    let elementwise = matches!(
        op.kind,
        OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce
    );
    if chunk_bytes == 0 || !elementwise || op.count <= per {
        return vec![(*op, 0)];
    }
    (0..op.count)
        .step_by(per)
        .map(|start| {
            let chunk = RawOp {
                count: per.min(op.count - start),
                ..*op
            };
            (chunk, start * size)
        })
        .collect()
}

/// The pieces `rank` stages `work` as, chunks of at most `chunk_bytes` (0: whole).
pub(crate) fn pieces(work: Work, rank: usize, chunk_bytes: usize) -> Vec<Piece> {
    match work {
        Work::Collective { op, send, recv } => {
            // A side the call does not use here (a broadcast's send buffer, a reduce's receive
            // buffer out of place, off the root) may have any length: it is neither copied nor
            // cut into chunks, and the host side gets none.
            let unused = |s: DevSpan| DevSpan {
                ptr: s.ptr,
                bytes: 0,
            };
            let send = send.map(|s| if op.reads_send(rank) { s } else { unused(s) });
            let recv = match send {
                Some(_) if !op.writes_recv(rank) => unused(recv),
                _ => recv,
            };
            let cut = chunks(&op, chunk_bytes);
            let whole = cut.len() == 1;
            cut.into_iter()
                .map(|(chunk, at)| {
                    // Chunks cut both buffers alike (an element-wise call's hold `count`
                    // elements each); a span the call leaves empty (a non-root's reduce
                    // output) stays empty in every chunk.
                    let bytes = chunk.count * chunk.dtype.size();
                    let span = |s: DevSpan| match whole {
                        true => s,
                        false => DevSpan {
                            ptr: s.ptr + at as u64,
                            bytes: if s.bytes == 0 { 0 } else { bytes },
                        },
                    };
                    let (send, recv) = (send.map(span), span(recv));
                    let copy_in = match send {
                        Some(s) => vec![(s, Side::Input, at)],
                        None => vec![(recv, Side::Output, at)],
                    };
                    let copy_back = match chunk.writes_recv(rank) {
                        true => vec![(at, recv)],
                        false => Vec::new(),
                    };
                    Piece {
                        work: Work::Collective {
                            op: chunk,
                            send,
                            recv,
                        },
                        input_at: at,
                        output_at: at,
                        copy_in: copy_in.into_iter().filter(|c| c.0.bytes > 0).collect(),
                        copy_back: copy_back.into_iter().filter(|c| c.1.bytes > 0).collect(),
                    }
                })
                .collect()
        }
        Work::Group { sends, recvs } => {
            let laid = |list: &[(usize, DevSpan)]| {
                let mut at = 0;
                list.iter()
                    .map(|&(_, s)| {
                        at += s.bytes;
                        (s, at - s.bytes)
                    })
                    .filter(|(s, _)| s.bytes > 0)
                    .collect::<Vec<_>>()
            };
            let copy_in = laid(&sends)
                .into_iter()
                .map(|(s, at)| (s, Side::Input, at))
                .collect();
            let copy_back = laid(&recvs).into_iter().map(|(s, at)| (at, s)).collect();
            vec![Piece {
                work: Work::Group { sends, recvs },
                input_at: 0,
                output_at: 0,
                copy_in,
                copy_back,
            }]
        }
    }
}

/// Staging bytes the pieces need: (input, output).
pub(crate) fn staging_bytes(pieces: &[Piece]) -> (usize, usize) {
    pieces.iter().fold((0, 0), |(i, o), p| {
        let (ib, ob) = p.work.staged_bytes();
        (i.max(p.input_at + ib), o.max(p.output_at + ob))
    })
}

/// The caller's stream as the staged transport drives it.
pub(crate) trait StagingStream {
    /// Enqueues a copy of device bytes `src` into staging buffer `to` at `at`.
    fn copy_in(&self, src: DevSpan, to: Side, at: usize) -> Result<()>;
    /// Marks the stream's position: passed once the copies before it are done.
    fn mark(&self) -> Result<Box<dyn Ready>>;
    /// Makes the stream wait until the proxy released `ticket` (stream memory operations), or
    /// returns `false` if it cannot, in which case [`enqueue`] waits on the host instead.
    fn wait_release(&self, ticket: u32) -> Result<bool>;
    /// Enqueues a copy of the output staging buffer's bytes at `at` into device bytes `dst`.
    fn copy_back(&self, at: usize, dst: DevSpan) -> Result<()>;
}

/// Enqueues `pieces` on `stream`: every piece's copies in and its job for the proxy, then every
/// piece's wait and copies back. Without stream memory operations each piece's host side is
/// waited for here (at most `host_wait`) before its copies back.
pub(crate) fn enqueue(
    stream: &dyn StagingStream,
    proxy: &ProxyThread,
    seq: u64,
    pieces: Vec<Piece>,
    input: &Arc<dyn StagingMemory>,
    output: &Arc<dyn StagingMemory>,
    host_wait: Duration,
) -> Result<()> {
    let mut waits = Vec::with_capacity(pieces.len());
    for piece in pieces {
        for &(src, to, at) in &piece.copy_in {
            stream.copy_in(src, to, at)?;
        }
        let ready = stream.mark()?;
        let ticket = proxy.next_ticket();
        let done = Arc::new(Outcome::default());
        proxy.submit(Job {
            seq,
            ticket,
            work: piece.work,
            input_at: piece.input_at,
            output_at: piece.output_at,
            ready,
            input: input.clone(),
            output: output.clone(),
            done: done.clone(),
            direct: None,
        })?;
        waits.push((ticket, done, piece.copy_back));
    }
    for (ticket, done, copy_back) in waits {
        if !stream.wait_release(ticket)? {
            match done.wait(host_wait) {
                Some(r) => r?,
                None => return Err(CudaError::Other("proxy did not answer".into())),
            }
        }
        for (at, dst) in copy_back {
            stream.copy_back(at, dst)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::harness::{config, start, Counter, HostStaging, Mark};
    use std::sync::Mutex;
    use weftcc_collectives::{DataType, RawOp};
    use weftcc_transports::lock;

    /// Chunks cover the call exactly, in order, each at most the chunk size (whole elements),
    /// keeping the call's kind, type, reduction and root; calls that are not element-wise, fit
    /// one chunk, or have chunking off run whole.
    #[test]
    fn chunks_cover_the_call() {
        for kind in [OpKind::AllReduce, OpKind::Broadcast, OpKind::Reduce] {
            for dtype in [DataType::Int8, DataType::Float16, DataType::Float64] {
                for (count, chunk) in [(1000, 100), (1001, 100), (7, 1), (10, 3), (64, 64 * 8)] {
                    let call = RawOp::new(kind, dtype, count).with_root(1);
                    let cut = chunks(&call, chunk);
                    let per = (chunk / dtype.size()).max(1);
                    let mut next = 0;
                    for (c, at) in &cut {
                        assert_eq!(*at, next * dtype.size(), "{kind} {dtype} {count}/{chunk}");
                        assert!(c.count >= 1 && c.count <= per);
                        assert_eq!((c.kind, c.dtype, c.op, c.root), (kind, dtype, call.op, 1));
                        next += c.count;
                    }
                    assert_eq!(next, count);
                    assert_eq!(cut.len(), count.div_ceil(per).max(1));
                }
            }
        }
        let whole = |call: RawOp, chunk| chunks(&call, chunk) == vec![(call, 0)];
        for kind in [OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllToAll] {
            assert!(whole(RawOp::new(kind, DataType::Float32, 1 << 20), 1024));
        }
        assert!(whole(
            RawOp::new(OpKind::AllReduce, DataType::Float32, 1 << 20),
            0
        ));
        assert!(whole(
            RawOp::new(OpKind::AllReduce, DataType::Float32, 256),
            1024
        ));
        assert!(whole(
            RawOp::new(OpKind::AllReduce, DataType::Float32, 0),
            1024
        ));
    }

    /// Every copy stays inside the caller's buffers and its piece's staging bytes, the
    /// pieces' staging bytes are apart, and the copies back cover the receive buffer exactly
    /// once where the call writes it (nothing off a reduce's root).
    #[test]
    fn pieces_stay_inside_the_callers_buffers_and_apart() {
        let inside = |s: DevSpan, outer: DevSpan| {
            s.bytes == 0
                || (s.ptr >= outer.ptr && s.ptr + s.bytes as u64 <= outer.ptr + outer.bytes as u64)
        };
        for kind in [
            OpKind::AllReduce,
            OpKind::Broadcast,
            OpKind::Reduce,
            OpKind::AllGather,
        ] {
            for count in [0usize, 1, 999, 1000, 1001] {
                for chunk in [0usize, 1, 8, 1000, 4096] {
                    for (in_place, empty_recv) in [(false, false), (true, false), (false, true)] {
                        for rank in [0usize, 1] {
                            let call = RawOp::new(kind, DataType::Float64, count).with_root(1);
                            let n = if kind == OpKind::AllGather { 2 } else { 1 };
                            let bytes = count * 8;
                            let send = (!in_place).then_some(DevSpan {
                                ptr: 1 << 30,
                                bytes,
                            });
                            let recv = DevSpan {
                                ptr: 1 << 40,
                                bytes: if empty_recv { 0 } else { n * bytes },
                            };
                            let case = format!("{kind} x{count} chunk {chunk} in place {in_place} empty {empty_recv} rank {rank}");
                            let ps = pieces(
                                Work::Collective {
                                    op: call,
                                    send,
                                    recv,
                                },
                                rank,
                                chunk,
                            );
                            let mut staged_out: Vec<(usize, usize)> = Vec::new();
                            let mut covered = 0;
                            for p in &ps {
                                let Work::Collective {
                                    send: s, recv: r, ..
                                } = p.work
                                else {
                                    panic!("{case}: a collective's piece is a group");
                                };
                                assert!(
                                    s.is_none_or(|s| send.is_some_and(|o| inside(s, o))),
                                    "{case}"
                                );
                                assert!(inside(r, recv), "{case}");
                                let (ib, ob) = p.work.staged_bytes();
                                for &(src, side, at) in &p.copy_in {
                                    let (base, len) = match side {
                                        Side::Input => (p.input_at, ib),
                                        Side::Output => (p.output_at, ob),
                                    };
                                    assert!(at >= base && at + src.bytes <= base + len, "{case}");
                                    assert!(inside(src, send.unwrap_or(recv)), "{case}");
                                }
                                for &(at, dst) in &p.copy_back {
                                    assert!(
                                        at >= p.output_at && at + dst.bytes <= p.output_at + ob,
                                        "{case}"
                                    );
                                    assert!(inside(dst, recv), "{case}");
                                    covered += dst.bytes;
                                }
                                staged_out.push((p.output_at, ob));
                            }
                            staged_out.sort_unstable();
                            assert!(
                                staged_out.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
                                "{case}"
                            );
                            let writes = !(kind == OpKind::Reduce && rank != 1);
                            assert_eq!(covered, if writes { recv.bytes } else { 0 }, "{case}");
                            if chunk == 0 || kind == OpKind::AllGather || bytes <= chunk.max(8) {
                                assert_eq!(ps.len(), 1, "{case}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Off the root a broadcast's send buffer and an out-of-place reduce's receive buffer may
    /// have any length (`RawOp::plan`): they are neither copied nor cut, whole or in chunks.
    #[test]
    fn sides_a_call_does_not_use_are_neither_copied_nor_cut() {
        let short = DevSpan {
            ptr: 1 << 30,
            bytes: 4,
        };
        let full = DevSpan {
            ptr: 1 << 40,
            bytes: 8000,
        };
        for chunk in [0, 1000] {
            // Rank 0 of a call rooted at rank 1, with a short send (or receive) buffer.
            let off_root = |kind, send, recv| {
                let op = RawOp::new(kind, DataType::Float64, 1000).with_root(1);
                let send = Some(send);
                pieces(Work::Collective { op, send, recv }, 0, chunk)
            };
            let ps = off_root(OpKind::Broadcast, short, full);
            assert!(ps.iter().all(|p| p.copy_in.is_empty()), "chunk {chunk}");
            let copied_back: usize = ps
                .iter()
                .flat_map(|p| &p.copy_back)
                .map(|c| c.1.bytes)
                .sum();
            assert_eq!(copied_back, 8000);
            assert!(ps.iter().all(|p| p.work.staged_bytes().0 == 0));
            let ps = off_root(OpKind::Reduce, full, short);
            assert!(ps.iter().all(|p| p.copy_back.is_empty()), "chunk {chunk}");
            assert!(ps.iter().all(|p| p.work.staged_bytes().1 == 0));
            let copied_in: usize = ps.iter().flat_map(|p| &p.copy_in).map(|c| c.0.bytes).sum();
            assert_eq!(copied_in, 8000);
        }
    }

    /// One rank's device memory and stream, in host memory: every operation runs when
    /// enqueued, in order, as the GPU runs a stream; the wait for the proxy blocks.
    struct HostStream<'a> {
        device: &'a Mutex<Vec<u8>>,
        input: &'a HostStaging,
        output: &'a HostStaging,
        counter: &'a Counter,
    }

    impl StagingStream for HostStream<'_> {
        fn copy_in(&self, src: DevSpan, to: Side, at: usize) -> Result<()> {
            let device = lock(self.device);
            let buf = match to {
                Side::Input => self.input,
                Side::Output => self.output,
            };
            let from = src.ptr as usize;
            lock(&buf.0)[at..at + src.bytes].copy_from_slice(&device[from..from + src.bytes]);
            Ok(())
        }

        fn mark(&self) -> Result<Box<dyn Ready>> {
            let mark = Mark::default();
            mark.pass();
            Ok(Box::new(mark))
        }

        fn wait_release(&self, ticket: u32) -> Result<bool> {
            match self.counter.wait_for(ticket, Duration::from_secs(60)) {
                true => Ok(true),
                false => Err(CudaError::Other(format!("ticket {ticket} never released"))),
            }
        }

        fn copy_back(&self, at: usize, dst: DevSpan) -> Result<()> {
            let to = dst.ptr as usize;
            lock(self.device)[to..to + dst.bytes]
                .copy_from_slice(&lock(&self.output.0)[at..at + dst.bytes]);
            Ok(())
        }
    }

    /// Rank `r`'s input: small integers, exact in every type and sum.
    fn input(dtype: DataType, r: usize, elems: usize) -> Vec<u8> {
        (0..elems)
            .flat_map(|i| {
                let v = ((r * 7 + i * 3) % 101) as i64;
                match dtype {
                    DataType::Int32 => (v as i32).to_ne_bytes().to_vec(),
                    _ => (v as f64).to_ne_bytes().to_vec(),
                }
            })
            .collect()
    }

    fn sum(dtype: DataType, n: usize, elems: usize) -> Vec<u8> {
        let ins: Vec<Vec<u8>> = (0..n).map(|r| input(dtype, r, elems)).collect();
        let es = dtype.size();
        (0..elems)
            .flat_map(|i| {
                let at = i * es..(i + 1) * es;
                match dtype {
                    DataType::Int32 => {
                        let s: i32 = ins
                            .iter()
                            .map(|b| i32::from_ne_bytes(b[at.clone()].try_into().unwrap()))
                            .sum();
                        s.to_ne_bytes().to_vec()
                    }
                    _ => {
                        let s: f64 = ins
                            .iter()
                            .map(|b| f64::from_ne_bytes(b[at.clone()].try_into().unwrap()))
                            .sum();
                        s.to_ne_bytes().to_vec()
                    }
                }
            })
            .collect()
    }

    /// What device memory holds before a call writes it.
    const GARBAGE: u8 = 0xEE;
    const SEND_AT: u64 = 0;
    const RECV_AT: u64 = 1 << 20;

    /// One call staged in pieces on `rank` of `n`: its receive buffer before and after.
    #[allow(clippy::too_many_arguments)]
    fn staged_call(
        rank: &crate::proxy::harness::Rank,
        n: usize,
        seq: u64,
        call: RawOp,
        in_place: bool,
        empty_recv: bool,
        chunk: usize,
    ) -> (Vec<u8>, Vec<u8>) {
        let (r, es) = (rank.host.rank(), call.dtype.size());
        let blocks = matches!(call.kind, OpKind::ReduceScatter | OpKind::AllToAll);
        let in_elems = if blocks { n * call.count } else { call.count };
        let out_elems = match call.kind {
            OpKind::AllGather | OpKind::AllToAll => n * call.count,
            _ => call.count,
        };
        let recv_elems = if in_place {
            in_elems.max(out_elems)
        } else {
            out_elems
        };
        let recv_bytes = if empty_recv { 0 } else { recv_elems * es };
        let mine = input(call.dtype, r, in_elems);
        let mut device = vec![GARBAGE; RECV_AT as usize + recv_bytes];
        let send = if in_place {
            let plan = call.plan(r, n, None, recv_bytes).expect("plan");
            let at = RECV_AT as usize + plan.input_offset;
            device[at..at + mine.len()].copy_from_slice(&mine);
            None
        } else {
            device[..mine.len()].copy_from_slice(&mine);
            Some(DevSpan {
                ptr: SEND_AT,
                bytes: mine.len(),
            })
        };
        let work = Work::Collective {
            op: call,
            send,
            recv: DevSpan {
                ptr: RECV_AT,
                bytes: recv_bytes,
            },
        };
        let pieces = pieces(work, r, chunk);
        let (in_bytes, out_bytes) = staging_bytes(&pieces);
        let input = HostStaging::new(vec![0; in_bytes]);
        let output = HostStaging::new(vec![0; out_bytes]);
        let before = device[RECV_AT as usize..].to_vec();
        let device = Mutex::new(device);
        let stream = HostStream {
            device: &device,
            input: &input,
            output: &output,
            counter: &rank.counter,
        };
        let (i, o): (Arc<dyn StagingMemory>, Arc<dyn StagingMemory>) =
            (input.clone(), output.clone());
        enqueue(
            &stream,
            &rank.proxy,
            seq,
            pieces,
            &i,
            &o,
            Duration::from_secs(60),
        )
        .expect("enqueue");
        let device = device.into_inner().unwrap_or_else(|p| p.into_inner());
        (before, device[RECV_AT as usize..].to_vec())
    }

    /// What the receive buffer must hold (`None`: untouched).
    fn expected(call: &RawOp, n: usize, me: usize) -> Option<Vec<u8>> {
        let (t, c, es) = (call.dtype, call.count, call.dtype.size());
        match call.kind {
            OpKind::AllReduce => Some(sum(t, n, c)),
            OpKind::Reduce => (me == call.root).then(|| sum(t, n, c)),
            OpKind::Broadcast => Some(input(t, call.root, c)),
            OpKind::AllGather => Some((0..n).flat_map(|r| input(t, r, c)).collect()),
            OpKind::ReduceScatter => {
                Some(sum(t, n, n * c)[me * c * es..(me + 1) * c * es].to_vec())
            }
            OpKind::AllToAll => Some(
                (0..n)
                    .flat_map(|r| input(t, r, n * c)[me * c * es..(me + 1) * c * es].to_vec())
                    .collect(),
            ),
            _ => None,
        }
    }

    /// Every staged collective, in and out of place, whole and in chunks (sizes that cut
    /// elements unevenly and leave a short last chunk), on 2 and 3 ranks whose host
    /// communicators run over the in-memory network provider, through the proxy and the
    /// stream-side loop the GPU path runs: each result against a reduction computed here.
    #[test]
    fn staged_pieces_give_every_collective_its_result() {
        for n in [2usize, 3] {
            let wrong = weftcc_comm::run_ranks(
                n,
                |r| config(r, Duration::from_secs(60)),
                |me, host| {
                    let rank = start(host);
                    let mut wrong = Vec::new();
                    let mut seq = 0;
                    let kinds = [
                        OpKind::AllReduce,
                        OpKind::Broadcast,
                        OpKind::Reduce,
                        OpKind::AllGather,
                        OpKind::ReduceScatter,
                        OpKind::AllToAll,
                    ];
                    for kind in kinds {
                        for dtype in [DataType::Int32, DataType::Float64] {
                            for count in [0usize, 1, 333, 1000] {
                                for chunk in [0usize, 1000, 4096] {
                                    for in_place in [false, true] {
                                        let call =
                                            RawOp::new(kind, dtype, count).with_root(n - 1);
                                        seq += 1;
                                        let (before, got) = staged_call(
                                            &rank, n, seq, call, in_place, false, chunk,
                                        );
                                        // In place, the output lies where the plan says.
                                        let out_at = match in_place {
                                            true => call
                                                .plan(me, n, None, got.len())
                                                .map_or(usize::MAX, |p| p.output_offset),
                                            false => 0,
                                        };
                                        let ok = match expected(&call, n, me) {
                                            Some(want) => {
                                                got.get(out_at..out_at + want.len())
                                                    == Some(&want[..])
                                            }
                                            None => got == before,
                                        };
                                        if !ok {
                                            wrong.push(format!(
                                                "rank {me}/{n}: {kind} {dtype} x{count} chunk {chunk} in place {in_place}"
                                            ));
                                        }
                                    }
                                }
                            }
                        }
                    }
                    // A reduce off the root with no receive buffer at all, in chunks.
                    let call = RawOp::new(OpKind::Reduce, DataType::Float64, 1000).with_root(0);
                    let (_, got) = staged_call(&rank, n, seq + 1, call, false, me != 0, 1000);
                    if me == 0 && got != sum(DataType::Float64, n, 1000) {
                        wrong.push(format!("rank {me}/{n}: reduce with empty receives off the root"));
                    }
                    assert!(rank.shared.check().is_ok(), "{:?}", rank.shared.check());
                    wrong
                },
            )
            .expect("ranks");
            let wrong: Vec<String> = wrong.into_iter().flatten().collect();
            assert!(
                wrong.is_empty(),
                "{} wrong:\n{}",
                wrong.len(),
                wrong.join("\n")
            );
        }
    }
}
