"""A head tied to the input embedding: the chunk table names the chunk it shares, and the
runtime model counts the gathers the engine adds for it ([Note: a tied head] in
``plan/runtime.py``). The engine's own counts are checked against the model in
``tests/engine/test_copy_times.py``; these are the branches and the saved-profile default."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import plan_synthetic as syn
import pytest
import torch

from protrain.plan.runtime import RuntimeModel
from protrain.profile.chunk_table import chunk_table
from protrain.profile.trace import ModelProfile

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import tiny_llama  # noqa: E402


def _profile(n_frozen: int, *, tied: bool = True, after: bool = True) -> ModelProfile:
    """Ten chunks, one module's worth of buffers (``min_buffers`` 1, counted as 2: a block
    over two chunks keeps both); the head shares chunk
    0; the first ``n_frozen`` chunks hold no trainable parameter."""
    p = syn.frozen_first(n_frozen, tied_head_chunk=0 if tied else None)
    return dataclasses.replace(p, head_after_blocks=after)


@pytest.mark.parametrize(
    ("n_frozen", "n_persist", "n_buffer", "again", "gathered"),
    [
        # n_buffer 2 < max(min_buffers, 2) + 2: chunk 0 is evicted in forward and gathered again for
        # the head; resident at the turn with chunk 9, so backward gathers 0-8
        (0, 0, 2, True, range(0, 9)),
        # n_buffer 3: the same; 4: chunk 0 stays through forward and backward, backward
        # gathers 1-6
        (0, 0, 3, True, range(0, 8)),
        (0, 0, 4, False, range(1, 7)),
        # the embedding's chunk frozen (LoRA): backward uses it for the head only, at the
        # turn, where it is resident; it displaces chunk 6 (n_buffer 4) or 8 (n_buffer 2)
        (1, 0, 4, False, range(1, 7)),
        (1, 0, 2, True, range(1, 9)),
        # chunk 0 persistent: nothing more than an untied head
        (0, 1, 3, False, range(1, 7)),
        # every offloaded chunk resident at once: nothing is gathered again
        (0, 0, 10, False, range(0)),
    ],
)
def test_tied_head_gathers(n_frozen, n_persist, n_buffer, again, gathered):
    rt = RuntimeModel(_profile(n_frozen), syn.hardware())
    n = rt.n_chunks
    assert int(rt.forward_gathers(n_persist, n_buffer)) == n - n_persist + again
    assert int(rt.backward_gathers(n_persist, n_buffer)) == len(gathered)
    used = np.asarray(rt.used)
    forward = rt.fwd_in[n] - rt.fwd_in[n_persist] + again * (used[1] - used[0])
    backward = sum(used[i + 1] - used[i] for i in gathered)
    _, terms = rt.step_s(n_persist, n_buffer, 1.0, 0, breakdown=True)
    assert terms["h2d_bytes"] == pytest.approx(forward + backward)
    # arrays broadcast, as the search evaluates them
    many = rt.backward_gathers(np.array([n_persist] * 2), np.array([n_buffer] * 2))
    assert many.tolist() == [len(gathered)] * 2
    fwd = rt.forward_gathers(np.array([n_persist] * 2), np.array([n_buffer] * 2))
    assert fwd.tolist() == [n - n_persist + again] * 2


@pytest.mark.parametrize(("tied", "after"), [(False, True), (True, False)])
def test_untied_or_head_not_last_counts_as_before(tied, after):
    """No tied chunk, or a head that did not run after the last block: each offloaded chunk
    once in forward, backward all but the last ``n_buffer``."""
    rt = RuntimeModel(_profile(0, tied=tied, after=after), syn.hardware())
    assert int(rt.forward_gathers(0, 2)) == 10
    assert int(rt.backward_gathers(0, 2)) == 8


def test_saved_profile_without_the_fields_loads_untied():
    d = _profile(0).to_dict()
    del d["head_after_blocks"], d["chunks"]["tied_head_chunk"]
    p = ModelProfile.from_dict(d)
    assert p.chunks.tied_head_chunk is None and not p.head_after_blocks
    rt = RuntimeModel(p, syn.hardware())
    assert int(rt.forward_gathers(0, 2)) == 10 and int(rt.backward_gathers(0, 2)) == 8
    # and the fields survive a round trip
    q = ModelProfile.from_json(_profile(0).to_json())
    assert q.chunks.tied_head_chunk == 0 and q.head_after_blocks


@pytest.mark.parametrize("tie", [True, False])
def test_chunk_table_names_the_tied_heads_chunk(tie):
    with torch.device("meta"):
        model = tiny_llama.build(tie=tie)
    table = chunk_table(model, compute_dtype=torch.bfloat16, chunk_size_bytes=64 * 1024)
    assert table.n_chunks > 2
    assert table.tied_head_chunk == (0 if tie else None)
