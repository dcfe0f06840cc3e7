"""Engine paths on several ranks beyond the clipped training step (gloo on the CPU, 2 ranks).

Each test spawns the ranks once and runs its scenarios in them; the reference is plain
PyTorch on one process, adding the gradients up in the order the ranks do (each
accumulation step's micro-batches of all ranks summed first, then accumulated), as in
``test_engine_exact.py``, whose docstring says why the order matters.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from tests.engine.models import batches, build, lora

import protrain
from protrain.chunks.shard import shard_range, shard_span
from protrain.optim import hybrid_adamw

from .ranks import run_ranks

WORLD, STEPS, ACCUM, MAX_NORM, LR, WD = 2, 3, 2, 0.5, 1e-2, 0.01
CHUNK = 16384
FP16 = torch.float16


def _with_unused(model: torch.nn.Module) -> torch.nn.Module:
    """A Linear no forward uses (registered after the final norm: it shares a chunk)."""
    torch.manual_seed(7)
    model.model.unused = torch.nn.Linear(32, 32)
    return model


def _model(kind: str) -> torch.nn.Module:
    if kind == "full":
        return build("llama")
    if kind == "lora":
        return lora(build("llama"), "llama")
    if kind == "unused":
        return _with_unused(build("llama"))
    raise ValueError(kind)


def _index(step: int, mb: int, rank: int, accum: int = ACCUM, world: int = WORLD) -> int:
    return step * accum * world + mb * world + rank


def _plain(model, steps, *, accum=ACCUM, clip=None, norm_type=2.0, start=0, opt_state=None):
    """Plain AdamW over the same global batches; ``start``: the first step's index."""
    data = batches("llama", (start + steps) * accum * WORLD)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    if opt_state is not None:
        opt.load_state_dict(copy.deepcopy(opt_state))  # torch steps its tensors in place
    losses, norms = {}, []
    for step in range(start, start + steps):
        total = None
        for mb in range(accum):
            summed = None
            for rank in range(WORLD):
                i = _index(step, mb, rank, accum)
                loss = model(**data[i]).loss / (accum * WORLD)
                loss.backward()
                losses[i] = loss.item()
                grads = [p.grad for p in params]
                summed = grads if summed is None else [_add(a, b) for a, b in zip(summed, grads)]
                opt.zero_grad()
            total = summed if total is None else [_add(a, b) for a, b in zip(total, summed)]
        for p, g in zip(params, total):
            p.grad = g
        with_grad = [p for p in params if p.grad is not None]
        max_norm = math.inf if clip is None else clip
        norms.append(torch.nn.utils.clip_grad_norm_(with_grad, max_norm, norm_type).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def _add(a, b):
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _wrap(model, mode="sharded", **kw):
    kw.setdefault("n_persist", 1)
    return protrain.wrap(
        model,
        device="cpu",
        lr=LR,
        weight_decay=WD,
        chunk_size_bytes=CHUNK,
        distributed_mode=mode,
        grad_reduce="sum",
        **kw,
    )


def _train(model, opt, rank, steps, *, accum=ACCUM, armed=False, clip=None, norm_type=2.0,
           start=0):  # fmt: skip
    data = batches("llama", (start + steps) * accum * WORLD)
    losses, norms = {}, []
    for step in range(start, start + steps):
        for mb in range(accum):
            if armed and mb == accum - 1:
                opt.step_in_backward()
            i = _index(step, mb, rank, accum)
            loss = model(**data[i]).loss / (accum * WORLD)
            opt.scale_loss(loss).backward()
            losses[i] = loss.item()
        if clip is None:
            norms.append(opt.grad_norm(norm_type).item())
        else:
            norms.append(opt.clip_grad_norm_(clip, norm_type).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def _check_state(got, want, what, atol=1e-6, rtol=1e-6):
    assert set(want) <= set(got), (what, sorted(set(want) - set(got))[:5])
    for name, ref in want.items():
        torch.testing.assert_close(
            got[name], ref, rtol=rtol, atol=atol, msg=lambda m, at=f"{what} {name}": f"{at}: {m}"
        )


def _results(tmp_path, world=WORLD):
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ---- step_in_backward ------------------------------------------------------------------


def _rank_armed(rank, world, out_dir):
    out = {}
    for mode in ("sharded", "replicated", "sharded-recompute"):
        kw = {}
        if mode == "sharded-recompute":
            # every block recomputed in backward (its chunks all-gathered again there, among
            # the reductions), host updates in pieces the next gathers copy in one by one
            kw = {"n_checkpoint": 3, "n_buffer": 2}
            hybrid_adamw._UPDATE_PIECE_NUMEL = 100
        model, opt, layout = _wrap(_model("full"), mode.split("-")[0], **kw)
        assert layout.n_chunks > 2, layout
        losses, norms = _train(model, opt, rank, STEPS, armed=True)
        started = opt.stats.get("updates_started_in_backward", 0)
        out[mode] = (losses, norms, protrain.state_dict(model), started)
        protrain.close(model)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_step_in_backward_both_modes(tmp_path):
    """Updates started inside the last backward of each window, no clipping: the same
    weights as plain AdamW, and ``grad_norm()`` (read after the armed backward, before
    ``step``) is the global norm over every rank."""
    losses, norms, state, _ = _plain(_model("full"), STEPS)
    run_ranks(WORLD, _rank_armed, str(tmp_path))
    for r, res in enumerate(_results(tmp_path)):
        for mode, (got_losses, got_norms, got_state, started) in res.items():
            assert started > 0, (r, mode)
            for i, loss in got_losses.items():
                assert loss == pytest.approx(losses[i], rel=1e-6, abs=1e-7), (r, mode, i)
            assert got_norms == pytest.approx(norms, rel=1e-6), (r, mode)
            _check_state(got_state, state, f"rank {r} {mode}")


# ---- fp16 loss scaling -----------------------------------------------------------------

INF_STEP = 1  # rank 1's first micro-batch of this step gives one parameter an inf gradient


def _inf_target(layout) -> str:
    """A trainable parameter of an offloaded chunk wholly in rank 0's shard: after the
    reduce-scatter only rank 0 sees its inf, and rank 1 must skip all the same."""
    own = layout.chunk_size_bytes // WORLD
    return next(
        pl.names[0]
        for spec in layout.chunks
        if not spec.persistent
        for pl in spec.placements
        if pl.trainable and pl.offset_bytes + pl.nbytes <= own
    )


def _poison(g: torch.Tensor) -> torch.Tensor:
    return torch.full_like(g, math.inf)


def _split_params(layout) -> dict[str, list[tuple[int, int]]]:
    """Each parameter that the ranks' shards split: the elements each rank owns."""
    split = {}
    for spec in layout.chunks:
        if spec.persistent:
            continue
        span = shard_span(spec.used_bytes, layout.chunk_size_bytes, WORLD)
        for pl in spec.placements:
            owned = [shard_range(span, r, WORLD).owned_elements(pl) for r in range(WORLD)]
            if pl.trainable and sum(hi > lo for lo, hi in owned) > 1:
                split[pl.names[0]] = owned
    return split


def _norm_as_the_ranks(named_grads, split) -> torch.Tensor:
    """The global 2-norm, a split parameter's norm taken as the ranks take it: the root of
    the sum of its shards' squared norms. torch's norm of the whole tensor sums in an order
    that depends on the CPU's vector width (AVX-512 and AVX2 differ in the last bit)."""
    norms = []
    for name, g in named_grads:
        flat = g.reshape(-1)
        parts = split.get(name, [(0, flat.numel())])
        squares = [torch.linalg.vector_norm(flat[lo:hi]) ** 2 for lo, hi in parts]
        norms.append(torch.stack(squares).sum().sqrt())
    return torch.linalg.vector_norm(torch.stack(norms))


def _plain_fp16(model, steps, target, split):
    """The engine's fp16 arithmetic in plain PyTorch: fp16 weights, scaled fp16 gradients
    summed over ranks in fp16 (as the reduction does), accumulated into fp32 master
    gradients, ``GradScaler`` unscale, clip (the norm reduced as the ranks reduce it), step
    (skipped on inf), update. In fp16 a last-bit difference of the clip coefficient is not
    small: it moves some masters by one ulp, which flips the rounding of their fp16 copies,
    and the next steps' gradients differ in fp16's precision."""
    data = batches("llama", steps * ACCUM * WORLD)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().to(torch.float32, copy=True) for _, p in trainable]
    for p in model.parameters():
        p.data = p.data.to(FP16)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    for step in range(steps):
        for mb in range(ACCUM):
            summed = None
            for rank in range(WORLD):
                loss = model(**data[_index(step, mb, rank)]).loss / (ACCUM * WORLD)
                scaler.scale(loss).backward()
                if step == INF_STEP and mb == 0 and rank == 1:
                    p = dict(trainable)[target]
                    p.grad = _poison(p.grad)
                grads = [p.grad for _, p in trainable]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
                for _, p in trainable:
                    p.grad = None
            with torch.no_grad():
                for m, g in zip(masters, summed):
                    if m.grad is None:
                        m.grad = g.to(torch.float32, copy=True)
                    else:
                        m.grad.add_(g)
        scaler.unscale_(opt)
        norm = _norm_as_the_ranks(((n, m.grad) for (n, _), m in zip(trainable, masters)), split)
        torch.nn.utils.clip_grads_with_norm_(masters, MAX_NORM, norm)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
        with torch.no_grad():
            for (_, p), m in zip(trainable, masters):
                p.copy_(m)
    master_of = {n: m for (n, _), m in zip(trainable, masters)}
    state = {
        n: master_of[n] if n in master_of else p.detach().float()
        for n, p in model.named_parameters()
    }
    return scales, state


def _rank_fp16(rank, world, out_dir):
    model, opt, layout = _wrap(_model("full"), compute_dtype=FP16)
    target = _inf_target(layout)
    data = batches("llama", STEPS * ACCUM * WORLD)
    scales, norms, states = [], [], []
    for step in range(STEPS):
        for mb in range(ACCUM):
            loss = model(**data[_index(step, mb, rank)]).loss / (ACCUM * WORLD)
            hook = None
            if step == INF_STEP and mb == 0 and rank == 1:
                hook = dict(model.named_parameters())[target].register_hook(_poison)
            opt.scale_loss(loss).backward()
            if hook is not None:
                hook.remove()
        norms.append(opt.clip_grad_norm_(MAX_NORM))
        opt.step()
        opt.zero_grad()
        scales.append(opt.scaler.get_scale())
        states.append(protrain.state_dict(model))
    protrain.close(model)
    torch.save(
        {
            "scales": scales,
            "norms": norms,
            "states": states,
            "target": target,
            "split": _split_params(layout),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.exactness
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    run_ranks(WORLD, _rank_fp16, str(tmp_path))
    results = _results(tmp_path)
    split = results[0]["split"]
    assert split  # the reference's clip norm is reduced as the ranks reduce it
    scales, state = _plain_fp16(_model("full"), STEPS, results[0]["target"], split)
    assert scales[INF_STEP] == scales[INF_STEP - 1] / 2  # the reference skipped it
    for r, res in enumerate(results):
        assert res["scales"] == scales, r
        # every rank clips by the same coefficient: the norms agree bit for bit
        assert [n.item() for n in res["norms"]] == [n.item() for n in results[0]["norms"]], r
        before, skipped = res["states"][INF_STEP - 1], res["states"][INF_STEP]
        for name, t in before.items():
            assert torch.equal(skipped[name], t), (r, name)
        # the same arithmetic in the same order: bit for bit on any CPU vector width
        _check_state(res["states"][-1], state, f"rank {r}", atol=0, rtol=0)


# ---- state dicts: save, load into a fresh engine, continue ---------------------------------

SAVED_AT = 2  # steps before the save; one more after it


def _rank_resume(rank, world, one_rank_file, out_dir):
    out = {}
    # uninterrupted, saving on the way
    model, opt, _ = _wrap(_model("full"))
    _train(model, opt, rank, SAVED_AT, clip=MAX_NORM)
    saved = (protrain.state_dict(model), opt.state_dict())
    _train(model, opt, rank, 1, clip=MAX_NORM, start=SAVED_AT)
    out["uninterrupted"] = protrain.state_dict(model)
    protrain.close(model)
    # a fresh engine (other initial weights) loads the save and continues
    model, opt, _ = _wrap(build("llama", seed=5))
    protrain.load_state_dict(model, saved[0])
    opt.load_state_dict(saved[1])
    out["reloaded"] = (protrain.state_dict(model), opt.state_dict())
    _train(model, opt, rank, 1, clip=MAX_NORM, start=SAVED_AT)
    out["resumed"] = protrain.state_dict(model)
    protrain.close(model)
    out["saved"] = saved
    # the save of a one-rank engine, loaded into two ranks' shards
    one = torch.load(one_rank_file, weights_only=False)
    model, opt, _ = _wrap(build("llama", seed=5))
    protrain.load_state_dict(model, one["model"])
    opt.load_state_dict(one["optim"])
    out["from_one_reloaded"] = (protrain.state_dict(model), opt.state_dict())
    _train(model, opt, rank, 1, clip=MAX_NORM, start=SAVED_AT)
    out["from_one"] = protrain.state_dict(model)
    protrain.close(model)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _same_optim_state(got, want, what):
    assert got["param_groups"] == want["param_groups"], what
    assert set(got["state"]) == set(want["state"]), what
    for pid, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["state"][pid][k], v, rtol=0, atol=0, msg=f"{what} {k}")


def test_state_dict_round_trip_and_world_size_change(tmp_path):
    # one rank, its own accumulation order, clipping on: SAVED_AT steps, then saved
    model, opt, _ = protrain.wrap(
        _model("full"), device="cpu", lr=LR, weight_decay=WD, chunk_size_bytes=CHUNK, n_persist=1
    )
    data = batches("llama", SAVED_AT * ACCUM * WORLD)
    for i in range(SAVED_AT * ACCUM * WORLD):
        (model(**data[i]).loss / (ACCUM * WORLD)).backward()
        if (i + 1) % (ACCUM * WORLD) == 0:
            opt.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad()
    one = {"model": protrain.state_dict(model), "optim": opt.state_dict()}
    protrain.close(model)
    torch.save(one, tmp_path / "one.pt")
    # plain PyTorch continuing from that save
    ref = build("llama", seed=5)
    ref.load_state_dict(one["model"])
    *_, ref_state, _ = _plain(ref, 1, clip=MAX_NORM, start=SAVED_AT, opt_state=one["optim"])

    run_ranks(WORLD, _rank_resume, str(tmp_path / "one.pt"), str(tmp_path))
    for r, res in enumerate(_results(tmp_path)):
        model_sd, optim_sd = res["saved"]
        for name, t in model_sd.items():
            assert torch.equal(res["reloaded"][0][name], t), (r, name)
        _same_optim_state(res["reloaded"][1], optim_sd, f"rank {r} reloaded")
        _check_state(res["resumed"], res["uninterrupted"], f"rank {r} resumed", atol=0)
        for name, t in one["model"].items():
            assert torch.equal(res["from_one_reloaded"][0][name], t), (r, name)
        _same_optim_state(res["from_one_reloaded"][1], one["optim"], f"rank {r} from one")
        _check_state(res["from_one"], ref_state, f"rank {r} from one rank")


# ---- a parameter without a gradient; the inf-norm ---------------------------------------


def _rank_unused(rank, world, out_dir):
    out = {}
    for armed in (False, True):
        model, opt, layout = _wrap(_model("unused"))
        # the unused Linear shares an offloaded chunk with parameters that do get gradients
        (spec,) = [c for c in layout.chunks if any("unused" in pl.names[0] for pl in c.placements)]
        assert not spec.persistent and any("norm" in pl.names[0] for pl in spec.placements)
        clip = None if armed else MAX_NORM
        losses, norms = _train(model, opt, rank, STEPS, armed=armed, clip=clip, norm_type=math.inf)
        out[armed] = (losses, norms, protrain.state_dict(model))
        protrain.close(model)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_parameter_without_gradient_and_inf_norm(tmp_path):
    """The unused Linear's chunk is reduced by the end-of-backward flush; the inf-norm is
    the largest over ranks (clipping with it, and ``grad_norm(inf)`` after an armed
    backward)."""
    run_ranks(WORLD, _rank_unused, str(tmp_path))
    results = _results(tmp_path)
    for armed in (False, True):
        clip = None if armed else MAX_NORM
        losses, norms, state, _ = _plain(_model("unused"), STEPS, clip=clip, norm_type=math.inf)
        for r, res in enumerate(results):
            got_losses, got_norms, got_state = res[armed]
            for i, loss in got_losses.items():
                assert loss == pytest.approx(losses[i], rel=1e-6, abs=1e-7), (r, armed, i)
            assert got_norms == pytest.approx(norms, rel=1e-6), (r, armed)
            _check_state(got_state, state, f"rank {r} armed={armed}")


# ---- LoRA: a subset of names, close; QLoRA: frozen bytes and trainable fp32 in one chunk ---


def _qlora() -> torch.nn.Module:
    from protrain.quant import quantize_linear_4bit

    model = build("llama")
    quantize_linear_4bit(model, compute_dtype=torch.float32)
    return lora(model, "llama")


def _rank_adapters(rank, world, kind, out_dir):
    model, opt, layout = _wrap(_qlora() if kind == "qlora" else _model("lora"))
    if kind == "qlora":  # packed bytes, fp32 scales and trainable adapters share a chunk
        mixed = [c for c in layout.chunks if not c.persistent
                 and {torch.uint8, torch.float32} <= {pl.dtype for pl in c.placements}
                 and any(pl.trainable for pl in c.placements)]  # fmt: skip
        assert mixed, layout
    losses, norms = _train(model, opt, rank, STEPS, clip=MAX_NORM)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    adapters = protrain.state_dict(model, names=names)
    protrain.close(model)
    closed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"losses": losses, "norms": norms, "adapters": adapters, "closed": closed}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_adapters_subset_state_dict_and_close(tmp_path, kind):
    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
    base = _qlora() if kind == "qlora" else _model("lora")
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    losses, norms, state, _ = _plain(copy.deepcopy(base), STEPS, clip=MAX_NORM)
    run_ranks(WORLD, _rank_adapters, kind, str(tmp_path))
    for r, res in enumerate(_results(tmp_path)):
        for i, loss in res["losses"].items():
            assert loss == pytest.approx(losses[i], rel=1e-6, abs=1e-7), (r, i)
        assert res["norms"] == pytest.approx(norms, rel=1e-6), r
        assert set(res["adapters"]) == trainable, r
        _check_state(res["adapters"], {n: state[n] for n in trainable}, f"rank {r} adapters")
        _check_state(res["closed"], state, f"rank {r} closed")


# ---- a module only some ranks' batches use (replicated mode) ------------------------------


def _used_on_rank0_only(model, use: list[bool]) -> None:
    """The unused Linear joins the forward while ``use[0]``: rank 0's batches, not rank 1's
    (as a batch without images skips a vision tower)."""

    def hook(mod, args, out):
        return out + 0.1 * model.model.unused(out) if use[0] else out

    model.model.norm.register_forward_hook(hook)


def _rank_partial(rank, world, out_dir):
    model = _model("unused")
    _used_on_rank0_only(model, [rank == 0])
    model, opt, _ = _wrap(model, "replicated")
    losses, norms = _train(model, opt, rank, STEPS, clip=MAX_NORM)
    out = {"losses": losses, "norms": norms, "state": protrain.state_dict(model)}
    protrain.close(model)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_module_used_by_one_rank_replicated(tmp_path):
    """Buckets are reduced in one order on every rank, the incomplete ones at the end of
    backward: the same collectives on both ranks, and the gradients of the Linear summed
    from rank 0's alone."""
    run_ranks(WORLD, _rank_partial, str(tmp_path))
    ref = _model("unused")
    use = [False]
    _used_on_rank0_only(ref, use)
    data = batches("llama", STEPS * ACCUM * WORLD)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    norms = []
    for step in range(STEPS):
        total = None
        for mb in range(ACCUM):
            summed = None
            for rank in range(WORLD):
                use[0] = rank == 0
                (ref(**data[_index(step, mb, rank)]).loss / (ACCUM * WORLD)).backward()
                grads = [p.grad for p in params]
                summed = grads if summed is None else [_add(a, b) for a, b in zip(summed, grads)]
                opt.zero_grad()
            total = summed if total is None else [_add(a, b) for a, b in zip(total, summed)]
        for p, g in zip(params, total):
            p.grad = g
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    for r, res in enumerate(_results(tmp_path)):
        assert res["norms"] == pytest.approx(norms, rel=1e-6), r
        _check_state(res["state"], ref.state_dict(), f"rank {r}")
