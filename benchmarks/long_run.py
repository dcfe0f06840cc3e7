"""A long LoRA run under auto mode, killed and resumed, against the same run uninterrupted.

`protrain train` as a user runs it: a random Llama saved under ``--work`` with the
quickstart's tokenizer and chat data, LoRA on every linear layer, ``memory.auto`` at
``--gpu-budget``, a checkpoint every ``--save-steps`` steps. Three runs:

- ``straight``: uninterrupted, ``--steps`` steps;
- ``again``: the same, a second time: the run-to-run floor of this device's kernels;
- ``killed``: killed with SIGKILL once each checkpoint named in ``--kill-after`` is complete
  (after a random delay of up to ``--kill-delay`` seconds, so the kill may land in a step or
  in the next save), then resumed with ``--resume``, until it ends.

One JSON line: the final adapter's largest absolute difference from ``straight`` for
``again`` and for ``killed``, the losses' largest relative difference by step, the number of
kills that landed, and each launch's seconds. ``killed`` passes when its differences are no
larger than ``again``'s (bitwise when the device is deterministic: the CPU is).

Usage: ``python benchmarks/long_run.py --steps 500 --save-steps 100 --kill-after 200 400``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resume_ranks import append_row, build_model_dir  # noqa: E402 (a sibling script, not a package)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--kill-after", type=int, nargs="+", default=[200, 400],
                   help="kill once this checkpoint is complete")  # fmt: skip
    p.add_argument("--kill-delay", type=float, default=2.0, help="random delay, seconds")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--gpu-budget", default="6GiB")
    p.add_argument("--device", default="auto", help="the config's device: auto, cpu, cuda")
    p.add_argument("--work", type=Path, default=Path("/tmp/long_run"))
    p.add_argument("--seed", type=int, default=0, help="the kill delays' seed")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", default=os.environ.get("PROTRAIN_COMMIT", "unknown"))
    return p.parse_args(argv)


def write_config(run: Path, model_dir: Path, args: argparse.Namespace) -> Path:
    import yaml

    from protrain.train.config import QUICKSTART_DIR

    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "adapter": {"type": "lora", "r": 16, "alpha": 32, "target_modules": "all-linear"},
        "datasets": [{"path": str(QUICKSTART_DIR / "data" / "chat.jsonl"), "type": "chat"}],
        "sequence_len": args.seq,
        "micro_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "max_steps": args.steps,
        "learning_rate": 2e-4,
        "lr_scheduler": "cosine",
        "warmup_steps": 10,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_steps": args.save_steps,
        "save_total_limit": 2,
        "output_dir": str(run),
        "seed": 7,
        "device": args.device,
        "memory": {"auto": True, "gpu_budget": args.gpu_budget},
    }
    path = run.with_name(f"{run.name}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def complete(run: Path, step: int) -> bool:
    """A checkpoint counts once its manifest is in place (it is renamed into place whole)."""
    return (run / f"checkpoint-{step}" / "manifest.json").exists()


def newest(run: Path) -> int:
    """The newest complete checkpoint's step, 0 if none."""
    steps = [
        int(p.name.split("-")[1])
        for p in run.glob("checkpoint-*")
        if complete(run, int(p.name.split("-")[1]))
    ]
    return max(steps, default=0)


def launch(config: Path, resume: bool, log: Path, kill_at: int | None, delay: float) -> dict:
    """One launch of `protrain train`; with `kill_at`, SIGKILL once that checkpoint is complete."""
    cmd = [sys.executable, "-m", "protrain", "train", str(config)]
    if resume:
        cmd.append("--resume")
    run = config.with_suffix("")  # write_config names it <run>.yaml
    t0 = time.perf_counter()
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        killed = False
        while proc.poll() is None:
            if kill_at is not None and complete(run, kill_at):
                time.sleep(delay)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                proc.wait()
                break
            time.sleep(0.05)
    seconds = round(time.perf_counter() - t0, 1)
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"{config.name}: exit {proc.returncode}\n{log.read_text()[-2000:]}")
    return {"seconds": seconds, "killed": killed, "resume": resume}


def losses(run: Path) -> dict[int, float]:
    """Loss by step; a step re-done after a kill keeps its last value."""
    out: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def adapter_diff(run: Path, ref: Path) -> float:
    from safetensors.torch import load_file

    got = load_file(run / "final" / "adapter_model.safetensors")
    want = load_file(ref / "final" / "adapter_model.safetensors")
    if set(got) != set(want):
        raise RuntimeError(f"final adapters name other tensors: {sorted(set(got) ^ set(want))}")
    return max(float((got[k].float() - w.float()).abs().max()) for k, w in want.items())


def loss_diff(run: Path, ref: Path) -> float:
    got, want = losses(run), losses(ref)
    if set(got) != set(want):
        raise RuntimeError(f"logged steps differ: {sorted(set(got) ^ set(want))[:10]}")
    return max(abs(got[s] - w) / max(abs(w), 1e-12) for s, w in want.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, n_params = build_model_dir(args.work, args.hidden, args.layers)
    launches: dict[str, list[dict]] = {}
    for name in ("straight", "again", "killed"):
        run = args.work / name
        shutil.rmtree(run, ignore_errors=True)
        config = write_config(run, model_dir, args)
        log = run.with_suffix(".log")
        log.unlink(missing_ok=True)
        kills = sorted(args.kill_after) if name == "killed" else []
        done: list[dict] = []
        while not done or done[-1]["killed"]:
            # the next kill: the first checkpoint this launch has yet to write
            kills = [k for k in kills if k > newest(run)]
            target = kills.pop(0) if kills else None
            done.append(launch(config, bool(done), log, target, rng.uniform(0, args.kill_delay)))
        launches[name] = done
    ref = args.work / "straight"
    again = args.work / "again"
    killed = args.work / "killed"
    row = {
        "bench": "long_run",
        "params": n_params,
        "steps": args.steps,
        "save_steps": args.save_steps,
        "kill_after": args.kill_after,
        "gpu_budget": args.gpu_budget,
        "seq": args.seq,
        "batch": args.batch,
        "world_size": 1,
        "checkpointing": "auto",
        "kills_landed": sum(d["killed"] for d in launches["killed"]),
        "launches": launches,
        "again_adapter_max_abs_diff": adapter_diff(again, ref),
        "again_loss_max_rel_diff": loss_diff(again, ref),
        "killed_adapter_max_abs_diff": adapter_diff(killed, ref),
        "killed_loss_max_rel_diff": loss_diff(killed, ref),
        "commit": args.commit,
        "date": f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
    }
    try:
        import torch

        if torch.cuda.is_available():
            row["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    ok = (
        row["killed_adapter_max_abs_diff"] <= row["again_adapter_max_abs_diff"]
        and row["killed_loss_max_rel_diff"] <= row["again_loss_max_rel_diff"]
    )
    row["status"] = "ok" if ok else "differs"
    append_row(args.out, row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
