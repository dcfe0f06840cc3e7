#!/usr/bin/env bash
# Session 18. Run from the working tree (clean at COMMIT).
# PART=pa K=.. N=3 (one GPU; carry .whl, WHL=.whl): with K=1 first the -m gpu tests of the
#   8-bit layers and QLoRA (bitsandbytes), then issue21.sh's part K of N of the acceptance
#   matrix in what is left of the call.
# PART=rows (one GPU; carry .whl-lite, WHL=.whl-lite): the matrix rows the plain layout's
#   measurement can move (their traces keep every chunk persistent), and the two small steps
#   that missed on the H200, again after a quiet host (plan_accuracy's wait_quiet_host).
source benchmarks/sessions/lib.sh
case "${PART:-pa}" in
pa)
  if [ "${K:-1}" = 1 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_eight_bit.py \
      tests/engine/test_qlora.py 2>&1 | tail -6 | tee "$OUT/gpu-tests-8bit.log"
  fi
  LIMIT=$(left) bash benchmarks/sessions/issue21.sh
  ;;
rows)
  ONLY=fits-b1,extra-3b-lora-24-b1-s512,extra-1b-full-16-b2-s1024,fits-b8,extra-1b-lora-16-b8-s2048
  ONLY=$ONLY,extra-3b-lora-80-b2-s4096,extra-8b-lora-40-b4-s2048,holdout-qwen7b-lora-48-b3-s2048
  ONLY=$ONLY,holdout-mistral7b-lora-48-b3-s3072
  timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --only "$ONLY" --run-id "$RID" \
    --time-limit $(( $(left) - 20 )) --out "$OUT/rows.jsonl" --profiles /tmp/pa-profiles 2>&1 \
    | grep -v '^{' | grep -i 'configurations ran\|peak error\|skipped\|not started\|Error' | tail -8
  tar -czf "$OUT/profiles-rows.tar.gz" -C /tmp pa-profiles 2>/dev/null
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
