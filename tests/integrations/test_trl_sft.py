"""ProTrain's engine under TRL's SFTTrainer (protrain.integrations.transformers.sft): the same
per-step losses as SFTTrainer alone in fp32 (full fine-tuning with clipping, LoRA through
SFTTrainer's peft_config without), with offloaded chunks; the example trains."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch

from .test_hf_trainer import ENGINE, REPO, Recording, tiny_model

trl = pytest.importorskip("trl")

QUICKSTART = REPO / "src/protrain/train/quickstart"


def sft_args(tmp, max_grad_norm: float):
    return trl.SFTConfig(
        output_dir=str(tmp),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=2e-3,
        weight_decay=0.1,
        max_grad_norm=max_grad_norm,
        optim="adamw_torch_fused",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        max_length=64,
        # the engine's own: compute dtype and activation checkpointing
        bf16=False,
        gradient_checkpointing=False,
    )


def chat_rows(n: int = 16):
    from datasets import Dataset

    lines = (QUICKSTART / "data/chat.jsonl").read_text().splitlines()[:n]
    return Dataset.from_list([json.loads(line) for line in lines])


@pytest.mark.parametrize(
    ("lora", "max_grad_norm"), [(False, 0.05), (True, 0.0)], ids=["full-clip", "lora-noclip"]
)
def test_same_losses_as_sft_trainer(tmp_path, lora, max_grad_norm):
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    class PlainSFT(Recording, trl.SFTTrainer):
        pass

    class EngineSFT(Recording, ProTrainSFTTrainer):
        pass

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer")
    runs = []
    for cls, extra in ((PlainSFT, {}), (EngineSFT, {"protrain_config": ENGINE})):
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        trainer = cls(
            model=tiny_model(),
            args=sft_args(tmp_path / cls.__name__, max_grad_norm),
            train_dataset=chat_rows(),
            processing_class=tokenizer,
            peft_config=peft_config if lora else None,
            **extra,
        )
        trainer.losses = []
        trainer.train()
        runs.append(trainer)
    plain, engine = runs
    assert sum(not c.persistent for c in engine.layout.chunks) >= 2
    assert len(engine.losses) == len(plain.losses) == 8
    torch.testing.assert_close(engine.losses, plain.losses, rtol=0, atol=1e-6)
    engine.close()


def test_moe_router_loss_is_weighted_as_sft_trainer_does(tmp_path):
    """A Mixture-of-Experts model's router loss: SFTTrainer adds router_aux_loss_coef x
    aux_loss divided by the accumulation steps, the model's own loss adds it undivided; the
    engine's trainer gives SFTTrainer's losses (accumulation 2)."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from protrain.integrations.transformers import ProTrainConfig
    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    def moe():
        torch.manual_seed(0)
        config = MixtralConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        return MixtralForCausalLM(config)

    class PlainSFT(Recording, trl.SFTTrainer):
        pass

    class EngineSFT(Recording, ProTrainSFTTrainer):
        pass

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer")
    assert len(tokenizer) <= 512
    runs = []
    for cls, extra in (
        (PlainSFT, {}),
        (EngineSFT, {"protrain_config": ProTrainConfig(n_persist=1, chunk_size_bytes=1 << 18)}),
    ):
        trainer = cls(model=moe(), args=sft_args(tmp_path / cls.__name__, 0.0),
                      train_dataset=chat_rows(), processing_class=tokenizer, **extra)  # fmt: skip
        assert trainer.aux_loss_enabled
        trainer.losses = []
        trainer.train()
        runs.append(trainer)
    plain, engine = runs
    assert sum(not c.persistent for c in engine.layout.chunks) >= 2
    torch.testing.assert_close(engine.losses, plain.losses, rtol=0, atol=2e-6)
    engine.close()


def test_a_loss_that_reads_the_fused_head_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    args = sft_args(tmp_path, 0.0)
    args.loss_type = "dft"
    model = tiny_model()
    with pytest.raises(ValueError, match="loss_type='dft' is not supported"):
        ProTrainSFTTrainer(
            model=model, args=args, train_dataset=chat_rows(),
            processing_class=AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer"),
            protrain_config=ENGINE,
        )  # fmt: skip
    assert not hasattr(model, "_protrain_engine")


def test_the_documented_example_runs_and_offloads(tmp_path):
    """docs/integrations.md's command, as written there (fewer steps, another folder):
    SFTConfig() at its defaults, planned for a budget under which chunks move."""
    doc = (REPO / "docs/integrations.md").read_text()
    [command] = [line for line in doc.splitlines() if "examples/trl_sft.py --" in line]
    python, *argv = shlex.split(command)
    assert python == ".venv/bin/python"
    out = subprocess.run(
        [sys.executable, *argv, "--max-steps", "2", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    assert "protrain memory plan" in out.stderr  # logged, as the docs say
    moved, total = map(int, re.search(r"(\d+) of (\d+) chunks move", out.stdout).groups())
    assert 1 <= moved <= total


def test_sft_config_defaults_train(tmp_path):
    """SFTConfig() at its defaults (bf16=True, gradient_checkpointing=True): the engine
    takes both over (its compute dtype, every block recomputed) and trains."""
    from transformers import AutoTokenizer

    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to="none")
    assert args.bf16 and args.gradient_checkpointing  # TRL's defaults
    trainer = ProTrainSFTTrainer(
        model=tiny_model(), args=args, train_dataset=chat_rows(),
        processing_class=AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer"),
        protrain_config=ENGINE,
    )  # fmt: skip
    assert trainer.protrain_config.compute_dtype == torch.bfloat16
    assert trainer.protrain_config.n_checkpoint == tiny_model().config.num_hidden_layers
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    trainer.close()


def test_arguments_are_refused_before_tokenization(tmp_path, monkeypatch):
    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    def tokenized(*args, **kwargs):
        raise AssertionError("SFTTrainer tokenized before the arguments were checked")

    monkeypatch.setattr(trl.SFTTrainer, "_prepare_dataset", tokenized)
    args = sft_args(tmp_path, 0.0)
    args.optim = "sgd"
    with pytest.raises(ValueError, match="ProTrainSFTTrainer: optim='sgd' is not supported"):
        ProTrainSFTTrainer(model=tiny_model(), args=args, train_dataset=chat_rows(),
                           protrain_config=ENGINE)  # fmt: skip
