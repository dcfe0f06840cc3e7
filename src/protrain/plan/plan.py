"""``Plan``: a plain, serializable value: knobs, predictions with their terms, and reasons."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

KNOBS = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")


@dataclass
class Plan:
    n_persist: int
    n_buffer: int
    n_swap: int
    n_checkpoint: int
    chunk_size_bytes: int
    n_chunks: int
    n_blocks: int
    tokens_per_step: int
    gpu_budget_bytes: int | None
    cpu_budget_bytes: int | None
    predicted_peak_bytes: int
    predicted_step_s: float
    predicted_host_bytes: int
    memory_terms: dict[str, int] = field(default_factory=dict)  # bytes, sum = peak
    time_terms: dict[str, float] = field(default_factory=dict)  # seconds
    fixed_knobs: dict[str, int] = field(default_factory=dict)  # what the user set
    reasons: list[str] = field(default_factory=list)
    candidates: list[dict] = field(default_factory=list)  # the best few, knobs and predictions
    # the ranks it is for (plan.world): every rank runs these knobs, each predicted alone
    world_size: int = 1
    distributed_mode: str | None = None  # "sharded" | "replicated"; None: one rank
    # The loss (protrain.plan.loss_chunk): where the planner owns it (``loss_planned``), the
    # chunk of positions it runs in (None: the whole logits); the runner applies it.
    chunked_loss_tokens: int | None = None
    loss_planned: bool = False
    # offloaded chunks whose AdamW runs on the device (optim/device_step.py); chosen after
    # the other knobs for the best of them (plan/search.py), so not among KNOBS
    n_device_step: int = 0
    # the optimizer whose device state the memory model counted (optim/adamw_8bit.py): the
    # engine runs the plan with it (planned_wrap.apply_plan)
    optimizer: str = "adamw"

    @property
    def knobs(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in KNOBS}

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.predicted_step_s if self.predicted_step_s else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> Plan:
        return cls.from_dict(json.loads(s))

    def __str__(self) -> str:
        from protrain.plan.explain import explain

        return explain(self)
