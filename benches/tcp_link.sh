#!/usr/bin/env bash
# weft over TCP between two "hosts" whose link, not the CPU, is the limit:
#   benches/tcp_link.sh [rate...]                 (default: 1gbit 4gbit unshaped)
# Makes two network namespaces joined by a veth pair, shapes both ends with `tc tbf` at each
# rate ("unshaped": no qdisc, so the two cores are the limit, as on loopback), and measures in
# the same run iperf3's one stream from one namespace to the other and `weft perf all-reduce`
# with one rank in each namespace (so they talk TCP over the veth), 2 ranks, float sum, -a 3.
# Prints, per rate, iperf3's rate and weft's busbw at the largest sizes with their ratio: on
# loopback with 2 cores the ranks and the kernel's TCP work share the cores that iperf3 has to
# itself (docs/performance.md), a shaped link is what two real hosts look like.
# Needs root, iproute2 and iperf3 (installed when missing). Environment: SIZES="-b 1M -e 128M"
# (weft perf's size options), ITERS=20, SECONDS_IPERF=5, COLL=all-reduce (the collective),
# NETS="socket" (the networks weft runs over, each in turn: `socket` is weft's own TCP, `ofi`
# the RDMA code path over libfabric's tcp provider, WEFT_NET=ofi WEFT_OFI_PROVIDER=tcp, and
# `ofi-ring` the same with rendezvous off, WEFT_NET_RNDV_THRESHOLD=0; `socket-TxS` weft's TCP
# over T helper threads of S sockets each, WEFT_SOCKET_NTHREADS=T WEFT_NSOCKS_PERTHREAD=S).
set -euo pipefail
cd "$(dirname "$0")/.."
rates=("$@")
((${#rates[@]})) || rates=(1gbit 4gbit unshaped)
read -r -a sizes <<<"${SIZES:--b 1M -e 128M}"
iters=${ITERS:-20}
secs=${SECONDS_IPERF:-5}
read -r -a nets <<<"${NETS:-socket}"
coll=${COLL:-all-reduce}
[ "$(id -u)" = 0 ] || { echo "tcp_link: needs root (network namespaces)" >&2; exit 2; }
source benches/need.sh
need ip iproute2 "iproute2 (ip)"
need tc iproute2 "iproute2 (tc)"
need iperf3 iperf3 "iperf3"
cargo build --release --bin weft -q
weft=$PWD/target/release/weft
out=${WEFT_PERF_OUT:-target/perf}/tcp-link
mkdir -p "$out"

tag=$(printf '%x' $(($$ % 0xfffff)))
ns=(weftlink-$tag-a weftlink-$tag-b)
dev=(wl${tag}a wl${tag}b)
ip=(10.232.7.1 10.232.7.2)
cleanup() { for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done; }
trap cleanup EXIT
for n in "${ns[@]}"; do ip netns add "$n"; done
ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for i in 0 1; do
  ip link set "${dev[i]}" netns "${ns[i]}"
  ip -n "${ns[i]}" addr add "${ip[i]}/24" dev "${dev[i]}"
  ip -n "${ns[i]}" link set "${dev[i]}" up
  ip -n "${ns[i]}" link set lo up
done

summary=()
for rate in "${rates[@]}"; do
  for i in 0 1; do
    ip netns exec "${ns[i]}" tc qdisc del dev "${dev[i]}" root 2>/dev/null || true
    if [ "$rate" != unshaped ]; then
      # tbf needs a bucket of at least one timer tick's worth of bytes at the rate; 4 MB covers
      # 10 Gbit/s at 250 Hz.
      ip netns exec "${ns[i]}" tc qdisc add dev "${dev[i]}" root tbf rate "$rate" burst 4mb latency 50ms
    fi
  done
  echo "== $rate: iperf3, 1 stream, ${secs} s, ${ip[1]} -> ${ip[0]}"
  ip netns exec "${ns[0]}" iperf3 -s -1 -p 5601 >/dev/null 2>&1 &
  sleep 0.5
  # Mbits/s (decimal, as weft's GB/s are 1e9 bytes; iperf3's byte formats are binary).
  iperf=$(ip netns exec "${ns[1]}" iperf3 -c "${ip[0]}" -p 5601 -t "$secs" -f m 2>&1 |
    awk '/receiver/ { printf "%.3f", $(NF-2) / 8000 }')
  wait || true
  echo "iperf3: ${iperf:-?} GB/s"
  for net in "${nets[@]}"; do
  echo "== $rate: weft perf $coll over $net, 2 ranks, one per namespace (over the veth)"
  rndv=64K
  [ "$net" = ofi-ring ] && rndv=0
  wnet=${net%-ring} threads=0 socks=1
  if [[ $net =~ ^socket-([0-9]+)x([0-9]+)$ ]]; then
    wnet=socket threads=${BASH_REMATCH[1]} socks=${BASH_REMATCH[2]}
  fi
  pids=()
  for rank in 0 1; do
    ip netns exec "${ns[rank]}" env WEFT_RANK=$rank WEFT_WORLD_SIZE=2 WEFT_LOCAL_RANK=0 \
      WEFT_LOCAL_WORLD_SIZE=1 WEFT_MASTER_ADDR="${ip[0]}" WEFT_MASTER_PORT=29471 \
      WEFT_JOB_TOKEN="link$tag" WEFT_HOST_ID="link-host-$rank" WEFT_SOCKET_IFNAME="=${dev[rank]}" \
      WEFT_NET="$wnet" WEFT_OFI_PROVIDER=tcp WEFT_NET_RNDV_THRESHOLD=$rndv \
      WEFT_SOCKET_NTHREADS=$threads WEFT_NSOCKS_PERTHREAD=$socks \
      WEFT_TIMEOUT=120 "$weft" perf "$coll" -a 3 "${sizes[@]}" -n "$iters" -w 3 \
      >"$out/weft-$rate-$net-$rank.txt" 2>"$out/weft-$rate-$net-$rank.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$out"/weft-"$rate"-"$net"-*.err >&2; exit 1; }; done
  grep -E '^ +[0-9]+ |#       size|Out of bounds' "$out/weft-$rate-$net-0.txt"
  summary+=("$(awk -v rate="$rate" -v net="$net" -v iperf="${iperf:-0}" '
    NF >= 13 && $1 ~ /^[0-9]+$/ { s = $1; o = $8; p = $12 }
    END { if (iperf > 0) printf "%-9s %-10s %14s %10.3f %10.2f %10.2f %7.0f%% %7.0f%%", rate, net, s, iperf, o, p, 100 * o / iperf, 100 * p / iperf }' \
    "$out/weft-$rate-$net-0.txt")")
  done
done
echo "== weft $coll busbw at the largest size against iperf3's one stream over the same link (GB/s)"
printf "%-9s %-10s %14s %10s %10s %10s %8s %8s\n" link net size iperf3 oop-bus ip-bus oop ip
printf '%s\n' "${summary[@]}"
