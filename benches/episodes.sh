#!/usr/bin/env bash
# Slow episodes, side by side: in each of REPEAT rounds, the machine's state and OpenMPI and weft
# running the same all-reduce under the same conditions, one after the other:
#
#   benches/episodes.sh [SIZE...]          (default 64K 1M 16M)
#
# Per round and size it prints one line per side: time per iteration (us, maximum over ranks of
# the mean, as vs_mpi_collectives.sh), the whole command's user and system CPU seconds
# (/usr/bin/time), its context switches, CPU migrations and page faults (perf stat, software
# events), and the machine around it: one thread's memcpy and a += b rates just before
# (benches/baseline/memcpy_bw.c at 64 MiB), the load average, and the share of CPU time the
# hypervisor stole during the command (/proc/stat). The summary gives each side's min/median/max
# over the rounds and max/median. A slow round of weft with OpenMPI steady in the same round, the
# probe steady and the same user CPU points at weft; both slow with the probe or steal moved
# points at the machine. Environment: REPEAT (default 7), ITERS (iterations below 1 MiB, below
# 16 MiB and from 16 MiB on, default "400 100 40"), NP
# (default 2), WEFT_ENV (e.g. "WEFT_CPU_BIND=core") and MPIRUN_ARGS (e.g. "--bind-to none")
# for the two sides, OUT (default target/perf/episodes).
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a sizes <<<"${*:-64K 1M 16M}"
repeat=${REPEAT:-7}
read -r -a iters <<<"${ITERS:-400 100 40}"
((${#iters[@]} == 3)) || { echo "ITERS needs three counts (<1M <16M >=16M)" >&2; exit 2; }
np=${NP:-2}
out=${OUT:-target/perf/episodes}
read -r -a weft_env <<<"${WEFT_ENV:-}"
read -r -a mpirun_extra <<<"${MPIRUN_ARGS:-}"
source benches/need.sh
need cc build-essential "a C compiler"
need mpicc "openmpi-bin libopenmpi-dev" "OpenMPI"
need perf linux-perf "perf"
mkdir -p "$out"
cc -O3 -march=native -o "$out/memcpy_bw" benches/baseline/memcpy_bw.c
mpicc -O3 -o "$out/mpi_collectives" benches/mpi_collectives.c
cargo build --release --bin weft -q
# A copy, so that a rebuild while this runs cannot change the binary between rounds.
cp target/release/weft "$out/weft"
weft=$out/weft

to_bytes() {
  local v=${1%[KkMmGg]}
  case $1 in *[Kk]) echo $((v << 10)) ;; *[Mm]) echo $((v << 20)) ;; *[Gg]) echo $((v << 30)) ;; *) echo "$v" ;; esac
}
steal_ticks() { awk '$1 == "cpu" { print $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9 }' /proc/stat; }

# run SIDE SIZE CMD...: one measured command; prints its line and appends it to the raw file.
run() {
  local side=$1 size=$2 st0 st1 t
  shift 2
  read -r -a st0 <<<"$(steal_ticks)"
  perf stat -x, -e context-switches,cpu-migrations,page-faults -o "$out/stat.txt" -- \
    /usr/bin/time -f "TIME %U %S %e" -o "$out/time.txt" "$@" >"$out/cmd.txt" 2>&1 || {
    echo "$side failed:" >&2
    tail -5 "$out/cmd.txt" >&2
    return 1
  }
  read -r -a st1 <<<"$(steal_ticks)"
  case $side in
    mpi) t=$(awk -v s="$size" '$1 == s && NF == 6 { print $3 }' "$out/cmd.txt") ;;
    *) t=$(awk -v s="$size" '$1 == s && NF >= 13 { print $6 }' "$out/cmd.txt") ;;
  esac
  awk -v side="$side" -v size="$size" -v t="${t:-?}" -v round="$round" -v probe="$probe" \
    -v load="$(cut -d' ' -f1 /proc/loadavg)" \
    -v steal="$(awk -v a="${st1[0]}" -v b="${st0[0]}" -v c="${st1[1]}" -v d="${st0[1]}" \
      'BEGIN { printf "%.1f", (c > d) ? 100 * (a - b) / (c - d) : 0 }')" '
    FILENAME ~ /time.txt$/ && $1 == "TIME" { user = $2; sys = $3 }
    FILENAME ~ /stat.txt$/ { split($0, f, ","); ev[f[3]] = f[1] }
    END {
      printf "%5s %-5s %10s %10s %6s %6s %7s %6s %7s %6s %6s  %s\n", round, side, size, t, user, sys,
        ev["context-switches"], ev["cpu-migrations"], ev["page-faults"], load, steal, probe
    }' "$out/time.txt" "$out/stat.txt" | tee -a "$raw"
}

raw=$out/episodes-$np.txt
: >"$raw"
echo "== $np ranks, ${iters[*]} iterations (<1M <16M >=16M), $repeat rounds; weft env: ${weft_env[*]:-none}; mpirun: ${mpirun_extra[*]:-default binding}"
printf "%5s %-5s %10s %10s %6s %6s %7s %6s %7s %6s %6s  %s\n" round side size us user-s sys-s ctxsw migr faults load steal% \
  "probe (memcpy_bw 64 MiB just before)"
for ((round = 1; round <= repeat; round++)); do
  for s in "${sizes[@]}"; do
    b=$(to_bytes "$s")
    if ((b < 1 << 20)); then n=${iters[0]}; elif ((b < 16 << 20)); then n=${iters[1]}; else n=${iters[2]}; fi
    probe=$("$out/memcpy_bw" 64 | sed 's/memcpy 64 MiB: //; s/ copied; reduce a+=b://; s/ of a//')
    run mpi "$b" mpirun --allow-run-as-root --oversubscribe -n "$np" "${mpirun_extra[@]}" \
      "$out/mpi_collectives" all-reduce float "$b" "$b" "$n" "$n" "$n" 10
    run weft "$b" env "${weft_env[@]}" "$weft" perf all-reduce --np "$np" -b "$b" -e "$b" \
      -n "$n" -w 10 -a 3
  done
done
echo "== min/median/max of the rounds' times (us) and max/median"
awk '$1 ~ /^[0-9]+$/ && $4 ~ /^[0-9.]+$/ { k = $3 " " $2; n[k]++; v[k, n[k]] = $4 + 0; if (!(k in seen)) { seen[k] = 1; order[++keys] = k } }
  END {
    for (i = 1; i <= keys; i++) {
      k = order[i]; m = n[k]
      for (j = 1; j <= m; j++) a[j] = v[k, j]
      for (j = 2; j <= m; j++) { t = a[j]; l = j - 1; while (l >= 1 && a[l] > t) { a[l + 1] = a[l]; l-- }; a[l + 1] = t }
      med = a[int((m + 1) / 2)]
      printf "%-16s %10.1f %10.1f %10.1f %6.2f\n", k, a[1], med, a[m], a[m] / med
    }
  }' "$raw"
rm -f "$out/stat.txt" "$out/time.txt" "$out/cmd.txt"
echo "== raw: $raw"
