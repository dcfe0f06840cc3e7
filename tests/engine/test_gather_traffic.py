"""Gathers per step equal what the runtime model counts: every offloaded chunk once in
forward, and again in backward except the ``n_buffer`` still resident when it begins; also
when the loss runs the body without the root module (a chunked loss) and when blocks
straddle chunk boundaries (LoRA, norms registered after the layers that follow them)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import protrain
from protrain.activations import apply_activation_knobs, chunked_causal_lm_loss_sum

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model: torch.nn.Module, mode: str, r: int) -> torch.nn.Module:
    """``model`` itself for "full", LoRA of rank ``r`` on every projection for "lora"."""
    if mode == "lora":
        model = get_peft_model(model, LoraConfig(r=r, target_modules=LORA_TARGETS))
    return model


def _model(mode: str, tied: bool = False) -> torch.nn.Module:
    """A tiny Llama; ``tied``: its head tied to the input embedding (as small Llama-3.2 and
    Qwen2.5 models are), so the head uses chunk 0 after the last block."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return with_lora(LlamaForCausalLM(cfg), mode, r=4)


def _chunked_loss(model, ids):
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=ids).last_hidden_state  # not through the root
    return chunked_causal_lm_loss_sum(hidden, causal_lm.lm_head, ids, chunk_tokens=16)


def _root_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("loss", [_chunked_loss, _root_loss], ids=["chunked", "root"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize(
    ("n_persist", "n_buffer", "n_checkpoint"), [(0, 3, 12), (2, 3, 0), (0, 4, 6)]
)
def test_gathers_per_step_are_the_modelled_traffic(loss, mode, n_persist, n_buffer, n_checkpoint):
    model = _model(mode)
    block = model.get_base_model().model.layers[0] if mode == "lora" else model.model.layers[0]
    block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    # about 2.3 blocks a chunk, so that blocks straddle chunk boundaries
    chunk = (int(2.3 * block_bytes) + 63) // 64 * 64
    model, opt, layout = protrain.wrap(
        model, n_persist=n_persist, n_buffer=n_buffer, device="cpu", chunk_size_bytes=chunk
    )
    apply_activation_knobs(model, 0, n_checkpoint, device="cpu")
    ids = torch.randint(128, (2, 32), generator=torch.Generator().manual_seed(0))
    n_off = layout.n_chunks - n_persist
    assert n_off >= 4
    expected = n_off + n_off - min(layout.n_buffer, n_off)
    for step in range(3):
        before = opt.stats["gathers"]
        loss(model, ids).backward()
        gathers = opt.stats["gathers"] - before
        opt.step()
        opt.zero_grad()
        if step > 0:  # the first forward records the order
            assert gathers == expected, (step, gathers, expected)
    protrain.close(model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_back_moves_only_the_trainable_bytes(device):
    """After a host update, a gather writes back only the chunk's trainable byte runs; its
    frozen runs (a LoRA base) stay as the host holds them, and the two kinds of run cover
    every parameter's bytes without overlapping. On CUDA the write-back runs on the
    device-to-host stream after the cast."""
    model = _model("lora")
    model, opt, _ = protrain.wrap(model, n_persist=0, n_buffer=3, device=device, lr=1e-2)
    manager = model._protrain_engine.manager
    before = {c.index: c.host_buffer.clone() for c in manager.chunks}
    ids = torch.randint(0, 128, (2, 16), device=device)
    for _ in range(2):
        _root_loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
    _root_loss(model, ids)  # gathers every chunk after the update: the write-backs
    if device == "cuda":
        torch.cuda.synchronize()
    for c in manager.chunks:
        trainable, frozen = c.byte_runs(trainable=True), c.byte_runs(trainable=False)
        covered = torch.zeros(c.host_buffer.numel(), dtype=torch.int8)
        for a, b in trainable + frozen:
            covered[a:b] += 1
        assert covered.max() <= 1
        for s in c.slots:
            a = s.placement.offset_bytes
            assert covered[a : a + s.placement.nbytes].min() == 1
            host = s.host_view.view(-1)
            if s.master is None:  # never written back: the original bytes
                assert torch.equal(
                    c.host_buffer[a : a + s.placement.nbytes],
                    before[c.index][a : a + s.placement.nbytes],
                )
            else:  # the updated master, cast
                assert torch.equal(host, s.master.view(-1).to(host.dtype))
        if any(s.master is not None for s in c.slots):
            assert sum(b - a for a, b in trainable) < c.used_bytes  # not the whole chunk
    protrain.close(model)
