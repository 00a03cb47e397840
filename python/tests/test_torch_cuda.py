"""CUDA tensors in the torch backend "weft" (torch_cuda_worker.py under torchrun, 1 and 2
ranks; ranks may share one GPU). GPU tests: skipped, saying why, where torch sees no CUDA device
(CI has none); run on a machine with a GPU (docs/gpu-results.md records the runs)."""

import os

import pytest

if os.environ.get("WEFT_REQUIRE_TORCH") == "1":
    import torch  # .ci/run: torch must be installed (the CUDA tests still skip without a GPU)
else:
    torch = pytest.importorskip("torch")

from launch import torchrun  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device visible to torch: the weft backend's CUDA-tensor tests need a GPU",
)


@pytest.mark.parametrize("n", [1, 2])
def test_cuda_tensors(n):
    r = torchrun("torch_cuda_worker.py", n, [], timeout=300)
    assert r.returncode == 0, f"{n} ranks failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
