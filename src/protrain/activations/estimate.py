"""Bytes a Llama-like decoder layer saves for backward, per policy: a formula, and its measurement.

The formula counts, term by term, the tensors autograd keeps between a layer's forward and
its backward in Hugging Face's Llama-family layers (Llama, Mistral, Qwen2 share the shape):
RMSNorm -> attention with rotary embeddings -> residual -> RMSNorm -> gated MLP -> residual.
``T = batch * seq`` tokens, ``d`` the compute dtype's bytes, ``hd`` the head dim:

- each RMSNorm: its input in fp32 (``T*h*4``), ``rsqrt`` (``T*4``); with a trainable weight
  also the normalized input in ``d`` (``T*h*d``); its output (``T*h*d``) when a consumer
  keeps it (a trainable projection, or a LoRA adapter);
- rotary embedding: ``cos`` and ``sin`` (``2*rope_batch*seq*hd*d``); these are the same
  tensors in every layer, counted per layer here;
- attention, ``sdpa`` (flash-style kernels): q, k, v (k and v at ``kv_heads`` unless
  expanded), the output (``T*h*d``, which is also o_proj's input) and the log-sum-exp
  (``batch*heads*seq*4``); ``eager``: q, k and v expanded to all heads, the fp32 softmax
  (``batch*heads*seq^2*4``), its cast to ``d`` unless ``d`` is 4, and o_proj's input;
- gated MLP: gate output, its activation, up output (``3*T*I*d``), and down's input
  (``T*I*d``) when a consumer keeps it;
- LoRA (frozen base weights, the base projections keep no input): per adapted projection its
  input (shared with the other adapters of the same input when the adapter dtype is ``d``,
  a separate cast copy ``T*in*a`` otherwise) and the rank-r middle (``T*r*a``).

Policies: ``keep`` holds all of it on the device; ``checkpoint`` holds the layer's input
(``T*h*d``); ``swap`` holds it all in host memory; ``offload_checkpoint`` holds the input in
host memory. :func:`measure_saved_bytes` measures the same quantity through
``saved_tensors_hooks`` (unique storages, parameters excluded) for the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from protrain.activations.forward_wrap import wrap_forward
from protrain.activations.policy import ActivationPolicy
from protrain.activations.swap import is_parameter_like

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LlamaLayerShape:
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int | None = None  # hidden // heads when None

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass(frozen=True)
class BlockActivationBytes:
    """Bytes one block holds between its forward and its backward."""

    device_bytes: int
    host_bytes: int


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def saved_bytes_breakdown(
    shape: LlamaLayerShape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    lora_targets: Sequence[str] | None = None,
    lora_rank: int = 0,
    lora_dtype: torch.dtype = torch.float32,
    rope_batch: int = 1,
    expanded_kv: bool = False,
) -> dict[str, int]:
    """The ``keep`` policy's saved bytes of one layer, term by term.

    ``lora_targets`` None means full fine-tuning (every weight trainable); a list names the
    adapted projections of a LoRA model with frozen base weights. ``rope_batch`` is 1 when the
    positions are the same for every row (no ``position_ids`` given), ``batch`` otherwise.
    ``expanded_kv``: sdpa received k and v repeated to all heads (a padding mask given on
    CUDA, where Hugging Face then repeats them); False when sdpa handles grouped heads.
    """
    if attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
        raise ValueError(
            f"attn_implementation={attn_implementation!r}: the formula knows 'sdpa', "
            "'flash_attention_2' and 'eager'"
        )
    s = shape
    T, h, inter, hd, d = s.tokens, s.hidden, s.intermediate, s.hd, _bytes(dtype)
    q_dim, kv_dim = s.heads * hd, s.kv_heads * hd
    full = lora_targets is None
    targets = set(LORA_TARGETS if full else lora_targets)
    unknown = targets - set(LORA_TARGETS)
    if unknown:
        raise ValueError(f"lora_targets {sorted(unknown)} are not projections of a Llama layer")
    a = _bytes(lora_dtype)
    in_dim = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q_dim, "gate_proj": h,
              "up_proj": h, "down_proj": inter}  # fmt: skip

    def kept_by_adapters(names: Sequence[str], shared_bytes: int) -> int:
        """Inputs kept by the adapters of ``names`` (which all read one tensor)."""
        used = [n for n in names if n in targets]
        if not used or full:
            return 0
        if a == d:
            return shared_bytes
        return sum(T * in_dim[n] * a for n in used)

    out: dict[str, int] = {}
    norm = T * h * 4 + T * 4 + (T * h * d if full else 0)
    out["input_norm"] = norm + (T * h * d if full else 0)
    out["input_norm"] += kept_by_adapters(["q_proj", "k_proj", "v_proj"], T * h * d)
    out["rope"] = 2 * rope_batch * s.seq * hd * d
    if attn_implementation == "eager":
        out["attention"] = T * q_dim * d + 2 * T * q_dim * d + s.batch * s.heads * s.seq**2 * 4
        if d != 4:
            out["attention"] += s.batch * s.heads * s.seq**2 * d
        o_input = T * q_dim * d if full else kept_by_adapters(["o_proj"], T * q_dim * d)
        out["attention"] += o_input
    else:
        kv = q_dim if expanded_kv else kv_dim
        out["attention"] = T * q_dim * d + 2 * T * kv * d + T * q_dim * d
        out["attention"] += s.batch * s.heads * s.seq * 4
        if not full and a != d and "o_proj" in targets:
            out["attention"] += T * q_dim * a  # o_proj's adapter casts the attention output
    out["post_attention_norm"] = norm + (T * h * d if full else 0)
    out["post_attention_norm"] += kept_by_adapters(["gate_proj", "up_proj"], T * h * d)
    down_input = T * inter * d if full else kept_by_adapters(["down_proj"], T * inter * d)
    out["mlp"] = 3 * T * inter * d + down_input
    if not full:
        out["lora_middle"] = len(targets) * T * lora_rank * a
    return out


def saved_bytes(shape: LlamaLayerShape, **kwargs) -> int:
    """The ``keep`` policy's saved bytes of one layer (see :func:`saved_bytes_breakdown`)."""
    return sum(saved_bytes_breakdown(shape, **kwargs).values())


def block_activation_bytes(
    shape: LlamaLayerShape,
    policy: ActivationPolicy | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    **kwargs,
) -> BlockActivationBytes:
    """Bytes one layer holds between forward and backward under ``policy``, device and host."""
    policy = ActivationPolicy(policy)
    layer_input = shape.tokens * shape.hidden * _bytes(dtype)
    if policy is ActivationPolicy.CHECKPOINT:
        return BlockActivationBytes(layer_input, 0)
    if policy is ActivationPolicy.OFFLOAD_CHECKPOINT:
        return BlockActivationBytes(0, layer_input)
    kept = saved_bytes(shape, dtype=dtype, **kwargs)
    if policy is ActivationPolicy.SWAP:
        return BlockActivationBytes(0, kept)
    return BlockActivationBytes(kept, 0)


class SavedBytesProbe:
    """Measures, per block, the bytes of the unique storages its forward saves for backward.

    Parameters and their views are not counted. Put it on a model (blocks given as modules),
    run forward passes, read ``bytes_per_block`` (the last call of each block), ``remove()``.
    """

    def __init__(self, blocks: Sequence[nn.Module]):
        self.bytes_per_block = [0] * len(blocks)
        self._undo: list[Callable[[], None]] = []
        for i, block in enumerate(blocks):
            self._undo.append(wrap_forward(block, lambda f, i=i: self._recording(f, i)))

    def _recording(self, forward: Callable, index: int) -> Callable:
        def run(*args, **kwargs):
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor):
                if not is_parameter_like(t):
                    st = t.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(*args, **kwargs)
            self.bytes_per_block[index] = sum(storages.values())
            return out

        return run

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def measure_saved_bytes(blocks: Sequence[nn.Module], run: Callable[[], object]) -> list[int]:
    """Run ``run()`` (a forward) and return the saved bytes of each block's last call."""
    probe = SavedBytesProbe(blocks)
    try:
        run()
    finally:
        probe.remove()
    return probe.bytes_per_block
