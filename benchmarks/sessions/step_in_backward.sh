#!/usr/bin/env bash
# Session 2, GPU call 2 (one H200): full-3b with the hand knobs of session 1, clipping on and
# off (off: optimizer.step_in_backward), under expandable segments; the gpu-marked tests and
# the video-row tests (torchvision is on that machine); more plan-accuracy configurations.
# Needs .whl carried (pydantic, pytest). Results under $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2"
row() {  # row <max seconds> <args...>
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{' | tail -1 | cut -c1-1200
}
K="--workload full-3b --system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769 --out $OUT/full3b.jsonl"
row 90 $K --max-grad-norm 0
row 90 $K
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/activations \
  tests/train/test_train_gpu.py 2>&1 | tail -15 | tee $OUT/gpu-tests.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/data/test_video_rows.py \
  tests/data/test_video_frames.py 2>&1 | tail -15 | tee $OUT/video-tests.log
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 10)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 110 --out $OUT/plan-accuracy.jsonl --only \
  extra-3b-lora-24-b1-s512,extra-1b-lora-16-b8-s2048,extra-3b-full-40-b2-s4096,extra-3b-lora-16-b4-s8192,extra-1b-full-24-b4-s4096 \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
