"""One rank of the NumPy API tests (launched by test_numpy.py with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Modes: matrix, abort, timeout. Exits 1 after printing every
mismatch."""

import os
import signal
import sys
import time

import numpy as np

import weftcc
from weftcc import PreMulSum, ReduceOp
from worker_report import exit_with

failures = []


def check(what, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        failures.append(f"{what}: got {got!r}, want {want!r}")


TYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32, np.float64]
FLOATS = {np.float16, np.float32, np.float64}


def data(rank, count, dt, op=None):
    i = np.arange(count)
    if op == ReduceOp.PROD:
        v = 1 + (rank + i) % 2  # products stay small for every type
    else:
        v = rank + 1 + i % 3
    return v.astype(dt)


def reference(n, count, dt, op):
    """The reduction computed here, in float64, from every rank's data."""
    xs = np.stack([data(q, count, dt, op).astype(np.float64) for q in range(n)]) if count else np.zeros((n, 0))
    if isinstance(op, PreMulSum):
        factors = np.array([(q + 1) / 2 for q in range(n)]).reshape(n, 1)
        return (xs * factors).sum(axis=0).astype(dt)
    f = {
        ReduceOp.SUM: lambda a: a.sum(axis=0),
        ReduceOp.PROD: lambda a: a.prod(axis=0),
        ReduceOp.MAX: lambda a: a.max(axis=0),
        ReduceOp.MIN: lambda a: a.min(axis=0),
        ReduceOp.AVG: lambda a: a.sum(axis=0) / n,
    }[op]
    return f(xs).astype(dt)


def matrix(comm):
    n, r = comm.size, comm.rank
    for dt in TYPES:
        ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN]
        if dt in FLOATS:
            ops += [ReduceOp.AVG, "premul"]
        for count in (0, 1, 7, 1001):
            for op in ops:
                o = PreMulSum((r + 1) / 2) if op == "premul" else op
                ref_op = PreMulSum(0) if op == "premul" else op
                name = f"{np.dtype(dt)} {op} x{count}"
                want = reference(n, count, dt, ref_op)
                send = data(r, count, dt, ref_op if op != "premul" else None)
                recv = np.empty(count, dt)
                check(f"all_reduce {name}", comm.all_reduce(send, recv, op=o), want)
                x = send.copy()
                check(f"all_reduce in place {name}", comm.all_reduce(x, op=o), want)
                root = count % n
                y = send.copy()
                comm.reduce(y, op=o, root=root)
                check(f"reduce root {root} {name}", y, want if r == root else send)
                blocks = np.stack([data(r * n + b, count, dt, ref_op if op != "premul" else None) for b in range(n)])
                got = comm.reduce_scatter(blocks, op=o)
                mine = [data(q * n + r, count, dt, ref_op if op != "premul" else None).astype(np.float64) for q in range(n)]
                if isinstance(o, PreMulSum):
                    want_rs = sum(m * (q + 1) / 2 for q, m in enumerate(mine)).astype(dt)
                else:
                    want_rs = reference_of(np.stack(mine) if count else np.zeros((n, 0)), op, n).astype(dt)
                check(f"reduce_scatter {name}", got, want_rs)
            for root in range(n):
                b = data(r, count, dt) if r == root else np.zeros(count, dt)
                check(f"broadcast root {root} {np.dtype(dt)} x{count}", comm.broadcast(b, root), data(root, count, dt))
            check(
                f"all_gather {np.dtype(dt)} x{count}",
                comm.all_gather(data(r, count, dt)),
                np.stack([data(q, count, dt) for q in range(n)]),
            )
            send = np.concatenate([data(r * 10 + q, count, dt) for q in range(n)])
            check(
                f"all_to_all {np.dtype(dt)} x{count}",
                comm.all_to_all(send),
                np.concatenate([data(q * 10 + r, count, dt) for q in range(n)]),
            )
            if n > 1:
                got = np.zeros(count, dt)
                out = data(r, count, dt)
                with weftcc.group():
                    comm.send(out, (r + 1) % n)
                    comm.recv(got, (r - 1) % n)
                check(f"send/recv ring {np.dtype(dt)} x{count}", got, data((r - 1) % n, count, dt))
    # Sub-communicators: even and odd ranks.
    sub = comm.split(r % 2, key=-r)
    with sub:
        x = np.array([r], dtype=np.int64)
        members = [q for q in range(n) if q % 2 == r % 2]
        check("split all_reduce", sub.all_reduce(x), np.array([sum(members)], dtype=np.int64))
        if sub.rank != sorted(members, reverse=True).index(r):
            failures.append(f"split rank {sub.rank} is not ordered by key")
    # Rank 0 takes part without joining; the others form a communicator of n - 1.
    rest = comm.split(None if r == 0 else 1, key=r)
    if r == 0:
        if rest is not None:
            failures.append("split(None) returned a communicator")
    else:
        with rest:
            if (rest.size, rest.rank) != (n - 1, r - 1):
                failures.append(f"split without rank 0: size {rest.size} rank {rest.rank}")
            check("split without rank 0", rest.all_reduce(np.array([1], np.int32)), np.array([n - 1], np.int32))
    comm.barrier()
    # Argument errors are raised here, with the rank and operation, and leave it usable.
    try:
        comm.broadcast(np.zeros(3, np.float32), root=n)
        failures.append("a root out of range was accepted")
    except weftcc.InvalidArgument as e:
        if (e.rank, e.op) != (r, "broadcast"):
            failures.append(f"invalid argument facts: rank {e.rank} op {e.op}")
    try:
        comm.all_reduce(np.zeros(3, np.complex64))
        failures.append("a complex array was accepted")
    except weftcc.InvalidArgument:
        pass
    comm.barrier()


def reference_of(xs, op, n):
    return {
        ReduceOp.SUM: lambda a: a.sum(axis=0),
        ReduceOp.PROD: lambda a: a.prod(axis=0),
        ReduceOp.MAX: lambda a: a.max(axis=0),
        ReduceOp.MIN: lambda a: a.min(axis=0),
        ReduceOp.AVG: lambda a: a.sum(axis=0) / n,
    }[op](xs)


def abort(comm):
    """The last rank aborts after a barrier: its next call raises Aborted, every other rank's
    raises RemoteError naming it."""
    n, r = comm.size, comm.rank
    comm.barrier()
    x = np.ones(4, np.float32)
    if r == n - 1:
        comm.abort()
        try:
            comm.all_reduce(x)
            failures.append("all_reduce after abort succeeded")
        except weftcc.Aborted as e:
            if e.rank != r:
                failures.append(f"Aborted names rank {e.rank}")
    else:
        try:
            comm.all_reduce(x)
            failures.append("all_reduce with an aborted rank succeeded")
        except weftcc.RemoteError as e:
            if e.peer != n - 1 or e.rank != r:
                failures.append(f"RemoteError facts: rank {e.rank} peer {e.peer}: {e}")
        if comm.async_error() is None:
            failures.append("no async error after a peer's abort")


def timeout(comm):
    """Rank 1 never calls: rank 0's all_reduce raises Timeout (WEFT_TIMEOUT=2) naming it."""
    r = comm.rank
    if r == 1:
        time.sleep(8)
        return
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(4, np.float32))
        failures.append("all_reduce without its peer succeeded")
    except weftcc.Timeout as e:
        took = time.monotonic() - start
        if not (1.5 < took < 7):
            failures.append(f"timed out after {took:.1f} s with WEFT_TIMEOUT=2")
        if (e.rank, e.peer, e.op, e.seq) != (0, 1, "all_reduce", e.seq) or e.seq is None:
            failures.append(f"Timeout facts: rank {e.rank} peer {e.peer} op {e.op} seq {e.seq}")


def survive(comm):
    """The last rank dies (SIGKILL): the others' next call raises RemoteError naming it; they
    agree on it, shrink, all-reduce over the survivors; then rank 0 revokes the shrunk
    communicator and every survivor's next call raises, saying "revoked"."""
    n, r = comm.size, comm.rank
    comm.barrier()
    x = np.ones(4, np.float32)
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(x)
        failures.append("all_reduce with a dead rank succeeded")
    except weftcc.RemoteError as e:
        if e.peer != n - 1:
            failures.append(f"RemoteError names rank {e.peer}: {e}")
    failed, epoch = comm.agree_on_failures()
    if (failed, epoch) != ([n - 1], 1):
        failures.append(f"agreement {failed} at epoch {epoch}")
    small = comm.shrink(failed)
    try:
        if (small.rank, small.size) != (r, n - 1):
            failures.append(f"shrunk: rank {small.rank} of {small.size}")
        y = np.ones(4, np.float32)
        small.all_reduce(y)
        if not (y == n - 1).all():
            failures.append(f"sum over the survivors {y}")
        if not small.job_id().startswith("weft1@"):
            failures.append(f"job id {small.job_id()}")
        if r == 0:
            small.revoke()
        try:
            small.all_reduce(y)
            failures.append("all_reduce after revoke succeeded")
        except (weftcc.InvalidUsage, weftcc.RemoteError) as e:
            want = weftcc.InvalidUsage if r == 0 else weftcc.RemoteError
            if not isinstance(e, want) or "revoked" not in str(e):
                failures.append(f"after revoke: {type(e).__name__}: {e}")
    finally:
        small.close()


def main():
    mode = sys.argv[1]
    comm = weftcc.Communicator.from_env()
    try:
        {"matrix": matrix, "abort": abort, "timeout": timeout, "survive": survive}[mode](comm)
    finally:
        comm.close()
    exit_with(failures, f"rank {comm.rank}: ", mode)


if __name__ == "__main__":
    main()
