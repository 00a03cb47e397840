//! Rank processes started by a test: waited for with a deadline, their output gathered.

use std::process::Child;
use std::thread::sleep;
use std::time::{Duration, Instant};

/// What a set of rank processes did.
pub struct Finished {
    /// Ranks that exited unsuccessfully, or were still running at the deadline (then killed).
    pub failed: Vec<usize>,
    /// Every rank's stdout and stderr, each under a `--- rank r ---` line.
    pub report: String,
}

/// Waits for `kids` (rank, process; started with piped stdout and stderr) until `limit` has
/// passed, kills those still running then, and gathers what every rank printed.
pub fn wait_ranks(mut kids: Vec<(usize, Child)>, limit: Duration) -> Finished {
    let deadline = Instant::now() + limit;
    let mut failed = Vec::new();
    for (r, kid) in &mut kids {
        loop {
            match kid.try_wait().expect("wait for a rank") {
                Some(status) => {
                    if !status.success() {
                        failed.push(*r);
                    }
                    break;
                }
                None if Instant::now() > deadline => {
                    let _ = kid.kill();
                    failed.push(*r);
                    break;
                }
                None => sleep(Duration::from_millis(20)),
            }
        }
    }
    let mut report = String::new();
    for (r, kid) in kids {
        let out = kid.wait_with_output().expect("a rank's output");
        report += &format!(
            "--- rank {r} ---\n{}{}\n",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Finished { failed, report }
}
