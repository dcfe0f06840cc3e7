"""The sharded checkpoint format on one process: `protrain convert-checkpoint` both ways
(a resume from the converted checkpoint ends on the uninterrupted run's bits), and what a
damaged or foreign sharded checkpoint gives: one error naming the file. Several ranks are
in tests/multirank/test_checkpoint_*.py."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import protrain.train.checkpoint as ckpt
from protrain.cli import main
from protrain.distributed.dcp_flat import CheckpointMismatch, read_metadata
from protrain.train.checkpoint.convert import convert_checkpoint
from protrain.train.config import validate_config
from protrain.train.errors import OutputDirError
from protrain.train.loop import train
from protrain.train.run_lock import RunLock

from .helpers import tiny_config

STEPS = dict(max_steps=4, save_steps=2, micro_batch_size=2, sequence_len=32)


def _cfg(tmp_path: Path, run: str, **kw):
    return validate_config(tiny_config(tmp_path, output_dir=str(tmp_path / run), **STEPS, **kw))


def _final(run: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run / "final" / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight 4-step run (plain format, checkpoints at 2 and 4), its checkpoint-2
    converted to sharded (also kept untouched in `pristine/`) and that one back to plain."""
    tmp = tmp_path_factory.mktemp("convert")
    train(_cfg(tmp, "straight"))
    sharded = convert_checkpoint(tmp / "straight" / "checkpoint-2", tmp / "sharded")
    shutil.copytree(sharded, tmp / "pristine" / sharded.name)
    assert main(["convert-checkpoint", str(sharded), str(tmp / "plain")]) == 0
    return tmp


def test_convert_both_ways_and_resume_bitwise(runs):
    sharded, plain = runs / "sharded" / "checkpoint-2", runs / "plain" / "checkpoint-2"
    assert ckpt.checkpoint_format(sharded) == ckpt.SHARDED and ckpt.verify(sharded) is None
    assert ckpt.checkpoint_format(plain) == ckpt.PLAIN and ckpt.verify(plain) is None
    # the round trip gives the very same tensors back
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(runs / "straight" / "checkpoint-2" / name), load_file(plain / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    want = _final(runs / "straight")
    for run in ("sharded", "plain"):
        train(_cfg(runs, run), resume=True)  # one process of plain PyTorch, either format
        got = _final(runs / run)
        assert all(torch.equal(got[k], want[k]) for k in want), run


def test_convert_refuses_what_it_cannot_do(runs, tmp_path, capsys):
    with pytest.raises(OutputDirError, match="already exists"):
        convert_checkpoint(runs / "straight" / "checkpoint-2", runs / "sharded")
    with pytest.raises(OutputDirError, match="is not a checkpoint-<step> folder"):
        convert_checkpoint(runs / "straight", tmp_path)
    inside = runs / "straight" / "checkpoint-2" / "converted"  # rotation would delete it
    with pytest.raises(OutputDirError, match="is inside the checkpoint .* it converts"):
        convert_checkpoint(runs / "straight" / "checkpoint-2", inside)
    assert not inside.exists()
    live = tmp_path / "live"
    in_use = pytest.raises(OutputDirError, match="convert-checkpoint: output_dir .* is in use")
    with RunLock(live), in_use:  # a run trains there: it would prune what the conversion writes
        convert_checkpoint(runs / "straight" / "checkpoint-2", live)
    assert not (live / "checkpoint-2").exists()
    damaged = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "pristine" / "checkpoint-2", damaged)
    data = damaged / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-8])
    assert main(["convert-checkpoint", str(damaged), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: convert-checkpoint:") and "__0_0.distcp has" in err
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_convert_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    missing = tmp_path / "run" / "checkpoint-40"
    assert main(["convert-checkpoint", str(missing), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"error: convert-checkpoint: {str(missing)!r} does not exist\n"
    )
    assert not (tmp_path / "out").exists()


def _resume_dir(tmp_path: Path, runs: Path) -> Path:
    """A run folder whose newest checkpoint is the sharded checkpoint-2, and an older intact
    one to fall back to (a plain copy named checkpoint-1)."""
    run = tmp_path / "run"
    shutil.copytree(runs / "pristine", run)
    shutil.copytree(runs / "straight" / "checkpoint-2", run / "checkpoint-1")
    return run


@pytest.mark.parametrize(
    "damage,problem",
    [
        (lambda c: (c / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
        (lambda c: _truncate(c / "__0_0.distcp"), "__0_0.distcp has"),
        (lambda c: _truncate(c / ".metadata"), ".metadata has"),
    ],
    ids=["missing-rank-file", "truncated-shard", "truncated-metadata"],
)
def test_a_damaged_sharded_checkpoint_is_named_and_the_one_before_resumes(
    runs, tmp_path, damage, problem
):
    run = _resume_dir(tmp_path, runs)
    damage(run / "checkpoint-2")
    assert problem in ckpt.verify(run / "checkpoint-2")
    assert ckpt.find_resume_checkpoint(run) == run / "checkpoint-1"
    assert (run / ".damaged-checkpoint-2").is_dir()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_checkpoint_of_another_model_is_one_error_naming_state_json(runs, tmp_path):
    run = tmp_path / "lora"
    shutil.copytree(runs / "pristine", run)
    cfg = _cfg(tmp_path, "lora", adapter={"type": "lora", "r": 4, "dropout": 0.0})
    with pytest.raises(OutputDirError, match=r"state\.json is a checkpoint of another model"):
        train(cfg, resume=True)


class _Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


def test_metadata_that_names_other_globals_is_refused_unread(runs, tmp_path):
    c = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "pristine" / "checkpoint-2", c)
    md = read_metadata(c)
    md.planner_data = _Boom()
    (c / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointMismatch, match=r"builtins\.exec is not allowed"):
        read_metadata(c)


def test_a_global_batch_change_is_one_error_naming_both(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "pristine", run)
    cfg = _cfg(tmp_path, "run", gradient_accumulation_steps=4)
    with pytest.raises(OutputDirError) as err:
        train(cfg, resume=True)
    message = str(err.value)
    assert "global batch of 2 x 2 x 1 = 4 rows" in message and "2 x 4 x 1 = 8" in message
    assert "gradient_accumulation_steps: 2" in message
    saved = json.loads((run / "checkpoint-2" / "state.json").read_text())
    assert saved["trainer"]["data_order"]["world_size"] == 1


def test_a_micro_batch_change_says_how_the_global_batch_may_change(runs, tmp_path):
    """micro_batch_size orders the rows, so even --new-global-batch refuses it; the one
    error says what --new-global-batch does allow."""
    run = tmp_path / "run"
    shutil.copytree(runs / "pristine", run)
    cfg = validate_config(
        tiny_config(tmp_path, output_dir=str(run), **{**STEPS, "micro_batch_size": 4})
    )
    with pytest.raises(OutputDirError) as err:
        train(cfg, resume=True, new_global_batch=True)
    message = str(err.value)
    assert "micro_batch_size: 2 -> 4" in message
    assert "keep micro_batch_size and change gradient_accumulation_steps" in message


def test_a_global_batch_change_continues_when_asked(runs, tmp_path):
    """`--new-global-batch`: the data goes on from the checkpoint's position, 4 micro-batches
    a step instead of 2, to max_steps; with num_epochs the steps left are recomputed."""
    run = tmp_path / "run"
    shutil.copytree(runs / "pristine", run)
    saved = _trainer_state(run / "checkpoint-2")
    start = saved["position"]
    train(_cfg(tmp_path, "run", gradient_accumulation_steps=4), resume=True, new_global_batch=True)
    end = _trainer_state(run / "checkpoint-4")["position"]
    per_epoch = -(-saved["data_order"]["rows"] // 2)  # micro-batches of 2 rows an epoch
    moved = (end["epoch"] - start["epoch"]) * per_epoch + end["micro_batch"] - start["micro_batch"]
    assert moved == 2 * 4  # two steps of four micro-batches

    epochs = tmp_path / "epochs"
    shutil.copytree(runs / "pristine", epochs)
    cfg = validate_config(
        tiny_config(
            tmp_path, output_dir=str(epochs), max_steps=None, num_epochs=1, save_steps=1000,
            micro_batch_size=2, sequence_len=32, gradient_accumulation_steps=100,
        )
    )  # fmt: skip
    result = train(cfg, resume=True, new_global_batch=True)
    # 2 steps of 2 micro-batches done; the epoch's other micro-batches in steps of 100
    assert result.steps == 2 + (per_epoch - 4) // 100


def _trainer_state(checkpoint: Path) -> dict:
    """The trainer state (data position and order) a checkpoint of either format records."""
    if ckpt.checkpoint_format(checkpoint) == ckpt.SHARDED:
        return json.loads((checkpoint / "state.json").read_text())["trainer"]
    return ckpt.load_checkpoint(checkpoint).trainer_state


def test_a_sharded_checkpoint_carries_the_optimizer_choice_and_format(runs, tmp_path):
    """The sharded format names the optimizer choice and the host moments' format, the round
    trip keeps them, and a resume under another choice or format is refused in one line
    before anything loads (it read torch's state into bitsandbytes' and failed a step later)."""
    meta = json.loads((runs / "pristine" / "checkpoint-2" / "state.json").read_text())
    assert meta["optimizer"]["optimizer"] == "adamw"  # no format marker: fp32
    back = json.loads((runs / "plain" / "checkpoint-2" / "state.json").read_text())["optimizer"]
    assert back["extra"]["optimizer"] == "adamw"
    for change, needle in (
        ({"memory": {"n_persist": 1}, "optimizer_state": "bf16"}, "optimizer_state='fp32'"),
        ({"memory": {"n_persist": 1}, "optimizer": "adamw_bnb_8bit"}, "optimizer='adamw'"),
    ):
        if "optimizer" in change and importlib.util.find_spec("bitsandbytes") is None:
            continue  # the config itself is refused without bitsandbytes
        run = tmp_path / str(len(needle))
        shutil.copytree(runs / "pristine", run)
        cfg = validate_config(tiny_config(tmp_path, output_dir=str(run), **STEPS, **change))
        with pytest.raises(OutputDirError, match=rf"its optimizer state was saved with {needle}"):
            train(cfg, resume=True)


@pytest.mark.usefixtures("one_pass_kernel")
def test_convert_compact_moments_both_ways_and_resume_bitwise(tmp_path):
    """8-bit host moments (the chunked engine on the CPU): the sharded format holds them
    decoded to fp32 and records the format; a resume from either conversion encodes them
    again over the same elements, so it ends on the uninterrupted run's bits, and a run of
    another optimizer_state refuses the sharded checkpoint."""
    memory = {"n_persist": 0, "chunk_size": "256KiB"}

    def cfg(run, fmt="8bit"):
        return _cfg(tmp_path, run, optimizer_state=fmt, memory=memory)

    train(cfg("straight"))
    sharded = convert_checkpoint(tmp_path / "straight" / "checkpoint-2", tmp_path / "sharded")
    shutil.copytree(sharded, tmp_path / "other" / sharded.name)
    convert_checkpoint(sharded, tmp_path / "plain")
    want = _final(tmp_path / "straight")
    for run in ("sharded", "plain"):
        train(cfg(run), resume=True)
        got = _final(tmp_path / run)
        assert all(torch.equal(got[k], want[k]) for k in want), run
    with pytest.raises(OutputDirError, match="saved with optimizer_state='8bit', this run's"):
        train(cfg("other", "fp32"), resume=True)
