"""First contact with the CLI: hints that work when followed, the plan printed once and
true for its device, no third-party noise at start."""

import importlib.util
import logging
import re
from pathlib import Path

import pytest
import torch

from protrain.cli import quiet_third_party_noise

from .helpers import tiny_config, write_config
from .test_cli_errors import run_cli, the_error

HINT = "--set memory.auto=true --set memory.gpu_budget=24GiB"


def test_plan_without_a_budget_names_the_keys_to_set():
    assert the_error(run_cli("plan")) == (
        "error: memory.gpu_budget is not set: the planner needs the device memory it may use, "
        f"e.g. {HINT}"
    )


@pytest.mark.slow
def test_following_the_plan_hint_prints_one_plan_true_for_its_device():
    proc = run_cli("plan", *HINT.split())
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    assert both.count("Plan: n_persist=") == 1, both
    assert both.count("best candidates:") == 1, both
    assert proc.stdout.startswith("Plan: n_persist=")
    if torch.cuda.is_available():
        assert "every chunk stays on the GPU" in proc.stdout
    else:
        assert "every chunk stays on the device (cpu): no chunk copies" in proc.stdout
        assert "GPU" not in proc.stdout


def _bitsandbytes_kernels_warning() -> str:
    """The format string bitsandbytes logs when its optional `kernels` package is missing,
    read from its own source."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("bitsandbytes is not installed")
    source = Path(spec.submodule_search_locations[0], "backends", "cpu", "ops.py").read_text()
    found = re.search(
        r'"(Failed to load CPU gemm_4bit_forward from kernels-community[^"]*)"', source
    )
    assert found, "bitsandbytes no longer logs the kernels warning the CLI drops"
    return found.group(1)


def test_bitsandbytes_kernels_warning_is_dropped_and_nothing_else(caplog):
    template = _bitsandbytes_kernels_warning()
    quiet_third_party_noise()
    quiet_third_party_noise()  # idempotent: one filter
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert len(bnb.filters) == 1
    with caplog.at_level(logging.WARNING):
        bnb.warning(template, ModuleNotFoundError("No module named 'kernels'"))
        bnb.warning("another bitsandbytes warning")
        logging.getLogger("bitsandbytes").warning(template, "elsewhere")
    messages = [r.getMessage() for r in caplog.records]
    assert not any(
        m.startswith("Failed to load CPU gemm_4bit_forward") and "kernels'" in m for m in messages
    )
    assert "another bitsandbytes warning" in messages
    assert sum("Failed to load CPU gemm_4bit_forward" in m for m in messages) == 1  # other logger


def test_no_third_party_noise_at_start(tmp_path):
    """A LoRA run imports peft, and peft bitsandbytes (whose CPU backend logs the warning on
    CPUs with AVX512-BF16)."""
    raw = tiny_config(tmp_path, max_steps=1, adapter={"type": "lora", "r": 4})
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert proc.returncode == 0, proc.stderr
    assert "kernels-community" not in proc.stderr  # bitsandbytes; ProTrain names model.kernels
    assert "gemm_4bit" not in proc.stderr
