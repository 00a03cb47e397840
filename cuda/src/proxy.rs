//! The staged transport's proxy: one thread per communicator that runs the host side of every
//! operation staged through pinned memory, in the order the caller's streams enqueued them.
//!
//! A job is one staged collective or group with a ticket `n` (1, 2, … in enqueue order). The
//! proxy waits until the caller's stream has filled the staging buffers (the job's [`Ready`]
//! event), runs the host collective or group on them over the host communicator, then raises
//! the release counter to `n` ([`Release`]), which the stream waits for
//! (`cuStreamWaitValue32 ≥ n`) before it copies the results back. The counter is raised
//! whatever happened: a failed job poisons the communicator (a tier's failure ends the whole
//! communicator, see `comm.rs`), and the stream runs on with garbage instead of waiting for a
//! flag nobody will raise. Once poisoned, later jobs are released without running. Stopping the
//! proxy raises the counter to the last ticket issued, releasing any job never processed.
//!
//! The GPU's parts are behind three small traits ([`Ready`], [`StagingMemory`], [`Release`]),
//! implemented here by [`Event`] and [`PinnedBuffer`]: the state machine runs in tests without
//! a GPU, its host side over the in-memory network provider.

use crate::comm::{Shared, Work};
use crate::error::{CudaError, Result};
use crate::gdr::GdrRing;
use crate::headers;
use crate::memory::{Event, PinnedBuffer};
use std::ops::DerefMut;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use weftcc_collectives::Combiner;
use weftcc_comm::Communicator;
use weftcc_transports::lock;
use weftcc_transports::net::device::DeviceMemory;

/// The point on the caller's stream after the staging buffers were filled.
pub(crate) trait Ready: Send {
    /// Waits (at most `timeout`) until the stream has passed it.
    fn wait(&self, timeout: Duration) -> Result<()>;
}

/// Bytes of a staging buffer as the host sees them.
pub(crate) type HostBytes<'a> = Box<dyn DerefMut<Target = [u8]> + 'a>;

/// A staging buffer the stream fills and empties around the job's host side.
pub(crate) trait StagingMemory: Send + Sync {
    /// Its `len` bytes at `at`, for the host side of the job that owns them now (nothing else
    /// touches them meanwhile: see [`PinnedBuffer`]'s implementation). Empty when `len` is 0,
    /// wherever `at` lies (a buffer the call does not use is not sized for its offset).
    fn host_bytes(&self, at: usize, len: usize) -> Result<HostBytes<'_>>;
}

/// The counter the caller's streams wait on.
pub(crate) trait Release: Send + Sync {
    /// Raises it to `ticket` (the waits compare `≥`, cyclically).
    fn release(&self, ticket: u32);
}

/// How a job ended, for an enqueue that waits for it (no stream memory operations).
#[derive(Default)]
pub(crate) struct Outcome {
    result: Mutex<Option<Result<()>>>,
    ready: Condvar,
}

impl Outcome {
    fn set(&self, r: Result<()>) {
        *lock(&self.result) = Some(r);
        self.ready.notify_all();
    }

    /// The job's result, or `None` if it did not end within `timeout`.
    pub(crate) fn wait(&self, timeout: Duration) -> Option<Result<()>> {
        let g = lock(&self.result);
        let (g, _) = self
            .ready
            .wait_timeout_while(g, timeout, |r| r.is_none())
            .unwrap_or_else(|p| p.into_inner());
        g.clone()
    }
}

/// One staged operation for the proxy.
pub(crate) struct Job {
    /// The device communicator's operation number.
    pub(crate) seq: u64,
    /// Its place in the stream order (module docs).
    pub(crate) ticket: u32,
    /// What the host communicator runs for it.
    pub(crate) work: Work,
    /// Where the job's bytes start in `input` and `output` (a chunk of a larger call).
    pub(crate) input_at: usize,
    pub(crate) output_at: usize,
    /// Passed once the stream filled `input` (or `output`, in place).
    pub(crate) ready: Box<dyn Ready>,
    pub(crate) input: Arc<dyn StagingMemory>,
    pub(crate) output: Arc<dyn StagingMemory>,
    pub(crate) done: Arc<Outcome>,
    /// Run on the GPUDirect RDMA ring instead of staging (its staging buffers are unused).
    pub(crate) direct: Option<Direct>,
}

/// An all-reduce the GPUDirect RDMA ring runs in place on the caller's device memory: the
/// NIC writes from and into it, the device reduces; nothing is staged. The job's work gives
/// the count and type; its ready mark is passed once the stream placed the input in `buf`.
pub(crate) struct Direct {
    /// The device allocation holding the buffer (registered whole, cached until freed).
    pub(crate) buf: Arc<dyn DeviceMemory>,
    /// The buffer's byte offset in it.
    pub(crate) offset: usize,
    /// The reduction.
    pub(crate) comb: Combiner,
}

/// The proxy thread, its queue and its tickets.
pub(crate) struct ProxyThread {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<JoinHandle<()>>,
    release: Arc<dyn Release>,
    tickets: AtomicU32,
}

impl ProxyThread {
    /// Starts the thread. `bind` runs on it first (makes the GPU's context current); if it
    /// fails, every job fails with its error and is released. `gdr`, the GPUDirect RDMA ring,
    /// runs the [`Direct`] jobs.
    pub(crate) fn start(
        bind: impl FnOnce() -> Result<()> + Send + 'static,
        host: Arc<Communicator>,
        shared: Arc<Shared>,
        release: Arc<dyn Release>,
        gdr: Option<Box<GdrRing>>,
    ) -> Result<ProxyThread> {
        let (tx, rx) = mpsc::channel::<Job>();
        let name = format!("weft-cuda-proxy-{}", host.rank());
        let flag = release.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let bound = bind();
                run(bound, &host, &shared, &*flag, gdr, rx)
            })
            .map_err(|e| CudaError::Other(format!("cannot start the proxy thread: {e}")))?;
        Ok(ProxyThread {
            tx: Mutex::new(Some(tx)),
            thread: Some(thread),
            release,
            tickets: AtomicU32::new(0),
        })
    }

    /// The next job's ticket. Tickets must reach [`ProxyThread::submit`] in the order they were
    /// taken (the caller holds one lock across both).
    pub(crate) fn next_ticket(&self) -> u32 {
        self.tickets.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    /// Queues `job` behind the jobs before it.
    pub(crate) fn submit(&self, job: Job) -> Result<()> {
        let stopped = || CudaError::Other("proxy thread stopped".into());
        lock(&self.tx)
            .as_ref()
            .ok_or_else(stopped)?
            .send(job)
            .map_err(|_| stopped())
    }
}

impl Drop for ProxyThread {
    fn drop(&mut self) {
        // Close the queue; the thread finishes the queued jobs (each bounded by the timeout)
        // and exits.
        drop(lock(&self.tx).take());
        if let Some(t) = self.thread.take() {
            // Not when this is the proxy thread (a failure hook running on it dropped the last
            // reference to the communicator): the thread ends once its queue is closed.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // Release any stream still waiting on a ticket that was never processed: the waits
        // compare cyclically (≥), so the last ticket issued releases every earlier one.
        self.release.release(self.tickets.load(Ordering::Relaxed));
    }
}

/// The proxy's loop: each job in turn, released whatever happened.
fn run(
    bound: Result<()>,
    host: &Communicator,
    shared: &Shared,
    release: &dyn Release,
    mut gdr: Option<Box<GdrRing>>,
    rx: mpsc::Receiver<Job>,
) {
    for job in rx {
        let r = match (&bound, shared.check()) {
            (_, Err(e)) => Err(e),
            (Err(e), _) => Err(e.clone()),
            (Ok(()), Ok(())) => match &job.direct {
                None => host_side(host, &job),
                Some(d) => direct_side(gdr.as_deref_mut(), host.timeout(), &job, d),
            },
        };
        let r = r.map_err(|e| match e {
            // A mismatch stays typed (it names both calls and their sequence number), as do
            // the ring's failures.
            e @ (CudaError::Poisoned { .. } | CudaError::Gdr(_)) => e,
            e if headers::is_mismatch(&e) => e,
            other => CudaError::Collective {
                rank: host.rank(),
                op: job.work.kind(),
                seq: job.seq,
                detail: other.to_string(),
            },
        });
        if let Err(e) = &r {
            shared.poison(e);
        }
        // Release the caller's stream whatever happened (an error is reported by the
        // communicator; the output of this operation is then garbage).
        release.release(job.ticket);
        job.done.set(r);
    }
}

/// A direct job: waits until the caller's stream placed the input, then runs the all-reduce
/// on the ring.
fn direct_side(ring: Option<&mut GdrRing>, timeout: Duration, job: &Job, d: &Direct) -> Result<()> {
    let Some(ring) = ring else {
        return Err(CudaError::Other("a direct job without a GDR ring".into()));
    };
    let Work::Collective { op, .. } = &job.work else {
        return Err(CudaError::Other(
            "a direct job that is not a collective".into(),
        ));
    };
    job.ready.wait(timeout)?;
    ring.all_reduce_in_place(d.buf.as_ref(), d.offset, op.count, op.dtype, d.comb)
        .map_err(|e| CudaError::Gdr(Box::new(e)))
}

/// The host side of a staged job: waits until the caller's stream has filled the staging
/// buffers, then runs the host collective or group on them.
fn host_side(host: &Communicator, job: &Job) -> Result<()> {
    job.ready.wait(host.timeout())?;
    let (in_bytes, out_bytes) = job.work.staged_bytes();
    let input = job.input.host_bytes(job.input_at, in_bytes)?;
    let mut output = job.output.host_bytes(job.output_at, out_bytes)?;
    match &job.work {
        Work::Collective { op, send, .. } => match send {
            Some(_) => host.execute_raw(*op, Some(&input), &mut output)?,
            None => host.execute_raw(*op, None, &mut output)?,
        },
        Work::Group { sends, recvs } => {
            let mut group = host.group();
            let mut rest: &[u8] = &input;
            for (peer, s) in sends {
                let (head, tail) = rest.split_at(s.bytes);
                group = group.send(head, *peer);
                rest = tail;
            }
            let mut rest: &mut [u8] = &mut output;
            for (peer, r) in recvs {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.bytes);
                group = group.recv(head, *peer);
                rest = tail;
            }
            group.run()?;
        }
    }
    Ok(())
}

impl Ready for Event {
    fn wait(&self, timeout: Duration) -> Result<()> {
        self.synchronize(timeout)
    }
}

impl StagingMemory for PinnedBuffer {
    /// The caller's stream writes the buffer by DMA before the job's ready event and reads it
    /// after the proxy raised the job's release counter, and the next job's copies wait for this
    /// one's copies back (`Staging::done` in `comm.rs`): while the proxy holds these bytes
    /// nothing else touches the memory.
    fn host_bytes(&self, at: usize, len: usize) -> Result<HostBytes<'_>> {
        if len == 0 {
            return Ok(Box::new(&mut [][..]));
        }
        if at.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(CudaError::Other("staging buffer too small".into()));
        }
        // SAFETY: the buffer holds at least `at + len` bytes of pinned host memory (checked),
        // alive as long as the borrow of `self`; by the ordering above this is the only access
        // to these bytes while the slice lives.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.host_ptr().add(at), len) };
        Ok(Box::new(bytes))
    }
}

impl Release for PinnedBuffer {
    fn release(&self, ticket: u32) {
        release_counter(self).store(ticket, Ordering::Release);
    }
}

/// The release counter: the first word of a pinned, host-mapped buffer.
pub(crate) fn release_counter(flag: &PinnedBuffer) -> &AtomicU32 {
    // SAFETY: the buffer holds at least 4 bytes of pinned memory, page aligned (so aligned for
    // u32), alive as long as `flag`; it is only accessed atomically by the host and read by the
    // GPU's wait operations.
    unsafe { &*(flag.host_ptr() as *const AtomicU32) }
}

#[cfg(test)]
pub(crate) mod harness {
    //! The proxy without a GPU: ranks are threads, each with a host communicator over the
    //! in-memory network provider (`WEFT_NET=loopback`, every rank a host of its own), the
    //! "stream" is the test thread filling host staging buffers and waiting for the release
    //! counter.
    use super::*;
    use std::sync::MutexGuard;
    use weftcc_comm::CommConfig;
    use weftcc_transports::net::{NetChoice, NetKind};

    /// A stream position the test passes by hand.
    #[derive(Clone, Default)]
    pub(crate) struct Mark(Arc<(Mutex<bool>, Condvar)>);

    impl Mark {
        pub(crate) fn pass(&self) {
            *lock(&self.0 .0) = true;
            self.0 .1.notify_all();
        }
    }

    impl Ready for Mark {
        fn wait(&self, timeout: Duration) -> Result<()> {
            let g = lock(&self.0 .0);
            let (g, _) = self
                .0
                 .1
                .wait_timeout_while(g, timeout, |passed| !*passed)
                .unwrap_or_else(|p| p.into_inner());
            if *g {
                Ok(())
            } else {
                Err(CudaError::Other(format!(
                    "event did not finish within {timeout:?}"
                )))
            }
        }
    }

    /// Host memory standing in for a pinned staging buffer.
    pub(crate) struct HostStaging(pub(crate) Mutex<Vec<u8>>);

    impl HostStaging {
        pub(crate) fn new(bytes: Vec<u8>) -> Arc<HostStaging> {
            Arc::new(HostStaging(Mutex::new(bytes)))
        }
        pub(crate) fn bytes(&self) -> Vec<u8> {
            lock(&self.0).clone()
        }
    }

    /// Bytes `range` of a staging buffer, held locked.
    pub(crate) struct Part<'a>(
        pub(crate) MutexGuard<'a, Vec<u8>>,
        pub(crate) std::ops::Range<usize>,
    );

    impl std::ops::Deref for Part<'_> {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            &self.0[self.1.clone()]
        }
    }

    impl DerefMut for Part<'_> {
        fn deref_mut(&mut self) -> &mut [u8] {
            let range = self.1.clone();
            &mut self.0[range]
        }
    }

    impl StagingMemory for HostStaging {
        fn host_bytes(&self, at: usize, len: usize) -> Result<HostBytes<'_>> {
            let g = lock(&self.0);
            if len == 0 {
                return Ok(Box::new(&mut [][..]));
            }
            if at + len > g.len() {
                return Err(CudaError::Other("staging buffer too small".into()));
            }
            Ok(Box::new(Part(g, at..at + len)))
        }
    }

    /// The release counter, recording every value it was raised to.
    #[derive(Default)]
    pub(crate) struct Counter {
        raised: Mutex<Vec<u32>>,
        changed: Condvar,
    }

    impl Release for Counter {
        fn release(&self, ticket: u32) {
            lock(&self.raised).push(ticket);
            self.changed.notify_all();
        }
    }

    impl Counter {
        /// What a stream's `wait ≥ ticket` does: true once raised that far, false after
        /// `timeout`.
        pub(crate) fn wait_for(&self, ticket: u32, timeout: Duration) -> bool {
            let g = lock(&self.raised);
            let (g, _) = self
                .changed
                .wait_timeout_while(g, timeout, |r| r.last().is_none_or(|&v| v < ticket))
                .unwrap_or_else(|p| p.into_inner());
            g.last().is_some_and(|&v| v >= ticket)
        }
        pub(crate) fn raised(&self) -> Vec<u32> {
            lock(&self.raised).clone()
        }
    }

    pub(crate) fn config(rank: usize, timeout: Duration) -> CommConfig {
        let mut c = CommConfig::from_env().expect("config");
        c.net = NetChoice {
            kind: NetKind::Loopback,
            ..NetChoice::default()
        };
        c.host_id = format!("proxy-test-host-{rank}");
        c.timeout = timeout;
        c
    }

    /// A rank's proxy with its counter and failure state.
    pub(crate) struct Rank {
        pub(crate) host: Arc<Communicator>,
        pub(crate) shared: Arc<Shared>,
        pub(crate) counter: Arc<Counter>,
        pub(crate) proxy: ProxyThread,
    }

    pub(crate) fn start(host: Communicator) -> Rank {
        let host = Arc::new(host);
        let shared = Arc::new(Shared::new(host.rank()));
        let counter = Arc::new(Counter::default());
        let proxy = ProxyThread::start(
            || Ok(()),
            host.clone(),
            shared.clone(),
            counter.clone() as Arc<dyn Release>,
            None,
        )
        .expect("proxy");
        Rank {
            host,
            shared,
            counter,
            proxy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::harness::*;
    use super::*;
    use crate::comm::DevSpan;
    use std::time::Instant;
    use weftcc_collectives::testing::buffer_counts;
    use weftcc_collectives::{DataType, OpKind, RawOp};
    use weftcc_comm::{AbortCause, Error as HostError};

    /// A job as `enqueue_staged` makes it; the spans' addresses are the device's and unused
    /// here, only their lengths.
    struct Staged {
        ticket: u32,
        mark: Mark,
        output: Arc<HostStaging>,
        done: Arc<Outcome>,
    }

    impl Rank {
        fn submit(&self, seq: u64, work: Work, input: Vec<u8>, output: Vec<u8>) -> Staged {
            let (mark, done) = (Mark::default(), Arc::new(Outcome::default()));
            let output = HostStaging::new(output);
            let ticket = self.proxy.next_ticket();
            self.proxy
                .submit(Job {
                    seq,
                    ticket,
                    work,
                    input_at: 0,
                    output_at: 0,
                    ready: Box::new(mark.clone()),
                    input: HostStaging::new(input),
                    output: output.clone(),
                    done: done.clone(),
                    direct: None,
                })
                .expect("submit");
            Staged {
                ticket,
                mark,
                output,
                done,
            }
        }
    }

    fn span(bytes: usize) -> DevSpan {
        DevSpan { ptr: 0, bytes }
    }

    /// `op` on `n` ranks as a job, its buffers' lengths as a test gives them; in place (no send
    /// buffer) when `in_place`.
    fn collective(op: RawOp, n: usize, in_place: bool) -> Work {
        let (send, recv) = buffer_counts(op.kind, op.count, n);
        let es = op.dtype.size();
        Work::Collective {
            op,
            send: (!in_place).then(|| span(send * es)),
            recv: span(recv * es),
        }
    }

    /// Runs `body` on `n` ranks, each with its proxy started, communicators timing out after
    /// `timeout`.
    fn on_ranks<T: Send>(
        n: usize,
        timeout: Duration,
        body: impl Fn(usize, Rank) -> T + Sync,
    ) -> Vec<T> {
        weftcc_comm::run_ranks(n, |r| config(r, timeout), |r, host| body(r, start(host)))
            .expect("ranks")
    }

    fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
        v.into_iter().flat_map(f32::to_ne_bytes).collect()
    }

    const N: usize = 3;

    #[test]
    fn jobs_run_in_ticket_order_over_the_network_and_release_their_streams() {
        on_ranks(N, Duration::from_secs(30), |r, rank| {
            // Four operations queued at once, as a stream enqueues them.
            let elems = 1000;
            let all_reduce = rank.submit(
                1,
                collective(
                    RawOp::new(OpKind::AllReduce, DataType::Float32, elems),
                    N,
                    false,
                ),
                f32_bytes((0..elems).map(|i| (i * (r + 1)) as f32)),
                vec![0; 4 * elems],
            );
            let broadcast = rank.submit(
                2,
                collective(
                    RawOp::new(OpKind::Broadcast, DataType::Uint8, 5000).with_root(1),
                    N,
                    true,
                ),
                Vec::new(),
                vec![r as u8 + 10; 5000],
            );
            let (to, from) = ((r + 1) % N, (r + N - 1) % N);
            let shift = rank.submit(
                3,
                Work::Group {
                    sends: vec![(to, span(3000))],
                    recvs: vec![(from, span(3000))],
                },
                vec![r as u8 + 100; 3000],
                vec![0; 3000],
            );
            let gather = rank.submit(
                4,
                collective(
                    RawOp::new(OpKind::AllGather, DataType::Int32, 100),
                    N,
                    false,
                ),
                (0..100i32)
                    .flat_map(|i| (i + 1000 * r as i32).to_ne_bytes())
                    .collect(),
                vec![0; 400 * N],
            );
            let jobs = [&all_reduce, &broadcast, &shift, &gather];
            // The proxy waits for each job's stream position: nothing is released before.
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                rank.counter.raised().is_empty(),
                "released before its stream was ready"
            );
            for job in jobs {
                job.mark.pass();
                assert!(
                    rank.counter.wait_for(job.ticket, Duration::from_secs(20)),
                    "rank {r}: ticket {} not released",
                    job.ticket
                );
                let outcome = job.done.wait(Duration::from_secs(5));
                assert!(matches!(outcome, Some(Ok(()))), "rank {r}: {outcome:?}");
            }
            assert_eq!(rank.counter.raised(), vec![1, 2, 3, 4], "rank {r}");
            assert_eq!(rank.host.transport_to(to), Some("net"));
            assert!(rank.shared.check().is_ok());
            let sum = (1..=N).sum::<usize>();
            assert_eq!(
                all_reduce.output.bytes(),
                f32_bytes((0..elems).map(|i| (i * sum) as f32)),
                "rank {r}: all-reduce"
            );
            assert_eq!(
                broadcast.output.bytes(),
                vec![11u8; 5000],
                "rank {r}: broadcast"
            );
            assert_eq!(
                shift.output.bytes(),
                vec![from as u8 + 100; 3000],
                "rank {r}: shift"
            );
            let want: Vec<u8> = (0..N as i32)
                .flat_map(|q| (0..100i32).map(move |i| i + 1000 * q))
                .flat_map(i32::to_ne_bytes)
                .collect();
            assert_eq!(gather.output.bytes(), want, "rank {r}: all-gather");
        });
    }

    #[test]
    fn a_mismatch_stays_typed_and_every_later_stream_is_released_without_running() {
        on_ranks(2, Duration::from_secs(30), |r, rank| {
            // Rank 1 calls one element more.
            let elems = 1000 + r;
            let bytes = 4 * elems;
            let work = || {
                collective(
                    RawOp::new(OpKind::AllReduce, DataType::Float32, elems),
                    2,
                    false,
                )
            };
            let first = rank.submit(1, work(), vec![0; bytes], vec![0; bytes]);
            let second = rank.submit(2, work(), vec![0; bytes], vec![0; bytes]);
            first.mark.pass();
            assert!(
                rank.counter.wait_for(1, Duration::from_secs(10)),
                "rank {r}"
            );
            // The rank that compared the headers has the mismatch itself; the other may
            // learn it first as that rank's abort, its cause a mismatch, as typed fields.
            match first.done.wait(Duration::from_secs(5)) {
                Some(Err(CudaError::Host(HostError::Mismatch { ours, theirs, .. }))) => {
                    assert_eq!((ours.count, ours.seq), (elems as u64, 1));
                    assert_eq!(theirs.count, (1000 + (1 - r)) as u64);
                }
                Some(Err(CudaError::Host(HostError::Aborted {
                    by: Some(by),
                    cause: AbortCause::Mismatch,
                    during: Some((OpKind::AllReduce, 1)),
                    ..
                }))) if by == 1 - r => {}
                other => panic!("rank {r}: {other:?}"),
            }
            match rank.shared.check() {
                Err(CudaError::Poisoned { first, .. }) => {
                    assert!(first.contains("mismatched collectives"), "{first}")
                }
                other => panic!("rank {r}: {other:?}"),
            }
            // The next job's stream is released although its host side never runs: its
            // stream position is never passed either.
            assert!(rank.counter.wait_for(2, Duration::from_secs(5)), "rank {r}");
            assert!(matches!(
                second.done.wait(Duration::from_secs(5)),
                Some(Err(CudaError::Poisoned { .. }))
            ));
            assert_eq!(rank.counter.raised(), vec![1, 2]);
        });
    }

    #[test]
    fn a_peer_that_aborts_releases_a_waiting_stream_with_the_operation_named() {
        // The timeout is long: the release must come from the abort, not from it.
        let results = on_ranks(2, Duration::from_secs(60), |r, rank| {
            if r == 1 {
                std::thread::sleep(Duration::from_millis(300));
                rank.host.abort();
                return None;
            }
            let work = collective(
                RawOp::new(OpKind::AllReduce, DataType::Float32, 1 << 16),
                2,
                true,
            );
            let start = Instant::now();
            let job = rank.submit(7, work, Vec::new(), vec![0; 4 << 16]);
            job.mark.pass();
            assert!(rank.counter.wait_for(job.ticket, Duration::from_secs(10)));
            Some((job.done.wait(Duration::from_secs(5)), start.elapsed()))
        });
        let (outcome, took) = results[0].clone().expect("rank 0");
        assert!(took < Duration::from_secs(3), "released after {took:?}");
        match outcome {
            Some(Err(CudaError::Collective {
                rank: 0,
                op: OpKind::AllReduce,
                seq: 7,
                detail,
            })) => assert!(detail.contains("abort"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_stream_that_never_reaches_its_job_times_out_and_is_released() {
        on_ranks(1, Duration::from_millis(300), |_, rank| {
            let work = collective(
                RawOp::new(OpKind::AllReduce, DataType::Float32, 10),
                1,
                true,
            );
            let job = rank.submit(1, work, Vec::new(), vec![0; 40]);
            // Never passed.
            assert!(rank.counter.wait_for(1, Duration::from_secs(5)));
            match job.done.wait(Duration::from_secs(5)) {
                Some(Err(CudaError::Collective { detail, .. })) => {
                    assert!(detail.contains("did not finish"), "{detail}")
                }
                other => panic!("{other:?}"),
            }
            assert!(rank.shared.check().is_err());
        });
    }

    #[test]
    fn stopping_the_proxy_releases_tickets_it_never_processed() {
        on_ranks(1, Duration::from_secs(30), |_, rank| {
            // Issued but never submitted (an enqueue that failed between the two).
            let t1 = rank.proxy.next_ticket();
            let t2 = rank.proxy.next_ticket();
            let counter = rank.counter.clone();
            drop(rank);
            assert_eq!((t1, t2), (1, 2));
            assert_eq!(counter.raised(), vec![2]);
        });
    }

    /// The GPUDirect RDMA path through the proxy: each rank's proxy owns a GDR ring over the
    /// emulated RDMA device (connected through the host communicator's all-gather), and a
    /// direct job all-reduces in place in "device memory" (a memfd stand-in) that the NIC
    /// writes, at an offset into the allocation, then releases its stream. Nothing is staged.
    #[test]
    fn direct_jobs_run_on_the_gdr_ring_in_device_memory_and_release_their_streams() {
        use crate::gdr::{exchange_over, GdrPath, GdrRing, GdrSetup, HostDevice};
        use weftcc_collectives::Combiner;
        use weftcc_topology::PathClass;
        use weftcc_transports::net::device::MemfdDevice;
        let Some(p) = weftcc_transports::net::verbs::emulated_for_tests(14, 7) else {
            return;
        };
        let provider: Arc<dyn weftcc_transports::net::Provider> = Arc::new(p);
        let (count, offset) = (3000, 4104);
        let results = weftcc_comm::run_ranks(
            2,
            |r| config(r, Duration::from_secs(30)),
            |r, host| {
                let path = GdrPath {
                    class: PathClass::Pix,
                    level: PathClass::Pxb,
                };
                let setup = GdrRing::connect(
                    r,
                    2,
                    &provider,
                    Box::new(HostDevice { peer_memory: false }),
                    path,
                    1 << 20,
                    &exchange_over(&host),
                    Duration::from_secs(30),
                )
                .expect("set-up");
                let GdrSetup::Direct(ring) = setup else {
                    panic!("rank {r} stages");
                };
                let host = Arc::new(host);
                let counter = Arc::new(Counter::default());
                let proxy = ProxyThread::start(
                    || Ok(()),
                    host.clone(),
                    Arc::new(Shared::new(r)),
                    counter.clone() as Arc<dyn Release>,
                    Some(ring),
                )
                .expect("proxy");
                let dev = Arc::new(MemfdDevice::new(offset + 4 * count + 64, false).unwrap());
                let input = f32_bytes((0..count).map(|i| (i * (r + 1)) as f32));
                // SAFETY: nothing else uses the fresh allocation yet.
                unsafe { dev.host().write(offset, &input) };
                let (mark, done) = (Mark::default(), Arc::new(Outcome::default()));
                let ticket = proxy.next_ticket();
                proxy
                    .submit(Job {
                        seq: 1,
                        ticket,
                        work: Work::Collective {
                            op: RawOp::new(OpKind::AllReduce, DataType::Float32, count),
                            send: None,
                            recv: span(4 * count),
                        },
                        input_at: 0,
                        output_at: 0,
                        ready: Box::new(mark.clone()),
                        input: HostStaging::new(Vec::new()),
                        output: HostStaging::new(Vec::new()),
                        done: done.clone(),
                        direct: Some(Direct {
                            buf: dev.clone(),
                            offset,
                            comb: Combiner::Sum,
                        }),
                    })
                    .expect("submit");
                mark.pass();
                assert!(
                    counter.wait_for(ticket, Duration::from_secs(30)),
                    "released"
                );
                assert_eq!(done.wait(Duration::from_secs(30)), Some(Ok(())));
                drop(proxy);
                // SAFETY: the job ended; nothing writes the memory any more.
                unsafe { dev.host().read(0, offset + 4 * count + 64, <[u8]>::to_vec) }
            },
        )
        .expect("ranks");
        for (r, bytes) in results.iter().enumerate() {
            let want = f32_bytes((0..count).map(|i| (i * 3) as f32));
            let wrong = (0..4 * count)
                .filter(|&i| bytes[offset + i] != want[i])
                .count();
            assert_eq!(wrong, 0, "rank {r}: wrong bytes in the buffer");
            let outside = bytes[..offset].iter().chain(&bytes[offset + 4 * count..]);
            assert!(
                outside.into_iter().all(|&b| b == 0),
                "rank {r}: only the buffer written"
            );
        }
    }
}
