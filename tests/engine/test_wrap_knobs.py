"""`protrain.wrap` with activation knobs and with a GPU budget (the plan chooses the rest)."""

import copy

import pytest
import torch

import protrain
from protrain.plan import Plan

from .models import batches, build, lora
from .test_equivalence import LR, WD, train_engine, train_plain


def _assert_same(model, reference, losses, ref_losses, atol=1e-5):
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=atol, rtol=0, msg=name)


def _refused_and_untouched(match: str, **wrap_kwargs) -> None:
    """``protrain.wrap`` refuses these arguments with ``match`` and leaves the model as it
    was: no engine attached, every parameter unchanged."""
    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        protrain.wrap(model, **wrap_kwargs)
    assert getattr(model, "_protrain_engine", None) is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_activation_knobs_in_wrap_keep_the_math(mode):
    data = batches("llama", 6)
    base = build("llama")
    if mode == "lora":
        base = lora(base, "llama")
    reference = copy.deepcopy(base)
    ref_losses, _ = train_plain(reference, data)
    model = copy.deepcopy(base)
    model, opt, _ = protrain.wrap(
        model, n_persist=0, device="cpu", lr=LR, weight_decay=WD,
        n_swap=1, n_checkpoint=1, offload_checkpoint=True, tiled_mlp_tokens=8,
    )  # fmt: skip
    assert model._protrain_engine.activations is not None
    losses, _ = train_engine(model, data, opt)
    _assert_same(model, reference, losses, ref_losses)
    protrain.close(model)
    assert getattr(model, "_protrain_activations", None) is None
    blocks = model.get_base_model().model.layers if mode == "lora" else model.model.layers
    assert "forward" not in vars(blocks[0])  # the block's own forward is back


def test_activation_knobs_checked_before_anything_moves():
    _refused_and_untouched(
        "more than the model's", n_persist=0, device="cpu", n_swap=5, n_checkpoint=5
    )


def test_gpu_budget_chooses_the_missing_knobs_and_keeps_the_math():
    data = batches("llama", 6)
    base = build("llama")
    reference = copy.deepcopy(base)
    ref_losses, _ = train_plain(reference, data)
    model = copy.deepcopy(base)
    model, opt, layout = protrain.wrap(
        model, device="cpu", lr=LR, weight_decay=WD,
        gpu_budget="64MiB", sample_batch=data[0], n_checkpoint=1,
    )  # fmt: skip
    plan = protrain.plan_of(model)
    assert isinstance(plan, Plan)
    assert plan.n_checkpoint == 1  # the fixed knob is kept
    assert layout.n_persist == plan.n_persist
    assert plan.predicted_peak_bytes <= 64 * 2**20
    losses, _ = train_engine(model, data, opt)
    _assert_same(model, reference, losses, ref_losses)
    protrain.close(model)


def test_gpu_budget_needs_a_sample_batch():
    with pytest.raises(ValueError, match="sample_batch"):
        protrain.wrap(build("llama"), device="cpu", gpu_budget="64MiB")


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_bad_host_threads_is_refused_before_anything_moves(bad):
    _refused_and_untouched(
        "host_threads=.* is not allowed: use an integer >= 1",
        n_persist=0,
        device="cpu",
        host_threads=bad,
    )


def test_host_threads_keeps_the_math():
    data = batches("llama", 6)
    base = build("llama")
    reference = copy.deepcopy(base)
    ref_losses, _ = train_plain(reference, data)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu", host_threads=1
    )
    losses, _ = train_engine(model, data, optimizer)
    _assert_same(model, reference, losses, ref_losses)
    protrain.close(model)


@pytest.mark.parametrize("clipping", [True, False])
def test_gpu_budget_plans_for_the_clipping_schedule_asked_for(monkeypatch, clipping):
    import protrain.planned_wrap as planned_wrap

    seen = {}
    real = planned_wrap.profile_and_plan

    def spy(model, request, **kw):
        seen["clipping"] = request.clipping
        return real(model, request, **kw)

    monkeypatch.setattr(planned_wrap, "profile_and_plan", spy)
    data = batches("llama", 1)
    model, _, _ = protrain.wrap(
        build("llama"), device="cpu", gpu_budget="64MiB", sample_batch=data[0], clipping=clipping
    )
    assert seen["clipping"] is clipping
    protrain.close(model)


def test_the_engine_knows_no_planner():
    """The engine's wrap takes knobs only and importing it loads no planner; protrain.wrap
    (plan, then wrap) keeps the budget arguments."""
    import inspect
    import subprocess
    import sys

    import protrain.engine as engine

    code = "import sys, protrain.engine; print(sorted(m for m in sys.modules if 'plan' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    own = inspect.signature(engine.wrap).parameters
    assert not {"gpu_budget", "cpu_budget", "sample_batch", "loss_fn"} & set(own)
    assert "request" in inspect.signature(protrain.wrap).parameters
    from protrain.planned_wrap import from_keywords

    asked = {"gpu_budget": "1GiB", "cpu_budget": 2, "sample_batch": {}, "clipping": False}
    _, _, request = from_keywords({**asked, "loss_fn": len, "n_persist": 1})
    assert (request.gpu_budget_bytes, request.cpu_budget_bytes) == (1 << 30, 2)
    assert (request.clipping, request.loss_fn, request.knobs.n_persist) == (False, len, 1)
