"""First gradients of offloaded chunks are offloaded in batches ([Note: batched first
gradients] in runtime/grad_offload.py): the same losses and weights as plain PyTorch, bit
for bit those of offloading one gradient at a time, with far fewer batches than gradients,
and no update or norm ever reads a gradient still held."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import protrain
import protrain.runtime.grad_offload as grad_offload
from protrain.optim.hybrid_adamw import HybridAdamW

from .models import batches, build, lora


@pytest.fixture(autouse=True)
def _hold_on_cpu(monkeypatch):
    """The engine holds first gradients on CUDA only; these tests run the same logic on
    the CPU."""
    monkeypatch.setattr(grad_offload, "_HOLD_ON_CPU", True)


STEPS, MAX_NORM, LR, WD = 3, 0.5, 1e-2, 0.01


def _plain(model, data, accum: int, clip: bool) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    losses = []
    for step in range(STEPS):
        for mb in range(accum):
            loss = model(**data[step * accum + mb]).loss / accum
            loss.backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses


def _offloaded_slots(model) -> list:
    manager = model._protrain_engine.manager
    return [s for c in manager.offloaded for s in c.trainable_slots]


def _poison(model) -> None:
    """Accumulators and landing places hold nan and no norm: a read of a gradient that has
    not landed shows, wherever it lands (the one-pass host AdamW's first gradients land in
    grad_staging). (Helpers take the model, not its slots: pytest's report of a failure
    would print a slot's parameter, whose released chunk has no storage.)"""
    for s in _offloaded_slots(model):
        for t in (s.grad_acc, s.grad_staging):
            if t is not None:
                t.fill_(math.nan)
        s.grad_norm = None


def _to(b, device):
    return {k: v.to(device) for k, v in b.items()}


def _engine(
    model,
    optimizer,
    data,
    accum: int,
    armed: bool,
    clip: bool | None = None,
    device: str = "cpu",
) -> list[float]:
    """STEPS steps of ``accum`` micro-batches; clipped unless armed (or as ``clip`` says).
    On the CPU each first backward's gradients are checked landed at its end (on CUDA the
    device norm and the host accumulator's may differ in their last bits)."""
    clip = not armed if clip is None else clip
    losses = []
    for step in range(STEPS):
        optimizer.synchronize()  # the last update has read the accumulators
        _poison(model)
        for mb in range(accum):
            if armed and mb == accum - 1:
                optimizer.step_in_backward()
            loss = model(**_to(data[step * accum + mb], device)).loss / accum
            loss.backward()
            if mb == 0 and device == "cpu":  # first gradients flushed at its end
                _check_landed(model)
            losses.append(loss.detach())  # read at the end: no sync inside the steps
        if clip:
            optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return [float(loss) for loss in losses]


def _check_landed(model) -> None:
    for s in _offloaded_slots(model):
        if s.has_grad:
            assert s.grad_norm is not None, s.name
            grad = s.landed_grad()
            assert torch.isfinite(grad).all(), s.name
            assert s.grad_norm == torch.linalg.vector_norm(grad), s.name


@pytest.mark.parametrize("armed", [False, True])
def test_same_as_plain_pytorch_and_as_one_gradient_at_a_time(armed, monkeypatch):
    """Unarmed: accumulation 2 with clipping; armed (step_in_backward, which excludes
    clipping): accumulation 1, so that the first gradients arrive in the watched backward and
    each chunk's update starts from inside it."""
    accum = 1 if armed else 2
    base = lora(build("llama"), "llama")
    data = batches("llama", STEPS * accum)
    reference = copy.deepcopy(base)
    ref_losses = _plain(reference, data, accum, clip=not armed)
    ref_state = reference.state_dict()

    real_start = HybridAdamW._start_in_backward
    checked = []

    def start_checked(self, key):  # no update starts while a gradient is held
        _check_landed(model)
        checked.append(key)
        real_start(self, key)

    monkeypatch.setattr(HybridAdamW, "_start_in_backward", start_checked)
    runs = {}
    for cap in (None, 4, 1):  # None: the default batch; 1: one gradient at a time
        monkeypatch.setattr(grad_offload, "_BATCH_TENSORS", cap or 64)
        model, optimizer, _ = protrain.wrap(
            copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu"
        )
        n_first = len(_offloaded_slots(model))
        assert n_first == 30  # 3 layers, 5 adapted projections, A and B
        losses = _engine(model, optimizer, data, accum, armed)
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), cap
        state = protrain.state_dict(model)
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=f"{cap} {name}")
        stats = optimizer.stats
        if not armed:  # every first gradient of a step held until its backward ends
            assert stats["grad_batches"] == STEPS * math.ceil(n_first / (cap or 64)), cap
        else:  # one batch each time a chunk's gradients complete (one update piece each)
            assert stats["updates_started_in_backward"] > 0
            if cap is None:
                assert stats["grad_batches"] == stats["updates_started_in_backward"]
                assert 3 * stats["grad_batches"] < STEPS * n_first  # a chunk's, not a tensor's
            else:
                assert stats["grad_batches"] >= STEPS * math.ceil(n_first / cap)
        runs[cap] = (losses, state)
        protrain.close(model)
    assert bool(checked) == armed
    for cap in (4, 1):  # the same bits whatever the batching
        assert runs[cap][0] == runs[None][0]
        for name, value in runs[None][1].items():
            assert torch.equal(runs[cap][1][name], value), (cap, name)


def test_large_gradients_go_at_once_between_batches(monkeypatch):
    """A gradient over the direct threshold is offloaded at once, after the batch held before
    it: the result is unchanged, and only the small gradients were batched."""
    monkeypatch.setattr(grad_offload, "_DIRECT_NUMEL", 100)
    base = lora(build("llama"), "llama")
    data = batches("llama", STEPS * 2)
    reference = copy.deepcopy(base)
    ref_losses = _plain(reference, data, 2, clip=True)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cpu"
    )
    slots = _offloaded_slots(model)
    large = sum(s.master.numel() > 100 for s in slots)
    assert 0 < large < len(slots)
    losses = _engine(model, optimizer, data, 2, armed=False)
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    # a batch at most before each large gradient, and one at the end of the backward
    assert STEPS <= optimizer.stats["grad_batches"] <= STEPS * (large + 1)
    protrain.close(model)


class _Fail(Exception):
    pass


def _fail_below(model, layer: int, armed: list[bool]) -> None:
    """While ``armed[0]``, the backward raises when it reaches the output of ``layer``: the
    gradients of the layers above it have been accumulated, the rest have not."""
    layers = model.get_submodule("base_model.model.model.layers")

    def raise_in_backward(grad):
        if armed[0]:
            raise _Fail("injected failure in backward")

    def on_output(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.requires_grad:
            hidden.register_hook(raise_in_backward)

    layers[layer].register_forward_hook(on_output)


@pytest.mark.parametrize("then", ["backward", "step", "zero_grad"])
def test_a_backward_that_raised_keeps_its_held_gradients(then):
    """A backward that raises halfway leaves its first gradients held (its end never came).
    What follows sees them as PyTorch's ``param.grad``: the next backward adds to them, a
    clipped step steps them, ``zero_grad`` drops them."""
    base = lora(build("llama"), "llama")
    data = batches("llama", 3)
    runs = []
    for wrapped in (False, True):
        model = copy.deepcopy(base)
        armed = [True]
        _fail_below(model, 0, armed)
        params = [p for p in model.parameters() if p.requires_grad]
        if wrapped:
            model, optimizer, _ = protrain.wrap(
                model, n_persist=0, lr=LR, weight_decay=WD, device="cpu"
            )
            _poison(model)
        else:
            optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
        with pytest.raises(_Fail):
            model(**data[0]).loss.backward()
        armed[0] = False
        if then == "backward":
            model(**data[1]).loss.backward()
        if then != "zero_grad":
            if wrapped:
                optimizer.clip_grad_norm_(MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
        optimizer.zero_grad()
        if wrapped:
            # the failed backward's batch, flushed by the next backward's gradient of a held
            # slot, or by the optimizer (clipping, zero_grad); then that backward's own
            assert optimizer.stats["grad_batches"] == (2 if then == "backward" else 1)
        model(**data[2]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state = protrain.state_dict(model) if wrapped else model.state_dict()
        runs.append({k: v.clone() for k, v in state.items()})
        if wrapped:
            protrain.close(model)
    plain, engine = runs
    moved = 0
    for name, ref in plain.items():
        torch.testing.assert_close(engine[name], ref, atol=1e-6, rtol=0, msg=name)
        moved += not torch.equal(ref, base.state_dict()[name])
    assert moved == 30


@pytest.mark.gpu
def test_batched_on_cuda_equals_one_gradient_at_a_time_and_plain_pytorch(monkeypatch):
    """bf16 LoRA with every chunk offloaded: the batches' one event orders every copy before
    the host reads the accumulators (clipped step, and step_in_backward)."""
    base = lora(build("llama"), "llama")
    accum = 2
    data = batches("llama", STEPS * accum)
    start = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    reference = copy.deepcopy(base).cuda()
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    for step in range(STEPS):
        for mb in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = reference(**_to(data[step * accum + mb], "cuda")).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad()
    ref_delta = {n: p.detach().cpu() - start[n] for n, p in reference.named_parameters()
                 if n in start}  # fmt: skip

    def delta_of(cap: int, armed: bool, clip: bool, accum: int) -> tuple[dict, dict]:
        monkeypatch.setattr(grad_offload, "_BATCH_TENSORS", cap)
        model, optimizer, _ = protrain.wrap(
            copy.deepcopy(base), n_persist=0, lr=LR, weight_decay=WD, device="cuda",
            compute_dtype=torch.bfloat16,
        )  # fmt: skip
        _engine(model, optimizer, data, accum, armed, clip=clip, device="cuda")
        stats = dict(optimizer.stats)
        state = protrain.state_dict(model)
        protrain.close(model)
        return {n: state[n].float() - start[n].float() for n in start}, stats

    def rel(a: dict, b: dict) -> float:
        num = sum((a[n] - d).pow(2).sum() for n, d in b.items())
        return float((num / sum(d.pow(2).sum() for d in b.values())).sqrt())

    batched, stats = delta_of(64, armed=False, clip=True, accum=accum)
    one_by_one, stats_one = delta_of(1, armed=False, clip=True, accum=accum)
    assert stats["grad_batches"] == STEPS and stats_one["grad_batches"] == STEPS * 30
    assert rel(batched, one_by_one) < 1e-3  # the same up to run-to-run nondeterminism
    assert rel(batched, ref_delta) < 0.15  # bf16 rounding, as test_gpu.py's bound
    # step_in_backward with the first gradients in the watched backward (accumulation 1),
    # batches of 4 and flushes as chunks complete, against the plain step
    armed, armed_stats = delta_of(4, armed=True, clip=False, accum=1)
    plain, _ = delta_of(64, armed=False, clip=False, accum=1)
    assert armed_stats["updates_started_in_backward"] >= STEPS
    assert armed_stats["grad_batches"] >= STEPS * math.ceil(30 / 4)
    assert rel(armed, plain) < 1e-2, rel(armed, plain)
