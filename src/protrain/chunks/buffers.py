"""The fewest offloaded chunks that must be resident on the device at once.

The runtime gathers a module's chunks before the module runs and keeps them until the
module's backward is done: a chunk of trainable parameters is let go once their gradients
are accumulated, a chunk of frozen parameters (LoRA bases) only once the gradient of the
module's inputs arrives. Two things bound how many offloaded chunks are resident together:
the chunks holding what one module's call brings in (its own parameters and those its
forward reads without calling their module: ``protrain.model.readers``), and, in a block
that holds frozen parameters, the chunks the whole block spans (its projections wait for
the same input gradients, so their chunks are held together). A buffer pool smaller than
this fails in the middle of a step; `protrain.wrap` and the planner check it before
anything moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from protrain.model.readers import direct_reads


def resident_groups(model: nn.Module, blocks: list | None = None) -> list[tuple[str, ...]]:
    """Parameter names (full) that are resident together: each module's own parameters,
    with those that the modules around it read without calling their owners
    (``direct_reads``: such a reader holds them for its whole call, its children's calls
    included), and every parameter of a block that holds frozen ones. Independent of the
    chunk size, so the planner reads it once for every candidate size. ``blocks``: the
    model's discovered blocks, when the caller has them."""
    reads = direct_reads(model).groups
    groups = []
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        names = tuple(prefix + n for n, _ in module.named_parameters(recurse=False))
        if reads:
            parts = mname.split(".") if mname else []
            for i in range(len(parts) + 1):
                names += reads.get(".".join(parts[:i]), ())
        if names:
            groups.append(names)
    if blocks is None:
        try:
            from protrain.model.blocks import discover_blocks

            blocks = discover_blocks(model).blocks
        except ValueError:  # no block stack: the module rule is all there is
            blocks = []
    for block in blocks:
        if not all(p.requires_grad for p in block.module.parameters()):
            groups.append(tuple(block.param_names))
    return groups


def min_resident_chunks(
    model: nn.Module, chunk_of: dict[str, int], groups: Sequence[Sequence[str]] | None = None
) -> int:
    """Most chunks of `chunk_of` (parameter name -> chunk index, offloaded chunks only)
    that one module, or one block holding frozen parameters, needs resident at once.
    ``groups``: :func:`resident_groups` of ``model``, when the caller has it already."""
    if groups is None:
        groups = resident_groups(model)
    return max((len({chunk_of[n] for n in g if n in chunk_of}) for g in groups), default=0)
