#!/usr/bin/env bash
# `make test-axolotl`: ProTrainPlugin under the real axolotl, on the CPU, in a venv of its
# own (axolotl pins transformers, peft and trl apart from protrain[hf]). Trains the
# repository's example and axolotl's own examples/llama-3/lora-1b.yml (pointed at a tiny
# local model and local data, plus the plugin line and a protrain_memory section) for three
# steps each. axolotl 0.20+ needs Python 3.12: AXOLOTL_PYTHON names it, else python3.12 on
# the PATH or pyenv's.
#
# Environment: AXOLOTL_VERSION (default 0.21.0), AXOLOTL_VENV (default .venv-axolotl),
# AXOLOTL_PYTHON, STEPS (default 3).
set -euo pipefail
version=${AXOLOTL_VERSION:-0.21.0}
venv=${AXOLOTL_VENV:-.venv-axolotl}
steps=${STEPS:-3}
python=${AXOLOTL_PYTHON:-$(command -v python3.12 || ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || true)}
if [ -z "$python" ]; then
  echo "test-axolotl: axolotl $version needs Python 3.12; set AXOLOTL_PYTHON to one" >&2
  exit 1
fi

if [ ! -x "$venv/bin/axolotl" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "axolotl==$version"
fi
# protrain from this checkout, on axolotl's pins (its own dependencies are among them)
"$venv/bin/python" -m pip install -q --no-deps -e .

venv=$(cd "$venv" && pwd)  # absolute: axolotl runs from the work folder below
# axolotl launches `accelerate` from the PATH
export PATH="$venv/bin:$PATH"
export AXOLOTL_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 CUDA_VISIBLE_DEVICES=""
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" examples/axolotl/make_tiny_model.py "$work/tiny-llama"
for config in example lora-1b; do
  "$venv/bin/python" tests/integrations/axolotl_real/configs.py "$config" "$work" > "$work/$config.yml"
  echo "test-axolotl: axolotl $version trains $config ($steps steps)"
  # from the work folder: lora-1b.yml leaves dataset_prepared_path at axolotl's default,
  # last_run_prepared/ under the current directory (the configs' other paths are absolute)
  (cd "$work" && "$venv/bin/axolotl" train "$config.yml" --max-steps "$steps") 2>&1 |
    tee "$work/$config.log"
  grep -q "protrain memory plan" "$work/$config.log" || {
    echo "test-axolotl: $config: the plan did not reach axolotl's console" >&2; exit 1; }
  ls "$work/$config-out"/adapter_model.safetensors > /dev/null
done
echo "test-axolotl: axolotl $version passed"
