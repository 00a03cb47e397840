#!/usr/bin/env bash
# Per-call time of an 8-byte all-reduce on 2 ranks through the C ABI (a C program), weftcc's
# NumPy API (ctypes), and the torch backend (`dist.all_reduce`, with gloo beside it), in
# alternating rounds; medians. Needs `pip install ./python` and torch.
#   bash benches/python_overhead.sh [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
cargo build --release -q -p weftcc-bindings && cargo build --release -q --bin weft
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc -O2 -o "$tmp/c_abi" benches/c_abi_allreduce.c -Ibindings/include -Ltarget/release -lweft \
  -Wl,-rpath,"$(pwd)/target/release"
weft=target/release/weft
cat > "$tmp/numpy8.py" <<'PY'
import time, numpy as np, weftcc
c = weftcc.Communicator.from_env()
x = np.ones(2, np.float32)
for _ in range(100): c.all_reduce(x)
c.barrier()
n = 20000
s = time.perf_counter()
for _ in range(n): c.all_reduce(x)
if c.rank == 0: print(f"numpy_8B_us {(time.perf_counter() - s) / n * 1e6:.2f}")
c.close()
PY
for r in $(seq "$rounds"); do
  "$weft" run -n 2 -- "$tmp/c_abi" 2>/dev/null | grep -o "c_abi_8B_us.*" || true
  "$weft" run -n 2 -- python3 "$tmp/numpy8.py" 2>/dev/null | grep -o "numpy_8B_us.*" || true
  torchrun --standalone --nproc-per-node 2 benches/torch_allreduce.py --rounds 1 --max-bytes 8 --collectives all_reduce 2>/dev/null \
    | awk '$1 == 8 {print "torch_weft_8B_us", $2; print "torch_gloo_8B_us", $3}'
done | tee "$tmp/all"
echo "# medians of $rounds rounds (µs per call, rank 0)"
for k in c_abi_8B_us numpy_8B_us torch_weft_8B_us torch_gloo_8B_us; do
  grep "^$k" "$tmp/all" | awk '{print $2}' | sort -n | awk -v k="$k" '{a[NR]=$1} END {print k, a[int((NR+1)/2)]}'
done
