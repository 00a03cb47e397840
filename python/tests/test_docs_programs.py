"""The documentation's complete Python programs (```python program blocks of README.md,
docs/*.md and python/README.md) run as written on 1 and 2 ranks."""

import glob
import os
import re

import pytest

from launch import assert_ok, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^\s*```(.*)$")


def blocks(path):
    """(line, info words, text) of every fenced block of the file."""
    out, open_block = [], None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fence = FENCE.match(line)
            if open_block is not None:
                if fence:
                    out.append(open_block)
                    open_block = None
                else:
                    open_block[2].append(line)
            elif fence:
                open_block = (number, fence.group(1).split(), [])
    return [(n, info, "".join(text)) for n, info, text in out]


def programs():
    docs = [os.path.join(REPO, "README.md")]
    docs += sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    docs.append(os.path.join(REPO, "python", "README.md"))
    found = []
    for path in docs:
        for line, info, text in blocks(path):
            if info[:1] == ["python"] and "program" in info:
                found.append((f"{os.path.relpath(path, REPO)}:{line}", text))
    return found


def test_the_documentation_has_python_programs():
    assert programs(), "python/README.md has a complete program (```python program)"


@pytest.mark.parametrize("place,text", programs(), ids=[p for p, _ in programs()])
@pytest.mark.parametrize("n", [1, 2])
def test_documented_program_runs(place, text, n, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(text)
    assert_ok(run_ranks(str(script), n, [], timeout=60), f"{place} on {n} ranks")
