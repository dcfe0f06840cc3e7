"""The memory model's per-segment evaluation against the per-interval formula it replaced,
and the search's lower bound against the exact peak, on a profile whose backward is cut
several times per block (as a LoRA model's is, at every gradient accumulation)."""

from __future__ import annotations

import dataclasses

import numpy as np
import plan_synthetic as syn
import pytest

from protrain.plan import PlanProblem
from protrain.plan.memory import KEEP, SWAP, MemoryModel, policy_matrix
from protrain.plan.search import _peak_lower_bound


def cut_backward(profile, pieces: int = 3, seed: int = 0):
    """Each backward interval split into ``pieces`` with their own peaks, and the gradient
    order split so that each piece has accumulated one more gradient than the one before."""
    rng = np.random.default_rng(seed)
    order = [(c, n // pieces) for c, n in profile.grad_order for _ in range(pieces)]
    intervals = []
    for iv in profile.intervals:
        if iv.kind != "bwd":
            intervals.append(iv)
            continue
        for j in range(pieces):
            peak = int(iv.peak_bytes * rng.uniform(0.6, 1.1))
            intervals.append(
                dataclasses.replace(iv, peak_bytes=peak, grads_done=pieces * iv.grads_done + j)
            )
    return dataclasses.replace(profile, intervals=intervals, grad_order=order)


def per_interval_peaks(mem: MemoryModel, pol: np.ndarray, n_persist: int) -> np.ndarray:
    """The formula before segments: every interval evaluated for every policy row."""
    keep, swap = pol == KEEP, pol == SWAP
    delta = np.where(keep, mem.saved - mem.inp, 0) + np.where(swap, -mem.inp, 0)
    before = np.concatenate([np.zeros((len(pol), 1), np.int64), np.cumsum(delta, 1)], 1)
    own = (keep | swap)[:, mem.iv_own]
    own_extra = np.where(mem.is_fwd, mem.fwd_keep_extra[mem.iv_own], mem.bwd_keep_extra[mem.iv_own])
    in_flight = np.where(swap, mem.saved, 0).max(axis=1, initial=0)[:, None]
    blockwise = mem.is_fwd | mem.is_bwd
    out = mem.iv_base + before[:, mem.iv_prefix]
    out = out + np.where(own & blockwise, own_extra, 0) + np.where(blockwise, in_flight, 0)
    return (out + mem.grads[:, n_persist][None, :]).max(axis=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segments_give_the_per_interval_peaks_and_a_valid_bound(seed):
    prof = cut_backward(syn.profile(n_blocks=6, n_chunks=8, seed=seed), seed=seed)
    mem = MemoryModel(prof)
    assert len(mem.seg_base) < len(mem.iv_base)  # the cut backward merged into segments
    b = mem.n_blocks
    s, c = map(np.asarray, zip(*[(s, c) for s in range(b + 1) for c in range(b + 1 - s)]))
    pol = policy_matrix(b, s, c)
    seg = mem.segment_activations(pol)
    n_p = np.arange(mem.n_chunks + 1)
    exact = np.stack([mem.peak_over_persist(row, n_p) for row in seg])  # pairs x n_persist
    for n in n_p:
        want = per_interval_peaks(mem, pol, int(n))
        assert np.array_equal(mem.activation_peak(s, c, int(n)), want)
        assert np.array_equal(exact[:, n], want)
    assert (_peak_lower_bound(mem, seg, n_p) <= exact).all()


def test_with_fixed_shares_the_models_and_keeps_the_original():
    problem = PlanProblem(
        syn.profile(n_blocks=4, n_chunks=5), syn.hardware(), gpu_budget_bytes=1 << 34
    )
    other = problem.with_fixed({"n_swap": 0, "n_buffer": None})
    assert other.fixed == {"n_swap": 0} and problem.fixed == {}
    assert other.memory is problem.memory and other.runtime is problem.runtime
    with pytest.raises(ValueError, match="not knobs"):
        problem.with_fixed({"n_swaps": 1})
    with pytest.raises(ValueError, match="n_swap=9"):
        problem.with_fixed({"n_swap": 9})
