"""Checkpoints resumed on another number of GPUs, as a user runs them: `protrain train`
under `torchrun`, a chain of segments that each train a few steps, save, and hand over to
the next segment on another number of ranks (``4,2,1``: four ranks, then two, then one).

Against one process trained straight through (plain PyTorch, the plain checkpoint format)
each chain reports its losses' largest relative difference, its final weights' largest
absolute difference, and per segment the seconds of the whole launch and the bytes of the
checkpoint it wrote. fp32 throughout (``mixed_precision: "no"``), so that the only
differences are the order of the ranks' sums. Several ranks run ProTrain's chunk engine in
the given mode with one persistent chunk and the rest offloaded (the host AdamW path).

The model is a random Llama of the given size, saved once under ``--work`` with the
quickstart's tokenizer; the data is the quickstart's chat set. One JSON line per chain.

Usage: ``python benchmarks/resume_ranks.py --chains 4,2,1 2,4 --out rows.jsonl``

``--save-on N --resume-on M ...``: instead of chains, one large model's save and resumes,
as on GPUs (``--device cuda``): a model of a shape of ``workloads.py`` (``--shape llama8b``,
random weights, bf16, ``--layers-override`` fewer where the disk is short) trains ``--steps`` on N
ranks under ``--gpu-budget`` (the planner's knobs, the given ``--mode``) and saves; each M
resumes that checkpoint and trains one step more, without saving (each resume's export
is removed before the next). Every launch runs under ``checkpoint_probe.py``, which times
each save, load and export of every rank and records its peak resident memory. One JSON
line: per segment its seconds, losses and probe rows, and the checkpoint's bytes.

``python benchmarks/resume_ranks.py --shape llama8b --device cuda --gpu-budget 24GiB
--save-on 2 --resume-on 2 1 --window 2 --out rows.jsonl`` (on the CPU: ``--shape quickstart
--hidden 256 --layers 2 --device cpu --seq 64``). Split over calls of limited length:
``--resume-on 2`` in one, ``--skip-save --resume-on 1`` in the next (the checkpoint under
``--work`` is kept between calls)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chains", nargs="+", default=["4,2,1", "2,4"], help="world sizes in turn")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per segment")
    p.add_argument("--window", type=int, default=4, help="micro-batches per step, all ranks")
    p.add_argument("--mode", choices=["sharded", "replicated"], default="sharded")
    p.add_argument("--chunk-size", default="64MiB")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--work", type=Path, default=Path("/tmp/resume_ranks"))
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default=os.environ.get("PROTRAIN_COMMIT", "unknown"))
    p.add_argument("--save-on", type=int, help="save-and-resume: ranks of the saving run")
    p.add_argument(
        "--resume-on", type=int, nargs="*", default=[2, 1], help="none: save only (to split calls)"
    )
    p.add_argument(
        "--skip-save",
        action="store_true",
        help="resume the checkpoint an earlier --save-on call left under --work (to split "
        "the work over several calls)",
    )
    p.add_argument(
        "--shape",
        default="llama8b",
        help="a MODEL_SHAPES key of workloads.py, or quickstart (a Llama of --hidden and --layers "
        "over the quickstart tokenizer's vocabulary, for the CPU)",
    )
    p.add_argument("--layers-override", type=int, help="fewer decoder layers than the shape")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--gpu-budget", default="24GiB")
    p.add_argument("--seq", type=int, default=512)
    return p.parse_args(argv)


def build_model_dir(work: Path, hidden: int, layers: int) -> tuple[Path, int]:
    """A random Llama saved with save_pretrained (fp32) and the quickstart tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from protrain.train.modeling import TINY_MODEL_CONFIG, TINY_TOKENIZER_DIR

    path = work / f"llama-{hidden}x{layers}"
    base = json.loads(TINY_MODEL_CONFIG.read_text())
    base.update(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
    )
    config = LlamaConfig(**{k: v for k, v in base.items() if k != "architectures"})
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(path)
        for f in TINY_TOKENIZER_DIR.iterdir():
            shutil.copy(f, path / f.name)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
    return path, n_params


def write_config(run: Path, model_dir: Path, world: int, end: int, args) -> Path:
    import yaml

    from protrain.train.config import QUICKSTART_DIR

    cfg = {
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "datasets": [{"path": str(QUICKSTART_DIR / "data" / "chat.jsonl"), "type": "chat"}],
        "sequence_len": 64,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": args.window // world,
        "max_steps": end,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "mixed_precision": "no",
        "logging_steps": 1,
        "save_steps": end,
        "save_total_limit": 1,
        "output_dir": str(run),
        "seed": 7,
    }
    if world > 1:
        cfg["memory"] = {"n_persist": 1, "mode": args.mode, "chunk_size": args.chunk_size}
    path = run.with_name(f"{run.name}-{end}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(world: int, config: Path, resume: bool, log: Path) -> float:
    """One segment: `protrain train` on `world` ranks (GPUs 0..world-1); its seconds."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(world))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "protrain", "train", str(config)]  # fmt: skip
    if resume:
        cmd.append("--resume")
    t0 = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{world} ranks, {config.name}: exit {done.returncode}\n{tail}")
    return round(seconds, 1)


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def append_row(path: Path, row: dict) -> None:
    """One JSON line appended to `path` (its folder made), and printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def weights_diff(run: Path, ref: Path) -> float:
    from safetensors.torch import load_file

    got = load_file(run / "final" / "model.safetensors")
    want = load_file(ref / "final" / "model.safetensors")
    if set(got) != set(want):
        raise RuntimeError(f"final weights name other tensors: {sorted(set(got) ^ set(want))}")
    return max(float((got[k].float() - w.float()).abs().max()) for k, w in want.items())


def build_shape_dir(work: Path, shape: str, layers: int | None, device: str) -> tuple[Path, int]:
    """A model of ``workloads.MODEL_SHAPES[shape]`` with cheap random weights
    (``materialize.py``, filled on ``device``), saved in bf16 with the quickstart tokenizer."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from materialize import build_on_meta, materialize, saved_param_count
    from protrain.train.modeling import TINY_TOKENIZER_DIR
    from workloads import hf_config

    config = hf_config(shape)
    if layers is not None:
        config.num_hidden_layers = layers
    path = work / f"{shape}-{config.num_hidden_layers}l"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = materialize(build_on_meta(config, torch.bfloat16), "cpu", device)
        partial = path.with_name(path.name + ".partial")  # a save cut short is not reused
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        for f in TINY_TOKENIZER_DIR.iterdir():
            shutil.copy(f, partial / f.name)
        partial.rename(path)
        del model
    return path, saved_param_count(path)


def probe_launch(world: int, config: Path, resume: bool, log: Path, probe: Path, device: str):
    """`launch` under checkpoint_probe.py; its seconds and the probe's rows. A resume saves
    nothing here: the loop's room check for another checkpoint is skipped."""
    env = dict(os.environ, CHECKPOINT_PROBE_DIR=str(probe))
    if resume:
        env["CHECKPOINT_PROBE_NO_ROOM_CHECK"] = "1"
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(world)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(REPO / "benchmarks" / "checkpoint_probe.py"),
           "train", str(config)] + (["--resume"] if resume else [])  # fmt: skip
    shutil.rmtree(probe, ignore_errors=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = round(time.perf_counter() - t0, 1)
    if done.returncode != 0:
        raise RuntimeError(f"{world} ranks, {config.name}: exit {done.returncode}\n"
                           f"{log.read_text()[-2000:]}")  # fmt: skip
    rows = [json.loads(line) for p in sorted(probe.glob("rank*.jsonl"))
            for line in p.read_text().splitlines()]  # fmt: skip
    return seconds, rows


def save_and_resume(args) -> int:
    """``--save-on N --resume-on M ...`` (see the module's docstring)."""
    import yaml

    from protrain.train.config import QUICKSTART_DIR

    args.work.mkdir(parents=True, exist_ok=True)
    if args.shape == "quickstart":  # the quickstart tokenizer's vocabulary: --hidden, --layers
        model_dir, n_params = build_model_dir(args.work, args.hidden, args.layers)
    else:
        model_dir, n_params = build_shape_dir(
            args.work, args.shape, args.layers_override, args.device
        )
    # bf16 model + the checkpoint (fp32 master, two AdamW moments) + one bf16 export; a
    # resume of a checkpoint already there needs room for the export only
    need = n_params * 2 if args.skip_save else n_params * (2 + 12 + 2)
    free = shutil.disk_usage(args.work).free + (0 if args.skip_save else dir_bytes(model_dir))
    if need > free:
        raise SystemExit(
            f"{args.shape}: {n_params / 1e9:.2f} B parameters need about {need / 2**30:.0f} GiB "
            f"under {args.work} (model, checkpoint, export); {free / 2**30:.0f} GiB there: pass "
            "--layers-override with fewer layers"
        )
    window = args.window
    run = args.work / f"save-{args.save_on}"
    if not args.skip_save:
        shutil.rmtree(run, ignore_errors=True)

    def config(world: int, end: int, save: bool) -> Path:
        cfg = {
            "model": {
                "name_or_path": str(model_dir),
                "dtype": "bfloat16" if args.device == "cuda" else "float32",
            },
            "mixed_precision": "bf16" if args.device == "cuda" else "no",
            "datasets": [{"path": str(QUICKSTART_DIR / "data" / "chat.jsonl"), "type": "chat"}],
            "sequence_len": args.seq,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": window // world,
            "max_steps": end,
            "learning_rate": 1e-5,
            "lr_scheduler": "constant",
            "warmup_steps": 0,
            "max_grad_norm": 1.0,
            "logging_steps": 1,
            "output_dir": str(run),
            "seed": 7,
            "device": args.device,
            "memory": {"auto": True, "gpu_budget": args.gpu_budget, "mode": args.mode},
        }
        if save:
            cfg["save_steps"] = end
        path = run.with_name(f"{run.name}-{world}-{end}.yaml")
        path.write_text(yaml.safe_dump(cfg))
        return path

    row: dict = {"bench": "resume_ranks_save", "shape": args.shape, "params": n_params,
                 "layers": args.layers_override, "device": args.device, "mode": args.mode,
                 "gpu_budget": args.gpu_budget, "seq": args.seq, "window": window,
                 "commit": args.commit,
                 "date": f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}"}  # fmt: skip
    status = 0
    try:
        end = args.steps
        row["segments"] = []
        if not args.skip_save:
            seconds, probe = probe_launch(args.save_on, config(args.save_on, end, True), False,
                                          run.with_name(f"{run.name}.log"), args.work / "probe",
                                          args.device)  # fmt: skip
            row["segments"].append({"world_size": args.save_on, "seconds": seconds,
                                    "losses": losses(run), "probe": probe})  # fmt: skip
        row["checkpoint_bytes"] = dir_bytes(run / f"checkpoint-{end}")
        saved = losses(run)[:end]
        for world in args.resume_on:
            shutil.rmtree(run / "final", ignore_errors=True)
            seconds, probe = probe_launch(world, config(world, end + 1, False), True,
                                          run.with_name(f"{run.name}-resume{world}.log"),
                                          args.work / "probe", args.device)  # fmt: skip
            got = losses(run)
            row["segments"].append({"world_size": world, "seconds": seconds,
                                    "losses": got, "probe": probe,
                                    "continues": got[:len(saved)] == saved
                                    and len(got) == len(saved) + 1
                                    and math.isfinite(got[-1])})  # fmt: skip
        row["status"] = (
            "ok" if all(s.get("continues", True) for s in row["segments"]) else "differs"
        )
    except Exception as e:
        row.update(status="error", error=str(e)[-1500:])
    if row["status"] != "ok":
        status = 1
    append_row(args.out, row)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.save_on is not None:
        return save_and_resume(args)
    chains = [[int(w) for w in c.split(",")] for c in args.chains]
    for chain in chains:
        bad = [w for w in chain if args.window % w]
        if bad:
            raise SystemExit(f"--window {args.window} is not a multiple of world sizes {bad}")
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, n_params = build_model_dir(args.work, args.hidden, args.layers)
    # one process straight through for every chain length
    refs: dict[int, tuple[Path, float]] = {}
    for total in sorted({args.steps * len(c) for c in chains}):
        ref = args.work / f"straight-{total}"
        shutil.rmtree(ref, ignore_errors=True)
        config = write_config(ref, model_dir, 1, total, args)
        refs[total] = ref, launch(1, config, False, ref.with_suffix(".log"))
    now = datetime.now(timezone.utc)
    status = 0
    for chain in chains:
        name = "-".join(map(str, chain))
        run = args.work / f"chain-{name}"
        shutil.rmtree(run, ignore_errors=True)
        total = args.steps * len(chain)
        ref, ref_s = refs[total]
        want = losses(ref)
        row: dict = {
            "bench": "resume_ranks",
            "chain": chain,
            "mode": args.mode,
            "params": n_params,
            "steps_per_segment": args.steps,
            "window": args.window,
            "straight_s": ref_s,
            "commit": args.commit,
            "date": f"{now:%Y-%m-%dT%H:%M:%SZ}",
        }
        try:
            segments = []
            for i, world in enumerate(chain):
                end = args.steps * (i + 1)
                config = write_config(run, model_dir, world, end, args)
                seconds = launch(world, config, i > 0, run.with_name(f"{run.name}-{end}.log"))
                ckpt = run / f"checkpoint-{end}"
                manifest = json.loads((ckpt / "manifest.json").read_text())
                segments.append(
                    {
                        "world_size": world,
                        "seconds": seconds,
                        "checkpoint_bytes": dir_bytes(ckpt),
                        "format": manifest.get("format", "plain"),
                    }
                )
            got = losses(run)
            rel = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))
            row.update(
                segments=segments,
                steps=len(got),
                loss_max_rel_diff=rel,
                weights_max_abs_diff=weights_diff(run, ref),
                status="ok" if rel <= args.tol and len(got) == len(want) == total else "differs",
            )
        except Exception as e:  # one row per chain, with its error
            row.update(status="error", error=str(e)[-1500:])
        if row["status"] != "ok":
            status = 1
        append_row(args.out, row)
    return status


if __name__ == "__main__":
    sys.exit(main())
