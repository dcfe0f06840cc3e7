"""`protrain preprocess CONFIG`: tokenize the training (and evaluation) data once and write
it where `build_train_dataset` finds it again (the cache: `prepared.py`)."""

from __future__ import annotations

import logging
from pathlib import Path

from protrain.train.data.config import DataSettings
from protrain.train.data.dataset import build_eval_dataset, build_train_dataset
from protrain.train.data.errors import DataError
from protrain.train.data.prepared import fingerprint, save_prepared

logger = logging.getLogger("protrain.train.data")


def preprocess(
    settings: DataSettings,
    tokenizer,
    *,
    sequence_len: int,
    seed: int,
    output_path: str | Path | None = None,
    processor=None,
) -> Path:
    """Tokenize the training (and evaluation) data and write it; returns the cache folder."""
    root = output_path or settings.dataset_prepared_path
    if root is None:
        raise DataError(
            "dataset_prepared_path is not set: preprocess needs a folder to write to, e.g. "
            "--set dataset_prepared_path=prepared"
        )
    fp = fingerprint(settings, tokenizer, sequence_len=sequence_len, seed=seed, processor=processor)
    folder = Path(root).expanduser() / fp
    uncached = settings.model_copy(update={"dataset_prepared_path": None})
    splits = {
        "train": build_train_dataset(
            uncached, tokenizer, sequence_len=sequence_len, seed=seed, processor=processor
        ),
        "eval": build_eval_dataset(
            uncached, tokenizer, sequence_len=sequence_len, seed=seed, processor=processor
        ),
    }
    for split, dataset in splits.items():
        if dataset is None or (folder / split).exists():
            continue
        save_prepared(dataset, folder / split)
        logger.info("wrote %d prepared %s samples to %s", len(dataset), split, folder / split)
    return folder
