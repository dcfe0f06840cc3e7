"""The per-chunk copy pipeline of the step model (plan/runtime.py, [Note: the copy pipeline]),
against hand-computed cases, the phase rule it refines, and the CPU (where nothing overlaps)."""

from __future__ import annotations

import itertools

import numpy as np
import plan_synthetic as syn
import pytest
from tests.plan.test_runtime_model import h200_like, llama1b_like

from protrain.plan.runtime import RuntimeModel, _pipeline


@pytest.mark.parametrize(("n_buffer", "wait"), [(3, 2.0), (2, 2.5)])
def test_three_chunks_whose_copies_outrun_the_compute(n_buffer, wait):
    """Three offloaded chunks of 1 s copies, first used at 0, 0.5 and 1 s of compute.
    3 buffers: all three gathered from the start, back to back, the last done at 3 s, needed
    at 1 s after 1.5 s of earlier waits (waits 1, then 1.5, then 2 in all). 2 buffers (a
    block over two chunks keeps both, so no gather runs ahead of the compute): the third
    starts once the compute reaches it (at 1 s plus the 1.5 s waited), done at 3.5: 2.5 s."""
    at = np.array([[0.0], [0.5], [1.0]])
    got = _pipeline(
        np.ones(3), at, np.ones((3, 1), bool), np.arange(3)[:, None], np.array([n_buffer])
    )
    assert got == pytest.approx([wait])
    # the phase rule (copies less compute, 3 - 1.5 s with 0.5 s after the last use) is a bound
    assert got[0] >= 3.0 - 1.5


def test_forward_with_every_chunk_in_a_buffer():
    """The 1B-like profile, all three chunks offloaded and as many buffers: every gather
    starts with the forward, one after another (fp32 masters and frozen bytes each), and the
    forward waits for the latest of (copies so far - when its chunk is needed)."""
    p, hw = llama1b_like(), h200_like()
    rt = RuntimeModel(p, hw)
    chunk, trn = p.chunks.used_bytes[0], p.chunks.trainable_numel[0]
    g = (chunk - 2 * trn + 4 * trn) / hw.h2d_bytes_per_s
    block = 0.03 / 16
    needed = np.array([0.0, 0.001 + 5 * block, 0.001 + 11 * block])
    compute_f = 0.031  # pre + the blocks' forward, as traced
    fwd, _ = rt.copy_pipeline_s(0, 3, compute_f, 0.1)
    assert float(fwd) == pytest.approx(max(0.0, *(np.arange(1, 4) * g - needed)))
    # twice the compute: every chunk is needed twice as late
    fwd2, _ = rt.copy_pipeline_s(0, 3, 2 * compute_f, 0.1)
    assert float(fwd2) == pytest.approx(max(0.0, *(np.arange(1, 4) * g - 2 * needed)))


def _terms(rt, n_persist, n_buffer, compute):
    """(the phase rule's breakdown, the pipeline's copy_exposed)."""
    rule = rt.step_s(n_persist, n_buffer, compute, 0, breakdown=True)[1]
    pipe = rt.step_s(n_persist, n_buffer, compute, 0, breakdown=True, copy_pipeline=True)[1]
    return rule, pipe["copy_exposed"]


def test_the_phase_rule_is_a_bound_and_buffers_only_help():
    """Over persistent chunks, buffers and compute: the pipeline's exposed copies are at
    least each phase's copies less its compute, and never grow with more buffers (the
    search's bound and its pruning of smaller n_buffer rely on both)."""
    # frozen chunks (no host stall) and trainable 256 MiB ones (copies past the compute)
    lora = RuntimeModel(syn.frozen_first(10, tied_head_chunk=None), syn.hardware())
    rt = RuntimeModel(syn.profile(12, 10, seed=3, chunk_mib=256), syn.hardware())
    for model, n_p, compute in itertools.product((lora, rt), range(0, 9, 2), (0.01, 0.05, 0.3)):
        last = None
        for nb in range(model.min_buffers + 1, model.n_chunks - n_p + 1):
            rule, piped = _terms(model, n_p, nb, compute)
            assert piped >= rule["copy_exposed"] - 1e-12
            if last is not None:
                assert piped <= last + 1e-12
            last = piped
    # vectorized over candidates as the search passes them: the same as one at a time
    n_p = np.array([0, 2, 4, 6])[None, :]
    nb = np.array([[3, 3, 4, 4], [5, 6, 5, 4]])
    compute = np.array([0.05, 0.3])[:, None]
    many = rt.step_s(n_p, nb, compute, 0, copy_pipeline=True)
    for i, j in np.ndindex(many.shape):
        one = rt.step_s(int(n_p[0, j]), int(nb[i, j]), float(compute[i, 0]), 0, copy_pipeline=True)
        assert many[i, j] == pytest.approx(float(one))
    # counted in the step: the step's copy term is the pipeline's
    rule, piped = _terms(lora, 0, 3, 0.05)
    assert piped > rule["copy_exposed"] == 0  # the first chunk's gather, needed at once
    assert float(lora.step_s(0, 3, 0.05, 0, copy_pipeline=True)) == pytest.approx(
        float(lora.step_s(0, 3, 0.05, 0)) + piped
    )


def test_cpu_keeps_the_phase_rule():
    """On a CPU device copies are synchronous: every copy adds, pipeline or not."""
    p = syn.profile(12, 10, seed=3, chunk_mib=256)
    rt = RuntimeModel(p, syn.hardware("cpu"))
    for n_p, nb in ((0, 3), (4, 2), (2, 8)):
        rule, piped = _terms(rt, n_p, nb, 0.05)
        assert piped == pytest.approx(rule["copy"])
        assert rule["copy_exposed"] == pytest.approx(rule["copy"])
        assert rt.step_s(n_p, nb, 0.05, 0, copy_pipeline=True) == rt.step_s(n_p, nb, 0.05, 0)
