#!/usr/bin/env bash
# GPU session 2 of the engine speed work: one run_id for full-3b (protrain, FSDP2 CPU offload,
# DeepSpeed ZeRO-3 offload; clipping at 1.0 and off), the engine GPU tests, and fits with
# clipping off. Needs .whl carried (pydantic for tests/train, DeepSpeed). Results under $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-575}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
 && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site .whl/deepspeed-0.19.8.tar.gz
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2"
row() {  # row <max seconds> <args...>
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{' | tail -1 | cut -c1-900
}
P3="--workload full-3b --system protrain --out $OUT/full3b.jsonl"
row 80 $P3 --n-persist 1 --n-buffer 3 --chunk-mib 769
if grep -q '"n_persist": 1.*"status": "ok"\|"status": "ok".*"n_persist": 1' $OUT/full3b.jsonl 2>/dev/null; then K="--n-persist 1 --n-buffer 3 --chunk-mib 769"
else K="--n-persist 0 --n-buffer 4 --chunk-mib 769"; row 75 $P3 $K; fi
row 75 $P3 $K --max-grad-norm 0
timeout 110 python3 -m pytest -m gpu -q tests/engine tests/train/test_train_gpu.py 2>&1 | tail -8 | tee $OUT/gpu_tests.log
row 100 --workload full-3b --system fsdp2_offload --out $OUT/full3b.jsonl
row 80 --workload full-3b --system fsdp2_offload --out $OUT/full3b.jsonl --max-grad-norm 0
row 170 --workload full-3b --system ds_z3_offload --out $OUT/full3b.jsonl
row 100 --workload full-3b --system ds_z3_offload --out $OUT/full3b.jsonl --max-grad-norm 0
for b in 1 8; do for s in plain protrain; do
  row 40 --workload fits --system $s --batch $b --max-grad-norm 0 --out $OUT/fits.jsonl
done; done
echo "elapsed $((SECONDS - T0)) s"
