"""fp16 compute with dynamic loss scaling (``torch.amp.GradScaler`` semantics), on the CPU.

The reference does the engine's math in plain PyTorch: fp16 copies of the weights for
compute, the loss scaled by ``torch.amp.GradScaler``, fp16 gradients accumulated into fp32
master gradients, ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step`` of a fused
AdamW over the fp32 masters, ``scaler.update``, masters copied back into the fp16 weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

import protrain

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR, MAX_NORM, STEPS, WD

FP16 = torch.float16


def _loss(model, b):
    return model(**b).loss / ACCUM


def train_reference(base, data, scaler_kwargs=None):
    model = copy.deepcopy(base)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().to(torch.float32, copy=True) for _, p in trainable]
    for p in model.parameters():
        p.data = p.data.to(FP16)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    scaler = torch.amp.GradScaler("cpu", **(scaler_kwargs or {}))
    losses, norms = [], []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = _loss(model, data[step * ACCUM + mb])
            scaler.scale(loss).backward()
            losses.append(loss.item())
            with torch.no_grad():
                for (_, p), m in zip(trainable, masters):
                    if p.grad is None:
                        continue
                    if m.grad is None:
                        m.grad = p.grad.to(torch.float32, copy=True)
                    else:
                        m.grad.add_(p.grad)
                    p.grad = None
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.no_grad():
            for (_, p), m in zip(trainable, masters):
                p.copy_(m)
    master_of = {n: m for (n, _), m in zip(trainable, masters)}
    state = {
        n: master_of[n] if n in master_of else p.detach().float()
        for n, p in model.named_parameters()
    }
    return losses, norms, state, scaler


def train_engine(model, data, optimizer):
    losses, norms = [], []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = _loss(model, data[step * ACCUM + mb])
            optimizer.scale_loss(loss).backward()
            losses.append(loss.item())
        norms.append(optimizer.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms


def _wrap(model, **kw):
    kw.setdefault("n_persist", 0)
    return protrain.wrap(model, lr=LR, weight_decay=WD, device="cpu", compute_dtype=FP16, **kw)


def _n_chunks(model) -> int:
    m, opt, layout = _wrap(copy.deepcopy(model), n_persist=None)
    n = layout.n_chunks
    opt.close()
    return n


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_fp16_same_as_plain_pytorch_with_grad_scaler(mode):
    base = build("llama")
    if mode == "lora":
        base = lora(base, "llama")
    data = batches("llama", STEPS * ACCUM)
    ref_losses, ref_norms, ref_state, ref_scaler = train_reference(base, data)
    n_chunks = _n_chunks(base)
    assert n_chunks >= 3
    for n_persist in sorted({0, n_chunks // 2, n_chunks}):
        model, optimizer, _ = _wrap(copy.deepcopy(base), n_persist=n_persist)
        losses, norms = train_engine(model, data, optimizer)
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), n_persist
        assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6), n_persist
        assert optimizer.scaler.get_scale() == ref_scaler.get_scale()
        state = protrain.state_dict(model)
        for name, ref in ref_state.items():
            torch.testing.assert_close(
                state[name], ref, atol=1e-6, rtol=0, msg=f"n_persist={n_persist} {name}"
            )
        protrain.close(model)


def _snapshot(model, optimizer):
    params = {n: t.clone() for n, t in protrain.state_dict(model).items()}
    opt_state = copy.deepcopy(optimizer.state_dict())
    return params, opt_state


def _assert_same(a, b):
    params_a, opt_a = a
    params_b, opt_b = b
    assert params_a.keys() == params_b.keys()
    for n in params_a:
        torch.testing.assert_close(params_a[n], params_b[n], rtol=0, atol=0, msg=n)
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for i in opt_a["state"]:
        for k, v in opt_a["state"][i].items():
            torch.testing.assert_close(opt_b["state"][i][k], v, rtol=0, atol=0, msg=f"{i} {k}")


def _one_step(model, optimizer, data, clip=True, poison=None, poison_mb=None):
    for mb, b in enumerate(data):
        handle = None
        if poison is not None and mb == poison_mb:

            def to_inf(g):
                g = g.clone()
                g.view(-1)[0] = float("inf")
                return g

            handle = poison.register_hook(to_inf)
        optimizer.scale_loss(_loss(model, b)).backward()
        if handle is not None:
            handle.remove()
    norm = optimizer.clip_grad_norm_(MAX_NORM) if clip else None
    optimizer.step()
    optimizer.zero_grad()
    return norm


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("poison_mb", [0, 1])
@pytest.mark.parametrize("which", ["first", "last"])
def test_overflow_skips_the_step_on_every_chunk(which, poison_mb, clip):
    base = build("llama")
    data = batches("llama", 3 * ACCUM)
    n_chunks = _n_chunks(base)
    for n_persist in sorted({0, n_chunks // 2, n_chunks}):
        model, optimizer, layout = _wrap(copy.deepcopy(base), n_persist=n_persist)
        _one_step(model, optimizer, data[:ACCUM], clip=clip)  # Adam state exists
        scale = optimizer.scaler.get_scale()
        before = _snapshot(model, optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        poison = params[0] if which == "first" else params[-1]
        norm = _one_step(
            model,
            optimizer,
            data[ACCUM : 2 * ACCUM],
            clip=clip,
            poison=poison,
            poison_mb=poison_mb,
        )
        if clip:
            assert not torch.isfinite(norm)
        assert optimizer.scaler.get_scale() == scale / 2, n_persist
        assert optimizer.scaler.get_growth_tracker() == 0
        _assert_same(before, _snapshot(model, optimizer))
        # the next clean step trains every chunk again
        _one_step(model, optimizer, data[2 * ACCUM :], clip=clip)
        after = protrain.state_dict(model)
        changed = [n for n, t in after.items() if not torch.equal(t, before[0][n])]
        assert len(changed) == len(params), (n_persist, len(changed), len(params))
        assert optimizer.scaler.get_growth_tracker() == 1
        protrain.close(model)


def test_scale_grows_after_growth_interval_clean_steps():
    base = build("llama")
    data = batches("llama", 4 * ACCUM)
    model, optimizer, _ = _wrap(base, loss_scaling={"init_scale": 2.0**4, "growth_interval": 3})
    seen = []
    for step in range(4):
        _one_step(model, optimizer, data[step * ACCUM : (step + 1) * ACCUM])
        seen.append((optimizer.scaler.get_scale(), optimizer.scaler.get_growth_tracker()))
    assert seen == [(16.0, 1), (16.0, 2), (32.0, 0), (32.0, 1)]
    protrain.close(model)


def test_scaler_state_dict_round_trip():
    base = build("llama")
    data = batches("llama", 3 * ACCUM)
    kw = {"init_scale": 2.0**10, "growth_interval": 5}
    model, optimizer, _ = _wrap(copy.deepcopy(base), n_persist=1, loss_scaling=kw)
    params = [p for p in model.parameters() if p.requires_grad]
    _one_step(model, optimizer, data[:ACCUM])
    _one_step(model, optimizer, data[ACCUM : 2 * ACCUM], poison=params[-1], poison_mb=1)
    _one_step(model, optimizer, data[2 * ACCUM :])
    sd = optimizer.state_dict()
    assert sd["loss_scaler"] == {
        "scale": 2.0**9,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "_growth_tracker": 1,
    }
    weights = protrain.state_dict(model)
    protrain.close(model)

    model2, optimizer2, _ = _wrap(copy.deepcopy(base), n_persist=1)
    assert optimizer2.scaler.get_scale() == 2.0**16
    protrain.load_state_dict(model2, weights)
    optimizer2.load_state_dict(sd)
    assert optimizer2.scaler.state_dict() == sd["loss_scaler"]
    sd2 = optimizer2.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(sd2["state"][i][k], v, rtol=0, atol=0)
    protrain.close(model2)


def test_bf16_and_fp32_have_no_loss_scaling():
    model, optimizer, _ = protrain.wrap(build("llama"), device="cpu")
    loss = torch.tensor(3.0)
    assert optimizer.scale_loss(loss) is loss
    assert optimizer.scaler.get_scale() == 1.0
    data = batches("llama", ACCUM)
    _one_step(model, optimizer, data)
    assert "loss_scaler" not in optimizer.state_dict()
    protrain.close(model)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_fp16_on_gpu_matches_autocast_fp16_with_grad_scaler(mode):
    """Against autocast fp16 over fp32 weights + GradScaler: within fp16 rounding."""
    base = build("llama")
    if mode == "lora":
        base = lora(base, "llama")
    data = [{k: v.cuda() for k, v in b.items()} for b in batches("llama", STEPS * ACCUM)]
    start = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    reference = copy.deepcopy(base).cuda()
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    ref_losses = []
    for step in range(STEPS):
        for mb in range(ACCUM):
            with torch.autocast("cuda", dtype=FP16):
                loss = _loss(reference, data[step * ACCUM + mb])
            scaler.scale(loss).backward()
            ref_losses.append(loss.item())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    ref_delta = {
        n: p.detach().cpu() - start[n] for n, p in reference.named_parameters() if n in start
    }
    probe, _, layout = protrain.wrap(copy.deepcopy(base), device="cuda", compute_dtype=FP16)
    n_chunks = layout.n_chunks
    protrain.close(probe)
    for n_persist in sorted({0, n_chunks // 2, n_chunks}):
        model, optimizer, _ = protrain.wrap(
            copy.deepcopy(base),
            n_persist=n_persist,
            lr=LR,
            weight_decay=WD,
            compute_dtype=FP16,
        )
        losses, _ = train_engine(model, data, optimizer)
        assert losses == pytest.approx(ref_losses, rel=1e-2, abs=1e-2), n_persist
        assert optimizer.scaler.get_scale() == scaler.get_scale()
        state = protrain.state_dict(model)
        num = sum(((state[n] - start[n]) - d).float().pow(2).sum() for n, d in ref_delta.items())
        den = sum(d.float().pow(2).sum() for d in ref_delta.values())
        # Adam's update is sign-like, so rounding of small gradients moves it by a few percent
        assert (num / den).sqrt() < 0.15, (mode, n_persist, (num / den).sqrt())
        protrain.close(model)


def test_step_without_gradients_is_an_error_as_in_grad_scaler():
    model, opt, _ = _wrap(build("llama"), n_persist=0)
    scale = opt.scaler.get_scale()
    with pytest.raises(RuntimeError, match="found no gradients"):
        opt.step()
    assert opt.scaler.get_scale() == scale
    protrain.close(model)
