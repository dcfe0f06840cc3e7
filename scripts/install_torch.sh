#!/usr/bin/env bash
# Installs PyTorch into a venv for `make install`: the CPU build from PyTorch's own index on
# a machine without an NVIDIA GPU (PyPI's Linux wheel is the multi-GB CUDA build), PyPI
# otherwise. Where that index does not answer within $PROBE_TIMEOUT seconds (a machine
# whose only package source is PyPI, a proxy, no network), it says so and takes PyPI's
# wheel instead of letting pip retry for minutes.
#
# Usage: scripts/install_torch.sh PYTHON
# Environment: TORCH_SPEC (e.g. torch==2.13.0), USE_CPU_INDEX (1: try the CPU index),
# TORCH_CPU_INDEX (its URL), PROBE_TIMEOUT (seconds, default 5), PIP (the pip command;
# default: PYTHON -m pip).
set -euo pipefail
python=${1:?usage: install_torch.sh PYTHON}
spec=${TORCH_SPEC:?TORCH_SPEC is not set}
index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
timeout=${PROBE_TIMEOUT:-5}
pip=${PIP:-"$python -m pip"}

args=()
if [ "${USE_CPU_INDEX:-0}" = 1 ]; then
  if "$python" - "$index/torch/" "$timeout" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).close()
PY
    args=(--index-url "$index")
  else
    echo "PyTorch's CPU index ($index) did not answer within ${timeout} s: installing" \
      "$spec from the configured package index instead (on Linux, PyPI's wheel is the" \
      "CUDA build: several GB)" >&2
  fi
fi
# a short timeout and one retry: an index that stops answering fails in seconds, not minutes
$pip install -q --timeout 30 --retries 1 "${args[@]}" "$spec"
