"""``PlanRequest``: what the planner is asked (the budgets, the sample batch at the real
shape, the knobs the user fixed, the loss and the schedule to plan for). Built once by the
caller (``protrain.wrap``, the application's ``memory:`` section, the Trainer integration)
and passed whole to :func:`protrain.plan.profile_and_plan`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from protrain.knobs import Knobs

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def parse_bytes(value: int | float | str) -> int:
    """``24GiB``, ``24 GB``, ``25769803776`` -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size: use e.g. 24GiB, 80GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class PlanRequest:
    """One planning call's inputs besides the model and where it runs.

    ``gpu_budget_bytes``: each GPU's memory the plan may use (bytes or a size such as
    ``"24GiB"``; stored as bytes). ``cpu_budget_bytes``: the host's (None: the default of
    ``protrain.plan.host_budget``, read after the trace). ``sample_batch``: a micro-batch of
    the real shape (None only while the request is being built). ``knobs``: what the user
    fixed; the searched knobs left None are chosen, ``chunk_size_bytes`` None is searched,
    ``distributed_mode`` None lets several ranks choose, ``tiled_mlp_tokens`` is traced as
    set. ``clipping``: whether training clips gradients (it decides when the host optimizer
    runs, ``plan/runtime.py``). ``loss_fn``: the loss the trace runs (None: the model's
    own); ``loss_chunks`` (a ``plan.loss_chunk.LossChunks``): the planner owns the loss and
    searches its chunk instead; ``fixed_loss_chunk_tokens``: the chunk of ``loss_fn`` where
    the user fixed one (named by the error of a trace that runs out of memory).
    ``device_step_search``: the search also chooses ``n_device_step`` where it is not fixed.
    ``optimizer``: the engine's (``"adamw"`` or ``"adamw_8bit"``), whose device state the
    memory model counts. ``optimizer_state``: the host's Adam moments (``"fp32"``,
    ``"bf16"`` or ``"8bit"``, ``optim/state_format.py``), whose host bytes it counts.
    """

    gpu_budget_bytes: int | str
    cpu_budget_bytes: int | str | None = None
    sample_batch: dict | None = None
    knobs: Knobs = field(default_factory=Knobs)
    clipping: bool = True
    loss_fn: Callable | None = None
    loss_chunks: object | None = None
    fixed_loss_chunk_tokens: int | None = None
    device_step_search: bool = False
    optimizer: str = "adamw"
    optimizer_state: str = "fp32"

    def __post_init__(self) -> None:
        # sizes as bytes from here on: a bad size is refused where the request is made
        object.__setattr__(self, "gpu_budget_bytes", parse_bytes(self.gpu_budget_bytes))
        if self.cpu_budget_bytes is not None:
            object.__setattr__(self, "cpu_budget_bytes", parse_bytes(self.cpu_budget_bytes))
