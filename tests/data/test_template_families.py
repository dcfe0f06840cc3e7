"""Chat templates of the model families, rendered with tokenizers that have their exact special
tokens; trained spans asserted position by position.

The byte-level test tokenizer has no merges, so a sample's expected ids and labels are the
concatenation of its pieces, each marked trained or not.
"""

from __future__ import annotations

import pytest

from protrain.train.data import DataError, DataSettings, build_train_dataset
from protrain.train.data.masks import MaskSettings
from protrain.train.data.role_boundaries import family_boundaries, labels_by_boundaries
from protrain.train.data.templates import BUILTIN_TEMPLATES

from .helpers import byte_tokenizer, expected_labels, write_jsonl

CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TOKENIZERS = {
    "chatml": dict(special_tokens=CHATML, eos="<|im_end|>", pad="<|endoftext|>"),
    "qwen": dict(special_tokens=CHATML, eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": dict(
        special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "llama4": dict(
        special_tokens=["<|header_start|>", "<|header_end|>", "<|eot|>"],
        bos="<|begin_of_text|>",
        eos="<|eot|>",
    ),
    "gemma": dict(
        special_tokens=["<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>", pad="<pad>"
    ),
    "mistral_v7": dict(
        special_tokens=["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
        bos="<s>",
        eos="</s>",
    ),
}

SYS, U1, A1, U2, A2 = "Be brief.", "Hi", "Hello!", "Bye", "See you."
CONVO = [
    {"role": "system", "content": SYS},
    {"role": "user", "content": U1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": U2},
    {"role": "assistant", "content": A2},
]

# (template, tokenizer, messages, pieces): what the template renders, and what is trained
# with the defaults (roles_to_train=[assistant], train_on_eos=turn).
FAMILIES = {
    "llama3": (
        "llama3",
        "llama3",
        CONVO,
        [
            (
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
                False,
            ),
            ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", False),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", False),
            ("Hello!<|eot_id|>", True),
            ("<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>", False),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", False),
            ("See you.<|eot_id|>", True),
        ],
    ),
    "llama4": (
        "llama4",
        "llama4",
        CONVO[1:3],
        [
            ("<|begin_of_text|><|header_start|>user<|header_end|>\n\nHi<|eot|>", False),
            ("<|header_start|>assistant<|header_end|>\n\n", False),
            ("Hello!<|eot|>", True),
        ],
    ),
    # Gemma folds the system prompt into the first user turn.
    "gemma": (
        "gemma",
        "gemma",
        CONVO,
        [
            (
                "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n",
                False,
            ),
            ("Hello!<end_of_turn>", True),
            ("\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n", False),
            ("See you.<end_of_turn>", True),
            ("\n", False),
        ],
    ),
    # Qwen2.5 inserts its default system prompt when the conversation has none.
    "qwen2_5": (
        "qwen2_5",
        "qwen",
        CONVO[1:3],
        [
            (
                "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("Hello!<|im_end|>", True),
            ("\n", False),
        ],
    ),
    # Qwen3 keeps the reasoning of the turn after the last user query only; it is trained.
    "qwen3": (
        "qwen3",
        "qwen",
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
        ],
        [
            ("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n", False),
            ("A1<|im_end|>", True),
            ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", False),
            ("<think>\nR2\n</think>\n\nA2<|im_end|>", True),
            ("\n", False),
        ],
    ),
    # Inline <think> in the content: dropped from history, kept (and trained) in the last turn.
    "qwen3_inline_think": (
        "qwen3",
        "qwen",
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>R1</think>A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
        ],
        [
            ("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n", False),
            ("A1<|im_end|>", True),
            ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", False),
            ("<think>\nR2\n</think>\n\nA2<|im_end|>", True),
            ("\n", False),
        ],
    ),
    # The final turn without reasoning still gets an empty think block from the template.
    "qwen3_no_reasoning": (
        "qwen3",
        "qwen",
        CONVO[:3],
        [
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("<think>\n\n</think>\n\nHello!<|im_end|>", True),
            ("\n", False),
        ],
    ),
    # Mistral V7 Tekken: [/INST] closes the user turn and opens the answer; never trained.
    "mistral_v7_tekken": (
        "mistral_v7_tekken",
        "mistral_v7",
        CONVO,
        [
            ("<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]", False),
            ("Hello!</s>", True),
            ("[INST]Bye[/INST]", False),
            ("See you.</s>", True),
        ],
    ),
    "chatml": (
        "chatml",
        "chatml",
        CONVO[1:],
        [
            ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
            ("Hello!<|im_end|>", True),
            ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", False),
            ("See you.<|im_end|>", True),
            ("\n", False),
        ],
    ),
}


def _tokenizer(kind: str):
    return byte_tokenizer(**TOKENIZERS[kind])


def _encode(tmp_path, tok, messages, template, **settings):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    s = DataSettings(datasets=[{"path": str(path)}], chat_template=template, **settings)
    return build_train_dataset(s, tok, sequence_len=1024, seed=0)[0]


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_family_trained_spans(tmp_path, case):
    template, kind, messages, pieces = FAMILIES[case]
    tok = _tokenizer(kind)
    item = _encode(tmp_path, tok, messages, template)
    text, ids, labels = expected_labels(tok, pieces)
    assert (
        tok.apply_chat_template(messages, chat_template=BUILTIN_TEMPLATES[template], tokenize=False)
        == text
    )
    assert item["input_ids"] == ids
    assert item["labels"] == labels


# Role boundaries on token ids must agree with the text-based masks on each family.
BOUNDARY_FAMILIES = {
    "llama3": "llama3_2_vision",
    "llama4": "llama4",
    "gemma": "gemma3",
    "qwen2_5": "qwen2_5_vl",
    "qwen3": "qwen3_vl",
    "qwen3_inline_think": "qwen3_5",
    "mistral_v7_tekken": "mistral_v7_tekken",
    "chatml": "qwen2_vl",
}


@pytest.mark.parametrize("case", sorted(BOUNDARY_FAMILIES))
@pytest.mark.parametrize("eos_mode", ["turn", "last", "none"])
def test_role_boundaries_agree_with_text_masks(tmp_path, case, eos_mode):
    template, kind, messages, _ = FAMILIES[case]
    tok = _tokenizer(kind)
    item = _encode(tmp_path, tok, messages, template, train_on_eos=eos_mode)
    boundaries = family_boundaries(BOUNDARY_FAMILIES[case], tok)
    mask = MaskSettings(False, ("assistant",), eos_mode)
    assert labels_by_boundaries(item["input_ids"], boundaries, mask, set()) == item["labels"]


def test_gemma_system_prompt_trained_inside_the_user_turn(tmp_path):
    tok = _tokenizer("gemma")
    item = _encode(tmp_path, tok, CONVO, "gemma", roles_to_train=["system"])
    pieces = [
        ("<bos><start_of_turn>user\n", False),
        ("Be brief.", True),
        ("\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n", False),
        (
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\nSee you.<end_of_turn>\n",
            False,
        ),
    ]
    assert item["labels"] == expected_labels(tok, pieces)[2]


def test_a_folded_system_prompt_equal_to_the_role_word_is_placed_on_itself(tmp_path):
    # Gemma writes the system prompt after the user header: "user" there is the body
    tok = _tokenizer("gemma")
    messages = [{"role": "system", "content": "user"}, *CONVO[1:3]]
    item = _encode(tmp_path, tok, messages, "gemma", roles_to_train=["system"])
    pieces = [
        ("<bos><start_of_turn>user\n", False),
        ("user", True),
        ("\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n", False),
    ]
    assert item["labels"] == expected_labels(tok, pieces)[2]


def test_qwen2_5_default_system_prompt_never_trained(tmp_path):
    tok = _tokenizer("qwen")
    item = _encode(
        tmp_path, tok, CONVO[1:3], "qwen2_5", roles_to_train=["system", "user", "assistant"]
    )
    pieces = [
        (
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n",
            False,
        ),
        ("<|im_start|>user\n", False),
        ("Hi<|im_end|>", True),
        ("\n<|im_start|>assistant\n", False),
        ("Hello!<|im_end|>", True),
        ("\n", False),
    ]
    assert item["labels"] == expected_labels(tok, pieces)[2]


def test_mistral_last_user_system_prompt(tmp_path):
    """Mistral v3 moves the system prompt into the last user turn: not a prefix-stable template."""
    tok = _tokenizer("mistral_v7")
    item = _encode(tmp_path, tok, CONVO, "mistral_tekken", train_on_eos="all")
    pieces = [
        ("<s>[INST]Hi[/INST]", False),
        ("Hello!</s>", True),
        ("[INST]Be brief.\n\nBye[/INST]", False),
        ("See you.</s>", True),
    ]
    assert item["labels"] == expected_labels(tok, pieces)[2]


def test_template_from_file_and_jinja_string(tmp_path):
    tok = _tokenizer("chatml")
    template_file = tmp_path / "t.jinja"
    template_file.write_text(BUILTIN_TEMPLATES["chatml"])
    by_name = _encode(tmp_path, tok, CONVO[1:3], "chatml")
    assert _encode(tmp_path, tok, CONVO[1:3], str(template_file)) == by_name
    assert _encode(tmp_path, tok, CONVO[1:3], BUILTIN_TEMPLATES["chatml"]) == by_name


def test_template_refusing_a_conversation_is_a_data_error(tmp_path):
    tok = _tokenizer("gemma")
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(DataError, match=r"row 0, field 'messages': cannot render.*alternate"):
        _encode(tmp_path, tok, messages, "gemma")
