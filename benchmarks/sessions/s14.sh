#!/usr/bin/env bash
# Session 14, one warm host of four GPUs (nvidia-h200-x4 / nvidia-h100-x4), calls in turn
# with one RID. Carry .whl (pydantic, DeepSpeed).
# PART=ckpt:  issue 18: full-8b through `protrain train` under torchrun, sharded, auto at
#             24 GiB, saved on 2 GPUs (benchmarks/resume_ranks.py; saves, loads and host
#             memory timed by checkpoint_probe.py); issue 25's 70B full fine-tuning asked of
#             the app on 4 GPUs (a header-only checkpoint: sessions/sparse_checkpoint.py);
#             the 30B MoE saved for PART=moe.
# PART=ckpt1: that checkpoint resumed on 2 GPUs and on 1.
# PART=moe also repeats the 70B question first (PART=ckpt's log kept only torchrun's tail).
# PART=moe:   issue 27: LoRA on the Qwen3-30B-A3B shape through `protrain train` (auto,
#             24 GiB, one GPU; benchmarks/app_speed.py).
# PART=moe2:  FSDP2 CPU offload on the same workload and budget (run.py), same RID.
# PART=four:  issue 25: lora-14b at 24 GiB a GPU on 4 GPUs: ProTrain auto, DeepSpeed ZeRO-3
#             offload at its largest batch that fits (FSDP2 at batch 2: session 12's run).
source benchmarks/sessions/lib.sh
run_on() {  # run_on <GPUs>: $R for that many GPUs of this host
  if [ "$1" = 1 ]; then
    R="env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/run.py"
  else
    R="env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(( $1 - 1 ))) torchrun --standalone --nproc-per-node $1 benchmarks/run.py"
  fi
  R="$R --commit $C --run-id $RID --steps 3 --warmup 2 --max-grad-norm 0"
}
nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
W=/tmp/s14
case "${PART:-ckpt}" in
x1) ;;
ckpt)  # the save on 2 GPUs; the 70B question; the MoE model saved for PART=moe
  timeout 330 python3 benchmarks/resume_ranks.py --commit "$C" --shape llama8b \
    --device cuda --gpu-budget 24GiB --save-on 2 --resume-on --window 2 --steps 2 \
    --work $W/rr --out "$OUT/resume8b.jsonl" 2>&1 | grep '^{\|Error\|error' | cut -c1-3000
  tail -5 $W/rr/save-2.log 2>/dev/null | cut -c1-300 > "$OUT/ckpt.log"
  python3 benchmarks/sessions/sparse_checkpoint.py llama70b $W/sparse70b
  sed "s#/tmp/sparse70b#$W/sparse70b#;s#/work/main#$PWD#;s#/tmp/full70b-run#$W/full70b-run#" \
    benchmarks/sessions/full70b.yaml > $W/full70b.yaml
  timeout 90 torchrun --standalone --nproc-per-node 4 -m protrain train $W/full70b.yaml 2>&1 \
    | grep -iv warn | tail -4 | tee "$OUT/full70b.log"; rm -rf $W/sparse70b
  timeout $(( $(left) - 5 )) python3 benchmarks/app_speed.py --workload lora-moe30b --build-only \
    --work $W/app 2>&1 | tail -2
  ;;
ckpt1)  # the checkpoint resumed on 2 GPUs and on 1, a row each; first what the save left
  # (PART=ckpt's save outran its 330 s after the checkpoint, in the final export)
  mkdir -p "$OUT/save2"; cp $W/rr/probe/rank*.jsonl "$OUT/save2/" 2>/dev/null
  grep -v "it/s\]" $W/rr/save-2.log | tail -60 | cut -c1-400 > "$OUT/save2/save-2.log"
  ls -la $W/rr/save-2/ $W/rr/save-2/checkpoint-2 | head -30 > "$OUT/save2/ls.txt"
  for m in 2 1; do
    t=$(( $(left) - 5 )); [ "$m" = 2 ] && t=$(( t / 2 + 20 ))
    timeout $t python3 benchmarks/resume_ranks.py --commit "$C" --shape llama8b \
      --device cuda --gpu-budget 24GiB --save-on 2 --skip-save --resume-on $m --window 2 \
      --steps 2 --work $W/rr --out "$OUT/resume8b.jsonl" 2>&1 | grep '^{\|Error\|error' | cut -c1-3000
    grep -v "it/s\]" $W/rr/save-2-resume$m.log | tail -40 | cut -c1-400 > "$OUT/resume$m.log"
    cp -r $W/rr/probe "$OUT/probe-resume$m" 2>/dev/null
  done
  ;;
moe)
  python3 benchmarks/sessions/sparse_checkpoint.py llama70b $W/sparse70b
  sed "s#/tmp/sparse70b#$W/sparse70b#;s#/work/main#$PWD#;s#/tmp/full70b-run#$W/full70b-run#" \
    benchmarks/sessions/full70b.yaml > $W/full70b.yaml
  timeout 90 torchrun --standalone --nproc-per-node 4 -m protrain train $W/full70b.yaml \
    > "$OUT/full70b.log" 2>&1; echo "exit $?"; grep -i "error" "$OUT/full70b.log" | grep -v "^\[\|elastic\|error_file" | head -4
  rm -rf $W/sparse70b
  export CUDA_VISIBLE_DEVICES=0
  timeout $(( $(left) - 5 )) python3 benchmarks/app_speed.py --workload lora-moe30b --commit "$C" \
    --run-id "$RID" --work $W/app --out "$OUT/moe.jsonl" 2>&1 | tail -1 | cut -c1-3000
  cp $W/app/lora-moe30b-run.log "$OUT/moe-app.log" 2>/dev/null
  ;;
moe2)
  run_on 1
  row $(( $(left) - 5 )) --workload lora-moe30b --system fsdp2_offload --batch 4 --out "$OUT/moe.jsonl"
  ;;
four)
  O14="--workload lora-14b --budget-gib 24 --out $OUT/four.jsonl"
  run_on 4
  row 170 $O14 $A
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .whl/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  for b in 4 2 1; do  # ZeRO-3 at its largest batch that fits
    out=$(row 200 $O14 --system ds_z3_offload --batch $b); echo "${out:-no row}"
    echo "$out" | grep -q '"status": "oom"' || break
  done
  ;;
esac
cp ~/.cache/protrain/hardware-*.json "$OUT/" 2>/dev/null; free -g | head -2; df -h /tmp | tail -1
# PART=x1 (one GPU, nvidia-h100-x1 / nvidia-h200): issue 21's `protrain profile` pictures of
# full-3b and lora-14b (benchmarks/profile_pictures.py); issue 19's FSDP2 peak from
# `protrain plan` beside the same config's training (sessions/fsdp2_plan_check.py); the GPU
# tests of engine, plan and train.
if [ "${PART}" = x1 ]; then
  timeout 260 python3 benchmarks/profile_pictures.py --out-dir "$OUT/pictures" 2>&1 | grep -v "it/s\]" | tail -4
  timeout 150 python3 benchmarks/sessions/fsdp2_plan_check.py $W/fsdp2 "$OUT/fsdp2-plan.jsonl" 2>&1 | tail -2 | cut -c1-1500
  timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/plan \
    tests/train -k "not wrap_close_cycles" 2>&1 | tail -4 | tee "$OUT/gpu-tests.log"
fi
