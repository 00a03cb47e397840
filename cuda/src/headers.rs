//! The operation header on the CUDA IPC path: mismatched collectives are an error on every
//! rank, before any of their data moves.
//!
//! The host engine sends the header ([`OpDesc`], `weftcc_collectives::header`) with the first
//! message to each peer and the receiver compares it. The IPC path has no host in its data
//! loop (stream waits on flags in IPC-mapped device memory), and a GPU stream cannot take back
//! work already enqueued: a header compared on the GPU would find the mismatch only after the
//! mismatched schedules were enqueued, with waits on flags that the peer's schedule never
//! raises. So the header is exchanged on the host, before the schedule is enqueued: every rank
//! all-gathers its encoded header (the same 40 bytes the host engine sends) over the host
//! communicator underneath, and compares every other rank's with its own ([`check`], pure).
//! Every rank sees the same headers, so when two differ every rank finds one that differs from
//! its own and fails with [`weftcc_comm::Error::Mismatch`] naming both descriptions; none
//! enqueues anything of the call, so no stream waits on a flag nobody raises, earlier
//! operations complete with correct data, and the message counters stay in step.
//!
//! A rank that calls no device collective at all (or a host collective instead) leaves the
//! others in the all-gather: the host communicator's timeout (`Error::Timeout`, naming the
//! ranks that had not entered) rather than a GPU stream that never drains.

use crate::error::{CudaError, Result};
use weftcc_collectives::{OpDesc, RawOp, HEADER_LEN};
use weftcc_comm::Communicator;

/// The header of the `seq`-th collective of an IPC device communicator (the sequence counts
/// the collectives, from 1, as the host communicator's does; send/recv groups are not counted:
/// they involve only some ranks).
pub(crate) fn desc(call: &RawOp, seq: u64) -> OpDesc {
    OpDesc::of_call(call, seq)
}

/// Exchanges headers with every rank of `host` and checks them ([`check`]).
pub(crate) fn exchange(host: &Communicator, ours: &OpDesc) -> Result<()> {
    let (rank, n) = (host.rank(), host.size());
    if n == 1 {
        return Ok(());
    }
    let mine = ours.encode(rank as u32);
    let mut all = vec![0u8; HEADER_LEN * n];
    host.all_gather(&mine[..], &mut all[..])?;
    check(rank, ours, &all)
}

/// Exchanges a send/recv group's headers with each peer it touches and checks them
/// ([`check_pair`]): to each peer this rank sends both its headers for that peer, what it sends
/// and what it expects (`p2p::pair_headers`), and receives the peer's, so both ends of a pair
/// whose messages differ find it before either enqueues anything. A peer that has no part in
/// this group while this rank does leaves it waiting: the host communicator's timeout.
pub(crate) fn exchange_pairs(host: &Communicator, pairs: &[(usize, OpDesc, OpDesc)]) -> Result<()> {
    let rank = host.rank();
    let mine: Vec<[u8; 2 * HEADER_LEN]> = pairs
        .iter()
        .map(|(_, out, inbound)| pair_record(rank, out, inbound))
        .collect();
    let mut theirs = vec![[0u8; 2 * HEADER_LEN]; pairs.len()];
    let mut group = host.group();
    for ((peer, ..), record) in pairs.iter().zip(&mine) {
        group = group.send(&record[..], *peer);
    }
    for ((peer, ..), record) in pairs.iter().zip(theirs.iter_mut()) {
        group = group.recv(&mut record[..], *peer);
    }
    group.run()?;
    for (&(peer, out, inbound), record) in pairs.iter().zip(&theirs) {
        check_pair(rank, peer, &out, &inbound, record)?;
    }
    Ok(())
}

/// What a rank sends a peer of its group: its header for what it sends the peer, then for what
/// it expects from it.
fn pair_record(rank: usize, out: &OpDesc, inbound: &OpDesc) -> [u8; 2 * HEADER_LEN] {
    let mut record = [0u8; 2 * HEADER_LEN];
    let (a, b) = record.split_at_mut(HEADER_LEN);
    for (half, desc) in [(a, out), (b, inbound)] {
        half.copy_from_slice(&desc.encode(rank as u32));
    }
    record
}

/// Compares the record `peer` sent (its header for what it sends this rank, then for what it
/// expects from it) with this rank's headers for that peer: what this rank expects (`inbound`)
/// must be what the peer sends, and the other way round. A difference is
/// [`weftcc_comm::Error::Mismatch`] naming this rank's header and the peer's.
pub(crate) fn check_pair(
    rank: usize,
    peer: usize,
    out: &OpDesc,
    inbound: &OpDesc,
    record: &[u8; 2 * HEADER_LEN],
) -> Result<()> {
    let (their_out, their_in) = record.split_at(HEADER_LEN);
    for (ours, theirs) in [(inbound, their_out), (out, their_in)] {
        if let Ok(theirs) = <&[u8; HEADER_LEN]>::try_from(theirs) {
            compare(rank, peer, ours, theirs)?;
        }
    }
    Ok(())
}

/// Compares `theirs`, the header `peer` sent, with `ours`: equal passes; a different call is
/// [`weftcc_comm::Error::Mismatch`] naming both; bytes that are not `peer`'s header are a
/// [`CudaError::Collective`] saying what is wrong with them.
fn compare(rank: usize, peer: usize, ours: &OpDesc, theirs: &[u8; HEADER_LEN]) -> Result<()> {
    if ours.is_encoded_in(peer as u32, theirs) {
        return Ok(());
    }
    let corrupt = |detail: String| CudaError::Collective {
        rank,
        op: ours.kind,
        seq: ours.seq,
        detail,
    };
    let (theirs, sender) = OpDesc::decode(theirs)
        .map_err(|e| corrupt(format!("bad operation header from rank {peer}: {e}")))?;
    if sender as usize != peer {
        return Err(corrupt(format!(
            "operation header of rank {sender} in rank {peer}'s place"
        )));
    }
    Err(CudaError::Host(weftcc_comm::Error::Mismatch {
        rank,
        peer,
        ours: *ours,
        theirs,
    }))
}

/// Compares every rank's header in `all` (rank order, [`HEADER_LEN`] bytes each, as the
/// all-gather leaves them) with `ours`, this rank's. The first rank whose header differs is
/// named: [`weftcc_comm::Error::Mismatch`] when it decodes (a different call), else a
/// [`CudaError::Collective`] saying what is wrong with it.
pub(crate) fn check(rank: usize, ours: &OpDesc, all: &[u8]) -> Result<()> {
    let corrupt = |detail: String| CudaError::Collective {
        rank,
        op: ours.kind,
        seq: ours.seq,
        detail,
    };
    if !all.len().is_multiple_of(HEADER_LEN) || all.len() / HEADER_LEN <= rank {
        return Err(corrupt(format!(
            "{} bytes of operation headers do not hold one per rank",
            all.len()
        )));
    }
    for (peer, chunk) in all.chunks_exact(HEADER_LEN).enumerate() {
        let Ok(bytes) = <&[u8; HEADER_LEN]>::try_from(chunk) else {
            continue; // chunks_exact: never short
        };
        if peer != rank {
            compare(rank, peer, ours, bytes)?;
        }
    }
    Ok(())
}

/// Whether `e` is a header mismatch, found here or by another rank that ended the
/// communicator for it (the call enqueued nothing: earlier operations are left to complete, no
/// flag is raised).
pub(crate) fn is_mismatch(e: &CudaError) -> bool {
    matches!(e, CudaError::Host(h) if h.abort_cause() == weftcc_comm::AbortCause::Mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use weftcc_collectives::schedule::p2p;
    use weftcc_collectives::{DataType, OpKind, ReduceOp};
    use weftcc_comm::{CommConfig, Error};

    fn all_reduce(count: usize) -> RawOp {
        RawOp::new(OpKind::AllReduce, DataType::Float32, count).with_op(ReduceOp::Sum)
    }

    fn gathered(descs: &[OpDesc]) -> Vec<u8> {
        descs
            .iter()
            .enumerate()
            .flat_map(|(r, d)| d.encode(r as u32))
            .collect()
    }

    #[test]
    fn equal_headers_pass() {
        let d = desc(&all_reduce(10), 3);
        let all = gathered(&[d, d, d]);
        for r in 0..3 {
            assert_eq!(check(r, &d, &all), Ok(()));
        }
    }

    #[test]
    fn every_rank_names_a_rank_that_differs_and_both_descriptions() {
        // Ranks 0 and 1 agree, rank 2 called another count: each of the three fails.
        let a = desc(&all_reduce(10), 1);
        let b = desc(&all_reduce(11), 1);
        let all = gathered(&[a, a, b]);
        let expect = [(0, 2, a, b), (1, 2, a, b), (2, 0, b, a)];
        for (rank, peer, ours, theirs) in expect {
            let e = check(rank, &ours, &all).expect_err("a mismatch");
            assert_eq!(
                e,
                CudaError::Host(Error::Mismatch {
                    rank,
                    peer,
                    ours,
                    theirs
                })
            );
            assert!(is_mismatch(&e));
            let facts = e.facts();
            assert_eq!(
                (facts.rank, facts.peer, facts.op, facts.seq),
                (Some(rank), Some(peer), Some(OpKind::AllReduce), Some(1))
            );
            let text = e.to_string();
            assert!(text.contains(&ours.to_string()), "{text}");
            assert!(text.contains(&theirs.to_string()), "{text}");
        }
    }

    #[test]
    fn kind_type_op_root_and_sequence_each_make_a_mismatch() {
        let base = RawOp::new(OpKind::Reduce, DataType::Float32, 8)
            .with_op(ReduceOp::Sum)
            .with_root(0);
        let ours = desc(&base, 5);
        let others = [
            desc(
                &RawOp::new(OpKind::AllReduce, DataType::Float32, 8).with_op(ReduceOp::Sum),
                5,
            ),
            desc(&base.with_root(1), 5),
            desc(&base.with_op(ReduceOp::Max), 5),
            desc(
                &RawOp {
                    dtype: DataType::Int32,
                    ..base
                },
                5,
            ),
            desc(&base, 6),
        ];
        for theirs in others {
            assert_ne!(ours, theirs);
            let all = gathered(&[ours, theirs]);
            assert!(is_mismatch(&check(0, &ours, &all).unwrap_err()), "{theirs}");
            assert!(
                is_mismatch(&check(1, &theirs, &all).unwrap_err()),
                "{theirs}"
            );
        }
    }

    #[test]
    fn fields_a_kind_ignores_never_make_a_mismatch() {
        // An all-gather has no reduction and no root; a broadcast has no reduction.
        let ag = RawOp::new(OpKind::AllGather, DataType::Uint8, 4);
        let a = desc(&ag.with_op(ReduceOp::Sum).with_root(0), 2);
        let b = desc(&ag.with_op(ReduceOp::Max).with_root(1), 2);
        assert_eq!(a, b);
        let bc = RawOp::new(OpKind::Broadcast, DataType::Uint8, 4).with_root(1);
        assert_eq!(
            desc(&bc.with_op(ReduceOp::Sum), 2),
            desc(&bc.with_op(ReduceOp::Min), 2)
        );
        // PreMulSum's factor is not compared (it is each rank's own scale).
        let ar = all_reduce(4);
        assert_eq!(
            desc(&ar.with_op(ReduceOp::PreMulSum(2.0)), 1),
            desc(&ar.with_op(ReduceOp::PreMulSum(3.0)), 1)
        );
    }

    #[test]
    fn a_corrupt_or_misplaced_header_is_an_error_not_a_pass() {
        let d = desc(&all_reduce(10), 1);
        let mut all = gathered(&[d, d]);
        all[HEADER_LEN + 3] ^= 0x40; // rank 1's magic
        let e = check(0, &d, &all).unwrap_err();
        assert!(
            matches!(&e, CudaError::Collective { rank: 0, seq: 1, detail, .. } if detail.contains("rank 1")),
            "{e:?}"
        );
        // Rank 1's slot holds a header rank 0 encoded.
        let all = [d.encode(0), d.encode(0)].concat();
        let e = check(0, &d, &all).unwrap_err();
        assert!(matches!(e, CudaError::Collective { .. }), "{e:?}");
        // Not one header per rank.
        let e = check(2, &d, &gathered(&[d, d])).unwrap_err();
        assert!(matches!(e, CudaError::Collective { .. }), "{e:?}");
    }

    fn config() -> CommConfig {
        let mut c = CommConfig::from_env().expect("config from env");
        c.timeout = Duration::from_secs(30);
        c
    }

    /// The exchange over real host communicators (ranks as threads, shared memory): calls that
    /// agree pass, and when one rank calls another count and then another kind every rank gets
    /// the mismatch, and the host communicator stays usable (the check enqueued nothing).
    #[test]
    fn exchange_over_host_communicators_fails_on_every_rank() {
        let results = weftcc_comm::run_ranks(
            3,
            |_| config(),
            |rank, host| {
                let same = desc(&all_reduce(16), 1);
                exchange(&host, &same).expect("agreeing headers");
                let count = desc(&all_reduce(if rank == 1 { 17 } else { 16 }), 2);
                let by_count = exchange(&host, &count);
                let kind = if rank == 2 {
                    desc(&RawOp::new(OpKind::AllGather, DataType::Float32, 16), 3)
                } else {
                    desc(&all_reduce(16), 3)
                };
                let by_kind = exchange(&host, &kind);
                host.barrier().expect("host communicator still usable");
                (by_count, by_kind)
            },
        )
        .expect("ranks");
        for (rank, (by_count, by_kind)) in results.into_iter().enumerate() {
            match by_count {
                Err(CudaError::Host(Error::Mismatch {
                    rank: r,
                    peer,
                    ours,
                    theirs,
                })) => {
                    assert_eq!(r, rank);
                    assert_eq!(peer, if rank == 1 { 0 } else { 1 });
                    assert_eq!(ours.count, if rank == 1 { 17 } else { 16 });
                    assert_eq!(theirs.count, if rank == 1 { 16 } else { 17 });
                }
                other => panic!("rank {rank}: expected a count mismatch, got {other:?}"),
            }
            match by_kind {
                Err(CudaError::Host(Error::Mismatch { ours, theirs, .. })) => {
                    assert_ne!(ours.kind, theirs.kind, "rank {rank}");
                    assert_eq!((ours.seq, theirs.seq), (3, 3));
                }
                other => panic!("rank {rank}: expected a kind mismatch, got {other:?}"),
            }
        }
    }

    fn group(
        rank: usize,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
        seqs: &mut (Vec<u64>, Vec<u64>),
    ) -> Vec<(usize, OpDesc, OpDesc)> {
        let list = |l: &[(usize, usize)]| -> Vec<(usize, u64, usize)> {
            l.iter().map(|&(p, b)| (p, 0, b)).collect()
        };
        let g = p2p::group_schedule(&list(sends), &list(recvs), 1 << 20);
        let _ = rank;
        p2p::pair_headers(&g, &mut seqs.0, &mut seqs.1)
    }

    fn record_of(
        rank: usize,
        pairs: &[(usize, OpDesc, OpDesc)],
        to: usize,
    ) -> [u8; 2 * HEADER_LEN] {
        let (_, out, inbound) = pairs.iter().find(|p| p.0 == to).copied().expect("a pair");
        pair_record(rank, &out, &inbound)
    }

    #[test]
    fn both_ends_of_a_pair_find_a_size_mismatch_in_either_direction() {
        let fresh = || (vec![0u64; 2], vec![0u64; 2]);
        // Rank 0 sends 100 bytes to rank 1 and receives 8 from it.
        let a = group(0, &[(1, 100)], &[(1, 8)], &mut fresh());
        let matching = group(1, &[(0, 8)], &[(0, 100)], &mut fresh());
        let (_, a_out, a_in) = a[0];
        let (_, b_out, b_in) = matching[0];
        assert_eq!(
            check_pair(0, 1, &a_out, &a_in, &record_of(1, &matching, 0)),
            Ok(())
        );
        assert_eq!(
            check_pair(1, 0, &b_out, &b_in, &record_of(0, &a, 1)),
            Ok(())
        );
        // Rank 1 expects 101 bytes: both ends fail naming the other and both headers.
        let wrong = group(1, &[(0, 8)], &[(0, 101)], &mut fresh());
        let (_, w_out, w_in) = wrong[0];
        match check_pair(0, 1, &a_out, &a_in, &record_of(1, &wrong, 0)) {
            Err(CudaError::Host(Error::Mismatch {
                rank: 0,
                peer: 1,
                ours,
                theirs,
            })) => {
                assert_eq!((ours.count, theirs.count), (100, 101));
                assert_eq!(ours.kind, OpKind::SendRecv);
            }
            other => panic!("{other:?}"),
        }
        match check_pair(1, 0, &w_out, &w_in, &record_of(0, &a, 1)) {
            Err(
                e @ CudaError::Host(Error::Mismatch {
                    rank: 1, peer: 0, ..
                }),
            ) => {
                assert!(is_mismatch(&e));
                assert!(e.to_string().contains("101 bytes"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        // The same bytes cut differently (two sends of 50 against one receive of 100).
        let split = group(0, &[(1, 50), (1, 50)], &[(1, 8)], &mut fresh());
        let (_, s_out, s_in) = split[0];
        assert!(check_pair(0, 1, &s_out, &s_in, &record_of(1, &matching, 0)).is_err());
        // A record that is not one: an error, not a pass.
        let e = check_pair(0, 1, &a_out, &a_in, &[0u8; 2 * HEADER_LEN]).unwrap_err();
        assert!(matches!(e, CudaError::Collective { .. }), "{e:?}");
        // Another rank's record in the peer's place.
        let e = check_pair(0, 1, &a_out, &a_in, &record_of(2, &matching, 0)).unwrap_err();
        assert!(matches!(e, CudaError::Collective { .. }), "{e:?}");
    }

    /// Three ranks as threads: a ring shift whose sizes agree passes on every rank; then rank 1
    /// expects one byte more from rank 0 than rank 0 sends: ranks 0 and 1 both fail naming each
    /// other, rank 2 (its pairs agree) passes, and the pair counters go on for the next group.
    #[test]
    fn pair_exchange_over_host_communicators_fails_on_both_ends_only() {
        let n = 3;
        let results = weftcc_comm::run_ranks(
            n,
            |_| config(),
            |rank, host| {
                let (to, from) = ((rank + 1) % n, (rank + n - 1) % n);
                let mut seqs = (vec![0u64; n], vec![0u64; n]);
                let ring = group(rank, &[(to, 64)], &[(from, 64)], &mut seqs);
                exchange_pairs(&host, &ring).expect("agreeing sizes");
                let expect = if rank == 1 { 65 } else { 64 };
                let odd = group(rank, &[(to, 64)], &[(from, expect)], &mut seqs);
                let to_next = odd.iter().find(|p| p.0 == to).expect("pair");
                assert_eq!(to_next.1.seq, 1, "the pair's second message");
                let r = exchange_pairs(&host, &odd);
                host.barrier().expect("host communicator still usable");
                r
            },
        )
        .expect("ranks");
        match &results[0] {
            Err(CudaError::Host(Error::Mismatch {
                peer: 1,
                ours,
                theirs,
                ..
            })) => {
                assert_eq!((ours.count, theirs.count, ours.seq), (64, 65, 1));
            }
            other => panic!("rank 0: {other:?}"),
        }
        match &results[1] {
            Err(CudaError::Host(Error::Mismatch {
                peer: 0,
                ours,
                theirs,
                ..
            })) => {
                assert_eq!((ours.count, theirs.count), (65, 64));
            }
            other => panic!("rank 1: {other:?}"),
        }
        assert_eq!(results[2], Ok(()));
    }

    #[test]
    fn one_rank_has_nothing_to_compare() {
        let r = weftcc_comm::run_ranks(
            1,
            |_| config(),
            |_, host| exchange(&host, &desc(&all_reduce(3), 1)),
        )
        .expect("rank");
        assert_eq!(r, vec![Ok(())]);
    }
}
