"""``Plan``: a plain, serializable value (knobs, predictions with their terms, and reasons),
and its text form: ``explain`` (what ``str(plan)`` gives) and the candidates' table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from protrain.knobs import SEARCHED, Knobs
from protrain.units import GIB

KNOBS = SEARCHED


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
    # the fused kernels the traced step ran (protrain.model.kernels): the run must run them
    kernels: list[str] = field(default_factory=list)

    @property
    def knobs(self) -> dict[str, int]:
        """The searched knobs (a candidate row's), by name."""
        return {k: getattr(self, k) for k in KNOBS}

    def engine_knobs(self, user: Knobs | None = None) -> Knobs:
        """What the engine runs: the plan's decisions over the ``user``'s knobs (those the
        plan does not decide, ``tiled_mlp_tokens`` and ``offload_checkpoint``, kept). With
        every chunk persistent there is no pool, so ``n_buffer`` is left to the engine."""
        return replace(
            user or Knobs(),
            n_persist=self.n_persist,
            n_buffer=self.n_buffer if self.n_persist < self.n_chunks else None,
            n_swap=self.n_swap,
            n_checkpoint=self.n_checkpoint,
            n_device_step=self.n_device_step,
            chunk_size_bytes=self.chunk_size_bytes,
            distributed_mode=self.distributed_mode,
        )

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
        return explain(self)


def gib(n: float) -> str:
    """``n`` bytes in GiB, two decimals."""
    return f"{n / GIB:.2f} GiB"


def loss_words(plan: Plan) -> str:
    """The plan's loss in words ("" where the planner does not own the loss)."""
    if not plan.loss_planned:
        return ""
    if plan.chunked_loss_tokens is None:
        return "loss over the whole logits"
    return f"loss in chunks of {plan.chunked_loss_tokens} tokens"


def candidates_table(plan: Plan) -> str:
    loss = any("chunked_loss_tokens" in c for c in plan.candidates)
    rows = [("n_persist", "n_buffer", "n_swap", "n_ckpt", "peak GiB", "step s", "tokens/s")]
    if loss:
        rows[0] += ("loss chunk",)
    for c in plan.candidates:
        row = (
            str(c["n_persist"]),
            str(c["n_buffer"]),
            str(c["n_swap"]),
            str(c["n_checkpoint"]),
            f"{c['predicted_peak_bytes'] / GIB:.2f}",
            f"{c['predicted_step_s']:.3f}",
            f"{c['predicted_tokens_per_s']:,.0f}",
        )
        if loss:
            row += (str(c.get("chunked_loss_tokens") or "off"),)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def explain(plan: Plan, *, with_candidates: bool = True) -> str:
    lines = [
        f"Plan: n_persist={plan.n_persist}, n_buffer={plan.n_buffer}, n_swap={plan.n_swap}, "
        f"n_checkpoint={plan.n_checkpoint} ({plan.n_chunks} chunks of "
        f"{plan.chunk_size_bytes / (1 << 20):.1f} MiB, {plan.n_blocks} blocks"
        + (f"; {loss_words(plan)}" if plan.loss_planned else "")
        + ")",
        f"  predicted peak {gib(plan.predicted_peak_bytes)} of {gib(plan.gpu_budget_bytes)}; "
        f"step {plan.predicted_step_s:.3f} s, {plan.predicted_tokens_per_s:,.0f} tokens/s; "
        f"host memory {gib(plan.predicted_host_bytes)}",
        "  memory terms: " + ", ".join(f"{k} {gib(v)}" for k, v in plan.memory_terms.items()),
    ]
    if plan.world_size > 1:  # the figures above are each rank's
        lines.insert(1, f"  per rank, {plan.world_size} ranks, {plan.distributed_mode} mode: every "
                        "rank runs these knobs; tokens/s of one rank")  # fmt: skip
    lines += [f"  - {r}" for r in plan.reasons]
    if with_candidates and plan.candidates:
        lines.append("best candidates:")
        lines += ["  " + row for row in candidates_table(plan).splitlines()]
    return "\n".join(lines)
