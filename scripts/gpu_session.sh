#!/usr/bin/env bash
# Issue 59's checks on one lent GPU, prepared as one script so that the device time goes to the checks. Here first:
# `scripts/gpu_wheels.sh`. Then, through the device tool, one part per call (each within 10 minutes):
#   run(command="bash scripts/gpu_session.sh suite", carry=[".whl"], timeout_s=590)   # the GPU suite, verify
#   run(command="bash scripts/gpu_session.sh bench", carry=[".whl"], timeout_s=590)   # distrain vs hand-written
#   run(command="bash scripts/gpu_session.sh offload", carry=[".whl"], timeout_s=590) # the offload ladder
# Each part writes its logs and a results.md under $OUT (runs/gpu_session elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?suite, bench or offload}
out=${OUT:-runs/gpu_session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
python3 -c "import torch, deepspeed, torchao; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'torchao', torchao.__version__)" | tee -a "$out/machine.txt"

case "$part" in
suite)
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/suite.log" | tail -25
    timeout 150 distrain verify --strategy fsdp --precision bf16-mixed --devices 1 --output-dir /tmp/verify \
        2>&1 | tee "$out/verify.log" | tail -15
    ;;
bench)
    # issue 59's rows: gpt-1.3b bf16 + compile (single and fsdp at one GPU), gpt-350m + compile, gpt-124m eager
    rows=("gpt-1.3b 8 --compile" "gpt-350m 8 --compile" "gpt-124m 8 ")
    for row in "${rows[@]}"; do
        read -r size batch flags <<<"$row"
        slug="$size${flags:+-compile}"
        timeout 150 python3 benchmarks/handwritten_gpt.py --size "$size" --batch-size "$batch" --seq-len 2048 $flags \
            --json "$out/hand-$slug.json" 2>&1 | tail -2
        strategies=(single)
        [ "$size" = gpt-1.3b ] && strategies=(single fsdp)
        for strategy in "${strategies[@]}"; do
            timeout 200 distrain bench --sizes "$size" --strategies "$strategy" --devices 1 --batch-size "$batch" \
                --seq-len 2048 --steps 20 --warmup 5 $flags --json "$out/bench-$slug-$strategy.json" 2>&1 | tail -3
        done
    done
    timeout 120 python3 benchmarks/step_overhead.py --device cuda --rounds 3 2>&1 | tail -5 | tee "$out/overhead.md"
    python3 - "$out" <<'PY' | tee "$out/results.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| row | runner | tokens/s | vs hand-written |\n|---|---|---|---|")
for hand in sorted(out.glob("hand-*.json")):
    slug = hand.stem[len("hand-"):]
    base = json.loads(hand.read_text())["tokens_per_sec"]
    print(f"| {slug} | hand-written | {base:,.0f} | 1.000 |")
    for bench in sorted(out.glob(f"bench-{slug}-*.json")):
        for row in json.loads(bench.read_text()):
            print(f"| {slug} | distrain {row['strategy']} | {row['tokens_per_sec']:,.0f} | {row['tokens_per_sec'] / base:.3f} |")
PY
    ;;
offload)
    timeout 560 python3 benchmarks/gpu_bench.py --skip-bench --out "$out/offload" 2>&1 | tail -30
    cp "$out/offload/results.md" "$out/offload.md" 2>/dev/null
    ;;
*)
    echo "unknown part $part: suite, bench or offload" >&2
    exit 2
    ;;
esac
