#!/usr/bin/env bash
# Installs distrain (editable) without ever letting pip swap the user's torch:
#  - torch already installed  -> constrain pip to exactly that version;
#  - no torch (fresh machine) -> torch==2.13.0, which pip finds as a local CPU wheel here.
# Usage: ./install.sh [extra ...]     e.g. ./install.sh test   (extras: test, deepspeed, hf, wandb, mlflow, sky, fp8)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
installed=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
echo "torch==${installed:-${DISTRAIN_TORCH_VERSION:-2.13.0}}" > "$constraints"
extras=$(IFS=,; echo "$*")
target="."
[ -n "$extras" ] && target=".[${extras}]"
# DeepSpeed (an extra): skip compiling its C++/CUDA ops at install; it JIT-builds the few it uses.
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}
"$PY" -m pip install -q -c "$constraints" -e "$target"
