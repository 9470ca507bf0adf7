#!/usr/bin/env bash
# Everything a GPU machine runs for the project, in one command (its machines are bare and lent for minutes):
# the carried wheels are installed, then each named step runs with its own time limit and writes its log and
# JSON under $OUT (default /tmp/gpu-out).
#
#   bash bench/gpu_session.sh tests bench load     # steps: env tests flash bench load train (and pack, see train)
#
# tests: the `gpu`-marked tests with $TSERVE_REQUIRE_GPU (a skip is a failure) and the kernel and CUDA-graph
# tests, which run on the GPU when one is present. bench: bench/gpu.py, one process per section. load:
# bench/load.py over HTTP with 1, 8 and 64 clients, GPT-2 small and Qwen2.5-0.5B shapes, bf16.
# train: the bundled translators and LM continued from their weights, side by side; `pack` first packs their
# data into .gpu-data for a machine without network access (carry .gpu-data, and .whl).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f /tmp/site/.installed ] && [ -z "${NO_WHEELS:-}" ] && [ "$*" != pack ]; then  # once a machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
STEP_S=${STEP_S:-240}
PACK=${PACK:-.gpu-data/train-data.tar.xz}  # the training data a train step unpacks (made by pack)

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
  for name in en-de de-en lm; do
    tail -n 3 "$runs/$name.log"
    [ -f "$runs/$name/model.safetensors" ] || { rc=1; continue; }
    python3 -m tserve.training half "$runs/$name" && cp "$runs/$name/model.safetensors" "$OUT/$name.safetensors" || rc=1
  done
  tar -czf "$OUT/train-records.tar.gz" -C "$runs" --exclude='*.safetensors' --exclude=data . || rc=1
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
