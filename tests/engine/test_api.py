"""The engine's API: knobs, state dicts, close, wrap twice, schedulers, checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR, MAX_NORM, WD, train_engine, train_plain


def _wrap(model, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("lr", LR)
    kw.setdefault("weight_decay", WD)
    return protrain.wrap(model, **kw)


def test_layout_describes_chunks():
    model, opt, layout = _wrap(build("gpt2"), n_persist=1, n_buffer=2)
    assert layout.n_persist == 1 and layout.n_buffer == 2 and layout.n_chunks >= 3
    names = [n for c in layout.chunks for pl in c.placements for n in pl.names]
    # tied embedding: placed once, under both names
    assert "transformer.wte.weight" in names and "lm_head.weight" in names
    placed = sum(len(c.placements) for c in layout.chunks)
    assert placed == len(list(model.parameters()))
    for c in layout.chunks:
        assert c.used_bytes <= layout.chunk_size_bytes
    text = str(layout)
    assert "n_persist=1" in text and "chunk   0 persistent" in text
    protrain.close(model)


@pytest.mark.parametrize(
    "knobs, word",
    [
        ({"n_persist": -1}, "n_persist=-1"),
        ({"n_persist": 10_000}, "n_persist=10000"),
        ({"n_persist": 0, "n_buffer": 1}, "n_buffer=1"),
        ({"n_persist": 0, "n_buffer": -3}, "n_buffer=-3"),
        ({"chunk_size_bytes": 100}, "chunk_size_bytes=100"),
        ({"compute_dtype": torch.float64}, "compute_dtype"),
        ({"compute_dtype": torch.float16, "loss_scaling": {"growth_factor": 3.0}}, "growth_factor"),
        ({"loss_scaling": {"init_scale": 1024.0}}, "loss_scaling"),
    ],
)
def test_bad_knobs_raise_before_anything_moves(knobs, word):
    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=word.replace("(", r"\(")):
        _wrap(model, **knobs)
    assert not hasattr(model, "_protrain_engine")
    for n, p in model.named_parameters():
        assert p.data_ptr() == ptrs[n]
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)


def test_wrap_twice_is_an_error_and_wrap_after_close_works():
    model, opt, _ = _wrap(build("llama"), n_persist=1)
    with pytest.raises(RuntimeError, match="already wrapped"):
        _wrap(model)
    protrain.close(model)
    model, opt, _ = _wrap(model, n_persist=0)
    opt.close()  # the same as protrain.close(model)
    with pytest.raises(RuntimeError, match="not wrapped"):
        protrain.close(model)


def test_close_leaves_a_plain_model_with_the_trained_values():
    data = batches("llama", 6)
    base = build("llama")
    reference = copy.deepcopy(base)
    train_plain(reference, data)
    model = copy.deepcopy(base)

    def n_hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    n_hooks_before = n_hooks()
    model, opt, _ = _wrap(model, n_persist=1)
    assert n_hooks() > n_hooks_before
    train_engine(model, data, opt)
    protrain.close(model)
    assert n_hooks() == n_hooks_before
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
        assert p.dtype == torch.float32 and p.grad is None
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], ref, atol=1e-6, rtol=0)
    # and it trains as a plain module
    b = data[0]
    model(**b).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_state_dict_round_trip_resumes_exactly():
    """Train 3 steps; save model and optimizer; train 3 more. A fresh wrap loaded from the
    save and trained the same 3 steps ends at the same parameters."""
    data = batches("qwen2", 12)
    model, opt, _ = _wrap(build("qwen2"), n_persist=1)
    train_engine(model, data[:6], opt)
    saved_model = protrain.state_dict(model)
    saved_opt = copy.deepcopy(opt.state_dict())
    assert all(t.device.type == "cpu" for s in saved_opt["state"].values() for t in s.values())
    train_engine(model, data[6:], opt)
    final = protrain.state_dict(model)
    protrain.close(model)

    fresh, opt2, _ = _wrap(build("qwen2", seed=7), n_persist=2)
    protrain.load_state_dict(fresh, saved_model)
    opt2.load_state_dict(saved_opt)
    sd2 = opt2.state_dict()
    for i, st in saved_opt["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(sd2["state"][i][k], v, rtol=0, atol=0)
    train_engine(fresh, data[6:], opt2)
    for name, value in protrain.state_dict(fresh).items():
        torch.testing.assert_close(value, final[name], atol=1e-6, rtol=0, msg=name)
    protrain.close(fresh)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_state_dicts_without_copies_are_views_of_the_engines_memory(mode):
    """copy=False (what a checkpoint save uses): the same values, and what lives on the host
    in its own dtype is the engine's tensor itself (offloaded masters, frozen host weights,
    the host AdamW's moments), so a save holds no second copy of the model states."""
    base = lora(build("llama"), "llama") if mode == "lora" else build("llama")
    data = batches("llama", 12)  # train_engine's steps of ACCUM micro-batches
    model, opt, _ = _wrap(base, n_persist=1)
    train_engine(model, data, opt)
    manager = model._protrain_engine.manager
    host = {id(s.param): s for c in manager.offloaded for s in c.slots}
    names = {id(p): n for n, p in model.named_parameters()}
    copied, viewed = protrain.state_dict(model), protrain.state_dict(model, copy=False)
    assert copied.keys() == viewed.keys()
    some = sorted(copied)[:3]
    assert sorted(protrain.state_dict(model, copy=False, names=some)) == some
    shared = 0
    for pid, s in host.items():
        name = names[pid]
        torch.testing.assert_close(viewed[name], copied[name], atol=0, rtol=0)
        own = s.master if s.master is not None else s.host_view
        assert viewed[name].data_ptr() == own.data_ptr()
        assert copied[name].data_ptr() != own.data_ptr()
        shared += 1
    assert shared > 0
    ours, views = opt.state_dict(), opt.state_dict(copy=False)
    moments = 0
    for i, st in views["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(v, ours["state"][i][k], atol=0, rtol=0)
            moments += torch.is_tensor(v) and v.dim() > 0
    host_moments = {
        t.data_ptr()
        for opts in opt._host_opts.values()
        for o in opts
        for st in o.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    }
    assert moments and host_moments
    assert host_moments <= {v.data_ptr() for st in views["state"].values() for v in st.values()}
    protrain.close(model)


def test_optimizer_state_dict_matches_torch_layout():
    data = batches("llama", 2)
    base = build("llama")
    reference = copy.deepcopy(base)
    params = list(reference.parameters())
    ref_opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    for b in data:
        (reference(**b).loss / ACCUM).backward()
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    ref_opt.step()
    model, opt, _ = _wrap(copy.deepcopy(base), n_persist=2)
    for b in data:
        (model(**b).loss / ACCUM).backward()
    opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    assert [g["params"] for g in ours["param_groups"]] == [
        g["params"] for g in theirs["param_groups"]
    ]
    for i in theirs["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                ours["state"][i][k], theirs["state"][i][k], atol=1e-6, rtol=0
            )
    protrain.close(model)


def test_lr_scheduler_and_param_groups():
    """Two groups (decay / no decay) with a LambdaLR schedule, as a training loop sets them."""
    data = batches("mistral", 6)
    base = build("mistral")

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    def schedule(step):
        return 0.5**step

    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(groups(reference), lr=LR, fused=True)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    model, opt, _ = _wrap(copy.deepcopy(base), n_persist=1, param_groups=None)
    protrain.close(model)
    model = copy.deepcopy(base)
    model, opt, _ = _wrap(model, n_persist=1, param_groups=groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(3):
        for mb in range(ACCUM):
            b = data[step * ACCUM + mb]
            (reference(**b).loss / ACCUM).backward()
            (model(**b).loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        opt.clip_grad_norm_(MAX_NORM)
        ref_opt.step(), opt.step()
        ref_sched.step(), sched.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    protrain.close(model)


def test_param_group_errors():
    model = build("llama")
    some = [p for p in model.parameters()][:2]
    with pytest.raises(ValueError, match="in no parameter group"):
        _wrap(model, param_groups=[{"params": some}])
    every = list(model.parameters())
    for flag, value in (("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", False)):
        with pytest.raises(ValueError, match=rf"param_groups\[0\] sets {flag}={value}"):
            _wrap(model, param_groups=[{"params": every, flag: value}])
    _, opt, _ = _wrap(model, param_groups=[{"params": every, "maximize": False}])
    opt.close()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_activation_checkpointing_and_smallest_pool(mode):
    """HF gradient checkpointing recomputes blocks in backward: chunks are gathered again.
    The smallest pool with nothing persistent makes every chunk move, many times (LoRA
    blocks hold frozen chunks together: chunks.buffers.min_resident_chunks)."""
    data = batches("llama", 6)
    base = build("llama")
    if mode == "lora":
        base = lora(base, "llama")
    reference = copy.deepcopy(base)
    ref_losses, _ = train_plain(reference, data)
    model = copy.deepcopy(base)
    model.gradient_checkpointing_enable()
    model, opt, layout = _wrap(model, n_persist=0, n_buffer=2 if mode == "full" else 3)
    losses, _ = train_engine(model, data, opt)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    assert model._protrain_engine.manager.stats["gathers"] > layout.n_chunks * 6
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    protrain.close(model)


def test_eval_forward_under_no_grad_and_frozen_params_have_no_state():
    model, opt, layout = _wrap(lora(build("llama"), "llama"), n_persist=1)
    with torch.no_grad():
        out = model(**batches("llama", 1)[0])
    assert torch.isfinite(out.loss)
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    train_engine(model, batches("llama", 6), opt)
    assert len(opt.state_dict()["state"]) == n_trainable
    protrain.close(model)


def test_lora_pool_below_what_a_block_holds_is_refused_before_anything_moves():
    """LoRA: a block's frozen chunks are held together in its backward. A pool smaller than
    that used to fail in the middle of backward; now wrap refuses it, and the smallest pool
    it accepts trains exactly."""
    data = batches("llama", 6)
    base = lora(build("llama"), "llama")
    reference = copy.deepcopy(base)
    ref_losses, _ = train_plain(reference, data)
    model = copy.deepcopy(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="n_buffer=2 is not allowed: a module or block"):
        _wrap(model, n_persist=0, n_buffer=2)
    assert getattr(model, "_protrain_engine", None) is None
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n]), n
    model, opt, layout = _wrap(model, n_persist=0)  # the default is the smallest that works
    losses, _ = train_engine(model, data, opt)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    protrain.close(model)


def test_bad_optimizer_values_raise_before_anything_moves():
    model = build("llama")
    with pytest.raises(ValueError, match=r"betas\[1\]=1.5 is not allowed"):
        _wrap(model, n_persist=0, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match=r"param_groups\[0\].lr=-1"):
        params = [p for p in model.parameters() if p.requires_grad]
        _wrap(model, n_persist=0, param_groups=[{"params": params, "lr": -1.0}])
    assert getattr(model, "_protrain_engine", None) is None


def test_optimizer_of_a_closed_engine_says_so():
    model, opt, _ = _wrap(build("llama"), n_persist=0)
    protrain.close(model)
    with pytest.raises(RuntimeError, match="engine is closed"):
        opt.zero_grad()


def test_a_wrap_that_fails_half_way_leaves_the_model_as_it_was(monkeypatch):
    import protrain.engine as engine

    def broken(*args, **kwargs):
        raise RuntimeError("optimizer construction failed")

    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(engine, "HybridAdamW", broken)
    with pytest.raises(RuntimeError, match="optimizer construction failed"):
        _wrap(model, n_persist=0)
    assert getattr(model, "_protrain_engine", None) is None
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n]), n
        assert not p._post_accumulate_grad_hooks, n
    monkeypatch.undo()
    model, opt, _ = _wrap(model, n_persist=0)  # and it can be wrapped again
    protrain.close(model)


def test_a_failed_chunk_build_leaves_every_parameter_as_it_was(monkeypatch):
    """wrap fails part way through copying parameters into chunks: each parameter already
    moved gets its own storage back, with its value, and no host memory stays pinned."""
    from protrain.chunks import manager as manager_mod

    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = {"n": 0}
    real = manager_mod.Chunk.drop_build_storage

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("injected")
        return real(self)

    monkeypatch.setattr(manager_mod.Chunk, "drop_build_storage", failing)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        protrain.wrap(model, n_persist=1, lr=LR, device="cpu")
    assert calls["n"] == 2
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], atol=0, rtol=0, msg=name)
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
    assert manager_mod.registered_host_bytes() == 0
    assert not hasattr(model, "_protrain_engine")


@pytest.mark.parametrize("n_persist", [None, 0])
def test_chunks_hold_the_weights_cast_as_torch_casts_them(n_persist):
    """bf16 compute over fp32 weights: every chunk's copy is ``weight.to(bfloat16)`` bit for
    bit (persistent chunks cast from their fp32 master on the device), and the masters are
    the weights."""
    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, _, _ = protrain.wrap(
        model, n_persist=n_persist, lr=LR, device="cpu", compute_dtype=torch.bfloat16
    )
    manager = model._protrain_engine.manager
    names = {id(p): n for n, p in model.named_parameters()}
    for s in manager.slots():
        want = before[names[id(s.param)]]
        stored = s.device_view if s.host_view is None else s.host_view
        torch.testing.assert_close(stored, want.to(torch.bfloat16), atol=0, rtol=0)
        if s.master is not None:
            torch.testing.assert_close(s.master, want, atol=0, rtol=0)
    protrain.close(model)
