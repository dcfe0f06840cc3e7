"""What each block does with the activations its forward saves for backward.

The knobs are counts, ``n_swap`` and ``n_checkpoint``; :func:`place_policies` turns them
into one policy per block by the paper's rule:

- swapped blocks first: the first blocks' activations are needed last in backward, which
  leaves the most time to bring them back from host memory;
- checkpointed blocks interleaved with them: a recomputation is compute during which swap
  traffic of the neighbouring blocks can run;
- kept blocks last: their activations are the first needed in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class ActivationPolicy(str, Enum):
    KEEP = "keep"
    """Saved tensors stay on the device (plain PyTorch)."""
    CHECKPOINT = "checkpoint"
    """Only the block's inputs are held; the block is recomputed in backward."""
    SWAP = "swap"
    """Saved tensors go to (pinned) host memory during forward and come back ahead of backward."""
    OFFLOAD_CHECKPOINT = "offload_checkpoint"
    """Checkpoint whose held input lives in host memory until the recomputation."""


def place_policies(
    n_blocks: int,
    n_swap: int = 0,
    n_checkpoint: int = 0,
    *,
    offload_checkpoint_inputs: bool = False,
) -> list[ActivationPolicy]:
    """One policy per block, in forward order, from the counts ``n_swap`` and ``n_checkpoint``.

    The first ``n_swap + n_checkpoint`` blocks are swapped or checkpointed; within them the
    swapped blocks are spread evenly (block ``round(k * (n_swap + n_checkpoint) /
    n_swap)`` for ``k < n_swap``), the first block being swapped (when ``n_swap > 0``).
    The other blocks are kept. With ``offload_checkpoint_inputs`` the checkpointed blocks
    hold their inputs in host memory (``OFFLOAD_CHECKPOINT``).
    """
    for name, value in (("n_blocks", n_blocks), ("n_swap", n_swap), ("n_checkpoint", n_checkpoint)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} is not allowed: use an integer >= 0")
    if n_swap + n_checkpoint > n_blocks:
        raise ValueError(
            f"n_swap={n_swap} + n_checkpoint={n_checkpoint} is more than the model's "
            f"{n_blocks} blocks"
        )
    recompute = (
        ActivationPolicy.OFFLOAD_CHECKPOINT
        if offload_checkpoint_inputs
        else ActivationPolicy.CHECKPOINT
    )
    n_managed = n_swap + n_checkpoint
    policies = [ActivationPolicy.KEEP] * n_blocks
    for i in range(n_managed):
        policies[i] = recompute
    for k in range(n_swap):  # k * n_managed / n_swap, rounded half up
        policies[(2 * k * n_managed + n_swap) // (2 * n_swap)] = ActivationPolicy.SWAP
    return policies


def as_policies(policies: Sequence[ActivationPolicy | str]) -> list[ActivationPolicy]:
    """Read policies given as enum members or their string values; a bad name is an error."""
    out = []
    for i, p in enumerate(policies):
        try:
            out.append(ActivationPolicy(p))
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in ActivationPolicy)
            raise ValueError(f"policies[{i}]={p!r} is not a policy: use one of {allowed}") from None
    return out
