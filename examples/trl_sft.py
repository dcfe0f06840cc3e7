"""TRL's SFTTrainer at ``SFTConfig()``'s defaults, with ProTrain's engine and its memory plan.

The quickstart's random-init Llama-architecture model and its tokenizer (nothing is
downloaded) learn the quickstart chat data (``messages`` rows, the tokenizer's chat
template), through ``ProTrainSFTTrainer`` with a LoRA adapter. ``SFTConfig`` keeps its
defaults: only the output folder, the number of steps, and ``use_cpu`` on a machine without
a GPU (transformers refuses the default ``bf16=True`` on the CPU unless ``use_cpu`` is set).
The engine takes over ``bf16=True`` (its compute dtype) and ``gradient_checkpointing=True``
(the plan places activations). The plan is made for ``--gpu-budget`` from the heaviest
micro-batch of the data: the default 8 MiB is small enough that most chunks move between
the device and the host (on a CPU-only machine the plan counts the engine's tensor bytes;
on a GPU give a real budget, such as 24GiB). Needs ``pip install -e ".[hf]"`` from this
repository (``make install``); runs offline, on the CPU in seconds::

    python examples/trl_sft.py --max-steps 20

The adapter is written to ``<output-dir>/final``, a normal PEFT directory.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import SFTConfig

import protrain
from protrain.integrations.transformers import ProTrainConfig
from protrain.integrations.transformers.sft import ProTrainSFTTrainer

QUICKSTART_DIR = Path(protrain.__file__).parent / "train" / "quickstart"


def build_trainer(output_dir: str, max_steps: int, gpu_budget: str) -> ProTrainSFTTrainer:
    """``ProTrainSFTTrainer`` on the tiny model and the chat data, ``SFTConfig()`` at its
    defaults, planned for ``gpu_budget``."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_DIR / "tokenizer")
    model = LlamaForCausalLM(LlamaConfig(**json.loads((QUICKSTART_DIR / "model.json").read_text())))
    with open(QUICKSTART_DIR / "data" / "chat.jsonl") as f:
        dataset = Dataset.from_list([json.loads(line) for line in f])
    config = SFTConfig(
        output_dir=output_dir, max_steps=max_steps, use_cpu=not torch.cuda.is_available()
    )
    return ProTrainSFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        protrain_config=ProTrainConfig(gpu_budget=gpu_budget),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", default="outputs/trl_sft")
    parser.add_argument("--gpu-budget", default="8MiB", help="the plan's device memory")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("protrain").setLevel(logging.INFO)  # the plan, what was taken over

    trainer = build_trainer(args.output_dir, args.max_steps, args.gpu_budget)
    result = trainer.train()  # the plan is made (and logged) when training starts
    chunks = trainer.layout.chunks
    moved = sum(not chunk.persistent for chunk in chunks)
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    trainer.close()
    print(f"{moved} of {len(chunks)} chunks move between the device and the host")
    print(f"train_loss {result.training_loss:.4f}; saved to {final}")


if __name__ == "__main__":
    main()
