"""Put a policy on each block of a model, and take it off again.

Each block gets a forward wrapper (``activations/forward_wrap.py``): the block's ``forward``
attribute, on that instance only, becomes the policy's function around the original forward,
and :meth:`ActivationHandle.remove` restores the original attribute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from protrain.activations.checkpoint import checkpointed_forward
from protrain.activations.forward_wrap import wrap_forward
from protrain.activations.offload_checkpoint import offload_checkpointed_forward
from protrain.activations.policy import ActivationPolicy, as_policies, place_policies
from protrain.activations.swap import ActivationSwapper, swapped_forward
from protrain.activations.tiled_mlp import TiledMLPHandle, apply_tiled_mlp
from protrain.model.blocks import discover_blocks
from protrain.model.layout import BlockLayout

log = logging.getLogger(__name__)


@dataclass
class ActivationHandle:
    """The policies applied to a model; :meth:`remove` takes them all off."""

    model: nn.Module
    block_names: list[str]
    policies: list[ActivationPolicy]
    swapper: ActivationSwapper | None
    tiled_mlp: TiledMLPHandle | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def policy_of(self) -> dict[str, ActivationPolicy]:
        return dict(zip(self.block_names, self.policies))

    def remove(self) -> None:
        if self.swapper is not None:
            self.swapper.synchronize()
        if self.tiled_mlp is not None:
            self.tiled_mlp.remove()
            self.tiled_mlp = None
        while self._undo:
            self._undo.pop()()
        if getattr(self.model, "_protrain_activations", None) is self:
            del self.model._protrain_activations


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def apply_activation_policies(
    model: nn.Module,
    policies: Sequence[ActivationPolicy | str] | Mapping[str, ActivationPolicy | str],
    *,
    device: torch.device | str | None = None,
    layout: BlockLayout | None = None,
    tiled_mlp_tokens: int | None = None,
    swap_max_in_flight_bytes: int = 1 << 30,
    swap_prefetch_groups: int = 1,
) -> ActivationHandle:
    """Apply one activation policy per block of ``model`` (blocks from ``discover_blocks``).

    ``policies`` is a list in block order (e.g. from :func:`place_policies`) or a mapping from
    block name to policy (blocks not named are kept). ``device`` is the compute device (the
    device of the first parameter when not given). ``tiled_mlp_tokens``, when set, also
    computes every block's MLP over sequence tiles of that many tokens.
    """
    if getattr(model, "_protrain_activations", None) is not None:
        raise RuntimeError(
            "apply_activation_policies: this model already has activation policies; "
            "call .remove() on the handle first"
        )
    layout = layout or discover_blocks(model)
    names = [b.name for b in layout.blocks]
    if isinstance(policies, Mapping):
        unknown = sorted(set(policies) - set(names))
        if unknown:
            raise ValueError(f"policies name blocks {unknown[:5]} that the model does not have")
        chosen = as_policies([policies.get(n, ActivationPolicy.KEEP) for n in names])
    else:
        chosen = as_policies(policies)
        if len(chosen) != len(names):
            raise ValueError(
                f"{len(chosen)} policies given for the model's {len(names)} blocks ({layout!r})"
            )
    device = torch.device(device) if device is not None else _device_of(model)
    needs_host = {ActivationPolicy.SWAP, ActivationPolicy.OFFLOAD_CHECKPOINT}
    swapper = (
        ActivationSwapper(
            device,
            max_in_flight_bytes=swap_max_in_flight_bytes,
            prefetch_groups=swap_prefetch_groups,
        )
        if needs_host & set(chosen)
        else None
    )
    handle = ActivationHandle(model, names, chosen, swapper)
    try:
        _apply(handle, layout, tiled_mlp_tokens)
    except BaseException:
        handle.remove()  # nothing half-applied stays on the model
        raise
    model._protrain_activations = handle
    log.info(
        "activation policies: %s",
        ", ".join(f"{p.value}={chosen.count(p)}" for p in ActivationPolicy),
    )
    return handle


def _apply(handle: ActivationHandle, layout: BlockLayout, tiled_mlp_tokens: int | None) -> None:
    swapper = handle.swapper
    for block, policy in zip(layout.blocks, handle.policies):
        if (
            getattr(block.module, "gradient_checkpointing", False)
            and policy is not ActivationPolicy.KEEP
        ):
            log.warning(
                "block %s also has the library's own gradient checkpointing on; policy %s "
                "applies on top of it",
                block.name,
                policy.value,
            )
        if policy is ActivationPolicy.CHECKPOINT:
            handle._undo.append(wrap_forward(block.module, checkpointed_forward))
        elif policy is ActivationPolicy.SWAP:
            handle._undo.append(wrap_forward(block.module, lambda f: swapped_forward(f, swapper)))
        elif policy is ActivationPolicy.OFFLOAD_CHECKPOINT:
            handle._undo.append(
                wrap_forward(block.module, lambda f: offload_checkpointed_forward(f, swapper))
            )
    if tiled_mlp_tokens is not None:
        handle.tiled_mlp = apply_tiled_mlp(
            handle.model, tile_tokens=tiled_mlp_tokens, layout=layout
        )


def apply_activation_knobs(
    model: nn.Module,
    n_swap: int = 0,
    n_checkpoint: int = 0,
    *,
    device: torch.device | str | None = None,
    offload_checkpoint_inputs: bool = False,
    tiled_mlp_tokens: int | None = None,
    layout: BlockLayout | None = None,
) -> ActivationHandle:
    """The plan's knobs applied: :func:`place_policies` over the model's blocks, then
    :func:`apply_activation_policies`. Blocks of several stacks (an encoder and a decoder,
    a vision tower and a language model) are placed as one sequence, in discovery order."""
    layout = layout or discover_blocks(model)
    policies = place_policies(
        len(layout.blocks),
        n_swap,
        n_checkpoint,
        offload_checkpoint_inputs=offload_checkpoint_inputs,
    )
    return apply_activation_policies(
        model, policies, device=device, layout=layout, tiled_mlp_tokens=tiled_mlp_tokens
    )
