"""The one-pass host AdamW kernel against torch.optim.AdamW(fused=True).

Every element a vector lane computes is bit for bit torch's; a tensor's last
``numel % vec_size`` elements, which torch computes in a compiler-built scalar loop, agree
to a few ulp (see [Note: same bits as torch's fused AdamW] in optim/csrc/host_adam.cpp).
Run under ATEN_CPU_CAPABILITY=avx2 and =default too: the kernel is built per capability.
"""

from __future__ import annotations

import pytest
import torch

from protrain.optim import host_adam_ext

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
FULL = [(64, 129)]  # one tensor with a tail on every vector width
LORA = [(8, 40), (40, 8), (16, 24), (24, 16), (7,), (33,), (16,)] * 4  # many small ones


@pytest.fixture
def kernel(one_pass_kernel):
    return one_pass_kernel


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


def _check(kernel, ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    body = ours.numel() - ours.numel() % kernel.vec_size()
    a, b = ours.reshape(-1), ref.reshape(-1)
    assert torch.equal(a[:body], b[:body]), f"{what}: a vector lane differs from torch"
    torch.testing.assert_close(a[body:], b[body:], rtol=2e-6, atol=1e-9, msg=what)


def _run(kernel, shapes, grad_dtype, inv_scale, clip, steps=3, skip=None):
    """``steps`` steps of both over ``shapes`` in two groups (weight decay 0.1 and 0); the
    parameter at index ``skip`` has no gradient in the second step."""
    torch.manual_seed(0)
    ref = [torch.randn(s) for s in shapes]
    wd = [0.1 if i % 2 == 0 else 0.0 for i in range(len(shapes))]
    groups = [
        {"params": [p for p, w in zip(ref, wd) if w == g], "weight_decay": g} for g in (0.1, 0.0)
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    ours = [p.clone() for p in ref]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ours]
    counts = [0.0] * len(ours)
    dtype = torch.bfloat16 if grad_dtype == torch.float32 else grad_dtype
    outs = [torch.empty(p.shape, dtype=dtype) for p in ours]
    for step in range(steps):
        grads = [torch.randn(p.shape).to(grad_dtype) for p in ours]
        stepping = [i for i in range(len(ours)) if not (step == 1 and i == skip)]
        for i, p in enumerate(ref):  # torch: unscale, then clip, then the step
            g = grads[i].float()
            g = g * inv_scale if inv_scale is not None else g
            p.grad = (g * clip if clip is not None else g) if i in stepping else None
        opt.step()
        for g in (0.1, 0.0):
            idx = [i for i in stepping if wd[i] == g]
            for i in idx:
                counts[i] += 1
            kernel.adamw_step(
                [ours[i] for i in idx], [moments[i][0] for i in idx],
                [moments[i][1] for i in idx], [grads[i] for i in idx], [outs[i] for i in idx],
                [counts[i] for i in idx], LR, *BETAS, g, EPS, inv_scale, clip,
            )  # fmt: skip
    for i, p in enumerate(ref):
        st = opt.state[p]
        _check(kernel, ours[i], p.detach(), f"param {i}")
        _check(kernel, moments[i][0], st["exp_avg"], f"exp_avg {i}")
        _check(kernel, moments[i][1], st["exp_avg_sq"], f"exp_avg_sq {i}")
        assert counts[i] == float(st["step"])
        assert torch.equal(outs[i], ours[i].to(dtype)), f"copy {i} is not the master rounded"


@pytest.mark.parametrize("shapes", [FULL, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_pass_matches_torch_adamw(kernel, shapes, grad_dtype):
    _run(kernel, shapes, grad_dtype, None, None, skip=3 if len(shapes) > 3 else None)


@pytest.mark.parametrize("shapes", [FULL, LORA], ids=["full", "lora"])
def test_unscale_and_clip_inside_the_pass(kernel, shapes):
    _run(kernel, shapes, torch.float16, 1.0 / 1024, 0.37)


def test_capability_is_torchs(kernel):
    assert kernel.capability() == host_adam_ext.capability()


def test_fallback_is_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv(host_adam_ext.ENV_VAR, "torch")
    assert host_adam_ext.kernel() is None


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copies_land_at_any_alignment_and_nowhere_else(kernel, out_dtype):
    # The copies are streamed in aligned 32-byte stores with ordinary stores around them
    # ([Note: streamed copies]): views of one buffer at every offset, of lengths that end
    # inside and past a store, get the master rounded, and the elements between them keep
    # their sentinel.
    sizes = [1, 5, 16, 17, 31, 64, 100, 1500, 2049]
    torch.manual_seed(0)
    masters = [torch.randn(n) for n in sizes]
    buf = torch.full((sum(sizes) + 3 * len(sizes) + 64,), 7.0, dtype=out_dtype)
    outs, at = [], 0
    for i, n in enumerate(sizes):
        at += 1 + i % 3  # a gap of one to three sentinels before each view
        outs.append(buf[at : at + n])
        at += n
    gaps = torch.ones_like(buf, dtype=torch.bool)
    for o in outs:
        gaps[o.storage_offset() : o.storage_offset() + o.numel()] = False
    kernel.adamw_step(
        masters, [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes],
        [torch.randn(n).to(torch.bfloat16) for n in sizes], outs, [1.0] * len(sizes),
        LR, *BETAS, 0.1, EPS, None, None,
    )  # fmt: skip
    for i, (o, p) in enumerate(zip(outs, masters)):
        assert torch.equal(o, p.to(out_dtype)), f"copy {i} is not the master rounded"
    assert bool((buf[gaps] == 7.0).all()), "a store reached past a copy"
