#!/usr/bin/env bash
# Here, before a GPU session: put into .whl (ignored by git, carried to the device machine) what its image lacks for
# distrain's GPU checks (scripts/gpu_session.sh). The image has torch 2.11 + CUDA 13 on Python 3.12 and most of
# distrain's needs (KINDS.md lists them); these are the versions that ran there (issue 59). Run it in distrain's
# venv (`./install.sh`): DeepSpeed's build imports torch.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl torchao==0.18.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection hjson
# DeepSpeed without its ops (they are JIT-built there when first used), as install.sh installs it: a pure-Python wheel
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
python -m pip wheel -q --no-deps -w .whl .  # distrain itself: its entry points travel too
ls -la .whl
du -sh .whl
