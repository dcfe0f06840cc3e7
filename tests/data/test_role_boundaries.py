"""Role boundaries on token ids: built-in tables per family, matching rules, family detection."""

from __future__ import annotations

import pytest

from protrain.train.data import DataSettings, RoleBoundary, render_inspection
from protrain.train.data.masks import IGNORE_INDEX, MaskSettings
from protrain.train.data.role_boundaries import (
    detect_family,
    family_boundaries,
    find_turns,
    labels_by_boundaries,
    resolve_boundaries,
)

from .helpers import byte_tokenizer, expected_labels

ASSISTANT_ONLY = MaskSettings(False, ("assistant",), "turn")

# Renderings of families without a built-in template here, with what is trained.
RENDERED = {
    "gemma4": (
        ["<|turn>", "<turn|>"],
        [
            ("<bos><|turn>system\nS<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n", False),
            ("Hello!<turn|>", True),
            ("\n<|turn>user\nBye<turn|>\n<|turn>model\n", False),
            ("<|channel>thought\nhmm<channel|>Ciao<turn|>", True),
            ("\n", False),
        ],
    ),
    "gemma3n": (
        ["<start_of_turn>", "<end_of_turn>"],
        [
            ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", False),
            ("Hello!<end_of_turn>", True),
            ("\n", False),
        ],
    ),
    "llama3_2_vision": (
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|image|>"],
        [
            ("<bos><|start_header_id|>user<|end_header_id|>\n\n<|image|>Hi<|eot_id|>", False),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", False),
            ("Hello!<|eot_id|>", True),
        ],
    ),
    "qwen3_5": (
        ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
        [
            (
                "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Hi<|im_end|>\n",
                False,
            ),
            ("<|im_start|>assistant\n", False),
            ("<think>\nR\n</think>\n\nHello!<|im_end|>", True),
            ("\n", False),
        ],
    ),
    "pixtral": (
        ["[INST]", "[/INST]", "[IMG]", "[IMG_END]"],
        [
            ("<bos>[INST][IMG][IMG][IMG_END]Hi[/INST]", False),
            ("Hello!<eos>", True),
            ("[INST]Bye[/INST]", False),
            ("Ciao<eos>", True),
        ],
    ),
}


@pytest.mark.parametrize("family", sorted(RENDERED))
def test_builtin_boundaries_exact_spans(family):
    specials, pieces = RENDERED[family]
    tok = byte_tokenizer(specials, bos="<bos>", eos="<eos>")
    _, ids, labels = expected_labels(tok, pieces)
    boundaries = family_boundaries(family, tok)
    got = labels_by_boundaries(ids, boundaries, ASSISTANT_ONLY, never_trained=set())
    assert got == labels


def test_longest_start_marker_wins():
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>")
    specs = [
        RoleBoundary(role="user", start="<|im_start|>", end="<|im_end|>"),
        RoleBoundary(role="assistant", start="<|im_start|>assistant\n", end="<|im_end|>"),
    ]
    boundaries = resolve_boundaries(specs, tok, "test")
    pieces = [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        ("Yo<|im_end|>", True),
        ("\n", False),
    ]
    _, ids, labels = expected_labels(tok, pieces)
    assert [t.role for _, t in find_turns(ids, boundaries)] == ["user", "assistant"]
    assert labels_by_boundaries(ids, boundaries, ASSISTANT_ONLY, set()) == labels


def test_eos_modes_on_boundaries():
    tok = byte_tokenizer(["[INST]", "[/INST]"], bos="<s>", eos="</s>")
    boundaries = family_boundaries("pixtral", tok)
    pieces = [
        ("<s>[INST]a[/INST]", False),
        ("b", True),
        ("</s>", "eos"),
        ("[INST]c[/INST]", False),
        ("d", True),
        ("</s>", "eos"),
    ]
    ids = tok("".join(p for p, _ in pieces), add_special_tokens=False)["input_ids"]

    def expect(eos_trained: list[bool]) -> list[int]:
        flags = iter(eos_trained)
        return expected_labels(tok, [(p, next(flags) if t == "eos" else t) for p, t in pieces])[2]

    for mode, flags in (
        ("turn", [True, True]),
        ("last", [False, True]),
        ("none", [False, False]),
        ("all", [True, True]),
    ):
        got = labels_by_boundaries(
            ids, boundaries, MaskSettings(False, ("assistant",), mode), set()
        )
        assert got == expect(flags), mode
    # user turns trained too: the [/INST] that closes them still opens the answer, untrained
    got = labels_by_boundaries(
        ids, boundaries, MaskSettings(False, ("user", "assistant"), "turn"), set()
    )
    assert (
        got
        == expected_labels(
            tok,
            [
                ("<s>[INST]", False),
                ("a", True),
                ("[/INST]", False),
                ("b</s>", True),
                ("[INST]", False),
                ("c", True),
                ("[/INST]", False),
                ("d</s>", True),
            ],
        )[2]
    )


def test_media_tokens_never_trained():
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>", "<|image_pad|>"], eos="<|im_end|>")
    boundaries = family_boundaries("qwen2_vl", tok)
    ids = tok("<|im_start|>assistant\nx<|image_pad|>y<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    got = labels_by_boundaries(ids, boundaries, MaskSettings(True, ("assistant",), "turn"), {pad})
    assert got == [IGNORE_INDEX if t == pad else t for t in ids]


@pytest.mark.parametrize(
    "name,family",
    [
        ("Qwen2VLProcessor", "qwen2_vl"),
        ("Qwen2_5_VLProcessor", "qwen2_5_vl"),
        ("Qwen3VLProcessor", "qwen3_vl"),
        ("Qwen3_5Processor", "qwen3_5"),
        ("Gemma3Processor", "gemma3"),
        ("Gemma3nProcessor", "gemma3n"),
        ("Gemma4Processor", "gemma4"),
        ("MllamaProcessor", "llama3_2_vision"),
        ("Llama4Processor", "llama4"),
        ("PixtralProcessor", "pixtral"),
        ("SomethingElse", None),
    ],
)
def test_family_by_processor_class(name, family):
    assert detect_family(type(name, (), {})(), None) == family


def test_quickstart_inspection_shows_trained_spans():
    from pathlib import Path

    import protrain.train

    root = Path(protrain.train.__path__[0]) / "quickstart"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    settings = DataSettings(datasets=[{"path": str(root / "data" / "chat.jsonl")}])
    text = render_inspection(settings, tok, sequence_len=256, n_samples=2)
    assert "[[" in text and "]]" in text
    assert "<|im_start|>assistant\n[[" in text
    assert "roles ['assistant']" in text
