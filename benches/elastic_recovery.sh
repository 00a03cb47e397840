#!/usr/bin/env bash
# Elastic training: recovery time and the cost of the elastic checks on the healthy path.
#
#   benches/elastic_recovery.sh [RUNS]        (after `cargo build --release`; RUNS default 7)
#
# 1. Recovery: `weft run -n 4 --elastic -- weft train --elastic`, one rank SIGKILLed after step
#    20 (WEFT_TRAIN_KILL_AT; rank 1, then rank 0). Per run: the time from the kill (the victim's
#    clock just before SIGKILL) to rank 0's first completed step after the shrink, and rank 0's
#    own figure (from the error it saw to that step). Medians over RUNS runs.
# 2. Healthy path (2 ranks: one CPU each on the 2-CPU machine): steps/s without --elastic,
#    with --elastic --join-check-every 1 and with --elastic (a check every 10 steps, the
#    default). A check is joiners_waiting(): rank 0 reads two store counters and broadcasts 8
#    bytes; rank 0 reports its mean time. The three alternate (the order rotates each round),
#    RUNS rounds, 32768 samples x 2 epochs (512 steps); medians and ratios to the plain run.
#    Steps/s is the trainer's own: steps / its whole training time (set-up, the per-epoch
#    evaluation and every check included).
set -euo pipefail
cd "$(dirname "$0")/.."
W=target/release/weft
RUNS=${1:-7}
TRAIN=(--no-progress --samples 8192 --test-samples 512 --epochs 2 --batch 32 --seed 3)
export WEFT_TIMEOUT=30
HEALTHY=(--no-progress --samples 32768 --test-samples 512 --epochs 2 --batch 32 --seed 3)

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) exit; if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "# elastic recovery: $(date -u +%FT%TZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!docs/perf' || echo +changes)"
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

echo "# healthy path: 2 ranks, ${HEALTHY[*]}; steps/s, alternating plain / --elastic --join-check-every 1 / --elastic (every 10)"
declare -A rates checks
order=(plain every1 elastic)
for i in $(seq "$RUNS"); do
  order=("${order[1]}" "${order[2]}" "${order[0]}")
  for mode in "${order[@]}"; do
    case $mode in
      plain) args=() ; launch=() ;;
      every1) args=(--elastic --join-check-every 1) ; launch=(--elastic) ;;
      elastic) args=(--elastic) ; launch=(--elastic) ;;
    esac
    out=$($W run -n 2 "${launch[@]}" -- $W train "${args[@]}" "${HEALTHY[@]}" 2>&1)
    rate=$(grep -o '([0-9.]* steps/s)' <<<"$out" | grep -o '[0-9.]*' | head -1)
    rates[$mode]+="$rate "
    check=$(grep -o 'checks for newcomers, [0-9.]* us each' <<<"$out" | grep -o '[0-9.]* us' || true)
    [ -n "$check" ] && checks[$mode]+="${check% us} "
    echo "round $i $mode: $rate steps/s${check:+; a check for newcomers (rank 0) $check}"
  done
done
p=$(tr ' ' '\n' <<<"${rates[plain]}" | grep . | median)
for mode in plain every1 elastic; do
  m=$(tr ' ' '\n' <<<"${rates[$mode]}" | grep . | median)
  c=$(tr ' ' '\n' <<<"${checks[$mode]:-}" | grep . | median || true)
  echo "MEDIAN $mode: $m steps/s (ratio to plain $(awk -v a="$m" -v b="$p" 'BEGIN{printf "%.3f", a/b}'))${c:+; one check for newcomers $c us on rank 0}"
done
