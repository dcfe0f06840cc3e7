"""Building the tokenized training and evaluation datasets from `DataSettings`.

Everything is read, checked and tokenized up front, so that a missing file or a bad row
stops the run before training starts, with one `DataError` line (or, with `skip_bad_rows`,
a counted skip and one warning per dataset). The result is a plain in-memory dataset of
dicts; the training loop samples it with its own seeded sampler.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from protrain.train.data.config import DatasetConfig, DataSettings
from protrain.train.data.encoding import Encoded, encode_sample
from protrain.train.data.errors import DataError
from protrain.train.data.formats import ChatSample, parse_row
from protrain.train.data.items import TokenizedDataset
from protrain.train.data.loading import UnreadableRow, read_rows, select_rows
from protrain.train.data.masks import IGNORE_INDEX, MaskSettings, resolve_mask_settings
from protrain.train.data.packing import pack_items
from protrain.train.data.prepared import fingerprint, load_prepared
from protrain.train.data.rendering import (
    ChatRenderer,
    TemplateMismatch,
    TemplateRenderError,
    end_of_turn_markers,
    special_token_strings,
)
from protrain.train.data.role_boundaries import (
    Boundary,
    boundary_labels,
    media_token_ids,
    resolve_boundaries,
)
from protrain.train.data.templates import resolve_chat_template
from protrain.train.data.vision import VisionEncoder

logger = logging.getLogger("protrain.train.data")


@dataclass
class DatasetReport:
    """What happened to one dataset's rows; logged once per dataset."""

    path: str
    rows: int = 0
    kept: int = 0
    skipped: list[str] = field(default_factory=list)  # one reason per skipped row
    truncated: int = 0
    dropped_long: int = 0
    too_long_media: int = 0
    no_trained_tokens: int = 0

    def log(self) -> None:
        if self.skipped:
            logger.warning(
                "dataset %r: skipped %d bad row(s) of %d (skip_bad_rows); first: %s",
                self.path,
                len(self.skipped),
                self.rows,
                self.skipped[0],
            )
        if self.truncated:
            logger.warning(
                "dataset %r: %d sample(s) longer than sequence_len were truncated (their "
                "tokens past it, answers included, do not train; excess_length_strategy: drop "
                "leaves them out)",
                self.path,
                self.truncated,
            )
        if self.dropped_long:
            logger.warning(
                "dataset %r: %d sample(s) longer than sequence_len were dropped "
                "(excess_length_strategy: drop)",
                self.path,
                self.dropped_long,
            )
        if self.too_long_media:
            logger.warning(
                "dataset %r: %d sample(s) with media were longer than sequence_len and dropped "
                "(media tokens cannot be truncated); raise sequence_len or shrink the images",
                self.path,
                self.too_long_media,
            )
        if self.no_trained_tokens:
            logger.warning(
                "dataset %r: %d sample(s) had no trained token (after truncation) and were dropped",
                self.path,
                self.no_trained_tokens,
            )


class DatasetEncoder:
    """Encodes the rows of one dataset entry with its resolved template and masks."""

    def __init__(
        self, settings: DataSettings, cfg: DatasetConfig, tokenizer, processor=None
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.processor = processor
        self.mask: MaskSettings = resolve_mask_settings(settings, cfg)
        self.renderer: ChatRenderer | None = None
        self.vision = None
        self.boundaries: list[Boundary] | None = None
        self._warned_tools = False
        # Config variables for every render; a row's own columns of the same name win.
        self.template_kwargs = {**settings.chat_template_kwargs, **(cfg.chat_template_kwargs or {})}
        if cfg.type == "chat":
            spec = cfg.chat_template if cfg.chat_template is not None else settings.chat_template
            source = processor if processor is not None else tokenizer
            try:
                template = resolve_chat_template(spec, source)
            except DataError as e:
                raise DataError(e.reason, dataset=cfg.path, field="chat_template") from e
            self.renderer = ChatRenderer(
                source, template, end_of_turn_markers(tokenizer), special_token_strings(tokenizer)
            )
            if processor is not None:
                self.vision = VisionEncoder(
                    settings, cfg, processor, tokenizer, self.renderer, self.mask
                )
            elif settings.role_boundaries is not None:
                self.boundaries = resolve_boundaries(
                    settings.role_boundaries, tokenizer, "role_boundaries"
                )
                self.never_trained = media_token_ids(tokenizer)

    def encode_row(self, row: dict[str, Any], row_index: int) -> Encoded:
        if isinstance(row, UnreadableRow):
            raise DataError(row.problem, dataset=self.cfg.path, row=row_index)
        variables = self.renderer.variables if self.renderer is not None else frozenset()
        sample = parse_row(row, self.cfg, row_index, variables, text_only=self.vision is None)
        if isinstance(sample, ChatSample) and self.template_kwargs:
            sample.template_kwargs = {**self.template_kwargs, **sample.template_kwargs}
        if row.get("tools") and "tools" not in variables and not self._warned_tools:
            self._warned_tools = True
            logger.warning(
                "dataset %r: rows carry `tools` but the chat template does not use them; the "
                "tool schemas are not in the prompt (use a chat template with tool support)",
                self.cfg.path,
            )
        if self.vision is not None and isinstance(sample, ChatSample):
            return self.vision.encode(sample, row_index)
        if self.boundaries is not None and isinstance(sample, ChatSample):
            return self._encode_by_boundaries(sample, row_index)
        try:
            return encode_sample(sample, self.tokenizer, self.renderer, self.mask)
        except TemplateMismatch as e:
            raise e.data_error(self.cfg.path, row_index) from e
        except TemplateRenderError as e:
            raise DataError(str(e), dataset=self.cfg.path, row=row_index, field="messages") from e

    def _encode_by_boundaries(self, sample: ChatSample, row_index: int) -> Encoded:
        try:
            _, text = self.renderer.prepare(sample.messages, sample.template_kwargs)
        except TemplateRenderError as e:
            raise DataError(str(e), dataset=self.cfg.path, row=row_index, field="messages") from e
        # verbose=False: rows are cut at sequence_len here (see `encoding.tokenize_labelled`)
        ids = list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        labels = boundary_labels(
            self.renderer, sample, text, ids, self.boundaries, self.mask, self.never_trained,
            dataset=self.cfg.path, row=row_index,
        )  # fmt: skip
        return Encoded(ids, labels, text)


def _fit(enc: Encoded, sequence_len: int, strategy: str, report: DatasetReport, row: int) -> bool:
    """A sample within `sequence_len`, as `excess_length_strategy` says: cut to it (text),
    or False to drop it; raise names the row."""
    if len(enc.input_ids) <= sequence_len:
        return True
    if strategy == "raise":
        raise DataError(
            f"{len(enc.input_ids)} tokens, longer than sequence_len = {sequence_len} "
            "(excess_length_strategy: raise; truncate or drop allow it)",
            dataset=report.path,
            row=row,
        )
    if any(isinstance(v, torch.Tensor) for v in enc.extras.values()):
        report.too_long_media += 1  # its media tokens cannot be cut from their pixels
        return False
    if strategy == "drop":
        report.dropped_long += 1
        return False
    report.truncated += 1
    enc.input_ids = enc.input_ids[:sequence_len]
    enc.labels = enc.labels[:sequence_len]
    for key, value in enc.extras.items():
        enc.extras[key] = value[:sequence_len]
    return True


def encode_dataset(
    settings: DataSettings,
    cfg: DatasetConfig,
    tokenizer,
    *,
    sequence_len: int,
    seed: int,
    processor=None,
    keep_text: bool = False,
) -> tuple[list[Encoded], DatasetReport]:
    """All usable samples of one dataset entry, encoded, in a seed-determined order."""
    encoder = DatasetEncoder(settings, cfg, tokenizer, processor)
    rows = read_rows(cfg)
    report = DatasetReport(cfg.path, rows=len(rows))
    encoded = []
    for row_index, row in select_rows(rows, cfg, seed=seed):
        try:
            enc = encoder.encode_row(row, row_index)
        except DataError as e:
            if not settings.skip_bad_rows:
                raise
            report.skipped.append(str(e))
            continue
        if not _fit(enc, sequence_len, settings.excess_length_strategy, report, row_index):
            continue
        if all(label == IGNORE_INDEX for label in enc.labels[1:]):
            report.no_trained_tokens += 1
            continue
        if not keep_text:
            enc.text = ""
            enc.notes = []
        encoded.append(enc)
    report.kept = len(encoded)
    if not encoded:
        reasons = [
            f"{report.no_trained_tokens} with no trained token (check roles_to_train, "
            "role_boundaries and train_on_eos)"
            if report.no_trained_tokens
            else "",
            f"{report.too_long_media} with media longer than sequence_len"
            if report.too_long_media
            else "",
            f"{report.dropped_long} longer than sequence_len (excess_length_strategy: drop)"
            if report.dropped_long
            else "",
            f"{len(report.skipped)} bad, first: {report.skipped[0]}" if report.skipped else "",
        ]
        raise DataError(
            f"no usable sample among {report.rows} row(s): " + "; ".join(r for r in reasons if r),
            dataset=cfg.path,
        )
    return encoded, report


def _encode_all(
    settings: DataSettings,
    configs: list[DatasetConfig],
    tokenizer,
    *,
    sequence_len: int,
    seed: int,
    processor,
) -> list[Encoded]:
    samples: list[Encoded] = []
    for cfg in configs:
        encoded, report = encode_dataset(
            settings, cfg, tokenizer, sequence_len=sequence_len, seed=seed, processor=processor
        )
        report.log()
        samples.extend(encoded)
    return samples


def _split_validation(
    samples: list[Encoded], val_set_size: float, seed: int
) -> tuple[list[Encoded], list[Encoded]]:
    """Deterministic hold-out: the same seed always holds out the same samples."""
    n_val = int(val_set_size) if val_set_size >= 1 else int(round(len(samples) * val_set_size))
    if n_val <= 0:
        return samples, []
    if n_val >= len(samples):
        raise DataError(
            f"val_set_size={val_set_size} holds out {n_val} of {len(samples)} samples; "
            "nothing would be left to train on"
        )
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_val])
    train = [s for i, s in enumerate(samples) if i not in held]
    val = [s for i, s in enumerate(samples) if i in held]
    return train, val


def _finish(samples: list[Encoded], settings: DataSettings, sequence_len: int, seed: int):
    items = [s.item() for s in samples]
    if settings.sample_packing:
        items = pack_items(items, sequence_len=sequence_len, seed=seed)
    return TokenizedDataset(items)


def check_settings(settings: DataSettings, tokenizer, processor=None) -> None:
    """What can be checked before any data is read: each dataset's chat template resolves,
    and every `role_boundaries` marker encodes with this tokenizer. Raises `DataError`."""
    for cfg in [*settings.datasets, *settings.eval_datasets]:
        DatasetEncoder(settings, cfg, tokenizer, processor)


# [Note: the val_set_size hold-out]
# The hold-out is carved from the encoded training rows, so building the training set also
# yields the evaluation set. It is kept here, keyed by everything it depends on, until
# `build_eval_dataset` asks for it, so the rows are not read and tokenized twice.
_held_out: dict[tuple, TokenizedDataset] = {}


def _held_out_key(settings, tokenizer, processor, sequence_len: int, seed: int) -> tuple:
    fp = fingerprint(settings, tokenizer, sequence_len=sequence_len, seed=seed, processor=processor)
    return (fp, id(tokenizer), id(processor))


def build_train_dataset(
    settings: DataSettings, tokenizer, *, sequence_len: int, seed: int, processor=None
) -> torch.utils.data.Dataset:
    """The tokenized (and, with `sample_packing`, packed) training dataset."""
    if not settings.datasets:
        raise DataError("datasets is empty: training needs at least one dataset")
    check_settings(settings, tokenizer, processor)
    prepared = load_prepared(
        settings,
        tokenizer,
        sequence_len=sequence_len,
        seed=seed,
        split="train",
        processor=processor,
    )
    if prepared is not None:
        return prepared
    samples = _encode_all(
        settings,
        settings.datasets,
        tokenizer,
        sequence_len=sequence_len,
        seed=seed,
        processor=processor,
    )
    if settings.val_set_size and not settings.eval_datasets:
        samples, held = _split_validation(samples, settings.val_set_size, seed)
        _held_out.clear()
        _held_out[_held_out_key(settings, tokenizer, processor, sequence_len, seed)] = _finish(
            held, settings, sequence_len, seed
        )
    return _finish(samples, settings, sequence_len, seed)


def build_eval_dataset(
    settings: DataSettings, tokenizer, *, sequence_len: int, seed: int, processor=None
) -> torch.utils.data.Dataset | None:
    """The evaluation dataset (`eval_datasets`, or the `val_set_size` hold-out), or None."""
    if not settings.eval_datasets and not settings.val_set_size:
        return None
    prepared = load_prepared(
        settings, tokenizer, sequence_len=sequence_len, seed=seed, split="eval", processor=processor
    )
    if prepared is not None:
        return prepared
    if settings.eval_datasets:
        samples = _encode_all(
            settings,
            settings.eval_datasets,
            tokenizer,
            sequence_len=sequence_len,
            seed=seed,
            processor=processor,
        )
        return _finish(samples, settings, sequence_len, seed)
    key = _held_out_key(settings, tokenizer, processor, sequence_len, seed)
    if key in _held_out:
        return _held_out.pop(key)
    samples = _encode_all(
        settings,
        settings.datasets,
        tokenizer,
        sequence_len=sequence_len,
        seed=seed,
        processor=processor,
    )
    _, held = _split_validation(samples, settings.val_set_size, seed)
    return _finish(held, settings, sequence_len, seed)
