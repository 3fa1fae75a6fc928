#!/usr/bin/env bash
# Every GPU check of this project in one run, for a CUDA host that is lent for minutes:
#   1. examples/twin_check.py: measured vs modeled forwards, draft levels, expert heads and H2D copies
#      (Qwen3-30B-A3B shapes, --layers of them), the fitted host overhead per launch, kernels counted;
#   2. the CUDA tests (pinned host experts, copy stream, the compiled Triton kernel in the runtime);
#   3. examples/bench_gpu.py on this project's trained tiny pair: every policy over the real link, greedy
#      identity checked per row (float32), then the same in bfloat16;
#   4. examples/bench_kernels.py: the fused expert kernels against transformers' grouped_mm;
#   5. twin_check again with Mixtral-8x7B shapes.
# Each step has its own time limit and a failure does not stop the next; everything lands in $OUT
# (default runs/gpu_check): gpu_check.log and the JSON/markdown the steps write.
#
#   OUT=/tmp/out bash scripts/gpu_check.sh            # DEVICE_SPEC=h200 LAYERS=8 by default
#   STEPS="twin_check_qwen3 bench_tiny_fp32" bash scripts/gpu_check.sh   # only these steps
#
# Packages the host lacks can come as wheels in .whl/ (installed to /tmp/site), prompts as jsonl
# files under $SPECFIT_DATA_DIR (cnn_dailymail/test.jsonl, gsm8k/test.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
DEVICE_SPEC=${DEVICE_SPEC:-h200}
LAYERS=${LAYERS:-8}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

step() {  # step NAME SECONDS CMD...: run with a time limit, log its output and how it ended
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  "$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  "$PY" -c "import scipy, pyarrow, datasets; print('scipy', scipy.__version__, 'pyarrow', pyarrow.__version__, 'datasets', datasets.__version__)"
  "$PY" -c "import ortools" 2>/dev/null || echo "no OR-Tools: the subtree search uses scipy's max-flow (specfit_hf.selection.mincut)"
  nproc; ulimit -l
} 2>&1 | tee -a "$LOG"

step twin_check_qwen3 150 "$PY" examples/twin_check.py --twin qwen3-30b-a3b@h100-pcie5 --device-spec "$DEVICE_SPEC" \
  --layers "$LAYERS" --json "$OUT/twin_check_qwen3.json"
step cuda_tests 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_offload.py -k cuda
TINY=(--model model_cards/specfit-tiny-qwen3moe --draft model_cards/specfit-tiny-qwen3moe-eagle3 --cache-fractions 0.5
      --max-new-tokens 128)
POLICIES=(autoregressive static:d1k1n1 static:d2k1n2 static:d3k1n3 static:d10k1n10 static:d4k3n8 eagle3 specfit)
step bench_tiny_fp32 110 "$PY" examples/bench_gpu.py "${TINY[@]}" --policies "${POLICIES[@]}" static-best --prompts 4 \
  --dtype float32 --out /tmp/bench_fp32
cp /tmp/bench_fp32/results.json "$OUT/bench_tiny_fp32.json" 2>/dev/null
step bench_kernels 90 "$PY" examples/bench_kernels.py --iters 10
step bench_tiny_bf16 60 "$PY" examples/bench_gpu.py "${TINY[@]}" --policies "${POLICIES[@]}" --prompts 2 --dtype bfloat16 \
  --out /tmp/bench_bf16
cp /tmp/bench_bf16/results.json "$OUT/bench_tiny_bf16.json" 2>/dev/null
step twin_check_mixtral 70 "$PY" examples/twin_check.py --twin mixtral-8x7b@rtx4090-pcie4 --device-spec "$DEVICE_SPEC" \
  --link-spec pcie5 --layers 4 --tokens 1 2 4 8 16 64 --json "$OUT/twin_check_mixtral.json"
echo "done in $SECONDS s" | tee -a "$LOG"
