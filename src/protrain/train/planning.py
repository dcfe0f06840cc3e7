"""What `memory: {auto: true}` needs from the application: the heaviest micro-batch of the
real data at its real shape, the loop's loss as the planner's `loss_fn`, and one call to
the planner with the budgets and the knobs the user fixed. Used by `AutoTrainable` and by
`protrain plan` / `protrain profile`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from protrain.activations import UnsupportedHead, causal_lm_head
from protrain.activations.fused_loss import fused_head
from protrain.plan import NoPlanFits, PlanRequest, profile_and_plan, profile_model
from protrain.plan.loss_chunk import LOSS_CHUNK_FLOOR_TOKENS, LossChunks
from protrain.train.config import ENGINE_OPTIMIZERS, TrainConfig
from protrain.train.data import build_collator, build_train_dataset
from protrain.train.errors import ConfigError
from protrain.train.heaviest_batch import heaviest_batch
from protrain.train.log import logger
from protrain.train.loss import count_trained_tokens, loss_sum
from protrain.train.modeling import (
    build_model,
    load_media_processor,
    load_tokenizer,
    resolve_autocast_dtype,
    resolve_device,
)
from protrain.train.seeding import seed_everything
from protrain.units import GIB


def sample_batch(cfg: TrainConfig, train_data, collate) -> dict[str, torch.Tensor]:
    """The heaviest micro-batch the training data can produce, made of real rows by the
    run's collator at `micro_batch_size` (see `heaviest_batch`): the most media input and
    the widest width, so that the plan holds for every micro-batch. Which rows and why is
    logged in one line. The run's data order and random state are not touched."""
    chosen = heaviest_batch(
        train_data,
        collate,
        micro_batch_size=cfg.micro_batch_size,
        sequence_len=cfg.sequence_len,
        packing=cfg.sample_packing,
    )
    logger.info(chosen.reason)
    return chosen.batch


def planner_loss(device: torch.device, chunked_loss_tokens: int | None):
    """The loop's loss (chunked when configured) as the planner's `loss_fn(model, batch)`."""

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        n = max(count_trained_tokens(batch["labels"]), 1)
        return loss_sum(model, batch, device, chunked_loss_tokens) / n

    return loss_fn


def planner_loss_chunks(model: nn.Module, settings: PlanSettings):
    """The loop's loss as one the planner chunks (`protrain.plan.loss_chunk.LossChunks`), or
    None where the user fixed `memory.chunked_loss_tokens`, the fused linear cross-entropy
    replaces the chunks (no logits at all: `protrain.model.kernels`), or the model's logits
    cannot be computed in chunks (`causal_lm_head` refuses its head: the whole logits)."""
    if settings.chunked_loss_tokens is not None:
        return None
    get_base = getattr(model, "get_base_model", None)
    causal_lm = get_base() if callable(get_base) else model
    if fused_head(causal_lm) is not None:
        logger.info("memory: the loss is not searched in chunks: the fused linear "
                    "cross-entropy holds no logits")  # fmt: skip
        return None
    try:
        head, _ = causal_lm_head(causal_lm)
    except UnsupportedHead as exc:
        logger.info("memory: the loss is not searched in chunks (%s): whole logits", exc)
        return None
    vocab = getattr(getattr(head, "weight", None), "shape", (None,))[0]
    if vocab is None:
        return None
    return LossChunks(
        loss_at=lambda tokens: planner_loss(settings.device, tokens),
        vocab_size=int(vocab),
        floor_tokens=settings.loss_chunk_floor_tokens,
    )


def loss_chunk_of(plan, settings: PlanSettings) -> int | None:
    """The `chunked_loss_tokens` to train with: the plan's where the planner chose it, else
    the user's (`memory.chunked_loss_tokens`)."""
    return plan.chunked_loss_tokens if plan.loss_planned else settings.chunked_loss_tokens


@dataclass
class PlanSettings:
    """The application's planning: where it plans, the request from the config (budgets,
    fixed knobs, the run's schedule and optimizer; the sample batch and the loss are added
    when the plan is made, `plan_request`) and the loss chunk the user fixed, if any."""

    device: torch.device
    compute_dtype: torch.dtype
    request: PlanRequest
    chunked_loss_tokens: int | None = None
    # The smallest loss chunk searched where chunked_loss_tokens is not set (plan/loss_chunk).
    loss_chunk_floor_tokens: int = LOSS_CHUNK_FLOOR_TOKENS

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, device: torch.device, autocast_dtype: torch.dtype | None
    ) -> PlanSettings:
        mem = cfg.memory
        if mem.gpu_budget is None:
            raise ConfigError(
                "memory.gpu_budget is not set: the planner needs the device memory it may "
                "use, e.g. --set memory.auto=true --set memory.gpu_budget=24GiB"
            )
        request = PlanRequest(
            gpu_budget_bytes=int(mem.gpu_budget),
            cpu_budget_bytes=int(mem.cpu_budget) if mem.cpu_budget is not None else None,
            knobs=mem.knobs(),
            # The host optimizer's schedule the plan assumes: after the whole backward
            # (clipping, or fp16 whose overflow check needs every gradient), or inside the
            # backward (EngineTrainable arms step_in_backward when neither applies).
            clipping=cfg.max_grad_norm is not None or autocast_dtype == torch.float16,
            device_step_search=mem.device_step_search,
            optimizer=ENGINE_OPTIMIZERS[cfg.optimizer],
            optimizer_state=cfg.optimizer_state,
        )
        return cls(
            device=device,
            compute_dtype=autocast_dtype or torch.float32,
            request=request,
            chunked_loss_tokens=mem.chunked_loss_tokens,
            loss_chunk_floor_tokens=LOSS_CHUNK_FLOOR_TOKENS,
        )


def plan_memory(model: nn.Module, batch: dict, settings: PlanSettings):
    """Profile one step and search: `(plan, problem)`. The model is left as it was, and so
    is the RNG state (the trace's dropout draws do not shift the run's). Several ranks
    (the default group initialized): every rank calls this; the first traces its batch and
    searches, every rank gets that plan (the problem: the first rank only, None elsewhere)."""
    request = plan_request(model, batch, settings)
    with torch.random.fork_rng(devices=_rng_devices(settings.device)):
        try:
            return profile_and_plan(
                model, request, device=settings.device, compute_dtype=settings.compute_dtype
            )
        except NoPlanFits as exc:
            raise ConfigError(no_plan_fits_message(exc, settings)) from None
        except ValueError as exc:  # e.g. a fixed knob this model cannot take
            raise ConfigError(f"memory: {exc}") from None


def profile_memory(model: nn.Module, batch: dict, settings: PlanSettings):
    """One traced step of the real model at the real batch (the planner's profile)."""
    request = plan_request(model, batch, settings)
    with torch.random.fork_rng(devices=_rng_devices(settings.device)):
        return profile_model(
            model, request, device=settings.device, compute_dtype=settings.compute_dtype
        )


def plan_request(model: nn.Module, batch: dict, settings: PlanSettings) -> PlanRequest:
    """The settings' request with the sample batch and the loop's loss, the same for
    planning and for profiling (and for `benchmarks/plan_accuracy.py`, which plans as the
    application does)."""
    return replace(
        settings.request,
        sample_batch=batch,
        loss_fn=planner_loss(settings.device, settings.chunked_loss_tokens),
        loss_chunks=planner_loss_chunks(model, settings),
        fixed_loss_chunk_tokens=settings.chunked_loss_tokens,
    )


def no_plan_fits_message(exc, settings: PlanSettings) -> str:
    if getattr(exc, "kind", "gpu") == "host":
        host = settings.request.cpu_budget_bytes
        budget = "memory.cpu_budget" + (f" = {_size(host)}" if host is not None else " (unset)")
        return f"{budget}: {_one_line(exc)}"
    budget = f"memory.gpu_budget = {_size(settings.request.gpu_budget_bytes)}"
    smallest = exc.smallest_budget_bytes
    if smallest is None:
        # No smallest budget is known (the trace itself ran out of memory, say): the
        # planner's message says why and what to change.
        return f"{budget}: {_one_line(exc)}"
    binding = getattr(exc, "binding_knobs", None) or {}
    at = "".join(
        f" with the loss at its least memory (memory.{k} = {v})" for k, v in binding.items()
    )
    return (
        f"{budget}: no plan fits; the smallest budget that would is "
        f"{_size(smallest)}{at} (set memory.gpu_budget to at least that)"
    )


def _size(n: int) -> str:
    """Rounded up, so that the named size is enough."""
    for unit, name in ((GIB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{math.ceil(n * 100 / unit) / 100:.2f}{name}"
    return f"{n}B"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def planning_inputs(cfg: TrainConfig) -> tuple[nn.Module, dict, PlanSettings]:
    """Model, sample batch and planner settings, built as `protrain train` builds them,
    writing nothing: for `protrain plan` and `protrain profile`."""
    device = resolve_device(cfg.device)
    # before the data and the model are built: a missing budget is refused at once
    settings = PlanSettings.from_config(cfg, device, run_autocast_dtype(cfg, device))
    model, batch = run_model_and_batch(cfg)
    return model, batch, settings


def run_autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The compute dtype `protrain train` resolves for `cfg` on `device` (the engine's own
    where the chunked engine runs or several ranks train)."""

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    engine = cfg.memory.engine_enabled or several
    return resolve_autocast_dtype(cfg.mixed_precision, device, engine=engine)


def run_model_and_batch(cfg: TrainConfig) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (in training mode) and the planning micro-batch (`sample_batch`) of a run,
    built as `protrain train` builds them (same seed, data, collator and model), writing
    nothing: the one builder of `planning_inputs` and of the FSDP2 engine's trace."""
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg)
    train_data = build_train_dataset(
        cfg,
        tokenizer,
        sequence_len=cfg.sequence_len,
        seed=cfg.seed,
        processor=load_media_processor(cfg),
    )
    collate = build_collator(tokenizer, sequence_len=cfg.sequence_len, packing=cfg.sample_packing)
    batch = sample_batch(cfg, train_data, collate)
    model = build_model(cfg, tokenizer).model
    model.train()
    return model, batch
