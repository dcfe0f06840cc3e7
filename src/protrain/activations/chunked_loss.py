"""Cross-entropy of a causal LM over sequence chunks, without full-sequence fp32 logits.

The logits of ``chunk_tokens`` positions at a time are computed by calling the model's
output-embedding module (so hooks on it, the chunk runtime's gather among them, fire), put
through the family's logit transform (``LogitTransform``: scaling, soft-capping), upcast to
fp32 and reduced to a summed loss. Each chunk runs under a non-reentrant checkpoint: its
logits are dropped after forward and recomputed, one chunk at a time, in backward. Peak
memory for the loss is then about ``chunk_tokens * vocab`` fp32 values (logits, and their
log-softmax and gradient in backward) instead of ``batch * seq * vocab``.

``causal_lm_head`` finds, for a transformers causal LM, the head module and the transform
its ``forward`` applies, by reading that ``forward``'s source: a model is accepted only
where the lines from the body's output to the loss are ones known here, so a family that
does anything else to its logits is refused, never trained on a different loss.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LogitTransform:
    """What a causal LM does to ``head(hidden)`` before its loss, in the model's order:
    upcast to fp32 (``upcast_first``), times ``multiply``, divided by ``divide``, then
    ``softcap * tanh(logits / softcap)``. The default is the identity."""

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None
    upcast_first: bool = False

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.upcast_first:
            logits = logits.float()
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _chunk_loss_sum(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    transform: LogitTransform | None,
) -> torch.Tensor:
    logits = lm_head(hidden)
    if transform is not None:  # in the head's dtype, as the model's own forward does
        logits = transform(logits)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with positions: position t is scored against ``labels[..., t + 1]``."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def chunked_causal_lm_loss_sum(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int = 4096,
    logit_transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Sum over tokens of the causal LM cross-entropy, computed chunk by chunk.

    ``hidden_states`` ``(..., seq, hidden)`` are the final hidden states (after the final
    norm), ``labels`` ``(..., seq)`` the unshifted labels (shifted by one here; -100 is
    ignored), ``lm_head`` the model's output-embedding module (``get_output_embeddings()``),
    ``logit_transform`` what the family applies to the head's output (``causal_lm_head``).
    Equals ``F.cross_entropy(logit_transform(lm_head(hidden_states)).float() flattened,
    shifted labels, reduction="sum", ignore_index=-100)``; divide by the number of target
    tokens for a mean.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} is not allowed: use an integer >= 1")
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and labels {tuple(labels.shape)} "
            "do not match: want hidden_states (..., seq, hidden) and labels (..., seq)"
        )
    targets = shift_labels(labels).reshape(-1)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    transform = logit_transform if logit_transform != LogitTransform() else None
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if grad:
            total = total + checkpoint(
                _chunk_loss_sum, h, lm_head, t, transform, use_reentrant=False
            )
        else:
            total = total + _chunk_loss_sum(h, lm_head, t, transform)
    return total


# -- which head and transform a transformers causal LM uses ---------------------------------
#
# [Note: reading the head from the source]
# transformers has no API that says what a causal LM does between its body and its loss, and
# families differ (Gemma 2/3 soft-cap, Cohere scales, Granite divides, others mask or add a
# bias). The forward's source is the one place that says it, so it is read: the lines from
# the body's call to the loss must be, line by line, ones known below (variable names as
# transformers writes them). Anything else is refused, naming the line; a transformers
# release that rewrites a family's forward is refused until its lines are added, never
# trained on a loss the model does not compute.

# Lines between the body's call and the head (``{out}``: the body's output variable).
_PRE_LINES = (
    r"hidden_states = {out}\.last_hidden_state",
    r"hidden_states = {out}\[0\]",
    r"hidden_states = slice_logits_to_keep\((?:hidden_states|{out}\.last_hidden_state|"
    r"{out}\[0\]), logits_to_keep\)",
    r"slice_indices = slice\(-logits_to_keep, None\) if isinstance\(logits_to_keep, int\) "
    r"else logits_to_keep",
)
# The head's line (``{head}``: the attribute holding the output embedding).
_HEAD_LINE = (
    r"logits = self\.{head}\(hidden_states(?:\[:, slice_indices, :\])?"
    r"(?P<cast>\.to\((?:dtype=)?self\.{head}\.weight\.dtype\))?\)"
    r"(?P<suffix>(?:\.float\(\)|\.contiguous\(\))*)"
)
# The known blocks after the head, and what each one reads from the model.
_POST_BLOCKS: dict[str, str] = {
    "": "identity",
    "if self.config.final_logit_softcapping is not None:\n"
    "logits = logits / self.config.final_logit_softcapping\n"
    "logits = torch.tanh(logits)\n"
    "logits = logits * self.config.final_logit_softcapping": "softcap",
    "if (final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) "
    "is not None:\n"
    "logits = logits / final_logit_softcapping\n"
    "logits = torch.tanh(logits)\n"
    "logits = logits * final_logit_softcapping": "text_softcap",
    "logits = logits * self.logit_scale": "logit_scale",
    "logits = logits / self.config.logits_scaling": "logits_scaling",
}
_END = ("loss = ", "loss: ", "if labels is not None", "return ")


class UnsupportedHead(ValueError):
    """The model's logits are not a known transform of its output embedding's output."""


def causal_lm_head(model: nn.Module) -> tuple[nn.Module, LogitTransform]:
    """The output-embedding module of a transformers causal LM and the transform its
    ``forward`` applies to that module's output before the loss, such that ``model(**x)
    .logits == transform(head(model.base_model(**x).last_hidden_state))``.

    Raises ``UnsupportedHead`` (a ``ValueError``) naming what differs, where the logits are
    anything else (see [Note: reading the head from the source])."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise UnsupportedHead(f"{type(model).__name__} has no output embedding")
    names = [name for name, child in model.named_children() if child is head]
    if not names:
        raise UnsupportedHead(
            f"the output embedding of {type(model).__name__} is not one of its own modules"
        )
    kind, upcast_first = _read_forward(type(model), names[0], model.base_model_prefix)
    config = model.config
    if kind == "softcap":
        transform = LogitTransform(softcap=config.final_logit_softcapping)
    elif kind == "text_softcap":
        transform = LogitTransform(softcap=config.get_text_config().final_logit_softcapping)
    elif kind == "logit_scale":
        transform = LogitTransform(multiply=_number(model, "logit_scale", model.logit_scale))
    elif kind == "logits_scaling":
        transform = LogitTransform(divide=_number(model, "logits_scaling", config.logits_scaling))
    else:
        transform = LogitTransform()
    if upcast_first:
        transform = LogitTransform(
            transform.multiply, transform.divide, transform.softcap, upcast_first=True
        )
    return head, transform


def _number(model: nn.Module, name: str, value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise UnsupportedHead(
        f"{type(model).__name__}.{name} is {type(value).__name__}, not a number: a learned "
        "or per-token logit scale is not reproduced by the chunked loss"
    )


@functools.cache
def _read_forward(cls: type, head: str, prefix: str) -> tuple[str, bool]:
    """(the post-head block's kind, whether the head's output is upcast first) of
    ``cls.forward``; raises ``UnsupportedHead`` naming the first line not known."""
    where = f"{cls.__name__}.forward"
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        raise UnsupportedHead(f"the source of {where} cannot be read") from None
    lines = [_clean(line) for line in source.splitlines()]
    head_re = re.compile(_HEAD_LINE.format(head=re.escape(head)))
    at = [i for i, line in enumerate(lines) if head_re.fullmatch(_rename(line))]
    if len(at) != 1:
        raise UnsupportedHead(
            f"{where} does not compute its logits as self.{head}(hidden_states) on one line"
        )
    i_head = at[0]
    # the body's call: the last `out = self.<base model>(` before the head
    call_re = re.compile(rf"(\w+)(?:: [\w\[\], .]+)? = self\.{re.escape(prefix)}(?:\.\w+)*\((.*)")
    calls = [(i, m) for i, line in enumerate(lines[:i_head]) if (m := call_re.fullmatch(line))]
    if not calls:
        raise UnsupportedHead(f"{where} does not call self.{prefix} before its head")
    i_call, match = calls[-1]
    out = match.group(1)
    i = _after_call(lines, i_call, match.group(2))
    pre = [re.compile(p.format(out=re.escape(out))) for p in _PRE_LINES]
    for line in lines[i:i_head]:
        if line and not any(p.fullmatch(line) for p in pre):
            raise UnsupportedHead(f"{where}: {line!r} between the body and the head")
    suffix = head_re.fullmatch(_rename(lines[i_head])).group("suffix")
    post = []
    for line in lines[i_head + 1 :]:
        if line.startswith(_END):
            break
        if line:
            post.append(_rename(line))
    block = "\n".join(post)
    if block not in _POST_BLOCKS:
        raise UnsupportedHead(f"{where} transforms its logits in a way not known: {block!r}")
    return _POST_BLOCKS[block], ".float()" in suffix


def _clean(line: str) -> str:
    """The line without indentation or a trailing comment (none of the lines read holds a
    '#' in a string)."""
    return line.split("#", 1)[0].strip()


def _rename(line: str) -> str:
    # Falcon and others name the logits `lm_logits`.
    return re.sub(r"\blm_logits\b", "logits", line)


def _after_call(lines: list[str], i_call: int, rest: str) -> int:
    """The index of the line after the call opened on ``lines[i_call]`` closes."""
    depth = 1 + rest.count("(") - rest.count(")")
    i = i_call + 1
    while depth > 0 and i < len(lines):
        depth += lines[i].count("(") - lines[i].count(")")
        i += 1
    return i
