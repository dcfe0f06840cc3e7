#!/usr/bin/env bash
# Session 6, calls 2-4: plan accuracy over the benchmark matrix and the further
# configurations, at one commit, in three groups (argument A, B or C) that each fit one
# call. Clipping at 1.0 and the chunked loss (the script's defaults, as in sessions 3-4);
# each configuration's profiles are kept for re-planning offline. Needs .whl and COMMIT.
set -u
source benchmarks/sessions/lib.sh
case "$1" in
  A) ONLY=fits-b1,fits-b8,full-3b,extra-1b-full-16-b2-s1024,extra-1b-full-24-b4-s4096,extra-1b-lora-16-b8-s2048,extra-1b-full-40-b8-s2048,extra-3b-lora-24-b1-s512 ;;
  B) ONLY=extra-3b-full-16-b1-s2048,extra-3b-full-40-b2-s4096,extra-3b-lora-16-b4-s8192,extra-3b-full-24-b8-s1024,extra-3b-lora-80-b2-s4096,extra-8b-lora-24-b2-s4096,extra-8b-lora-16-b1-s8192 ;;
  C) ONLY=lora-14b,extra-8b-lora-40-b4-s2048,extra-14b-lora-40-b2-s2048,extra-14b-lora-80-b8-s512 ;;
esac
timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --timeout-s 240 --run-id "$RID" \
  --out "$OUT/plan-accuracy.jsonl" --profiles "$OUT/profiles" --only "$ONLY" 2>&1 \
  | grep -v '^{' | grep -i 'configurations ran\|peak error\|Error' | tail -8
python3 - "$OUT/plan-accuracy.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["config"], r["status"], r.get("plan"), r.get("step_error"), r.get("peak_error"),
          r.get("search_s"), r.get("error", "")[:200])
PY
# the device returns at most 8 files: the profiles travel as one archive (calls 2-4 lost 17)
[ -d "$OUT/profiles" ] && tar -czf "$OUT/profiles.tgz" -C "$OUT" profiles && rm -rf "$OUT/profiles"
echo "elapsed $((SECONDS - T0)) s"
