"""The files a run reads but never trains: checked before any data is read, fingerprinted
into every checkpoint, and compared with the files on disk at `--resume`.

Frozen inputs: the base model (a local directory, or the hub cache's snapshot of a hub id
once it is there) and every adapter of `adapter.extra` loaded from a `path`. The built-in
`tiny` model is rebuilt from the run's seed and has no files. A resumed run that read other
files than its first steps did would train against another model without a word; so a
change is refused in one line, and `--accept-changed-inputs` says "I know".

[Note: fingerprints]
What is compared: `config.json` and the tokenizer files of a model folder, and
`adapter_config.json` of an adapter, hashed whole; every weight file (`*.safetensors`,
`*.bin`) hashed whole up to 64 MiB (any adapter of a usual rank), and above that by its size
and the sha256 of three 1 MiB blocks: its start (the safetensors header: every tensor's
name, dtype, shape and offset), its middle and its end. That reads 3 MiB of each file of a
16 GB model instead of 16 GB at every start and resume, and another checkpoint saved over
the folder (a fine-tune of the same architecture) differs in every block. Modification
times are not used: a copy or a fresh download of the same files would be refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache

from protrain.train.config import ExtraAdapterConfig, TrainConfig
from protrain.train.errors import ConfigError, OutputDirError

ACCEPT_FLAG = "--accept-changed-inputs"
_WHOLE_BYTES = 64 << 20  # files up to this size are hashed whole
_BLOCK_BYTES = 1 << 20
_HEADER_LIMIT = 100 << 20  # a safetensors header larger than this is not one
_MODEL_TEXT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
MODEL_KEY = "model"


def check_readable(cfg: TrainConfig) -> None:
    """Refuse, before any data or model is loaded, a frozen input that cannot be read:
    an `adapter.extra[].path` that is missing or no PEFT directory, or a weight file whose
    safetensors header is damaged (truncated, random bytes)."""
    for i, extra in enumerate(cfg.adapter.extra):
        if extra.path is not None:
            check_adapter_dir(extra, f"adapter.extra[{i}]")
    folder = model_folder(cfg)
    if folder is not None:
        for path in _weight_files(folder):
            _check_weight_file(path, "model.name_or_path")


def check_adapter_dir(extra: ExtraAdapterConfig, key: str) -> Path:
    """The adapter directory of ``extra.path``; ConfigError naming ``key`` when it is not
    one (missing, no adapter_config.json, a damaged weight file)."""
    path = Path(extra.path).expanduser()
    if not path.exists():
        raise ConfigError(f"{key}.path = {extra.path!r}: no such file or directory")
    if not (path / "adapter_config.json").is_file():
        raise ConfigError(
            f"{key}.path = {extra.path!r} is not a PEFT adapter directory (no "
            "adapter_config.json there); allowed: a directory written by peft's "
            "save_pretrained, such as a LoRA run's final/"
        )
    for weights in _weight_files(path):
        _check_weight_file(weights, f"{key}.path")
    return path


def model_folder(cfg: TrainConfig) -> Path | None:
    """The folder the base model's files are read from: a local directory, or the hub
    cache's snapshot of a hub id (None where it is not downloaded yet, and for `tiny`)."""
    name = cfg.model.name_or_path
    if name == "tiny":
        return None
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()

    try:
        found = try_to_load_from_cache(name, "config.json", revision=cfg.model.revision)
    except ValueError:  # not a valid hub id: the loader names it
        return None
    return Path(found).parent if isinstance(found, str) else None


def fingerprint(cfg: TrainConfig) -> dict[str, dict[str, str]]:
    """Input -> {file name: digest} (see [Note: fingerprints]); inputs are `model` and
    `adapter:<name>` of each frozen adapter loaded from a path."""
    found: dict[str, dict[str, str]] = {}
    folder = model_folder(cfg)
    if folder is not None:
        names = [n for n in _MODEL_TEXT_FILES if (folder / n).is_file()]
        found[MODEL_KEY] = _digests(folder, names + [p.name for p in _weight_files(folder)])
    for extra in cfg.adapter.extra:
        if extra.path is not None and not extra.is_trainable:
            path = Path(extra.path).expanduser()
            names = ["adapter_config.json"] + [p.name for p in _weight_files(path)]
            found[f"adapter:{extra.name}"] = _digests(path, names)
    return found


def check_unchanged(
    checkpoint: Path, now: dict[str, dict[str, str]], cfg: TrainConfig, accept: bool
) -> str | None:
    """Refuse (OutputDirError, one line) a resume whose frozen inputs differ from those
    `checkpoint` recorded; with ``accept``, the line to log instead. None where nothing
    changed, or the checkpoint recorded nothing (written before inputs were recorded)."""
    saved = _recorded(checkpoint)
    if saved is None:
        return None
    change = _first_change(saved, now)
    if change is None:
        return None
    key, what = change
    where = _describe(key, cfg)
    if accept:
        return (
            f"{ACCEPT_FLAG}: {where} is not what {checkpoint.name} was trained with ({what}); "
            "the run continues with it as it is now"
        )
    raise OutputDirError(
        f"--resume: {where} is not what {checkpoint.name} was trained with ({what}); restore "
        f"those files, or pass {ACCEPT_FLAG} to continue with them as they are now"
    )


def _first_change(
    saved: dict[str, dict[str, str]], now: dict[str, dict[str, str]]
) -> tuple[str, str] | None:
    """(input, what changed) of the first input that differs. The model is compared where
    both runs fingerprinted it (a hub model downloaded during the first run's start is not
    in its record); an adapter added or removed is a change."""
    for key in sorted(set(saved) | set(now)):
        if key not in now or key not in saved:
            if key == MODEL_KEY:
                continue
            return key, "added since" if key not in saved else "no longer loaded"
        before, after = saved[key], now[key]
        for name in sorted(set(before) | set(after)):
            if name not in after:
                return key, f"{name} is gone"
            if name not in before:
                return key, f"{name} is new"
            if before[name] != after[name]:
                return key, f"{name} changed"
    return None


def _describe(key: str, cfg: TrainConfig) -> str:
    if key == MODEL_KEY:
        return f"model.name_or_path = {cfg.model.name_or_path!r}"
    name = key.removeprefix("adapter:")
    for i, extra in enumerate(cfg.adapter.extra):
        if extra.name == name:
            return f"the frozen adapter {name!r} (adapter.extra[{i}].path = {extra.path!r})"
    return f"the frozen adapter {name!r}"


def _recorded(checkpoint: Path) -> dict[str, dict[str, str]] | None:
    """The fingerprints in a checkpoint's state.json (either format keeps the trainer
    state there); None where it has none."""
    try:
        state = json.loads((checkpoint / "state.json").read_text())
        return state["trainer"].get("frozen_inputs")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # the resume's own read names a state.json that does not parse


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def _digests(folder: Path, names: list[str]) -> dict[str, str]:
    return {name: _digest(folder / name) for name in names}


def _digest(path: Path) -> str:
    """sha256 of the whole file up to `_WHOLE_BYTES`, else of its size and three blocks."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        if size <= _WHOLE_BYTES:
            h.update(f.read())
            return h.hexdigest()
        h.update(str(size).encode())
        for offset in (0, size // 2, size - _BLOCK_BYTES):
            f.seek(offset)
            h.update(f.read(_BLOCK_BYTES))
    return "sampled:" + h.hexdigest()


def _check_weight_file(path: Path, key: str) -> None:
    if path.suffix != ".safetensors":
        return
    problem = safetensors_problem(path)
    if problem is not None:
        raise ConfigError(
            f"{key}: {path} is not a readable safetensors file ({problem}); download or "
            "copy it again"
        )


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's header, read alone: None where it parses and
    every tensor it lists lies inside the file (a truncated file's do not)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _HEADER_LIMIT:
                return "its first 8 bytes are no safetensors header length: random bytes?"
            if n > size - 8:
                return f"truncated inside its header ({size} bytes)"
            header: Any = json.loads(f.read(n))
    except (OSError, struct.error):
        return f"{size} bytes, shorter than a header"
    except (ValueError, UnicodeDecodeError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a mapping of tensors"
    data_bytes = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            shape = entry["shape"]
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no data_offsets or shape"
        numbers = [begin, end, *shape] if isinstance(shape, list) else None
        if numbers is None or not all(type(x) is int for x in numbers):
            return f"tensor {name!r} has offsets or a shape that are not whole numbers"
        if not (0 <= begin <= end) or math.prod(shape) < 0:
            return f"tensor {name!r} has bad offsets"
        if end > data_bytes:
            return f"truncated: tensor {name!r} ends at byte {end} of {data_bytes} data bytes"
    return None
