//! The communicator handle (`ncclComm_t`): weftcc's handle once made, with what NCCL's
//! semantics add (a non-blocking init still in progress, or failed; the device of
//! `ncclCommInitAll`).

use std::ffi::c_int;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use weft::{weftCommDestroy, weftComm_t, weftInProgress, weftResult_t};

use crate::errors::{bad_arg, bad_usage, Failure};

/// weftcc's handle, moved between threads.
#[derive(Clone, Copy)]
pub(crate) struct Raw(pub(crate) weftComm_t);

// SAFETY: weftcc's communicators are used from any thread (the C ABI's contract: a handle may
// be called from several threads); this layer only passes the pointer.
unsafe impl Send for Raw {}

pub(crate) enum State {
    /// A non-blocking or grouped init not finished.
    Pending,
    Ready(Raw),
    Failed(Failure),
}

/// A communicator (opaque). Shared (`Arc`): the application's reference, and one per call in
/// flight or collected in a group, so that `ncclCommAbort` on one thread does not free it
/// under another's blocked call; weftcc's communicator is destroyed with the last reference.
pub struct ncclComm {
    state: Mutex<State>,
    settled: Condvar,
    pub(crate) blocking: bool,
    /// The CUDA device given to `ncclCommInitAll`.
    pub(crate) device: Option<c_int>,
}

/// Handle to a communicator.
pub type ncclComm_t = *mut ncclComm;

impl ncclComm {
    pub(crate) fn new(state: State, blocking: bool, device: Option<c_int>) -> Arc<ncclComm> {
        Arc::new(ncclComm {
            state: Mutex::new(state),
            settled: Condvar::new(),
            blocking,
            device,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends a pending init.
    pub(crate) fn settle(&self, made: Result<Raw, Failure>) {
        *self.lock() = match made {
            Ok(raw) => State::Ready(raw),
            Err(f) => State::Failed(f),
        };
        self.settled.notify_all();
    }

    /// weftcc's handle; an init in progress or failed is `call`'s failure.
    pub(crate) fn weft(&self, call: &str) -> Result<weftComm_t, weftResult_t> {
        match &*self.lock() {
            State::Ready(raw) => Ok(raw.0),
            State::Pending => Err(bad_usage(&format!(
                "{call}: the communicator is still being initialised (non-blocking): poll \
                 ncclCommGetAsyncError until it is no longer ncclInProgress"
            ))),
            State::Failed(f) => Err(f.raise()),
        }
    }

    /// The init's state: `Ok(Some(handle))` made, `Ok(None)` in progress, `Err` failed (its
    /// failure recorded on this thread).
    pub(crate) fn poll(&self) -> Result<Option<weftComm_t>, weftResult_t> {
        match &*self.lock() {
            State::Ready(raw) => Ok(Some(raw.0)),
            State::Pending => Ok(None),
            State::Failed(f) => Err(f.raise()),
        }
    }

    /// Waits until a pending init ended.
    pub(crate) fn wait_settled(&self) {
        let mut s = self.lock();
        while matches!(*s, State::Pending) {
            s = self.settled.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The application's handle for `comm` (one reference, given back by `ncclCommDestroy`
    /// or `ncclCommAbort`).
    pub(crate) fn publish(comm: Arc<ncclComm>) -> ncclComm_t {
        Arc::into_raw(comm).cast_mut()
    }
}

impl Drop for ncclComm {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|e| e.into_inner()),
            State::Pending,
        );
        if let State::Ready(raw) = state {
            // SAFETY: made by weftCommInit*/weftCommSplit for this handle alone, destroyed
            // once, here, when no call holds it any more.
            unsafe { weftCommDestroy(raw.0) };
        }
    }
}

/// One more reference to the communicator behind `comm`.
///
/// # Safety
/// `comm` is null or a handle from this library not yet destroyed or aborted.
pub(crate) unsafe fn comm_arc(comm: ncclComm_t, call: &str) -> Result<Arc<ncclComm>, weftResult_t> {
    if comm.is_null() {
        return Err(bad_arg(&format!("{call}: null communicator")));
    }
    // SAFETY: `comm` came from Arc::into_raw (publish) and the application's reference is
    // alive per the contract: one more strong count, owned by the Arc made here.
    unsafe {
        Arc::increment_strong_count(comm.cast_const());
        Ok(Arc::from_raw(comm.cast_const()))
    }
}

/// Takes back the application's reference to `comm` (destroy, abort).
///
/// # Safety
/// `comm` is null or a live handle from this library, not used afterwards.
pub(crate) unsafe fn take(comm: ncclComm_t) -> Option<Arc<ncclComm>> {
    // SAFETY: per the contract, the application's own reference made by publish.
    (!comm.is_null()).then(|| unsafe { Arc::from_raw(comm.cast_const()) })
}

/// `weftInProgress`, for a call that returns with work still going on.
pub(crate) const IN_PROGRESS: weftResult_t = weftInProgress;
