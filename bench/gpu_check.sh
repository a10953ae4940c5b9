#!/usr/bin/env bash
# One-shot GPU check (parts 1-4, the training step: about 6-8 minutes on one H200; parts 5-8, the drafter in the engines),
# printing what docs/PERFORMANCE.md records and, for parts 5-8, the eval report's engine section:
#   1-2. the drafter step at the Qwen3-8B drafter shape (5 layers, H 4096, 3072 tokens x 512 anchors x B 16), dense vs
#        block-sparse attention: step time, tokens/s, MFU (flex: FLOPs of the tiles its mask keeps), peak memory;
#   3.   the attention alone at 4096 tokens x 512 anchors x B 16, dense vs block-sparse, forward and backward;
#   4.   the pipelined step with a random-init Qwen3-8B-shaped target on the same GPU (its own stream):
#        pipeline ratio = pipelined step / (target forward + drafter step, each alone on its own thread) beside its
#        floor max(t, d) / (t + d), and bit-equal losses;
#   5.   the hybrid engine check: a drafter of the published Qwen3.6 shape (4 sliding-window + 1 full-attention layers)
#        trained briefly on the tiny hybrid target, exported, and `blockdraft eval --engine vllm` with vLLM's V2 model
#        runner (bench/engine_gpu.py); prints the report's engine section;
#   6.   the SGLang check: the same on the tiny dense target with `eval --engine sglang`.
#   7-8. DFlash2: a DFlash2 drafter trained briefly on the tiny dense target (`dflash.architecture = "dflash2"`), exported,
#        and `blockdraft eval --engine vllm` on vLLM's V2 model runner (the one that serves DFlash2), then the same with
#        `eval --engine sglang`.
#   9.   the target's features from a vLLM feature server (train.target_engine = "vllm") against the trainer's own
#        forward on the tiny target (bench/engine_features.py --device cuda).
# Parts 5-9 have not run yet (not timed); each is skipped, saying why, when its engine's Python is missing.
# Needs a Python with a CUDA build of torch and blockdraft installed (`pip install -e .`); PYTHON overrides the interpreter.
# Part 5 needs vLLM in ENGINE_PYTHON (default .venv-engine/bin/python: `make engine` on this machine installs vllm==0.32.0);
# part 6 needs SGLang in SGLANG_PYTHON (default .venv-sglang/bin/python), installed by whoever prepares the machine, e.g.
#   python -m venv .venv-sglang && .venv-sglang/bin/pip install sglang
# Usage: bash bench/gpu_check.sh [OUT_DIR]   (each part's JSON line and log land in OUT_DIR, default ./gpu-check)
set -uo pipefail
PYTHON=${PYTHON:-python}
OUT=${1:-gpu-check}
ENGINE_PYTHON=${ENGINE_PYTHON:-.venv-engine/bin/python}
SGLANG_PYTHON=${SGLANG_PYTHON:-.venv-sglang/bin/python}
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

engine_part() {  # engine_part CHECK ENGINE_PY: one bench/engine_gpu.py check, or why it is skipped
  if [ ! -x "$2" ]; then echo "== engine-$1: skipped, no engine Python at $2"; return; fi
  part "engine-$1" 900 bench.engine_gpu "$1" --engine-python "$2" --workdir "$OUT/engine-$1"
}
engine_part hybrid-vllm "$ENGINE_PYTHON"
engine_part sglang "$SGLANG_PYTHON"
engine_part dflash2-vllm "$ENGINE_PYTHON"
engine_part dflash2-sglang "$SGLANG_PYTHON"
# 9. the target's features from a vLLM feature server against the trainer's own forward on the GPU (train.target_engine)
if [ -x "$ENGINE_PYTHON" ]; then
  part engine-features 600 bench.engine_features --device cuda --engine-python "$ENGINE_PYTHON"
else
  echo "== engine-features: skipped, no engine Python at $ENGINE_PYTHON"
fi
echo "== done: $OUT"
