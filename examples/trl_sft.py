"""TRL's SFTTrainer training a LoRA adapter with ProTrain's engine, on the embedded tiny model.

The quickstart's random-init Llama-architecture model (nothing is downloaded) learns the
quickstart chat data (``messages`` rows, the tokenizer's chat template) through
``trl.SFTTrainer``; ``ProTrainSFTTrainer`` hands it the engine's model and optimizer, with
most chunks offloaded. Needs ``pip install protrain[hf]``. Runs on the CPU in seconds::

    python examples/trl_sft.py --max-steps 20

The adapter is written to ``<output-dir>/final``, a normal PEFT directory.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", default="outputs/trl_sft")
    parser.add_argument("--n-persist", type=int, default=1, help="chunks kept on the device")
    parser.add_argument("--chunk-size", type=int, default=1 << 19, help="chunk size in bytes")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_DIR / "tokenizer")
    model = LlamaForCausalLM(LlamaConfig(**json.loads((QUICKSTART_DIR / "model.json").read_text())))
    with open(QUICKSTART_DIR / "data" / "chat.jsonl") as f:
        dataset = Dataset.from_list([json.loads(line) for line in f])

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,  # applied by the engine (the Trainer's own clip is turned off)
        max_length=128,
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        # the engine's own: compute dtype (ProTrainConfig.compute_dtype) and activation
        # checkpointing (ProTrainConfig.n_checkpoint)
        bf16=False,
        gradient_checkpointing=False,
    )
    trainer = ProTrainSFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        protrain_config=ProTrainConfig(n_persist=args.n_persist, chunk_size_bytes=args.chunk_size),
    )
    print(trainer.layout)
    result = trainer.train()
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    trainer.close()
    print(f"train_loss {result.training_loss:.4f}; saved to {final}")


if __name__ == "__main__":
    main()
