//! The asynchronous API: operations queued on the communicator's worker thread, and the
//! [`Handle`] that gives the buffer back when an operation is done.

use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::ordering::TICKET;
use crate::worker::{Job, Worker};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use weftcc_collectives::call::RawOp;
use weftcc_collectives::{DataType, Element, OpKind, ReduceOp};
use weftcc_transports::lock;

impl Communicator {
    /// Starts an in-place all-reduce of an owned buffer; the handle gives it back when done.
    pub fn all_reduce_async<T: Element, B>(&self, buf: B, op: ReduceOp) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, OpKind::AllReduce, move |c| c.with_op(op))
    }

    /// Starts an in-place broadcast from `root` of an owned buffer.
    pub fn broadcast_async<T: Element, B>(&self, buf: B, root: usize) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, OpKind::Broadcast, move |c| c.with_root(root))
    }

    /// Starts an in-place reduce to `root` of an owned buffer.
    pub fn reduce_async<T: Element, B>(&self, buf: B, op: ReduceOp, root: usize) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, OpKind::Reduce, move |c| c.with_op(op).with_root(root))
    }

    /// Starts an in-place all-gather (contribution in block `rank`) of an owned buffer.
    pub fn all_gather_async<T: Element, B>(&self, buf: B) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, OpKind::AllGather, |c| c)
    }

    /// Starts an in-place reduce-scatter (result in block `rank`) of an owned buffer.
    pub fn reduce_scatter_async<T: Element, B>(&self, buf: B, op: ReduceOp) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, OpKind::ReduceScatter, move |c| c.with_op(op))
    }

    /// Starts an in-place all-to-all of an owned buffer.
    pub fn all_to_all_async<T: Element, B>(&self, buf: B) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit_in_place(buf, OpKind::AllToAll, |c| c)
    }

    /// Starts a barrier.
    pub fn barrier_async(&self) -> Handle<()> {
        let inner = Arc::clone(&self.inner);
        self.submit((), move |_| {
            let call = RawOp::new(OpKind::Barrier, DataType::Uint8, 0);
            let plan = inner.plan(&call, None, 0)?;
            inner.run_blocking(call.kind, |i, st| {
                i.run_planned(st, &call, &plan, None, &mut [])
            })
        })
    }

    /// Starts sending an owned buffer to `peer`.
    pub fn send_async<T: Element, B>(&self, buf: B, peer: usize) -> Handle<B>
    where
        B: AsRef<[T]> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        self.submit(buf, move |b| {
            let bytes: &[u8] = bytemuck::cast_slice(b.as_ref());
            inner.run_group(&[(peer, bytes)], &mut [])
        })
    }

    /// Starts receiving from `peer` into an owned buffer.
    pub fn recv_async<T: Element, B>(&self, buf: B, peer: usize) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        self.submit(buf, move |b| {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(b.as_mut());
            inner.run_group(&[], &mut [(peer, bytes)])
        })
    }

    /// Queues an in-place collective on an owned buffer: the count from its length
    /// ([`RawOp::from_lengths`], as for the blocking calls); `with` sets the op and root.
    pub(crate) fn submit_in_place<T: Element, B>(
        &self,
        buf: B,
        kind: OpKind,
        with: impl FnOnce(RawOp) -> RawOp + Send + 'static,
    ) -> Handle<B>
    where
        B: AsMut<[T]> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        let nranks = self.size();
        self.submit(buf, move |b| {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(b.as_mut());
            let len = bytes.len() / T::DTYPE.size();
            let call = with(RawOp::from_lengths(kind, T::DTYPE, nranks, None, len));
            let plan = inner.plan(&call, None, bytes.len())?;
            inner.run_blocking(call.kind, |i, st| {
                i.run_planned(st, &call, &plan, None, bytes)
            })
        })
    }

    /// Queues `work` on the worker thread behind every operation issued before it.
    pub(crate) fn submit<B: Send + 'static>(
        &self,
        mut buf: B,
        work: impl FnOnce(&mut B) -> Result<()> + Send + 'static,
    ) -> Handle<B> {
        let done = Arc::new(Completion::<B>::default());
        if let Err(e) = self.inner.check() {
            done.finish(Err(e));
            return Handle { done };
        }
        // The ticket is taken now, on the issuing thread: that fixes the execution order.
        let ticket = self.inner.turns.take_ticket();
        let finished = Arc::clone(&done);
        let inner = Arc::clone(&self.inner);
        let job: Job = Box::new(move || {
            let result = match inner.turns.wait_turn(ticket, &|| inner.check()) {
                Ok(()) => {
                    let r = TICKET.with(|t| {
                        t.set(Some(ticket));
                        let r = work(&mut buf);
                        t.set(None);
                        r
                    });
                    inner.turns.end_turn(ticket);
                    r.map(|()| buf)
                }
                Err(e) => {
                    inner.turns.end_turn(ticket);
                    Err(e)
                }
            };
            finished.finish(result);
        });
        let mut worker = lock(&self.worker);
        if worker.is_none() {
            match Worker::start(self.inner.rank) {
                Ok(w) => *worker = Some(w),
                Err(e) => {
                    self.inner.turns.end_turn(ticket);
                    let e = Error::Config(format!("cannot start the worker thread: {e}"));
                    done.finish(Err(e));
                    return Handle { done };
                }
            }
        }
        if let Some(w) = worker.as_ref() {
            w.run(job);
        }
        Handle { done }
    }
}

/// The shared state of an async operation.
pub(crate) struct Completion<B> {
    pub(crate) result: Mutex<Option<Result<B>>>,
    pub(crate) cv: Condvar,
    pub(crate) done: AtomicBool,
}

impl<B> Default for Completion<B> {
    fn default() -> Self {
        Completion {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
        }
    }
}

impl<B> Completion<B> {
    pub(crate) fn finish(&self, r: Result<B>) {
        *lock(&self.result) = Some(r);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// The handle of an asynchronous operation; gives the buffer back when the operation is done.
/// Dropping a handle does not cancel the operation.
pub struct Handle<B> {
    pub(crate) done: Arc<Completion<B>>,
}

impl<B> Handle<B> {
    /// True once the operation finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.done.done.load(Ordering::Acquire)
    }

    /// Waits up to `timeout`; returns whether the operation finished.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut slot = lock(&self.done.result);
        while slot.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            slot = match self.done.cv.wait_timeout(slot, deadline - now) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Waits for the operation and returns its buffer. Never waits forever: operations end by
    /// their own timeout.
    pub fn wait(self) -> Result<B> {
        let mut slot = lock(&self.done.result);
        loop {
            if let Some(r) = slot.take() {
                return r;
            }
            slot = match self.done.cv.wait(slot) {
                Ok(s) => s,
                Err(p) => p.into_inner(),
            };
        }
    }
}
