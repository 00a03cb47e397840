# Helpers shared by benches/scale.sh and benches/scale_hosts.sh (sourced, not run).

shm_used() { df -B1 --output=used /dev/shm | tail -1; }
segments() { find /dev/shm -maxdepth 1 -name 'weft-*' 2>/dev/null | wc -l; }

# The column of `weft perf`'s first result row: 6 = out-of-place time.
row_time() { awk '$1 ~ /^[0-9]+$/ { print $6; exit }'; }

# Samples the workers of the launchers given (pids, after the first argument) until all have
# exited: prints the peak /dev/shm use above $1 (bytes), the largest worker RSS (KiB) and the
# most open files of a worker.
sample() {
  local base=$1 peak=0 rss=0 fds=0
  shift
  while :; do
    local alive=0
    for l in "$@"; do kill -0 "$l" 2>/dev/null && alive=1; done
    [ "$alive" = 1 ] || break
    local used=$(( $(shm_used) - base ))
    (( used > peak )) && peak=$used
    for l in "$@"; do
      for w in $(pgrep -P "$l" 2>/dev/null); do
        local r f
        # A worker may exit between pgrep and these reads.
        r=$(awk '/^VmRSS:/ { print $2 }' "/proc/$w/status" 2>/dev/null || true)
        f=$(ls "/proc/$w/fd" 2>/dev/null | wc -l || true)
        (( ${r:-0} > rss )) && rss=${r:-0}
        (( ${f:-0} > fds )) && fds=${f:-0}
      done
    done
    sleep 0.05
  done
  echo "$peak $rss $fds"
}
