//! A helper thread that runs until its owner drops it: the owner's drop raises the stop flag
//! the body watches, then joins it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub(crate) struct Background {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
    /// Runs `body` on a thread named `name`; `body` returns soon after the flag it is given is
    /// raised.
    pub(crate) fn spawn(
        name: String,
        body: impl FnOnce(&AtomicBool) + Send + 'static,
    ) -> std::io::Result<Background> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || body(&stopped))?;
        Ok(Background {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
