//! NCCL's groups: between `ncclGroupStart` and `ncclGroupEnd` every call on a communicator
//! (collective, send, receive, init, split) is collected; the outermost `ncclGroupEnd` makes the
//! communicators being initialised (together: one process may be several ranks of the job),
//! then runs each communicator's calls in order inside one weftcc group (its sends and
//! receives together), one thread per communicator when there are several, so that one
//! thread can drive several ranks as NCCL allows.

use std::cell::RefCell;
use std::sync::Arc;

use weft::{weftComm_t, weftGroupEnd, weftGroupStart, weftInternalError, weftResult_t, Nesting};

use crate::errors::{bad_usage, check, run, Failure, Outcome, DONE};
use crate::handle::{ncclComm, Raw, IN_PROGRESS};
use crate::types::ncclResult_t;

/// One collected call, given weftcc's handle when it runs; returns a `weft*` code (its message
/// recorded on the thread that ran it).
pub(crate) type Job = Box<dyn FnOnce(weftComm_t) -> weftResult_t + Send>;
/// Makes weftcc's communicator of an init.
pub(crate) type Make = Box<dyn FnOnce() -> Result<Raw, Failure> + Send>;
/// One task of [`together`].
pub(crate) type Task = Box<dyn FnOnce() -> Option<Failure> + Send>;

/// What a group collects: inits, then calls.
#[derive(Default)]
struct Collected {
    inits: Vec<(Arc<ncclComm>, Make)>,
    ops: Vec<(Arc<ncclComm>, Job)>,
}

thread_local! {
    static GROUP: RefCell<Nesting<Collected>> = RefCell::new(Nesting::default());
}

pub(crate) fn in_group() -> bool {
    GROUP.with(|g| g.borrow_mut().open().is_some())
}

/// Collects `item` in this thread's open group (where `list` says), or gives it back to run
/// now outside any group.
fn collect_or_now<X>(
    item: X,
    list: impl FnOnce(&mut Collected) -> &mut Vec<(Arc<ncclComm>, X)>,
    comm: &Arc<ncclComm>,
) -> Option<X> {
    GROUP.with(|g| match g.borrow_mut().open() {
        Some(c) => {
            list(c).push((comm.clone(), item));
            None
        }
        None => Some(item),
    })
}

/// Drops what this thread's group collected for `comm` (it is being destroyed or aborted); an
/// init collected there ends as failed, so that nothing waits for it.
pub(crate) fn forget(comm: &Arc<ncclComm>) {
    let (inits, ops) = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        let Some(g) = g.open() else {
            return Default::default();
        };
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut g.inits)
            .into_iter()
            .partition(|(c, _)| Arc::ptr_eq(c, comm));
        g.inits = rest;
        let (ops, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut g.ops)
            .into_iter()
            .partition(|(c, _)| Arc::ptr_eq(c, comm));
        g.ops = rest;
        (mine, ops)
    });
    drop(ops);
    for (c, _) in inits {
        c.settle(Err(Failure {
            code: weft::weftInvalidUsage,
            msg: "the communicator was destroyed before the ncclGroupEnd that would make it".into(),
        }));
    }
}

/// Runs `job` on `comm` now, or collects it until the group ends.
pub(crate) fn submit(comm: Arc<ncclComm>, call: &str, job: Job) -> Outcome {
    let now = collect_or_now(job, |c| &mut c.ops, &comm);
    match now {
        None => DONE,
        Some(job) => check(job(comm.weft(call)?)),
    }
}

/// Makes `comm`'s weftcc communicator: collected in a group; else now (blocking) or on a
/// thread of its own (non-blocking: `weftInProgress`, `ncclCommGetAsyncError` tells the end).
pub(crate) fn submit_init(comm: Arc<ncclComm>, make: Make) -> Outcome {
    let now = collect_or_now(make, |c| &mut c.inits, &comm);
    let Some(make) = now else { return DONE };
    if !comm.blocking {
        spawn_init(comm, make);
        return Ok(IN_PROGRESS);
    }
    match run_make(make) {
        Ok(raw) => {
            comm.settle(Ok(raw));
            DONE
        }
        Err(f) => {
            let code = f.raise();
            comm.settle(Err(f));
            Err(code)
        }
    }
}

/// Runs an init's `make`; a panic in it is a failure, so that its handle is settled whatever
/// happens (a handle left pending would hold `ncclCommDestroy` forever).
pub(crate) fn run_make(make: Make) -> Result<Raw, Failure> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(make)).unwrap_or_else(|_| {
        Err(Failure {
            code: weftInternalError,
            msg: "internal error: a communicator's init panicked".into(),
        })
    })
}

/// A non-blocking init, on a thread that settles the handle when done.
fn spawn_init(comm: Arc<ncclComm>, make: Make) {
    let mine = comm.clone();
    let started = std::thread::Builder::new()
        .name("weft-nccl-init".into())
        .spawn(move || mine.settle(run_make(make)));
    if let Err(e) = started {
        comm.settle(Err(Failure {
            code: weft::weftSystemError,
            msg: format!("cannot start a thread for a non-blocking init: {e}"),
        }));
    }
}

/// Runs `tasks` together (one thread each when there are several) and returns their failures.
pub(crate) fn together(tasks: Vec<Task>) -> Vec<Option<Failure>> {
    if tasks.len() <= 1 {
        return tasks.into_iter().map(|t| t()).collect();
    }
    std::thread::scope(|s| {
        let running: Vec<_> = tasks.into_iter().map(|t| s.spawn(t)).collect();
        running
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Some(Failure {
                        code: weftInternalError,
                        msg: "internal error: a group's worker thread panicked".into(),
                    })
                })
            })
            .collect()
    })
}

/// Runs one communicator's collected calls in order inside one weftcc group.
fn run_jobs(comm: &ncclComm, jobs: Vec<Job>) -> Option<Failure> {
    let w = match comm.weft("ncclGroupEnd") {
        Ok(w) => w,
        Err(code) => return Some(Failure::here(code)),
    };
    weftGroupStart();
    let mut failed = None;
    for job in jobs {
        let r = job(w);
        if r != weft::weftSuccess {
            failed = Some(Failure::here(r));
            break;
        }
    }
    let r = weftGroupEnd();
    if failed.is_none() && r != weft::weftSuccess {
        failed = Some(Failure::here(r));
    }
    failed
}

/// Starts (or nests) a group.
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    run(|| {
        GROUP.with(|g| g.borrow_mut().start());
        DONE
    })
}

/// Ends a group; the outermost one runs what was collected and returns when it is done
/// (`ncclInProgress` while non-blocking inits of the group go on).
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    run(|| {
        let taken = GROUP.with(|g| g.borrow_mut().end());
        let Some(Collected { inits, ops }) = taken else {
            return Err(bad_usage("ncclGroupEnd without ncclGroupStart"));
        };
        let mut in_progress = false;
        let mut blocking: Vec<Task> = Vec::new();
        for (comm, make) in inits {
            if comm.blocking {
                blocking.push(Box::new(move || {
                    let made = run_make(make);
                    let failed = made.as_ref().err().cloned();
                    comm.settle(made);
                    failed
                }));
            } else {
                spawn_init(comm, make);
                in_progress = true;
            }
        }
        let mut failures = together(blocking);
        let mut per_comm: Vec<(Arc<ncclComm>, Vec<Job>)> = Vec::new();
        for (comm, job) in ops {
            match per_comm.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &comm)) {
                Some((_, jobs)) => jobs.push(job),
                None => per_comm.push((comm, vec![job])),
            }
        }
        let tasks: Vec<Task> = per_comm
            .into_iter()
            .map(|(comm, jobs)| -> Task { Box::new(move || run_jobs(&comm, jobs)) })
            .collect();
        failures.extend(together(tasks));
        if let Some(f) = failures.into_iter().flatten().next() {
            return Err(f.raise());
        }
        if in_progress {
            Ok(IN_PROGRESS)
        } else {
            DONE
        }
    })
}
