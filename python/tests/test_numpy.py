"""The NumPy API across processes: the correctness matrix in small (every type, reduction,
collective, zero and uneven counts, in and out of place), split, argument errors, abort and
timeout, each raising the exception class with the failure's facts."""

import pytest

from launch import assert_ok, run_ranks


@pytest.mark.parametrize("n", [1, 2, 4])
def test_matrix(n):
    assert_ok(run_ranks("numpy_worker.py", n, ["matrix"]), f"matrix on {n} ranks")


@pytest.mark.parametrize("n", [2, 3])
def test_abort_raises_on_every_rank(n):
    assert_ok(run_ranks("numpy_worker.py", n, ["abort"], timeout=60), f"abort on {n} ranks")


def test_timeout_names_the_rank_behind():
    results = run_ranks("numpy_worker.py", 2, ["timeout"], timeout=60, env={"WEFT_TIMEOUT": "2"})
    assert_ok(results, "timeout")


def test_survivors_agree_shrink_and_revoke():
    results = run_ranks("numpy_worker.py", 3, ["survive"], timeout=60)
    assert results[2].returncode == -9, results[2].stdout
    assert_ok(results[:2], "survivors")
