"""The result of block discovery: the repeated layers of a model and the parameters outside them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class Block:
    """One repeated layer: the unit of activation policy.

    `name` is the module's qualified name relative to the model given to `discover_blocks`
    (so it matches that model's `named_modules()`), `stack` the qualified name of the list
    it belongs to, `index` its position in that list. `param_names` are the qualified names
    of the parameters this block owns; a parameter shared with an earlier block is owned by
    that earlier block alone.
    """

    name: str
    module: nn.Module
    stack: str
    index: int
    param_names: tuple[str, ...] = ()


@dataclass
class BlockLayout:
    """Blocks in module registration order, the stacks they form, and the other parameters.

    Every parameter of the model (each tied parameter once, under the name
    `named_parameters()` gives it first) is either owned by exactly one block or listed in
    `non_block_param_names`.
    """

    blocks: list[Block]
    non_block_param_names: list[str]
    stacks: list[str] = field(default_factory=list)
    # "generic" (+ "+table:<Class>" per table entry used), "explicit" or "whole_model"
    source: str = "generic"

    def blocks_of(self, stack: str) -> list[Block]:
        return [b for b in self.blocks if b.stack == stack]

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}: {len(self.blocks_of(s))}" for s in self.stacks)
        return (
            f"BlockLayout({len(self.blocks)} blocks in {{{counts}}}, "
            f"{len(self.non_block_param_names)} non-block parameters, source={self.source})"
        )
