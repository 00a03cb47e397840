#!/usr/bin/env bash
# Elastic training: recovery time and the cost of the elastic checks on the healthy path.
#
#   benches/elastic_recovery.sh [RUNS]        (after `cargo build --release`; RUNS default 7)
#
# 1. Recovery: `weft run -n 4 --elastic -- weft train --elastic`, one rank SIGKILLed after step
#    20 (WEFT_TRAIN_KILL_AT; rank 1, then rank 0). Per run: the time from the kill (the victim's
#    clock just before SIGKILL) to rank 0's first completed step after the shrink, and rank 0's
#    own figure (from the error it saw to that step). Medians over RUNS runs.
# 2. Healthy path: steps/s of the same 4-rank job without --elastic, with --elastic (a
#    joiners_waiting() check every step: rank 0 reads two store counters, broadcasts 8 bytes),
#    and with --elastic --join-check-every 10; the three alternate, RUNS rounds; medians and
#    ratios to the plain run. Steps/s is the trainer's own (steps / time in training).
set -euo pipefail
cd "$(dirname "$0")/.."
W=target/release/weft
RUNS=${1:-7}
TRAIN=(--no-progress --samples 8192 --test-samples 512 --epochs 2 --batch 32 --seed 3)
export WEFT_TIMEOUT=30

median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "# elastic recovery: $(date -u +%FT%TZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD)"
echo "# 4 ranks, ${TRAIN[*]}, killed after step 20"
for victim in 1 0; do
  kill_ms=(); self_ms=()
  for i in $(seq "$RUNS"); do
    out=$(WEFT_TRAIN_KILL_AT="$victim:20" $W run -n 4 --elastic -- $W train --elastic "${TRAIN[@]}" 2>&1)
    k=$(grep -o 'kills itself.*unix_ms [0-9]*' <<<"$out" | grep -o '[0-9]*$' | head -1)
    line=$(grep 'elastic: lost ranks' <<<"$out" | head -1)
    r=$(grep -o 'unix_ms [0-9]*' <<<"$line" | grep -o '[0-9]*$')
    s=$(grep -o 'completed [0-9.]* ms' <<<"$line" | grep -o '[0-9.]*')
    kill_ms+=($((r - k))); self_ms+=("$s")
    echo "run $i rank $victim killed: kill -> first step after recovery $((r - k)) ms; error -> step (rank 0) $s ms"
  done
  echo "MEDIAN rank $victim killed: kill -> first step $(printf '%s\n' "${kill_ms[@]}" | median) ms; error -> step $(printf '%s\n' "${self_ms[@]}" | median) ms (runs: $RUNS)"
done

echo "# healthy path: steps/s, alternating plain / --elastic / --elastic --join-check-every 10"
declare -A rates
for i in $(seq "$RUNS"); do
  for mode in plain elastic every10; do
    case $mode in
      plain) args=() ; launch=() ;;
      elastic) args=(--elastic) ; launch=(--elastic) ;;
      every10) args=(--elastic --join-check-every 10) ; launch=(--elastic) ;;
    esac
    out=$($W run -n 4 "${launch[@]}" -- $W train "${args[@]}" "${TRAIN[@]}" 2>&1)
    rate=$(grep -o '([0-9.]* steps/s)' <<<"$out" | grep -o '[0-9.]*' | head -1)
    rates[$mode]+="$rate "
    echo "round $i $mode: $rate steps/s"
  done
done
p=$(tr ' ' '\n' <<<"${rates[plain]}" | grep . | median)
for mode in plain elastic every10; do
  m=$(tr ' ' '\n' <<<"${rates[$mode]}" | grep . | median)
  echo "MEDIAN $mode: $m steps/s (ratio to plain $(awk -v a="$m" -v b="$p" 'BEGIN{printf "%.3f", a/b}'))"
done
