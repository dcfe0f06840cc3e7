"""Dynamic loss scale for fp16 compute, with the semantics of ``torch.amp.GradScaler``.

The scale multiplies the loss before backward; the optimizer divides the gradients by it
(in fp32, ``grad * (1 / scale)``, as GradScaler does) before clipping and the update, skips
the step when any gradient is inf or nan, and then calls :meth:`LossScaler.update`: a skipped
step multiplies the scale by ``backoff_factor``, ``growth_interval`` clean steps in a row
multiply it by ``growth_factor`` (``torch._amp_update_scale_``, GradScaler's own kernel).
Where the gradients live and how they are checked is the optimizer's business
(see [Note: loss scaling over chunks] in ``hybrid_adamw.py``).

Disabled (bf16 or fp32 compute), the scale is 1 and :meth:`scale` returns the loss itself.
"""

from __future__ import annotations

import math

import torch


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


class LossScaler:
    def __init__(
        self,
        device: torch.device,
        *,
        enabled: bool = True,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        # Offloaded gradients' 2-norms are taken on the device before the device-to-host
        # copy, on the scaled gradients; norm(g) / s equals norm(g / s) bit for bit only
        # when s is a power of two, so every scale this scaler can reach must be one.
        for name, value in (
            ("init_scale", init_scale),
            ("growth_factor", growth_factor),
            ("backoff_factor", backoff_factor),
        ):
            if not _is_power_of_two(float(value)):
                raise ValueError(
                    f"loss scaling: {name}={value} must be a power of two (the engine unscales "
                    "gradient norms taken before the gradients left the device, which is exact "
                    "only for powers of two)"
                )
        if not growth_factor > 1.0 or not backoff_factor < 1.0:
            raise ValueError("loss scaling: need growth_factor > 1 and backoff_factor < 1")
        if int(growth_interval) < 1:
            raise ValueError(f"loss scaling: growth_interval={growth_interval} must be >= 1")
        self.device = torch.device(device)
        self.enabled = enabled
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=self.device)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=self.device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (the loss itself when disabled); call backward on the result."""
        if not self.enabled:
            return loss
        return loss * self._scale.to(device=loss.device, non_blocking=True)

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as GradScaler computes it (in float64, then rounded to fp32)."""
        return self._scale.double().reciprocal().float()

    def get_scale(self) -> float:
        return self._scale.item() if self.enabled else 1.0

    def get_growth_tracker(self) -> int:
        return int(self._growth_tracker.item()) if self.enabled else 0

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off after a skipped step, grow after ``growth_interval`` clean ones."""
        if not self.enabled:
            return
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf.to(device=self.device, dtype=torch.float32),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict:
        """GradScaler's format; empty when disabled."""
        if not self.enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError("loss scaler state is empty: it was saved without fp16 loss scaling")
        for name in ("scale", "growth_factor", "backoff_factor"):
            if not _is_power_of_two(float(state_dict[name])):
                raise ValueError(
                    f"loss scaler state: {name}={state_dict[name]} is not a power of two"
                )
        self._scale.fill_(float(state_dict["scale"]))
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker.fill_(int(state_dict["_growth_tracker"]))
