"""The engine's two small policy values: :class:`Knobs` (where model states and activations
go: what the planner decides and the engine executes) and :class:`OptimizerSettings` (the
optimizer the engine builds). The config, the planner (``protrain.plan``), ``protrain.wrap``,
the engine and the integrations all pass these values; none re-declares their fields.

A leaf module (no torch, no other protrain module): the engine imports it, and so does the
planner, which sits above the engine (``protrain.plan`` traces under it), so the types cannot
live in ``protrain.plan`` without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# The knobs the planner's search ranges over (a candidate row's knobs; ``Plan.knobs``).
SEARCHED = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")
# Fixable besides SEARCHED: chosen after them for the best of them (``plan/search.py``).
DEVICE_STEP = "n_device_step"


@dataclass(frozen=True)
class Knobs:
    """Placement choices; None leaves a choice to the planner (with a budget) or to the
    engine's default (without one).

    ``n_persist``: chunks kept on the compute device (engine default: all). ``n_buffer``:
    offloaded chunks resident at once (default: what one module or block needs).
    ``n_swap``/``n_checkpoint``: blocks whose activations go to the host / are recomputed
    (both None: no activation policy). ``n_device_step``: offloaded chunks whose AdamW runs
    on the device (default 0). ``chunk_size_bytes``: the chunk size (default: least waste).
    ``distributed_mode``: several ranks, ``"sharded"`` (default) or ``"replicated"``.
    ``offload_checkpoint``: checkpointed blocks hold their inputs on the host (not planned).
    ``tiled_mlp_tokens``: MLPs in tiles of this many tokens (not planned; traced as set).
    """

    n_persist: int | None = None
    n_buffer: int | None = None
    n_swap: int | None = None
    n_checkpoint: int | None = None
    n_device_step: int | None = None
    chunk_size_bytes: int | None = None
    distributed_mode: str | None = None
    offload_checkpoint: bool = False
    tiled_mlp_tokens: int | None = None

    def fixed_searched(self) -> dict[str, int]:
        """The searched knobs (and ``n_device_step``) given a value: what the search keeps."""
        names = (*SEARCHED, DEVICE_STEP)
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @property
    def with_activations(self) -> bool:
        """Whether the engine applies activation policies (a block knob or tiled MLPs)."""
        return (
            self.n_swap is not None or self.n_checkpoint is not None or bool(self.tiled_mlp_tokens)
        )


@dataclass(frozen=True)
class OptimizerSettings:
    """The engine's optimizer: AdamW's hyperparameters and parameter groups, which AdamW
    (``"adamw"``, fp32 moments, or ``"adamw_8bit"``), fp16's ``loss_scaling`` (the keywords
    of ``torch.amp.GradScaler``), the host update's ``host_threads`` (None: the engine's
    default) and ``optimizer_state``, how the host keeps the offloaded chunks' Adam moments:
    ``"fp32"`` (torch's), or opt-in ``"bf16"`` or ``"8bit"``, which change the math
    (``protrain/optim/state_format.py``)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    param_groups: list[dict] | None = None
    optimizer: str = "adamw"
    loss_scaling: dict | None = None
    host_threads: int | None = None
    optimizer_state: str = "fp32"


def field_names(cls: type) -> tuple[str, ...]:
    """The field names of one of these dataclasses (``Knobs``, ``OptimizerSettings``, ...)."""
    return tuple(f.name for f in fields(cls))


def knobs_of(source: Any) -> Knobs:
    """The :class:`Knobs` of an object that carries them as attributes of the same names
    (a ``Knobs`` subclass such as the Trainer's ``ProTrainConfig``)."""
    return Knobs(*(getattr(source, name) for name in field_names(Knobs)))
