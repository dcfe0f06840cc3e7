#!/usr/bin/env bash
# Session 22's GPU calls. Run from a `git archive` of COMMIT without benchmarks/results,
# carrying the wheel folder WHL names (see benchmarks/README.md).
# PART=two (2 GPUs, WHL=.whl-ds): full-8b at 24 GiB a GPU, one run on one warm machine:
#   auto, then auto with N device-stepped chunks for each N of DSTEP (fixed for the planner,
#   which picks the other knobs; without clipping they now step inside the backward on
#   several ranks too), FSDP2 CPU offload, DeepSpeed ZeRO-3 offload. START=k continues at
#   row k on the same warm machine with the same RID when a call runs out of time.
#   Issue 17: 2x FSDP2 and 2.5x ZeRO-3 (session 22's first call, e8e5f71: 1.49x, 2.30x).
# PART=host (any machine, written for the next session): the host AdamW of 1 and 2 processes
#   at once over 1 G parameters each (host_adam_ranks.py): the floor of full-8b's step on a
#   two-GPU host (3.75 G offloaded parameters a rank) and the ratio it allows against FSDP2.
source benchmarks/sessions/lib.sh
nvidia-smi -L; nproc
if [ "${PART:-two}" = host ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/host_adam_ranks.py --procs 1 2 \
    --numel $((1 << 30)) --out "$OUT/host_adam.jsonl"
  exit
fi
R="torchrun --standalone --nproc-per-node 2 benchmarks/run.py --commit $C --run-id $RID"
R="$R --steps 4 --warmup 2 --max-grad-norm 0 --budget-gib 24"
rows=("190 --workload full-8b $A")
for k in ${DSTEP:-4 7}; do rows+=("190 --workload full-8b $A --n-device-step $k"); done
rows+=("130 --workload full-8b --system fsdp2_offload"
       "240 --workload full-8b --system ds_z3_offload")
for ((i = ${START:-1}; i <= ${#rows[@]}; i++)); do
  set -- ${rows[$((i - 1))]}
  [ "$1" -gt "$(( $(left) - 5 ))" ] && { echo "next: START=$i"; break; }
  [[ "$*" == *ds_z3* ]] && python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-cache-dir --upgrade --target /tmp/site "$WHL"/deepspeed-0.19.8.tar.gz >/dev/null 2>&1
  row "$@" --out "$OUT/full8b.jsonl"
done
echo "elapsed $((SECONDS - T0)) s"
