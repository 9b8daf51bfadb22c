#!/usr/bin/env bash
# Installs distrain (editable) without ever letting pip swap the user's torch:
#  - torch already installed  -> constrain pip to exactly that version;
#  - no torch (fresh machine) -> torch==2.13.0 installed alone first (pip finds a local CPU wheel here), then
#    the same constraint: exactly the build it took.
# Usage: ./install.sh [extra ...]     e.g. ./install.sh test   (extras: test, deepspeed, hf, wandb, mlflow, sky, fp8, ft, docs, cli, s3)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# torch's version from its metadata, not by importing it: a torch installed alone (no NumPy yet) warns on import
version='import importlib.metadata as m; print(m.version("torch"))'
installed=$("$PY" -c "$version" 2>/dev/null || true)
if [ -z "$installed" ]; then
    # torch alone first, then pinned to exactly the build it took: resolved together with the extras, pip once
    # took a CUDA build (GBs) of 2.13.0 on a CPU machine over the local 2.13.0+cpu wheel, which it takes alone
    "$PY" -m pip install -q "torch==${DISTRAIN_TORCH_VERSION:-2.13.0}"
    installed=$("$PY" -c "$version")
fi
echo "torch==${installed}" > "$constraints"
extras=$(IFS=,; echo "$*")
target="."
[ -n "$extras" ] && target=".[${extras}]"
# DeepSpeed (an extra): skip compiling its C++/CUDA ops at install; it JIT-builds the few it uses.
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}
"$PY" -m pip install -q -c "$constraints" -e "$target"
# DeepSpeed JIT-builds its CPU ops into ~/.cache/torch_extensions on first use: CPU Adam (optimizer
# offload) and, where libaio is installed, async I/O (NVMe offload), minutes each on a small machine.
# The test extra builds them now rather than inside a first run (or a test's time limit).
if [[ ",$extras," == *",test,"* ]]; then
    "$PY" - <<'PY' || echo "install.sh: DeepSpeed's CPU ops were not built now; they build on first use"
import os, torch
if not torch.cuda.is_available():  # with CUDA they are built for it, on first use
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
        if builder.is_compatible(verbose=False):
            builder.load(verbose=False)
PY
fi
