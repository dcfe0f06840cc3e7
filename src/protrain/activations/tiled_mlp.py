"""Tiled MLP: each block's MLP (and its own norms) computed over sequence tiles.

The MLP of a decoder layer makes intermediate tensors ``intermediate_size / hidden_size``
times (3 to 5 times) larger than its input, and keeps several of them for backward. Here the
MLP's forward is called on tiles of ``tile_tokens`` positions along the sequence dimension
(dim -2 of a ``(..., seq, hidden)`` input), each tile under a non-reentrant checkpoint: in
forward only one tile's intermediates exist at a time, and in backward each tile is
recomputed when its gradient arrives and freed before the next (autograd runs the nodes of
the most recent tile first). The MLP is token-wise, so the result is the same function;
gradients of its weights are summed over tiles by autograd before they are accumulated, so
hooks on parameter gradients (the chunk runtime's gradient offload, FSDP's reduce-scatter)
still fire once per backward.

[Note: tiled norms]
The block's own norms (its direct children that are RMSNorm or LayerNorm modules: a Llama
layer's ``input_layernorm`` and ``post_attention_layernorm``), and those beside the stack of
blocks (the decoder's final ``norm``), are tiled the same way. They
are token-wise too, and at long sequences they, not the MLP, set the peak: Hugging Face's
RMSNorm computes in fp32, and its backward holds about seven fp32 copies of the hidden
states at once. Measured on the CPU (``benchmarks/activation_census.py``: two
Llama-3-8B-shaped layers, LoRA r=16, offload-checkpoint, MLP tiled, 4,096 tokens): the
step's peak was 165.6 KB a token, 112 KB of it fp32 hidden-sized tensors inside a norm's
backward; with the norms tiled, 95.3 KB. Norms inside the attention (Qwen3's ``q_norm``) run over heads,
not tokens, and are left alone.

[Note: what tiling rounds differently]
In fp32 the tiled forward is bit for bit the untiled one where a row's matmul result does
not depend on the other rows (so on the CPU, measured on Llama), and where the MLP has no
active dropout: each tile draws its own mask, of the same distribution as the untiled call's
but not the same draws (recomputation replays each tile's, so backward matches forward). Backward differs only in the order of fp32 sums: a weight's
gradient is summed per tile and then over tiles, and a tiled norm's input gradient is
grouped ``r + (a + b)`` (residual, then the tile's two uses inside the norm) where the
untiled graph adds ``(r + a) + b``; in bf16 and fp16 the norm's upcast isolates its uses
and the grouping is the same. Guaranteed: every gradient within 1e-6 of the tensor's
largest gradient (at least 1). Not guaranteed to a fixed number: parameters after AdamW
steps, because Adam divides each element's update by the root of its squared gradients, so
an element whose gradient is near zero moves by up to ``lr`` on a rounding-sized
difference; plain fp32 training is itself that far from exact arithmetic. The tolerance is
therefore relative to fp32's own rounding: against the same training in float64, tiled
parameters are off by at most 3 times plain PyTorch's RMS error and 5 times its largest
error (``tests/families/test_tiled.py``; measured at most 2.1 and 3.6). The untiled matmul's
own summation order is the BLAS library's, which no per-tile sum can follow; within fp32's
own rounding is as tight as tiling allows.

[Note: tiles under torch.distributed]
No collective is issued here, with or without a process group: ranks may even tile
different sequence lengths. Tiles call the MLP's original ``forward`` function, not the
module, so hooks on the MLP module itself (an FSDP2 ``fully_shard`` unit, the chunk
runtime's gather) run once per MLP call, not once per tile. Hooks on the MLP's children run
once per tile; a child that is its own FSDP unit would all-gather once per tile (and again
per tile in the recomputation), so that placement is refused with an error: shard the
decoder layer or the MLP as a whole. With the whole layer (or the MLP) as one FSDP unit, its
parameters are unsharded once before forward and once before backward, and every tile's
forward and recomputation runs inside that window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from protrain.activations.forward_wrap import wrap_forward
from protrain.model.blocks import discover_blocks
from protrain.model.layout import BlockLayout

MLP_NAMES = ("mlp", "feed_forward", "ffn")


def tiled_forward(forward: Callable, tile_tokens: int) -> Callable:
    """``forward`` (token-wise, one tensor in and one out) run over sequence tiles."""

    def run(x, *args, **kwargs):
        if args or kwargs or not torch.is_tensor(x) or x.dim() < 2 or x.shape[-2] <= tile_tokens:
            return forward(x, *args, **kwargs)
        tiles = x.split(tile_tokens, dim=-2)

        def run_tile(t):
            # A tile of a batch of several sequences is a strided view; modules that .view()
            # their input (GPT-2's Conv1D) need it contiguous. Copied inside the checkpoint,
            # so that only the view is kept for backward, not a copy of every tile.
            return forward(t.contiguous())

        if torch.is_grad_enabled():
            outs = [checkpoint(run_tile, t, use_reentrant=False) for t in tiles]
        else:
            outs = [run_tile(t) for t in tiles]
        if not all(
            torch.is_tensor(o) and o.shape[:-1] == t.shape[:-1] for o, t in zip(outs, tiles)
        ):
            raise TypeError(
                "tiled MLP: the MLP must map a (..., seq, hidden) tensor to one tensor of the "
                f"same leading shape; got {type(outs[0]).__name__} (e.g. a mixture-of-experts "
                "layer returning router logits): do not tile this model's MLP"
            )
        return torch.cat(outs, dim=-2)

    return run


def _fsdp_children(mlp: nn.Module) -> list[str]:
    kinds: list[type] = []
    try:
        # torch may be built without torch.distributed (the ImportError below)
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # torch built without distributed
        return []
    return [n for n, m in mlp.named_modules() if n and isinstance(m, tuple(kinds))]


@dataclass
class TiledMLPHandle:
    mlp_names: list[str]
    norm_names: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def find_mlp(block: nn.Module, names: tuple[str, ...] = MLP_NAMES) -> tuple[str, nn.Module] | None:
    for name in names:
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            return name, m
    return None


def block_norms(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block's own norms: direct children that are RMSNorm or LayerNorm modules over
    the last dimension only (leaf modules: a class named ``...LayerNorm`` that is a whole
    layer, as in Wav2Vec2's ``...EncoderLayerStableLayerNorm``, is not a norm)."""
    kinds = tuple(k for k in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if k is not None)
    found = []
    for name, m in block.named_children():
        named = type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
        shape = getattr(m, "normalized_shape", None)
        last_dim_only = shape is None or isinstance(shape, int) or len(shape) == 1
        if (isinstance(m, kinds) or named) and not any(m.children()) and last_dim_only:
            found.append((name, m))
    return found


def apply_tiled_mlp(
    model: nn.Module,
    *,
    tile_tokens: int,
    layout: BlockLayout | None = None,
    mlp_names: tuple[str, ...] = MLP_NAMES,
    norms: bool = True,
) -> TiledMLPHandle:
    """Tile the MLP of every block (its child named one of ``mlp_names``) by ``tile_tokens``,
    and with ``norms`` the block's own norms (see [Note: tiled norms]).

    A block without such a child is an error: name the MLP attribute with ``mlp_names``.
    """
    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r} is not allowed: use an integer >= 1")
    layout = layout or discover_blocks(model)
    handle = TiledMLPHandle([])
    for block in layout.blocks:
        found = find_mlp(block.module, mlp_names)
        if found is None:
            handle.remove()
            raise ValueError(
                f"tiled MLP: block {block.name} ({type(block.module).__name__}) has no child "
                f"named any of {mlp_names}; pass mlp_names=(...) naming its MLP"
            )
        name, mlp = found
        sharded = _fsdp_children(mlp)
        if sharded:
            handle.remove()
            raise ValueError(
                f"tiled MLP: {block.name}.{name} has FSDP units inside it ({sharded[:3]}), "
                "which would all-gather once per tile; shard the decoder layer or the MLP "
                "as a whole"
            )
        handle._undo.append(wrap_forward(mlp, lambda f: tiled_forward(f, tile_tokens)))
        handle.mlp_names.append(f"{block.name}.{name}")
        for norm_name, norm in block_norms(block.module) if norms else []:
            handle._undo.append(wrap_forward(norm, lambda f: tiled_forward(f, tile_tokens)))
            handle.norm_names.append(f"{block.name}.{norm_name}")
    # the norms beside each block stack (a decoder's final norm, GPT-2's ln_f); "" is the
    # model itself (a bare LlamaModel's layers)
    owners = {b.stack.rpartition(".")[0] for b in layout.blocks}
    for owner in sorted(owners) if norms else []:
        for norm_name, norm in block_norms(model.get_submodule(owner)):
            handle._undo.append(wrap_forward(norm, lambda f: tiled_forward(f, tile_tokens)))
            handle.norm_names.append(f"{owner}.{norm_name}" if owner else norm_name)
    return handle
