#!/usr/bin/env bash
# The planner's predictions against measurement (benchmarks/plan_accuracy.py): part K of N
# of a group of configurations, each profiled, planned and trained in its own process, the
# predicted peak and step time beside the measured ones; stopped cleanly before LIMIT. The
# kept model and hardware profiles come back as one tar (benchmarks/repredict.py reads them).
#   GROUP  matrix | holdout | big | all | acceptance (default); `--list` shows the parts
#   K, N   the part (default 1 of 3); ONLY: a comma-separated list of configurations instead
#   VLM    a budget in GiB: the vision-language row (vlm_accuracy.py) instead; the model is
#          written once per machine under /tmp/vlm_accuracy (run a second budget warm)
#   TINY=1 the same commands on the CPU (plan_accuracy --tiny, vlm_accuracy --smoke)
# Summary over several parts' files:
#   python3 benchmarks/plan_accuracy.py --summarize benchmarks/results/*_plan-accuracy*.jsonl
source "$(dirname "$0")/lib.sh"
machine
if [ -n "${VLM:-}" ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/vlm_accuracy.py ${TINY:+--smoke} --budgets "$VLM" \
    --time-limit $(( $(left) - 20 )) --commit "$C" --run-id "$RID" --out "$OUT/vlm-$VLM.jsonl" \
    2>&1 | grep -v '^{' | tail -6 | cut -c1-2000
  exit
fi
G=${GROUP:-acceptance}; P="${K:-1}/${N:-3}"
if [ -n "${ONLY:-}" ]; then SEL=(--only "$ONLY"); NAME=only; else SEL=(--group "$G" --part "$P"); NAME="$G-${K:-1}of${N:-3}"; fi
timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py ${TINY:+--tiny} "${SEL[@]}" \
  --time-limit $(( $(left) - 20 )) --run-id "$RID" --out "$OUT/plan-accuracy-$NAME.jsonl" \
  --profiles /tmp/pa-profiles 2>&1 | grep -v '^{' \
  | grep -i 'configurations ran\|peak error\|skipped\|not started\|exit status\|timeout\|Error' | tail -12
tar -czf "$OUT/profiles-$NAME.tar.gz" -C /tmp pa-profiles 2>/dev/null
echo "elapsed $((SECONDS - T0)) s"
