"""One rank of the torch backend's CUDA-tensor tests, launched by torchrun
(test_torch_cuda.py; needs a GPU). Each rank uses cuda:(LOCAL_RANK % device_count): ranks may
share one GPU. Checks, against exact values: every call that takes CUDA tensors, in place and
through non-contiguous tensors; stream order (the operation runs after the work already on the
caller's stream, and `Work.wait()` makes the caller's current stream wait for it, on another
stream too); `is_completed()` once the GPU is done; the CUDA-aware future; a call that does not
take CUDA tensors raising naming the calls that do. Exits 1 after printing every mismatch."""

import os

import torch
import torch.distributed as dist

import weftcc
import weftcc.torch  # noqa: F401  registers the "weft" backend
from worker_report import exit_with

failures = []


def check(what, got, want):
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        failures.append(f"{what}: got {got.tolist()} ({got.dtype}), want {want.tolist()}")


def main():
    dist.init_process_group("weft")
    r, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    total = n * (n + 1) // 2

    # all_reduce, in place, after work already on the stream (a long fill first).
    x = torch.empty(1 << 20, device=dev)
    x.fill_(float(r + 1))
    dist.all_reduce(x)
    check("all_reduce", x[:4], torch.full((4,), float(total)))

    # async on a side stream; wait() orders the current stream after it (no host sync here).
    side = torch.cuda.Stream(dev)
    y = torch.full((1000,), float(r + 1), device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        work = dist.all_reduce(y, async_op=True)
    work.wait()  # the default stream now waits for the all-reduce on `side`
    check("async all_reduce on a side stream", y[:3], torch.full((3,), float(total)))
    torch.cuda.synchronize(dev)
    if not work.is_completed():
        failures.append("is_completed() false after the device synchronized")

    # the future is CUDA-aware: its value is ready on the stream that uses it.
    z = torch.full((8,), 2.0, device=dev)
    fut = dist.all_reduce(z, async_op=True).get_future()
    check("future value", fut.wait()[0][:2], torch.full((2,), 2.0 * n))

    # broadcast from the last rank, reduce into rank 0 (PRODUCT), int64.
    b = torch.full((5,), r, dtype=torch.int64, device=dev)
    dist.broadcast(b, src=n - 1)
    check("broadcast", b, torch.full((5,), n - 1, dtype=torch.int64))
    p = torch.full((5,), 2, dtype=torch.int32, device=dev)
    dist.reduce(p, dst=0, op=dist.ReduceOp.PRODUCT)
    if r == 0:
        check("reduce", p, torch.full((5,), 2**n, dtype=torch.int32))

    # all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (bfloat16 too).
    for dt in (torch.float32, torch.bfloat16):
        inp = torch.full((3,), float(r), dtype=dt, device=dev)
        out = torch.empty(3 * n, dtype=dt, device=dev)
        dist.all_gather_into_tensor(out, inp)
        check(f"all_gather_into_tensor {dt}", out, torch.arange(n, dtype=dt).repeat_interleave(3))
    big = torch.arange(2 * n, dtype=torch.float32, device=dev)
    part = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(part, big)
    check("reduce_scatter_tensor", part, torch.tensor([2.0 * r, 2.0 * r + 1]) * n)
    a2a = torch.full((2 * n,), float(r), device=dev)
    got = torch.empty_like(a2a)
    dist.all_to_all_single(got, a2a)
    check("all_to_all_single", got, torch.arange(n, dtype=torch.float32).repeat_interleave(2))

    # a non-contiguous tensor: a copy reduced and written back on the stream.
    m = torch.full((4, 6), float(r + 1), device=dev)[:, ::2]
    dist.all_reduce(m)
    check("all_reduce of a strided view", m, torch.full((4, 3), float(total)))

    # a call that does not take CUDA tensors raises, naming those that do.
    try:
        dist.all_gather([torch.empty(2, device=dev) for _ in range(n)], torch.ones(2, device=dev))
        failures.append("all_gather of CUDA tensors: no error")
    except weftcc.InvalidArgument as e:
        if "all_reduce" not in str(e):
            failures.append(f"all_gather of CUDA tensors: message {e}")

    torch.cuda.synchronize(dev)
    dist.barrier()
    dist.destroy_process_group()
    exit_with(failures, f"rank {r}: ")


if __name__ == "__main__":
    main()
