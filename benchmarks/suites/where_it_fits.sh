#!/usr/bin/env bash
# Where the model fits: ProTrain auto with Liger's kernels (--kernels auto) beside what a
# user would run instead, one run id, no clipping, 2 warm-up and 5 timed steps.
#   WORKLOADS  any of: lora-8b (Llama-3-8B LoRA, the whole GPU: 70 GiB on an H100, 80 on an
#              H200; batch $BATCH x 2048: protrain auto, plain PEFT without recompute, plain
#              PEFT + Liger without recompute), lora-14b (24 GiB: protrain auto with kernels at
#              batch 4, FSDP2 CPU offload at batch 2, its largest), packed (Llama-3-8B LoRA,
#              plain PEFT with recompute and the chunked loss (32K tokens of whole fp32
#              logits are 15.7 GiB), one pack of 8K and of 32K tokens holding samples of
#              2048: sdpa with its dense tokens x tokens mask, beside flex_attention with a
#              block mask); default "lora-8b lora-14b"
#   BATCH      lora-8b's batch (default 4; the acceptance range is 2 to 4)
#   START      continue at row k on the same warm machine (with the same RID)
# Needs liger-kernel in $WHL (see benchmarks/README.md, "Wheels"); Triton comes with the GPU
# image's torch. Both workloads take about 9 minutes of one device call; rows left over
# print their START. packed alone needs no liger-kernel: WORKLOADS=packed.
source "$(dirname "$0")/lib.sh"
machine
if [ "${WORKLOADS:-}" != packed ]; then
  python3 -c "import liger_kernel, triton; print('liger-kernel', liger_kernel.__file__, 'triton', triton.__version__)" \
    || { echo "liger-kernel is not importable: put its wheel in $WHL"; exit 2; }
fi
R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 5 --warmup 2 --max-grad-norm 0"
KAUTO="$AUTO --kernels auto"
B=${BATCH:-4}
specs=()
for w in ${WORKLOADS:-lora-8b lora-14b}; do
  case $w in
  lora-8b)
    G=70; nvidia-smi -L | grep -q H200 && G=80
    specs+=("130 --workload lora-8b --budget-gib $G --batch $B $KAUTO"
            "75 --workload lora-8b --budget-gib $G --batch $B --system plain --no-checkpointing"
            "75 --workload lora-8b --budget-gib $G --batch $B --system plain_liger --no-checkpointing") ;;
  lora-14b) specs+=("170 --workload lora-14b --batch 4 $KAUTO"
                    "150 --workload lora-14b --system fsdp2_offload --batch 2") ;;
  packed) for s in 8192 32768; do
            for a in sdpa flex_attention; do
              specs+=("$(( s == 8192 ? 90 : 180 )) --workload lora-8b --system plain --seq $s --pack-samples $(( s / 2048 )) --attn $a --chunked-loss-tokens 4096")
            done
          done ;;
  *) echo "unknown workload: $w (allowed: lora-8b lora-14b packed)"; exit 2 ;;
  esac
done
rows "$OUT/where_it_fits.jsonl" "${specs[@]}"
echo "elapsed $((SECONDS - T0)) s"
