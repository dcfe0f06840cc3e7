#!/usr/bin/env bash
# Session 18. Run from the working tree (clean at COMMIT).
# PART=pa K=.. N=3 (one GPU; carry .whl, WHL=.whl): with K=1 first the -m gpu tests of the
#   8-bit layers and QLoRA (bitsandbytes), then issue21.sh's part K of N of the acceptance
#   matrix in what is left of the call.
source benchmarks/sessions/lib.sh
case "${PART:-pa}" in
pa)
  if [ "${K:-1}" = 1 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_eight_bit.py \
      tests/engine/test_qlora.py 2>&1 | tail -6 | tee "$OUT/gpu-tests-8bit.log"
  fi
  LIMIT=$(left) bash benchmarks/sessions/issue21.sh
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
