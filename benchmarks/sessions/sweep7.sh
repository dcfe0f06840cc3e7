#!/usr/bin/env bash
# Session 7: plan accuracy over the benchmark matrix and the further configurations, all on
# one commit (session 6's rows mixed three engines), in groups A-D that each fit one call.
# Clipping at 1.0 and the chunked loss (the script's defaults); profiles kept for re-planning
# offline; the search profiled once more on this host (search_hot). extra-3b-full-16 also
# runs no-swap alternatives on its trace (session 6 saw its swap plan 30% slower than
# predicted, on the kept-chunks engine). D: qlora-70b without clipping (as session 6), then
# full-3b in auto mode beside FSDP2 CPU offload (no clipping, run.py). Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
PA="python3 benchmarks/plan_accuracy.py --run-id $RID --out $OUT/plan-accuracy.jsonl --profiles $OUT/profiles --profile-search"
case "$1" in
  A) ONLY=fits-b1,fits-b8,full-3b,extra-1b-full-16-b2-s1024,extra-1b-full-24-b4-s4096,extra-1b-lora-16-b8-s2048,extra-1b-full-40-b8-s2048,extra-3b-lora-24-b1-s512 ;;
  B) ONLY=extra-3b-full-40-b2-s4096,extra-3b-lora-16-b4-s8192,extra-3b-full-24-b8-s1024,extra-3b-lora-80-b2-s4096,extra-8b-lora-24-b2-s4096,extra-8b-lora-16-b1-s8192 ;;
  C) ONLY=lora-14b,extra-8b-lora-40-b4-s2048,extra-14b-lora-40-b2-s2048,extra-14b-lora-80-b8-s512
     timeout 200 $PA --timeout-s 195 --only extra-3b-full-16-b1-s2048 --also "1,2,0,24;0,2,0,6" \
       2>&1 | grep -v '^{' | grep -i 'configurations ran\|peak error\|Error' | tail -4 ;;
  D) timeout 300 $PA --steps 3 --warmup 2 --max-grad-norm 0 --chunked-loss-tokens 2048 \
       --timeout-s 290 --only qlora-70b 2>&1 | grep -v '^{' | tail -3
     row 150 --workload full-3b $A --out "$OUT/auto.jsonl"
     row 120 --workload full-3b --system fsdp2_offload --out "$OUT/auto.jsonl"
     ONLY= ;;
esac
[ -n "$ONLY" ] && timeout $(( $(left) - 8 )) $PA --timeout-s 240 --only "$ONLY" 2>&1 \
  | grep -v '^{' | grep -i 'configurations ran\|peak error\|Error' | tail -8
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], r.get("plan"), r.get("step_error"), r.get("peak_error"),
          r.get("search_s"), r.get("error", "")[:200])
PY
# the device returns at most 8 files: the profiles travel as one archive
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
