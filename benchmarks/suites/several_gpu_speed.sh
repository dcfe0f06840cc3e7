#!/usr/bin/env bash
# Speed on several GPUs of one host through torchrun: ProTrain auto beside the baselines,
# 24 GiB a GPU, no clipping, 2 warm-up and 4 timed steps, one run id; each rank gets
# cores / local ranks threads (run.py). First the host's memory roof beside its fused CPU
# AdamW for 1..GPUS processes at once (host_adam_ranks.py): the floor of an offloaded step.
#   GPUS       processes (default: every GPU nvidia-smi lists)
#   WORKLOADS  any of: full-8b (auto, FSDP2 CPU offload, DeepSpeed ZeRO-3 offload),
#              lora-14b (auto at batch 4, FSDP2 CPU offload at batch 2); default "full-8b"
#   DSTEP      extra auto rows with that many device-stepped chunks each (e.g. "4 7")
#   HOST_ADAM  0 skips the host measurement; START as in one_gpu_speed.sh
source "$(dirname "$0")/lib.sh"
machine
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
if [ "${HOST_ADAM:-1}" = 1 ] && [ "${START:-1}" = 1 ]; then
  timeout 150 python3 benchmarks/host_adam_ranks.py --procs $(seq 1 "$GPUS") \
    --numel $((1 << 30)) --out "$OUT/host_adam.jsonl" 2>&1 | tail -2
fi
R="torchrun --standalone --nproc-per-node $GPUS benchmarks/run.py --commit $C --run-id $RID"
R="$R --steps 4 --warmup 2 --max-grad-norm 0 --budget-gib 24"
specs=()
for w in ${WORKLOADS:-full-8b}; do
  case $w in
  full-8b)
    specs+=("190 --workload full-8b $AUTO")
    for k in ${DSTEP:-}; do specs+=("190 --workload full-8b $AUTO --n-device-step $k"); done
    specs+=("130 --workload full-8b --system fsdp2_offload"
            "240 --workload full-8b --system ds_z3_offload") ;;
  lora-14b) specs+=("170 --workload lora-14b $AUTO"
                    "180 --workload lora-14b --system fsdp2_offload --batch 2") ;;
  *) echo "unknown workload: $w (allowed: full-8b lora-14b)"; exit 2 ;;
  esac
done
rows "$OUT/speed.jsonl" "${specs[@]}"
cp ~/.cache/protrain/hardware-*.json "$OUT/" 2>/dev/null
echo "elapsed $((SECONDS - T0)) s"
