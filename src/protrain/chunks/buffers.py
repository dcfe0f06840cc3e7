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

A module's call holds, besides its own parameters, those of every module around it that
is running (each pins its chunks from its pre-hook to its post-hook, and through its
backward until its gradients are accumulated): the Mamba mixer holds ``A_log`` and ``D``
while its ``in_proj`` runs, SigLIP's pooling head its ``probe`` around its attention.

A recomputed (checkpointed) block needs more: its recompute runs while the module whose
backward started it, a module of the same block, still holds its chunks, and a head tied to
the input embedding keeps the embedding's chunk held until the embedding's own gradient
arrives at the end of backward. So with recompute a block needs the most chunks any two of
its modules hold together (:func:`recompute_held_chunks`: Jamba's experts span two chunks
and start the recompute of a mixer spanning two others), and never fewer than one chunk
more than a module's own; one more again for a tied head (:func:`recompute_extra_chunks`;
without them Pegasus, Marian, Qwen3-MoE, Mixtral, OLMoE and Jamba fail in the first
backward under the module rule); a block group holds its whole block already.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from protrain.model.blocks import discover_blocks
from protrain.model.readers import direct_reads, has_forward


def resident_groups(model: nn.Module, blocks: list | None = None) -> list[tuple[str, ...]]:
    """Parameter names (full) that are resident together: each module's own parameters,
    with those of the modules around it that are called (they hold theirs through the
    call) and those that they read without calling their owners (``direct_reads``: such a
    reader holds them for its whole call, its children's calls included), and every
    parameter of a block that holds frozen ones. A module of a block gives a
    :class:`ModuleGroup` that names its block. Independent of the chunk size, so the
    planner reads it once for every candidate size. ``blocks``: the model's discovered
    blocks, when the caller has them."""
    reads = direct_reads(model).groups
    if blocks is None:
        try:
            blocks = discover_blocks(model).blocks
        except ValueError:  # no block stack: the module rule is all there is
            blocks = []
    block_of = {f"{b.name}.{n}" if n else b.name: i for i, b in enumerate(blocks)
                for n, _ in b.module.named_modules(remove_duplicate=False)}  # fmt: skip
    modules = dict(model.named_modules(remove_duplicate=False))
    groups = []
    for mname, module in modules.items():
        names = _own_names(mname, module)
        parts = mname.split(".") if mname else []
        for i in range(len(parts)):  # the modules around it, called with it
            outer = ".".join(parts[:i])
            if has_forward(modules[outer]):
                names += _own_names(outer, modules[outer])
        for i in range(len(parts) + 1):
            names += reads.get(".".join(parts[:i]), ())
        if names:
            groups.append(ModuleGroup(names, block_of.get(mname)))
    for block in blocks:
        if not all(p.requires_grad for p in block.module.parameters()):
            groups.append(BlockGroup(block.param_names))
    return groups


def _own_names(mname: str, module: nn.Module) -> tuple[str, ...]:
    prefix = f"{mname}." if mname else ""
    return tuple(prefix + n for n, _ in module.named_parameters(recurse=False))


class ModuleGroup(tuple):
    """What one module's call holds; ``block``: the index of the block it belongs to, None
    outside the block stack (never recomputed)."""

    def __new__(cls, names: tuple[str, ...], block: int | None = None):
        group = super().__new__(cls, names)
        group.block = block
        return group

    def __reduce__(self):
        return (ModuleGroup, (tuple(self), self.block))


class BlockGroup(tuple):
    """A block's parameter names held together (the block holds frozen parameters): a
    recompute of the block needs no chunk beyond them, unlike a module's group."""


def min_resident_chunks(
    model: nn.Module,
    chunk_of: dict[str, int],
    groups: Sequence[Sequence[str]] | None = None,
    recompute_extra: int = 0,
) -> int:
    """Most chunks of `chunk_of` (parameter name -> chunk index, offloaded chunks only)
    that one module, or one block holding frozen parameters, needs resident at once.
    ``groups``: :func:`resident_groups` of ``model``, when the caller has it already.
    ``recompute_extra``: with recomputed blocks, :func:`recompute_extra_chunks`: chunks a
    recompute holds besides a module's own, one of them the starting module's, which
    :func:`recompute_held_chunks` counts exactly; a block group holds its whole block."""

    def need(g) -> int:
        n = len({chunk_of[name] for name in g if name in chunk_of})
        return n if isinstance(g, BlockGroup) or n == 0 else n + recompute_extra

    if groups is None:
        groups = resident_groups(model)
    most = max((need(g) for g in groups), default=0)
    if recompute_extra:
        most = max(most, recompute_held_chunks(groups, chunk_of) + recompute_extra - 1)
    return most


def recompute_held_chunks(groups: Sequence[Sequence[str]], chunk_of: dict[str, int]) -> int:
    """Most chunks two modules of one block hold together: the module whose backward
    starts the block's recompute, and a module the recompute calls."""
    per_block: dict[int, set[frozenset[int]]] = {}
    for g in groups:
        if isinstance(g, ModuleGroup) and g.block is not None:
            chunks = frozenset(chunk_of[name] for name in g if name in chunk_of)
            per_block.setdefault(g.block, set()).add(chunks)
    return max((len(a | b) for held in per_block.values() for a in held for b in held), default=0)


def recompute_extra_chunks(tied_head: bool) -> int:
    """Chunks a recompute holds besides a module's own: at least one of the module whose
    backward started it (:func:`recompute_held_chunks` counts all of them), and a tied
    head's embedding chunk (where offloaded), held through backward."""
    return 1 + (1 if tied_head else 0)


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head (``get_output_embeddings()``), None where it has none:
    transformers' base class raises NotImplementedError for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None
    return head if isinstance(head, nn.Module) else None


def tied_head_chunk(model: nn.Module, chunk_of: dict[str, int]) -> int | None:
    """The chunk of the output head's weight (``get_output_embeddings()``) where that
    weight is one parameter under several names (tied to the input embedding, as small
    Llama-3.2 and Qwen2.5 models are); None for an untied head or a model without one."""
    weight = getattr(output_head(model), "weight", None)
    if not isinstance(weight, nn.Parameter):
        return None
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]
    if len(names) < 2:
        return None
    return next((chunk_of[n] for n in names if n in chunk_of), None)
