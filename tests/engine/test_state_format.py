"""The engine with every chunk offloaded and compact host moments (optimizer_state bf16 and
8bit): resumed bit for bit, the format carried by the state dict and a checkpoint of another
format refused, the bytes a parameter counted, and what it does not run with refused."""

from __future__ import annotations

import copy

import pytest
import torch

import protrain
from protrain.optim import host_adam_ext
from protrain.optim.adamw_8bit import check_saved_optimizer

from .models import batches, build

STEPS, MAX_NORM, LR, WD = 3, 0.5, 1e-2, 0.01
FORMATS = ["bf16", "8bit"]


@pytest.fixture(autouse=True)
def _kernel(one_pass_kernel):
    """The compact formats run in the one pass only (tests/conftest.py: skipped without a
    compiler, failed where one is present and the build fails)."""


def _wrap(base, fmt, **kw):
    model = copy.deepcopy(base)
    kw.setdefault("n_persist", 0)
    return protrain.wrap(model, lr=LR, weight_decay=WD, device="cpu", optimizer_state=fmt, **kw)


def _train(model, opt, data, steps=STEPS, start=0):
    for step in range(start, steps):
        model(**data[step]).loss.backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_is_bit_for_bit(fmt):
    base = build("llama")
    data = batches("llama", STEPS)
    model, opt, _ = _wrap(base, fmt)
    _train(model, opt, data)
    whole = protrain.state_dict(model)
    whole_opt = opt.state_dict()
    protrain.close(model)

    model, opt, _ = _wrap(base, fmt)
    _train(model, opt, data, steps=2)
    saved = copy.deepcopy(opt.state_dict())
    weights = protrain.state_dict(model)
    protrain.close(model)
    restored = copy.deepcopy(base)
    restored.load_state_dict(weights)
    model, opt, _ = _wrap(restored, fmt)
    opt.load_state_dict(saved)
    _train(model, opt, data, start=2)
    for name, value in protrain.state_dict(model).items():
        assert torch.equal(value, whole[name]), name
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, whole_opt["state"][i][k]), (i, k)
    protrain.close(model)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_carries_the_format(fmt):
    base = build("llama")
    data = batches("llama", 1)
    model, opt, _ = _wrap(base, fmt)
    _train(model, opt, data, steps=1)
    sd = opt.state_dict()
    assert sd["optimizer_state"] == fmt
    st = next(iter(sd["state"].values()))
    want = torch.bfloat16 if fmt == "bf16" else torch.uint8
    assert st["exp_avg"].dtype == want and st["exp_avg_sq"].dtype == want
    assert ("exp_avg_absmax" in st) == (fmt == "8bit")
    per_param = opt.stats["host_update_bytes"] / opt.stats["host_update_params"]
    # fp32 weights on the CPU: 4 in, the master's 8, the moments', 4 out
    moments = 8 if fmt == "bf16" else 4 + 16 / 256
    assert abs(per_param - (16 + moments)) < 0.05
    protrain.close(model)

    other, other_opt, _ = _wrap(base, "fp32")
    with pytest.raises(ValueError, match=f"saved with optimizer_state='{fmt}'"):
        other_opt.load_state_dict(sd)
    fp32_sd = other_opt.state_dict()
    protrain.close(other)
    model, opt, _ = _wrap(base, fmt)
    with pytest.raises(ValueError, match="saved with optimizer_state='fp32'"):
        opt.load_state_dict(fp32_sd)
    protrain.close(model)
    # plain PyTorch and FSDP2 (the app without the chunked engine) keep fp32 moments
    with pytest.raises(ValueError, match=f"saved with optimizer_state='{fmt}', this run's"):
        check_saved_optimizer(sd, "adamw")


def test_compact_state_refuses_what_steps_fp32_moments(monkeypatch):
    base = build("llama")
    with pytest.raises(ValueError, match="optimizer_state='bf16' is not supported with n_device"):
        _wrap(base, "bf16", n_device_step=1)
    monkeypatch.setenv(host_adam_ext.ENV_VAR, "torch")
    with pytest.raises(ValueError, match="without the host's one-pass kernel"):
        _wrap(base, "8bit")


@pytest.mark.parametrize("fmt", FORMATS)
def test_host_moments_moved_to_the_device_take_the_parameters_shape(fmt):
    """A plan that keeps every chunk on the device resumes a compact host state: each
    moment is decoded to fp32 in its parameter's shape (torch's fused AdamW on CUDA takes
    no other), the same values as the host's."""
    base = build("llama")
    data = batches("llama", 1)
    model, opt, layout = _wrap(base, fmt)
    _train(model, opt, data, steps=1)
    saved = copy.deepcopy(opt.state_dict())
    protrain.close(model)
    model, opt, _ = _wrap(base, fmt, n_persist=layout.n_chunks)
    opt.load_state_dict(saved)
    params = [p for p in model.parameters() if p.requires_grad]
    moved = opt.state_dict()["state"]
    for i, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert moved[i][key].shape == p.shape, (i, key)
    _train(model, opt, data, steps=1)
    protrain.close(model)
