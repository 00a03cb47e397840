//! Small helpers shared by the transports: hashing, aligned buffers and the futex /
//! pidfd system calls; [`lock`] and deadlines come from `weftcc-base` (the store shares them).

use crate::error::{Result, TransportError};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;
pub use weftcc_base::lock;
pub(crate) use weftcc_base::Deadline;

/// A value in NCCL's device-list grammar (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA`, and their
/// `WEFT_*` twins): `[^][=]item,item,…`.
pub(crate) struct NcclList<'a> {
    /// `^`: the items are excluded rather than selected.
    pub(crate) exclude: bool,
    /// `=`: names match exactly rather than as prefixes ([`NcclList::name_matches`]).
    pub(crate) exact: bool,
    /// The comma-separated items, trimmed, empty ones dropped.
    pub(crate) items: Vec<&'a str>,
}

impl<'a> NcclList<'a> {
    pub(crate) fn parse(text: &'a str) -> NcclList<'a> {
        let rest = text.trim();
        let (exclude, rest) = rest.strip_prefix('^').map_or((false, rest), |r| (true, r));
        let (exact, rest) = rest.strip_prefix('=').map_or((false, rest), |r| (true, r));
        let items = rest
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        NcclList {
            exclude,
            exact,
            items,
        }
    }

    /// Whether `name` is named by `pattern`: equal to it with `=`, else starting with it.
    pub(crate) fn name_matches(exact: bool, pattern: &str, name: &str) -> bool {
        if exact {
            name == pattern
        } else {
            name.starts_with(pattern)
        }
    }
}

/// 64-bit FNV-1a hash; stable across processes and builds (used for namespace hashes).
pub fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `nbytes` random bytes from the OS, as lowercase hex.
pub(crate) fn random_hex(nbytes: usize) -> Result<String> {
    let mut b = vec![0u8; nbytes];
    getrandom::getrandom(&mut b).map_err(|e| TransportError::Io {
        what: "getrandom".into(),
        message: e.to_string(),
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// A heap byte buffer whose usable region starts 8-byte aligned, built in safe code (the backing
/// `Vec<u8>` is never resized, so the alignment found at construction stays valid).
pub(crate) struct AlignedBuf {
    buf: Vec<u8>,
    base: usize,
    len: usize,
}

impl AlignedBuf {
    pub(crate) fn new(len: usize) -> Self {
        let buf = vec![0u8; len + 8];
        let off = buf.as_ptr().align_offset(8);
        let base = if off < 8 { off } else { 0 };
        AlignedBuf { buf, base, len }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.buf[self.base..self.base + self.len]
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[self.base..self.base + self.len]
    }
}

fn duration_to_timespec(d: Duration) -> libc::timespec {
    // Cap at about 68 years so the seconds always fit in time_t.
    let secs = d.as_secs().min(i32::MAX as u64);
    libc::timespec {
        tv_sec: secs as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    }
}

/// Blocks while `*word == expected`, for at most `timeout`; returns on wake, timeout, signal or
/// value mismatch (the caller re-checks its condition). Uses a shared (not private) futex so
/// wakers in other processes that map the same page reach it.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    if timeout.is_zero() {
        return;
    }
    let ts = duration_to_timespec(timeout);
    // SAFETY: `word` is a valid, aligned 32-bit atomic that outlives the call (it lives in a
    // mapping or allocation the caller borrows); `ts` is a valid timespec on our stack; the
    // remaining arguments are unused by FUTEX_WAIT. The kernel only reads these pointers.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter blocked in [`futex_wait`] on `word` (in any process).
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 32-bit atomic borrowed for the call; FUTEX_WAKE only uses
    // its address as a key and reads no other pointer argument.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Watches a process for exit: a pidfd when the kernel has them, else `kill(pid, 0)` plus a look
/// at `/proc/<pid>/stat` for zombies.
#[derive(Debug)]
pub(crate) struct ProcessWatch {
    pid: i32,
    pidfd: Option<OwnedFd>,
}

impl ProcessWatch {
    pub(crate) fn new(pid: i32) -> Self {
        let pidfd = if pid > 0 {
            // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or -1;
            // no memory is passed.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
            if fd >= 0 && fd <= i64::from(i32::MAX) {
                // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
                Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
            } else {
                None
            }
        } else {
            None
        };
        ProcessWatch { pid, pidfd }
    }

    /// True when the process is known to have exited (zombies count as exited).
    pub(crate) fn exited(&self) -> bool {
        if self.pid <= 0 {
            return false;
        }
        if let Some(fd) = &self.pidfd {
            let mut fds = [nix::poll::PollFd::new(
                fd.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            return match nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO) {
                Ok(n) if n > 0 => fds[0].revents().is_some_and(|r| !r.is_empty()),
                _ => false,
            };
        }
        match nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), None) {
            Err(nix::errno::Errno::ESRCH) => true,
            _ => {
                // A zombie still accepts signal 0; its state letter in /proc tells.
                match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
                    Ok(stat) => stat
                        .rsplit_once(')')
                        .map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
                        .unwrap_or(false),
                    Err(_) => false,
                }
            }
        }
    }
}

/// Sends `frame` with `fds` attached (SCM_RIGHTS) over a Unix stream; the whole frame goes in
/// one message (frames are a few bytes, well under the socket buffer).
pub(crate) fn send_fds(
    stream: &std::os::unix::net::UnixStream,
    frame: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    let raw: Vec<std::os::fd::RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let iov = [std::io::IoSlice::new(frame)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    // A signal that arrives while the call waits interrupts it whatever SA_RESTART says: the
    // stream has a timeout (signal(7)). Nothing was sent then; send again.
    let sent = retry_interrupted(|| {
        sendmsg::<()>(
            stream.as_raw_fd(),
            &iov,
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
    })?;
    if sent != frame.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "descriptor frame sent in part",
        ));
    }
    Ok(())
}

/// Runs `call` again while it fails with `EINTR`: a signal delivered while it waited, nothing
/// done (socket calls with a timeout report it whatever `SA_RESTART` says, signal(7)).
pub(crate) fn retry_interrupted<T>(mut call: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    loop {
        match call() {
            Err(nix::errno::Errno::EINTR) => continue,
            done => return done,
        }
    }
}

/// Receives one frame of exactly `frame.len()` bytes sent by [`send_fds`], and its descriptors
/// (at most `max_fds`; extra ones are closed). The stream's read timeout bounds the wait; a
/// signal that interrupts it is no error (the call is made again).
pub(crate) fn recv_fds(
    stream: &std::os::unix::net::UnixStream,
    frame: &mut [u8],
    max_fds: usize,
) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
    loop {
        match recv_fds_once(stream, frame, max_fds) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            done => return done,
        }
    }
}

fn recv_fds_once(
    stream: &std::os::unix::net::UnixStream,
    frame: &mut [u8],
    max_fds: usize,
) -> std::io::Result<Vec<std::os::fd::OwnedFd>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 4]);
    let mut iov = [std::io::IoSliceMut::new(frame)];
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let bytes = msg.bytes;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` in this process for this message
                // (SCM_RIGHTS); nothing else owns it, so taking ownership closes it exactly once.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "descriptor frame truncated",
        ));
    }
    if bytes != frame.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "descriptor frame of {bytes} bytes, expected {}",
                frame.len()
            ),
        ));
    }
    fds.truncate(max_fds);
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" fn ignore(_: libc::c_int) {}

    /// A signal delivered to a thread waiting for a descriptor frame (a handler installed
    /// without `SA_RESTART`, as a profiler or a runtime may) does not fail the exchange: the
    /// waiting call is made again. Before this, `recv_fds` returned `EINTR` as an error
    /// ("receiving shared memory from rank N: Interrupted system call").
    #[test]
    fn a_signal_during_a_descriptor_exchange_is_no_error() {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        use std::os::fd::AsFd;
        let action = SigAction::new(
            SigHandler::Handler(ignore),
            SaFlags::empty(),
            SigSet::empty(),
        );
        // SAFETY: the handler does nothing (async-signal-safe); SIGURG is otherwise ignored by
        // default, so no other test of this process depends on its disposition.
        unsafe { sigaction(Signal::SIGURG, &action) }.expect("sigaction");
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        b.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let receiver = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            tid_tx.send(unsafe { libc::pthread_self() }).expect("tid");
            let mut frame = [0u8; 4];
            let got = recv_fds(&b, &mut frame, 1);
            (got.map(|fds| fds.len()), frame)
        });
        let tid = tid_rx.recv().expect("tid");
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(40));
            // SAFETY: `tid` is the receiver thread, alive until joined below.
            assert_eq!(unsafe { libc::pthread_kill(tid, libc::SIGURG) }, 0);
        }
        let file = std::fs::File::open("/dev/null").expect("/dev/null");
        send_fds(&a, b"weft", &[file.as_fd()]).expect("send");
        let (got, frame) = receiver.join().expect("receiver");
        assert_eq!(got.expect("no EINTR error"), 1);
        assert_eq!(&frame, b"weft");
    }

    #[test]
    fn aligned() {
        for n in [1usize, 7, 64, 1000] {
            let b = AlignedBuf::new(n);
            assert_eq!(b.as_slice().as_ptr() as usize % 8, 0);
            assert_eq!(b.len(), n);
        }
    }

    #[test]
    fn own_process_is_alive() {
        let w = ProcessWatch::new(std::process::id() as i32);
        assert!(!w.exited());
    }
}
