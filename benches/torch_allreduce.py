"""all_reduce, all_gather_into_tensor and reduce_scatter_tensor of float32, weft backend vs
gloo, in one torchrun job:

    torchrun --standalone --nproc-per-node 2 benches/torch_allreduce.py [--rounds 5]
    torchrun --standalone --nproc-per-node 4 benches/torch_allreduce.py --collectives all_gather

Both groups span the same ranks (the default group is weft, a gloo group is made beside it).
Rounds alternate weft and gloo at every size; each round times enough calls to last ~0.2 s;
the figures are medians over rounds (µs per call, rank 0's view). Sizes are each rank's
input (all_reduce, all_gather) or output (reduce_scatter). At 8 B it also times all_reduce
through weftcc's NumPy API (ctypes into the C ABI, no torch) on the group's own communicator, so
the torch layer's share of the per-call time shows; the C ABI's own figure comes from
benches/c_abi_allreduce.c (benches/python_overhead.sh runs both).
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import weftcc.torch  # noqa: F401


def timed(fn, min_s=0.2, max_iters=20000):
    """µs per call of `fn` (a collective: every rank runs the same number of calls)."""
    for _ in range(3):  # warm up (first calls of a shape)
        fn()
    start = time.perf_counter()
    for _ in range(10):
        fn()
    per_call = (time.perf_counter() - start) / 10
    # Enough calls for ~min_s, the same on every rank (the smallest of the ranks' estimates).
    n = torch.tensor([max(1, min(max_iters, int(min_s / max(per_call, 1e-9))))], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=GLOO)
    iters = int(n.item())
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def all_reduce(elems, n):
    t = torch.ones(elems, dtype=torch.float32)
    return lambda group: dist.all_reduce(t, group=group)


def all_gather(elems, n):
    t = torch.ones(elems, dtype=torch.float32)
    out = torch.empty(elems * n, dtype=torch.float32)
    return lambda group: dist.all_gather_into_tensor(out, t, group=group)


def reduce_scatter(elems, n):
    t = torch.ones(elems * n, dtype=torch.float32)
    out = torch.empty(elems, dtype=torch.float32)
    return lambda group: dist.reduce_scatter_tensor(out, t, group=group)


CALLS = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}


def main():
    global GLOO
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=128 << 20)
    p.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter")
    args = p.parse_args()
    dist.init_process_group("weft")
    GLOO = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    sizes = [8]
    while sizes[-1] * 8 <= args.max_bytes:
        sizes.append(sizes[-1] * 8)
    if sizes[-1] != args.max_bytes:
        sizes.append(args.max_bytes)
    n = dist.get_world_size()
    for coll in args.collectives.split(","):
        if rank == 0:
            print(f"# {coll} float32 (sum), {n} ranks, torch {torch.__version__}, "
                  f"medians of {args.rounds} alternating rounds (µs per call)")
            print(f"{'bytes':>12} {'weft_us':>12} {'gloo_us':>12} {'gloo/weft':>10}")
        for size in sizes:
            call = CALLS[coll](size // 4, n)
            weft, gloo = [], []
            for _ in range(args.rounds):
                weft.append(timed(lambda: call(None)))
                gloo.append(timed(lambda: call(GLOO)))
            w, g = statistics.median(weft), statistics.median(gloo)
            if rank == 0:
                print(f"{size:>12} {w:>12.1f} {g:>12.1f} {g / w:>10.2f}", flush=True)
    # The torch layer's share at 8 B: the same communicator through the NumPy API.
    comm = dist.distributed_c10d._get_default_group().comm
    x = np.ones(2, dtype=np.float32)
    t = torch.ones(2, dtype=torch.float32)
    via_torch, via_numpy = [], []
    for _ in range(args.rounds):
        via_torch.append(timed(lambda: dist.all_reduce(t)))
        via_numpy.append(timed(lambda: comm.all_reduce(x)))
    if rank == 0:
        print(f"# 8 B: torch backend {statistics.median(via_torch):.1f} µs, "
              f"weftcc NumPy API {statistics.median(via_numpy):.1f} µs per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
