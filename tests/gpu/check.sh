#!/usr/bin/env bash
# What a machine with a GPU runs (`make gpu-check`), within ~9 minutes: the GPU tests, then
# `ngrammys bench` (plain, fixed k=8 w=8, auto) with the device round and on the host path,
# `ngrammys steps` (where a step's time goes) and `ngrammys loadtest` (C = 1, 4, 16, 64, off
# vs auto) on the embedded model, each under a time limit, their figures as JSON in $OUT.
# It downloads nothing: the packages such a machine's image lacks come as wheels, with the
# Spec-Bench questions and the embedded GGUF in two parts, from `make gpu-bundle` (.gpu/a and
# .gpu/b, each small enough to travel with the tree on its own). A step that fails or runs out
# of time is recorded in $OUT/steps.txt and the next one runs.
set -u
OUT=${OUT:?set OUT to the folder the figures go to}
BUNDLE=${BUNDLE:-.gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: >"$OUT/steps.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to $OUT/NAME.log, record the outcome
  local name=$1 limit=$2
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0  # ONLY="tests bench": those alone
  shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name exit=$? seconds=$((SECONDS - started))" | tee -a "$OUT/steps.txt"
}

"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ngrammys-site "$BUNDLE"/b/wheels/*.whl || exit 1
export PYTHONPATH="/tmp/ngrammys-site:$PWD" PYTHONUNBUFFERED=1
MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
SUMS=$PWD/$BUNDLE/b/model.sha256
cat "$BUNDLE"/a/model.part-* "$BUNDLE"/b/model.part-* >"$MODEL"
(cd /tmp && sha256sum -c "$SUMS") || exit 1
export NGRAMMYS_GPU_MODEL=$MODEL
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.csv" 2>&1
DATASET=$BUNDLE/b/question.jsonl
MODEL_FLAGS=(--model "$MODEL" --device cuda --cache-dir /tmp/ngrammys-cache)

step tests 110 "$PY" -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$OUT/tests.xml"
# the device round (on by default on a GPU), then the host path it replaces, on the same prompts
step bench 130 "$PY" -m app.cli bench "${MODEL_FLAGS[@]}" --dataset "$DATASET" --per-category 1 \
  --max-new-tokens 128 --k 8 --w 8 --auto --suffix-cache-tokens 0 --json "$OUT/bench.json"
step bench-host 100 "$PY" -m app.cli bench "${MODEL_FLAGS[@]}" --dataset "$DATASET" --per-category 1 \
  --max-new-tokens 128 --k 8 --w 8 --auto --suffix-cache-tokens 0 --device-round off --json "$OUT/bench-host.json"
step steps 60 "$PY" -m app.cli steps "${MODEL_FLAGS[@]}" --dataset "$DATASET" --per-category 1 \
  --concurrency 1 16 --repeats 1 --requests-per-slot 1 --max-new-tokens 64
step loadtest 140 "$PY" -m app.cli loadtest "${MODEL_FLAGS[@]}" --dataset "$DATASET" --per-category 2 \
  --concurrency 1 4 16 64 --max-tokens 128 --json "$OUT/loadtest.json"
