//! The communicator's worker thread: runs the asynchronous operations' jobs one after another,
//! in the order their tickets fixed when they were issued.

use std::sync::mpsc;
use std::thread::JoinHandle;

/// One queued operation.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Worker {
    jobs: mpsc::Sender<Job>,
    thread: JoinHandle<()>,
}

impl Worker {
    /// Starts the worker thread of rank `rank`'s communicator.
    pub(crate) fn start(rank: usize) -> std::io::Result<Worker> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("weft-worker-{rank}"))
            .spawn(move || {
                for job in rx {
                    job();
                }
            })?;
        Ok(Worker { jobs, thread })
    }

    /// Queues `job` behind the others.
    pub(crate) fn run(&self, job: Job) {
        if let Err(mpsc::SendError(job)) = self.jobs.send(job) {
            // The worker is gone (cannot happen while its owner holds it): run inline.
            job();
        }
    }

    /// Lets the queued jobs finish, and the thread end.
    pub(crate) fn stop(self) {
        drop(self.jobs);
        join_unless_current(self.thread);
    }
}

/// Waits for `thread` to end, unless it is this one: a failure hook
/// (`Communicator::on_failure`) that drops the last reference to a communicator runs on that
/// communicator's watcher or worker thread, which then ends by itself after the hook.
pub(crate) fn join_unless_current(thread: JoinHandle<()>) {
    if thread.thread().id() != std::thread::current().id() {
        let _ = thread.join();
    }
}
