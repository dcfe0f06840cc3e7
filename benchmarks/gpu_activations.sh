#!/usr/bin/env bash
# One GPU-machine session for the activation policies (issue 4) and the application's GPU
# tests: gpu-marked tests, then the 8B policy probe at 8192 tokens, then a bounded
# long-context probe. Wheels the machine lacks (pydantic for the config, pytest) come from
# .whl (see benchmarks/README.md). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/pydantic*.whl .whl/annotated_types*.whl \
  .whl/typing_inspection*.whl .whl/pytest*.whl .whl/pluggy*.whl .whl/iniconfig*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
timeout "${TEST_S:-170}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/activations tests/train/test_train_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
timeout "${POLICY_S:-230}" python3 benchmarks/activations_probe.py policies --model llama8b \
  --mode lora --seq 8192 --steps 2 --warmup 1 --out "$OUT/activations-8b.jsonl" 2>&1 | tail -15
timeout "${LONG_S:-150}" python3 benchmarks/activations_probe.py long --model llama8b \
  --mode lora --budget-gib 80 --seqs "${SEQS:-65536,131072}" --steps 1 --warmup 0 \
  --lora-dtype bfloat16 --out "$OUT/activations-long.jsonl" 2>&1 | tail -10
ls -la "$OUT"
