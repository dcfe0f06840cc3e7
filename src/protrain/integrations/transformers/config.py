"""The engine's knobs for a Hugging Face ``Trainer`` run.

The optimizer's hyperparameters (learning rate, betas, epsilon, weight decay) and gradient
clipping come from the ``TrainingArguments``; only what places model states lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protrain.knobs import Knobs, knobs_of
from protrain.plan import PlanRequest, parse_bytes


@dataclass(frozen=True)
class ProTrainConfig(Knobs):
    """The engine's knobs (every field of ``protrain.knobs.Knobs``, which documents them;
    None keeps the engine's default) and what the Trainer adds.

    ``compute_dtype``: float32 or bfloat16 (default: the Trainer's ``bf16``, so bfloat16
    where ``bf16=True`` and float32 where it is False, as the plain Trainer computes);
    the masters and AdamW state are fp32 either way. ``host_threads``: intra-op threads of
    the host AdamW. ``step_in_backward``: without clipping, start each offloaded chunk's AdamW inside the
    last backward of the step (the same arithmetic, overlapped with the backward).

    ``gpu_budget`` (bytes or a size such as ``"24GiB"``): plan the knobs left None for the
    heaviest micro-batch of the Trainer's training data (profile and search,
    ``protrain.plan``; see ``planning.py``); the ones given are kept. ``cpu_budget`` bounds
    the plan's host memory (default: 90% of what is available). ``plan_sequence_len``: pad
    the planning batch to this many tokens, for a collator that yields batches wider than
    the dataset's longest row (None: as wide as that row).
    """

    compute_dtype: torch.dtype | None = None
    host_threads: int | None = None
    step_in_backward: bool = True
    gpu_budget: int | str | None = None
    cpu_budget: int | str | None = None
    plan_sequence_len: int | None = None

    def __post_init__(self) -> None:
        # fp16 needs the engine's loss scale in every backward, which the Trainer's
        # training_step does not apply; bf16 needs no scaling.
        if self.compute_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"ProTrainConfig.compute_dtype={self.compute_dtype} is not supported with the "
                "Trainer: use torch.float32 or torch.bfloat16"
            )
        for name in ("gpu_budget", "cpu_budget"):
            value = getattr(self, name)
            if value is not None:
                try:
                    size = parse_bytes(value)
                except ValueError as exc:
                    raise ValueError(f"ProTrainConfig.{name}: {exc}") from None
                if size <= 0:
                    raise ValueError(
                        f"ProTrainConfig.{name}={value!r} is not allowed: use a size above "
                        "0, in bytes or such as '24GiB'"
                    )
        if self.gpu_budget is None and (
            self.cpu_budget is not None or self.plan_sequence_len is not None
        ):
            raise ValueError(
                "ProTrainConfig: cpu_budget and plan_sequence_len are read only by the "
                "planner: set gpu_budget too"
            )
        if self.gpu_budget is not None and self.offload_checkpoint:
            raise ValueError(
                "ProTrainConfig: offload_checkpoint=True is not planned by gpu_budget; fix "
                "n_persist, n_buffer and n_checkpoint without a budget to use it"
            )
        if self.plan_sequence_len is not None and self.plan_sequence_len < 1:
            raise ValueError(
                f"ProTrainConfig.plan_sequence_len={self.plan_sequence_len} is not allowed: "
                "use a number of tokens >= 1"
            )

    @property
    def planned(self) -> bool:
        """Whether the knobs left None are chosen by the planner when training starts."""
        return self.gpu_budget is not None

    def knobs(self) -> Knobs:
        """The engine's knobs these fields set."""
        return knobs_of(self)

    def plan_request(
        self, sample_batch: dict, clipping: bool, optimizer: str = "adamw"
    ) -> PlanRequest:
        """The planner's request for ``sample_batch`` (``clipping``: the host optimizer's
        schedule the run uses, after the backward or inside it; ``optimizer``: the engine's
        AdamW, ``"adamw"`` or ``"adamw_8bit"``)."""
        return PlanRequest(
            gpu_budget_bytes=self.gpu_budget,
            cpu_budget_bytes=self.cpu_budget,
            sample_batch=sample_batch,
            knobs=self.knobs(),
            clipping=clipping,
            optimizer=optimizer,
        )
