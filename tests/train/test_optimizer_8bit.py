"""Config `optimizer: adamw_bnb_8bit`: bitsandbytes' 8-bit AdamW on plain PyTorch, in the
chunked engine's persistent chunks (the same math: to 1e-6), through the planner, and its
refusals."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
from protrain.train.loop import train
from protrain.train.planning import PlanSettings

from .helpers import tiny_config

pytest.importorskip("bitsandbytes")

EIGHT_BIT = {"optimizer": "adamw_bnb_8bit"}


def _weights(run):
    return load_file(run.output_dir / "final" / "model.safetensors")


def _resume_from_step_2(cfg, run):
    shutil.rmtree(run.output_dir / "checkpoint-4")
    shutil.rmtree(run.final_dir)
    resumed = train(cfg, resume=True)
    assert resumed.losses == run.losses[2:]
    a, b = _weights(run), _weights(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_engine_persistent_chunks_match_plain_8bit_and_both_resume_exactly(tmp_path):
    """Plain PyTorch with bitsandbytes' AdamW8bit against the engine with every chunk
    persistent (stepped by AdamW8bit); both then resume bit for bit from a checkpoint."""
    plain_cfg = validate_config(
        tiny_config(tmp_path / "p8", max_steps=4, save_steps=2, **EIGHT_BIT)
    )
    plain_8bit = train(plain_cfg)
    plain = train(validate_config(tiny_config(tmp_path / "p", max_steps=4)))
    # one chunk, persistent: every parameter stepped by bitsandbytes on the compute device
    memory = {"n_persist": 1, "chunk_size": "4MiB"}
    cfg = validate_config(
        tiny_config(tmp_path / "e", max_steps=4, save_steps=2, memory=memory, **EIGHT_BIT)
    )
    engine = train(cfg)
    assert engine.losses == pytest.approx(plain_8bit.losses, rel=1e-5, abs=1e-6)
    a, b = _weights(plain_8bit), _weights(engine)
    # The loop's gradients match plain PyTorch's to the last bits (fp32 AdamW: 1e-6), and a
    # last-bit difference can move a moment across a quantization boundary: a few elements
    # differ by up to 2e-5 here; 8-bit against fp32 AdamW differs by 1.5e-3.
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-5)
    fp32 = _weights(plain)
    assert max((a[k] - fp32[k]).abs().max().item() for k in a) > 1e-3
    # the 8-bit state round-trips through the checkpoints of both
    _resume_from_step_2(cfg, engine)
    _resume_from_step_2(plain_cfg, plain_8bit)


def test_optimizer_key_errors(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, optimizer="adamw_8bit"))
    assert "optimizer = 'adamw_8bit'" in str(err.value)
    assert "'adamw_torch' or 'adamw_bnb_8bit'" in str(err.value)
    with pytest.raises(ConfigError, match="with fsdp_version = 2 is not supported"):
        validate_config(tiny_config(tmp_path, fsdp_version=2, **EIGHT_BIT))
    assert validate_config(tiny_config(tmp_path)).optimizer == "adamw_torch"


def test_the_planner_plans_for_the_optimizer_and_the_plan_runs_with_it(tmp_path, monkeypatch):
    from protrain.optim.hybrid_adamw import HybridAdamW
    from protrain.plan.search import PlanProblem

    seen = []
    for cls in (PlanProblem, HybridAdamW):
        init = cls.__init__

        def record(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            built_for = self.optimizer_name if isinstance(self, HybridAdamW) else self.optimizer
            seen.append((type(self).__name__, built_for))

        monkeypatch.setattr(cls, "__init__", record)
    memory = {"auto": True, "gpu_budget": "100MiB"}
    fast = {"sequence_len": 32, "micro_batch_size": 2, "max_steps": 2}
    cfg = validate_config(tiny_config(tmp_path, memory=memory, **fast, **EIGHT_BIT))
    assert (
        PlanSettings.from_config(cfg, torch.device("cpu"), None).request.optimizer == "adamw_8bit"
    )
    train(cfg)
    problems = [o for name, o in seen if name == "PlanProblem"]
    assert problems and set(problems) == {"adamw_8bit"}
    # the trace steps torch's AdamW (its own wrap), the run bitsandbytes'
    assert [o for name, o in seen if name == "HybridAdamW"] == ["adamw", "adamw_8bit"]


@pytest.mark.parametrize("memory", [None, {"n_persist": 1, "chunk_size": "4MiB"}])
def test_resume_with_the_other_optimizer_choice_is_refused(tmp_path, memory):
    """A checkpoint of adamw_torch resumed with adamw_bnb_8bit (plain PyTorch, whose
    bitsandbytes optimizer would take torch's state and fail at its first step, and the
    engine): one message naming both choices, and the checkpoint is left as it was."""
    from protrain.train.errors import OutputDirError

    extra = {"memory": memory} if memory else {}
    run = train(validate_config(tiny_config(tmp_path / "r", max_steps=2, save_steps=2, **extra)))
    ckpt = run.output_dir / "checkpoint-2"
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    cfg = validate_config(
        tiny_config(tmp_path / "r", max_steps=4, save_steps=2, **extra, **EIGHT_BIT)
    )
    with pytest.raises(OutputDirError) as err:
        train(cfg, resume=True)
    assert "saved with optimizer='adamw'" in str(err.value)
    assert "'adamw_8bit'" in str(err.value) and "checkpoint-2" in str(err.value)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == files
