"""ProTrain: the engine's `protrain.wrap` with the knobs given on the command line.

The model is filled on the host; the engine decides from the knobs what goes to the GPU.
Figures the engine reports about its plan and its steps are copied into the result row
where it exposes them (see `_plan_fields` and `StepCounters`).
"""

from __future__ import annotations

import torch

from materialize import build_for_mode
from systems import RowSpec, Trainer
from systems.plain import enable_checkpointing
from workloads import hf_config

_GIB = 2**30


def setup(spec: RowSpec) -> Trainer:
    import protrain

    model = build_for_mode(hf_config(spec.model), spec.mode, spec.lora_rank, spec.device)
    kernels = put_kernels(model, spec)
    if not spec.auto and spec.checkpointing:  # auto: the plan's activation policies instead
        enable_checkpointing(model)
    model.train()
    knobs = {
        k: v
        for k, v in (
            ("n_persist", spec.n_persist),
            ("n_buffer", spec.n_buffer),
            ("chunk_size_bytes", spec.chunk_size_bytes),
            ("host_threads", spec.host_threads),
            ("n_device_step", spec.n_device_step),
            ("distributed_mode", spec.distributed_mode),
            ("optimizer_state", None if spec.optimizer_state == "fp32" else spec.optimizer_state),
        )
        if v is not None
    }
    loss_fn = _hf_loss
    # as `memory: {chunked_loss_tokens: N}` in the app; the fused loss is the app's loss too
    if spec.chunked_loss_tokens or kernels.fused_loss:
        from protrain.train.planning import planner_loss

        loss_fn = planner_loss(spec.device, spec.chunked_loss_tokens)
    auto = {}
    if spec.auto:  # the planner profiles one step at the row's shape and searches
        vocab = model.config.vocab_size
        ids = torch.randint(vocab, (spec.batch, spec.seq), device=spec.device)
        budget = spec.budget_gib if spec.budget_gib is not None else 1.0  # --tiny: no budget
        auto = dict(
            gpu_budget=int(budget * _GIB),
            sample_batch={"input_ids": ids, "labels": ids},
            clipping=spec.max_grad_norm is not None,
            loss_fn=loss_fn,
            device_step_search=spec.device_step_search,
        )
    if spec.auto and spec.profiles is not None:
        model, optimizer, layout = _plan_keeping_profiles(model, spec, knobs, auto)
    else:
        model, optimizer, layout = protrain.wrap(
            model,
            **knobs,
            **auto,
            device=spec.device,
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            compute_dtype=torch.bfloat16,
        )

    def step(micro_batches: list[torch.Tensor]) -> torch.Tensor:
        for i, input_ids in enumerate(micro_batches):
            if spec.max_grad_norm is None and i == len(micro_batches) - 1:
                optimizer.step_in_backward()  # each chunk's host AdamW starts inside backward
            loss = loss_fn(model, {"input_ids": input_ids, "labels": input_ids})
            (loss / len(micro_batches)).backward()
        if spec.max_grad_norm is not None:
            optimizer.clip_grad_norm_(spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    plan, predicted_peak_gib, predicted_step_s = _plan_fields(layout, knobs)
    if spec.auto:
        chosen = protrain.plan_of(model)
        plan = {**chosen.knobs, "chunk_size_bytes": layout.chunk_size_bytes, "auto": True,
                "distributed_mode": chosen.distributed_mode, "reasons": chosen.reasons,
                "time_terms": chosen.time_terms,
                "n_device_step": knobs.get("n_device_step", chosen.n_device_step),
                "planned_n_device_step": chosen.n_device_step}  # fmt: skip
        predicted_peak_gib = chosen.predicted_peak_bytes / _GIB
        predicted_step_s = chosen.predicted_step_s
    # what the engine runs with, read back from it (not the row's request)
    plan = {**(plan or {}), "kernels": list(kernels.names),
            "optimizer_state": getattr(optimizer, "state_format", "fp32")}  # fmt: skip
    return Trainer(step, plan, predicted_peak_gib, predicted_step_s, StepCounters(model, optimizer))


def put_kernels(model: torch.nn.Module, spec: RowSpec):
    """Liger's kernels for ``spec.kernels`` (auto | none), as `model.kernels` in the app."""
    from protrain.activations.fused_loss import apply_kernels, fused_head_problem
    from protrain.model.kernels import choose_kernels, liger_installed

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    choice = choose_kernels(
        spec.kernels,
        causal_lm.config.model_type,
        spec.device,
        liger_available=liger_installed(),
        head_problem=fused_head_problem(causal_lm),
    )
    print(choice.describe(), flush=True)
    apply_kernels(causal_lm, choice)
    return choice


def _plan_keeping_profiles(model, spec: RowSpec, knobs: dict, auto: dict):
    """What ``protrain.wrap(gpu_budget=...)`` does, as the application does it (the
    planner's ``profile_and_plan``, then ``apply_plan``), keeping the model and hardware
    profiles the plan was made from in ``spec.profiles`` for ``repredict.py``."""
    import gzip
    import json

    from protrain.knobs import Knobs, OptimizerSettings
    from protrain.plan import PlanRequest, profile_and_plan
    from protrain.planned_wrap import apply_plan

    fixed = Knobs(
        n_persist=knobs.get("n_persist"),
        n_buffer=knobs.get("n_buffer"),
        n_device_step=knobs.get("n_device_step"),
        chunk_size_bytes=knobs.get("chunk_size_bytes"),
        distributed_mode=knobs.get("distributed_mode"),
    )
    request = PlanRequest(
        auto["gpu_budget"],
        sample_batch=auto["sample_batch"],
        knobs=fixed,
        loss_fn=auto["loss_fn"],
        clipping=auto["clipping"],
        device_step_search=auto["device_step_search"],
        optimizer_state=spec.optimizer_state,
    )
    plan, problem = profile_and_plan(
        model, request, device=spec.device, compute_dtype=torch.bfloat16
    )
    if problem is not None:  # several ranks: the first rank planned
        budget = f"-{spec.budget_gib:g}g" if spec.budget_gib is not None else ""
        name = f"{spec.workload}-b{spec.batch}-s{spec.seq}{budget}-w{spec.world_size}"
        spec.profiles.mkdir(parents=True, exist_ok=True)
        with gzip.open(spec.profiles / f"{name}.profile.json.gz", "wt") as f:
            f.write(problem.profile.to_json())
        (spec.profiles / f"{name}.hardware.json").write_text(json.dumps(problem.hardware.to_dict()))
    optim = OptimizerSettings(
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        host_threads=knobs.get("host_threads"),
        optimizer_state=spec.optimizer_state,
    )
    model, optimizer, layout, _ = apply_plan(
        model, plan, device=spec.device, compute_dtype=torch.bfloat16, optim=optim
    )
    return model, optimizer, layout


def _hf_loss(model, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def _plan_fields(layout, knobs: dict) -> tuple[dict, float | None, float | None]:
    plan = dict(knobs)
    for name in ("n_persist", "n_buffer", "n_swap", "n_checkpoint", "n_chunks", "chunk_size_bytes"):
        value = getattr(layout, name, None)
        if isinstance(value, int):
            plan[name] = value
    peak = getattr(layout, "predicted_peak_bytes", None)
    step_s = getattr(layout, "predicted_step_s", None)
    return plan, (peak / _GIB if peak is not None else None), step_s


class StepCounters:
    """Per-step figures from the engine's cumulative counters (keys ending in `_s` or
    `_bytes`, and `gathers`): host optimizer and waits, and the copies each way with their seconds, the
    link's busy time and the compute's waits for gathers (`wait_copy_s`), all the engine's
    own (`protrain/chunks/copy_times.py`).

    The engine keeps them in a `stats` dict: on the optimizer if it exposes one, else on
    its chunk manager. Each call returns the growth since the previous call, after the
    manager has counted every copy so far (a synchronization, between steps).
    """

    def __init__(self, model, optimizer) -> None:
        self._stats = getattr(optimizer, "stats", None)
        engine = getattr(model, "_protrain_engine", None)
        self._manager = getattr(engine, "manager", None)
        if not isinstance(self._stats, dict):
            self._stats = getattr(self._manager, "stats", None)
        self._last = self._snapshot()

    def _snapshot(self) -> dict[str, float]:
        if not isinstance(self._stats, dict):
            return {}
        return {
            k: float(v)
            for k, v in self._stats.items()
            if k.endswith(("_s", "_bytes")) or k == "gathers"
        }

    def __call__(self) -> dict[str, float]:
        if self._manager is not None:
            self._manager.settle_counters()
        now = self._snapshot()
        delta = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        return delta
