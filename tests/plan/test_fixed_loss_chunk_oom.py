"""A trace that runs out of memory with the loss chunk fixed by the user: the one error names
`memory.chunked_loss_tokens`, what it holds, and what is allowed instead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import protrain.plan.auto as auto
from protrain.plan import PlanRequest
from protrain.plan.loss_chunk import LOSS_CHUNK_FLOOR_TOKENS
from protrain.plan.search import NoPlanFits
from protrain.train.errors import ConfigError
from protrain.train.planning import PlanSettings, plan_memory, planner_loss

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import tiny_llama  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def trace_out_of_memory(monkeypatch):
    def fake_trace(m, b, *, knobs, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB.")

    monkeypatch.setattr(auto, "trace_model", fake_trace)


def _batch(positions: int) -> dict:
    ids = torch.zeros(1, positions, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def test_the_app_error_names_the_fixed_loss_chunk(trace_out_of_memory):
    model = tiny_llama.build()
    vocab = model.config.vocab_size
    settings = PlanSettings(CPU, torch.float32, PlanRequest(12 << 30, 1 << 40),
                            chunked_loss_tokens=4096)  # fmt: skip
    with pytest.raises(ConfigError) as err:
        plan_memory(model, _batch(9216), settings)
    text = str(err.value)
    gib = 4096 * vocab * 8 / 2**30  # fp32 logits and their fp32 gradient
    assert text.startswith("memory.gpu_budget = 12.00GiB: the traced step ran out of memory "
                           "with every chunk offloaded and every block checkpointed")  # fmt: skip
    # the knob before the allocator's text (CUDA's runs to hundreds of characters)
    assert text.index("memory.chunked_loss_tokens=4096") < text.index("Tried to allocate 2.32 GiB")
    assert (f"The loss chunk is fixed: memory.chunked_loss_tokens=4096 holds 4,096 x {vocab:,} "
            f"logits, {gib:.2f} GiB as fp32 with their gradient") in text  # fmt: skip
    assert f"a smaller value (at least {LOSS_CHUNK_FLOOR_TOKENS}, " in text
    assert "or leave it unset so that the planner chooses the chunk" in text
    assert text.count("every chunk offloaded") == 1  # one message, the knob inside it
    assert "full-sequence logits of a plain loss" not in text


def test_a_fixed_chunk_at_the_floor_is_named_but_not_advised_smaller(trace_out_of_memory):
    model = tiny_llama.build()
    with pytest.raises(NoPlanFits) as err:
        request = PlanRequest(1 << 40, sample_batch=_batch(600), loss_fn=planner_loss(CPU, 1024),
                              fixed_loss_chunk_tokens=1024)  # fmt: skip
        auto.profile_model(model, request, device="cpu")
    text = str(err.value)
    # the chunk holds no more than the micro-batch's positions
    assert f"memory.chunked_loss_tokens=1024 holds 600 x {model.config.vocab_size:,} logits" in text
    assert (
        f"no more than the smallest chunk the planner searches ({LOSS_CHUNK_FLOOR_TOKENS})" in text
    )
    assert "a smaller value" not in text and err.value.smallest_budget_bytes is None
