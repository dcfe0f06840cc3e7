"""Block discovery: find the repeated layers of a model and the parameters outside them.

The generic rule: a *block stack* is an `nn.ModuleList` or `nn.Sequential` of at least two
*layers*, where a layer is a module that holds parameters and has submodules of its own (a
bare `nn.Linear`, or a PEFT adapter around one, is not a layer), and at least one layer
class occurs twice. Layers of different classes side by side (attention next to linear
attention or state-space layers) are one stack. The walk goes from the root down and stops
at the first stack on each path, so the outermost lists win: an MoE's list of experts inside
a decoder layer is part of that layer, and each of T5's `encoder.block` and `decoder.block`
or a VLM's vision-tower and text stacks is found on its own path.

Where the rule misreads a module, `known_stacks.KNOWN_STACKS` names the stacks inside it by
its class name, and the walk takes those for that module's subtree. A caller can also name
all stacks with `stacks=[...]`. A model with no stack
raises `BlockDiscoveryError` unless the caller asks for `on_no_stack="whole_model"`, which
makes the whole model one block.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from torch import nn

from protrain.model.known_stacks import KNOWN_STACKS
from protrain.model.layout import Block, BlockLayout

logger = logging.getLogger(__name__)

_STACK_TYPES = (nn.ModuleList, nn.Sequential)


class BlockDiscoveryError(ValueError):
    """The model's blocks cannot be read: no stack found, or a named stack is not one."""


def discover_blocks(
    model: nn.Module,
    *,
    stacks: Sequence[str] | None = None,
    on_no_stack: Literal["error", "whole_model"] = "error",
) -> BlockLayout:
    """Return the blocks of `model` (any wrapper included, e.g. a PEFT `PeftModel`).

    Names are qualified relative to `model` itself, so they match `model.named_modules()`
    and `model.named_parameters()`. `stacks` names the stacks explicitly and skips the
    rule and the table.
    """
    if stacks is not None:
        stack_paths, source = list(stacks), "explicit"
        _check_explicit_stacks(model, stack_paths)
    else:
        stack_paths, tables = _find_stacks(model)
        source = "+".join(["generic", *(f"table:{t}" for t in tables)])

    if not stack_paths:
        if on_no_stack == "whole_model":
            logger.warning(
                "no repeated layers found in %s; treating the whole model as one block",
                type(model).__name__,
            )
            return _whole_model_layout(model)
        raise BlockDiscoveryError(
            f"no repeated layers found in {type(model).__name__}: looked for an nn.ModuleList "
            "or nn.Sequential of at least 2 layers (modules with parameters and submodules), "
            "at least two of one class. Name the stacks with discover_blocks(model, "
            "stacks=['path.to.layers']), add the module's class to "
            "protrain.model.known_stacks.KNOWN_STACKS, or pass on_no_stack='whole_model' "
            "to make the whole model one block."
        )

    blocks = [
        Block(name=_join(path, str(i)), module=layer, stack=path, index=i)
        for path in stack_paths
        for i, layer in enumerate(_get(model, path).children())
    ]
    return _assign_parameters(model, blocks, stack_paths, source)


def _find_stacks(model: nn.Module) -> tuple[list[str], list[str]]:
    """Stack paths, outermost first on each path; and the table entries that were used."""
    found: list[str] = []
    tables: list[str] = []
    seen: set[int] = set()

    def visit(module: nn.Module, path: str) -> None:
        if id(module) in seen:  # a module shared between two parents is read once
            return
        seen.add(id(module))
        known = KNOWN_STACKS.get(type(module).__name__)
        if known is not None:
            paths = [_join(path, s) for s in known]
            _check_explicit_stacks(model, paths)
            found.extend(paths)
            tables.append(type(module).__name__)
        elif _is_block_stack(module):
            found.append(path)
        else:
            for name, child in module.named_children():
                visit(child, _join(path, name))

    visit(model, "")
    return found, tables


def _is_block_stack(module: nn.Module) -> bool:
    if not isinstance(module, _STACK_TYPES):
        return False
    children = list(module.children())
    if len(children) < 2 or not all(_is_layer(c) for c in children):
        return False
    return max(Counter(type(c) for c in children).values()) >= 2


def _is_layer(module: nn.Module) -> bool:
    if _is_adapter_leaf(module) or next(module.children(), None) is None:
        return False
    return next(module.parameters(), None) is not None


def _is_adapter_leaf(module: nn.Module) -> bool:
    try:
        # optional here: the engine runs without peft (then no module is an adapter)
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(module, BaseTunerLayer)


def _check_explicit_stacks(model: nn.Module, stack_paths: list[str]) -> None:
    for path in stack_paths:
        try:
            module = _get(model, path)
        except AttributeError as e:
            raise BlockDiscoveryError(f"stack {path!r} is not a submodule of the model") from e
        if not isinstance(module, _STACK_TYPES) or len(module) == 0:
            raise BlockDiscoveryError(
                f"stack {path!r} is a {type(module).__name__}, not a non-empty "
                "nn.ModuleList or nn.Sequential"
            )
    for a in stack_paths:
        for b in stack_paths:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise BlockDiscoveryError(f"stack {b!r} lies inside stack {a!r}")


def _assign_parameters(
    model: nn.Module, blocks: list[Block], stack_paths: list[str], source: str
) -> BlockLayout:
    # named_parameters() lists a tied parameter once, under its first name: that name is
    # the parameter's name here too, and the first block holding it owns it.
    canonical = {id(p): name for name, p in model.named_parameters()}
    owner: set[int] = set()
    owned_blocks = []
    for block in blocks:
        names = []
        for p in block.module.parameters():
            if id(p) not in owner:
                owner.add(id(p))
                names.append(canonical[id(p)])
        owned_blocks.append(Block(block.name, block.module, block.stack, block.index, tuple(names)))
    non_block = [name for pid, name in canonical.items() if pid not in owner]
    return BlockLayout(owned_blocks, non_block, stack_paths, source)


def _whole_model_layout(model: nn.Module) -> BlockLayout:
    names = tuple(name for name, _ in model.named_parameters())
    return BlockLayout([Block("", model, "", 0, names)], [], [""], "whole_model")


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
