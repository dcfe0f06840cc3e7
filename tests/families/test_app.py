"""Every family of the matrix (Qwen2-VL aside) trains 3 steps through ``protrain train`` from a saved
local checkpoint, saves, and the export reloads with the matching ``Auto...`` class (LoRA:
the adapter onto the saved base). Full fine-tuning and LoRA alternate down the table.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from tests.train.cli_server import CliServer
from tests.train.helpers import tiny_config, write_config

from protrain.train.config import QUICKSTART_DIR

from .configs import FAMILIES, build

TOKENIZER_VOCAB = 512  # the quickstart tokenizer's
TEXT = [name for name, f in FAMILIES.items() if f.kind != "vlm"]
# Qwen2-VL is left out: its processor needs torchvision (its video processor)
VLM = ["gemma3", "llava", "paligemma"]


def _steps_logged(run_dir) -> list[int]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"loss"' in line]


@pytest.fixture(scope="module")
def cli():
    server = CliServer()
    yield server
    server.close()


def _auto_class(name: str):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if FAMILIES[name].kind == "seq2seq" else AutoModelForCausalLM


def _config(tmp_path, name: str, model_dir, lora: bool):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "chat.jsonl"
    rows = (QUICKSTART_DIR / "data" / "chat.jsonl").read_text().splitlines()[:16]
    data.write_text("\n".join(rows) + "\n")
    raw = tiny_config(
        tmp_path,
        model={"name_or_path": str(model_dir)},  # attention: the default
        datasets=[{"path": str(data), "type": "chat"}],
        max_steps=3,
        micro_batch_size=2,
        gradient_accumulation_steps=1,
    )
    if lora:
        targets = FAMILIES[name].lora.get("target_modules", "all-linear")
        raw["adapter"] = {"type": "lora", "r": 4, "target_modules": targets}
    return write_config(tmp_path, raw)


@pytest.mark.parametrize("name", TEXT)
def test_family_trains_through_the_app_and_reloads(name, cli, tmp_path):
    lora = TEXT.index(name) % 2 == 1
    model_dir = tmp_path / "model"
    shutil.copytree(QUICKSTART_DIR / "tokenizer", model_dir)
    saved = build(name, vocab_size=TOKENIZER_VOCAB)
    saved.save_pretrained(model_dir)
    config = _config(tmp_path, name, model_dir, lora)
    log = tmp_path / "log.txt"
    status = cli.wait(cli.start(["train", str(config)], log))
    assert status == 0, log.read_text()[-3000:]
    assert _steps_logged(tmp_path / "run") == [1, 2, 3]
    final = tmp_path / "run" / "final"
    auto = _auto_class(name)
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(auto.from_pretrained(model_dir), final)
        trained = [n for n, _ in model.named_parameters() if "lora_" in n]
        assert trained, f"{name}: no adapter weights loaded"
        base = model.get_base_model()
    else:
        model = base = auto.from_pretrained(final)
    assert type(base) is type(saved), (type(base), type(saved))
    if not lora:  # trained: the weights moved from the saved ones
        before = saved.state_dict()
        moved = [
            k
            for k, v in model.state_dict().items()
            if k in before and not torch.equal(v, before[k])
        ]
        assert moved, f"{name}: no weight changed"


# the model config keys naming the processor's tokens, by family
_VLM_TOKENS = {
    "gemma3": dict(image_token_index="<image_soft_token>", boi_token_index="<start_of_image>",
                   eoi_token_index="<end_of_image>"),
    "llava": dict(image_token_index="<image>"),
    "paligemma": dict(image_token_index="<image>"),
}  # fmt: skip
_VLM_IMAGE = {"gemma3": dict(image_size=28, patch_size=14), "llava": {}, "paligemma": {}}


@pytest.mark.parametrize("name", VLM)
def test_vision_language_family_trains_through_the_app_and_reloads(name, cli, tmp_path):
    """The family's real processor class (byte tokenizer, PIL image processor), one image a
    row: trained 3 steps with LoRA, the adapter reloads onto the base loaded by
    AutoModelForImageTextToText."""
    import json

    from peft import PeftModel
    from tests.data.vision_helpers import write_image
    from transformers import AutoConfig, AutoModelForImageTextToText

    from .processors import PROCESSORS

    processor = PROCESSORS[name]()
    tok = processor.tokenizer
    family = FAMILIES[name]
    text = dict(family.text, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    vision = dict(family.vision, **_VLM_IMAGE[name])
    tokens = {k: tok.convert_tokens_to_ids(v) for k, v in _VLM_TOKENS[name].items()}
    config = AutoConfig.for_model(
        name, text_config=text, vision_config=vision, **{**family.config, **tokens}
    )
    torch.manual_seed(0)
    saved = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # Gemma 3 initializes its image projection to zero: images unseen
        for n, p in saved.named_parameters():
            if "projector" in n and not p.any():
                p.normal_(0.0, 0.02)
    model_dir = tmp_path / "model"
    saved.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)

    side = vision["image_size"]
    write_image(tmp_path / "cat.png", (side, side))
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A red square."},
        ],
        "images": ["cat.png"],
    }
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for _ in range(8)) + "\n")
    raw = tiny_config(
        tmp_path,
        model={"name_or_path": str(model_dir)},
        datasets=[{"path": str(data), "type": "chat"}],
        max_steps=3,
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        adapter={"type": "lora", "r": 4},
    )
    log = tmp_path / "log.txt"
    status = cli.wait(cli.start(["train", str(write_config(tmp_path, raw))], log))
    assert status == 0, log.read_text()[-3000:]
    assert _steps_logged(tmp_path / "run") == [1, 2, 3]
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert type(base) is type(saved)
    model = PeftModel.from_pretrained(base, tmp_path / "run" / "final")
    # trained: LoRA's B starts at zero; in the vision tower it moves only if images got there
    moved = [n for n, p in model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert any("vision_tower" in n for n in moved), f"{name}: the images were not trained on"
    assert any("vision_tower" not in n for n in moved), f"{name}: the text was not trained on"
