#!/usr/bin/env bash
# Soak (not a CI test; bounded time): communicator create/destroy cycles, then random collectives
# with every result checked, under `weft run`; each rank samples its resident memory, open file
# descriptors, threads and weftcc's /dev/shm entries (examples/soak.rs).
#   benches/soak.sh                     CYCLES=10000 SECONDS_RANDOM=1800 NP=4
#   CYCLES=2000 SECONDS_RANDOM=300 benches/soak.sh
# Prints the samples, then per rank and metric the first, last and largest value after the
# warm-up (the first sample after the first 10 % of the run): growth shows as last > first.
# RAW=FILE keeps the samples. Exits non-zero if a result was wrong, a rank failed, or /dev/shm
# holds a weft segment after the job.
set -euo pipefail
cd "$(dirname "$0")/.."
cycles=${CYCLES:-10000}
secs=${SECONDS_RANDOM:-1800}
np=${NP:-4}
cargo build --release --bin weft --example soak >&2
weft=target/release/weft
soak=target/release/examples/soak
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

run_phase() {
  local name=$1; shift
  echo "== $name: weft run -n $np -- soak $*" >&2
  local start=$SECONDS
  "$weft" run -n "$np" -- "$soak" "$@" | tee -a "$raw" | grep -v '^\[' || true
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s" >&2
  [ "$rc" = 0 ] || { echo "soak: $name failed" >&2; exit 1; }
}

summarize() {
  # SAMPLE lines arrive as "[rank]: SAMPLE rank t rss fds threads shm done".
  awk -v phase="$1" '
    /SAMPLE/ {
      sub(/^.*SAMPLE /, "");
      r = $1; t = $2; n[r]++;
      rss[r, n[r]] = $3; fds[r, n[r]] = $4; thr[r, n[r]] = $5; shm[r, n[r]] = $6; done[r] = $7;
    }
    END {
      printf "%s: rank  rss KiB (warm → last, max)   fds (warm → last, max)   threads   shm   ops\n", phase;
      for (r in n) {
        w = int(n[r] / 10) + 1; if (w > n[r]) w = n[r];
        mr = 0; mf = 0;
        for (i = w; i <= n[r]; i++) { if (rss[r, i] > mr) mr = rss[r, i]; if (fds[r, i] > mf) mf = fds[r, i]; }
        printf "%s: %4d  %8d → %8d, %8d   %4d → %4d, %4d   %3d → %3d   %d → %d   %d\n", phase, r,
          rss[r, w], rss[r, n[r]], mr, fds[r, w], fds[r, n[r]], mf, thr[r, w], thr[r, n[r]],
          shm[r, w], shm[r, n[r]], done[r];
      }
    }' "$2"
}

: >"$raw"
run_phase cycles cycles "$cycles"
cp "$raw" "$raw.cycles"
: >"$raw"
run_phase random random "$secs" "${SEED:-1}"
summarize "create/destroy" "$raw.cycles"
summarize "random" "$raw"
left=$(ls /dev/shm | grep -c '^weft' || true)
echo "weft entries left in /dev/shm after the job: $left"
if [ -n "${RAW:-}" ]; then cat "$raw.cycles" "$raw" >"$RAW"; fi
rm -f "$raw.cycles"
[ "$left" = 0 ]
