"""ProTrain's engine under the Hugging Face Trainer (protrain.integrations.transformers):
the same per-step losses as the Trainer alone in fp32 (full fine-tuning and LoRA, gradient
accumulation 2, clipping on and off, offloaded chunks), save_model directories that
from_pretrained loads, and exact resumes from the Trainer's checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import protrain
from protrain.integrations.transformers import ProTrainConfig, ProTrainTrainer
from protrain.integrations.transformers.arguments import take_over

REPO = Path(__file__).resolve().parents[2]
MODEL_JSON = REPO / "src/protrain/train/quickstart/model.json"
# Small chunks, one kept on the device: several chunks offload (the layout is checked).
ENGINE = ProTrainConfig(n_persist=1, chunk_size_bytes=1 << 19)
STEPS = 4


def tiny_model(lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads(MODEL_JSON.read_text()))
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        )
        # a non-zero B: the adapter changes the loss from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return model


def dataset(n: int = 16, length: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 512, (length,), generator=g)
        labels = ids.clone()
        labels[: length // 3] = -100  # prompt tokens: uneven counts across micro-batches
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


def arguments(tmp: Path, max_grad_norm: float, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=2e-3,
        weight_decay=0.1,
        max_grad_norm=max_grad_norm,
        optim="adamw_torch_fused",
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**base, **kw})


class Recording:
    """Records the loss of every micro-batch (what training_step returns)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(float(loss))
        return loss


class PlainTrainer(Recording, Trainer):
    losses: list[float]


class EngineTrainer(Recording, ProTrainTrainer):
    losses: list[float]


def run_plain(tmp: Path, lora: bool, max_grad_norm: float) -> tuple[list[float], dict]:
    model = tiny_model(lora)
    trainer = PlainTrainer(
        model=model,
        args=arguments(tmp, max_grad_norm),
        train_dataset=dataset(),
        eval_dataset=dataset(4),
    )
    trainer.losses = []
    trainer.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    return trainer.losses, state, trainer.state.log_history, trainer.evaluate()["eval_loss"]


def engine_trainer(tmp: Path, lora: bool, max_grad_norm: float, **kw) -> EngineTrainer:
    trainer = EngineTrainer(
        model=tiny_model(lora),
        args=arguments(tmp, max_grad_norm, **kw),
        train_dataset=dataset(),
        eval_dataset=dataset(4),
        protrain_config=ENGINE,
    )
    trainer.losses = []
    return trainer


def trained_state(trainer: ProTrainTrainer) -> dict[str, torch.Tensor]:
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    return protrain.state_dict(trainer.model, names=names)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["noclip", "clip"])
def test_same_losses_as_trainer(tmp_path, lora, max_grad_norm):
    losses, state, history, eval_loss = run_plain(tmp_path / "plain", lora, max_grad_norm)
    trainer = engine_trainer(tmp_path / "engine", lora, max_grad_norm)
    assert sum(not c.persistent for c in trainer.layout.chunks) >= 2
    trainer.train()
    assert len(trainer.losses) == len(losses) == 2 * STEPS
    torch.testing.assert_close(trainer.losses, losses, rtol=0, atol=1e-6)
    got = trained_state(trainer)
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)
    plain_norms = [h["grad_norm"] for h in history if "grad_norm" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    torch.testing.assert_close(norms, plain_norms, rtol=1e-5, atol=0)
    if max_grad_norm:
        assert min(norms) > max_grad_norm  # clipping did bite
    else:  # offloaded updates began inside the last backward of each step
        assert trainer.engine_optimizer.stats.get("updates_started_in_backward", 0) > 0
    # evaluation runs the engine's forward without gradients
    assert abs(trainer.evaluate()["eval_loss"] - eval_loss) <= 1e-6
    trainer.close()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_save_model_reloads_with_from_pretrained(tmp_path, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from protrain.integrations.transformers import ENGINE_STATE_NAME

    trainer = engine_trainer(tmp_path / "run", lora, max_grad_norm=0.05)
    trainer.train()
    out = tmp_path / "export"
    trainer.save_model(str(out))
    assert not (out / ENGINE_STATE_NAME).exists()  # a plain HF / PEFT directory
    engine_state = protrain.state_dict(trainer.model)
    if lora:
        assert (out / "adapter_model.safetensors").is_file()
        reloaded = PeftModel.from_pretrained(tiny_model(lora=False), str(out))
    else:
        assert (out / "model.safetensors").is_file()
        reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    reloaded_state = reloaded.state_dict()
    assert set(reloaded_state) == set(engine_state)
    for name, value in engine_state.items():
        torch.testing.assert_close(reloaded_state[name], value, rtol=0, atol=0)
    # the trained weights, not the initial ones
    initial = tiny_model(lora).state_dict()
    assert any(not torch.equal(engine_state[n], initial[n]) for n in trainer._trainable_names)
    trainer.close()


@pytest.mark.parametrize(
    ("lora", "max_grad_norm"), [(False, 0.05), (True, 0.0)], ids=["full-clip", "lora-noclip"]
)
def test_resume_from_checkpoint_continues_exactly(tmp_path, lora, max_grad_norm):
    from protrain.integrations.transformers import ENGINE_STATE_NAME

    save = dict(save_strategy="steps", save_steps=2)
    whole = engine_trainer(tmp_path / "whole", lora, max_grad_norm, **save)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    for name in (ENGINE_STATE_NAME, "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
    resumed = engine_trainer(tmp_path / "resumed", lora, max_grad_norm, **save)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed.losses) == len(whole.losses) // 2
    torch.testing.assert_close(resumed.losses, whole.losses[len(resumed.losses) :], rtol=0, atol=0)
    want, got = trained_state(whole), trained_state(resumed)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
    whole.close()
    resumed.close()


def test_clipping_is_the_engines_and_the_callers_arguments_stay(tmp_path):
    args = arguments(tmp_path, max_grad_norm=0.5)
    trainer = ProTrainTrainer(model=tiny_model(), args=args, train_dataset=dataset())
    assert args.max_grad_norm == 0.5  # the caller's arguments are not changed
    assert trainer.args.max_grad_norm == 0.0  # the Trainer's clip (param.grad) never runs
    assert trainer.max_grad_norm == 0.5
    trainer.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"optim": "sgd"}, "optim='sgd'"),
        ({"optim": "adafactor"}, "optim='adafactor' is not supported"),
        # these cast or compile the wrapped model as a whole (it was left half cast)
        ({"bf16_full_eval": True}, "bf16_full_eval and fp16_full_eval cast the whole model"),
        ({"torch_compile": True}, "torch_compile is not supported"),
    ],
)
def test_refuses_what_the_engine_cannot_run(tmp_path, change, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        ProTrainTrainer(model=model, args=arguments(tmp_path, 1.0, **change), train_dataset=[])
    assert not hasattr(model, "_protrain_engine")  # refused before anything was wrapped


def test_bf16_next_to_an_fp32_compute_dtype_is_refused(tmp_path):
    config = ProTrainConfig(n_persist=1, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16=True and ProTrainConfig.compute_dtype"):
        ProTrainTrainer(model=tiny_model(), args=arguments(tmp_path, 1.0, bf16=True),
                        train_dataset=[], protrain_config=config)  # fmt: skip


def test_bf16_false_computes_in_fp32_as_the_plain_trainer_does(tmp_path):
    """bf16=False (the Trainer's default) is fp32 compute on any device, as the plain
    Trainer's; an explicit ProTrainConfig.compute_dtype is kept."""
    args = arguments(tmp_path, 1.0, bf16=False)
    assert take_over(args, ProTrainConfig(), "t").compute_dtype == torch.float32
    chosen = ProTrainConfig(compute_dtype=torch.bfloat16)
    assert take_over(args, chosen, "t").compute_dtype == torch.bfloat16
    assert take_over(arguments(tmp_path, 1.0, bf16=True), ProTrainConfig(), "t").compute_dtype == (
        torch.bfloat16
    )


def test_gradient_checkpointing_is_the_engines_recompute_with_the_same_losses(tmp_path):
    """gradient_checkpointing=True saves activation memory the engine's way (every block
    recomputed, the Trainer's own checkpointing off) with the Trainer's losses."""
    losses, _, _, _ = run_plain(tmp_path / "plain", lora=False, max_grad_norm=0.0)
    trainer = engine_trainer(tmp_path / "engine", False, 0.0, gradient_checkpointing=True)
    n_blocks = tiny_model().config.num_hidden_layers
    assert trainer.protrain_config.n_checkpoint == n_blocks
    assert trainer.layout is not None and not trainer.args.gradient_checkpointing
    assert not getattr(trainer.model.model.layers[0], "gradient_checkpointing", False)
    trainer.train()
    torch.testing.assert_close(trainer.losses, losses, rtol=0, atol=1e-6)
    trainer.close()


def test_bf16_and_an_8bit_optim_are_the_engines(tmp_path):
    args = arguments(tmp_path, 0.0, bf16=True, optim="paged_adamw_8bit")
    trainer = engine_trainer(tmp_path, False, 0.0, bf16=True, optim="paged_adamw_8bit")
    assert args.bf16 and not trainer.args.bf16  # the Trainer's autocast stays off
    assert trainer.protrain_config.compute_dtype == torch.bfloat16
    assert trainer.engine_optimizer.optimizer_name == "adamw_8bit"
    trainer.train()
    assert len(trainer.losses) == 2 * STEPS and all(map(math.isfinite, trainer.losses))
    trainer.close()


@pytest.mark.parametrize("budget", [None, "100MiB"], ids=["knobs", "gpu-budget"])
def test_example_runs(tmp_path, budget):
    extra = ["--gpu-budget", budget] if budget else []
    out = subprocess.run(
        [sys.executable, str(REPO / "examples/hf_trainer.py"), "--max-steps", "2",
         "--output-dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "final" / "model.safetensors").is_file()
    logged = out.stdout + out.stderr
    # with a budget the plan is made for the heaviest micro-batch and printed once
    assert logged.count("protrain memory plan for the planning micro-batch") == int(bool(budget))


@pytest.mark.gpu
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["noclip", "clip"])
def test_same_losses_as_trainer_on_gpu(tmp_path, max_grad_norm):
    """On CUDA: the Trainer's own model.to(device) leaves the wrapped model as it is, and the
    engine (fp32 compute here) gives the Trainer's losses."""
    on_gpu = dict(use_cpu=False)
    model = tiny_model()
    plain = PlainTrainer(
        model=model,
        args=arguments(tmp_path / "p", max_grad_norm, **on_gpu),
        train_dataset=dataset(),
    )
    plain.losses = []
    plain.train()
    trainer = EngineTrainer(
        model=tiny_model(),
        args=arguments(tmp_path / "e", max_grad_norm, **on_gpu),
        train_dataset=dataset(),
        protrain_config=ProTrainConfig(
            n_persist=1, chunk_size_bytes=1 << 19, compute_dtype=torch.float32
        ),
    )
    trainer.losses = []
    assert trainer.model.model.layers[3].mlp.down_proj.weight.device.type == "cuda"
    trainer.train()
    torch.testing.assert_close(trainer.losses, plain.losses, rtol=0, atol=1e-5)
    trainer.close()


def test_the_replaced_private_method_is_checked(tmp_path, monkeypatch):
    """Trainer._load_from_checkpoint is replaced (see trainer.py): a transformers whose
    method has other arguments is refused before anything is wrapped."""
    import transformers

    from protrain.integrations.transformers import trainer as module

    assert transformers.__version__ == module.TESTED_TRANSFORMERS  # the pinned version
    monkeypatch.setattr(Trainer, "_load_from_checkpoint", lambda self, path: None)
    model = tiny_model()
    with pytest.raises(RuntimeError, match="_load_from_checkpoint"):
        ProTrainTrainer(model=model, args=arguments(tmp_path, 1.0), train_dataset=[])
    assert not hasattr(model, "_protrain_engine")
