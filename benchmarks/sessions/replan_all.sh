#!/usr/bin/env bash
# Next session, first GPU calls (one H200): every plan-accuracy configuration again, since
# the step times measured before f3064a4 carry the gather thrash that commit removed.
# PART=small (1B/3B rows, ~9 min) or PART=large (8B/14B rows, two calls: PART=large1, large2);
# PART=auto: run.py --auto rows (fits b1/b8, full-3b with and without clipping, lora-14b).
# CLIP=0 measures (and plans) without clipping. Needs .whl carried (pydantic).
# Results under $OUT/plan-accuracy-$PART.jsonl.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
if [ "${PART:-small}" = auto ]; then  # auto mode in the same harness as the baselines
  R="python3 benchmarks/run.py --system protrain --auto --steps 4 --warmup 2 --commit ${COMMIT:-unknown}"
  R="$R --run-id $(date -u +%Y-%m-%dT%H:%MZ)-${COMMIT:-unknown} --out $OUT/auto.jsonl"
  for b in 1 8; do timeout 90 $R --workload fits --batch $b | cut -c1-400; done
  for c in 1.0 0; do timeout 120 $R --workload full-3b --max-grad-norm $c | cut -c1-400; done
  timeout 200 $R --workload lora-14b | cut -c1-400
  exit 0
fi
case ${PART:-small} in
  small) C=fits-b1,fits-b8,full-3b,extra-1b-full-16-b2-s1024,extra-1b-full-24-b4-s4096,extra-1b-lora-16-b8-s2048,extra-3b-full-16-b1-s2048,extra-3b-full-40-b2-s4096,extra-3b-lora-16-b4-s8192,extra-3b-lora-24-b1-s512 ;;
  large1) C=extra-8b-lora-24-b2-s4096,extra-8b-lora-16-b1-s8192,extra-8b-lora-40-b4-s2048,lora-14b ;;
  large2) C=full-8b,extra-8b-full-40-b1-s2048,extra-8b-full-80-b8-s1024,extra-14b-lora-40-b2-s2048,extra-14b-lora-80-b8-s512 ;;
esac
timeout 570 python3 benchmarks/plan_accuracy.py --steps 3 --warmup 1 --timeout-s 240 ${CLIP:+--max-grad-norm $CLIP} \
  --run-id "$(date -u +%Y-%m-%dT%H:%MZ)-${COMMIT:-unknown}" \
  --out "$OUT/plan-accuracy-${PART:-small}.jsonl" --only "$C" 2>&1 | grep -v '^{' | tail -4
