"""``optimizer="adamw_8bit"``: the engine steps its persistent chunks as bitsandbytes'
AdamW8bit steps the same fp32 parameters, and its offloaded chunks as torch's AdamW.

The model is a Llama wide enough that some tensors have at least bitsandbytes'
``min_8bit_size`` (4096) elements and take 8-bit state (q_proj, o_proj, the MLP, the
embeddings) while others stay below it and take its fp32 state (k_proj, v_proj, norms), as
they would in ``bnb.optim.AdamW8bit`` with its default threshold.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import protrain
from protrain import wrap
from protrain.optim.adamw_8bit import (
    MIN_8BIT_SIZE,
    check_saved_optimizer,
    optimizer_choice,
    plain_state_dict,
    state_bytes_8bit,
)
from protrain.plan.memory import device_optimizer_bytes
from protrain.profile.chunk_table import chunk_table

bnb = pytest.importorskip("bitsandbytes")

STEPS, ACCUM, MAX_NORM, LR, WD = 3, 2, 0.5, 1e-2, 0.01
VOCAB = 96


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).train()


def batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (2, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _run(model, data, steps, step_fn, clip_fn):
    losses, norms = [], []
    for step in range(steps):
        for mb in range(ACCUM):
            loss = model(**data[step * ACCUM + mb]).loss / ACCUM
            loss.backward()
            losses.append(loss.item())
        norms.append(float(clip_fn()))
        step_fn()
    return losses, norms


def train_reference(model, data, persistent: set[str], device):
    """bitsandbytes' AdamW8bit over the parameters the engine keeps persistent, torch's fused
    AdamW over the others (the engine's host update), clipping by torch."""
    model.to(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    on_device = [p for n, p in named if n in persistent]
    offloaded = [p for n, p in named if n not in persistent]
    opts = []
    if on_device:
        opts.append(bnb.optim.AdamW8bit(on_device, lr=LR, weight_decay=WD))
    if offloaded:
        opts.append(torch.optim.AdamW(offloaded, lr=LR, weight_decay=WD, fused=True))

    def step():
        for o in opts:
            o.step()
            o.zero_grad()

    out = _run(model, data, STEPS, step, lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    return out, {n: p.detach().cpu() for n, p in model.named_parameters()}


def train_engine(model, opt, data, steps=STEPS):
    def step():
        opt.step()
        opt.zero_grad()

    return _run(model, data, steps, step, lambda: opt.clip_grad_norm_(MAX_NORM))


def _persistent_names(layout) -> set[str]:
    return {n for c in layout.chunks if c.persistent for n in c.param_names}


def _compare(device, n_persist_of, tol: float):
    base = build()
    # on the model's device: the engine, like plain PyTorch, takes batches where it computes
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(STEPS * ACCUM)]
    model, opt, layout = wrap(
        copy.deepcopy(base),
        n_persist=n_persist_of(base),
        lr=LR,
        weight_decay=WD,
        device=device,
        compute_dtype=torch.float32,
        optimizer="adamw_8bit",
    )
    losses, norms = train_engine(model, opt, data)
    persistent = _persistent_names(layout)
    state = {k: v.cpu() for k, v in protrain.state_dict(model).items()}
    opt_state = opt.state_dict()
    protrain.close(model)
    (ref_losses, ref_norms), ref_state = train_reference(
        copy.deepcopy(base), data, persistent, device
    )
    assert losses == pytest.approx(ref_losses, abs=tol, rel=tol)
    assert norms == pytest.approx(ref_norms, abs=tol, rel=tol)
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], atol=tol, rtol=0, msg=name)
    return persistent, opt_state


def _n_chunks(model) -> int:
    m, opt, layout = wrap(copy.deepcopy(model), device="cpu")
    n = layout.n_chunks
    opt.close()
    return n


@pytest.mark.parametrize("where", ["all_persistent", "half_persistent"])
def test_8bit_engine_equals_bitsandbytes_adamw8bit(where):
    """Every chunk persistent: the model trained by bnb.optim.AdamW8bit; half: its
    persistent parameters by AdamW8bit, the offloaded ones by torch's AdamW (their moments
    stay fp32 on the host). On the CPU bit for bit (the same kernels in the same order)."""
    if where == "all_persistent":
        persistent, sd = _compare("cpu", lambda m: None, tol=0.0)
    else:
        persistent, sd = _compare("cpu", lambda m: _n_chunks(m) // 2, tol=0.0)
        assert persistent and len(persistent) < len(list(build().parameters()))
    names = [n for n, p in build().named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in build().named_parameters()}
    kinds = set()
    for i, name in enumerate(names):  # the state's format: 8-bit, bnb's fp32, torch's fp32
        st = sd["state"][i]
        if name not in persistent:
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"}, name
            kinds.add("host fp32")
        elif sizes[name] >= MIN_8BIT_SIZE:
            assert st["state1"].dtype == torch.uint8 and st["absmax1"].numel() > 0, name
            kinds.add("8-bit")
        else:
            assert st["state1"].dtype == torch.float32, name
            kinds.add("bnb fp32")
    want = {"8-bit", "bnb fp32"} | ({"host fp32"} if where == "half_persistent" else set())
    assert kinds == want


def _wrap(n_persist=None, optimizer="adamw_8bit", seed=0):
    return wrap(
        build(seed), n_persist=n_persist, lr=LR, weight_decay=WD, device="cpu", optimizer=optimizer
    )


@pytest.mark.parametrize("n_persist", [None, 2])
def test_8bit_resume_equals_an_uninterrupted_run_bit_for_bit(n_persist):
    data = batches(4 * ACCUM)
    model, opt, _ = _wrap(n_persist)
    train_engine(model, opt, data[: 2 * ACCUM], steps=2)
    saved_model = protrain.state_dict(model)
    saved_opt = copy.deepcopy(opt.state_dict())
    ref_losses, _ = train_engine(model, opt, data[2 * ACCUM :], steps=2)
    final = protrain.state_dict(model)
    final_opt = opt.state_dict()
    protrain.close(model)

    fresh, opt2, _ = _wrap(n_persist, seed=7)
    protrain.load_state_dict(fresh, saved_model)
    opt2.load_state_dict(saved_opt)
    losses, _ = train_engine(fresh, opt2, data[2 * ACCUM :], steps=2)
    assert losses == ref_losses
    for name, value in protrain.state_dict(fresh).items():
        torch.testing.assert_close(value, final[name], atol=0, rtol=0, msg=name)
    for i, st in opt2.state_dict()["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                torch.testing.assert_close(v, final_opt["state"][i][k], atol=0, rtol=0)
            else:
                assert v == final_opt["state"][i][k]
    # one shared quantization map per kind, as in a fresh state
    device_opt = opt2._device_opt[0]
    maps = {id(st["qmap1"]) for st in device_opt.state.values() if "qmap1" in st}
    assert len(maps) == 1
    protrain.close(fresh)


def test_a_checkpoint_of_the_other_optimizer_choice_is_refused():
    data = batches(ACCUM)
    model, opt, _ = _wrap(optimizer="adamw")
    train_engine(model, opt, data, steps=1)
    saved = opt.state_dict()
    protrain.close(model)
    model, opt, _ = _wrap(optimizer="adamw_8bit")
    with pytest.raises(ValueError, match="saved with optimizer='adamw', this engine's is"):
        opt.load_state_dict(saved)
    legacy = {k: v for k, v in saved.items() if k != "optimizer"}  # before the marker
    with pytest.raises(ValueError, match="optimizer='adamw_8bit' keeps"):
        opt.load_state_dict(legacy)
    protrain.close(model)


def test_each_optimizer_names_its_own_choice():
    # bitsandbytes' optimizers carry an optimizer_name of their own ("adam"): the choice a
    # checkpoint records must still be the run's "adamw_8bit".
    p = [torch.nn.Parameter(torch.zeros(8))]
    assert optimizer_choice(bnb.optim.AdamW8bit(p)) == "adamw_8bit"
    assert optimizer_choice(torch.optim.AdamW(p)) == "adamw"
    for choice in ("adamw", "adamw_8bit"):
        model, opt, _ = _wrap(optimizer=choice)
        assert optimizer_choice(opt) == choice
        protrain.close(model)
    saved = {**plain_state_dict(bnb.optim.AdamW8bit(p)), "optimizer": "adam"}  # bnb's own name
    check_saved_optimizer(saved, "adamw_8bit")  # read as the choice it stands for
    with pytest.raises(ValueError, match="saved with optimizer='adamw_8bit'"):
        check_saved_optimizer(saved, "adamw")


@pytest.mark.parametrize("before,after", [(None, 0), (0, None)])
def test_8bit_state_moves_with_the_plan(before, after):
    """A new plan (the closed loop's re-plan, a resume under another plan) that moves
    parameters between the persistent chunks (8-bit state) and the host (fp32 moments)
    loads the same choice's checkpoint: the moments are dequantized with bitsandbytes' own
    code, or quantized as its AdamW8bit does, the step count kept; training goes on."""
    F = bnb.functional
    data = batches(3 * ACCUM)
    model, opt, _ = _wrap(before)
    train_engine(model, opt, data[:ACCUM], steps=1)
    saved = copy.deepcopy(opt.state_dict())
    protrain.close(model)
    model, opt, _ = _wrap(after)
    opt.load_state_dict(saved)
    got = opt.state_dict()
    moved = 0
    for i, st in saved["state"].items():
        new = got["state"][i]
        if set(st) == set(new):
            continue
        moved += 1
        assert float(new["step"]) == float(st["step"]) == 1.0
        if "absmax1" in st:  # 8-bit -> fp32 on the host: bitsandbytes' dequantization
            for j, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                want = F.dequantize_blockwise(st[f"state{j}"], absmax=st[f"absmax{j}"],
                                              code=st[f"qmap{j}"], blocksize=256)  # fmt: skip
                torch.testing.assert_close(new[key], want, atol=0, rtol=0)
        elif "absmax1" in new:  # fp32 -> 8-bit: within one quantization step of a block
            for j, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                back = F.dequantize_blockwise(new[f"state{j}"], absmax=new[f"absmax{j}"],
                                              code=new[f"qmap{j}"], blocksize=256)  # fmt: skip
                scale = st[key].abs().max()
                assert (back - st[key]).abs().max() <= 0.05 * scale, key
    assert moved > 0
    losses, _ = train_engine(model, opt, data[ACCUM:], steps=2)
    assert all(torch.isfinite(torch.tensor(losses)))
    protrain.close(model)


def test_unknown_optimizer_is_refused_before_anything_moves():
    model = build()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="'adamw', 'adamw_8bit'"):
        wrap(model, device="cpu", optimizer="sgd")
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}


def test_state_bytes_8bit_is_what_bitsandbytes_allocates():
    """The memory model's count (plan/memory.py) against the state AdamW8bit makes."""
    for numel in (100, MIN_8BIT_SIZE - 1, MIN_8BIT_SIZE, 5000, 65536 + 3):
        p = torch.nn.Parameter(torch.zeros(numel))
        p.grad = torch.ones(numel)
        o = bnb.optim.AdamW8bit([p])
        o.step()
        st = o.state[p]
        got = sum(st[k].nbytes for k in ("state1", "state2", "absmax1", "absmax2") if k in st)
        assert got == state_bytes_8bit(numel), numel


@pytest.mark.gpu
def test_8bit_engine_equals_bitsandbytes_adamw8bit_on_cuda():
    """The same comparison in fp32 on the GPU: bitsandbytes' CUDA kernels on both sides."""
    _compare("cuda", lambda m: None, tol=1e-6)


def test_memory_model_bounds_the_8bit_state_the_engine_holds():
    """plan/memory.py's per-chunk count against the masters and state the wrapped model
    holds after a step: never below, at most 24 KiB a tensor above (its bound)."""
    base = build()
    table = chunk_table(base, compute_dtype=torch.float32)
    data = batches(ACCUM)
    model, opt, layout = wrap(
        base, lr=LR, device="cpu", chunk_size_bytes=table.chunk_size_bytes, optimizer="adamw_8bit"
    )
    assert layout.n_chunks == table.n_chunks
    train_engine(model, opt, data, steps=1)
    sd = opt.state_dict()["state"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    index = {n: i for i, n in enumerate(names)}
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    state_keys = ("state1", "state2", "absmax1", "absmax2")
    held = [
        sum(
            4 * sizes[n] + sum(sd[index[n]][k].nbytes for k in state_keys if k in sd[index[n]])
            for n in c.param_names
        )  # fmt: skip
        for c in layout.chunks
    ]
    protrain.close(model)
    bound = device_optimizer_bytes(table.trainable_numel, table.trainable_tensors, "adamw_8bit")
    fp32 = device_optimizer_bytes(table.trainable_numel, table.trainable_tensors)
    for c, (h, b, f) in enumerate(zip(held, bound, fp32)):
        assert h <= b <= h + (6 * (MIN_8BIT_SIZE - 1) + 8) * table.trainable_tensors[c], c
        assert b <= f, c  # and never above torch's fp32 state
    assert bound.sum() < 0.8 * fp32.sum()


def test_state_dicts_share_no_memory_between_entries():
    """A checkpoint writes each tensor under its own name (safetensors refuses shared
    memory): bitsandbytes' one quantization map comes out as a copy per parameter, from the
    engine's state_dict without copies and from plain_state_dict of AdamW8bit itself, which
    also flattens bnb's nested state; that flat state loads back and steps the same."""
    from protrain.optim.adamw_8bit import plain_state_dict

    model, opt, _ = _wrap()
    train_engine(model, opt, batches(ACCUM), steps=1)
    tensors = [v for st in opt.state_dict(copy=False)["state"].values() for v in st.values()]
    ptrs = [t.data_ptr() for t in tensors if torch.is_tensor(t) and t.numel() > 1]
    assert len(ptrs) == len(set(ptrs))
    protrain.close(model)

    def plain(seed=0):
        m = build(seed)
        return m, bnb.optim.AdamW8bit(m.parameters(), lr=LR, weight_decay=WD)

    def one_step(m, o, b):
        m(**b).loss.backward()
        o.step()
        o.zero_grad()

    data = batches(3)
    m, o = plain()
    one_step(m, o, data[0])
    sd = plain_state_dict(o)
    st = sd["state"][0]
    assert not any(isinstance(v, dict) for v in st.values())
    assert set(st) == {"step", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2"}
    ptrs = [v.data_ptr() for s in sd["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert len(ptrs) == len(set(ptrs))
    sd = copy.deepcopy(sd)
    m2, o2 = plain(seed=5)
    m2.load_state_dict(m.state_dict())
    o2.load_state_dict(sd)
    for b in data[1:]:
        one_step(m, o, b)
        one_step(m2, o2, b)
    for (name, a), b in zip(m.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
