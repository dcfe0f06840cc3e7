"""Block discovery on tiny random models of the supported families (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from protrain.model import BlockDiscoveryError, BlockLayout, discover_blocks, known_stacks

TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _layers(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


def assert_partition(model: nn.Module, layout: BlockLayout) -> None:
    """Every parameter is owned by exactly one block or listed once as a non-block one."""
    all_names = [name for name, _ in model.named_parameters()]
    owned = [name for block in layout.blocks for name in block.param_names]
    assert len(owned) == len(set(owned))
    assert len(layout.non_block_param_names) == len(set(layout.non_block_param_names))
    assert sorted(owned + layout.non_block_param_names) == sorted(all_names)
    for block in layout.blocks:
        assert block.module is model.get_submodule(block.name)
        assert all(name.startswith(block.name + ".") for name in block.param_names)
        assert block.param_names, f"{block.name} owns no parameter"


def _build(config_cls, model_cls, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs))


DECODERS = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {}),
}


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_decoder_only(family: str) -> None:
    config_cls, model_cls, extra = DECODERS[family]
    model = _build(config_cls, model_cls, num_hidden_layers=3, **TEXT, **extra)
    layout = discover_blocks(model)
    assert layout.stacks == ["model.layers"]
    assert [b.name for b in layout.blocks] == _layers("model.layers", 3)
    assert [b.index for b in layout.blocks] == [0, 1, 2]
    assert layout.source == "generic"
    tied = model.config.tie_word_embeddings
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (
        set() if tied else {"lm_head.weight"}
    )
    assert set(layout.non_block_param_names) == expected
    assert_partition(model, layout)


def test_gpt2_tied_head_listed_once() -> None:
    model = _build(
        T.GPT2Config,
        T.GPT2LMHeadModel,
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    layout = discover_blocks(model)
    assert [b.name for b in layout.blocks] == _layers("transformer.h", 2)
    assert layout.non_block_param_names == [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]
    assert_partition(model, layout)


def test_t5_encoder_and_decoder_stacks() -> None:
    model = _build(
        T.T5Config,
        T.T5ForConditionalGeneration,
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        num_decoder_layers=3,
        vocab_size=128,
    )
    layout = discover_blocks(model)
    assert layout.stacks == ["encoder.block", "decoder.block"]
    assert [b.name for b in layout.blocks] == _layers("encoder.block", 2) + _layers(
        "decoder.block", 3
    )
    assert [b.stack for b in layout.blocks] == ["encoder.block"] * 2 + ["decoder.block"] * 3
    # The embedding is shared by encoder, decoder and (tied) head: listed once.
    assert layout.non_block_param_names == [
        "shared.weight",
        "encoder.final_layer_norm.weight",
        "decoder.final_layer_norm.weight",
    ]
    assert_partition(model, layout)


def test_qwen2_vl_vision_and_text_stacks() -> None:
    text = dict(
        TEXT,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=3,
        embed_dim=16,
        hidden_size=32,
        num_heads=2,
        mlp_ratio=2,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    model = _build(
        T.Qwen2VLConfig, T.Qwen2VLForConditionalGeneration, text_config=text, vision_config=vision
    )
    layout = discover_blocks(model)
    assert layout.stacks == ["model.visual.blocks", "model.language_model.layers"]
    assert [b.name for b in layout.blocks] == _layers("model.visual.blocks", 3) + _layers(
        "model.language_model.layers", 2
    )
    non_block = set(layout.non_block_param_names)
    assert "model.visual.patch_embed.proj.weight" in non_block
    assert "model.visual.merger.mlp.0.weight" in non_block  # the merger is no block
    assert "model.language_model.embed_tokens.weight" in non_block
    assert "model.language_model.norm.weight" in non_block
    assert_partition(model, layout)


def test_qwen3_vl_deepstack_mergers_are_not_a_stack() -> None:
    # The generic rule would read `deepstack_merger_list` as a stack: the table corrects it.
    text = dict(
        TEXT,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=4, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
        num_position_embeddings=16, deepstack_visual_indexes=[1, 2],
    )  # fmt: skip
    model = _build(
        T.Qwen3VLConfig, T.Qwen3VLForConditionalGeneration, text_config=text, vision_config=vision
    )
    layout = discover_blocks(model)
    assert layout.source == "generic+table:Qwen3VLVisionModel"
    assert layout.stacks == ["model.visual.blocks", "model.language_model.layers"]
    assert [b.name for b in layout.blocks] == _layers("model.visual.blocks", 4) + _layers(
        "model.language_model.layers", 2
    )
    assert "model.visual.deepstack_merger_list.0.linear_fc1.weight" in layout.non_block_param_names
    assert_partition(model, layout)


def test_hybrid_jamba_attention_and_mamba_layers_are_one_stack() -> None:
    model = _build(
        T.JambaConfig,
        T.JambaForCausalLM,
        **{k: v for k, v in TEXT.items() if k != "head_dim"},
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    )
    layout = discover_blocks(model)
    assert layout.stacks == ["model.layers"]
    assert [b.name for b in layout.blocks] == _layers("model.layers", 4)
    kinds = [type(b.module).__name__ for b in layout.blocks]
    assert kinds == [
        "JambaMambaDecoderLayer",
        "JambaAttentionDecoderLayer",
        "JambaMambaDecoderLayer",
        "JambaAttentionDecoderLayer",
    ]
    assert set(layout.non_block_param_names) == {
        "model.embed_tokens.weight",
        "model.final_layernorm.weight",
        "lm_head.weight",
    }
    assert_partition(model, layout)


def test_hybrid_qwen3_next_linear_and_full_attention() -> None:
    model = _build(
        T.Qwen3NextConfig,
        T.Qwen3NextForCausalLM,
        **TEXT,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    layout = discover_blocks(model)
    assert [b.name for b in layout.blocks] == _layers("model.layers", 4)
    assert hasattr(layout.blocks[0].module, "linear_attn")
    assert hasattr(layout.blocks[3].module, "self_attn")
    assert_partition(model, layout)


def test_lora_wrapped_llama() -> None:
    import peft

    model = _build(T.LlamaConfig, T.LlamaForCausalLM, num_hidden_layers=2, **TEXT)
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, target_modules="all-linear", modules_to_save=["lm_head"], lora_dropout=0.0
        ),
    )
    layout = discover_blocks(lora)
    prefix = "base_model.model.model.layers"
    assert layout.stacks == [prefix]
    assert [b.name for b in layout.blocks] == _layers(prefix, 2)
    lora_names = [n for b in layout.blocks for n in b.param_names if "lora_" in n]
    assert len(lora_names) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    assert "base_model.model.model.embed_tokens.weight" in layout.non_block_param_names
    assert any(n.startswith("base_model.model.lm_head") for n in layout.non_block_param_names)
    assert_partition(lora, layout)


class _Layer(nn.Module):
    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shared = shared if shared is not None else nn.Linear(4, 4)


def test_parameter_shared_between_blocks_is_owned_by_the_first() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([_Layer(shared) for _ in range(3)]))
    layout = discover_blocks(model)
    assert [b.name for b in layout.blocks] == ["1.0", "1.1", "1.2"]
    assert layout.blocks[0].param_names == (
        "1.0.fc.weight",
        "1.0.fc.bias",
        "1.0.shared.weight",
        "1.0.shared.bias",
    )
    assert layout.blocks[1].param_names == ("1.1.fc.weight", "1.1.fc.bias")
    assert layout.non_block_param_names == ["0.weight", "0.bias"]
    assert_partition(model, layout)


def test_root_sequential_of_layers_is_a_stack() -> None:
    model = nn.Sequential(_Layer(), _Layer())
    layout = discover_blocks(model)
    assert layout.stacks == [""]
    assert [b.name for b in layout.blocks] == ["0", "1"]
    assert_partition(model, layout)


def test_lists_of_bare_linears_or_unrepeated_modules_are_not_stacks() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.projections = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.mixed = nn.ModuleList([_Layer(), nn.Sequential(nn.Linear(4, 4), nn.ReLU())])
            self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    with pytest.raises(BlockDiscoveryError, match="no repeated layers found in Odd"):
        discover_blocks(Odd())
    layout = discover_blocks(Odd(), on_no_stack="whole_model")
    assert [b.name for b in layout.blocks] == [""]
    assert layout.source == "whole_model"
    assert layout.non_block_param_names == []


def test_explicit_stacks_and_their_errors() -> None:
    model = _build(T.LlamaConfig, T.LlamaForCausalLM, num_hidden_layers=2, **TEXT)
    layout = discover_blocks(model, stacks=["model.layers"])
    assert layout.source == "explicit"
    assert [b.name for b in layout.blocks] == _layers("model.layers", 2)
    with pytest.raises(BlockDiscoveryError, match="not a submodule"):
        discover_blocks(model, stacks=["model.blocks"])
    with pytest.raises(BlockDiscoveryError, match="not a non-empty"):
        discover_blocks(model, stacks=["model.norm"])
    nested = nn.Sequential(nn.ModuleList([_Layer(), _Layer()]), _Layer())
    with pytest.raises(BlockDiscoveryError, match="lies inside"):
        discover_blocks(nested, stacks=["", "0"])


def test_known_stacks_table_takes_over_a_subtree(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _build(T.T5Config, T.T5ForConditionalGeneration, d_model=32, d_ff=64, d_kv=8,
                   num_heads=4, num_layers=2, num_decoder_layers=3, vocab_size=128)  # fmt: skip
    # An entry for the class of both stacks' parents: each subtree is read by the table.
    monkeypatch.setitem(known_stacks.KNOWN_STACKS, "T5Stack", ("block",))
    layout = discover_blocks(model)
    assert layout.source == "generic+table:T5Stack+table:T5Stack"
    assert layout.stacks == ["encoder.block", "decoder.block"]
    monkeypatch.setitem(known_stacks.KNOWN_STACKS, "T5Stack", ("missing",))
    with pytest.raises(BlockDiscoveryError, match="not a submodule"):
        discover_blocks(model)
