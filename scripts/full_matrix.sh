#!/usr/bin/env bash
# The full correctness matrix of tests/collectives.rs: every collective × type × reduction × rank
# count × count × placement × wire, and every forced algorithm with every type and reduction
# (the `full_*` tests, #[ignore]d). CI's `cargo test --workspace --release` runs a slice of it
# that still meets every pair of dimensions (`ci_slices_cover_every_pair`). Run this before a
# release or after changing a kernel, a schedule or a transport (on a 2-core machine the slice
# took 2-3 minutes, this 10-30). Extra arguments go to the test harness (a name filter,
# `--test-threads=1`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo test --release --test collectives -- --ignored "$@"
