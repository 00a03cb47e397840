"""One rank of the torch backend tests, launched by torchrun (test_torch.py). Modes:
  matrix  every collective of the backend x dtypes x reductions against exact values,
          async_op ordering, sub-groups, point to point, unsupported calls
  errors  mismatched shapes between ranks: an exception on every rank, not a hang
  mesh    what DeviceMesh, FSDP2, TP and pipelining ask of a backend (see `mesh`)
Exits 1 after printing every mismatch."""

import sys

import torch
import torch.distributed as dist

import weftcc
import weftcc.torch  # noqa: F401  registers the "weft" backend
from worker_report import exit_with

failures = []


def check(what, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        failures.append(f"{what}: got {got.tolist()} ({got.dtype}), want {want.tolist()} ({want.dtype})")


TYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
R = dist.ReduceOp


def data(rank, count, dt, prod=False):
    i = torch.arange(count)
    v = 1 + (rank + i) % 2 if prod else rank + 1 + i % 3
    return v.to(dt)


def fold(xs, op, n):
    a = torch.stack([x.to(torch.float64) for x in xs])
    if op == R.SUM:
        return a.sum(0)
    if op == R.PRODUCT:
        return a.prod(0)
    if op == R.MAX:
        return a.max(0).values
    if op == R.MIN:
        return a.min(0).values
    if op == R.AVG:
        return a.sum(0) / n
    raise AssertionError(op)


def matrix():
    n, r = dist.get_world_size(), dist.get_rank()
    for dt in TYPES:
        ops = [R.SUM, R.PRODUCT, R.MAX, R.MIN] + ([R.AVG] if dt in FLOATS else [])
        for count in (0, 1, 7, 1001):
            name = f"{dt} x{count}"
            for op in ops:
                prod = op == R.PRODUCT
                want = fold([data(q, count, dt, prod) for q in range(n)], op, n).to(dt)
                x = data(r, count, dt, prod)
                dist.all_reduce(x, op=op)
                check(f"all_reduce {op} {name}", x, want)
                root = count % n
                y = data(r, count, dt, prod)
                dist.reduce(y, dst=root, op=op)
                if r == root:
                    check(f"reduce {op} root {root} {name}", y, want)
                blocks = [data(r * n + b, count, dt, prod) for b in range(n)]
                want_rs = fold([data(q * n + r, count, dt, prod) for q in range(n)], op, n).to(dt)
                out = torch.empty(count, dtype=dt)
                dist.reduce_scatter(out, blocks, op=op)
                check(f"reduce_scatter {op} {name}", out, want_rs)
                out = torch.empty(count, dtype=dt)
                dist.reduce_scatter_tensor(out, torch.cat(blocks), op=op)
                check(f"reduce_scatter_tensor {op} {name}", out, want_rs)
            for root in range(n):
                b = data(r, count, dt) if r == root else torch.zeros(count, dtype=dt)
                dist.broadcast(b, src=root)
                check(f"broadcast root {root} {name}", b, data(root, count, dt))
            outs = [torch.empty(count, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, data(r, count, dt))
            for q in range(n):
                check(f"all_gather [{q}] {name}", outs[q], data(q, count, dt))
            flat = torch.empty(n * count, dtype=dt)
            dist.all_gather_into_tensor(flat, data(r, count, dt))
            check(f"all_gather_into_tensor {name}", flat, torch.cat([data(q, count, dt) for q in range(n)]))
            # all_to_all_single: equal blocks, then uneven splits (rank q sends q + j + 1 rows to j).
            send = torch.cat([data(r * 10 + j, count, dt) for j in range(n)])
            got = torch.empty_like(send)
            dist.all_to_all_single(got, send)
            check(f"all_to_all_single {name}", got, torch.cat([data(q * 10 + r, count, dt) for q in range(n)]))
            in_splits = [r + j + 1 for j in range(n)]
            out_splits = [q + r + 1 for q in range(n)]
            send = torch.cat([data(r * 10 + j, s, dt) for j, s in enumerate(in_splits)])
            got = torch.empty(sum(out_splits), dtype=dt)
            dist.all_to_all_single(got, send, out_splits, in_splits)
            check(
                f"all_to_all_single uneven {dt}",
                got,
                torch.cat([data(q * 10 + r, s, dt) for q, s in enumerate(out_splits)]),
            )
            outs = [torch.empty(count + q, dtype=dt) for q in range(n)]
            dist.all_to_all(outs, [data(r * 10 + j, count + r, dt) for j in range(n)])
            for q in range(n):
                check(f"all_to_all [{q}] {name}", outs[q], data(q * 10 + r, count + q, dt))
            root = (count + 1) % n
            g = [torch.empty(count, dtype=dt) for _ in range(n)] if r == root else None
            dist.gather(data(r, count, dt), g, dst=root)
            if r == root:
                for q in range(n):
                    check(f"gather [{q}] {name}", g[q], data(q, count, dt))
            s_out = torch.empty(count, dtype=dt)
            dist.scatter(s_out, [data(10 + q, count, dt) for q in range(n)] if r == root else None, src=root)
            check(f"scatter {name}", s_out, data(10 + r, count, dt))
            if n > 1:
                got = torch.zeros(count, dtype=dt)
                reqs = dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, data(r, count, dt), (r + 1) % n),
                        dist.P2POp(dist.irecv, got, (r - 1) % n),
                    ]
                )
                for w in reqs:
                    w.wait()
                check(f"batch_isend_irecv ring {name}", got, data((r - 1) % n, count, dt))
    # bool: moved as bytes; MIN/MAX/BAND/BOR are logical and/or.
    b = torch.tensor([r % 2 == 0, True, False])
    dist.all_reduce(b, op=R.BAND)
    check("all_reduce bool BAND", b, torch.tensor([n == 1, True, False]))
    b = torch.tensor([r % 2 == 1, False])
    dist.all_reduce(b, op=R.BOR)
    check("all_reduce bool BOR", b, torch.tensor([n > 1, False]))
    # Complex tensors: torch hands the backend their real view.
    c = torch.tensor([1 + 2j, r - 1j], dtype=torch.complex64)
    dist.all_reduce(c)
    check("all_reduce complex64", c, torch.tensor([n + 2j * n, sum(range(n)) - 1j * n], dtype=torch.complex64))
    # Non-contiguous tensors are written back.
    m = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    dist.all_reduce(m)
    check("all_reduce transposed", m, (torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * n))
    # async_op: operations run in call order; the last wait sees them all.
    x = torch.ones(5, dtype=torch.float64)
    works = [dist.all_reduce(x, async_op=True) for _ in range(3)]
    works.append(dist.broadcast(x, src=n - 1, async_op=True))
    works.append(dist.all_reduce(x, op=R.MAX, async_op=True))
    works[-1].wait()
    for w in works:
        w.wait()
        if not w.is_completed():
            failures.append("a waited work is not completed")
    check("async_op order", x, torch.full((5,), float(n**3), dtype=torch.float64))
    # Contiguous copies are made when an operation runs, not when it is called: two queued
    # all-reduces of a non-contiguous tensor compound.
    m2 = torch.ones(3, 2).t()
    w1 = dist.all_reduce(m2, async_op=True)
    w2 = dist.all_reduce(m2, async_op=True)
    w2.wait()
    w1.wait()
    check("async_op on a non-contiguous tensor", m2, torch.full((2, 3), float(n * n)))
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    check("future value", fut.wait()[0], torch.full((2,), float(n)))
    # Plain send/recv (blocking): even ranks send first, odd ones receive first.
    if n > 1 and r < n - n % 2:
        peer = r + 1 if r % 2 == 0 else r - 1
        got = torch.zeros(3, dtype=torch.int64)
        if r % 2 == 0:
            dist.send(torch.tensor([r, 7, 9]), peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(torch.tensor([r, 7, 9]), peer)
        check("send/recv pair", got, torch.tensor([peer, 7, 9]))
    # Sub-groups: new_group (every rank calls it; members get a weftcc communicator).
    evens = list(range(0, n, 2))
    g = dist.new_group(evens)
    if r in evens:
        x = torch.tensor([float(r)])
        dist.all_reduce(x, group=g)
        check("new_group all_reduce", x, torch.tensor([float(sum(evens))]))
        if dist.get_rank(g) != evens.index(r):
            failures.append(f"new_group rank {dist.get_rank(g)}")
    dist.barrier()
    # A send on one group waits for no collective of another: rank 0 posts an isend on the
    # world group and goes on to an all-reduce on a second group; rank 1 waits for the receive
    # first. (The send must be started by the all-reduce's call, or both wait forever.)
    other = dist.new_group(list(range(n)))
    if n > 1 and r < 2:
        if r == 0:
            pending = dist.isend(torch.tensor([5.0, 6.0]), 1)
        else:
            got = torch.zeros(2)
            dist.irecv(got, 0).wait()
            check("isend across groups", got, torch.tensor([5.0, 6.0]))
    y = torch.ones(1)
    dist.all_reduce(y, group=other)
    check("all_reduce on a second group", y, torch.tensor([float(n)]))
    if n > 1 and r == 0:
        pending.wait()
    dist.barrier()
    # Unsupported calls raise a clear error naming them, before anything is sent.
    for what, call in [
        ("int16 reduced", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16))),
        ("BXOR on floats", lambda: dist.all_reduce(torch.ones(2), op=R.BXOR)),
        # A device tensor (meta stands in for cuda on this CPU-only machine: the same check).
        ("device tensor", lambda: dist.all_reduce(torch.ones(2, device="meta"))),
        ("tag", lambda: dist.isend(torch.ones(1), (r + 1) % n, tag=3)),
    ]:
        try:
            call()
            failures.append(f"{what}: no error")
        except weftcc.InvalidArgument as e:
            if "weft backend" not in str(e):
                failures.append(f"{what}: message {e}")
    dist.barrier()


def mesh():
    """What DeviceMesh, FSDP2, tensor and pipeline parallelism ask of a backend, on 4 ranks:
    meshes (1-D, and 2-D with named dimensions), functional collectives, new_subgroups and
    split_group, the bitwise and PREMUL_SUM reductions, types weftcc only moves, point to point
    as a pipeline posts it, monitored_barrier (passing, then naming a rank that never came)."""
    from datetime import timedelta

    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    n, r = dist.get_world_size(), dist.get_rank()
    total = float(n * (n + 1) // 2)
    flat = init_device_mesh("cpu", (n,))
    if not flat.get_group().group_name:
        failures.append("a 1-D mesh's group has no name")
    x = fc.all_reduce(torch.full((3,), float(r + 1)), "sum", flat.get_group())
    check("functional all_reduce on a 1-D mesh", torch.as_tensor(x.wait() if hasattr(x, "wait") else x), torch.full((3,), total))
    if n == 4:
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for dim, members in (("dp", [r % 2, r % 2 + 2]), ("tp", [r // 2 * 2, r // 2 * 2 + 1])):
            g = m[dim].get_group()
            y = torch.tensor([float(r + 1)])
            dist.all_reduce(y, group=g)
            check(f"all_reduce on mesh[{dim!r}]", y, torch.tensor([float(sum(q + 1 for q in members))]))
    sub, _ = dist.new_subgroups(2)
    y = torch.tensor([float(r + 1)])
    dist.all_reduce(y, group=sub)
    pair = [r // 2 * 2, r // 2 * 2 + 1] if r // 2 * 2 + 1 < n else [r]
    check("new_subgroups", y, torch.tensor([float(sum(q + 1 for q in pair))]))
    # Lists in descending order: the new ranks follow the list, not the old ranks.
    lists = [list(range(0, n, 2))[::-1], list(range(1, n, 2))[::-1]]
    queued = dist.all_reduce(torch.ones(1), async_op=True)  # the split runs after it
    parity = dist.split_group(split_ranks=lists)
    queued.wait()
    mine = lists[r % 2]
    y = torch.tensor([float(r + 1)])
    dist.all_reduce(y, group=parity)
    check("split_group", y, torch.tensor([float(sum(q + 1 for q in mine))]))
    if parity.rank() != mine.index(r) or not parity.group_name:
        failures.append(f"split_group: rank {parity.rank()} (want {mine.index(r)}), name {parity.group_name!r}")
    first = torch.tensor([float(r)])
    dist.broadcast(first, group_src=0, group=parity)
    check("split_group: broadcast from its rank 0", first, torch.tensor([float(mine[0])]))
    # Bitwise reductions (integers; BXOR also on bool) and PREMUL_SUM (a number or a tensor).
    for dt in (torch.uint8, torch.int32, torch.int64):
        v = torch.tensor([r + 1, 1 << r, 0x55], dtype=dt)
        for op, f in ((R.BAND, torch.bitwise_and), (R.BOR, torch.bitwise_or), (R.BXOR, torch.bitwise_xor)):
            want = torch.tensor([q + 1 for q in range(n)], dtype=dt), torch.tensor([1 << q for q in range(n)], dtype=dt)
            folded = [want[0][0], want[1][0]]
            for q in range(1, n):
                folded = [f(folded[0], want[0][q]), f(folded[1], want[1][q])]
            xs = v.clone()
            dist.all_reduce(xs, op=op)
            third = torch.tensor(0x55 if op != R.BXOR or n % 2 else 0, dtype=dt)
            check(f"all_reduce {op} {dt}", xs, torch.stack([folded[0], folded[1], third]))
    b = torch.tensor([r == 0, True])
    dist.all_reduce(b, op=R.BXOR)
    check("all_reduce bool BXOR", b, torch.tensor([True, n % 2 == 1]))
    for factor in (0.5, torch.tensor([2.0])):
        z = torch.full((4,), float(r + 1), dtype=torch.float64)
        dist.all_reduce(z, op=dist._make_nccl_premul_sum(factor))
        check(f"PREMUL_SUM {factor}", z, torch.full((4,), total * float(factor), dtype=torch.float64))
    # Types weftcc has no kernels for are moved as bytes.
    for dt in (torch.int16, torch.uint16, torch.float8_e4m3fn, torch.complex32):
        base = torch.arange(5, dtype=torch.float32)
        mine = (base + r).to(dt)
        outs = [torch.zeros(5, dtype=dt) for _ in range(n)]
        dist.all_gather(outs, mine)
        for q in range(n):
            check(f"all_gather {dt} [{q}]", outs[q].view(torch.uint8), (base + q).to(dt).view(torch.uint8))
        c = mine.clone() if r == 1 else torch.zeros(5, dtype=dt)
        dist.broadcast(c, src=1 % n)
        check(f"broadcast {dt}", c.view(torch.uint8), (base + 1 % n).to(dt).view(torch.uint8))
    # A pipeline stage sends its micro-batches without waiting; the next receives them one by
    # one (torch matches single messages in order, whatever was posted with them).
    if n > 1 and r < 2:
        if r == 0:
            sends = [dist.isend(torch.full((8,), float(k)), 1) for k in range(4)]
            back = torch.zeros(8)
            dist.irecv(back, 1).wait()
            check("pipeline: the gradient back", back, torch.full((8,), 9.0))
            for w in sends:
                w.wait()
        else:
            for k in range(4):
                got = torch.zeros(8)
                dist.irecv(got, 0).wait()
                check(f"pipeline: micro-batch {k}", got, torch.full((8,), float(k)))
            dist.isend(torch.full((8,), 9.0), 0).wait()
    # A batch whose op raises is ended; the next batch runs.
    if n > 1:
        try:
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(1), (r + 1) % n, tag=5)])
            failures.append("a tagged receive in a batch was accepted")
        except weftcc.InvalidArgument:
            pass
        got = torch.zeros(2)
        ring = [
            dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % n),
            dist.P2POp(dist.irecv, got, (r - 1) % n),
        ]
        for w in dist.batch_isend_irecv(ring):
            w.wait()
        check("a batch after a failed one", got, torch.full((2,), float((r - 1) % n)))
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    # The last rank skips a monitored barrier: rank 0 names it within the timeout.
    if r != n - 1 and n > 1:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=3), wait_all_ranks=True)
            if r == 0:
                failures.append("monitored_barrier passed without the last rank")
        except weftcc.WeftError as e:
            if r == 0 and f"[{n - 1}]" not in str(e):
                failures.append(f"monitored_barrier: {e}")
            print(f"rank {r}: monitored_barrier: {e}")


def errors():
    """Rank 0 all-reduces 4 elements, the others 8: every rank raises a weftcc error naming the
    operation and its sequence number."""
    r = dist.get_rank()
    x = torch.ones(4 if r == 0 else 8)
    try:
        dist.all_reduce(x)
        failures.append("mismatched all_reduce succeeded")
    except weftcc.WeftError as e:
        print(f"rank {r}: {type(e).__name__}: {e}")
        if e.op != "all_reduce" or e.seq is None or e.rank != r:
            failures.append(f"facts: rank {e.rank} op {e.op} seq {e.seq}")
    # Blocks of different sizes in an exchange (rank 0 sends 2 elements to every rank, the
    # others expect 3 from it): every rank raises, none hangs: the receivers at the exchange,
    # rank 0 (whose own sends and receives all went through) at its next call. On a fresh
    # group: the failure above ended the world one.
    n = dist.get_world_size()
    g = dist.new_group(list(range(n)))
    sizes_in = [2 if r == 0 else 3] * n
    sizes_out = [2 if r == 0 and q == 0 else 3 for q in range(n)]
    send = torch.zeros(sum(sizes_in))
    recv = torch.zeros(sum(sizes_out))
    try:
        dist.all_to_all_single(recv, send, sizes_out, sizes_in, group=g)
        dist.barrier(group=g)
        if n > 1:
            failures.append("all_to_all_single with blocks of different sizes succeeded")
    except weftcc.WeftError as e:
        print(f"rank {r}: exchange: {type(e).__name__}: {e}")
    if n == 1:
        failures.clear()


def init_method(methods):
    """init_process_group("weft", init_method=...) with rank and size from the environment
    (tcp:// and file:// stores; torchrun's env:// is every other mode), once per method given: a
    group made again after destroy_process_group (on the same store: file://) must not join the
    old one. (torch's own TCPStore does not reliably come back on the port it just left, so
    tcp:// is given a fresh port each time.)"""
    import os

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for attempt, method in enumerate(methods):
        dist.init_process_group("weft", init_method=method, rank=rank, world_size=n)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        check(f"all_reduce after {method.split(':')[0]}:// #{attempt}", x, torch.tensor([n * (n + 1) / 2]))
        dist.destroy_process_group()


def main():
    mode = sys.argv[1]
    import faulthandler
    import os

    # Every thread's stack if the rank is still running then (the test harness kills it later).
    faulthandler.dump_traceback_later(float(os.environ.get("WEFT_TEST_STACKS_AFTER", "100")), exit=False)
    if mode == "init":
        init_method(sys.argv[2:])
        exit_with(failures)
    dist.init_process_group("weft")
    if dist.get_backend() != "weft":
        failures.append(f"backend {dist.get_backend()}")
    {"matrix": matrix, "errors": errors, "mesh": mesh}[mode]()
    r = dist.get_rank()
    if mode == "matrix":
        dist.destroy_process_group()
    exit_with(failures, f"rank {r}: ", mode)


if __name__ == "__main__":
    main()
