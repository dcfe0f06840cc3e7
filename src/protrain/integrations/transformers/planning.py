"""The memory plan for the heaviest micro-batch of the Trainer's training data.

With ``ProTrainConfig.gpu_budget`` the model is wrapped when the Trainer builds its training
dataloader (``get_train_dataloader``, public, called at the top of the training loop before
the optimizer is created). The planner's sample is the heaviest micro-batch the training
dataset can produce, chosen as ``protrain train`` chooses it
(``protrain.train.heaviest_batch``): the ``per_device_train_batch_size`` rows with the most
media input, else the longest, collated by the loader's own collator (the Trainer's, with
its unused columns removed), padded to the longest row of the dataset. A plan made for it
holds for every micro-batch the loader yields. ``plan_sequence_len`` pads it further, for a
collator that can yield wider batches than the rows (padding to a fixed length).

[Note: choosing without the training stream]
Rows are read by index from the loader's dataset and collated by its ``collate_fn``; the
loader is never iterated, so its sampler draws nothing and its position is untouched. The
collation runs with torch's, Python's and NumPy's random states restored afterwards, so a
collator that draws (random masking) leaves the run's random state as it was: the Trainer
then yields the batches it would have yielded without the plan.

[Note: packing batch samplers]
axolotl's ``sample_packing`` loads through a batch sampler of packs (``MultipackBatchSampler``):
each micro-batch is ``batch_size`` packs of rows laid end to end, each pack up to
``batch_max_len`` tokens (``micro_batch_size`` packs of ``sequence_len`` tokens, or one pack
of ``micro_batch_size * sequence_len`` where its attention takes packed rows), which its
collator concatenates per pack and pads to its ``pad_to_multiple_of``. A loader whose batch
sampler has those two attributes is planned for that: ``batch_size`` packs, each the longest
row (its collator handles a list of packs) padded with masked tokens to ``batch_max_len``
rounded up to the collator's multiple, the widest micro-batch it can yield. TRL's packing
needs nothing of its own: its rows are the packs, and its padding-free collator lays the
chosen longest packs end to end as in training.

Where the rows cannot be sized without collating them (an iterable dataset, or rows without
``input_ids`` that the collator tokenizes, as TRL's vision-language rows), the sample is the
loader's first batch instead, peeked at under the same restored random state, and the log
line says so. The peek reads the loader under the accelerate adapter (``base_dataloader``):
iterating the adapter registers it with accelerate's gradient state until the iteration
ends, and a peek never ends it.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from protrain.integrations.transformers.config import ProTrainConfig
from protrain.train.heaviest_batch import heaviest_batch, pad_tokens

log = logging.getLogger(__name__)


def planning_batch(
    loader: DataLoader, device: torch.device, config: ProTrainConfig, micro_batch_size: int
) -> dict[str, Any]:
    """The planner's sample on ``device`` (see the module's note); one log line says which
    rows and why."""
    base = getattr(loader, "base_dataloader", loader)
    unsized = why_unsized(base.dataset)
    packs = packing_sampler(base)
    with kept_random_state(device):
        if unsized is None and packs is not None:
            batch, reason = packed_batch(base, *packs)
        elif unsized is None:
            collate = base.collate_fn
            # transformers' RemoveColumnsCollator keeps the Trainer's collator as data_collator
            inner = getattr(collate, "data_collator", collate)
            chosen = heaviest_batch(
                arrow_sized(base.dataset),
                collate,
                micro_batch_size=micro_batch_size,
                pad_to_multiple_of=getattr(inner, "pad_to_multiple_of", None) or 0,
            )
            batch, reason = chosen.batch, chosen.reason
        else:
            batch = next(iter(base))
            reason = f"planning micro-batch: the loader's first batch ({unsized})"
    _check_batch(batch)
    batch = dict(batch)
    width = config.plan_sequence_len
    if width is not None and width > batch["input_ids"].shape[1]:
        batch = pad_tokens(batch, width, pad_id=0, media_keys=_floating_keys(batch))
        reason += f", padded to plan_sequence_len {width}"
    log.info(reason)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def packing_sampler(loader: DataLoader) -> tuple[int, int] | None:
    """(packs per micro-batch, tokens per pack) of a packing batch sampler (see the module's
    note), else None."""
    sampler = loader.batch_sampler
    packs, width = getattr(sampler, "batch_size", None), getattr(sampler, "batch_max_len", None)
    if isinstance(packs, int) and isinstance(width, int):
        return packs, width
    return None


def packed_batch(loader: DataLoader, packs: int, width: int) -> tuple[dict, str]:
    """The widest micro-batch of a packing batch sampler: ``packs`` packs, each one of the
    longest rows padded to ``width`` tokens rounded up to the collator's multiple."""
    collate = loader.collate_fn
    multiple = getattr(getattr(collate, "data_collator", collate), "pad_to_multiple_of", None)
    width = -(-width // multiple) * multiple if multiple else width
    chosen = heaviest_batch(
        arrow_sized(loader.dataset),
        lambda rows: collate([[row] for row in rows]),  # one row per pack
        micro_batch_size=packs,
    )
    batch = pad_tokens(dict(chosen.batch), width, pad_id=0, media_keys=_floating_keys(chosen.batch))
    shape = "x".join(map(str, batch["input_ids"].shape))
    reason = (
        f"planning micro-batch: {packs} pack(s) of {width} tokens ({shape}), the widest the "
        f"packing batch sampler yields; rows {chosen.rows} padded to fill them"
    )
    return batch, reason


def why_unsized(dataset: Any) -> str | None:
    """Why the rows of ``dataset`` cannot be sized by index (None: they can)."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return f"a {type(dataset).__name__} has no rows to choose from"
    if len(dataset) == 0:
        return None  # heaviest_batch names the empty dataset
    first = dataset[0]
    if not isinstance(first, Mapping) or "input_ids" not in first:
        return (
            "its rows carry no input_ids to size them by, the collator makes them; the plan "
            "holds for batches no heavier than this one"
        )
    return None


class ArrowSizedRows:
    """A ``datasets.Dataset`` in Python format whose token counts are read from its Arrow
    ``input_ids`` column (``heaviest_batch``'s ``token_counts``): reading every row as Python
    lists takes about 2 s per 20k rows of 500 tokens, the column's lengths 0.05 s. Its rows
    hold no tensors, so no media values (``media_values`` counts tensors) either way."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def token_counts(self) -> list[int]:
        # pyarrow comes with datasets, which is optional here (see arrow_sized)
        import pyarrow.compute as pc

        # the arrow format follows the dataset's indices (shuffle, select)
        return pc.list_value_length(self.dataset.with_format("arrow")["input_ids"]).to_pylist()


def arrow_sized(dataset: Any) -> Any:
    """``dataset`` as ``ArrowSizedRows`` where it is a Python-format ``datasets.Dataset``
    with a list column ``input_ids``; else as it is."""
    try:
        # optional here: the Trainer takes any dataset, datasets' only where it is installed
        import datasets
    except ImportError:
        return dataset
    if not isinstance(dataset, datasets.Dataset) or dataset.format["type"] is not None:
        return dataset
    column = dataset.features.get("input_ids")
    if not isinstance(column, (datasets.Sequence, datasets.List, datasets.LargeList)):
        return dataset
    return ArrowSizedRows(dataset)


@contextlib.contextmanager
def kept_random_state(device: torch.device) -> Iterator[None]:
    """Torch's (and the CUDA device's), Python's and NumPy's random states as they were."""
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=rng_devices(device)):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _check_batch(batch: Any) -> None:
    # collators return dicts or transformers' BatchEncoding (a Mapping)
    if not isinstance(batch, Mapping) or not torch.is_tensor(batch.get("input_ids")):
        raise ValueError(
            "ProTrainConfig.gpu_budget plans from a training micro-batch, which must be a "
            f"mapping with an input_ids tensor (got {type(batch).__name__}); fix the knobs "
            "(n_persist, n_buffer, n_checkpoint) without a budget instead"
        )


def _floating_keys(batch: Mapping[str, Any]) -> set[str]:
    """Media tensors (pixels, audio features) that padding must leave as they are."""
    return {k for k, v in batch.items() if torch.is_tensor(v) and v.is_floating_point()}
