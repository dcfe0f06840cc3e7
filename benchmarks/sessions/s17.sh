#!/usr/bin/env bash
# Session 17. Run from the working tree (clean at COMMIT), carrying .whl-lite (WHL=.whl-lite).
# PART=diag (one GPU): issue 21's small steps, predicted 42-50% too slow in session 16. The two
#   rows, each with the alternatives on the same trace that split the error: the trace's own
#   layout (offloaded chunks, every block recomputed) and every chunk persistent with every
#   block recomputed, beside the plan (every chunk persistent, nothing recomputed).
# PART=loss (one GPU): the rows whose loss ran on the whole logits (12 bytes a logit now): the
#   1B at 40 GiB that ran out of memory on both hosts, fits-b8, the 3B LoRA at 80 GiB.
source benchmarks/sessions/lib.sh
case "${PART:-diag}" in
diag)
  P="python3 benchmarks/plan_accuracy.py --run-id $RID --out $OUT/diag.jsonl"
  timeout $(( $(left) - 5 )) $P --only fits-b1 --also "3,2,0,16;5,0,0,16;5,0,0,8" 2>&1 | grep -v '^{' | tail -5
  timeout $(( $(left) - 5 )) $P --only extra-3b-lora-24-b1-s512 --also "5,4,0,28;9,0,0,28;9,0,0,14" \
    2>&1 | grep -v '^{' | tail -5
  ;;
loss)
  timeout $(( $(left) - 5 )) python3 benchmarks/plan_accuracy.py --run-id "$RID" --out "$OUT/loss.jsonl" \
    --only extra-1b-full-40-b8-s2048,fits-b8,extra-3b-lora-80-b2-s4096 2>&1 | grep -v '^{' | tail -4
  ;;
esac
echo "elapsed $((SECONDS - T0)) s"
