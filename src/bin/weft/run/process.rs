//! Process control of `weft run`: termination signals turned into a flag the launcher polls,
//! and what a worker does between fork and exec (dies with the launcher, binds to its CPU).
//! The two `unsafe` calls the launcher needs live here, at the OS edge, and nowhere else in
//! the binary.

use nix::sched::CpuSet;
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::unistd::Pid;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

/// The termination signal received last (0: none), set by [`on_signal`].
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// The signals a launcher forwards to its job instead of dying of them.
pub const TERMINATION_SIGNALS: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

extern "C" fn on_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Catches [`TERMINATION_SIGNALS`]: from now on they only record themselves for
/// [`take_pending_signal`]. Returns the signals whose handler could not be installed.
pub fn catch_termination_signals() -> Vec<(Signal, nix::Error)> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    let mut failed = Vec::new();
    for sig in TERMINATION_SIGNALS {
        // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
        if let Err(e) = unsafe { signal::sigaction(sig, &action) } {
            failed.push((sig, e));
        }
    }
    failed
}

/// The termination signal caught since the last call (its number), clearing it; `None` when
/// there was none.
pub fn take_pending_signal() -> Option<i32> {
    match PENDING_SIGNAL.swap(0, Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// Sets `cmd` up as a launched worker: it dies with the launcher (even a SIGKILLed one; a
/// worker whose launcher is already gone exits at once) and, with `cpus`, runs bound to those
/// CPUs from its first instruction, so every thread it starts inherits the binding.
pub fn launch_as_worker(cmd: &mut Command, cpus: Option<&[usize]>) -> io::Result<()> {
    // Built before the fork: the child only makes the system call.
    let cpu_set = match cpus {
        Some(cs) => {
            let mut set = CpuSet::new();
            for &c in cs {
                set.set(c).map_err(io::Error::from)?;
            }
            Some(set)
        }
        None => None,
    };
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
    // functions (prctl, getppid, _exit, and sched_setaffinity on a set built before the fork).
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            if let Some(set) = &cpu_set {
                nix::sched::sched_setaffinity(Pid::from_raw(0), set)?;
            }
            Ok(())
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_signal_is_taken_once() {
        assert!(catch_termination_signals().is_empty());
        // Nothing else in this test binary raises SIGHUP.
        signal::raise(Signal::SIGHUP).unwrap();
        assert_eq!(take_pending_signal(), Some(Signal::SIGHUP as i32));
        assert_eq!(take_pending_signal(), None);
    }

    #[test]
    fn a_worker_runs_on_the_cpu_it_was_given() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "grep Cpus_allowed_list /proc/self/status"]);
        launch_as_worker(&mut cmd, Some(&[0])).unwrap();
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.trim_end().ends_with("\t0"), "{text}");
    }
}
