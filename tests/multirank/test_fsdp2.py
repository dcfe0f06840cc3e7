"""The FSDP2 engine (`fsdp_version: 2`) through `protrain train` under torchrun: 2 gloo
ranks train as one process of plain PyTorch with twice the accumulation (losses and weights
to 1e-6), checkpoints are sharded and resume on 2 ranks of either engine and in one process, QLoRA with the tiled MLP and the
chunked loss exports its adapter; size-based units as FSDP1 chooses them; config errors.

The one-process reference is built here from the application's own pieces (tokenizer,
data, micro-batch stream, model with adapters, scheduler) and trained with
`torch.optim.AdamW` and `clip_grad_norm_`, adding each accumulation position's
micro-batches of both ranks first, as the engine does ([Note: gradients summed over ranks]
in `protrain.distributed.fsdp2.units`). `test_fsdp2_exact.py` covers the whole matrix of wrap
policies, activation checkpointing and adapters in one process pair.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tests.multirank.test_fsdp2_exact import one_thread
from tests.multirank.test_train_ranks import _losses, _torchrun
from tests.train.helpers import tiny_config, write_config
from torch import nn

from protrain.distributed.fsdp2 import size_based_units
from protrain.train.checkpoint.convert import convert_checkpoint
from protrain.train.config import load_config, validate_config
from protrain.train.errors import ConfigError

STEPS, ACCUM, WORLD = 3, 2, 2


def _config(tmp_path: Path, name: str, fsdp_config: dict, **extra) -> Path:
    cfg = tiny_config(
        tmp_path,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        max_grad_norm=1.0,
        save_steps=2,
        output_dir=str(tmp_path / name),
        fsdp_version=2,
        fsdp_config=fsdp_config,
        **extra,
    )
    return write_config(tmp_path, cfg, f"{name}.yaml")


@one_thread()  # as every rank under torchrun (OMP_NUM_THREADS=1)
def one_process_reference(config: Path, world: int = WORLD) -> tuple[list[float], dict]:
    """The losses per step and the trained parameters (by name) of plain PyTorch on one
    process, over the global batches `protrain train` on ``world`` ranks trains on."""
    from transformers import get_scheduler

    from protrain.train.data import build_collator, build_train_dataset
    from protrain.train.loss import count_trained_tokens, loss_sum
    from protrain.train.modeling import build_model, load_tokenizer
    from protrain.train.sampling import MicroBatchStream, StreamPosition
    from protrain.train.seeding import seed_everything
    from protrain.train.trainable import optimizer_param_groups

    cfg = load_config(config)
    seed_everything(cfg.seed)  # the loop's order: seed, data, then the model (LoRA init)
    tokenizer = load_tokenizer(cfg)
    data = build_train_dataset(cfg, tokenizer, sequence_len=cfg.sequence_len, seed=cfg.seed)
    collate = build_collator(tokenizer, sequence_len=cfg.sequence_len, packing=cfg.sample_packing)
    stream = MicroBatchStream(len(data), cfg.micro_batch_size, cfg.seed).iterate(StreamPosition())
    model = build_model(cfg, tokenizer).model.train()
    mem = cfg.memory
    if mem.tiled_mlp_tokens:
        from protrain.activations import apply_tiled_mlp

        apply_tiled_mlp(model, tile_tokens=mem.tiled_mlp_tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        optimizer_param_groups(model, cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=True,
    )
    scheduler = get_scheduler(
        cfg.lr_scheduler, opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=STEPS
    )
    cpu = torch.device("cpu")
    losses = []
    for _ in range(STEPS):
        window = [collate([data[i] for i in next(stream)[1]]) for _ in range(ACCUM * world)]
        n_trained = sum(count_trained_tokens(b["labels"]) for b in window)
        total, step_loss = None, 0.0
        for position in range(ACCUM):  # rank r trains window[position * world + r]
            summed = None
            for batch in window[position * world : (position + 1) * world]:
                loss = loss_sum(model, batch, cpu, mem.chunked_loss_tokens)
                step_loss += loss.item()
                (loss / n_trained).backward()
                grads = [p.grad for p in params]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
                opt.zero_grad(set_to_none=True)
            total = summed if total is None else [a + b for a, b in zip(total, summed)]
        for p, g in zip(params, total):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss / n_trained)
    return losses, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _run(n: int, config: Path, *extra: str) -> str:
    proc = _torchrun(n, config, *extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def _assert_close(got: dict, want: dict, rtol: float = 1e-6) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=rtol, atol=rtol, msg=name)


@pytest.mark.parametrize(
    "fsdp_config",
    [
        {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "activation_checkpointing": True},
        {"auto_wrap_policy": "SIZE_BASED_WRAP"},
    ],
    ids=["layers-ac", "size-default"],
)
def test_two_ranks_train_as_one_process(tmp_path, fsdp_config):
    config = _config(tmp_path, "fsdp", fsdp_config)
    out = _run(2, config)
    assert out.count(f"done: {STEPS} steps") == 1, "rank 0 alone reports"
    if fsdp_config["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":
        assert "TRANSFORMER_BASED_WRAP, 4 units + root (classes LlamaDecoderLayer)" in out
    else:
        assert "fsdp_config.min_num_params not set: 100000000" in out
    losses, weights = one_process_reference(config)
    run = tmp_path / "fsdp"
    assert _losses(run) == pytest.approx(losses, rel=1e-6)
    _assert_close(load_file(run / "final" / "model.safetensors"), weights)
    # every rank wrote its own shards; converted to the plain format, the last checkpoint
    # equals the export
    last = run / f"checkpoint-{STEPS}"
    assert json.loads((last / "manifest.json").read_text())["format"] == "sharded"
    assert json.loads((last / "state.json").read_text())["mode"] == "fsdp2"
    plain = convert_checkpoint(last, tmp_path / "plain")
    _assert_close(
        load_file(plain / "model.safetensors"),
        load_file(run / "final" / "model.safetensors"),
        rtol=0,
    )
    if fsdp_config.get("activation_checkpointing"):
        _resume_from_checkpoint_2(tmp_path, run, config, weights)


def _resume_from_checkpoint_2(tmp_path: Path, run: Path, config: Path, weights: dict) -> None:
    """The sharded checkpoint of step 2 resumes on both ranks of the FSDP2 engine, on two
    ranks of the chunked engine and in one process of plain PyTorch, each as the run that
    did not stop (the other engines to 1e-5: their sums over ranks run in another order)."""
    resumed = {}
    for name, world, change in [
        ("fsdp2", 2, {}),
        ("chunked", 2, {"fsdp_version": None, "fsdp_config": None,
                        "memory": {"n_persist": 1, "mode": "sharded", "chunk_size": "512KiB"}}),
        ("plain", 1, {"fsdp_version": None, "fsdp_config": None,
                      "gradient_accumulation_steps": ACCUM * WORLD}),
    ]:  # fmt: skip
        copy = tmp_path / f"resume-{name}"
        shutil.copytree(run, copy)
        for later in (copy / f"checkpoint-{STEPS}", copy / "final"):
            shutil.rmtree(later)
        cfg = {**yaml.safe_load(config.read_text()), "output_dir": str(copy), **change}
        cfg = {k: v for k, v in cfg.items() if v is not None}
        out = _run(world, write_config(tmp_path, cfg, f"resume-{name}.yaml"), "--resume")
        assert "checkpoint-2 at step 2" in out, out[-3000:]
        resumed[name] = load_file(copy / "final" / "model.safetensors")
    _assert_close(resumed["fsdp2"], weights)
    _assert_close(resumed["chunked"], weights, rtol=1e-5)
    _assert_close(resumed["plain"], weights, rtol=1e-5)


def test_chunked_checkpoint_resumes_in_fsdp2(tmp_path):
    """The other way: the chunked engine's sharded checkpoint of step 2 (two ranks) resumes
    on two ranks of the FSDP2 engine as the run that did not stop."""
    fsdp = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    config = _config(tmp_path, "chunked", fsdp)
    cfg = yaml.safe_load(config.read_text())
    chunked = {k: v for k, v in cfg.items() if k not in ("fsdp_version", "fsdp_config")}
    chunked["memory"] = {"n_persist": 1, "mode": "sharded", "chunk_size": "512KiB"}
    _run(2, write_config(tmp_path, chunked, "chunked-engine.yaml"))
    run = tmp_path / "chunked"
    assert json.loads((run / "checkpoint-2" / "state.json").read_text())["mode"] == "sharded"
    for later in (run / f"checkpoint-{STEPS}", run / "final"):
        shutil.rmtree(later)
    out = _run(2, config, "--resume")
    assert "checkpoint-2 at step 2" in out, out[-3000:]
    _, weights = one_process_reference(config)
    _assert_close(load_file(run / "final" / "model.safetensors"), weights, rtol=1e-5)


def test_qlora_tiled_chunked_two_ranks(tmp_path):
    """QLoRA (4-bit base quantized in the process, packed weights sharded) with the tiled
    MLP and the chunked loss, size-based units small enough that the head and the MLP's
    projections would be units of their own: the adapter equals one process's."""
    config = _config(
        tmp_path,
        "qlora",
        {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10_000},
        adapter={"type": "qlora", "r": 4, "alpha": 8},
        memory={"tiled_mlp_tokens": 16, "chunked_loss_tokens": 48},
    )
    out = _run(2, config)
    assert "4-bit layers, packed weights stored as torch.float32 and sharded" in out, out[-3000:]
    assert "tiled_mlp_tokens=16, chunked_loss_tokens=48" in out
    losses, weights = one_process_reference(config)
    run = tmp_path / "qlora"
    assert _losses(run) == pytest.approx(losses, rel=1e-6)
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    exported = {name.replace(".lora_A.", ".lora_A.default.").replace(
        ".lora_B.", ".lora_B.default."): w for name, w in adapter.items()}  # fmt: skip
    _assert_close(exported, weights)
    assert (run / "final" / "base_model" / "model.safetensors").is_file()


def test_one_process_group_is_freed_when_the_run_ends(tmp_path):
    """On one process the engine starts a group of one rank and ends it in `close`; the
    closed units (garbage in reference cycles) and DTensor's caches (their mesh) would keep
    it alive into interpreter exit ([Note: the meshes outlive the model] in
    `protrain.distributed.fsdp2.units`): `stop_ranks`, the end of `protrain train`, frees it."""
    import weakref

    import torch.distributed as dist
    from tests.engine.models import build

    from protrain.train.fsdp2_trainable import FSDP2Trainable
    from protrain.train.ranks import stop_ranks

    assert not dist.is_initialized()
    cfg = validate_config(
        tiny_config(tmp_path, fsdp_version=2, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP"})
    )
    trainable = FSDP2Trainable(build("llama"), cfg, torch.device("cpu"), None)
    group = weakref.ref(dist.group.WORLD)
    ids = torch.randint(1, 95, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = trainable.forward_loss_sum({"input_ids": ids, "labels": ids.clone()})
    trainable.backward(loss, last=True)
    trainable.clip_grad_norm(1.0)
    trainable.optimizer_step()  # DTensor operations: the caches hold the mesh from here
    assert trainable.model_state()
    trainable.close()
    del trainable, loss
    assert group() is not None  # held by the closed units, garbage until a collection
    stop_ranks()
    assert group() is None, "the group of one rank outlived the run"


# -- size-based units: FSDP1's decisions


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)  # 272
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16))  # 1088 + 1040


class _Model(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(100, 16)  # 1600
        self.layers = nn.ModuleList(_Block() for _ in range(3))  # 2400 each
        self.norm = nn.LayerNorm(16)  # 32
        self.head = nn.Linear(16, 100, bias=False)  # 1600
        if tied:
            self.head.weight = self.embed.weight


def _fsdp1_units(model: nn.Module, min_num_params: int) -> list[str]:
    """The modules FSDP1's auto wrap wraps under `size_based_auto_wrap_policy`."""
    from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

    names = {id(m): n for n, m in model.named_modules()}
    wrapped = []

    def record(module, **kwargs):
        wrapped.append(names[id(module)])
        return module

    _recursive_wrap(
        model,
        functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params),
        record,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    return wrapped


@pytest.mark.parametrize(
    "min_num_params, want",
    [
        (2000, ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]),
        (
            1000,
            ["embed"] + [f"layers.{i}.mlp.{j}" for i in range(3) for j in range(2)] + ["head"],
        ),
        (5000, []),  # a block is below it: everything stays with the root
        (int(1e8), []),  # the default
    ],
)
def test_size_based_units_are_fsdp1s(min_num_params, want):
    model = _Model()
    assert size_based_units(model, min_num_params) == want
    assert size_based_units(model, min_num_params) == _fsdp1_units(model, min_num_params)


def test_size_based_units_keep_tied_weights_together():
    units = size_based_units(_Model(tied=True), 1000)
    assert "embed" not in units and "head" not in units
    assert "layers.0.mlp.0" in units


# -- config errors


def _error(tmp_path: Path, **keys) -> str:
    cfg = tiny_config(tmp_path, **keys)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_config_errors(tmp_path):
    m = _error(tmp_path, fsdp_version=2, fsdp_config={"min_num_param": 10})
    assert "unknown key 'fsdp_config.min_num_param'" in m and "'min_num_params'" in m
    m = _error(tmp_path, fsdp_version=2, memory={"n_persist": 1, "n_buffer": 2})
    assert "memory.n_persist = 1, memory.n_buffer = 2 is not allowed" in m
    m = _error(tmp_path, fsdp_version=1)
    assert "fsdp_version = 1 is not allowed" in m
    m = _error(tmp_path, fsdp_version=2, fsdp_config={"state_dict_type": "LOCAL_STATE_DICT"})
    assert "'LOCAL_STATE_DICT' is not allowed: use FULL_STATE_DICT or SHARDED_STATE_DICT" in m
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):  # both of axolotl's values
        validate_config(
            tiny_config(tmp_path, fsdp_version=2, fsdp_config={"state_dict_type": kind})
        )
    m = _error(tmp_path, fsdp_config={"offload_params": True})
    assert "fsdp_config needs fsdp_version = 2" in m
    m = _error(
        tmp_path,
        fsdp_version=2,
        gradient_checkpointing=True,
        fsdp_config={"activation_checkpointing": True},
    )
    assert "use one" in m
    m = _error(tmp_path, fsdp_version=2, memory={"n_checkpoint": 2, "tiled_mlp_tokens": 8})
    assert "memory.n_checkpoint = 2 is not allowed" in m
    assert "only tiled_mlp_tokens and chunked_loss_tokens apply" in m
    m = _error(tmp_path, fsdp_version=2, adapter={"type": "qlora", "bits": 8})
    assert "adapter.bits = 8 with fsdp_version = 2" in m and "use adapter.bits = 4" in m


def test_memory_options_and_qlora_allowed(tmp_path):
    cfg = validate_config(
        tiny_config(
            tmp_path,
            fsdp_version=2,
            adapter="qlora",
            memory={"tiled_mlp_tokens": 512, "chunked_loss_tokens": 1024},
        )
    )
    assert cfg.memory.tiled_mlp_tokens == 512 and cfg.memory.chunked_loss_tokens == 1024


def test_axolotl_spellings(tmp_path):
    cfg = tiny_config(
        tmp_path,
        fsdp_version=2,
        fsdp_config={
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_offload_params": True,
        },
    )
    fsdp = validate_config(cfg).fsdp
    assert fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert fsdp.offload_params


def test_three_uneven_ranks_resume_on_two(tmp_path):
    """Three ranks shard dim 0 unevenly (vocabulary 512 and width 128 over 3): their
    checkpoint resumes on two FSDP2 ranks, the global batch kept (3 x 2 = 2 x 3 micro-batches),
    as one process trained straight through (1e-5: the sums over ranks run in another order)."""
    fsdp = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    base = {"lr_scheduler": "constant", "warmup_steps": 0}
    first = {**yaml.safe_load(_config(tmp_path, "chain", fsdp, **base).read_text()),
             "gradient_accumulation_steps": 2, "max_steps": 2}  # fmt: skip
    three = write_config(tmp_path, first, "three.yaml")
    _run(3, three)
    run = tmp_path / "chain"
    state = json.loads((run / "checkpoint-2" / "state.json").read_text())
    assert (state["mode"], state["world_size"]) == ("fsdp2", 3)
    cfg = {**yaml.safe_load(three.read_text()), "gradient_accumulation_steps": 3, "max_steps": 4}
    out = _run(2, write_config(tmp_path, cfg, "two.yaml"), "--resume")
    assert "checkpoint-2 at step 2" in out, out[-3000:]
    straight = {k: v for k, v in cfg.items() if k not in ("fsdp_version", "fsdp_config")}
    straight.update(gradient_accumulation_steps=6, output_dir=str(tmp_path / "straight"))
    _run(1, write_config(tmp_path, straight, "straight.yaml"))
    assert _losses(run) == pytest.approx(_losses(tmp_path / "straight"), rel=1e-5)
    _assert_close(
        load_file(run / "final" / "model.safetensors"),
        load_file(tmp_path / "straight" / "final" / "model.safetensors"),
        rtol=1e-5,
    )
