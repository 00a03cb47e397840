"""What a worker process of these tests ends with: its failures printed one a line, then a
summary line, and exit status 1 if there were any (what test_*.py read through launch.py)."""

import sys


def exit_with(failures, prefix="", mode=None):
    """Prints `failures` (each after `prefix`) and, for a `mode`, the count; exits 1 if any."""
    for f in failures:
        print(f"{prefix}FAIL {f}")
    if mode is not None:
        print(f"{prefix}{mode}: {len(failures)} failures")
    sys.exit(1 if failures else 0)
