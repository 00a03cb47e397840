//! Test support for weftcc's crates; a dev-dependency only, never part of the library.
//!
//! * [`fuzz`]: proptest run for many cases over one target (`WEFT_FUZZ_CASES`), the count
//!   printed: the fuzz tests of `weftcc-transports` and `weftcc-topology`.
//! * [`model`]: exhaustive interleaving exploration for the concurrency protocols (the
//!   shared-memory ring and its doorbells and the dial handshake in `weftcc-transports`, the
//!   communicator's ticket protocol in `weftcc-comm`).

#![forbid(unsafe_code)]

pub mod fuzz;
pub mod model;
