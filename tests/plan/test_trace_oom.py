"""The trace never runs out of memory: the logits are budgeted and an OOM is retried."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

import protrain.plan.auto as auto
from protrain.plan import PlanRequest
from protrain.plan.search import NoPlanFits

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import tiny_llama  # noqa: E402


def test_full_logits_bytes_from_the_config():
    model = tiny_llama.build()
    vocab = model.config.vocab_size
    assert auto.full_logits_bytes(model, 4, 2048, torch.bfloat16) == 4 * 2048 * vocab * 6


def test_logits_come_out_of_the_trace_budget(monkeypatch):
    model, batch = tiny_llama.build(), tiny_llama.batch()
    seen = []
    monkeypatch.setattr(
        auto, "trace_model", lambda m, b, *, knobs, **kw: seen.append(knobs.n_persist)
    )
    big = 1 << 40
    auto.profile_model(model, PlanRequest(big, sample_batch=batch), device="cpu")
    logits = auto.full_logits_bytes(model, *batch["input_ids"].shape, torch.float32)
    auto.profile_model(model, PlanRequest(2 * logits, sample_batch=batch), device="cpu")
    assert seen == [None, 0]  # everything fits; the budget's half is all logits: none


def test_trace_that_runs_out_of_memory_retries_offloaded(monkeypatch, caplog):
    model, batch = tiny_llama.build(), tiny_llama.batch()
    calls = []

    def fake_trace(m, b, *, knobs, **kw):
        n_persist = knobs.n_persist
        calls.append(n_persist)
        if n_persist != 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB.")
        return profile

    profile = types.SimpleNamespace(notes=[])
    monkeypatch.setattr(auto, "trace_model", fake_trace)
    with caplog.at_level(logging.WARNING, logger="protrain.plan.auto"):
        assert (
            auto.profile_model(model, PlanRequest(1 << 40, sample_batch=batch), device="cpu")
            is profile
        )
    assert calls == [None, 0]
    assert "retrying with every chunk offloaded" in caplog.text
    assert "3.91 GiB" in caplog.text
    # the profile says it is the second trace, and what the first cost (the plan counts both)
    (note,) = profile.notes
    assert note.startswith("traced with every chunk offloaded after the trace with "
                           "n_persist=all ran out of memory in ")  # fmt: skip
    assert note.endswith(" s (CUDA out of memory. Tried to allocate 3.91 GiB.)")


@pytest.mark.parametrize("budget", [0, 1 << 40])
def test_trace_out_of_memory_with_everything_offloaded_is_no_plan(monkeypatch, budget):
    calls = []

    def fake_trace(m, b, *, knobs, **kw):
        n_persist = knobs.n_persist
        calls.append(n_persist)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB.")

    monkeypatch.setattr(auto, "trace_model", fake_trace)
    with pytest.raises(NoPlanFits) as err:
        request = PlanRequest(budget, sample_batch=tiny_llama.batch())
        auto.profile_model(tiny_llama.build(), request, device="cpu")
    assert calls == ([0] if budget == 0 else [None, 0])
    text = str(err.value)
    assert "every chunk offloaded" in text and "7.83 GiB" in text
    assert "chunked_loss_tokens" in text  # the plain loss's logits are named as the way out
    assert err.value.smallest_budget_bytes is None


def test_app_message_for_a_trace_out_of_memory_keeps_the_planners_advice():
    from protrain.train.planning import no_plan_fits_message

    class Settings:
        request = PlanRequest(16 << 30)

    exc = NoPlanFits("the traced step ran out of memory ...; give a larger budget.", None)
    text = no_plan_fits_message(exc, Settings())
    assert text.startswith("memory.gpu_budget = 16.00GiB: the traced step ran out of memory")
    assert "at any budget" not in text
