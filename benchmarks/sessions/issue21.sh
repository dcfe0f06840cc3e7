#!/usr/bin/env bash
# Issue 21's acceptance runs, one device call each (limit 600 s); needs COMMIT. The parts'
# files go to $OUT; copy them to benchmarks/results/ and summarize them all together:
#   python3 benchmarks/plan_accuracy.py --summarize benchmarks/results/<date>-s<N>-pa-*.jsonl
# PART=pa K=1 N=3 [GROUP=acceptance]: plan_accuracy.py, part K of N of the group (held-out
#          and tuned configurations; `--list` shows the parts), stopped before the call ends;
#          the profiles it keeps come back as one tar (benchmarks/repredict.py reads them).
# PART=vlm B=16: vlm_accuracy.py at B GiB (the Qwen2.5-VL-7B shape is built first, once per
#          machine, under /tmp/vlm_accuracy: run the second budget on the same warm machine).
# TINY=1: the same commands on the CPU (plan_accuracy --tiny, vlm_accuracy --smoke).
set -u
source benchmarks/sessions/lib.sh
nvidia-smi -L 2>/dev/null; nproc; free -g | head -2
case "${PART:-pa}" in
pa)
  G=${GROUP:-acceptance}; P="${K:-1}/${N:-3}"
  timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py ${TINY:+--tiny} --group "$G" \
    --part "$P" --time-limit $(( $(left) - 20 )) --run-id "$RID" \
    --out "$OUT/pa-$G-${K:-1}of${N:-3}.jsonl" --profiles /tmp/pa-profiles 2>&1 | grep -v '^{' \
    | grep -i 'configurations ran\|peak error\|skipped\|not started\|exit status\|timeout\|Error' | tail -12
  # the kept model and hardware profiles, for repredict.py: one file back
  tar -czf "$OUT/profiles-$G-${K:-1}of${N:-3}.tar.gz" -C /tmp pa-profiles 2>/dev/null
  ;;
vlm)
  timeout $(( $(left) - 5 )) python3 benchmarks/vlm_accuracy.py ${TINY:+--smoke} --budgets "${B:-16}" \
    --time-limit $(( $(left) - 20 )) --commit "$C" --run-id "$RID" --out "$OUT/vlm-${B:-16}.jsonl" \
    2>&1 | grep -v '^{' | tail -6 | cut -c1-2000
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
