#!/usr/bin/env bash
# Fetches NVIDIA's nccl.h (headers only: nothing of NVIDIA's is linked or shipped) for the NCCL
# drop-in's tests, which compile C programs against it and check weftcc's layouts against it.
# Prints the include directory; use it as WEFT_NCCL_INCLUDE:
#   export WEFT_NCCL_INCLUDE=$(scripts/nccl_header.sh)
# The wheel is pip's nvidia-nccl-cu13 (the one torch 2.15 installs); pip caches it, so a later
# `pip install torch` does not download it again. DEST (default /tmp/weft-nccl-header) keeps it.
set -euo pipefail
version=2.30.7
dest=${1:-/tmp/weft-nccl-header}
if [ ! -f "$dest/include/nccl.h" ]; then
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$wheels" "nvidia-nccl-cu13==$version" >&2
  mkdir -p "$dest/include"
  python3 - "$wheels" "$dest/include" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    (pathlib.Path(sys.argv[2]) / "nccl.h").write_bytes(z.read("nvidia/nccl/include/nccl.h"))
PY
fi
echo "$dest/include"
