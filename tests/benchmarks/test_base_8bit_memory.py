"""benchmarks/base_8bit_memory.py on the CPU with the tiny Llama: its rows, the planner's
split of the chunks' bytes against the quantized formats' sizes, and the chunk manager's
buffers against the planner's count."""

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
        [sys.executable, str(BENCH / "base_8bit_memory.py"), "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["base"] for r in rows] == ["bf16", "int8", "nf4"]
    bf16, int8, nf4 = rows
    numel, n_rows = bf16["projection_params"], bf16["projection_rows"]
    assert bf16["projection_layers"] == 2 * 7  # every projection of the 2 blocks, LoRA's
    for r in rows:
        # the same model around the base: adapters, embeddings, norms
        for key in ("projection_params", "projection_rows", "planned_trainable_bytes",
                    "planned_other_frozen_bytes", "planned_optimizer_bytes", "master_bytes",
                    "optimizer_state_bytes"):  # fmt: skip
            assert r[key] == bf16[key], key
        parts = (r["planned_projection_weight_bytes"] + r["planned_quant_state_bytes"]
                 + r["planned_other_frozen_bytes"])  # fmt: skip
        assert r["planned_frozen_bytes"] == parts
        assert r["planned_used_bytes"] == parts + r["planned_trainable_bytes"]
        assert r["planned_chunk_bytes"] == r["n_chunks"] * r["chunk_size_bytes"]
        assert r["planned_used_bytes"] <= r["planned_chunk_bytes"]
        # the chunk manager's buffers are what the planner counts; torch's AdamW exactly
        assert r["measured_by"] == "chunk_buffers"
        assert r["chunk_buffer_bytes"] == r["planned_chunk_bytes"]
        assert r["master_bytes"] == 2 * r["planned_trainable_bytes"]  # fp32 of bf16
        assert r["states_buffer_bytes"] == r["planned_states_bytes"] == r["measured_states_bytes"]
        assert (
            r["saved_vs_bf16_planned_bytes"]
            == bf16["planned_states_bytes"] - r["planned_states_bytes"]
        )
        assert (
            r["saved_vs_bf16_measured_bytes"]
            == bf16["measured_states_bytes"] - r["measured_states_bytes"]
        )
    assert bf16["planned_projection_weight_bytes"] == 2 * numel
    assert bf16["planned_quant_state_bytes"] == 0
    # LLM.int8: one byte a weight, an fp32 scale a row: about half of bf16's frozen bytes
    assert int8["planned_projection_weight_bytes"] == numel
    assert int8["planned_quant_state_bytes"] == 4 * n_rows
    # NF4: half a byte a weight; a uint8 scale a block of 64 and, double quantized, an fp32
    # scale a block of 256 of those (one per tiny layer: each has at most 128 blocks)
    assert nf4["planned_projection_weight_bytes"] == numel // 2
    assert nf4["planned_quant_state_bytes"] == numel // 64 + 4 * bf16["projection_layers"]
    assert bf16["planned_used_bytes"] - int8["planned_used_bytes"] == numel - 4 * n_rows
    assert 0 < int8["saved_vs_bf16_planned_bytes"] < nf4["saved_vs_bf16_planned_bytes"]
