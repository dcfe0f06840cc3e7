"""The engine's host AdamW over flat runs ([Note: flat runs] in optim/flat_adamw.py) computes
bit for bit what it computes with one tensor per parameter: LoRA and full fine-tuning (odd
sizes among gpt2's), two parameter groups (decay and no decay), fp32 and fp16 with loss
scaling, clipping, and a resume from the optimizer's state dict."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain
from protrain.optim import flat_adamw

from .models import batches, build, lora
from .test_equivalence import ACCUM, LR, MAX_NORM

STEPS = 3


def _groups(model):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for _, p in trainable if p.ndim >= 2]
    no_decay = [p for _, p in trainable if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _train(model, optimizer, data, steps):
    for step in steps:
        for mb in range(ACCUM):
            loss = model(**data[step * ACCUM + mb]).loss / ACCUM
            optimizer.scale_loss(loss).backward()
        optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()


def _wrap(base, fp16):
    model = copy.deepcopy(base)
    dtype = torch.float16 if fp16 else None
    groups = [g for g in _groups(model) if g["params"]]
    return protrain.wrap(
        model, n_persist=0, lr=LR, device="cpu", param_groups=groups, compute_dtype=dtype
    )


def _states(model, optimizer):
    return protrain.state_dict(model), optimizer.state_dict()


def _assert_bitwise(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for name in ma:
        assert torch.equal(ma[name], mb[name]), name
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)
    assert oa["param_groups"] == ob["param_groups"]


@pytest.mark.parametrize(
    "kind,mode,fp16", [("llama", "lora", False), ("gpt2", "full", False), ("llama", "lora", True)]
)
def test_flat_runs_equal_one_tensor_per_parameter(kind, mode, fp16, monkeypatch):
    torch.manual_seed(0)
    base = build(kind)
    if mode == "lora":
        base = lora(base, kind)
    data = batches(kind, (STEPS + 2) * ACCUM)

    model, opt, _ = _wrap(base, fp16)
    pieces = [p for opts in opt._host_opts.values() for p in opts]
    # flat runs (fewer where decay and no-decay parameters alternate, as gpt2's do)
    assert sum(len(p.runs) for p in pieces) < sum(len(p.slots) for p in pieces)
    _train(model, opt, data, range(STEPS))
    flat = _states(model, opt)
    saved_model, saved_opt = copy.deepcopy(flat[0]), copy.deepcopy(flat[1])
    _train(model, opt, data, range(STEPS, STEPS + 2))
    flat_after = _states(model, opt)
    protrain.close(model)

    # resumed: a fresh engine from the state dicts, two more steps
    model, opt, _ = _wrap(base, fp16)
    protrain.load_state_dict(model, saved_model)
    opt.load_state_dict(saved_opt)
    _train(model, opt, data, range(STEPS, STEPS + 2))
    _assert_bitwise(flat_after, _states(model, opt))
    protrain.close(model)

    # one tensor per parameter: every run ends after its first slot
    monkeypatch.setattr(flat_adamw, "_LANE_UNIT", 1 << 62)
    model, opt, _ = _wrap(base, fp16)
    assert all(len(p.runs) == len(p.slots) for opts in opt._host_opts.values() for p in opts)
    _train(model, opt, data, range(STEPS))
    _assert_bitwise(flat, _states(model, opt))
    protrain.close(model)
