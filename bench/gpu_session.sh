#!/usr/bin/env bash
# Everything a GPU machine runs for the project, in one command (its machines are bare and lent for minutes):
# the carried wheels are installed, then each named step runs with its own time limit and writes its log and
# JSON under $OUT (default /tmp/gpu-out).
#
#   bash bench/gpu_session.sh tests bench load     # steps: env tests flash bench load train
#
# tests: the `gpu`-marked tests with $TSERVE_REQUIRE_GPU (a skip is a failure) and the kernel and CUDA-graph
# tests, which run on the GPU when one is present. bench: bench/gpu.py, one process per section. load:
# bench/load.py over HTTP with 1, 8 and 64 clients, GPT-2 small and Qwen2.5-0.5B shapes, bf16.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
STEP_S=${STEP_S:-240}

step_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  nproc
}

step_tests() {
  TSERVE_REQUIRE_GPU=1 timeout "$STEP_S" python3 -m pytest -p no:cacheprovider -q -m gpu tests/engine/test_gpu.py \
    --junitxml="$OUT/gpu-tests.xml"
  timeout "$STEP_S" python3 -m pytest -p no:cacheprovider -q tests/model/test_flash_kernels.py \
    tests/model/test_cuda_graphs.py --junitxml="$OUT/kernel-tests.xml"
}

step_flash() {  # the kernel tests alone (a quick re-check after a kernel change)
  timeout "$STEP_S" python3 -m pytest -p no:cacheprovider -q tests/model/test_flash_kernels.py
}

step_bench() {  # one process per section, and per shape in the lm section (a slow shape cannot starve the next)
  for section in ${SECTIONS:-lm translation vit kernels}; do
    if [ "$section" = lm ]; then
      for shape in ${LM_SHAPES:-gpt2 qwen2.5-0.5b}; do
        timeout "$STEP_S" python3 bench/gpu.py --sections lm --attention-backend "${BACKEND:-auto}" \
          --lm-shapes "$shape" --out "$OUT/gpu-lm-$shape-${BACKEND:-auto}.json"
      done
    else
      timeout "$STEP_S" python3 bench/gpu.py --sections "$section" --attention-backend "${BACKEND:-auto}" \
        --out "$OUT/gpu-$section-${BACKEND:-auto}.json"
    fi
  done
}

step_load() {
  for size in ${LOAD_SIZES:-small qwen2.5-0.5b}; do
    timeout "$STEP_S" python3 bench/load.py --device cuda --dtype bfloat16 --size "$size" \
      --concurrency 1 8 64 --requests 32 --max-tokens 128 --threads 4 --hf-sequential one-client ${LOAD_ARGS:-} \
      --out "$OUT/load-$size.json"
  done
}

status=0
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  "step_$step" 2>&1 | tee "$OUT/$step.log"
  rc=${PIPESTATUS[0]}
  echo "=== $step exit $rc $(date -u +%T)"
  [ "$rc" = 0 ] || status=$rc
done
exit $status
