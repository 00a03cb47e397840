"""Launching ranks for the tests: plain processes with the launcher environment (NumPy
tests), or torchrun itself (torch tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str, n: int, args: List[str], timeout: float = 120, env: Optional[Dict[str, str]] = None
) -> List[subprocess.CompletedProcess]:
    """Runs `script` as ranks 0..n-1 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and returns
    each rank's result; a rank still running after `timeout` is killed and fails the test."""
    port = free_port()
    procs = []
    for rank in range(n):
        e = dict(os.environ)
        e.update(env or {})
        e.update(
            RANK=str(rank),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, script)] + args,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            raise AssertionError(f"rank {rank} of {script} {args} hung; output:\n{out}")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return results


def torchrun(script: str, n: int, args: List[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node n script args`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        script if os.path.isabs(script) else os.path.join(HERE, script),
    ] + args
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    try:
        return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        raise AssertionError(f"torchrun {script} {args} hung; output:\n{t.stdout}\n{t.stderr}")


def assert_ok(results, what: str) -> None:
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{what}: rank {rank} exited {r.returncode}:\n{r.stdout}"
