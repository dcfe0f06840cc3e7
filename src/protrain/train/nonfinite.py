"""Steps and weights that are not finite: a NaN or inf never reaches the weights or the disk.

[Note: non-finite steps]
Before an optimizer step the loop reads the step's loss (every micro-batch's, the last one
before its backward) and the global gradient norm (taken anyway for clipping; without
clipping, the engine combines the per-chunk norms its gradient sink took during backward).
A step where either is not finite does not update the weights: its gradients are dropped,
the scheduler and the data stream move on as after any step. `nonfinite.policy: stop` (the
default) then ends the run with one line naming the step; `skip` goes on, and stops after
`nonfinite.max_consecutive_skips` such steps in a row.

With fp16 loss scaling, an overflowing gradient is the scaler's business (it skips that
step itself and lowers the scale), so only the loss is checked there.

The engine without clipping starts offloaded chunks' AdamW inside the last backward
(`step_in_backward`), before the gradient norm exists. It arms that only when the losses of
the step so far are finite, and under `policy: stop`; a non-finite gradient with a finite
loss there is found after backward, when some chunks have begun their update: the run
stops, and the half-updated weights in memory are never saved. Under `policy: skip` the
engine steps after backward instead, so that a skipped step touches nothing.

Whatever happens in memory, `assert_finite` runs over the weights before every checkpoint
and every export.
"""

from __future__ import annotations

import math

import torch

from protrain.train.config import NonFiniteConfig
from protrain.train.errors import ConfigError
from protrain.train.log import logger


class NonFiniteError(ConfigError):
    """A loss, gradient norm or weight that is not finite: the run cannot go on usefully.
    (A ConfigError: what fixes it is a change to the config, named in the message.)"""


class NonFiniteGuard:
    """Decides, step by step, whether a step may update the weights."""

    def __init__(self, cfg: NonFiniteConfig, *, learning_rate: float, max_grad_norm: float | None):
        self.cfg = cfg
        self.learning_rate = learning_rate
        self.max_grad_norm = max_grad_norm
        self.consecutive = 0
        self.skipped = 0

    def allows(self, step: int, loss: float, grad_norm: float | None, last_saved: str) -> bool:
        """True: step `step` (1-based) may update. False: skip it. Raises under `stop`, or
        after too many skips in a row. ``grad_norm`` None: not checked (fp16 scaling)."""
        what = _what_is_not_finite(loss, grad_norm)
        if what is None:
            self.consecutive = 0
            return True
        if self.cfg.policy == "stop":
            raise NonFiniteError(
                f"step {step}: {what}; the run stops here and keeps nothing of this step "
                f"({last_saved}). {self._advice()}"
            )
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive > self.cfg.max_consecutive_skips:
            raise NonFiniteError(
                f"step {step}: {what}; {self.consecutive} non-finite steps in a row, more than "
                f"nonfinite.max_consecutive_skips = {self.cfg.max_consecutive_skips}; the run "
                f"stops here ({last_saved}). {self._advice()}"
            )
        logger.warning(
            "step %d: %s: skipped, the weights were not updated (%d in a row, at most %d)",
            step,
            what,
            self.consecutive,
            self.cfg.max_consecutive_skips,
        )
        return False

    def _advice(self) -> str:
        clip = (
            f"max_grad_norm (now {self.max_grad_norm:g})"
            if self.max_grad_norm is not None
            else "max_grad_norm: 1.0 (clipping is off)"
        )
        return (
            f"Try a lower learning_rate (now {self.learning_rate:g}), {clip}, or "
            "nonfinite.policy: skip"
        )


def _what_is_not_finite(loss: float, grad_norm: float | None) -> str | None:
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm}"
    return None


@torch.no_grad()
def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or inf, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def assert_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse to write weights that are not finite; `what` says what would be written."""
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise NonFiniteError(
            f"{what} not written: weight {bad!r} is not finite (NaN or inf); the checkpoints "
            "already written are kept. Try a lower learning_rate, or set max_grad_norm"
        )
