"""The chunked loss of transformers families: the model's own loss and gradients, to 1e-6
in fp32, with each family's head (biased or not) and logit transform (soft-capping, scaling).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protrain.activations import LogitTransform, UnsupportedHead, causal_lm_head
from protrain.train.errors import ConfigError
from protrain.train.loss import loss_sum
from protrain.train.trainable import check_chunked_loss_supported

VOCAB, BATCH, SEQ = 96, 2, 10
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)

# model_type -> (config overrides, the transform the chunked loss must read)
FAMILIES: dict[str, tuple[dict, LogitTransform]] = {
    "llama": (dict(intermediate_size=64, num_key_value_heads=2), LogitTransform()),
    "gpt_neox": (dict(intermediate_size=64), LogitTransform()),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=64), LogitTransform()),
    "falcon": (dict(new_decoder_architecture=True, num_kv_heads=2), LogitTransform()),
    # the head has a bias
    "gptj": (dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64), LogitTransform()),
    "phi": (dict(intermediate_size=64), LogitTransform()),
    # a small cap and scale, so that they change the loss
    "gemma2": (
        dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.05),
        LogitTransform(softcap=0.05),
    ),
    "cohere": (
        dict(intermediate_size=64, num_key_value_heads=2, logit_scale=3.0),
        LogitTransform(multiply=3.0),
    ),
    "granite": (
        dict(intermediate_size=64, num_key_value_heads=2, logits_scaling=0.25),
        LogitTransform(divide=0.25),
    ),
    # a state-space model whose head's output is upcast before anything else
    "mamba": (dict(state_size=4), LogitTransform(upcast_first=True)),
}


def _model(model_type: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides, _ = FAMILIES[model_type]
    config = AutoConfig.for_model(model_type, **{**SIZES, **overrides})
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    # eval: no dropout (GPT-2, Falcon, ...), so that two forwards compute the same
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding
    labels[1, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _trained(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_chunked_loss_is_the_models_own_loss(model_type):
    model = _model(model_type)
    _, transform = causal_lm_head(model)
    assert transform == FAMILIES[model_type][1]
    check_chunked_loss_supported(model)
    batch = _batch()
    own = model(**batch).loss
    own_grads = torch.autograd.grad(own, list(model.parameters()), allow_unused=True)
    chunked = loss_sum(model, batch, torch.device("cpu"), chunked_loss_tokens=7)
    chunked = chunked / _trained(batch["labels"])
    grads = torch.autograd.grad(chunked, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(chunked, own, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), grads, own_grads, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_a_vision_language_model_on_text():
    """A VLM's causal class calls its whole body (vision tower included) as the base model."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(SIZES, intermediate_size=64, num_key_value_heads=2)
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))
    model.eval()
    batch = _batch()
    own = model(**batch).loss
    chunked = loss_sum(model, batch, torch.device("cpu"), chunked_loss_tokens=7)
    torch.testing.assert_close(chunked / _trained(batch["labels"]), own, rtol=1e-6, atol=1e-6)


def test_biased_heads_keep_their_bias():
    for model_type in ("gptj", "phi"):
        head, _ = causal_lm_head(_model(model_type))
        assert isinstance(head, nn.Linear) and head.bias is not None


def test_transform_matters():
    """Without Gemma 2's soft-cap the loss differs: the test above would see a missing one."""
    model = _model("gemma2")
    batch = _batch()
    own = model(**batch).loss
    from protrain.activations import chunked_causal_lm_loss_sum

    with torch.no_grad():
        hidden = model.base_model(batch["input_ids"], attention_mask=batch["attention_mask"])
        plain = chunked_causal_lm_loss_sum(
            hidden.last_hidden_state, model.lm_head, batch["labels"], chunk_tokens=7
        )
    assert abs(float(plain) / _trained(batch["labels"]) - own.item()) > 1e-3


def test_lora_model_through_peft():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model("gpt_neox"), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    batch = _batch()
    own = model(**batch).loss
    chunked = loss_sum(model, batch, torch.device("cpu"), chunked_loss_tokens=5)
    torch.testing.assert_close(chunked / _trained(batch["labels"]), own, rtol=1e-6, atol=1e-6)


def test_a_family_that_differs_is_refused_with_one_line():
    """A forward that does something not known to its logits (here: masks some out)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Masked(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            logits[..., :3] = -1e4
            return logits

    model = Masked(LlamaConfig(**SIZES, intermediate_size=64))
    with pytest.raises(UnsupportedHead, match=r"transforms its logits in a way not known"):
        causal_lm_head(model)
    with pytest.raises(ConfigError) as info:
        check_chunked_loss_supported(model)
    assert "\n" not in str(info.value)
    assert "chunked_loss_tokens is not allowed for model type 'llama'" in str(info.value)


def test_a_model_without_an_output_embedding_is_refused():
    class NoHead(nn.Module):
        def get_output_embeddings(self):
            return None

    with pytest.raises(UnsupportedHead, match="has no output embedding"):
        causal_lm_head(NoHead())
