#!/usr/bin/env bash
# Session 12: one host of four GPUs (nvidia-h100-x4 / nvidia-h200-x4), issue 25. Every
# row at 24 GiB a GPU, no clipping; 1, 2 and 4 GPUs of the same host in one run (RID
# shared across the calls on the warm machine); each rank gets cores / local ranks threads
# (run.py), the one-GPU rows the whole host's.
# PART=a: full-8b on 4 GPUs: ProTrain auto, FSDP2 CPU offload, DeepSpeed ZeRO-3 offload;
#         then ProTrain auto on 2 GPUs.
# PART=b: full-8b ProTrain auto on 1 GPU; lora-14b on 4 GPUs: ProTrain auto, FSDP2 CPU
#         offload at batch 2 (its largest at 24 GiB: the fp32 logits of batch 4 do not
#         fit); lora-14b ProTrain auto on 1 GPU.
# PART=c: qlora-70b on 4 GPUs through the chunk engine (auto) and the FSDP2 engine; the
#         checkpoint chains 4->2->1 and 2->4 (benchmarks/resume_ranks.py); lora-14b on 2.
# PART=d: the peers on one GPU: full-8b FSDP2 offload and ZeRO-3 offload, lora-14b FSDP2.
source benchmarks/sessions/lib.sh
run_on() {  # run_on <GPUs>: $R for that many GPUs of this host
  if [ "$1" = 1 ]; then
    R="env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/run.py"
  else
    R="env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(( $1 - 1 ))) torchrun --standalone --nproc-per-node $1 benchmarks/run.py"
  fi
  R="$R --commit $C --run-id $RID --steps 3 --warmup 2 --max-grad-norm 0"
}
nvidia-smi -L; nproc; free -g | head -2
O8="--workload full-8b --budget-gib 24 --out $OUT/four-$PART.jsonl"
O14="--workload lora-14b --budget-gib 24 --out $OUT/four-$PART.jsonl"
case "${PART:-a}" in
a)
  run_on 4
  row 170 $O8 $A
  row 170 $O8 --system fsdp2_offload
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .whl/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  row 220 $O8 --system ds_z3_offload
  run_on 2
  row 140 $O8 $A
  ;;
b)
  run_on 1
  row 170 $O8 $A
  run_on 4
  row 170 $O14 $A
  row 180 $O14 --system fsdp2_offload --batch 2
  run_on 1
  row 170 $O14 $A
  ;;
c)
  run_on 4
  Q="--workload qlora-70b --budget-gib 24 --out $OUT/four-c.jsonl"
  row 230 $Q --system protrain --auto --chunked-loss-tokens 2048
  row 230 $Q --system protrain_fsdp2 --chunked-loss-tokens 2048
  l=$(left); [ "$l" -gt 100 ] && timeout $(( l - 10 )) python3 benchmarks/resume_ranks.py \
    --commit "$C" --out "$OUT/resume-ranks.jsonl" 2>&1 | grep '^{' | cut -c1-1500
  run_on 2
  row 140 $O14 $A
  ;;
d)  # the peers on one GPU of the same host (DeepSpeed installed by PART=a)
  run_on 1
  row 160 $O8 --system fsdp2_offload
  row 180 $O8 --system ds_z3_offload
  row 150 $O14 --system fsdp2_offload --batch 2
  ;;
esac
cp ~/.cache/protrain/hardware-*.json "$OUT/" 2>/dev/null; free -g | head -2
