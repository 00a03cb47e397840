//! Test support for weftcc's crates; a dev-dependency only, never part of the library.
//!
//! * [`fuzz`]: proptest run for many cases over one target (`WEFT_FUZZ_CASES`), the count
//!   printed: the fuzz tests of `weftcc-transports` and `weftcc-topology`.
//! * [`docs`]: the documentation's complete programs (fenced blocks marked `program`), which
//!   the tests compile and run.
//! * [`shm_names`]: what a job left in `/dev/shm`.
//! * [`model`]: exhaustive interleaving exploration for the concurrency protocols (the
//!   shared-memory ring and its doorbells and the dial handshake in `weftcc-transports`, the
//!   communicator's ticket protocol in `weftcc-comm`).
//! * [`ranks`]: rank processes of a multi-process test, waited for with a deadline.

#![forbid(unsafe_code)]

pub mod docs;
pub mod etcd;
pub mod fuzz;
pub mod model;
pub mod ranks;

/// The names in `/dev/shm` that start with `prefix` (a job's shared-memory objects: tests check
/// that none is left under a name).
pub fn shm_names(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .expect("/dev/shm")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}
