"""The end of a run keeps the model: a signal during the export lets it finish, a failed
export says what is kept, replacing `final` never leaves the folder without one, a new run
does not remove a save `--resume` would complete, and every damaged checkpoint is named."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import protrain.train.checkpoint as ckpt
import protrain.train.loop as loop
from protrain.train.checkpoint import final_dir
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError, OutputDirError

from .helpers import run_script, signal_inside, tiny_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"micro_batch_size": 2, "gradient_accumulation_steps": 1}


# A run of 4 steps whose export receives SIGTERM as it starts; save_minutes (the default)
# never checkpoints the last step, so before the fix nothing of the run was left.
_SIGNAL_IN_EXPORT = signal_inside("export", max_steps=4, **SMALL)


def test_a_signal_during_the_export_lets_it_finish(tmp_path):
    proc = run_script(_SIGNAL_IN_EXPORT, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    assert (run / "final" / "model.safetensors").is_file()
    assert not (run / "final.tmp").exists()
    assert "SIGTERM: finishing the export of the trained model first" in proc.stderr
    assert "SIGTERM came after the last step; the export finished" in proc.stderr


_SIGNAL_AFTER_LOOP = _SIGNAL_IN_EXPORT.replace(
    "loop.export = export",
    # the moment between the loop's end and the export: the metrics file's close
    "import protrain.train.metrics as metrics\n"
    "real_close = metrics.MetricsWriter.close\n"
    "def close(self, *args):\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return real_close(self, *args)\n"
    "metrics.MetricsWriter.close = close",
)


def test_a_signal_between_the_loop_and_the_export_lets_it_finish(tmp_path):
    proc = run_script(_SIGNAL_AFTER_LOOP, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert "SIGTERM came after the last step; the export finished" in proc.stderr


# The export's SIGTERM comes twice, the second 0.3 s after the first (torchrun's or srun's
# copy of a signal SLURM sent to every process): one request, the export still finishes.
_TWO_SIGNALS_IN_EXPORT = _SIGNAL_IN_EXPORT.replace(
    "    os.kill(os.getpid(), signal.SIGTERM)\n",
    "    import threading\n"
    "    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n",
)


def test_a_signal_repeated_by_a_launcher_during_the_export_lets_it_finish(tmp_path):
    assert _TWO_SIGNALS_IN_EXPORT != _SIGNAL_IN_EXPORT
    proc = run_script(_TWO_SIGNALS_IN_EXPORT, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "run" / "final.tmp").exists()
    assert proc.stderr.count("SIGTERM again within") == 1, proc.stderr[-2000:]
    assert "SIGTERM came after the last step; the export finished" in proc.stderr


def _failing_export(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("save_steps", [None, 2, 4])
def test_a_failed_export_names_what_is_kept(tmp_path, monkeypatch, protrain_log, save_steps):
    monkeypatch.setattr(loop, "export", _failing_export)
    cfg = tiny_config(tmp_path, max_steps=4, save_steps=save_steps, **SMALL)
    with pytest.raises(OSError, match="No space left"):
        loop.train(validate_config(cfg))
    note = [line for line in protrain_log if "the final model was not written" in line]
    assert len(note) == 1, protrain_log
    if save_steps is None:  # save_minutes: nothing saved in 4 steps
        assert "no checkpoint was saved: the 4 steps trained are lost" in note[0]
    elif save_steps == 2:
        assert "checkpoint-4 is the newest checkpoint" in note[0] and "exports it" in note[0]
    else:
        assert "checkpoint-4 is the newest checkpoint" in note[0]


def test_replacing_final_killed_at_each_point_keeps_a_whole_model(tmp_path, monkeypatch):
    """Killed between the renames, `recover` completes the new model (whole on disk before
    the old one moved); killed after it is in place, it removes the old one; with the new
    one gone, it restores the old one; a partial export alone is removed."""
    import shutil

    out = tmp_path / "out"
    final = out / "final"
    final.mkdir(parents=True)
    (final / "w").write_text("old")
    real_rename, real_rmtree = Path.rename, shutil.rmtree

    def write(text: str) -> Path:
        tmp = final_dir.tmp_dir(final)
        tmp.mkdir()
        (tmp / "w").write_text(text)
        return tmp

    # 1. killed between moving the old final aside and renaming the new one in
    def killed_before_new(self, target):
        if self.name == "final.tmp":
            raise SystemExit("killed")
        return real_rename(self, target)

    tmp = write("new")
    monkeypatch.setattr(Path, "rename", killed_before_new)
    with pytest.raises(SystemExit):
        final_dir.publish(tmp, final)
    monkeypatch.undo()
    assert not final.exists() and (out / "final.old" / "w").read_text() == "old"
    note = final_dir.recover(final)
    assert note is not None and note.startswith("completed")
    assert (final / "w").read_text() == "new"
    assert sorted(p.name for p in out.iterdir()) == ["final"]

    # 2. killed after the new final is in place, before the old one is removed
    def killed_before_removal(path, *args, **kwargs):
        if Path(path).name == "final.old":
            raise SystemExit("killed")
        return real_rmtree(path, *args, **kwargs)

    tmp = write("newer")
    monkeypatch.setattr(shutil, "rmtree", killed_before_removal)
    with pytest.raises(SystemExit):
        final_dir.publish(tmp, final)
    monkeypatch.undo()
    assert (final / "w").read_text() == "newer" and (out / "final.old").exists()
    note = final_dir.recover(final)
    assert note is not None and note.startswith("removed")
    assert sorted(p.name for p in out.iterdir()) == ["final"]
    assert final_dir.recover(final) is None

    # 3. the new model gone (removed by hand) while the old one is aside: the old one back
    real_rename(final, out / "final.old")
    note = final_dir.recover(final)
    assert note is not None and note.startswith("restored")
    assert (final / "w").read_text() == "newer"

    # 4. a partial export alone (killed while writing): removed, final untouched
    write("partial")
    note = final_dir.recover(final)
    assert note is not None and "did not finish" in note
    assert sorted(p.name for p in out.iterdir()) == ["final"]

    # 5. a publish after a replacement a kill cut short (case 1's state) finishes it first
    tmp = write("new2")
    real_rename(final, out / "final.old")
    final_dir.publish(tmp, final)
    assert (final / "w").read_text() == "new2"
    assert sorted(p.name for p in out.iterdir()) == ["final"]


def test_a_new_run_leaves_a_verified_unrenamed_save_for_resume(tmp_path, monkeypatch):
    """A kill between a save's manifest and its rename leaves a verified `.tmp-checkpoint-N`:
    a run without --resume (here with bad input) is refused and removes nothing."""
    real_rename = Path.rename

    def killed_before_rename(self, target):
        if self.name.startswith(ckpt.TMP_PREFIX):
            raise SystemExit("killed between the manifest and the rename")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_before_rename)
    with pytest.raises(SystemExit):
        loop.train(validate_config(tiny_config(tmp_path, max_steps=4, save_steps=2, **SMALL)))
    monkeypatch.undo()
    run = tmp_path / "run"
    tmp = run / f"{ckpt.TMP_PREFIX}2"
    assert ckpt.verify(tmp) is None and not ckpt.list_checkpoints(run)

    bad = tiny_config(tmp_path, max_steps=None, num_epochs=1, gradient_accumulation_steps=10**6)
    with pytest.raises(OutputDirError, match=r"a checkpoint, \.tmp-checkpoint-2, awaits --resume"):
        loop.train(validate_config(bad))
    assert ckpt.verify(tmp) is None  # untouched
    # --resume completes it (and then refuses the bad accumulation, keeping it)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        loop.train(validate_config(bad), resume=True)
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["checkpoint-2"]


def _save(out: Path, step: int) -> None:
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w])
    w.grad = torch.ones(4)
    opt.step()
    ckpt.save_checkpoint(
        out,
        step,
        model_state={"w": w.detach()},
        optimizer_state=opt.state_dict(),
        scheduler_state={},
        trainer_state={},
        save_total_limit=None,
    )


def test_every_damaged_checkpoint_passed_over_is_named(tmp_path, protrain_log):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    (tmp_path / "checkpoint-30" / "state.json").write_text("{}")
    (tmp_path / "checkpoint-20" / "model.safetensors").unlink()
    assert ckpt.find_resume_checkpoint(tmp_path).name == "checkpoint-10"
    warned = [line for line in protrain_log if "is damaged" in line]
    assert len(warned) == 2
    assert "checkpoint-30" in warned[0] and ".damaged-checkpoint-30" in warned[0]
    assert "checkpoint-20" in warned[1] and "model.safetensors is missing" in warned[1]


def test_the_signal_handler_says_what_it_lets_finish(tmp_path):
    """The handler's line during the export (the loop's own is tested in test_never_lose)."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from protrain.train.stop_signals import StopSignals
        with StopSignals(finishing="the export") as s:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert s.requested == signal.SIGINT
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{signal.SIGINT.name}: finishing the export first" in proc.stderr


def test_an_error_after_the_export_wrote_does_not_say_it_was_not_written(
    tmp_path, monkeypatch, protrain_log
):
    from protrain.train.trainable import PlainTrainable

    def failing_close(self, keep_weights: bool = True) -> None:
        raise RuntimeError("close failed")

    monkeypatch.setattr(PlainTrainable, "close", failing_close)
    with pytest.raises(RuntimeError, match="close failed"):
        loop.train(validate_config(tiny_config(tmp_path, max_steps=2, **SMALL)))
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert not any("not written" in line for line in protrain_log)


def test_resuming_a_finished_run_says_final_is_trained_again(tmp_path, protrain_log):
    """--resume after the run finished starts from its last checkpoint, older than final:
    one warning says the steps after it are trained again and final replaced (a run
    extended this way must not repeat its last steps silently)."""
    loop.train(validate_config(tiny_config(tmp_path, max_steps=4, save_steps=4, **SMALL)))
    # extended to 6 steps: no checkpoint after step 4 (save_minutes, the default, is far off)
    cfg = validate_config(tiny_config(tmp_path, max_steps=6, save_steps=None, **SMALL))
    loop.train(cfg, resume=True)
    assert not [line for line in protrain_log if "are trained again" in line]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4"]
    loop.train(cfg, resume=True)  # again: from checkpoint-4, while final holds step 6
    said = [line for line in protrain_log if "are trained again" in line]
    assert len(said) == 1 and "checkpoint-4" in said[0] and "step 4" in said[0], said


# The disk fills while the final model is written: safetensors' writer reports it as a
# SafetensorError carrying the OS error (ENOSPC, 28), after a partial file.
_DISK_FULL_IN_EXPORT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError
    from protrain.cli import main
    from tests.train.helpers import tiny_config, write_config

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
            '"No space left on device" })'
        )

    modeling_utils.safe_save_file = disk_full
    tmp = Path(sys.argv[1])
    cfg = tiny_config(tmp, max_steps=4, save_steps=2, micro_batch_size=2,
                      gradient_accumulation_steps=1)
    sys.argv = ["protrain", "train", str(write_config(tmp, cfg))]  # as the console script
    sys.exit(main(sys.argv[1:]))
    """
)


def test_a_disk_that_fills_during_the_export_is_one_line_and_keeps_the_checkpoints(tmp_path):
    env = {**__import__("os").environ, "PROTRAIN_DEBUG": ""}
    proc = run_script(_DISK_FULL_IN_EXPORT, tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    run = tmp_path / "run"
    assert errors == [
        f"error: no space left in output_dir {str(run)!r} while writing the final model "
        "(final.tmp removed); the final model was not written; checkpoint-4 is the newest "
        "checkpoint: after fixing the cause, protrain train "
        f"{tmp_path / 'config.yaml'} --resume exports it"
    ], proc.stderr[-3000:]
    assert not (run / "final.tmp").exists() and not (run / "final").exists()
    assert ckpt.verify(run / "checkpoint-4") is None and ckpt.verify(run / "checkpoint-2") is None

    # with room again, --resume exports it
    cfg = tiny_config(tmp_path, max_steps=4, save_steps=2, **SMALL)
    result = loop.train(validate_config(cfg), resume=True)
    assert (result.final_dir / "model.safetensors").is_file()


def test_the_start_up_space_check_asks_what_a_save_asks(tmp_path, monkeypatch):
    """Room for the checkpoint's tensors but not the margin every save keeps: refused before
    anything loads, not at the first save after training."""
    import shutil

    cfg = validate_config(tiny_config(tmp_path, max_steps=2, save_steps=1, **SMALL))
    estimate = loop._estimate_checkpoint_bytes(cfg, None)
    real = shutil.disk_usage
    free = {"bytes": estimate + (1 << 20)}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free["bytes"]))
    with monkeypatch.context() as m:
        m.setattr(loop, "load_tokenizer", lambda cfg: pytest.fail("loaded"))
        with pytest.raises(OutputDirError, match="a checkpoint needs about"):
            loop.train(cfg)
    # what the start-up check asks (its estimate leaves out AdamW's step counters, 4 bytes
    # a tensor): every save of the run fits
    free["bytes"] = ckpt.space_needed_bytes(estimate) + (64 << 10)
    result = loop.train(cfg)
    assert [p.name for p in ckpt.list_checkpoints(result.output_dir)] == [
        "checkpoint-1",
        "checkpoint-2",
    ]
