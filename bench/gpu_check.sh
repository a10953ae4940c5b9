#!/usr/bin/env bash
# One-shot GPU check of the training step (about 6-8 minutes on one H200), printing what docs/PERFORMANCE.md records:
#   1-2. the drafter step at the Qwen3-8B drafter shape (5 layers, H 4096, 3072 tokens x 512 anchors x B 16), dense vs
#        block-sparse attention: step time, tokens/s, MFU (flex: FLOPs of the tiles its mask keeps), peak memory;
#   3.   the attention alone at 4096 tokens x 512 anchors x B 16, dense vs block-sparse, forward and backward;
#   4.   the pipelined step with a random-init Qwen3-8B-shaped target on the same GPU (its own stream):
#        pipeline ratio = pipelined step / (target forward + drafter step, each alone on its own thread) beside its
#        floor max(t, d) / (t + d), and bit-equal losses.
# Needs a Python with a CUDA build of torch and blockdraft installed (`pip install -e .`); PYTHON overrides the interpreter.
# Usage: bash bench/gpu_check.sh [OUT_DIR]   (each part's JSON line and log land in OUT_DIR, default ./gpu-check)
set -uo pipefail
PYTHON=${PYTHON:-python}
OUT=${1:-gpu-check}
mkdir -p "$OUT"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" \
  | tee "$OUT/device.txt" || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv | tee -a "$OUT/device.txt"

part() {  # part NAME SECONDS ARGS...: one benchmark under a time limit; a failure is reported and the next part runs
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$PYTHON" -m "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "^Loading\|it/s]" "$OUT/$name.log" | tail -4
  [ $rc -eq 0 ] || echo "   $name exited $rc (see $OUT/$name.log)"
}

part train-dense 120 bench.train --preset qwen3-8b --attention dense
part train-flex 150 bench.train --preset qwen3-8b --attention flex
part attention 120 bench.attention --device cuda --backward
part pipeline 300 bench.train --pipeline --preset qwen3-8b
echo "== done: $OUT"
