#!/usr/bin/env bash
# weftcc against OpenMPI for every collective, one data type, measured in the same run:
#   benches/vs_mpi_collectives.sh [ranks] [dtype]        (default 2 float)
# For each collective (all-reduce all-gather reduce-scatter broadcast reduce all-to-all) it runs
# benches/mpi_collectives.c under `mpirun -n ranks` and `weft perf <collective> --np ranks` at the
# same sizes, iteration counts and data type (op sum, root 0), both reporting the MAXIMUM over
# ranks of the average time per iteration (weft perf -a 3), then prints one table: OpenMPI
# time/busbw, weft out-of-place and in-place time/busbw and the ratios OpenMPI time / weft time
# (>1: weft faster). Sizes and bus factors are the same on both sides, so from 4 KiB on this is
# exactly vs_baseline.sh's busbw ratio weft/OpenMPI, only computed from the times, which are
# printed with more digits. Rows where weft's time is more than 10 % above OpenMPI's (ratio
# < 1/1.1), where a value was wrong, or where the two disagree on the element count are flagged.
# Sizes follow nccl-tests: all-gather, reduce-scatter and all-to-all count the whole buffer
# (per-rank count x ranks elements); the count column is the per-rank count.
# Environment:
#   SIZES="8 128 ..."         sizes in bytes (default 8 16 ... 128M, doubling; K/M/G suffixes)
#   ITERS="200 40 10"         timed iterations below 1 MiB, below 16 MiB, from 16 MiB on
#   WARMUP=5                  warm-up iterations per size
#   COLLECTIVES="..."         a subset of the collectives
#   WIRE=shm|tcp              tcp: weft with WEFT_SHM_DISABLE=1, OpenMPI with its TCP BTL
#   MPIRUN_ARGS="..."         extra mpirun options (e.g. --bind-to none; OpenMPI binds ranks
#                             to cores by default, weft perf gives each rank its own share of
#                             the CPUs; both leave ranks that outnumber the CPUs unbound)
#   WEFT_PERF_OUT=dir         output folder (default target/perf/collectives)
#   REPEAT=1                  rounds per collective, each an OpenMPI sweep then a weft sweep;
#                             with more than one the table gives each side's median per size
#                             (per column; #wrong: the maximum) and the range of each round's
#                             ratios, [min-max]: on a shared machine single runs of sub-µs rows
#                             swing by ±20 %, and alternating rounds see the same noise; a
#                             second table gives each side's min/median/max over the rounds per
#                             size and max/median (EPISODE: weft's > 1.5 where OpenMPI's is not)
# Other environment (e.g. WEFT_SHM_CMA=0) reaches the weft runs. Leaves, per collective, the raw
# outputs (mpi-*.txt, weft-*.txt), JSON (mpi-*.json from `weft baseline-json`, weft-*-<run>.json
# from weft perf --json) and an SVG plot (*.svg) in the output folder. Sizes are measured in runs:
# chains of requested sizes that double within one iteration band, one OpenMPI sweep and one
# weft perf sweep each (the default sizes make 3 runs per collective). The plot is drawn by the
# last weft run (solid: its sizes); the other runs' weft rows and OpenMPI's are dashed baselines.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2}
dtype=${2:-float}
wire=${WIRE:-shm}
read -r -a iters <<<"${ITERS:-200 40 10}"
warmup=${WARMUP:-5}
repeat=${REPEAT:-1}
((repeat >= 1)) || { echo "REPEAT must be at least 1" >&2; exit 2; }
read -r -a colls <<<"${COLLECTIVES:-all-reduce all-gather reduce-scatter broadcast reduce all-to-all}"
read -r -a mpirun_extra <<<"${MPIRUN_ARGS:-}"
out=${WEFT_PERF_OUT:-target/perf/collectives}
((${#iters[@]} == 3)) || { echo "ITERS needs three counts (<1M <16M >=16M)" >&2; exit 2; }

to_bytes() { # 4K -> 4096
  local v=${1%[KkMmGg]}
  case $1 in
    *[Kk]) echo $((v << 10)) ;;
    *[Mm]) echo $((v << 20)) ;;
    *[Gg]) echo $((v << 30)) ;;
    *) echo "$v" ;;
  esac
}
band() { # iteration band of a size: 0 below 1 MiB, 1 below 16 MiB, 2 from 16 MiB on
  if (($1 < 1 << 20)); then echo 0; elif (($1 < 16 << 20)); then echo 1; else echo 2; fi
}
sizes=()
if [ -n "${SIZES:-}" ]; then
  for s in $SIZES; do sizes+=("$(to_bytes "$s")"); done
else
  for ((s = 8; s <= 128 << 20; s *= 2)); do sizes+=("$s"); done
fi
# Runs: maximal chains of requested sizes that double and share an iteration band, so that one
# OpenMPI sweep and one weft perf sweep (-b first -e last) measure exactly the requested sizes.
runs=()
first=${sizes[0]} prev=${sizes[0]}
for s in "${sizes[@]:1}"; do
  if ((s == 2 * prev)) && [ "$(band "$s")" = "$(band "$prev")" ]; then
    prev=$s
  else
    runs+=("$first $prev")
    first=$s prev=$s
  fi
done
runs+=("$first $prev")

case $wire in
  shm) weft_env=() mpi_wire=() ;;
  tcp) weft_env=(WEFT_SHM_DISABLE=1)
    mpi_wire=(--mca pml ob1 --mca btl "tcp,self" --mca btl_tcp_if_include lo) ;;
  *) echo "WIRE must be shm or tcp" >&2; exit 2 ;;
esac

source benches/need.sh
need mpicc "openmpi-bin libopenmpi-dev" "OpenMPI"
need mpirun "openmpi-bin" "OpenMPI's mpirun"
mkdir -p "$out"
mpicc -O3 -o "$out/mpi_collectives" benches/mpi_collectives.c
cargo build --release --bin weft -q
weft=target/release/weft
mpirun=(mpirun --allow-run-as-root --oversubscribe -n "$n" "${mpi_wire[@]}" "${mpirun_extra[@]}")

# Medians over rounds: prints the first file with each data row (first field a size) replaced
# field by field by the lower median over all files' rows of that size (an actual value, so its
# printed form is kept); the fields listed in MAXF (#wrong) take the maximum instead.
median_rows() {
  local maxf=$1
  shift
  awk -v maxf="$maxf" '
    function isnum(x) { return x ~ /^-?[0-9]+(\.[0-9]+)?$/ }
    BEGIN { n = split(maxf, m, " "); for (i = 1; i <= n; i++) takemax[m[i]] = 1 }
    FNR == 1 { file++ }
    NF >= 6 && $1 ~ /^[0-9]+$/ { k = $1; c = ++cnt[k]; nf[k] = NF; for (f = 1; f <= NF; f++) v[k, f, c] = $f }
    file == 1 { line[++lines] = $0 }
    END {
      for (l = 1; l <= lines; l++) {
        $0 = line[l]
        if (!(NF >= 6 && $1 ~ /^[0-9]+$/)) { print; continue }
        k = $1; out = ""
        for (f = 1; f <= nf[k]; f++) {
          x = v[k, f, 1]
          if (isnum(x) && cnt[k] > 1) {
            for (i = 1; i <= cnt[k]; i++) a[i] = v[k, f, i] + 0
            for (i = 2; i <= cnt[k]; i++) { t = a[i]; j = i - 1; while (j >= 1 && a[j] > t) { a[j + 1] = a[j]; j-- }; a[j + 1] = t }
            pick = (f in takemax) ? a[cnt[k]] : a[int((cnt[k] + 1) / 2)]
            for (i = 1; i <= cnt[k]; i++) if (v[k, f, i] + 0 == pick) { x = v[k, f, i]; break }
          }
          out = out (f > 1 ? " " : "") x
        }
        print out
      }
    }' "$@"
}

# One table row per OpenMPI row, joined with weft's row of the same size.
join_rows() { # collective mpi-file weft-file
  awk -v c="$1" '
    FNR == 1 { file++ }
    file == 1 && NF == 6 && $1 ~ /^[0-9]+$/ { order[++rows] = $1; mc[$1] = $2; mt[$1] = $3; mb[$1] = $5; mw[$1] = $6 }
    file == 2 && NF >= 13 && $1 ~ /^[0-9]+$/ { wc[$1] = $2; ot[$1] = $6; ob[$1] = $8; ow[$1] = $9; it[$1] = $10; ib[$1] = $12; iw[$1] = $13 }
    END {
      for (k = 1; k <= rows; k++) {
        s = order[k]
        if (!(s in wc)) { printf "%-14s %10s %10s %10s %8s  %s\n", c, s, mc[s], mt[s], mb[s], "weft row missing"; continue }
        ro = (ot[s] > 0 ? mt[s] / ot[s] : 0); ri = (it[s] > 0 ? mt[s] / it[s] : 0)
        flag = ""
        if (ro < 1 / 1.1 || ri < 1 / 1.1) flag = flag " SLOWER>10%"
        if (mc[s] != wc[s]) flag = flag " COUNT(weft " wc[s] ")"
        if (mw[s] != 0 || ow[s] != 0 || iw[s] != 0) flag = flag " WRONG(" mw[s] "/" ow[s] "/" iw[s] ")"
        printf "%-14s %10s %10s %10s %8s %10s %8s %10s %8s %7.2f %7.2f%s\n", c, s, mc[s], mt[s], mb[s], ot[s], ob[s], it[s], ib[s], ro, ri, flag
      }
    }' "$2" "$3"
}

# Each side's spread over the rounds, per size: minimum, median and maximum of the rounds' times
# (OpenMPI; weft out of place and in place), and max/median. A side whose slowest round is more
# than 1.5x its median is flagged EPISODE(side), so slow rounds show here, not only in the raw
# files.
spread_rows() { # collective round-files (mpi-*-r*.txt, weft-*-r*.txt)
  local c=$1
  shift
  awk -v c="$c" '
    function isnum(x) { return x ~ /^-?[0-9]+(\.[0-9]+)?$/ }
    function add(key, s, x) { if (!isnum(x)) return; k = key SUBSEP s; n[k]++; v[k, n[k]] = x + 0 }
    function stats(key, s,   k, i, j, t, m) {
      k = key SUBSEP s
      if (!(k in n)) return "-"
      m = n[k]
      for (i = 1; i <= m; i++) a[i] = v[k, i]
      for (i = 2; i <= m; i++) { t = a[i]; j = i - 1; while (j >= 1 && a[j] > t) { a[j + 1] = a[j]; j-- }; a[j + 1] = t }
      med = a[int((m + 1) / 2)]; lo = a[1]; hi = a[m]
      return sprintf("%s/%s/%s %.2f", lo, med, hi, med > 0 ? hi / med : 0)
    }
    FNR == 1 { side = (FILENAME ~ /(^|\/)weft-[^\/]*$/) ? "w" : "m" }
    side == "m" && NF == 6 && $1 ~ /^[0-9]+$/ { if (!($1 in seen)) { seen[$1] = 1; order[++rows] = $1 }; add("m", $1, $3) }
    side == "w" && NF >= 13 && $1 ~ /^[0-9]+$/ { add("o", $1, $6); add("i", $1, $10) }
    END {
      for (r = 1; r <= rows; r++) {
        s = order[r]; flag = ""
        ms = stats("m", s); split(ms, mm, " ")
        os = stats("o", s); split(os, oo, " ")
        is = stats("i", s); split(is, ii, " ")
        if (oo[2] > 1.5 && mm[2] <= 1.5) flag = flag " EPISODE(oop)"
        if (ii[2] > 1.5 && mm[2] <= 1.5) flag = flag " EPISODE(ip)"
        printf "%-14s %10s %24s %5s %24s %5s %24s %5s%s\n", c, s, mm[1], mm[2], oo[1], oo[2], ii[1], ii[2], flag
      }
    }' "$@"
}

table=$out/table-$dtype-$wire-$n.txt
spread=$out/spread-$dtype-$wire-$n.txt
: >"$table"
: >"$spread"
for c in "${colls[@]}"; do
  tag=$c-$dtype-$wire-$n
  rm -f "$out/mpi-$tag"-r*.txt "$out/weft-$tag"-r*.txt "$out/weft-$tag"-*.json
  : >"$out/mpi-$tag.err"
  for ((rep = 1; rep <= repeat; rep++)); do
    round=$([ "$repeat" -gt 1 ] && echo ", round $rep of $repeat" || true)
    echo "== $c, $dtype, $n ranks, $wire: OpenMPI$round" >&2
    : >"$out/mpi-$tag-r$rep.txt"
    for r in "${runs[@]}"; do
      read -r b e <<<"$r"
      if ! "${mpirun[@]}" "$out/mpi_collectives" "$c" "$dtype" "$b" "$e" "${iters[@]}" "$warmup" \
        >>"$out/mpi-$tag-r$rep.txt" 2>>"$out/mpi-$tag.err"; then
        tail -n 20 "$out/mpi-$tag.err" >&2
        exit 1
      fi
    done
    if ((rep == repeat)); then
      median_rows 6 "$out/mpi-$tag"-r*.txt >"$out/mpi-$tag.txt"
      "$weft" baseline-json "$out/mpi-$tag.txt" -o "$out/mpi-$tag.json"
    fi
    echo "== $c, $dtype, $n ranks, $wire: weft perf$round" >&2
    : >"$out/weft-$tag-r$rep.txt"
    last=$((${#runs[@]} - 1))
    for i in "${!runs[@]}"; do
      read -r b e <<<"${runs[i]}"
      k=$(band "$b")
      # The last round's last run draws the plot: its own out-of-place and in-place curves,
      # OpenMPI's (medians), and weft's rows of this round's earlier runs (the other sizes).
      plot=()
      if ((rep == repeat && i == last)); then
        plot=(--plot "$out/$tag.svg" --baseline "$out/mpi-$tag.json")
        for half in oop ip; do
          if ((i == 0)); then break; fi
          label=$([ $half = oop ] && echo out-of-place || echo in-place)
          awk -v h=$half 'NF >= 13 && $1 ~ /^[0-9]+$/ {
              if (h == "oop") print $1, $2, $6, $7, $8, $9; else print $1, $2, $10, $11, $12, $13 }' \
            "$out/weft-$tag-r$rep.txt" >"$out/weft-$tag-earlier-$half.txt"
          if "$weft" baseline-json "$out/weft-$tag-earlier-$half.txt" --label "weft $dtype, $label (other sizes)" \
            -o "$out/weft-$tag-earlier-$half.json"; then
            plot+=(--baseline "$out/weft-$tag-earlier-$half.json")
          fi
        done
      fi
      env "${weft_env[@]}" "$weft" perf "$c" --np "$n" -d "$dtype" -o sum -r 0 -a 3 -b "$b" -e "$e" \
        -n "${iters[k]}" -w "$warmup" --json "$out/weft-$tag-$i.json" "${plot[@]}" \
        >"$out/weft-$tag-$i.txt" || true
      cat "$out/weft-$tag-$i.txt" >>"$out/weft-$tag-r$rep.txt"
    done
  done
  median_rows "9 13" "$out/weft-$tag"-r*.txt >"$out/weft-$tag.txt"
  if ((repeat == 1)); then
    join_rows "$c" "$out/mpi-$tag.txt" "$out/weft-$tag.txt" >>"$table"
  else
    # Each round's own ratios, their range appended to the medians' row.
    for ((rep = 1; rep <= repeat; rep++)); do
      join_rows "$c" "$out/mpi-$tag-r$rep.txt" "$out/weft-$tag-r$rep.txt"
    done >"$out/rounds-$tag.txt"
    spread_rows "$c" "$out/mpi-$tag"-r*.txt "$out/weft-$tag"-r*.txt >>"$spread"
    join_rows "$c" "$out/mpi-$tag.txt" "$out/weft-$tag.txt" |
      awk 'FNR == 1 { file++ }
        file == 1 && NF >= 11 { s = $2; if (!(s in lo)) { lo[s] = hi[s] = $10; li[s] = hi2[s] = $11 }
          if ($10 < lo[s]) lo[s] = $10; if ($10 > hi[s]) hi[s] = $10
          if ($11 < li[s]) li[s] = $11; if ($11 > hi2[s]) hi2[s] = $11; next }
        file == 2 { if (NF >= 11 && ($2 in lo)) printf "%s [%s-%s] [%s-%s]\n", $0, lo[$2], hi[$2], li[$2], hi2[$2]; else print }' \
        "$out/rounds-$tag.txt" - >>"$table"
  fi
done

medians=$([ "$repeat" -gt 1 ] && echo "; medians of $repeat alternating rounds, [min-max] of the rounds' r-oop and r-ip" || true)
echo "== weft vs OpenMPI, $dtype, $n ranks, $wire (time: max over ranks of the mean per iteration, us; busbw GB/s; r = OpenMPI time / weft time = weft busbw / OpenMPI busbw, >1: weft faster$medians)"
printf "%-14s %10s %10s %10s %8s %10s %8s %10s %8s %7s %7s\n" collective size count \
  "mpi-us" "mpi-bus" "oop-us" "oop-bus" "ip-us" "ip-bus" "r-oop" "r-ip"
cat "$table"
if ((repeat > 1)); then
  echo "== spread over $repeat rounds: min/median/max of the rounds' times (us) and max/median, OpenMPI, weft out of place, weft in place (EPISODE: weft's slowest round > 1.5x its median where OpenMPI's is not)"
  printf "%-14s %10s %24s %5s %24s %5s %24s %5s\n" collective size "mpi min/med/max" "x" \
    "oop min/med/max" "x" "ip min/med/max" "x"
  cat "$spread"
fi
echo "== files in $out: mpi-<collective>-$dtype-$wire-$n.{txt,json} (OpenMPI), weft-<collective>-$dtype-$wire-$n.txt (all weft rows; both medians of the rounds, each round in -r<round>.txt), weft-<collective>-$dtype-$wire-$n-<run>.{txt,json} (one per weft perf run), <collective>-$dtype-$wire-$n.svg, $(basename "$table")"
