"""Liger's fused kernels (protrain.model.kernels, the fused loss's head in
protrain.activations.fused_loss): which run for a setting, that `auto` is off on the CPU
with one log line, how they are put on a model through Liger's public per-family function, that the fused loss gives the app's summed loss, and that the plan
and the run agree on the kernels. Liger's kernels are Triton (no CPU backend): on the CPU
the family function is a stand-in that records its call, and the fused loss's kernel is
its reference with the logits materialized (`reference_linear_cross_entropy`)."""

from __future__ import annotations

import copy
import logging
import sys
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from protrain.activations.fused_loss import (
    apply_kernels,
    fused_head,
    fused_head_problem,
    reference_linear_cross_entropy,
)
from protrain.model.kernels import FUSED_CE, KernelChoice, applied_kernels, choose_kernels
from protrain.train.loss import count_trained_tokens, loss_sum

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             use_cache=False)  # fmt: skip


def _llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tie))


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE))


def _batch() -> dict:
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt not trained
    return {"input_ids": ids, "labels": labels}


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in `liger_kernel.transformers` recording each family function's call."""
    calls = []
    module = types.ModuleType("liger_kernel.transformers")
    for family in ("llama", "qwen2"):

        def apply(family=family, **kwargs):
            calls.append((family, kwargs))

        setattr(module, f"apply_liger_kernel_to_{family}", apply)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    return calls


def _choose(setting, model_type="llama", device=CUDA, liger=True, head_problem=None):
    return choose_kernels(setting, model_type, device, liger_available=liger,
                          head_problem=head_problem)  # fmt: skip


def test_auto_is_every_kernel_of_the_family_on_a_gpu():
    assert _choose("auto").names == ("rms_norm", "swiglu", "rope", FUSED_CE)
    assert _choose("auto", "gemma").names == ("rms_norm", "geglu", "rope", FUSED_CE)
    off = _choose("auto", head_problem="the output head is a Linear4bit")
    assert off.names == ("rms_norm", "swiglu", "rope")
    assert "fused_linear_cross_entropy off: the output head is a Linear4bit" in off.reason


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (dict(device=CPU), "no CUDA GPU (cpu)"),
        (dict(liger=False), "liger-kernel is not installed"),
        (dict(model_type="gpt2"), "no kernels for model type 'gpt2'"),
    ],
)
def test_auto_is_off_with_the_reason(kwargs, why):
    choice = _choose("auto", **kwargs)
    assert choice.names == ()
    assert why in choice.reason


def test_a_list_runs_as_listed_or_is_refused():
    assert _choose(["rope", "rms_norm"]).names == ("rms_norm", "rope")
    assert _choose("none").names == ()
    with pytest.raises(ValueError, match="'layer_norm' not known"):
        _choose(["layer_norm"])
    with pytest.raises(ValueError, match="geglu not for model type 'llama'"):
        _choose(["geglu"])
    with pytest.raises(ValueError, match="cannot run: no CUDA GPU"):
        _choose(["rms_norm"], device=CPU)
    with pytest.raises(ValueError, match="fused_linear_cross_entropy cannot run: tied"):
        _choose([FUSED_CE], head_problem="tied")


def test_auto_on_the_cpu_puts_nothing_on_and_logs_one_line(caplog):
    from protrain.train.config import TrainConfig
    from protrain.train.kernels import put_kernels

    model = _llama()
    forwards = {name: m.forward for name, m in model.named_modules()}
    with caplog.at_level(logging.INFO, logger="protrain"):
        choice = put_kernels(TrainConfig(), model, CPU)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:")]
    assert lines == [
        "kernels: none (model.kernels: auto; no CUDA GPU (cpu): Liger's kernels are Triton, "
        "GPU only)"
    ]
    assert choice.names == () and applied_kernels(model) == ()
    assert all(m.forward == forwards[n] for n, m in model.named_modules())


@pytest.mark.parametrize("build, family", [(_llama, "llama"), (_qwen2, "qwen2")])
def test_the_family_function_gets_the_model_and_the_chosen_kernels(fake_liger, build, family):
    model = build()
    choice = KernelChoice(("rms_norm", "rope"), "test")
    apply_kernels(model, choice)
    assert fake_liger == [
        (
            family,
            dict(
                model=model,
                rope=True,
                rms_norm=True,
                swiglu=False,
                cross_entropy=False,
                fused_linear_cross_entropy=False,
            ),
        )  # fmt: skip
    ]
    assert applied_kernels(model) == ("rms_norm", "rope")
    assert fused_head(model) is None


def _counting(calls: list):
    def kernel(weight, hidden, targets, bias):
        calls.append(hidden.shape)
        return reference_linear_cross_entropy(weight, hidden, targets, bias)

    return kernel


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunked", [None, 8])
def test_the_fused_loss_is_the_apps_summed_loss(fake_liger, chunked):
    """The fused head replaces the whole-logits loss and the chunked one: the same sum over
    trained tokens, and the same gradients, as the stock model's loss."""
    stock = _llama()
    fused = copy.deepcopy(stock)
    calls = []
    apply_kernels(fused, KernelChoice((FUSED_CE,), "test"), loss_kernel=_counting(calls))
    batch = _batch()
    want = loss_sum(stock, batch, CPU)
    got = loss_sum(fused, batch, CPU, chunked_loss_tokens=chunked)
    assert calls == [torch.Size([2 * 24, SHAPE["hidden_size"]])]  # one call: the whole batch
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    n = count_trained_tokens(batch["labels"])
    (want / n).backward()
    (got / n).backward()
    a, b = _grads(stock), _grads(fused)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_fused_loss_with_lora_and_the_head_stays_a_plain_head(fake_liger):
    from peft import LoraConfig, get_peft_model

    stock = get_peft_model(_llama(), LoraConfig(r=4, target_modules="all-linear"))
    fused = copy.deepcopy(stock)
    apply_kernels(fused.get_base_model(), KernelChoice((FUSED_CE,), "test"),
                  loss_kernel=reference_linear_cross_entropy)  # fmt: skip
    batch = _batch()
    torch.testing.assert_close(loss_sum(fused, batch, CPU), loss_sum(stock, batch, CPU),
                               rtol=1e-6, atol=0)  # fmt: skip
    head = fused.get_base_model().lm_head
    logits = head(torch.ones(3, SHAPE["hidden_size"]))  # evaluation: logits as before
    assert logits.shape == (3, SHAPE["vocab_size"])


def test_heads_the_fused_loss_cannot_take():
    from peft import LoraConfig, get_peft_model

    assert fused_head_problem(_llama()) is None
    wrapped = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["lm_head"]))
    assert "not a plain nn.Linear" in fused_head_problem(wrapped.get_base_model())


def test_a_head_the_fused_loss_cannot_take_is_refused_before_any_kernel_is_put_on(fake_liger):
    from peft import LoraConfig, get_peft_model

    base = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["lm_head"])).get_base_model()
    with pytest.raises(ValueError, match="fused linear cross-entropy cannot run: the output head"):
        apply_kernels(base, KernelChoice(("rms_norm", FUSED_CE), "test"),
                      loss_kernel=reference_linear_cross_entropy)  # fmt: skip
    assert fake_liger == [] and applied_kernels(base) == () and fused_head(base) is None


def test_the_plan_records_the_traced_kernels_and_the_run_must_run_them(fake_liger):
    """The planner traces the model with its kernels (the fused loss, not the loss in
    chunks), the plan records them, and the engine refuses a model running others."""
    from protrain.plan import PlanRequest, profile_and_plan
    from protrain.planned_wrap import check_plan_kernels
    from protrain.train.planning import PlanSettings, plan_request

    model = _llama()
    calls = []
    apply_kernels(model, KernelChoice(("rms_norm", FUSED_CE), "test"), loss_kernel=_counting(calls))
    request = PlanRequest(gpu_budget_bytes=1 << 40, cpu_budget_bytes=1 << 40)
    settings = PlanSettings(device=CPU, compute_dtype=torch.float32, request=request)
    request = plan_request(model, _batch(), settings)
    assert request.loss_chunks is None  # the fused loss has no chunk to search
    plan, _ = profile_and_plan(model, request, device=CPU, compute_dtype=torch.float32)
    assert calls, "the traced step ran the fused loss"
    assert plan.kernels == ["rms_norm", FUSED_CE]
    assert not plan.loss_planned and plan.chunked_loss_tokens is None
    check_plan_kernels(plan, model)
    with pytest.raises(ValueError, match=r"traced with kernels \[rms_norm, "):
        check_plan_kernels(plan, _llama())
