#!/usr/bin/env bash
# GPU checks that were written but not run in the first session (one H200 or H100):
# the gpu-marked tests (fp16 engine, activations, loop), the remaining plan-accuracy
# configurations, and the matrix rows not measured yet. Run pieces with STAGES, e.g.
#   STAGES="tests plan" bash benchmarks/sessions/pending_gpu_checks.sh
# with `carry: [".whl"]` (pydantic, pytest and DeepSpeed wheels: benchmarks/README.md).
# The matrix stage runs protrain with its default knobs (all persistent); pass
# --n-persist/--n-buffer through matrix.py for the budgeted rows.
set -u
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-"tests plan matrix"}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
for stage in $STAGES; do
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
        | tee "$OUT/gpu-tests.log" | tail -20 ;;
    plan)
      timeout 1500 python3 benchmarks/plan_accuracy.py --steps 3 --warmup 1 --timeout-s 120 \
        --out "$OUT/plan-accuracy.jsonl" 2>&1 | tail -30 ;;
    matrix)
      for w in full-8b lora-14b; do
        timeout 900 python3 benchmarks/matrix.py --workload "$w" --steps 4 --warmup 2 \
          --out "$OUT/matrix-$w.jsonl" 2>&1 | tail -10
      done ;;
  esac
done
ls -la "$OUT"
