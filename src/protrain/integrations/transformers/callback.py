"""Clipping and clearing gradients around the Trainer's optimizer step, through the
Trainer's public callback events.

The engine keeps gradients in its chunks, not in ``param.grad``, so the Trainer's own
``clip_grad_norm_`` over ``model.parameters()`` would see no gradient at all. The engine's
optimizer clips instead (``HybridAdamW.clip_grad_norm_``: the global norm over every chunk,
as ``torch.nn.utils.clip_grad_norm_`` computes it), in ``on_pre_optimizer_step``, which the
Trainer calls after the last backward of the step and right before ``optimizer.step()``.
After the step, the Trainer clears gradients with ``model.zero_grad()``, which does not reach
the chunks' accumulators: ``on_optimizer_step`` clears them with the engine's ``zero_grad``.
"""

from __future__ import annotations

from transformers import TrainerCallback

from protrain.optim.hybrid_adamw import HybridAdamW


class EngineStepCallback(TrainerCallback):
    """Clip (``max_grad_norm``; None: only measure the norm) before each optimizer step and
    clear the engine's gradients after it. ``last_grad_norm`` holds the norm of the last step
    (before clipping), for the Trainer's logs."""

    def __init__(self, optimizer: HybridAdamW | None, max_grad_norm: float | None):
        # None until the model is wrapped (ProTrainConfig.gpu_budget: when training starts)
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.max_grad_norm is not None:
            norm = self.optimizer.clip_grad_norm_(self.max_grad_norm)
        else:  # also valid after a backward armed by step_in_backward()
            norm = self.optimizer.grad_norm()
        self.last_grad_norm = float(norm)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer.zero_grad()
