"""Tiny random Llama and Qwen2 models, batches and a plain AdamW loop for activation tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
STEPS, ACCUM, LR, WD = 2, 2, 1e-2, 0.01


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = {**DECODER, **overrides}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    else:
        raise ValueError(kind)
    return model.train()


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        init_lora_weights=False,  # random A and B: every adapter gets a non-trivial gradient
    )
    torch.manual_seed(123)
    return get_peft_model(model, cfg)


def batches(n: int, seed: int = 1, batch: int = 2, seq: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 3] = -100  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def train(model, data, optimizer=None, loss_fn=None) -> list[float]:
    """STEPS optimizer steps of ACCUM micro-batches each; returns the micro-batch losses."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    loss_fn = loss_fn or (lambda m, b: m(**b).loss)
    losses = []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = loss_fn(model, data[step * ACCUM + mb]) / ACCUM
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def first_gradients(model, batch: dict, loss_fn=None) -> dict[str, torch.Tensor]:
    """The gradients of one micro-batch's loss, before any optimizer step."""
    loss_fn = loss_fn or (lambda m, b: m(**b).loss)
    loss_fn(model, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_same_gradients(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=atol, rtol=1e-6, msg=name)
