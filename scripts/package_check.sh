#!/usr/bin/env bash
# Checks that every publishable crate of the workspace packages and builds from its package
# alone (`cargo package`: the files a registry would get, compiled in a scratch directory with
# the other crates of the workspace as their packages), i.e. that the crates are ready to
# publish. Not run by CI (it builds every crate again: ~15 minutes on 2 cores); run it before
# a release or after changing a Cargo.toml:
#   scripts/package_check.sh              # verify (build) every package
#   scripts/package_check.sh --no-verify  # only assemble them (a minute)
# (cargo package refuses uncommitted changes: commit them, or add --allow-dirty)
# The .crate files land in target/package/.
set -euo pipefail
cd "$(dirname "$0")/.."
# weftcc-testkit is the tests' helper (publish = false).
cargo package --workspace --exclude weftcc-testkit --locked "$@"
echo "package_check: every crate packaged$([ "${1:-}" = --no-verify ] || echo " and built from its package")"
