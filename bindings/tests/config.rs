//! `weftCommInitRankConfig`: the config's timeout is the communicator's (not the environment's),
//! and the error codes say what each rank saw: `weftTimeout` where the operation timed out,
//! `weftRemoteError` on a rank that learnt of it.

use std::ffi::CStr;
use std::time::{Duration, Instant};
use weft::{
    weftCommDestroy, weftCommInitRankConfig, weftComm_t, weftConfig_t, weftGetLastError,
    weftGetUniqueId, weftInt8, weftRecv, weftRemoteError, weftTimeout, weftUniqueId,
    WEFT_CONFIG_MAGIC, WEFT_CONFIG_UNDEF_INT, WEFT_CONFIG_VERSION,
};

fn config(timeout_ms: i64) -> weftConfig_t {
    weftConfig_t {
        size: std::mem::size_of::<weftConfig_t>(),
        magic: WEFT_CONFIG_MAGIC,
        version: WEFT_CONFIG_VERSION,
        timeoutMs: timeout_ms,
        splitShare: WEFT_CONFIG_UNDEF_INT,
        deterministic: WEFT_CONFIG_UNDEF_INT,
    }
}

#[test]
fn the_config_timeout_applies_and_each_rank_gets_the_code_of_what_it_saw() {
    // The environment's timeout would be a minute: the config's 400 ms must win.
    std::env::set_var("WEFT_TIMEOUT", "60");
    let mut id = weftUniqueId {
        internal: [0; weft::WEFT_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a writable out-parameter.
    assert_eq!(unsafe { weftGetUniqueId(&mut id) }, 0);
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut comm: weftComm_t = std::ptr::null_mut();
                // Rank 1 learns of rank 0's timeout through the job; its own would be later.
                let cfg = config(if rank == 0 { 400 } else { 30_000 });
                // SAFETY: `comm` is writable and `cfg` a whole config.
                let code = unsafe { weftCommInitRankConfig(&mut comm, 2, id, rank, &cfg) };
                assert_eq!(code, 0);
                let start = Instant::now();
                let mut byte = 0i8;
                // Both receive, nobody sends.
                // SAFETY: `byte` is one writable int8; `comm` is live.
                let code = unsafe {
                    weftRecv(
                        (&mut byte as *mut i8).cast(),
                        1,
                        weftInt8,
                        1 - rank,
                        comm,
                        std::ptr::null_mut(),
                    )
                };
                let took = start.elapsed();
                // SAFETY: the message is NUL-terminated and owned by this thread.
                let msg = unsafe { CStr::from_ptr(weftGetLastError(comm)) }
                    .to_string_lossy()
                    .into_owned();
                // SAFETY: live handle, destroyed once.
                unsafe { weftCommDestroy(comm) };
                (code, took, msg)
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    let (code0, took0, msg0) = &results[0];
    assert_eq!(*code0, weftTimeout, "rank 0: {msg0}");
    assert!(*took0 < Duration::from_secs(10), "rank 0 took {took0:?}");
    let (code1, took1, msg1) = &results[1];
    assert_eq!(*code1, weftRemoteError, "rank 1: {msg1}");
    assert!(msg1.contains("reported by rank 0"), "rank 1: {msg1}");
    assert!(*took1 < Duration::from_secs(10), "rank 1 took {took1:?}");
}

#[test]
fn a_config_that_is_not_one_is_refused_before_joining() {
    let mut id = weftUniqueId {
        internal: [0; weft::WEFT_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a writable out-parameter.
    assert_eq!(unsafe { weftGetUniqueId(&mut id) }, 0);
    let mut comm: weftComm_t = std::ptr::null_mut();
    let mut short = config(100);
    short.size = 8;
    let mut future = config(100);
    future.version = WEFT_CONFIG_VERSION + 1;
    let mut share = config(100);
    share.splitShare = 2;
    let mut det = config(100);
    det.deterministic = 2;
    // Version 2 with version 1's size: the deterministic field is missing.
    let mut cut = config(100);
    cut.size = std::mem::offset_of!(weftConfig_t, deterministic);
    for (what, cfg) in [
        ("size", short),
        ("version", future),
        ("splitShare", share),
        ("deterministic", det),
        ("size", cut),
    ] {
        // SAFETY: `comm` is writable and `cfg` a whole struct.
        let code = unsafe { weftCommInitRankConfig(&mut comm, 1, id, 0, &cfg) };
        assert_eq!(code, weft::weftInvalidArgument, "{what}");
        // SAFETY: the message is NUL-terminated and owned by this thread.
        let msg = unsafe { CStr::from_ptr(weftGetLastError(std::ptr::null_mut())) };
        assert!(msg.to_string_lossy().contains(what), "{what}: {msg:?}");
        assert!(comm.is_null());
    }
}

/// A program built against the version-1 header (no `deterministic` field) still gets its
/// communicator; a version-2 config may ask for deterministic reductions.
#[test]
fn version_1_configs_are_accepted_and_version_2_sets_deterministic() {
    for (version, size, deterministic) in [
        (1, std::mem::offset_of!(weftConfig_t, deterministic), 7),
        (2, std::mem::size_of::<weftConfig_t>(), 1),
    ] {
        let mut id = weftUniqueId {
            internal: [0; weft::WEFT_UNIQUE_ID_BYTES],
        };
        // SAFETY: `id` is a writable out-parameter.
        assert_eq!(unsafe { weftGetUniqueId(&mut id) }, 0);
        let mut cfg = config(5_000);
        cfg.version = version;
        cfg.size = size;
        // Not read in version 1 (an invalid value there proves it).
        cfg.deterministic = deterministic;
        let mut comm: weftComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is writable and `cfg` holds at least `size` bytes.
        let code = unsafe { weftCommInitRankConfig(&mut comm, 1, id, 0, &cfg) };
        assert_eq!(code, 0, "version {version}");
        // SAFETY: a live handle, destroyed once.
        assert_eq!(unsafe { weftCommDestroy(comm) }, 0);
    }
}
