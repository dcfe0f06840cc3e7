"""Parameters read without calling their module are resident when read.

MoE families with fused experts (transformers 5 keeps them as 3-D parameters of an experts
module), full fine-tuning and peft LoRA ``all-linear``, whose ``ParamWrapper`` reads
``lora_A``/``lora_B`` (and the expert weights) without calling their modules. Every chunk
offloaded, chunk boundaries inside the experts, the smallest pool wrap accepts: losses,
gradient norms and parameters after 3 AdamW steps as plain PyTorch's (fp32 on CPU: 1e-6).
Before the fix: "data is not allocated yet" (Mixtral, OLMoE) or a segmentation fault
(Qwen3-MoE).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import protrain
from protrain.model.readers import direct_reads

from .test_equivalence import ACCUM, LR, STEPS, WD, train_engine, train_plain

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# 4 experts, 2 per token; one config per family
_MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4,
                num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
}  # fmt: skip
FAMILIES = list(_MOE)


def build_moe(kind: str) -> nn.Module:
    import transformers

    config_cls, model_cls, extra = _MOE[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**_COMMON, **extra)
    return getattr(transformers, model_cls)(config).train()


def lora_all_linear(model: nn.Module, kind: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    # peft 0.21 puts Qwen2-MoE's fused experts under all-linear's ParamWrapper only when
    # named; the other families get one from all-linear alone
    extra = {}
    if kind == "qwen2_moe":
        extra["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                     init_lora_weights=False, **extra)  # fmt: skip
    torch.manual_seed(123)
    return get_peft_model(model, cfg)


def moe_batches(n: int, seed: int = 1, batch: int = 2, seq: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost module of each layer's experts (a ParamWrapper under LoRA)."""
    return [(n, m) for n, m in model.named_modules() if n.endswith("mlp.experts")]


def _largest_param_bytes(model: nn.Module) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


def _check_same(model, ref_losses, ref_norms, ref_state, losses, norms, msg):
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6), msg
    assert norms == pytest.approx(ref_norms, abs=1e-6, rel=1e-6), msg
    state = protrain.state_dict(model)
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=f"{msg} {name}")


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_fused_experts_offloaded_same_as_plain_pytorch(kind, mode, checkpointed):
    base = build_moe(kind)
    if mode == "lora":
        base = lora_all_linear(base, kind)
        wrappers = [m for _, m in _experts(base) if type(m).__name__ == "ParamWrapper"]
        assert wrappers, f"{kind}: no ParamWrapper on the experts"
    data = moe_batches(STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, ref_norms = train_plain(reference, data)
    ref_state = reference.state_dict()

    model = copy.deepcopy(base)
    if checkpointed:  # recomputation calls the readers again inside backward
        model.gradient_checkpointing_enable()
    # the largest parameter (an expert stack) fills a chunk: the experts' parameters and
    # their adapters span several chunks
    model, optimizer, layout = protrain.wrap(
        model,
        n_persist=0,
        chunk_size_bytes=_largest_param_bytes(base),
        lr=LR,
        weight_decay=WD,
        device="cpu",
    )
    chunk_of = {n: c.index for c in layout.chunks for pl in c.placements for n in pl.names}
    for name, experts in _experts(model):
        spanned = {chunk_of[f"{name}.{n}"] for n, _ in experts.named_parameters()}
        assert len(spanned) >= 2, (name, spanned)
    losses, norms = train_engine(model, data, optimizer)
    assert model._protrain_engine.manager.stats["gathers"] > layout.n_chunks * STEPS
    _check_same(model, ref_losses, ref_norms, ref_state, losses, norms, f"{kind} {mode}")
    protrain.close(model)


def test_param_wrapper_reads_are_resident_together():
    """A ParamWrapper's call brings in its whole subtree: the pool wrap accepts holds it."""
    model = lora_all_linear(build_moe("qwen3_moe"), "qwen3_moe")
    reads = direct_reads(model).groups
    for name, experts in _experts(model):
        assert set(reads[name]) == {f"{name}.{n}" for n, _ in experts.named_parameters()}
    plain = build_moe("qwen3_moe")
    assert direct_reads(plain).groups == {} and direct_reads(plain).uncovered == {}


class _Scaled(nn.Module):
    """A forward that reads a ParameterList (no forward of its own) directly."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.scales = nn.ParameterList(
            [nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16))]
        )

    def forward(self, x):
        return self.proj(x) @ self.scales[0] + self.scales[1]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = _Scaled(), _Scaled(), _Scaled()

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_parameter_list_read_by_the_module_around_it():
    torch.manual_seed(0)
    base = _Net()
    xs = [torch.randn(4, 16) for _ in range(3)]
    reference = copy.deepcopy(base)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD, fused=True)
    ref_losses = []
    for x in xs:
        loss = reference(x).square().mean()
        loss.backward()
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    # a matrix fills a chunk: chunks that hold ParameterList entries only
    model, optimizer, layout = protrain.wrap(
        copy.deepcopy(base), n_persist=0, chunk_size_bytes=16 * 16 * 4, lr=LR, weight_decay=WD,
        device="cpu",
    )  # fmt: skip
    only_lists = [c for c in layout.chunks if all(".scales." in n for n in c.param_names)]
    assert len(only_lists) >= 3, layout
    losses = []
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    protrain.close(model)


class _Parts(nn.Module):
    """No forward: the caller runs its parts and reads ``scales`` itself, which no module
    call can bring in."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(16))])


def test_reader_the_engine_cannot_cover_is_refused_naming_the_parameter():
    model = _Parts()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"parameter 'scales\.0' would be offloaded, but no"):
        protrain.wrap(model, n_persist=0, chunk_size_bytes=16 * 16 * 4, device="cpu")
    assert getattr(model, "_protrain_engine", None) is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    # persistent, it is always resident: allowed
    model, optimizer, _ = protrain.wrap(model, device="cpu")
    x = torch.randn(4, 16)
    (model.proj(x) * model.scales[0]).sum().backward()
    optimizer.step()
    protrain.close(model)


def test_dora_reads_its_base_and_adapters():
    """DoRA's magnitude module reads lora_A, lora_B and the base weight, which it does not
    call (a segmentation fault with 16 KiB chunks before the fix)."""
    from peft import LoraConfig, get_peft_model

    from .models import batches, build

    base = build("llama")
    torch.manual_seed(123)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True,
                     init_lora_weights=False)  # fmt: skip
    base = get_peft_model(base, cfg)
    data = batches("llama", STEPS * ACCUM)
    reference = copy.deepcopy(base)
    ref_losses, ref_norms = train_plain(reference, data)
    model, optimizer, _ = protrain.wrap(
        copy.deepcopy(base), n_persist=0, chunk_size_bytes=16384, lr=LR, weight_decay=WD,
        device="cpu",
    )  # fmt: skip
    losses, norms = train_engine(model, data, optimizer)
    _check_same(model, ref_losses, ref_norms, reference.state_dict(), losses, norms, "dora")
    protrain.close(model)


def test_parametrized_modules():
    """A parametrized module reads ``parametrizations.weight.original*`` through its
    property (weight norm here), offloaded one chunk per matrix."""
    torch.manual_seed(0)
    base = _Net()
    for m in base.modules():
        if isinstance(m, nn.Linear):
            nn.utils.parametrizations.weight_norm(m)
    xs = [torch.randn(4, 16) for _ in range(3)]
    reference = copy.deepcopy(base)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD, fused=True)
    ref_losses = []
    for x in xs:
        loss = reference(x).square().mean()
        loss.backward()
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    model, optimizer, layout = protrain.wrap(
        copy.deepcopy(base), n_persist=0, chunk_size_bytes=16 * 16 * 4, lr=LR, weight_decay=WD,
        device="cpu",
    )  # fmt: skip
    assert any(".parametrizations." in n for n in direct_reads(model).groups["a.proj"])
    losses = []
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=1e-6)
    state = protrain.state_dict(model)
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-6, rtol=0, msg=name)
    protrain.close(model)
