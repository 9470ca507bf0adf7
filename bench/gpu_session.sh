#!/usr/bin/env bash
# Everything a GPU machine runs for the project, in one command (its machines are bare and lent for minutes):
# the carried wheels are installed, then each named step runs with its own time limit and writes its log and
# JSON under $OUT (default /tmp/gpu-out).
#
#   bash bench/gpu_session.sh tests bench load     # steps: env tests flash bench load train lease (and pack)
#   TRAIN_MINUTES=5 bash bench/gpu_session.sh lease   # a whole lease in one command (see step_lease)
#   DRY_RUN=1 bash bench/gpu_session.sh lease         # the same control flow on this CPU in a few minutes
#
# tests: the `gpu`-marked tests with $TSERVE_REQUIRE_GPU (a skip is a failure) and the kernel and CUDA-graph
# tests, which run on the GPU when one is present. bench: bench/gpu.py, one process per section. load:
# bench/load.py over HTTP with 1, 8 and 64 clients, GPT-2 small and Qwen2.5-0.5B shapes, bf16.
# train: the bundled translators and LM continued from their weights, side by side; `pack` first packs their
# data into .gpu-data for a machine without network access (carry .gpu-data, and .whl).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
WHEELS=$( (cd .whl 2>/dev/null && ls *.whl) | tr '\n' ' ')  # installed again on a warm machine when they change
if [ -d .whl ] && [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$WHEELS" ] && [ -z "${NO_WHEELS:-}" ] \
    && [ "$*" != pack ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && echo "$WHEELS" >/tmp/site/.installed || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -n "${DRY_RUN:-}" ]; then  # lease's control flow on a CPU: tiny shapes, a moment of training, tests collected
  : "${TRAIN_DEVICE:=cpu}" "${TRAIN_MINUTES:=0.05}" "${MT_BATCH:=400}" "${LM_BATCH:=2}" "${OMP_NUM_THREADS:=1}"
  : "${BENCH_ARGS:=--tiny --device cpu}" "${LM_SHAPES:=gpt2 tiny-llama}" "${LOAD_SIZES:=tiny-llama}"
  : "${LOAD_ARGS:=--device cpu --dtype float32 --concurrency 2 --requests 2 --max-tokens 4 --skip-hf}"
  : "${PYTEST_ARGS:=--collect-only}" "${LEASE_S:=900}"
  export TRAIN_DEVICE TRAIN_MINUTES MT_BATCH LM_BATCH OMP_NUM_THREADS
fi
STEP_S=${STEP_S:-240}
DEADLINE=${DEADLINE:-1000000000}  # in $SECONDS: no process of a step runs past it (the lease step sets it)
limit() {  # seconds the next process may run: $STEP_S, or what is left before $DEADLINE
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$STEP_S" ] && echo $((left > 1 ? left : 1)) || echo "$STEP_S"
}
PACK=${PACK:-.gpu-data/train-data.tar.xz}  # the training data a train step unpacks (made by pack)

step_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  nproc
}

step_tests() {
  local rc=0
  TSERVE_REQUIRE_GPU=${TSERVE_REQUIRE_GPU-1} timeout "$(limit)" python3 -m pytest -p no:cacheprovider -q -m gpu \
    tests/engine/test_gpu.py --junitxml="$OUT/gpu-tests.xml" ${PYTEST_ARGS:-} || rc=1
  timeout "$(limit)" python3 -m pytest -p no:cacheprovider -q tests/model/test_flash_kernels.py \
    tests/model/test_cuda_graphs.py --junitxml="$OUT/kernel-tests.xml" ${PYTEST_ARGS:-} || rc=1
  return $rc
}

step_flash() {  # the kernel tests alone (a quick re-check after a kernel change)
  timeout "$STEP_S" python3 -m pytest -p no:cacheprovider -q tests/model/test_flash_kernels.py
}

step_bench() {  # one process per section, and per shape in the lm section (a slow shape cannot starve the next)
  local rc=0
  for section in ${SECTIONS:-lm translation vit kernels}; do
    if [ "$section" = lm ]; then
      for shape in ${LM_SHAPES:-gpt2 qwen2.5-0.5b}; do
        timeout "$(limit)" python3 bench/gpu.py --sections lm --attention-backend "${BACKEND:-auto}" \
          --lm-shapes "$shape" --out "$OUT/gpu-lm-$shape-${BACKEND:-auto}.json" ${BENCH_ARGS:-} || rc=1
      done
    else
      timeout "$(limit)" python3 bench/gpu.py --sections "$section" --attention-backend "${BACKEND:-auto}" \
        --out "$OUT/gpu-$section-${BACKEND:-auto}.json" ${BENCH_ARGS:-} || rc=1
    fi
  done
  return $rc
}

step_load() {
  local rc=0
  for size in ${LOAD_SIZES:-small qwen2.5-0.5b}; do
    timeout "$(limit)" python3 bench/load.py --device cuda --dtype bfloat16 --size "$size" \
      --concurrency 1 8 64 --requests 32 --max-tokens 128 --threads 4 --hf-sequential one-client ${LOAD_ARGS:-} \
      --out "$OUT/load-$size.json" || rc=1
  done
  return $rc
}

step_train() {  # the bundled translators and LM, trained on from their weights with mixed precision, side by side
  # Data: the processed splits, packed here by `bash bench/gpu_session.sh pack` (the machine has no internet).
  # Each run stops after $TRAIN_MINUTES; its best validated weights are halved and put under $OUT as one file
  # each, the runs' records as train-records.tar.gz.
  local minutes=${TRAIN_MINUTES:-7} runs=${TRAIN_RUNS:-/tmp/train} limit pids=() rc=0
  rm -rf "$runs" && mkdir -p "$runs/data" && tar -xJf "$PACK" -C "$runs/data" || return 1
  export TSERVE_DATA_DIR=$runs/data OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  limit=$(python3 -c "print(int(($minutes + 2) * 60))") || return 1
  for name in en-de de-en; do
    timeout "$limit" python3 -m tserve.training train translation --init-from "models/tserve-$name" --out "$runs/$name" \
      --device "${TRAIN_DEVICE:-cuda}" --batch "${MT_BATCH:-16000}" --lr "${MT_LR:-1e-3}" --dropout "${MT_DROPOUT:-0.1}" --steps 1000000 \
      --max-minutes "$minutes" >"$runs/$name.log" 2>&1 & pids+=($!)
  done
  timeout "$limit" python3 -m tserve.training train lm --init-from models/tserve-lm --out "$runs/lm" \
    --device "${TRAIN_DEVICE:-cuda}" --batch "${LM_BATCH:-64}" --lr "${LM_LR:-1e-3}" --dropout "${LM_DROPOUT:-0.1}" --steps 1000000 \
    --max-minutes "$minutes" >"$runs/lm.log" 2>&1 & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  local trained=()
  for name in en-de de-en lm; do
    tail -n 3 "$runs/$name.log"
    if [ -f "$runs/$name/model.safetensors" ]; then trained+=("$name"); else rc=1; fi
  done
  if [ ${#trained[@]} -gt 0 ]; then  # one process for all: each start imports torch again
    if python3 -m tserve.training half "${trained[@]/#/$runs/}"; then
      for name in "${trained[@]}"; do cp "$runs/$name/model.safetensors" "$OUT/$name.safetensors" || rc=1; done
    else
      rc=1
    fi
  fi
  tar -czf "$OUT/train-records.tar.gz" -C "$runs" --exclude='*.safetensors' --exclude=data . || rc=1
  return $rc
}

step_lease() {  # a whole lease in one command of $LEASE_S seconds at most (the machine's wheels included)
  # The three trainings start in the background and the GPU tests run beside them; the benchmarks wait for the
  # trainings to end, so that nothing else runs on the GPU while they time it; then one load run (64 clients)
  # if at least $LOAD_MIN_S seconds are left. Each process stops at $STEP_S or at the lease's end, whichever
  # comes first. What comes back: the three float16 weights files, lease.log and results.tar.gz (every other
  # log, JSON and test report, and the trainings' records), then a summary table, printed last.
  local final=$OUT work=$OUT/lease rc=0 train_pid name
  DEADLINE=$((${LEASE_S:-540} - ${LEASE_RESERVE_S:-15}))  # $SECONDS counts from the script's start
  rm -rf "$work" && mkdir -p "$work" && OUT=$work || return 1
  echo "--- train (background) $(date -u +%T), ${TRAIN_MINUTES:-7} minutes"
  (step_train >"$work/train.log" 2>&1; echo $? >"$work/train.rc") & train_pid=$!
  echo "--- tests $(date -u +%T)"
  step_tests >"$work/tests.log" 2>&1 || rc=1
  tail -n 2 "$work/tests.log"
  wait "$train_pid"
  echo "--- train exit $(cat "$work/train.rc" 2>/dev/null) $(date -u +%T)"
  [ "$(cat "$work/train.rc" 2>/dev/null)" = 0 ] || rc=1
  for name in en-de de-en lm; do
    [ -f "$work/$name.safetensors" ] && mv "$work/$name.safetensors" "$final/$name.safetensors"
  done
  echo "--- bench $(date -u +%T), $((DEADLINE - SECONDS)) s left"
  SECTIONS=${SECTIONS:-lm translation vit} step_bench >"$work/bench.log" 2>&1 || rc=1
  if [ $((DEADLINE - SECONDS)) -ge "${LOAD_MIN_S:-90}" ]; then
    echo "--- load $(date -u +%T), $((DEADLINE - SECONDS)) s left"
    LOAD_SIZES=${LOAD_SIZES:-small} LOAD_ARGS=${LOAD_ARGS:---concurrency 64 --skip-hf} step_load >"$work/load.log" 2>&1 \
      || rc=1
  else
    echo "--- load skipped: $((DEADLINE - SECONDS)) s left, under LOAD_MIN_S=${LOAD_MIN_S:-90}"
  fi
  OUT=$final
  tar -czf "$final/results.tar.gz" -C "$work" . && rm -rf "$work" || rc=1
  python3 bench/gpu_lease_summary.py "$final" || rc=1
  return $rc
}

step_pack() {  # here, before a train step: the processed training splits, compressed to travel with the tree
  local processed=${TSERVE_DATA_DIR:-data}/processed
  mkdir -p "$(dirname "$PACK")"
  local files
  files=$(cd "$(dirname "$processed")" && ls processed/translation-v*-*.jsonl processed/lm-v*-*.jsonl) || return 1
  tar -cJf "$PACK" -C "$(dirname "$processed")" $files || return 1
  ls -l "$PACK"
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
