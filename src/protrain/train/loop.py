"""The training loop of `protrain train`, one story from config to exported model, told
by `Run` in the order it happens:

1. `train` locks the output directory (one run per folder); `Run.setup` checks it, seeds
   everything, reads the tokenizer and data (validated in full before anything is
   written), builds the model (+ adapters) on the device and the optimizer: plain AdamW,
   or the chunked engine (`protrain.wrap`) when the `memory:` section asks for it, with
   knobs the planner chose for the heaviest micro-batch under `memory.auto`; the LR
   scheduler;
2. `Run.resume` continues from the newest intact checkpoint when asked;
3. `Run.train_step`: gradient accumulation over micro-batches, global-norm clipping, the
   non-finite check, optimizer and scheduler steps;
4. `Run.after_step`: the plan check, metrics, evaluation and checkpoints; SIGINT and
   SIGTERM stop the run at a step boundary, saved;
5. `Run.export`: Hugging Face format for full fine-tuning, a PEFT adapter directory
   otherwise.

Under `torchrun` every rank runs this story on its own GPU and its share of each step's
micro-batches; rank 0 alone writes logs, metrics and the export (see `train/ranks.py`), and
every rank of the chunked engine writes its own part of each checkpoint
(`train/checkpoint/sharded.py`). A checkpoint of either format resumes at any world size
and mode under the same global batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic_core
import torch
import yaml
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler

from protrain.distributed.agree import agreed, alike
from protrain.train import checkpoint as ckpt
from protrain.train import frozen_inputs, rank_failure
from protrain.train.attention import sdpa_backend
from protrain.train.checkpoint import sharded, streamed_export
from protrain.train.checkpoint.final_dir import publish, tmp_dir
from protrain.train.checkpoint.final_dir import recover as recover_final
from protrain.train.config import TrainConfig
from protrain.train.data import (
    DataError,
    build_collator,
    build_eval_dataset,
    build_train_dataset,
    describe_masking,
)
from protrain.train.errors import ConfigError, OutputDirError, PlanRefusedError
from protrain.train.fsdp2_trainable import check_layer_classes
from protrain.train.host_memory import check_host_memory_for_loading, checkpoint_numel
from protrain.train.log import logger, setup_logging
from protrain.train.loss import count_trained_tokens
from protrain.train.make_trainable import make_trainable
from protrain.train.metrics import MetricsWriter, set_aside_metrics
from protrain.train.modeling import (
    DTYPES,
    TINY,
    TINY_MODEL_CONFIG,
    beyond_positions_note,
    build_model,
    build_tiny_base,
    load_media_processor,
    load_tokenizer,
    model_auto_class,
    model_on_meta,
    resolve_autocast_dtype,
    resolve_device,
    trained_adapter_names,
)
from protrain.train.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    assert_finite,
    first_nonfinite,
)
from protrain.train.planning import sample_batch
from protrain.train.ranks import Ranks, start_ranks, stop_ranks
from protrain.train.run_lock import RunLock, check_free_space
from protrain.train.sampling import MicroBatchStream, StreamPosition
from protrain.train.seeding import seed_everything
from protrain.train.stop_signals import StopSignals, TrainingStopped, resume_command
from protrain.train.tracking import check_trackers_installed, open_trackers
from protrain.train.trainable import Trainable


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)  # one per optimizer step run here


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    new_global_batch: bool = False,
    accept_changed_inputs: bool = False,
) -> TrainResult:
    """Train as the config says; the SDPA kernel of `model.sdpa_backend` for the whole run,
    the output directory locked against a second run. Stopped by SIGINT or SIGTERM, it
    saves and raises `TrainingStopped` (a SystemExit of status 130 or 143).
    ``new_global_batch``: a resume may change the rows per optimizer step (see
    `_check_data_order`); ``accept_changed_inputs``: a resume may read frozen inputs that
    changed since the checkpoint (`train/frozen_inputs.py`)."""
    setup_logging()
    rank_failure.begin_run()
    output_dir = Path(cfg.output_dir)
    check_trackers_installed(cfg)  # before any work, and before the ranks meet
    ranks, device = start_ranks(resolve_device(cfg.device))
    if not ranks.is_main:  # rank 0 logs for the job
        logger.setLevel(logging.WARNING)
    with (
        sdpa_backend(cfg.model.sdpa_backend, device),
        RunLock(output_dir) if ranks.is_main else contextlib.nullcontext(),
    ):
        result = _train(
            cfg,
            output_dir,
            resume=resume,
            ranks=ranks,
            device=device,
            new_global_batch=new_global_batch,
            accept_changed_inputs=accept_changed_inputs,
        )
    # Only after a run every rank finished: a failed rank leaves the group as it is (its
    # exit ends the job through torchrun), since tearing it down waits for the others.
    stop_ranks()
    return result


def _train(
    cfg: TrainConfig,
    output_dir: Path,
    *,
    resume: bool,
    ranks: Ranks,
    device: torch.device,
    new_global_batch: bool = False,
    accept_changed_inputs: bool = False,
) -> TrainResult:
    run = Run(cfg, output_dir, ranks=ranks, device=device)
    run.setup(resume=resume, accept_changed_inputs=accept_changed_inputs)
    run.resume(new_global_batch=new_global_batch)
    return run.train()


@dataclass
class _LogWindow:
    """What the steps since the last log line add up to. Throughput counts training time
    only, not evaluation or checkpoint saves."""

    loss: float = 0.0  # over the finite steps
    steps: int = 0  # finite steps
    skipped: int = 0  # steps whose loss was not finite
    tokens: int = 0
    seconds: float = 0.0
    tokens_logged: int = 0  # tokens of the window already added to tokens_seen


class Run:
    """One training run, in the order it happens: `setup` (the output directory, the data,
    the model and optimizer), `resume` (from a checkpoint, or a fresh start), then `train`:
    each `train_step`, after it `after_step` (log, evaluate, save, stop), and at the end
    `export`. Every rank runs the same calls; rank 0 alone writes files."""

    def __init__(self, cfg: TrainConfig, output_dir: Path, *, ranks: Ranks, device: torch.device):
        self.cfg, self.output_dir, self.ranks, self.device = cfg, output_dir, ranks, device
        # micro-batches of the stream per optimizer step, all ranks together
        self.window = cfg.gradient_accumulation_steps * ranks.world_size

    # -- 1. setup: output directory, data, model, optimizer, scheduler ---------------------

    def setup(self, *, resume: bool, accept_changed_inputs: bool) -> None:
        cfg, ranks = self.cfg, self.ranks
        try:  # the files every rank reads alike, before any data or model is loaded
            frozen_inputs.check_readable(cfg)
        except ConfigError as exc:
            raise alike(exc) from None
        self.inputs = frozen_inputs.fingerprint(cfg)
        self.resume_from = ranks.on_main_patiently(
            lambda: self._check_output_dir(resume, accept_changed_inputs)
        )
        rank_failure.note_checkpoint(self.resume_from)
        if ranks.several:
            logger.info(
                "%d ranks (%s): each step takes %d x %d micro-batches of %d rows",
                ranks.world_size,
                "FSDP2" if cfg.fsdp_version else cfg.memory.mode or "sharded",
                cfg.gradient_accumulation_steps,
                ranks.world_size,
                cfg.micro_batch_size,
            )
        seed_everything(cfg.seed)
        self.autocast_dtype = resolve_autocast_dtype(
            cfg.mixed_precision, self.device, engine=cfg.memory.engine_enabled or ranks.several
        )
        if cfg.fsdp is not None:  # the layers named as FSDP2 units, before data and weights
            meta_model = model_on_meta(cfg)
            if meta_model is not None:
                check_layer_classes(meta_model, cfg)
        self._setup_data()
        self._setup_model()

    def _check_output_dir(self, resume: bool, accept_changed_inputs: bool) -> Path | None:
        """Rank 0 alone reads, hashes and moves files."""
        found = _check_output_dir(self.output_dir, resume)
        if found is not None:
            note = frozen_inputs.check_unchanged(
                found, self.inputs, self.cfg, accept_changed_inputs
            )
            if note is not None:
                logger.warning(note)
        needed = ckpt.space_needed_bytes(_estimate_checkpoint_bytes(self.cfg, found))
        check_free_space(self.output_dir, needed, "a checkpoint")
        return found

    def _setup_data(self) -> None:
        """Tokenizer and data: every row is checked here, before any output is written."""
        cfg = self.cfg
        positions_note = beyond_positions_note(cfg)
        if positions_note is not None and self.ranks.is_main:
            logger.warning(positions_note)
        self.tokenizer = load_tokenizer(cfg)
        processor = None  # a vision-language model's: its rows' images go through it
        if cfg.model.name_or_path != TINY:
            # a model kind it cannot train is refused before the data work
            processor = load_media_processor(cfg, model_auto_class(cfg))
        for line in describe_masking(cfg):
            logger.info(line)
        data_kwargs = dict(sequence_len=cfg.sequence_len, seed=cfg.seed, processor=processor)
        try:
            self.train_data = build_train_dataset(cfg, self.tokenizer, **data_kwargs)
            self.eval_data = build_eval_dataset(cfg, self.tokenizer, **data_kwargs)
        except DataError as exc:  # every rank reads and checks every row alike
            raise alike(exc) from None  # printed once a node; --debug shows where
        self.collate = build_collator(
            self.tokenizer, sequence_len=cfg.sequence_len, packing=cfg.sample_packing
        )
        try:
            _check_eval_rows(cfg, self.eval_data, warn=self.ranks.is_main)
        except ConfigError as exc:  # every rank holds the same rows
            raise alike(exc) from None
        self.stream = MicroBatchStream(len(self.train_data), cfg.micro_batch_size, cfg.seed)
        self.total_steps = _total_steps(cfg, self.stream, self.window)
        logger.info(
            "data: %d training rows%s; %d optimizer steps of %d x %d micro-batches",
            len(self.train_data),
            f", {len(self.eval_data)} evaluation rows" if self.eval_data is not None else "",
            self.total_steps,
            cfg.gradient_accumulation_steps,
            cfg.micro_batch_size,
        )

    def _setup_model(self) -> None:
        """Model, optimizer (plain or an engine), scheduler."""
        cfg = self.cfg
        _check_host_memory(cfg, self.ranks)
        self.built = build_model(cfg, self.tokenizer)
        if frozen_inputs.MODEL_KEY not in self.inputs:  # a hub model downloaded just now
            self.inputs = frozen_inputs.fingerprint(cfg)
        self.trainable = make_trainable(
            self.built.model,
            cfg,
            self.device,
            self.autocast_dtype,
            lambda: sample_batch(cfg, self.train_data, self.collate),
            several_ranks=self.ranks.several,
        )
        self.scheduler = _make_scheduler(cfg, self.trainable.optimizer, self.total_steps)

    # -- 2. resume: the checkpoint is checked against this run before anything is written --

    def resume(self, *, new_global_batch: bool) -> None:
        cfg, ranks, output_dir = self.cfg, self.ranks, self.output_dir
        self.data_order = {
            "rows": len(self.train_data),
            "micro_batch_size": cfg.micro_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "seed": cfg.seed,
            "world_size": ranks.world_size,
        }
        self.position, self.step, self.tokens_seen = StreamPosition(), 0, 0
        self.last_saved = self.resume_from
        if self.resume_from is not None:
            self._resume_from_checkpoint(new_global_batch)
        elif ranks.is_main:
            if set_aside_metrics(output_dir):
                logger.warning("metrics.jsonl of an earlier run without checkpoints moved aside")
            (output_dir / "config.yaml").write_text(_yaml(cfg))
            logger.info("resolved config (every key) written to %s", output_dir / "config.yaml")
        self.guard = NonFiniteGuard(
            cfg.nonfinite, learning_rate=cfg.learning_rate, max_grad_norm=cfg.max_grad_norm
        )
        logger.info("checkpoints: %s", _describe_saving(cfg))

    def _resume_from_checkpoint(self, new_global_batch: bool) -> None:
        cfg, window, resume_from = self.cfg, self.window, self.resume_from
        asked = _hyperparameters(self.trainable.optimizer), list(self.scheduler.base_lrs)
        step, trainer_state, scheduler_state = _resume(
            resume_from, self.trainable, self.ranks, self.data_order, new_global_batch
        )
        optimizer = self.trainable.optimizer
        saved_window = _saved_window(trainer_state) or window  # older checkpoints: unknown
        if saved_window != window and cfg.max_steps is None:
            # the steps left are those of the new window over the micro-batches left
            per_epoch = self.stream.micro_batches_per_epoch
            saved = trainer_state["position"]
            consumed = saved["epoch"] * per_epoch + saved["micro_batch"]
            left = per_epoch * cfg.num_epochs - consumed
            self.total_steps = step + left // window
            self.scheduler = _make_scheduler(cfg, self.trainable.optimizer, self.total_steps)
        self.scheduler.load_state_dict(scheduler_state)
        taken = _take_config_hyperparameters(optimizer, self.scheduler, *asked)
        if taken and self.ranks.is_main:
            logger.warning(
                "--resume: %s from this config from step %d on, not the checkpoint's (its "
                "moments, step counts and place in the schedule are kept)",
                ", ".join(taken),
                step + 1,
            )
        # this step's learning rate on this config's schedule (the same value where neither
        # the schedule nor its base changed: LambdaLR's step computes it so)
        for group, lr in zip(optimizer.param_groups, _lr_now(self.scheduler)):
            group["lr"] = lr
        if saved_window != window and self.ranks.is_main:
            logger.warning(
                "--new-global-batch: %d micro-batches per step from step %d (the checkpoint's "
                "%d), %d steps in all",
                window,
                step,
                saved_window,
                self.total_steps,
            )
        self.step = step
        self.position = StreamPosition(**trainer_state["position"])
        self.tokens_seen = trainer_state["tokens_seen"]
        logger.info("resumed from %s at step %d", resume_from, step)
        if self.ranks.is_main:  # rank 0 writes
            self._set_aside_later_metrics()
            _note_config_changes(self.output_dir / "config.yaml", cfg)

    def _set_aside_later_metrics(self) -> None:
        """The metrics records past the resumed step leave metrics.jsonl."""
        output_dir, step = self.output_dir, self.step
        moved = set_aside_metrics(output_dir, after_step=step)
        if not moved:
            return
        logger.info(
            "%d metrics records after step %d moved to %s",
            moved,
            step,
            output_dir / "metrics.superseded.jsonl",
        )
        if (output_dir / "final").is_dir():  # a finished run resumed again
            logger.warning(
                "%s holds a model trained past %s (the metrics went on past step "
                "%d): those steps are trained again, and the export at the end "
                "replaces it",
                output_dir / "final",
                self.resume_from.name,
                step,
            )

    # -- checkpoints ----------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {
            "position": vars(self.position),
            "tokens_seen": self.tokens_seen,
            "data_order": self.data_order,
            "extra": self.trainable.extra_state(),
            "frozen_inputs": self.inputs,  # compared at --resume
        }

    def save(self, step: int) -> Path:
        trainable, ranks, output_dir = self.trainable, self.ranks, self.output_dir
        if sharded.writes_sharded(trainable, ranks):  # every rank writes its own part
            return sharded.save_sharded_checkpoint(
                output_dir,
                step,
                trainable=trainable,
                ranks=ranks,
                scheduler_state=self.scheduler.state_dict(),
                trainer_state=self.trainer_state(),
                save_total_limit=self.cfg.save_total_limit,
            )
        # one process (plain PyTorch, or either engine on one rank): rank 0 writes it whole
        model_state = trainable.model_state(copy=False)
        optimizer_state = trainable.optimizer_state(copy=False)
        path = output_dir / f"checkpoint-{step}"
        if ranks.is_main:
            path = ckpt.save_checkpoint(
                output_dir,
                step,
                # views, not copies: a save must not double the host's model states
                model_state=model_state,
                optimizer_state=optimizer_state,
                scheduler_state=self.scheduler.state_dict(),
                trainer_state=self.trainer_state(),
                save_total_limit=self.cfg.save_total_limit,
                param_names=sharded.optimizer_param_names(trainable.optimizer, trainable.model),
            )
        ranks.barrier()  # a checkpoint counts once written, for every rank
        return path

    def _save_now(self) -> None:
        self.last_saved = self.save(self.step)
        rank_failure.note_checkpoint(self.last_saved)

    # -- 3. the loop ----------------------------------------------------------------------

    def train(self) -> TrainResult:
        """The steps, then the export; the stop handlers hold from the first step to the end
        of the export."""
        ranks = self.ranks
        self.metrics = _NoMetrics()
        if ranks.is_main:
            trackers = open_trackers(self.cfg, self.output_dir, self.cfg.model_dump(mode="json"))
            self.metrics = MetricsWriter(self.output_dir, trackers)
        self.result = TrainResult(
            output_dir=self.output_dir, final_dir=self.output_dir / "final", steps=self.step
        )
        self.batches = self.stream.iterate(self.position)
        self.progress = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=None if ranks.is_main else True,
        )
        self.log_window = _LogWindow()
        self.last_save_s = time.monotonic()
        self.stops = StopSignals()
        self.say = self.progress.write if ranks.is_main else (lambda line: None)
        with self.stops:
            self._steps()
            self.export()
        if self.stops.requested is not None:
            logger.warning(
                "%s came after the last step; the export finished: the run is complete",
                signal_name(self.stops.requested),
            )
        return self.result

    def _steps(self) -> None:
        failure: BaseException | None = None  # what ended the loop, for the trackers' records
        try:
            # A stop, a save and an evaluation are decided alike on every rank: each is a
            # collective of the engine in the sharded mode.
            stopping = False
            while self.step < self.total_steps and not stopping:
                grad_norm = self.train_step()
                stopping = self.after_step(grad_norm)
            self._stop_if_requested()
        except BaseException as exc:
            failure = exc
            if not self.ranks.several:
                # the engine's threads and buffers; the weights are not needed again (what
                # the run keeps is saved), and may be half stepped (a step refused as not
                # finite after its update began inside the backward)
                self.trainable.close(keep_weights=False)
            # Several ranks: closing the engine is a collective (it gathers sharded chunks),
            # which the other ranks, stopped elsewhere, never join: this rank would wait for
            # them until the group's timeout instead of ending the job with its message. The
            # process is about to exit and the OS takes its memory and daemon threads back.
            raise
        finally:
            self.progress.close()
            self.metrics.close(failure)

    def _next_micro_batches(self) -> tuple[list[dict[str, torch.Tensor]], int]:
        """This rank's share of the step's micro-batches, and the step's trained tokens
        over all ranks."""
        micro, n_trained = [], 0
        for k in range(self.window):  # every rank counts the whole step's tokens
            self.position, rows = next(self.batches)
            batch = self.collate([self.train_data[i] for i in rows])
            n_trained += count_trained_tokens(batch["labels"])
            if k % self.ranks.world_size == self.ranks.rank:  # this rank's share
                micro.append(batch)
        return micro, n_trained

    def train_step(self) -> float:
        """One optimizer step over the window's micro-batches; its gradient norm."""
        trainable, w = self.trainable, self.log_window
        step_start = time.perf_counter()
        micro, n_trained = self._next_micro_batches()
        step_loss = 0.0
        for i, batch in enumerate(micro):
            loss_sum = trainable.forward_loss_sum(batch)
            last = i == len(micro) - 1
            if last:  # read before its backward, which may begin the update
                step_loss = self.ranks.sum(step_loss + loss_sum.item())[0]
            trainable.backward(
                loss_sum / max(n_trained, 1), last=last, may_step=math.isfinite(step_loss)
            )
            if not last:
                step_loss += loss_sum.item()
            w.tokens += _n_tokens(batch)
        grad_norm = trainable.clip_grad_norm(self.cfg.max_grad_norm)
        loss = step_loss / max(n_trained, 1)
        checked_norm = None if trainable.skips_overflow else grad_norm
        if self.guard.allows(self.step + 1, loss, checked_norm, _saved_note(self.last_saved)):
            trainable.optimizer_step()
        else:
            trainable.skip_step()
        self.scheduler.step()
        self.step += 1
        self.result.losses.append(loss)
        if math.isfinite(loss):  # a skipped step's loss is no part of the mean
            w.loss += loss
            w.steps += 1
        else:
            w.skipped += 1
        w.seconds += time.perf_counter() - step_start
        self.tokens_seen += w.tokens - w.tokens_logged
        w.tokens_logged = w.tokens
        self.progress.update(1)
        return grad_norm

    # -- 4. after the step: plan check, log, evaluate, save, stop --------------------------

    def after_step(self, grad_norm: float) -> bool:
        """What follows a step; True where the run stops here."""
        cfg, ranks, step, total_steps = self.cfg, self.ranks, self.step, self.total_steps
        # A planned placement compares its prediction with the first steps once; a
        # corrected plan re-wraps the model, and the scheduler follows the new optimizer.
        try:
            plan_record = self.trainable.check_plan(step, total_steps)
        except PlanRefusedError as exc:  # the step is sound: only the plan for the next is not
            self._log(grad_norm)
            self._save_now()
            raise PlanRefusedError(
                f"{exc}; {self.last_saved.name} holds step {step}: resume from it (--resume) "
                "with that budget"
            ) from None
        if plan_record is not None:
            self.metrics.write(step, plan_record)
            self.scheduler.optimizer = self.trainable.optimizer
        if step % cfg.logging_steps == 0 or step == total_steps:
            self._log(grad_norm)
        stopping = ranks.any(self.stops.requested is not None)
        saved = False
        if step == total_steps:  # the last step is saved before its evaluation can fail
            saved, stopping = self._save_if_due(stopping)
        if (
            self.eval_data is not None
            and not stopping
            and cfg.eval.steps
            and (step % cfg.eval.steps == 0 or step == total_steps)
        ):
            eval_loss = evaluate(self.trainable, self.eval_data, self.collate, cfg)
            self.metrics.write(step, {"eval_loss": eval_loss})
            self.say(f"step {step}/{total_steps} | eval_loss {eval_loss:.4f}")
            # a signal that came during the evaluation stops the run here, saved
            stopping = ranks.any(self.stops.requested is not None)
        if not saved:
            _, stopping = self._save_if_due(stopping)
        return stopping

    def _save_if_due(self, stopping: bool) -> tuple[bool, bool]:
        """A checkpoint where one is due or the run stops; (saved, stopping)."""
        due = _save_due(self.cfg, self.step, self.total_steps, self.last_save_s)
        if not (self.ranks.any(due) or stopping):
            return False, stopping
        self._save_now()
        self.last_save_s = time.monotonic()
        logger.info("saved %s", self.last_saved)
        # a signal that came during the save stops the run here, not a step later
        return True, self.ranks.any(self.stops.requested is not None)

    def _log(self, grad_norm: float) -> None:
        """The window's record to the metrics, the progress bar and the log."""
        w, ranks = self.log_window, self.ranks
        if ranks.several:  # the whole job's throughput
            w.seconds = ranks.max(w.seconds)[0]
            w.tokens = int(ranks.sum(w.tokens)[0])
        record = {
            "epoch": round(self.stream.fractional_epoch(self.position), 4),
            # the mean over the window's finite steps (None: none was)
            "loss": w.loss / w.steps if w.steps else None,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens_per_s": w.tokens / max(w.seconds, 1e-9),
            "tokens_seen": self.tokens_seen,
        }
        if w.skipped:
            record["skipped_steps"] = w.skipped
        if self.device.type == "cuda":
            record["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.metrics.write(self.step, record)
        postfix = {
            "loss": "-" if record["loss"] is None else f"{record['loss']:.4f}",
            "lr": f"{record['lr']:.2e}",
            "tok_s": f"{record['tokens_per_s']:.0f}",
        }
        if "gpu_peak_gib" in record:
            postfix["gpu_gib"] = f"{record['gpu_peak_gib']:.1f}"
        self.progress.set_postfix(postfix)
        self.say(_format_log(self.step, self.total_steps, record))
        self.log_window = _LogWindow()

    def _stop_if_requested(self) -> None:
        """A stop signal: save where the last save was not this step, and stop."""
        ranks, stops = self.ranks, self.stops
        if ranks.several:  # a signal to any rank stops them all, saved alike
            signum = int(ranks.max(stops.requested or 0)[0])
            stops.requested = signum or None
        if stops.requested is None:
            return
        if self.last_saved != self.output_dir / f"checkpoint-{self.step}":
            self._save_now()
        if ranks.is_main:  # the job's stop, said once
            logger.warning(
                "stopped by %s at step %d/%d, saved in %s; resume with: %s",
                signal_name(stops.requested),
                self.step,
                self.total_steps,
                self.last_saved,
                resume_command(),
            )
        raise TrainingStopped(stops.requested)

    # -- 5. export ------------------------------------------------------------------------

    def export(self) -> None:
        result, step, total_steps = self.result, self.step, self.total_steps
        result.steps = step
        # A stop signal now lets the export finish (the model is the run's result; the
        # steps since the last checkpoint exist nowhere else); another one, past the
        # repeat window ([Note: repeated signals] in stop_signals.py), ends the process at
        # once. The same handlers as the loop's: no moment between the two.
        self.stops.finishing = "the export of the trained model"
        try:
            streamed = _write_final(
                self.trainable, self.built, self.cfg, self.ranks, result.final_dir
            )
        except NonFiniteError:
            raise  # it says what is kept
        except OutputDirError as exc:  # one line: what failed, and what is kept
            note = _export_failed_note(self.last_saved, step, total_steps)
            raise OutputDirError(f"{exc}; {note}") from None
        except Exception:
            if self.ranks.is_main:
                logger.error(_export_failed_note(self.last_saved, step, total_steps))
            raise
        self.ranks.barrier()
        self.trainable.close(keep_weights=not streamed)  # streamed: nothing to gather back
        logger.info("exported the trained model to %s", result.final_dir)


def _write_final(
    trainable: Trainable, built, cfg: TrainConfig, ranks: Ranks, final_dir: Path
) -> bool:
    """Write `final_dir` from every rank's trainable; True where it was streamed (every
    rank wrote its tensors, nothing is left to gather back)."""
    if ranks.several:  # each rank checks its own shards, one verdict for all
        _check_finite_over_ranks(trainable, ranks)
        why_not = streamed_export.streamable(trainable)
        if why_not is None:
            streamed_export.export_streamed(
                trainable, built.tokenizer, final_dir, ranks,
                write_extra=_tiny_base_writer(cfg, built),
            )  # fmt: skip
            return True
        logger.warning("export gathered on every rank (not streamed): %s", why_not)
    else:
        assert_finite(trainable.model_state(copy=False), "the final model")
    if not ranks.several:
        export(trainable, built, cfg, final_dir)
        return False
    model = trainable.export_model()  # every rank: closing the engine is a collective
    # Rank 0 writes the whole model while the others wait: a large one on slow storage
    # outlasts the group's collective timeout, which would end every rank, rank 0's write
    # included, and lose the steps after the last checkpoint.
    ranks.on_main_patiently(lambda: export(trainable, built, cfg, final_dir, model=model))
    return False


def _export_failed_note(last_saved: Path | None, step: int, total_steps: int) -> str:
    """What is kept when the export fails: the steps after the last checkpoint are lost."""
    if last_saved is None:
        return (
            f"the final model was not written, and no checkpoint was saved: the {step} steps "
            "trained are lost; set save_steps to keep checkpoints"
        )
    redo = (
        "exports it"
        if last_saved.name == f"checkpoint-{step}"
        else f"trains the steps after it (to {total_steps}) again and exports"
    )
    return (
        f"the final model was not written; {last_saved.name} is the newest checkpoint: after "
        f"fixing the cause, {resume_command()} {redo}"
    )


@torch.no_grad()
def evaluate(trainable: Trainable, data, collate, cfg: TrainConfig) -> float:
    """Mean token loss over the evaluation rows (in order, micro-batch by micro-batch)."""
    trainable.model.eval()
    total, n_tokens = 0.0, 0
    size = cfg.micro_batch_size
    for i, start in enumerate(range(0, len(data), size)):
        if cfg.eval.max_batches is not None and i >= cfg.eval.max_batches:
            break
        batch = collate([data[j] for j in range(start, min(start + size, len(data)))])
        total += trainable.forward_loss_sum(batch).item()
        n_tokens += count_trained_tokens(batch["labels"])
    trainable.model.train()
    return total / max(n_tokens, 1)


def export(trainable: Trainable, built, cfg: TrainConfig, final_dir: Path, model=None) -> None:
    """Write the model atomically: Hugging Face format, or the trained PEFT adapters (frozen
    ones stay where they were loaded from). ``model``: ``trainable.export_model()``'s, where
    it was already taken."""
    tmp = tmp_dir(final_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    if model is None:
        model = trainable.export_model()
    try:
        _write_export(model, trainable, built, cfg, tmp)
    except Exception as exc:  # a partial export is removed; the checkpoints are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = ckpt.as_os_error(exc, tmp)
        if os_error is None:
            raise
        if ckpt.is_no_space(os_error):
            raise OutputDirError(
                f"no space left in output_dir {str(final_dir.parent)!r} while writing the "
                f"final model ({tmp.name} removed)"
            ) from None
        raise os_error from None
    publish(tmp, final_dir)  # [Note: replacing final] in final_dir.py


def _write_export(model, trainable: Trainable, built, cfg: TrainConfig, tmp: Path) -> None:
    adapters = trained_adapter_names(model, trainable.names)
    if adapters is None:
        model.save_pretrained(tmp, safe_serialization=True)
    else:  # peft's layout: `default` at the top, any other adapter in its own subfolder
        model.save_pretrained(tmp, safe_serialization=True, selected_adapters=adapters)
    built.tokenizer.save_pretrained(tmp)
    write_extra = _tiny_base_writer(cfg, built)
    if write_extra is not None:
        write_extra(tmp)


def _tiny_base_writer(cfg: TrainConfig, built):
    """The built-in base exists nowhere else: an adapter ships it beside itself. It is the
    frozen random init, which the run's seed rebuilds exactly. None where not needed."""
    if not (cfg.adapter.enabled and built.is_tiny):
        return None

    def write(tmp: Path) -> None:
        build_tiny_base(cfg).save_pretrained(tmp / "base_model", safe_serialization=True)
        built.tokenizer.save_pretrained(tmp / "base_model")

    return write


def _check_finite_over_ranks(trainable: Trainable, ranks: Ranks) -> None:
    """`assert_finite` over every rank's own trainable values (its shards): no gather."""
    bad = first_nonfinite(trainable.own_trainable_values())
    first_bad_rank = int(ranks.max(-1 if bad is None else ranks.world_size - ranks.rank)[0])
    if first_bad_rank < 0:
        return
    what = (
        f"weight {bad!r}"
        if bad is not None
        else f"a weight of rank {ranks.world_size - first_bad_rank}"
    )
    raise NonFiniteError(
        f"the final model not written: {what} is not finite (NaN or inf); the checkpoints "
        "already written are kept. Try a lower learning_rate, or set max_grad_norm"
    )


# --------------------------------------------------------------------------------------


def _check_output_dir(output_dir: Path, resume: bool) -> Path | None:
    """Refuse to overwrite earlier work; with `resume`, return the newest intact checkpoint
    (what a killed run left is cleaned up first, damaged checkpoints moved aside)."""
    note = recover_final(output_dir / "final")
    if note is not None:
        logger.warning(note)
    if resume:
        return ckpt.find_resume_checkpoint(output_dir)
    unrenamed = ckpt.complete_unrenamed_saves(output_dir)
    listed = ckpt.list_checkpoints(output_dir)
    if listed or (output_dir / "final").exists() or unrenamed:
        # a save killed before its rename but verified is a checkpoint of the run:
        # --resume puts it in place; a new run must not remove it as a leftover
        held = (
            f" (a checkpoint, {unrenamed[-1].name}, awaits --resume)"
            if unrenamed and not listed
            else ""
        )
        raise OutputDirError(
            f"output_dir {str(output_dir)!r} already holds a training run{held}; pass --resume "
            "to continue it, or choose another output_dir"
        )
    for note in ckpt.clean_leftovers(output_dir, complete_saves=False):  # a new run
        logger.warning(note)
    return None


def _estimate_checkpoint_bytes(cfg: TrainConfig, resume_from: Path | None) -> int:
    """A checkpoint's size before anything is loaded: the last one's on resume; for full
    fine-tuning, 12 bytes a parameter (weight and two AdamW moments in fp32) of the model
    config, where it is on this machine; else 0 (each save checks the exact size)."""
    if resume_from is not None:
        return ckpt.checkpoint_bytes(resume_from)
    if cfg.adapter.enabled:
        return 0

    source = cfg.model.name_or_path
    if source != TINY:
        # the local checkpoint's safetensors headers, whatever the model's class
        # (seq2seq and vision-language models too)
        numel = checkpoint_numel(Path(source)) if Path(source).is_dir() else None
        return 12 * numel if numel else 0
    try:
        config = AutoConfig.for_model(**json.loads(TINY_MODEL_CONFIG.read_text()))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an estimate only: the save checks the exact size
        return 0
    return 12 * sum(p.numel() for p in model.parameters())


def _describe_saving(cfg: TrainConfig) -> str:
    limit = f"keeping the last {cfg.save_total_limit}" if cfg.save_total_limit else "keeping all"
    if cfg.save_steps:
        return f"every {cfg.save_steps} steps and at the end, {limit}"
    if cfg.save_minutes:
        return f"every {cfg.save_minutes:g} minutes (save_minutes; save_steps unset), {limit}"
    return "none (save_steps and save_minutes unset): a stopped run resumes from nothing"


def _check_host_memory(cfg: TrainConfig, ranks: Ranks) -> None:
    """Every rank of a host loads the whole model: the first rank decides whether the host
    holds that many copies, and every rank stops with its message if not."""
    message = None
    if ranks.is_main:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks.several else 1
        itemsize = DTYPES[cfg.model.dtype].itemsize
        try:
            check_host_memory_for_loading(
                cfg.model.name_or_path, itemsize, cfg.model.dtype, local_ranks=local
            )
        except ConfigError as exc:
            message = str(exc)
    message = ranks.from_main(message)
    if message is not None:
        raise agreed(ranks.ctx, ConfigError(message))


def _save_due(cfg: TrainConfig, step: int, total_steps: int, last_save_s: float) -> bool:
    if cfg.save_steps:
        return step % cfg.save_steps == 0 or step == total_steps
    if cfg.save_minutes and step < total_steps:  # the last step is exported anyway
        return time.monotonic() - last_save_s >= cfg.save_minutes * 60
    return False


def _saved_note(last_saved: Path | None) -> str:
    if last_saved is None:
        return "no checkpoint was saved yet"
    return f"{last_saved.name} is the last checkpoint, untouched"


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _total_steps(cfg: TrainConfig, stream: MicroBatchStream, window: int) -> int:
    """`max_steps`, or the optimizer steps of `window` micro-batches (accumulation times
    ranks) that fit in `num_epochs` (the micro-batch stream runs across epochs, so a window
    may span an epoch boundary; a last partial window is not run)."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    micro_batches = stream.micro_batches_per_epoch * cfg.num_epochs
    steps = micro_batches // window
    if steps == 0:
        ranks = window // cfg.gradient_accumulation_steps
        raise ConfigError(
            f"gradient_accumulation_steps = {cfg.gradient_accumulation_steps} is not allowed: "
            f"{cfg.num_epochs} epoch(s) hold only {micro_batches} micro-batches of "
            f"{cfg.micro_batch_size} rows"
            + (f", fewer than one step of {window} on {ranks} ranks" if ranks > 1 else "")
            + "; lower it, or set max_steps"
        )
    left = micro_batches - steps * window
    if left:
        logger.info("the last %d micro-batches do not fill an accumulation window: not run", left)
    return steps


class _NoMetrics:
    """The metrics writer of ranks other than 0, which write nothing."""

    def write(self, step: int, record: dict) -> None:
        pass

    def close(self, error: BaseException | None = None) -> None:
        pass


_CONFIG_KEYS = {"weight_decay": "weight_decay", "betas": "adam_beta1/2", "eps": "adam_epsilon"}


def _hyperparameters(optimizer) -> list[dict[str, Any]]:
    """Each group's AdamW hyperparameters as this run's config made them."""
    return [{k: g[k] for k in _CONFIG_KEYS} for g in optimizer.param_groups]


def _take_config_hyperparameters(optimizer, scheduler, hyper, base_lrs) -> list[str]:
    """Put this run's learning rate and AdamW hyperparameters back over the checkpoint's
    (``load_state_dict`` brings back the values it was written with, as the schedule's
    ``base_lrs``): a resume trains with the config it is given, as it does for the other
    keys. The config keys whose values changed."""
    changed = []
    for key, name in _CONFIG_KEYS.items():
        saved = [g[key] for g in optimizer.param_groups]
        if [_plain(v) for v in saved] != [_plain(h[key]) for h in hyper]:
            changed.append(name)
            for g, h in zip(optimizer.param_groups, hyper):
                g[key] = h[key]
    if [float(b) for b in scheduler.base_lrs] != [float(b) for b in base_lrs]:
        changed.insert(0, "learning_rate")
        scheduler.base_lrs = list(base_lrs)
        for g, b in zip(optimizer.param_groups, base_lrs):
            g["initial_lr"] = b
    return changed


def _plain(value):
    """A hyperparameter as a comparable value (betas come back from a checkpoint as a list)."""
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else float(value)


def _lr_now(scheduler) -> list[float]:
    """The learning rates at the schedule's place now (every schedule here is a LambdaLR;
    its ``get_lr`` warns when called outside ``step``)."""
    return [
        base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)
    ]


def _resume(path: Path, trainable, ranks: Ranks, data_order: dict, new_global_batch: bool):
    """Load a checkpoint of either format (one process wrote it, or several ranks) into
    this run, at any world size and mode; the step, trainer state and scheduler state it
    holds."""
    if ckpt.checkpoint_format(path) == ckpt.SHARDED:
        trainer_state = sharded.read_state(path)["trainer"]
        _check_data_order(trainer_state.get("data_order"), data_order, path, new_global_batch)
        resumed = sharded.load_sharded_checkpoint(path, trainable, ranks)
        step, trainer_state, scheduler_state = (
            resumed.step,
            resumed.trainer_state,
            resumed.scheduler_state,
        )
    else:
        state = ckpt.load_checkpoint(path)
        _check_data_order(state.trainer_state.get("data_order"), data_order, path, new_global_batch)
        try:
            trainable.load_model_state(state.model_state)
        except ValueError as exc:  # names or shapes of another model (or adapter)
            raise OutputDirError(
                f"--resume: {path / 'model.safetensors'} is a checkpoint of another model "
                f"({exc}); resume with the config that wrote it, or move {path.name} away to "
                "resume from the one before"
            ) from None
        try:
            trainable.load_optimizer_state(state.optimizer_state)
        except ValueError as exc:  # another optimizer choice, or another model's groups
            raise OutputDirError(
                f"--resume: the optimizer state in {path} does not fit this run ({exc}); "
                f"resume with the config that wrote it, or move {path.name} away to resume "
                "from the one before"
            ) from None
        ckpt.restore_rng(state)
        step, trainer_state, scheduler_state = (
            state.step,
            state.trainer_state,
            state.scheduler_state,
        )
    trainable.load_extra_state(trainer_state.get("extra", {}))
    return step, trainer_state, scheduler_state


def _saved_window(trainer_state: dict) -> int | None:
    """Micro-batches per optimizer step, all ranks together, of the run that saved."""
    order = trainer_state.get("data_order")
    if order is None:
        return None
    return order["gradient_accumulation_steps"] * order.get("world_size", 1)


def _check_data_order(
    saved: dict | None, now: dict, checkpoint, new_global_batch: bool = False
) -> None:
    """A checkpoint's data position means something only under the same data order: the
    same rows, seed and micro-batch size, and the same global batch (micro-batches per step,
    accumulation times ranks), however it is split over ranks; ``new_global_batch`` (the
    user's `--new-global-batch`) lets the global batch change."""
    if saved is None:
        return
    saved = {"world_size": 1, **saved}  # checkpoints from before several ranks
    window = {"gradient_accumulation_steps", "world_size"}
    diffs = ", ".join(
        f"{k}: {saved.get(k)} -> {now[k]}"
        for k in now
        if k not in window and saved.get(k) != now[k]
    )
    if diffs:
        # rows: the training rows after tokenizing, truncating, holding out and packing
        rows = (
            " (rows follow datasets, sequence_len, val_set_size and sample_packing)"
            if saved.get("rows") != now["rows"]
            else ""
        )
        # micro_batch_size orders the rows; the global batch may change through the window
        batch = (
            "; to change the global batch, keep micro_batch_size and change "
            "gradient_accumulation_steps or the number of ranks (--resume --new-global-batch)"
            if saved.get("micro_batch_size") != now["micro_batch_size"]
            else ""
        )
        raise alike(
            OutputDirError(
                f"--resume: {checkpoint} was written under another data order ({diffs}){rows}; its "
                "data position does not carry over: restore those settings, or start a new "
                f"output_dir{batch}"
            )
        )
    before = saved["gradient_accumulation_steps"] * saved["world_size"]
    after = now["gradient_accumulation_steps"] * now["world_size"]
    if before == after or new_global_batch:
        return
    mbs = now["micro_batch_size"]
    hint = (
        f"set gradient_accumulation_steps: {before // now['world_size']} to keep it"
        if before % now["world_size"] == 0
        else f"run on a number of ranks that divides {before}"
    )
    raise alike(
        OutputDirError(
            f"--resume: {checkpoint} was written with a global batch of {mbs} x "
            f"{saved['gradient_accumulation_steps']} x {saved['world_size']} = {mbs * before} rows "
            f"per step (micro_batch_size x gradient_accumulation_steps x ranks); this run's is "
            f"{mbs} x {now['gradient_accumulation_steps']} x {now['world_size']} = {mbs * after}: "
            f"{hint}, continue with the new one (--resume --new-global-batch), or start a new "
            "output_dir"
        )
    )


def _check_eval_rows(cfg: TrainConfig, eval_data, warn: bool) -> None:
    """Evaluation asked for with no rows to read is refused before training; rows held out
    that no evaluation reads are named (they train nothing either)."""
    n = 0 if eval_data is None else len(eval_data)
    if cfg.eval.steps and not n:
        source = "eval_datasets" if cfg.eval_datasets else f"val_set_size = {cfg.val_set_size}"
        raise ConfigError(
            f"eval.steps = {cfg.eval.steps} but the evaluation data ({source}) has no rows: "
            "give it rows (raise val_set_size, or set eval_datasets), or remove eval.steps"
        )
    if n and not cfg.eval.steps and warn:
        fix = "val_set_size: 0 to train on them" if cfg.val_set_size else "remove eval_datasets"
        logger.warning(
            "%d evaluation rows (%s) but eval.steps is unset, so none is evaluated: set "
            "eval.steps to evaluate them, or %s",
            n,
            "held out of training" if cfg.val_set_size else "eval_datasets",
            fix,
        )


def _note_config_changes(path: Path, cfg: TrainConfig) -> None:
    """Keep the run's recorded config; say which keys this resume changes."""
    if not path.exists():
        path.write_text(_yaml(cfg))
        logger.info("resolved config (every key) written to %s", path)
        return
    before = yaml.safe_load(path.read_text()) or {}
    now = json.loads(cfg.model_dump_json())
    changed = sorted(
        k for k in set(before) | set(now) if before.get(k, _default_json(k)) != now.get(k)
    )
    if changed:
        logger.warning(
            "resuming with changed config keys: %s (config.yaml keeps the original)",
            ", ".join(changed),
        )


def _default_json(key: str) -> Any:
    """A key's default as config.yaml writes it: a key the recorded config lacks (written
    before the key existed) took its default then."""
    field = TrainConfig.model_fields.get(key)
    if field is None:
        return None
    return json.loads(pydantic_core.to_json(field.get_default(call_default_factory=True)))


def _make_scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    if cfg.warmup_steps is not None:
        warmup = cfg.warmup_steps
    else:
        warmup = math.ceil((cfg.warmup_ratio or 0.0) * total_steps)
    return get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
        scheduler_specific_kwargs=cfg.lr_scheduler_kwargs,
    )  # fmt: skip


def _yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False)


def _n_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens of a micro-batch."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return batch["input_ids"].numel()


def _format_log(step: int, total: int, record: dict[str, Any]) -> str:
    parts = [
        f"step {step}/{total}",
        f"loss {record['loss']:.4f}" if record["loss"] is not None else "",
        f"lr {record['lr']:.3e}",
        f"grad_norm {record['grad_norm']:.3f}" if record["grad_norm"] is not None else "",
        f"{record['skipped_steps']} skipped" if record.get("skipped_steps") else "",
        f"{record['tokens_per_s']:.0f} tok/s",
    ]
    if "gpu_peak_gib" in record:
        parts.append(f"gpu {record['gpu_peak_gib']:.2f} GiB")
    return " | ".join(p for p in parts if p)
