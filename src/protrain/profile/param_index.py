"""What the planner reads from a model's parameters, in one walk of its modules.

The chunk-size search (``plan.chunk_size``) re-derives a chunk table for every candidate size
from the parameters' shapes, the groups of them resident together and the blocks holding
them. None of that depends on the chunk size, but walking the modules does cost: on a
100-block LoRA model it was four fifths of a search over seven sizes that walked them once
per size (``benchmarks/search_time.py``). So it is read once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from protrain.chunks.buffers import resident_groups
from protrain.chunks.layout import params_in_order, storage_dtype
from protrain.model.blocks import discover_blocks
from protrain.quant.four_bit import lift_quant_state


@dataclass(frozen=True)
class ParamIndex:
    # each parameter once, with all its names, in execution order (layout.params_in_order)
    params: list[tuple[list[str], nn.Parameter]]
    # names resident together (chunks.buffers.resident_groups)
    groups: list[tuple[str, ...]]
    # per block of the stack, every name of its parameters (trace.chunk_first_blocks); None
    # when the model has no block stack
    block_names: list[list[str]] | None
    _arrays: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def arrays(self, compute_dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per parameter of ``params``: elements, bytes as stored in ``compute_dtype``
        (``layout.storage_dtype``), trainable; read once per dtype and read-only. Like the
        whole index, a snapshot: build a new index after changing the model."""
        if compute_dtype not in self._arrays:
            ps = [p for _, p in self.params]
            numel = np.asarray([p.numel() for p in ps], dtype=np.int64)
            size = [storage_dtype(p, compute_dtype).itemsize for p in ps]
            trainable = np.asarray([p.requires_grad for p in ps], dtype=bool)
            arrays = (numel, numel * np.asarray(size, np.int64), trainable)
            for a in arrays:
                a.setflags(write=False)
            self._arrays[compute_dtype] = arrays
        return self._arrays[compute_dtype]


def block_param_names(blocks) -> list[list[str]]:
    """Per block, the full names of its parameters, shared ones under every name."""
    return [
        [f"{b.name}.{n}" for n, _ in b.module.named_parameters(remove_duplicate=False)]
        for b in blocks
    ]


def param_index(model: nn.Module) -> ParamIndex:
    """The index of ``model``, 4-bit layers' scales lifted first (as ``protrain.wrap`` does,
    so that it lists what the chunks will hold)."""
    lift_quant_state(model)
    try:
        blocks = discover_blocks(model).blocks
    except ValueError:  # no block stack
        return ParamIndex(params_in_order(model), resident_groups(model, []), None)
    return ParamIndex(
        params_in_order(model), resident_groups(model, blocks), block_param_names(blocks)
    )
