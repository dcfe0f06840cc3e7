"""Regenerate the quickstart assets shipped inside the package.

The quickstart must train with nothing downloaded, so the project makes its own small chat
dataset and a byte-level BPE tokenizer (with a ChatML chat template) trained on it. The
outputs are committed under src/protrain/train/quickstart/; run this script only to change
them: `python scripts/make_quickstart.py`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "src" / "protrain" / "train" / "quickstart"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "India": "New Delhi",
    "Chile": "Santiago",
    "Poland": "Warsaw",
    "Vietnam": "Hanoi",
    "Ireland": "Dublin",
}
COLORS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "an orange": "orange",
    "a plum": "purple",
}
NAMES = [
    "Ada",
    "Alan",
    "Grace",
    "Linus",
    "Barbara",
    "Ken",
    "Margaret",
    "Dennis",
    "Frances",
    "John",
    "Radia",
    "Edsger",
]
SYSTEM = "You are a helpful assistant. Answer briefly."


def make_rows(n_rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(20), rng.randrange(20)
            q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif kind == 1:
            country = rng.choice(sorted(CAPITALS))
            q, ans = (
                f"What is the capital of {country}?",
                f"The capital of {country} is {CAPITALS[country]}.",
            )
        elif kind == 2:
            thing = rng.choice(sorted(COLORS))
            q, ans = f"What color is {thing}?", f"The color of {thing} is {COLORS[thing]}."
        else:
            name = rng.choice(NAMES)
            q, ans = f"Say hello to {name}.", f"Hello, {name}! Nice to meet you."
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        rows.append({"messages": messages})
    return rows


def make_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def main() -> None:
    rows = make_rows(800, seed=0)
    data_dir = OUT / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    texts = [m["content"] for row in rows for m in row["messages"]]
    texts += ["system", "user", "assistant"]
    tokenizer = make_tokenizer(texts)
    tokenizer.save_pretrained(OUT / "tokenizer")
    # Name the class that transformers 4.x and 5.x both know, not the 5.x-only backend name.
    config_path = OUT / "tokenizer" / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    print(f"wrote {len(rows)} rows and a tokenizer of {len(tokenizer)} tokens under {OUT}")


if __name__ == "__main__":
    main()
