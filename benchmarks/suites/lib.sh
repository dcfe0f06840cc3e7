# Sourced by the suites: arguments, the tree to run, wheels, and the row helper.
# Usage of every suite: benchmarks/suites/<suite>.sh OUT_DIR [COMMIT]
#   OUT_DIR  where the rows (JSON lines) and logs go; created if missing
#   COMMIT   run that commit's tree (extracted with `git archive` under /tmp, the wheel folders
#            copied beside it); without it, the working tree runs, its commit named by
#            $COMMIT or `git rev-parse` (the device machine's copy has a stale .git: set COMMIT)
# Environment: LIMIT (seconds the suite may use, default 585: one device call), RID (a run id
# shared with an earlier call on the same warm machine), WHL (wheel folder, default .whl).
set -u
OUT=${1:?usage: $0 OUT_DIR [COMMIT]}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if [ -n "${2:-}" ]; then
  C=$(git rev-parse --short "$2") || exit 2
  SRC=/tmp/protrain-$C; rm -rf "$SRC"; mkdir -p "$SRC"
  git archive "$2" | tar -x -C "$SRC" || exit 2
  cp -r .whl* "$SRC"/ 2>/dev/null
  cd "$SRC" || exit 2
else
  C=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
fi
T0=$SECONDS; ROWN=0; LIMIT=${LIMIT:-585}; WHL=${WHL:-.whl}
left() { echo $(( LIMIT - (SECONDS - T0) )); }  # seconds left of this suite's budget
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 COMMIT=$C
RID=${RID:-"$(date -u +%Y-%m-%dT%H:%MZ)-$C"}
install_deepspeed() {  # DeepSpeed's source distribution, for the ds_* rows (see README)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --upgrade --target /tmp/site "$WHL"/deepspeed-*.tar.gz >/dev/null 2>&1
}
row() {  # row <max seconds> <run.py args...>: one row through $R, its JSON line echoed
  local t=$1; shift; local l; l=$(left)
  [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  [[ "$*" == *ds_z* ]] && install_deepspeed
  ROWN=$((ROWN + 1)); mkdir -p "$OUT/logs"  # the whole output kept, the JSON line shown
  timeout "$t" $R "$@" > "$OUT/logs/row-$ROWN.log" 2>&1
  local rc=$?; [ $rc = 124 ] && echo "timed out after $t s (log: logs/row-$ROWN.log)"
  grep '^{\|Error' "$OUT/logs/row-$ROWN.log" | tail -2 | cut -c1-1500 \
    || tail -3 "$OUT/logs/row-$ROWN.log" | cut -c1-300
}
rows() {  # rows <out file> <spec>...: each spec "<max seconds> <run.py args>", from $START
  local out=$1; shift; local specs=("$@") i
  for ((i = ${START:-1}; i <= ${#specs[@]}; i++)); do
    set -- ${specs[$((i - 1))]}
    [ "$1" -gt "$(( $(left) - 5 ))" ] && { echo "next: START=$i (same RID=$RID)"; return; }
    echo "row $i: ${*:2}"; ROWN=$((i - 1)); row "$@" --out "$out"
  done
}
machine() {  # what the rows ran on, for the log
  nvidia-smi -L 2>/dev/null; nproc; free -g | head -2
  lscpu | grep -i "numa node(s)\|model name\|socket(s)"
}
AUTO="--system protrain --auto --chunked-loss-tokens 4096"  # auto mode as the app runs it
