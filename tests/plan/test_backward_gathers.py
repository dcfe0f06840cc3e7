"""Which chunks the runtime model gathers in backward: each offloaded chunk from the first
with a trainable parameter, except those still resident from forward. The engine's own
counts are checked against the model in ``tests/engine/test_copy_times.py``; these are the
edges a tiny model does not reach cheaply."""

from __future__ import annotations

import numpy as np
import plan_synthetic as syn
import pytest

from protrain.plan.runtime import RuntimeModel


def _lora_like(n_frozen: int) -> RuntimeModel:
    """Ten chunks; the first ``n_frozen`` hold no trainable parameter (an embedding)."""
    return RuntimeModel(syn.frozen_first(n_frozen), syn.hardware())


@pytest.mark.parametrize(
    ("n_frozen", "n_persist", "n_buffer", "gathered"),
    [
        (0, 0, 3, range(0, 7)),  # full fine-tuning: all but the three resident at the turn
        (1, 0, 3, range(1, 7)),  # the frozen embedding chunk: backward never runs there
        (1, 2, 3, range(2, 7)),  # persistent chunks are not gathered at all
        (2, 0, 9, range(0)),  # what is not resident is frozen
        (10, 0, 3, range(0)),  # nothing trains
        (0, 4, 6, range(0)),  # every offloaded chunk resident at the turn
    ],
)
def test_backward_gathers_the_trainable_span_not_resident(n_frozen, n_persist, n_buffer, gathered):
    rt = _lora_like(n_frozen)
    assert int(rt.backward_gathers(n_persist, n_buffer)) == len(gathered)
    _, terms = rt.step_s(n_persist, n_buffer, 1.0, 0, breakdown=True)
    used = np.asarray(rt.used)
    forward = rt.fwd_in[rt.n_chunks] - rt.fwd_in[n_persist]
    backward = sum(used[i + 1] - used[i] for i in gathered)
    assert terms["h2d_bytes"] == pytest.approx(forward + backward)
    # arrays broadcast, as the search evaluates them
    many = rt.backward_gathers(np.array([n_persist, n_persist]), np.array([n_buffer, n_buffer]))
    assert many.tolist() == [len(gathered)] * 2
