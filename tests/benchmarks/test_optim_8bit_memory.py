"""benchmarks/optim_8bit_memory.py on the CPU with the tiny Llama: its rows, and the memory
model's count never below the state the optimizers made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytest.importorskip("bitsandbytes")


def test_tiny_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCH / "optim_8bit_memory.py"), "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    fp32, q, saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert (fp32["optimizer"], q["optimizer"]) == ("adamw", "adamw_8bit")
    assert fp32["planned_bytes"] == fp32["state_bytes"]  # torch's state: counted exactly
    assert q["state_bytes"] <= q["planned_bytes"] <= fp32["planned_bytes"]
    assert q["state_bytes"] < fp32["state_bytes"]
    assert saved["saved_state_bytes"] == fp32["state_bytes"] - q["state_bytes"]
