"""`protrain inspect-data`: a few samples as the model sees them, trained tokens marked.

Trained spans are wrapped in `[[...]]` (or coloured green with `color=True`); everything
else is masked. Chat samples list their messages first: role, the tools an assistant message
calls, which call a tool result answers, and whether the message is trained. Long runs of one repeated token (image placeholders, padding) are shown once
with a count.
"""

from __future__ import annotations

from protrain.train.data.config import DataSettings
from protrain.train.data.dataset import encode_dataset
from protrain.train.data.masking_info import describe_masking
from protrain.train.data.masks import IGNORE_INDEX

_GREEN = "\x1b[32m"
_RESET = "\x1b[0m"
_MIN_RUN = 8  # a token repeated this often in a row is shown as `tok x N`


def _decode_run(tokenizer, ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        if j - i >= _MIN_RUN:
            out.append(f"{tokenizer.decode([ids[i]])}×{j - i}")
            i = j
            continue
        k = i
        while k < len(ids):
            m = k
            while m < len(ids) and ids[m] == ids[k]:
                m += 1
            if m - k >= _MIN_RUN:
                break
            k = m
        out.append(tokenizer.decode(ids[i:k], skip_special_tokens=False))
        i = k
    return "".join(out)


def render_tokens(
    tokenizer, input_ids: list[int], labels: list[int], *, color: bool = False
) -> str:
    """The decoded sample with trained runs marked."""
    parts = []
    i = 0
    while i < len(input_ids):
        trained = labels[i] != IGNORE_INDEX
        j = i
        while j < len(input_ids) and (labels[j] != IGNORE_INDEX) == trained:
            j += 1
        text = _decode_run(tokenizer, list(input_ids[i:j]))
        if trained:
            text = f"{_GREEN}{text}{_RESET}" if color else f"[[{text}]]"
        parts.append(text)
        i = j
    return "".join(parts)


def render_inspection(
    settings: DataSettings,
    tokenizer,
    *,
    sequence_len: int,
    n_samples: int = 3,
    processor=None,
    seed: int = 0,
    color: bool = False,
) -> str:
    """Text for `protrain inspect-data`: the masking settings, then samples per dataset."""
    marker = "green" if color else "[[...]]"
    out = [f"# trained tokens are shown in {marker}; everything else is masked (label -100)"]
    out += [f"# {line}" for line in describe_masking(settings)]
    for cfg in settings.datasets:
        limited = cfg.model_copy(update={"max_samples": n_samples, "shuffle": False})
        encoded, report = encode_dataset(
            settings,
            limited,
            tokenizer,
            sequence_len=sequence_len,
            seed=seed,
            processor=processor,
            keep_text=True,
        )
        for k, enc in enumerate(encoded):
            n_trained = sum(label != IGNORE_INDEX for label in enc.labels)
            out.append(
                f"\n=== dataset {cfg.path!r} sample {k}: {len(enc.input_ids)} tokens, "
                f"{n_trained} trained ==="
            )
            out += [f"  {note}" for note in enc.notes]
            out.append(render_tokens(tokenizer, enc.input_ids, enc.labels, color=color))
        if report.skipped:
            out.append(f"\n({len(report.skipped)} bad row(s) skipped; first: {report.skipped[0]})")
    return "\n".join(out)
