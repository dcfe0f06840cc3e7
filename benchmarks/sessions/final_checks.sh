#!/usr/bin/env bash
# Session 2, last GPU call (one H200): the activation GPU tests after the offload-checkpoint
# fix and the engine GPU tests (step_in_backward on CUDA), full-3b without clipping at the
# default host threads, and lora-14b plus two 8B LoRA plan-accuracy configurations (with
# the engine counters). Needs .whl carried. Results under $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-575}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/activations/test_gpu.py tests/engine/test_gpu.py -k "not wrap_close_cycles" 2>&1 \
  | tail -15 | tee $OUT/activations-gpu-tests.log
timeout 90 python3 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2 \
  --workload full-3b --system protrain --n-persist 1 --n-buffer 3 --chunk-mib 769 \
  --max-grad-norm 0 --out $OUT/full3b.jsonl 2>&1 | grep '^{' | tail -1 | cut -c1-900
l=$(left); [ "$l" -gt 60 ] && timeout $((l - 5)) python3 benchmarks/plan_accuracy.py --steps 3 \
  --warmup 1 --timeout-s 150 --run-id "$RID" --out $OUT/plan-accuracy.jsonl --only \
  ${CONFIGS:-lora-14b,extra-8b-lora-24-b2-s4096,extra-8b-lora-16-b1-s8192} \
  2>&1 | grep -v '^{' | tail -4
echo "elapsed $((SECONDS - T0)) s"
