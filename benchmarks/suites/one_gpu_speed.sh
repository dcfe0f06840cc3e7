#!/usr/bin/env bash
# Speed on one GPU: ProTrain auto beside the baselines, one run id, at each workload's
# budget, no clipping, 2 warm-up and 5 timed steps (benchmarks/run.py rows).
#   WORKLOADS  any of: full-3b, full-8b (24 GiB: auto, FSDP2 CPU offload, DeepSpeed ZeRO-3
#              offload), lora-14b (24 GiB: auto at batch 4, FSDP2 CPU offload at batch 2, its
#              largest), qlora-70b (24 GiB: auto at batch 2; needs bitsandbytes in $WHL),
#              fits (Llama-3.2-1B, 70 GiB on an H100, 80 on an H200: auto beside plain PyTorch
#              with and without recompute, batch 1 and 8); default "full-3b"
#   GA         micro-batches a step for the full-* rows (default 1; 4 as fine-tuning recipes)
#   TORCH_PATH 1: also a ProTrain auto row on torch's fused AdamW (--host-update torch)
#   STATES     also ProTrain auto rows with these opt-in host moment formats (e.g. "bf16 8bit")
#   STEPS, WARMUP  timed and warm-up steps (default 5 and 2)
#   START      continue at row k on the same warm machine (with the same RID)
# One device call (600 s) holds about one workload; the ds row JIT-builds DeepSpeed's CPU Adam.
source "$(dirname "$0")/lib.sh"
machine
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps ${STEPS:-5} --warmup ${WARMUP:-2}"
R="$R --max-grad-norm 0"
specs=()
for w in ${WORKLOADS:-full-3b}; do
  case $w in
  full-3b | full-8b)  # both at 24 GiB on one GPU (full-8b's workload default is 80)
    A="--workload $w --budget-gib 24 --grad-accum ${GA:-1}"
    specs+=("200 $A $AUTO")
    [ "${TORCH_PATH:-0}" = 1 ] && specs+=("200 $A $AUTO --host-update torch")
    for st in ${STATES:-}; do specs+=("200 $A $AUTO --optimizer-state $st"); done
    specs+=("160 $A --system fsdp2_offload" "240 $A --system ds_z3_offload") ;;
  lora-14b) specs+=("200 --workload lora-14b $AUTO"
                    "200 --workload lora-14b --system fsdp2_offload --batch 2") ;;
  qlora-70b) specs+=("300 --workload qlora-70b $AUTO --batch 2") ;;
  fits)
    G=70; nvidia-smi -L | grep -q H200 && G=80
    for b in 1 8; do
      specs+=("100 --workload fits --budget-gib $G --batch $b $AUTO"
              "80 --workload fits --budget-gib $G --batch $b --system plain --no-checkpointing"
              "80 --workload fits --budget-gib $G --batch $b --system plain")
    done ;;
  *) echo "unknown workload: $w (allowed: full-3b full-8b lora-14b qlora-70b fits)"; exit 2 ;;
  esac
done
rows "$OUT/speed.jsonl" "${specs[@]}"
echo "elapsed $((SECONDS - T0)) s"
