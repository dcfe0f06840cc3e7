#!/usr/bin/env bash
# Session 13. PART=fits (one GPU): issue 21's fits check: Llama-3.2-1B full fine-tuning at
# batch 1 and 8, auto mode beside plain PyTorch with and without recompute, no clipping,
# 70 GiB on an H100 (80 on an H200); then issue 24's long run (benchmarks/long_run.py:
# 500 LoRA steps under auto mode, killed twice and resumed, against two straight runs).
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc; free -g | head -2
case "${PART:-fits}" in
fits)
  G=70; nvidia-smi -L | grep -q H200 && G=80
  F="--workload fits --budget-gib $G --out $OUT/fits.jsonl"
  for b in 1 8; do
    row 100 $F --batch $b $A
    row 80 $F --batch $b --system plain --no-checkpointing
    row 80 $F --batch $b --system plain
  done
  l=$(left); [ "$l" -gt 60 ] && timeout $(( l - 10 )) python3 benchmarks/long_run.py \
    --commit $C --gpu-budget 2GiB --work /tmp/long_run --out $OUT/long-run.jsonl 2>&1 | tail -3
  tail -c 3000 /tmp/long_run/killed.log > $OUT/long-run-killed-tail.log 2>/dev/null
  ;;
fits2)  # batch 1 again, 20 timed steps, alternating; the engine with every chunk persistent
  # and no chunked loss beside it (the engine alone against plain)
  G=70; nvidia-smi -L | grep -q H200 && G=80
  F="--workload fits --budget-gib $G --batch 1 --steps 20 --out $OUT/fits2.jsonl"
  for i in 1 2; do
    row 100 $F $A
    row 80 $F --system plain --no-checkpointing
  done
  row 80 $F --system protrain --no-checkpointing
  ;;
fits3)  # auto mode as a user of a model that fits runs it: the model's own loss (no
  # chunked loss), batch 1 and 8, beside plain PyTorch's fastest configuration that fits
  G=70; nvidia-smi -L | grep -q H200 && G=80
  F="--workload fits --budget-gib $G --steps 20 --out $OUT/fits3.jsonl"
  row 80 $F --batch 1 --system plain --no-checkpointing
  row 100 $F --batch 1 --system protrain --auto
  row 80 $F --batch 1 --system plain --no-checkpointing
  row 100 $F --batch 8 --system protrain --auto
  row 80 $F --batch 8 --system plain
  ;;
long)  # issue 24's long run: 500 LoRA steps under auto mode, checkpoints every 100, killed
  # (SIGKILL) after checkpoints 200 and 400 and resumed, against two straight runs
  timeout $(( $(left) - 10 )) python3 benchmarks/long_run.py --commit $C --gpu-budget 2GiB \
    --hidden 512 --layers 8 --seq 256 --work /tmp/long --out $OUT/long-run.jsonl 2>&1 | tail -1
  grep -i "plan\|persist\|chunk" /tmp/long/straight.log | head -20 > $OUT/long-run-plan.log
  grep "^step" /tmp/long/straight.log | tail -3 >> $OUT/long-run-plan.log
  ;;
trainer)  # issue 20: Trainer + ProTrain on full-3b beside run.py's auto row; SFTTrainer LoRA 8B
  l=$(left); timeout $(( l > 330 ? 330 : l )) python3 benchmarks/trainer_speed.py \
    --row trainer-full-3b --with-wrap-row --commit $C --run-id $RID --out $OUT/trainer.jsonl \
    2>&1 | grep '^{' | cut -c1-400
  l=$(left); timeout $(( l - 5 )) python3 benchmarks/trainer_speed.py --row sft-lora-8b \
    --commit $C --run-id $RID --out $OUT/trainer.jsonl 2>&1 | grep '^{\|Error' | cut -c1-400
  ;;
fits4)  # batch 1, 100 timed steps, alternating: is auto mode's plain layout within 2%?
  G=70; nvidia-smi -L | grep -q H200 && G=80
  F="--workload fits --budget-gib $G --batch 1 --steps 100 --warmup 5 --out $OUT/fits4.jsonl"
  for i in 1 2; do
    row 90 $F --system plain --no-checkpointing
    row 110 $F --system protrain --auto
  done
  ;;
moe)  # on one GPU of a two-GPU host (256 GiB: the 61 GB bf16 base and its pinned copy):
  # issue 20's SFTTrainer LoRA 8B row (where the image has pyarrow), then issue 27's LoRA on
  # the Qwen3-30B-A3B shape, auto mode beside FSDP2 CPU offload, 24 GiB, no clipping
  export CUDA_VISIBLE_DEVICES=0
  if [ -z "$NO_SFT" ] && python3 -c "import pyarrow" 2>/dev/null; then
    timeout 200 python3 benchmarks/trainer_speed.py --row sft-lora-8b --commit $C --run-id $RID \
      --out $OUT/trainer.jsonl 2>&1 | grep '^{\|Error' | cut -c1-400
  else
    echo "the SFTTrainer row is not run (NO_SFT, or no pyarrow on this image)"
  fi
  R="python3 benchmarks/run.py --commit $C --run-id $RID --steps 3 --warmup 2 --max-grad-norm 0"
  M="--workload lora-moe30b --out $OUT/moe.jsonl"
  row 200 $M $A
  for b in 4 2 1; do  # FSDP2 at its largest batch that fits (its set-up alone took > 200 s)
    out=$(row 360 $M --system fsdp2_offload --batch $b); echo "${out:-no row (killed at its time limit?)}"
    echo "$out" | grep -q '"status": "oom"' || break
  done
  free -g | head -2
  ;;
longdiag)  # the app's LoRA step at a 2 GiB and an 8 GiB budget: where the time goes
  for g in 2GiB 8GiB; do
    timeout 150 python3 benchmarks/long_run.py --commit $C --gpu-budget $g --steps 40 \
      --save-steps 20 --kill-after 20 --work /tmp/ld-$g --out $OUT/longdiag.jsonl 2>&1 | tail -1
    grep -v "^step" /tmp/ld-$g/straight.log | head -60 > $OUT/longdiag-$g.log
    grep "^step" /tmp/ld-$g/straight.log | tail -5 >> $OUT/longdiag-$g.log
  done
  ;;
esac
