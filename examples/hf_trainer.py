"""The Hugging Face Trainer training with ProTrain's engine, on the embedded tiny model.

The quickstart's random-init Llama-architecture model (nothing is downloaded) learns the
quickstart chat data through ``transformers.Trainer``; ``ProTrainTrainer`` hands it the
engine's model and optimizer, with most chunks offloaded. Runs on the CPU in seconds::

    python examples/hf_trainer.py --max-steps 20
    python examples/hf_trainer.py --max-steps 20 --lora
    python examples/hf_trainer.py --max-steps 20 --gpu-budget 100MiB   # the plan decides

The trained model (or adapter) is written to ``<output-dir>/final``, a normal HF / PEFT
directory.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

import protrain
from protrain.integrations.transformers import ProTrainConfig, ProTrainTrainer

QUICKSTART_DIR = Path(protrain.__file__).parent / "train" / "quickstart"


def chat_dataset(tokenizer, max_len: int) -> list[dict[str, list[int]]]:
    rows = []
    with open(QUICKSTART_DIR / "data" / "chat.jsonl") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            ids = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
            rows.append({"input_ids": ids[:max_len]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", default="outputs/hf_trainer")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter")
    parser.add_argument("--n-persist", type=int, default=1, help="chunks kept on the device")
    parser.add_argument("--chunk-size", type=int, default=1 << 19, help="chunk size in bytes")
    parser.add_argument(
        "--gpu-budget",
        help="plan the knobs from the heaviest micro-batch of the dataset for this budget (e.g. 24GiB; on "
        "the CPU the plan counts the engine's tensor bytes), instead of --n-persist",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_DIR / "tokenizer")
    model = LlamaForCausalLM(LlamaConfig(**json.loads((QUICKSTART_DIR / "model.json").read_text())))
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        )

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=min(5, args.max_steps // 10),
        weight_decay=0.01,
        max_grad_norm=1.0,  # applied by the engine (the Trainer's own clip is turned off)
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    if args.gpu_budget:
        logging.basicConfig(format="%(message)s")
        logging.getLogger("protrain.integrations").setLevel(logging.INFO)  # the plan, once
        engine_config = ProTrainConfig(gpu_budget=args.gpu_budget, plan_sequence_len=128)
    else:
        engine_config = ProTrainConfig(n_persist=args.n_persist, chunk_size_bytes=args.chunk_size)
    trainer = ProTrainTrainer(
        model=model,
        args=training_args,
        train_dataset=chat_dataset(tokenizer, max_len=128),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        protrain_config=engine_config,
    )
    result = trainer.train()  # with --gpu-budget: the plan is made and logged first
    print(trainer.layout)
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    trainer.close()
    print(f"train_loss {result.training_loss:.4f}; saved to {final}")


if __name__ == "__main__":
    main()
