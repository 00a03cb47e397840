//! Process-wide resources a rank needs: the open-files limit (`RLIMIT_NOFILE`) its connections
//! will use, checked and raised before they are made.

use crate::error::TransportError;
use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Files a process keeps open besides a rank's connections (stdio, the binary's own, the
/// bootstrap socket, a listener, an epoll or pidfd or two), so that a check leaves room for them.
pub const OPEN_FILES_MARGIN: u64 = 64;

/// Makes sure this process may have `needed` more files open (plus [`OPEN_FILES_MARGIN`]):
/// raises the soft `RLIMIT_NOFILE` up to the hard limit when it is lower, and fails with
/// [`TransportError::FileLimit`] (naming both limits) when even the hard limit is too low.
/// Returns the soft limit in force afterwards.
pub fn ensure_open_files(needed: u64) -> Result<u64, TransportError> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)
        .map_err(|e| TransportError::io("reading the open-files limit", std::io::Error::from(e)))?;
    let want = needed.saturating_add(OPEN_FILES_MARGIN);
    if want <= soft {
        return Ok(soft);
    }
    if want > hard {
        return Err(TransportError::FileLimit {
            needed: want,
            soft,
            hard,
        });
    }
    setrlimit(Resource::RLIMIT_NOFILE, want, hard)
        .map_err(|e| TransportError::io("raising the open-files limit", std::io::Error::from(e)))?;
    tracing::info!(target: "weftcc::init", from = soft, to = want, "raised the open-files limit");
    Ok(want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_files_limit_is_raised_or_refused_with_both_limits() {
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert!(ensure_open_files(0).unwrap() >= soft.min(OPEN_FILES_MARGIN));
        if hard < u64::MAX / 2 {
            match ensure_open_files(hard) {
                Err(TransportError::FileLimit {
                    needed, hard: h, ..
                }) => {
                    assert_eq!((needed, h), (hard + OPEN_FILES_MARGIN, hard));
                }
                other => panic!("expected FileLimit, got {other:?}"),
            }
        }
        // A soft limit below what is asked is raised to it (never past the hard limit).
        let lowered = soft / 2;
        setrlimit(Resource::RLIMIT_NOFILE, lowered, hard).unwrap();
        let raised = ensure_open_files(lowered);
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
        assert_eq!(raised.unwrap(), lowered + OPEN_FILES_MARGIN);
    }
}
