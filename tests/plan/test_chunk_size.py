"""The chunk size as a searched knob: a trace re-read for another chunk size predicts what a
run at that size measures (CPU device, as ``test_memory_model_cpu``), and auto mode picks the
fastest size unless the user fixed it or chunk counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from protrain.plan import Knobs, PlanProblem, PlanRequest, search
from protrain.plan.auto import profile_and_plan
from protrain.plan.chunk_size import chunk_size_candidates, rechunk
from protrain.profile.chunk_table import chunk_table, chunk_table_and_index

sys.path.insert(0, str(Path(__file__).parent.parent / "profile"))
import plan_synthetic as syn  # noqa: E402
import tiny_llama  # noqa: E402
from cpu_runs import measured_peak, model_and_traces  # noqa: E402


@pytest.fixture(scope="module")
def traced():
    return model_and_traces(seed=3)


def test_candidates_hold_the_traced_size_and_the_smallest_layout(traced):
    model, _, persistent, _ = traced
    sizes = chunk_size_candidates(model, persistent)
    assert persistent.chunks.chunk_size_bytes in sizes and sizes == sorted(set(sizes))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert sizes[0] >= largest and sizes[0] < largest + 512  # the smallest that holds it


def test_rechunk_at_the_traced_size_is_the_profile(traced):
    model, _, persistent, _ = traced
    assert rechunk(persistent, model, persistent.chunks.chunk_size_bytes) is persistent


def test_rechunked_table_is_the_models_table_at_that_size(traced):
    model, _, persistent, offloaded = traced
    size = chunk_size_candidates(model, persistent)[0]
    for profile in (persistent, offloaded):
        out = rechunk(profile, model, size)
        dtype = getattr(torch, out.compute_dtype)
        assert out.chunks == chunk_table(model, compute_dtype=dtype, chunk_size_bytes=size)
        assert [n for n, _ in out.grad_order] != [n for n, _ in profile.grad_order]
        assert [m for _, m in out.grad_order] == [m for _, m in profile.grad_order]
        assert profile.chunks.chunk_size_bytes != size  # the original is unchanged


@pytest.mark.parametrize("knobs", [(99, 0, 0, 0), (99, 0, 0, 3), (2, 2, 0, 2), (0, 2, 0, 4),
                                   (1, 3, 0, 0), (0, 2, 0, 0)])  # fmt: skip
def test_rechunked_prediction_matches_a_run_at_that_size(traced, knobs):
    """Predicted from a trace at another chunk size (every chunk persistent, or none), the
    peak of a run at the smallest candidate size: within the memory model's CPU tolerance."""
    model, batch, persistent, offloaded = traced
    size = chunk_size_candidates(model, persistent)[0]
    n_chunks = rechunk(offloaded, model, size).chunks.n_chunks
    knobs = (min(knobs[0], n_chunks), *knobs[1:])
    if knobs[0] == n_chunks:
        knobs = (n_chunks, 0, *knobs[2:])
    measured = measured_peak(model, batch, knobs, size)
    hw = syn.hardware("cpu")
    for profile in (persistent, offloaded):
        problem = PlanProblem(rechunk(profile, model, size), hw, gpu_budget_bytes=1 << 40)
        predicted = problem.evaluate(*knobs)["peak_bytes"]
        err = (predicted - measured) / measured
        assert -0.005 <= err <= 0.02, (profile.trace_n_persist, knobs, err)


def _auto(knobs: Knobs | None = None):
    """Auto mode on the tiny Llama at a 6 MB budget: (plan, problem, model)."""
    model = tiny_llama.build(seed=4)
    request = PlanRequest("6MB", sample_batch=tiny_llama.batch(), knobs=knobs or Knobs())
    plan, problem = profile_and_plan(model, request, device="cpu", hardware=syn.hardware("cpu"))
    return plan, problem, model


def _step_at(problem, model, size: int, fixed: dict | None = None) -> float:
    """The predicted step of the full search at ``size`` (knobs ``fixed`` kept)."""
    at = PlanProblem(
        rechunk(problem.profile, model, size),
        problem.hardware,
        gpu_budget_bytes=6_000_000,
        fixed_knobs=fixed or {},
    )
    return search(at).plan.predicted_step_s


def test_auto_plan_searches_the_chunk_size():
    """A small problem: the full search at every candidate size; the fastest plan wins."""
    plan, problem, model = _auto()
    sizes = chunk_size_candidates(model, problem.profile)
    assert plan.chunk_size_bytes in sizes
    assert any("candidates searched" in r for r in plan.reasons)
    for size in sizes:  # the chosen size is the fastest of them by the model's prediction
        assert _step_at(problem, model, size) >= plan.predicted_step_s - 1e-12


@pytest.mark.parametrize("asked", [False, True])
def test_protrain_wrap_asks_the_search_for_device_steps_only_when_told(monkeypatch, asked):
    """``protrain.wrap(device_step_search=True)`` reaches every problem the search solves
    (through profile_and_plan, the loss chunks and the chunk sizes); by default none asks."""
    import protrain
    import protrain.plan.chunk_size as chunk_size

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("device_step_search", False))
        return PlanProblem(*args, **kwargs)

    monkeypatch.setattr(chunk_size, "PlanProblem", recording)
    protrain.wrap(tiny_llama.build(seed=4), gpu_budget=1 << 30, sample_batch=tiny_llama.batch(),
                  device="cpu", device_step_search=asked)  # fmt: skip
    assert seen and all(s is asked for s in seen)


def test_device_step_search_without_a_budget_is_refused():
    import protrain

    with pytest.raises(ValueError, match="device_step_search=True is read only by the planner"):
        protrain.wrap(tiny_llama.build(), device="cpu", device_step_search=True)


def test_a_large_problem_screens_the_sizes_without_swap(monkeypatch):
    """Above the work bound every size is screened by a search without swap, and the full
    search runs at the size that screened fastest."""
    monkeypatch.setattr("protrain.plan.chunk_size._FULL_SEARCH_CELLS", 0)
    plan, problem, model = _auto()
    assert any("candidates screened without swap" in r for r in plan.reasons)
    sizes = chunk_size_candidates(model, problem.profile)
    screened = {size: _step_at(problem, model, size, {"n_swap": 0}) for size in sizes}
    assert screened[plan.chunk_size_bytes] == min(screened.values())
    full = search(PlanProblem(problem.profile, problem.hardware, gpu_budget_bytes=6_000_000))
    assert full.plan.knobs == plan.knobs  # the full search at the chosen size


def test_a_fixed_n_swap_gets_the_full_search_at_every_size(monkeypatch):
    monkeypatch.setattr("protrain.plan.chunk_size._FULL_SEARCH_CELLS", 0)
    plan, problem, model = _auto(Knobs(n_swap=1))
    assert plan.n_swap == 1
    assert any("candidates searched" in r for r in plan.reasons)
    for size in chunk_size_candidates(model, problem.profile):
        assert _step_at(problem, model, size, {"n_swap": 1}) >= plan.predicted_step_s - 1e-12


@pytest.mark.parametrize("knobs", [Knobs(chunk_size_bytes=300_000), Knobs(n_persist=1)])
def test_auto_plan_keeps_a_given_chunk_size_or_chunk_count(knobs):
    plan, problem, _ = _auto(knobs)
    assert plan.chunk_size_bytes == problem.profile.chunks.chunk_size_bytes
    assert not any("candidates" in r for r in plan.reasons)
    if knobs.chunk_size_bytes is not None:
        assert plan.chunk_size_bytes == 300_000


def test_the_work_bound_counts_the_pairs_the_search_evaluates():
    from protrain.plan.chunk_size import _n_pairs

    assert _n_pairs(28, {}) == 29 * 30 // 2
    assert _n_pairs(10, {"n_checkpoint": 4}) == 7  # n_swap 0..6
    assert _n_pairs(10, {"n_swap": 2, "n_checkpoint": 9}) == 0


def test_a_large_problem_that_needs_swap_screens_the_sizes_at_a_few_swap_counts(monkeypatch):
    """Where no size has a plan without swap (made so here: any plan without swap is
    refused), the sizes are screened at swap counts of an eighth to half of the blocks,
    and the full search runs only at the size that screened fastest."""
    import protrain.plan.chunk_size as cs

    monkeypatch.setattr(cs, "_FULL_SEARCH_CELLS", 0)
    real = cs.search
    full_searches = []

    def needs_swap(problem):
        n_swap = problem.fixed.get("n_swap")
        if n_swap == 0:
            raise cs.NoPlanFits("no plan without swap (test)", None)
        if n_swap is None:
            full_searches.append(problem.profile.chunks.chunk_size_bytes)
        return real(problem)

    monkeypatch.setattr(cs, "search", needs_swap)
    plan, problem, model = _auto()
    assert len(full_searches) == 1 and plan.chunk_size_bytes == full_searches[0]
    assert any("screened at swap [1, 2]" in r for r in plan.reasons), plan.reasons


def _table_from_layout(model, dtype, size):
    """The table and chunk of every name read from the layout protrain.wrap would build
    (plan_layout's placements)."""
    from protrain.chunks.layout import params_in_order, plan_layout

    layout = plan_layout(params_in_order(model), compute_dtype=dtype, device=torch.device("meta"),
                         n_persist=0, n_buffer=None, chunk_size_bytes=size)  # fmt: skip
    rows = []
    for c in layout.chunks:
        tr = [pl for pl in c.placements if pl.trainable]
        rows.append((c.used_bytes, sum(pl.numel for pl in tr), sum(pl.nbytes for pl in tr),
                     len(tr), max((pl.numel for pl in tr), default=0)))  # fmt: skip
    chunk_of = {n: pl.chunk for c in layout.chunks for pl in c.placements for n in pl.names}
    return rows, chunk_of


@pytest.mark.parametrize("kind", ["full", "lora", "tied", "qlora"])
def test_chunk_table_is_the_layouts_table(kind):
    """The planner's table (packed over arrays) is the one the engine's layout gives, at
    several sizes: full fine-tuning, LoRA (frozen and trainable tensors mixed), tied
    embeddings (one parameter under two names), 4-bit bases (uint8 weights, fp32 scales that
    keep their dtype)."""
    import peft

    from protrain.chunks.layout import storage_dtype

    model = tiny_llama.build(tie=kind == "tied")
    if kind == "qlora":
        from protrain.quant import quantize_linear_4bit

        quantize_linear_4bit(model, compute_dtype=torch.float32)
    if kind in ("lora", "qlora"):
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    for dtype in (torch.float32, torch.bfloat16):
        sizes = [p.numel() * storage_dtype(p, dtype).itemsize for p in model.parameters()]
        for size in (max(sizes), max(sizes) + 4096, 3 * max(sizes), sum(sizes) + 64):
            table, chunk_of = chunk_table_and_index(model, compute_dtype=dtype,
                                                    chunk_size_bytes=size)  # fmt: skip
            got = list(zip(table.used_bytes, table.trainable_numel, table.trainable_bytes,
                           table.trainable_tensors, table.max_trainable_numel))  # fmt: skip
            assert (got, chunk_of) == _table_from_layout(model, dtype, size)
    for bad in (max(sizes) - 1, float(10 * max(sizes)), True):
        with pytest.raises(ValueError, match="too small"):
            chunk_table(model, compute_dtype=torch.bfloat16, chunk_size_bytes=bad)


def test_param_index_arrays_are_a_read_only_snapshot():
    from protrain.profile.param_index import param_index

    model = tiny_llama.build()
    index = param_index(model)
    numel, nbytes, trainable = index.arrays(torch.bfloat16)
    assert nbytes.tolist() == [2 * p.numel() for _, p in index.params] and trainable.all()
    assert index.arrays(torch.bfloat16)[0] is numel  # read once per dtype
    assert index.arrays(torch.float32)[1].tolist() == [4 * n for n in numel.tolist()]
    with pytest.raises(ValueError):
        numel[0] = 0  # callers cannot change what later callers read
    next(model.parameters()).requires_grad_(False)
    assert not param_index(model).arrays(torch.bfloat16)[2][0]  # a new index sees the change
