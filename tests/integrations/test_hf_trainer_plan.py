"""ProTrainTrainer with a GPU budget: the memory plan for the heaviest micro-batch of the
Trainer's data (ProTrainConfig.gpu_budget), logged once, training to the Trainer's own losses (the
tolerance of the application's auto tests), and resuming exactly from its checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from protrain.integrations.transformers import ProTrainConfig

from .test_hf_trainer import (
    EngineTrainer,
    PlainTrainer,
    dataset,
    run_plain,
    tiny_model,
    trained_state,
)
from .test_hf_trainer import arguments as trainer_arguments

BUDGET = "100MiB"  # on the CPU: the engine's tensor bytes as the planner counts them


def planned_trainer(tmp, lora, max_grad_norm, config, **kw) -> EngineTrainer:
    trainer = EngineTrainer(
        model=tiny_model(lora),
        args=trainer_arguments(tmp, max_grad_norm, **kw),
        train_dataset=dataset(),
        protrain_config=config,
    )
    trainer.losses = []
    return trainer


# The user fixes n_persist=1 and the chunk size (chunks offload); the planner chooses n_buffer
# and the activation knobs, from the heaviest micro-batch padded to plan_sequence_len.
CONFIG = ProTrainConfig(gpu_budget=BUDGET, n_persist=1, chunk_size_bytes=1 << 19,
                        plan_sequence_len=32)  # fmt: skip
SAVE = dict(save_strategy="steps", save_steps=2)


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory):
    """A planned run (clipping on, accumulation 2), its plan log and its checkpoints."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("protrain.integrations")
    handler, old = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = planned_trainer(tmp_path_factory.mktemp("planned"), False, 0.05, CONFIG, **SAVE)
        assert not trainer.wrapped and trainer.plan is None  # until train() starts
        assert next(trainer.model.parameters()).device.type == "cpu"
        trainer.train()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    yield trainer, records
    trainer.close()


def test_planned_run_gives_the_trainers_losses(tmp_path, planned_run):
    trainer, records = planned_run
    losses, state, _, _ = run_plain(tmp_path / "plain", False, 0.05)
    plan = trainer.plan
    assert plan is not None and trainer.layout.n_persist == plan.n_persist == 1
    assert plan.chunk_size_bytes == 1 << 19
    assert sum(not c.persistent for c in trainer.layout.chunks) >= 2
    lines = [m for m in records if m.startswith("protrain memory plan for the planning")]
    # per_device_train_batch_size=2 rows of 24 tokens, padded to plan_sequence_len
    assert len(lines) == 1 and "batch 2x32:" in lines[0] and str(plan) in lines[0]
    torch.testing.assert_close(trainer.losses, losses, rtol=1e-5, atol=1e-6)
    got = trained_state(trainer)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_resume_with_a_budget_continues_exactly(tmp_path, planned_run):
    """The checkpoint is read after the model is wrapped, when training starts."""
    whole, _ = planned_run
    resumed = planned_trainer(tmp_path / "resumed", False, 0.05, CONFIG, **SAVE)
    resumed.train(resume_from_checkpoint=str(Path(whole.args.output_dir) / "checkpoint-2"))
    assert resumed.plan.knobs == whole.plan.knobs
    torch.testing.assert_close(resumed.losses, whole.losses[len(resumed.losses) :], rtol=0, atol=0)
    want, got = trained_state(whole), trained_state(resumed)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
    resumed.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_budget": "lots"}, "ProTrainConfig.gpu_budget: 'lots' is not a size"),
        ({"cpu_budget": "8GiB"}, "read only by the planner: set gpu_budget"),
        ({"gpu_budget": "1GiB", "offload_checkpoint": True}, "offload_checkpoint=True is not"),
        ({"gpu_budget": "1GiB", "plan_sequence_len": 0}, "plan_sequence_len=0 is not allowed"),
        ({"gpu_budget": 0}, "gpu_budget=0 is not allowed: use a size above 0"),
        ({"gpu_budget": -5}, "gpu_budget=-5 is not allowed"),
    ],
)
def test_bad_budget_settings_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProTrainConfig(**kwargs)


def test_evaluate_before_train_plans_and_wraps_first(tmp_path):
    """evaluate() before train() with a budget plans from the training data and wraps, as
    train() would (unwrapped, the Trainer's evaluation places the whole model on the
    device); training then runs under that plan to the Trainer's losses. Without a
    train_dataset it is one clear error."""
    runs = []
    for trainer in (
        PlainTrainer(model=tiny_model(False), args=trainer_arguments(tmp_path / "plain", 0.05),
                     train_dataset=dataset()),
        planned_trainer(tmp_path / "a", False, 0.05, CONFIG),
    ):  # fmt: skip
        trainer.losses = []
        before = trainer.evaluate(eval_dataset=dataset(4))["eval_loss"]
        assert getattr(trainer, "wrapped", True)  # the engine's: planned and wrapped by now
        trainer.train()
        runs.append((trainer, before))
    (plain, plain_before), (engine, engine_before) = runs
    assert engine.plan is not None
    assert engine_before == pytest.approx(plain_before, rel=0, abs=1e-6)
    torch.testing.assert_close(engine.losses, plain.losses, rtol=0, atol=1e-6)
    engine.close()

    bare = EngineTrainer(
        model=tiny_model(False), args=trainer_arguments(tmp_path / "b", 0.05),
        protrain_config=CONFIG,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"evaluate\(\) before train\(\) with ProTrainConfig"):
        bare.evaluate(eval_dataset=dataset(4))
