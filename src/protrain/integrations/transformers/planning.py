"""The memory plan from the Trainer's own first training batch.

With ``ProTrainConfig.gpu_budget`` the model is wrapped when the Trainer builds its training
dataloader (``get_train_dataloader``, public, called at the top of the training loop before
the optimizer is created): the first batch that loader yields is the planner's sample, at its
real shape (``per_device_train_batch_size`` rows, the collator's padded length).

[Note: peeking at the first batch]
The batch is read from the loader under the accelerate adapter (``base_dataloader``), not
from the adapter itself: iterating the adapter registers it with accelerate's gradient
state until the iteration ends, and a peek never ends it. The read and the trace run under
``torch.random.fork_rng``, so that what draws from torch's global generator (a
``RandomSampler`` when ``use_seedable_sampler=False``, a random-masking collator, the trace's
dropout) leaves the run's random state as it was: the Trainer then yields the same first
batch again and trains as it would have without the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from protrain.integrations.transformers.config import ProTrainConfig

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # the labels' padding, as transformers' collators write it


def first_batch(loader: DataLoader, device: torch.device) -> dict[str, Any]:
    """The first batch ``loader`` yields, on ``device``, leaving every random state as it
    was (see [Note: peeking at the first batch])."""
    base = getattr(loader, "base_dataloader", loader)
    with torch.random.fork_rng(devices=rng_devices(device)):
        batch = next(iter(base))
    # collators return dicts or transformers' BatchEncoding (a Mapping)
    if not isinstance(batch, Mapping) or not torch.is_tensor(batch.get("input_ids")):
        raise ValueError(
            "ProTrainConfig.gpu_budget plans from the first training batch, which must be a "
            f"mapping with an input_ids tensor (got {type(batch).__name__}); fix the knobs "
            "(n_persist, n_buffer, n_checkpoint) without a budget instead"
        )
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def pad_to(batch: dict[str, Any], width: int) -> dict[str, Any]:
    """``batch`` padded on the right to ``width`` tokens: the widest shape the collator can
    yield, for a plan that must hold for every batch. Padding values do not matter to the
    trace (only shapes do); labels get the ignore index so the loss stays defined."""
    ids = batch["input_ids"]
    n_pad = width - ids.shape[1]
    if n_pad <= 0:
        return batch
    out = {}
    for key, t in batch.items():
        if not torch.is_tensor(t) or t.shape[:2] != ids.shape:
            out[key] = t
        elif key == "position_ids":
            tail = torch.arange(n_pad, dtype=t.dtype, device=t.device) + t[:, -1:] + 1
            out[key] = torch.cat([t, tail], dim=1)
        else:
            fill = IGNORE_INDEX if key == "labels" else 0
            out[key] = torch.cat([t, t.new_full((t.shape[0], n_pad), fill)], dim=1)
    return out


def planning_batch(loader: DataLoader, device: torch.device, config: ProTrainConfig) -> dict:
    """The planner's sample: the first batch, padded to ``config.plan_sequence_len``."""
    batch = first_batch(loader, device)
    if config.plan_sequence_len is not None:
        batch = pad_to(batch, config.plan_sequence_len)
    return batch


def rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []
