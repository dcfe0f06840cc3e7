"""Write protrain's embedded tiny model (random init, from the quickstart's model.json) and
its tokenizer as a Hugging Face directory, the ``base_model`` of ``protrain.yaml``::

    python examples/axolotl/make_tiny_model.py outputs/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import protrain

QUICKSTART_DIR = Path(protrain.__file__).parent / "train" / "quickstart"


def make_tiny_model(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    torch.manual_seed(seed)
    config = LlamaConfig(**json.loads((QUICKSTART_DIR / "model.json").read_text()))
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(QUICKSTART_DIR / "tokenizer").save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="outputs/tiny-llama")
    print(f"tiny model written to {make_tiny_model(parser.parse_args(argv).out)}")


if __name__ == "__main__":
    main()
