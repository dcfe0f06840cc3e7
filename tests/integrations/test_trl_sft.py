"""ProTrain's engine under TRL's SFTTrainer (protrain.integrations.transformers.sft): the same
per-step losses as SFTTrainer alone in fp32 (full fine-tuning with clipping, LoRA through
SFTTrainer's peft_config without), with offloaded chunks; the example trains."""

from __future__ import annotations

import json
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


def test_example_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "examples/trl_sft.py"), "--max-steps", "2",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
