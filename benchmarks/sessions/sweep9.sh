#!/usr/bin/env bash
# Session 9: plan accuracy on the final trace (four steps, no landing places, offloaded
# gradients in one scratch area) and auto mode's default host budget, over the further
# configurations in groups that each fit one H100 call (A: 1B and 3B; B: lora-14b and the 8B
# and 3B LoRA rows; C: the 14B LoRA rows and qlora-70b), and long-8b on an H200 (L). Clipping
# at 1.0 and the chunked loss (the script's defaults); profiles kept. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
PA="python3 benchmarks/plan_accuracy.py --run-id $RID --out $OUT/plan-accuracy.jsonl --profiles $OUT/profiles"
case "$1" in
  A) ONLY=extra-1b-full-16-b2-s1024,extra-1b-full-24-b4-s4096,extra-1b-lora-16-b8-s2048,extra-1b-full-40-b8-s2048,extra-3b-lora-24-b1-s512,extra-3b-full-24-b8-s1024,extra-3b-full-16-b1-s2048,extra-3b-full-40-b2-s4096 ;;
  B) ONLY=lora-14b,extra-8b-lora-24-b2-s4096,extra-8b-lora-16-b1-s8192,extra-3b-lora-16-b4-s8192,extra-3b-lora-80-b2-s4096,extra-8b-lora-40-b4-s2048 ;;
  C) timeout 300 $PA --steps 3 --warmup 2 --max-grad-norm 0 --chunked-loss-tokens 2048 \
       --timeout-s 290 --only qlora-70b 2>&1 | grep -v '^{' | tail -3
     ONLY=extra-14b-lora-40-b2-s2048,extra-14b-lora-80-b8-s512 ;;
  L) free -g | head -2; ONLY=long-8b-s65536 ;;
esac
[ -n "$ONLY" ] && timeout $(( $(left) - 8 )) $PA --timeout-s ${PER:-240} --only "$ONLY" 2>&1 \
  | grep -v '^{' | grep -i 'configurations ran\|peak error\|Error\|exit status' | tail -8
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], r.get("plan"), r.get("step_error"), r.get("peak_error"),
          r.get("plan_s"), r.get("cpu_budget_gib"), r.get("predicted_host_gib"),
          r.get("error", "")[:300])
PY
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
