#!/usr/bin/env bash
# Session 15. Carry .whl (pydantic, pytest, DeepSpeed).
# PART=diag (one GPU): issue 19: why the FSDP2 engine exited 1 on an H100 in session 14:
#            `protrain plan` and `protrain train` of sessions/fsdp2_plan_check.py's config
#            with --debug (the whole traceback), then the check itself.
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc; free -g | head -2
W=/tmp/s15
case "${PART:-diag}" in
diag)
  timeout 240 python3 benchmarks/sessions/fsdp2_plan_check.py $W/fsdp2 $W/fsdp2.jsonl 2>&1 | tail -2 | cut -c1-2500
  grep -q '"train_rc": 0' $W/fsdp2.jsonl && exit 0  # else the whole traceback of one train
  for f in $W/fsdp2/fsdp2-False.yaml; do
    PROTRAIN_DEBUG=1 timeout 120 torchrun --standalone --nproc-per-node 1 -m protrain train "$f" 2>&1 \
      | grep -v "it/s\]\|^  [a-z_]*:\|^[a-z_]*:" | tail -45 | cut -c1-400
  done
  ;;
esac
