#!/usr/bin/env bash
# GPU session 1 of the engine speed work: GPU tests, then protrain full-3b knob variants and
# the fits rows (protrain all-persistent vs plain). Results under $OUT.
set -u
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}
RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C-tune"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee $OUT/gpu.txt
timeout 170 python3 -m pytest -m gpu -q tests/engine tests/train/test_train_gpu.py 2>&1 | tail -25 | tee $OUT/gpu_tests.log
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 4 --warmup 2"
for k in "0 4 0" "0 4 769" "1 3 769" "1 2 769"; do
  set -- $k
  CH=""; [ "$3" != 0 ] && CH="--chunk-mib $3"
  timeout 110 $R --workload full-3b --system protrain --n-persist $1 --n-buffer $2 $CH --out $OUT/full3b.jsonl 2>&1 | grep -v Warn | tail -3
done
for b in 1 8; do for s in plain protrain; do
  timeout 60 $R --workload fits --system $s --batch $b --out $OUT/fits.jsonl 2>&1 | tail -1
done; done
