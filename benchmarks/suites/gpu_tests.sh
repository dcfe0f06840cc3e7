#!/usr/bin/env bash
# The tests marked `gpu` (and `multigpu` where the host has two or more GPUs), which CI's
# CPU machine skips. Needs pytest, and bitsandbytes for the 8-bit and QLoRA tests, in $WHL.
#   TESTS  the test paths (default: engine, optim, plan, activations, families, train)
source "$(dirname "$0")/lib.sh"
machine
timeout $(( $(left) / 2 + 60 )) python3 -m pytest -q -p no:cacheprovider -m gpu \
  ${TESTS:-tests/engine tests/optim tests/plan tests/activations tests/families tests/train} \
  2>&1 | grep -E "passed|failed|Error|^E |^FAILED" | tail -20 | tee "$OUT/gpu-tests.log"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider -m multigpu tests/multirank \
    2>&1 | grep -E "passed|failed|Error|^E |^FAILED" | tail -20 | tee -a "$OUT/gpu-tests.log"
fi
echo "elapsed $((SECONDS - T0)) s"
