"""How the host keeps Adam's moments (``optimizer_state``): fp32 (the default), bf16 or 8 bits.

``fp32`` is ``torch.optim.AdamW``'s state and arithmetic. The other two are opt-in and change
the math, so they are never chosen for the user, and the engine says once what they change:

- ``bf16``: ``exp_avg`` and ``exp_avg_sq`` stored in bf16. Each step decodes them to fp32,
  runs the fp32 update, and rounds them back *stochastically* (up or down with the
  probability of the distance, so unbiased: round-to-nearest would drop every update smaller
  than half a bf16 ulp, and ``exp_avg_sq`` moves by ``1 - beta2 = 1e-3`` of itself a step,
  under bf16's 2^-9). The random bits come from a hash of (the parameter's seed, its step
  count, the element's offset), so the result does not depend on threads, and a resumed
  run draws the same bits as an unbroken one.
- ``8bit``: blockwise, as bitsandbytes' 8-bit Adam (Dettmers et al. 2022): per block of
  :data:`QBLOCK` elements of a parameter one fp32 absmax, and a byte an element of a
  *dynamic* code, relative to the absmax: a floating-point code (``exp_avg``: sign, 4
  exponent and 3 mantissa bits; ``exp_avg_sq``: 5 exponent and 3 mantissa bits), since
  the moments of a block span orders of magnitude, which a linear code would flush to zero.
  It is not bitsandbytes' own map (decimal exponents, a search per element to encode): a
  binary floating-point code encodes from the fp32 bits with a few integer operations and a
  comparison, and keeps 3 significant bits over 2^15 (``exp_avg``) and 2^31
  (``exp_avg_sq``) of range below the absmax. Round to nearest; a nonzero ``exp_avg_sq``
  never encodes to zero (its denominator would be ``eps`` alone: Li et al. 2023, "Memory
  efficient optimizers with 4-bit states").

The master stays fp32 in every format: a bf16 master needs a bf16 compensation term to keep
fp32's small updates (Kahan summation), which is 4 bytes a parameter again.

The formats apply to the offloaded chunks stepped by the host's one pass
(``optim/host_one_pass.py``, the kernel in ``csrc/host_adam.cpp`` and ``csrc/state_codes.h``).
Persistent chunks are stepped on the device with fp32 moments (``optimizer: adamw_8bit``
is the device's 8-bit state); the device step of offloaded chunks (``n_device_step``) and
torch's fallback without the kernel run fp32 state only, and refuse the others. With several
ranks each rank's pass steps the elements it holds: a sharded parameter's 8-bit blocks start
at the rank's first element of it, and its bf16 bits are drawn by the offset in the shard; a
checkpoint holds the moments decoded to fp32 (:func:`reencode_state` encodes them back). The
functions below are the kernel's arithmetic in torch, bit for bit: the tests'
reference, and the conversion of a checkpoint's state where a plan moves a parameter
between the device and the host.
"""

from __future__ import annotations

import zlib

import torch

STATE_FORMATS = ("fp32", "bf16", "8bit")
KERNEL_FORMAT = {"bf16": 1, "8bit": 2}  # adamw_step_compact's format argument
QBLOCK = 256  # elements per absmax of the 8-bit state
MOMENTS = ("exp_avg", "exp_avg_sq")
ABSMAX = ("exp_avg_absmax", "exp_avg_sq_absmax")
_MASK = 0xFFFFFFFF


def check_state_format(state_format: str) -> None:
    if state_format not in STATE_FORMATS:
        raise ValueError(
            f"optimizer_state={state_format!r} is not allowed: use one of "
            f"{', '.join(map(repr, STATE_FORMATS))}"
        )


def check_saved_format(state_dict: dict, state_format: str, where: str = "") -> None:
    """Refuse an optimizer state dict saved with another ``optimizer_state`` (no marker:
    fp32). Not converted: another format changes the math of the resumed run, and a
    compact state read as fp32 moments would be garbage."""
    saved = state_dict.get("optimizer_state", "fp32")
    if saved != state_format:
        raise ValueError(
            f"optimizer state_dict does not match: it was saved with optimizer_state="
            f"{saved!r}, this {where or 'engine'}'s is {state_format!r}; resume with the "
            "optimizer_state (and the chunked engine) it was saved with"
        )


def state_keys(state_format: str) -> set[str]:
    """The keys of one parameter's host state in this format (torch's for fp32 and bf16)."""
    keys = {"step", *MOMENTS}
    return keys | set(ABSMAX) if state_format == "8bit" else keys


def moment_bytes_per_param(state_format: str) -> float:
    """Host bytes of both moments of one parameter (8-bit: the absmaxes included)."""
    return {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8.0 / QBLOCK}[state_format]


def host_state_bytes_per_param(state_format: str) -> float:
    """Host bytes an offloaded trainable parameter's fp32 master and moments hold."""
    return 4.0 + moment_bytes_per_param(state_format)


def host_update_bytes_per_param(
    grad_dtype: torch.dtype, state_format: str, clipping: bool, *, one_pass: bool = True
) -> float:
    """Host memory bytes the update of one offloaded parameter moves a step, as the counter
    ``host_update_bytes`` counts them ([Note: host bytes of the one pass] in
    ``optim/host_one_pass.py``): the gradient read, the master and moments read and written,
    and the weights' copy written (in the gradient's dtype, the dtype the device computes
    in). The one pass unscales and clips as it reads, at no bytes; torch's fused AdamW
    (``one_pass=False``, fp32 state only) reads an fp32 gradient and adds a pass over it to
    clip."""
    check_state_format(state_format)
    if not one_pass:
        if state_format != "fp32":
            raise ValueError(f"optimizer_state={state_format!r} runs only in the one pass")
        return 28.0 + (8.0 if clipping else 0.0)
    g = torch.empty((), dtype=grad_dtype).element_size()
    return g + 8.0 + 2 * moment_bytes_per_param(state_format) + g


def param_seed(name: str) -> int:
    """The seed of a parameter's stochastic rounding: fixed by its name across runs."""
    return zlib.crc32(name.encode())


def new_moments(state_format: str, numel: int, n_blocks: int) -> dict[str, torch.Tensor]:
    """Zero moments of ``numel`` elements (8-bit: with ``n_blocks`` absmaxes each): Adam's
    fresh state in every format (code 0 is 0.0)."""
    if state_format == "fp32":
        return {k: torch.zeros(numel) for k in MOMENTS}
    if state_format == "bf16":
        return {k: torch.zeros(numel, dtype=torch.bfloat16) for k in MOMENTS}
    out = {k: torch.zeros(numel, dtype=torch.uint8) for k in MOMENTS}
    return out | {k: torch.zeros(n_blocks) for k in ABSMAX}


def n_blocks(numel: int) -> int:
    return -(-numel // QBLOCK)


# ---- bf16 with stochastic rounding (csrc/state_codes.h) --------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c`` mod 2^32 for uint32 values held in int64, without int64 overflow."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & _MASK


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 over uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def step_key(step: float, seed: int) -> int:
    """The key of a parameter's step (its count after this step's increment)."""
    x = ((int(step) * 0x9E3779B9) & _MASK) ^ (seed & _MASK)
    return int(mix32(torch.tensor([x], dtype=torch.int64))[0])


def element_bits(key: int, numel: int) -> torch.Tensor:
    """32 random bits of each element (in int64): the low half rounds ``exp_avg``, the
    high half ``exp_avg_sq``."""
    return mix32(torch.arange(numel, dtype=torch.int64) ^ key)


def round_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16, up or down in magnitude by the low 16 of ``bits``; inf stays
    inf, NaN NaN."""
    b = x.contiguous().view(torch.int32).to(torch.int64) & _MASK
    rounded = (b + (bits & 0xFFFF)) >> 16
    special = (b & 0x7F800000) == 0x7F800000
    kept = (b >> 16) | torch.where((b & 0x007FFFFF) != 0, 0x40, 0)
    h = torch.where(special, kept, rounded) & 0xFFFF
    return torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.bfloat16)


# ---- 8-bit blockwise (csrc/state_codes.h) ----------------------------------------------------


def code_values(signed: bool) -> torch.Tensor:
    """The code's magnitudes: index ``E * 8 + M`` is ``2^(E - top) * (1 + M/8)`` (``E >= 1``)
    or ``2^(1 - top) * M/8`` (``E = 0``), with ``top = 2^ebits - 1``, so the largest binade
    is [1, 2) and a block's absmax is exact."""
    ebits = 4 if signed else 5
    top = (1 << ebits) - 1
    idx = torch.arange(8 << ebits)
    e, m = idx >> 3, (idx & 7).double() / 8
    value = torch.where(e == 0, m * 2.0 ** (1 - top), (1 + m) * torch.pow(2.0, (e - top).double()))
    return value.float()


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` (flat) as uint8 codes and one fp32 absmax per block of :data:`QBLOCK`."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x.reshape(-1), (0, n_blocks(n) * QBLOCK - n))
    blocks = blocks.view(-1, QBLOCK)
    absmax = blocks.abs().amax(dim=1)
    a = absmax[:, None]
    r = blocks.abs() / torch.where(a > 0, a, 1.0)  # a block of zeros: every r is 0
    code = code_values(signed)
    mids = (code[:-1] + code[1:]) / 2
    idx = torch.bucketize(r, mids, right=True)
    if signed:
        idx = idx | torch.where(blocks < 0, 0x80, 0)
    else:  # a nonzero second moment never encodes to zero
        idx = torch.where((idx == 0) & (r > 0), 1, idx)
    return idx.to(torch.uint8).reshape(-1)[:n], absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of uint8 codes ``q`` (flat) with their blocks' ``absmax``."""
    n = q.numel()
    idx = q.reshape(-1).long()
    a = absmax.repeat_interleave(QBLOCK)[:n]
    code = code_values(signed)
    if not signed:
        return code[idx] * a
    mag = code[idx & 0x7F] * a
    return torch.where(idx >= 0x80, -mag, mag)


# ---- whole states ----------------------------------------------------------------------------


def decode_state(state_format: str, st: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``exp_avg`` and ``exp_avg_sq`` (flat) of one parameter's state in this format."""
    if state_format == "8bit":
        return (
            dequantize_blockwise(st["exp_avg"], st["exp_avg_absmax"], True),
            dequantize_blockwise(st["exp_avg_sq"], st["exp_avg_sq_absmax"], False),
        )
    return st["exp_avg"].reshape(-1).float(), st["exp_avg_sq"].reshape(-1).float()


def reencode_state(state_format: str, step, m: torch.Tensor, v: torch.Tensor) -> dict:
    """:func:`encode_state` of moments decoded from this format: the same codes again where
    they are laid over the same elements (bf16: exact; 8-bit: each block's absmax element
    decodes to the absmax times the code's 1.0, so the block keeps its absmax, and any other
    code's value divided by it lands within an ulp of the code, far from the midpoints),
    with a ``-0.0`` of ``exp_avg`` given the sign bit (code 0x80, a negative value under the
    least magnitude, decodes to ``-0.0``, which the kernel's rule ``x < 0`` encodes as 0).
    Over other elements (another world size's or chunk layout's shards), a fresh encoding of
    the values (exact for bf16; for 8-bit the blocks move). A block already holding inf or
    NaN does not come back code for code (its moments have diverged)."""
    out = encode_state(state_format, step, m, v)
    if state_format == "8bit":
        negative_zero = (m.reshape(-1) == 0) & torch.signbit(m.reshape(-1))
        out["exp_avg"] = torch.where(negative_zero, out["exp_avg"] | 0x80, out["exp_avg"])
    return out


def encode_state(state_format: str, step, m: torch.Tensor, v: torch.Tensor) -> dict:
    """One parameter's state in this format from fp32 moments (bf16: rounded to nearest,
    as a conversion is done once, not every step)."""
    if state_format == "fp32":
        return {"step": step, "exp_avg": m.float(), "exp_avg_sq": v.float()}
    if state_format == "bf16":
        return {"step": step, "exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16()}
    qm, am = quantize_blockwise(m.float(), True)
    qv, av = quantize_blockwise(v.float(), False)
    return {
        "step": step,
        "exp_avg": qm,
        "exp_avg_sq": qv,
        "exp_avg_absmax": am,
        "exp_avg_sq_absmax": av,
    }
