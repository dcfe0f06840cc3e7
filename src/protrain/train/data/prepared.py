"""The tokenized-data cache that `protrain preprocess CONFIG` writes and `build_train_dataset`
reuses (the command itself: `preprocess.py`).

The cache lives under `dataset_prepared_path/<fingerprint>/` where the fingerprint hashes
everything the tokenized data depends on: the data settings (`chat_template_kwargs` included),
the tokenizer (name, vocabulary size, special tokens, template), a vision-language model's
processor (its class and image/video processor settings), `sequence_len`, the seed, and the
size and modification time of each local data file. A changed input gives a new folder, never a stale cache.
Text-only data is stored with `datasets.save_to_disk` (Arrow, memory-mapped); data with media
tensors with `torch.save`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from protrain.train.data.config import DataSettings
from protrain.train.data.errors import DataError
from protrain.train.data.items import ArrowItems, TokenizedDataset
from protrain.train.data.templates import template_file

logger = logging.getLogger("protrain.train.data")

# 4: the app passes vision-language models' processors (caches of version 3 and before were
# written without their images)
_FORMAT_VERSION = 4


def _file_stamps(settings: DataSettings) -> list[Any]:
    stamps = []
    for cfg in [*settings.datasets, *settings.eval_datasets]:
        path = Path(cfg.path).expanduser()
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            if f.is_file():
                st = f.stat()
                stamps.append([str(f), st.st_size, st.st_mtime_ns])
    # a chat template named by its file renders every row: an edit to it is a new cache
    specs = [settings.chat_template]
    specs += [cfg.chat_template for cfg in [*settings.datasets, *settings.eval_datasets]]
    for f in filter(None, map(template_file, specs)):
        stamps.append([str(f), hashlib.sha256(f.read_bytes()).hexdigest()])
    return stamps


def fingerprint(
    settings: DataSettings, tokenizer, *, sequence_len: int, seed: int, processor=None
) -> str:
    data_keys = DataSettings.model_fields.keys()
    payload = {
        "version": _FORMAT_VERSION,
        "settings": settings.model_dump(
            mode="json", include=set(data_keys) - {"dataset_prepared_path"}
        ),
        "tokenizer": [
            getattr(tokenizer, "name_or_path", ""),
            len(tokenizer),
            sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
            str(getattr(tokenizer, "chat_template", "")),
        ],
        "sequence_len": sequence_len,
        "seed": seed,
        "files": _file_stamps(settings),
        # media rows depend on the processor (image sizes, patches, tokens per image)
        "processor": _processor_stamp(processor),
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _processor_stamp(processor) -> list[str] | None:
    if processor is None:
        return None
    parts = [type(processor).__qualname__]
    for name in ("image_processor", "video_processor", "feature_extractor"):
        sub = getattr(processor, name, None)
        if sub is not None and hasattr(sub, "to_json_string"):
            parts.append(sub.to_json_string())
    return parts


def save_prepared(dataset: torch.utils.data.Dataset, folder: Path) -> None:
    items = [dataset[i] for i in range(len(dataset))]
    has_media = any(isinstance(v, torch.Tensor) for item in items for v in item.values())
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".tmp")
    if has_media:
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(items, tmp / "items.pt")
    else:
        # the config check imports this module: datasets loads where a dataset is read
        import datasets

        datasets.Dataset.from_list(items).save_to_disk(str(tmp))
    tmp.rename(folder)  # the folder appears whole or not at all


def _load(folder: Path) -> torch.utils.data.Dataset:
    if (folder / "items.pt").exists():
        return TokenizedDataset(torch.load(folder / "items.pt", weights_only=True))
    # the config check imports this module: datasets loads where a dataset is read
    import datasets

    return ArrowItems(datasets.load_from_disk(str(folder)))


def load_prepared(
    settings: DataSettings,
    tokenizer,
    *,
    sequence_len: int,
    seed: int,
    split: str,
    processor=None,
) -> torch.utils.data.Dataset | None:
    """The cached split if `dataset_prepared_path` holds one for exactly these inputs."""
    if not settings.dataset_prepared_path:
        return None
    fp = fingerprint(settings, tokenizer, sequence_len=sequence_len, seed=seed, processor=processor)
    folder = Path(settings.dataset_prepared_path).expanduser() / fp / split
    if not folder.exists():
        return None
    logger.info("using prepared %s data from %s", split, folder)
    try:
        return _load(folder)
    except (OSError, ValueError, RuntimeError) as e:  # torch and datasets on damaged files
        raise DataError(
            f"the prepared {split} data in {folder} cannot be read ({' '.join(str(e).split())}); "
            "delete that folder to tokenize the datasets again"
        ) from e
