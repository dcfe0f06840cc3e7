"""Compact Adam moments on the host (optimizer_state bf16 and 8bit): the kernel against the
same arithmetic in torch (optim/state_format.py around torch's fused AdamW), bit for bit;
stochastic rounding unbiased; the 8-bit code's error bounds; the bytes a parameter.

Exact on every vector width: the shapes' sizes are multiples of 16, so no element takes the
kernel's scalar tail (which agrees with torch's to a few ulp, tests/optim/test_host_adam.py),
and the encodings are integer arithmetic and single IEEE operations.
"""

from __future__ import annotations

import pytest
import torch

from protrain.optim import state_format as sf
from protrain.optim.flat_adamw import fused_adamw

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
SHAPES = [(64, 128), (16, 48), (300, 16)]  # the last: a partial 8-bit block of 192


@pytest.fixture
def kernel(one_pass_kernel):
    """tests/conftest.py's: skipped without a compiler, failed where the build fails."""
    return one_pass_kernel


def _reference_step(fmt, p, st, g, step, seed, wd, inv_scale, clip):
    """One step as the kernel takes it: moments decoded, torch's fused AdamW in fp32 on
    them, moments encoded (bf16: rounded with the bits of (seed, step, offset))."""
    m, v = sf.decode_state(fmt, st)
    m, v = m.view(p.shape).clone(), v.view(p.shape).clone()
    grad = g.float()
    grad = grad * inv_scale if inv_scale is not None else grad
    grad = grad * clip if clip is not None else grad
    count = torch.tensor(step - 1.0)
    group = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": wd}
    fused_adamw([p], [grad], [m], [v], [count], group)
    if fmt == "bf16":
        bits = sf.element_bits(sf.step_key(step, seed), p.numel()).view(p.shape)
        return {
            "exp_avg": sf.round_stochastic(m, bits),
            "exp_avg_sq": sf.round_stochastic(v, bits >> 16),
        }
    return sf.encode_state(fmt, step, m.reshape(-1), v.reshape(-1))


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("grad_dtype,inv_scale,clip", [
    (torch.bfloat16, None, None), (torch.float16, 0.5, 0.25), (torch.float32, None, 0.7),
])  # fmt: skip
def test_kernel_matches_reference(kernel, fmt, grad_dtype, inv_scale, clip):
    torch.manual_seed(0)
    masters = [torch.randn(s) for s in SHAPES]
    ref = [p.clone() for p in masters]
    states = [sf.new_moments(fmt, p.numel(), sf.n_blocks(p.numel())) for p in masters]
    ref_states = [{k: t.clone() for k, t in st.items()} for st in states]
    seeds = [sf.param_seed(f"layer.{i}.weight") for i in range(len(SHAPES))]
    out_dtype = torch.bfloat16 if grad_dtype == torch.float32 else grad_dtype
    outs = [torch.empty(s, dtype=out_dtype) for s in SHAPES]
    wd = 0.1
    for step in (1.0, 2.0, 3.0):
        grads = [(torch.randn(s) * 10 ** torch.randint(-3, 2, s)).to(grad_dtype) for s in SHAPES]
        absmax = [sf.ABSMAX] if fmt == "8bit" else []
        kernel.adamw_step_compact(
            masters, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
            [st[sf.ABSMAX[0]] if absmax else torch.empty(0) for st in states],
            [st[sf.ABSMAX[1]] if absmax else torch.empty(0) for st in states],
            grads, outs, [step] * len(SHAPES), seeds, sf.KERNEL_FORMAT[fmt],
            LR, *BETAS, wd, EPS, inv_scale, clip,
        )  # fmt: skip
        for i in range(len(SHAPES)):
            want = _reference_step(fmt, ref[i], ref_states[i], grads[i], step, seeds[i], wd,
                                   inv_scale, clip)  # fmt: skip
            for k, t in want.items():
                if k != "step":
                    ref_states[i][k] = t.reshape(ref_states[i][k].shape)
    for i in range(len(SHAPES)):
        assert torch.equal(masters[i], ref[i]), f"master {i}"
        assert torch.equal(outs[i], ref[i].to(out_dtype)), f"copy {i}"
        for k, t in states[i].items():
            assert torch.equal(t, ref_states[i][k]), f"{k} {i}"
    if fmt == "8bit":  # the state is not trivial: every code of both moments in use
        assert states[0]["exp_avg"].unique().numel() > 100


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.randn(64) * 10.0 ** torch.randint(-6, 6, (64,))
    draws = 4000
    total = torch.zeros(64, dtype=torch.float64)
    for key in range(draws):
        total += sf.round_stochastic(x, sf.mix32(torch.arange(64) ^ (key * 7919))).double()
    ulp = (x.bfloat16().float().abs().double() * 2.0**-7).clamp(min=1e-30)
    bias = ((total / draws - x.double()).abs() / ulp).max()
    assert bias < 0.05, f"mean of {draws} roundings is {bias:.3f} ulp from the value"
    nearest = ((x.bfloat16().double() - x.double()).abs() / ulp).max()
    assert nearest > 0.05  # round-to-nearest is biased on these values: the test can tell


def test_stochastic_rounding_keeps_specials():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    out = sf.round_stochastic(x, torch.full((5,), 0xFFFF, dtype=torch.int64)).float()
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()
    assert out[3] == 0 and out[4] == 0


def test_8bit_code_error_bounds():
    torch.manual_seed(0)
    x = torch.randn(4096) * 10.0 ** torch.randint(-5, 1, (4096,))
    for signed in (True, False):
        src = x if signed else x.abs()
        q, absmax = sf.quantize_blockwise(src, signed)
        back = sf.dequantize_blockwise(q, absmax, signed)
        a = absmax.repeat_interleave(sf.QBLOCK)
        top = 15 if signed else 31  # below 2^-top of the absmax: linear steps of 2^-(top+3)
        normal = src.abs() >= a * 2.0 ** (1 - top)
        rel = ((back - src).abs() / src.abs())[normal]
        assert rel.max() <= 2.0**-4, "nearest of 3 mantissa bits"
        assert ((back - src).abs()[~normal] <= a[~normal] * 2.0 ** -(top + 3)).all()
        assert torch.equal(back.abs().reshape(-1, sf.QBLOCK).amax(1), absmax), "absmax exact"
        if not signed:
            assert (back[src > 0] > 0).all(), "a nonzero second moment decodes nonzero"


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
def test_decoded_state_encodes_to_the_same_codes(fmt):
    """A resume at the same world size decodes a gathered checkpoint's moments and encodes
    them over the same elements: every code comes back (8-bit: a negative value under the
    least magnitude, code 0x80, too), as do the absmaxes; a partial last block included."""
    torch.manual_seed(0)
    n = 40 * sf.QBLOCK + 19
    m = torch.randn(n) * 10.0 ** torch.randint(-12, 3, (n,))
    v = m * m * torch.rand(n)
    m[::11], v[::7] = 0.0, 0.0
    st = sf.encode_state(fmt, torch.tensor(3.0), m, v)
    if fmt == "8bit":
        assert (st["exp_avg"] == 0x80).any(), "no negative value under the least magnitude"
    again = sf.reencode_state(fmt, st["step"], *sf.decode_state(fmt, st))
    for k, t in st.items():
        assert torch.equal(again[k], t), k


def test_bytes_a_parameter():
    bf16 = torch.bfloat16
    assert sf.host_update_bytes_per_param(bf16, "fp32", True) == 28
    assert sf.host_update_bytes_per_param(bf16, "bf16", True) == 20
    assert sf.host_update_bytes_per_param(bf16, "8bit", False) == 16 + 16 / 256
    assert sf.host_update_bytes_per_param(torch.float32, "fp32", True, one_pass=False) == 36
    assert sf.host_state_bytes_per_param("fp32") == 12
    assert sf.host_state_bytes_per_param("bf16") == 8
    assert sf.host_state_bytes_per_param("8bit") == 6 + 8 / 256
    with pytest.raises(ValueError, match="optimizer_state='fp8' is not allowed"):
        sf.check_state_format("fp8")


def _around(values: torch.Tensor) -> torch.Tensor:
    """``values`` and their fp32 neighbours one ulp below and above."""
    return torch.cat([torch.nextafter(values, torch.zeros(())), values,
                      torch.nextafter(values, torch.full((), 2.0))])  # fmt: skip


def _first_step_8bit(kernel, grad: torch.Tensor) -> dict:
    """One kernel step from zero 8-bit moments with beta1 = beta2 = 0 and no learning rate:
    exp_avg is then ``grad`` (where finite) and exp_avg_sq ``grad * grad``, as encoded."""
    st = sf.new_moments("8bit", grad.numel(), sf.n_blocks(grad.numel()))
    kernel.adamw_step_compact(
        [torch.zeros_like(grad)], [st["exp_avg"]], [st["exp_avg_sq"]], [st[sf.ABSMAX[0]]],
        [st[sf.ABSMAX[1]]], [grad], [torch.empty(0)], [1.0], [0], sf.KERNEL_FORMAT["8bit"],
        0.0, 0.0, 0.0, 0.0, EPS, None, None,
    )  # fmt: skip
    return st


def _assert_codes_are_the_references(st: dict, grad: torch.Tensor) -> None:
    """The codes of the moments torch's fused AdamW takes to (exp_avg: the gradient where it
    is finite; exp_avg_sq: its square)."""
    m, v = torch.zeros_like(grad), torch.zeros_like(grad)
    group = {"lr": 0.0, "betas": (0.0, 0.0), "eps": EPS, "weight_decay": 0.0}
    fused_adamw([torch.zeros_like(grad)], [grad], [m], [v], [torch.tensor(0.0)], group)
    for key, absmax, x, signed in [
        ("exp_avg", sf.ABSMAX[0], m, True),
        ("exp_avg_sq", sf.ABSMAX[1], v, False),
    ]:
        q, a = sf.quantize_blockwise(x, signed)
        assert torch.equal(st[absmax].isnan(), a.isnan()), key
        assert torch.equal(st[absmax].nan_to_num(), a.nan_to_num()), key
        assert torch.equal(st[key], q), f"{key}: {(st[key] != q).sum()} codes differ"


def test_8bit_codes_at_their_boundaries(kernel):
    """Every midpoint between two codes, and one ulp either side, through the kernel's 8-bit
    encoding: with beta1 = beta2 = 0 a step's exp_avg is the gradient and exp_avg_sq its
    square, so the codes must be quantize_blockwise's of those. One block holds the code's
    midpoints below its normals (quantized element by element), the others only normals
    (a block whose every element is a normal takes the normals' path)."""
    mids = (sf.code_values(True)[:-1] + sf.code_values(True)[1:]) / 2
    mids = mids[mids < 1.0]  # r = |x| / absmax is at most 1
    normal = mids >= 2.0**-14  # the signed code's normals: at least 2^(1 - 15) of the absmax
    below = _around(mids[~normal])
    above = _around(mids[normal])
    blocks = [torch.cat([below, torch.tensor([0.0, -0.0])]), above[:255], above[255:]]
    assert all(0 < b.numel() < sf.QBLOCK for b in blocks)
    grad = torch.zeros(len(blocks), sf.QBLOCK)
    gen = torch.Generator().manual_seed(0)
    for b, values in enumerate(blocks):
        sign = torch.where(torch.rand(values.numel(), generator=gen) < 0.5, -1.0, 1.0)
        grad[b, 0] = 1.0  # the absmax: r is the value itself
        grad[b, 1 : 1 + values.numel()] = values * sign
        grad[b, 1 + values.numel() :] = 1.0
    grad = grad.reshape(-1)
    _assert_codes_are_the_references(_first_step_8bit(kernel, grad), grad)


def test_8bit_codes_of_nan_and_inf(kernel):
    """A block with a NaN (absmax NaN: every r is |x| itself, a NaN's code the last) and one
    with an inf (exp_avg NaN there, exp_avg_sq's absmax inf: r of inf / inf is NaN), coded as
    quantize_blockwise codes them."""
    torch.manual_seed(0)
    grad = torch.randn(3, sf.QBLOCK) * 1e-3
    grad[0, 5] = float("nan")
    grad[1, 9] = float("inf")
    grad = grad.reshape(-1)
    _assert_codes_are_the_references(_first_step_8bit(kernel, grad), grad)
