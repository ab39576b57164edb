#!/usr/bin/env bash
# The GPU figures of docs/gpu.md beyond `make gpu-check`: the invariant benchmark and the backends matrix on the
# default model and tiny:gemma2 with compile on and every attention kind. Usage: bash bench/gpu_session.sh OUTDIR
set -u
OUT=${1:-gpu-out}
mkdir -p "$OUT"
export KVVIZ_TEST_DEVICE=auto HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
timeout 150 $PY -m pytest -q -p no:cacheprovider -x tests/test_invariant.py tests/test_figures.py \
  tests/test_kvcache.py -k "bit_for_bit or figures or heatmap or lossy" > "$OUT/tests.txt" 2>&1
tail -5 "$OUT/tests.txt"
timeout 120 $PY bench/invariant_bench.py --device cuda --repeats 5 --json "$OUT/invariant.json"
for m in default tiny:gemma2; do
  name=$(echo "$m" | tr ':' '_')
  timeout 200 $PY -m kvviz matrix --model "$m" --dtype bfloat16 --device cuda \
    --prompt "The capital of France is Paris, and the capital of Italy is" --max-new-tokens 12 --repeats 2 \
    --attns eager,sdpa,flex_attention,flash_attention_2 --cache dynamic,static --compile off,default \
    --json --quiet > "$OUT/matrix_$name.json" 2> "$OUT/matrix_$name.err"
  echo "$m matrix rc=$?"
done
