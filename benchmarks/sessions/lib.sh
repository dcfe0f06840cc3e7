# Sourced by the session scripts (since session 3): the device machine's set-up and the
# helpers every call used. Needs .whl carried (pydantic, pytest; see benchmarks/README.md).
# Sets T0, LIMIT (default 585 s), C (COMMIT), RID (the run id rows share) and PYTHONPATH.
T0=$SECONDS; LIMIT=${LIMIT:-585}
left() { echo $(( LIMIT - (SECONDS - T0) )); }  # seconds left of this call's budget
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}; RID="$(date -u +%Y-%m-%dT%H:%MZ)-$C"
row() {  # row <max seconds> <args...>: one benchmarks/run.py row ($R: its command), JSON out
  local t=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped (time): $*"; return; }
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" $R "$@" 2>&1 | grep '^{\|Error' | tail -2 | cut -c1-1500
}
