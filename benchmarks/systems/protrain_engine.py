"""ProTrain: the engine's `protrain.wrap` with the knobs given on the command line.

The model is filled on the host; the engine decides from the knobs what goes to the GPU.
Figures the engine reports about its plan and its steps are copied into the result row
where it exposes them (see `_plan_fields` and `_step_extras`).
"""

from __future__ import annotations

import torch

from materialize import build_on_meta, materialize
from systems import RowSpec, Trainer
from systems.plain import enable_checkpointing
from workloads import hf_config

_GIB = 2**30


def setup(spec: RowSpec) -> Trainer:
    import protrain

    dtype = torch.bfloat16 if spec.mode == "lora" else torch.float32
    model = build_on_meta(hf_config(spec.model), dtype, spec.lora_rank)
    materialize(model, "cpu", fill_device=spec.device)
    enable_checkpointing(model)
    model.train()
    knobs = {
        k: v
        for k, v in (("n_persist", spec.n_persist), ("n_buffer", spec.n_buffer))
        if v is not None
    }
    model, optimizer, layout = protrain.wrap(
        model,
        **knobs,
        device=spec.device,
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        compute_dtype=torch.bfloat16,
    )

    def step(input_ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if spec.max_grad_norm is not None:
            optimizer.clip_grad_norm_(spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    plan, predicted_peak_gib, predicted_step_s = _plan_fields(layout, knobs)
    return Trainer(
        step, plan, predicted_peak_gib, predicted_step_s, lambda: _step_extras(model, optimizer)
    )


def _plan_fields(layout, knobs: dict) -> tuple[dict, float | None, float | None]:
    plan = dict(knobs)
    for name in ("n_persist", "n_buffer", "n_swap", "n_checkpoint", "n_chunks", "chunk_size_bytes"):
        value = getattr(layout, name, None)
        if isinstance(value, int):
            plan[name] = value
    peak = getattr(layout, "predicted_peak_bytes", None)
    step_s = getattr(layout, "predicted_step_s", None)
    return plan, (peak / _GIB if peak is not None else None), step_s


def _step_extras(model, optimizer) -> dict:
    # The engine's per-step timings, if it keeps them: a dict of seconds such as
    # copy_wait_s and cpu_optim_s, averaged over the timed steps by the harness.
    for owner in (optimizer, model):
        stats = getattr(owner, "last_step_stats", None)
        if callable(stats):
            stats = stats()
        if isinstance(stats, dict):
            return {k: float(v) for k, v in stats.items() if k.endswith("_s")}
    return {}
