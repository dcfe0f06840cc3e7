"""`memory: {auto: true}`: config checks, auto plans that keep the math of plain PyTorch,
fixed knobs, the closed-loop re-plan, and `protrain plan` / `protrain profile`."""

import dataclasses
import logging

import pytest
import torch

from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
from protrain.train.loop import train
from protrain.train.metrics import read_metrics

from .helpers import tiny_config, write_config
from .test_cli_errors import assert_one_line_error, run_cli
from .test_train import final_weights

# Small and fast: 4 blocks, 2 x 32 tokens, 5 steps of 2 micro-batches.
FAST = {"sequence_len": 32, "micro_batch_size": 2, "max_steps": 5}
BUDGET = "100MiB"  # on the CPU: the engine's tensor bytes as the planner counts them


def fast_config(tmp_path, **overrides):
    return tiny_config(tmp_path, **{**FAST, **overrides})


@pytest.fixture
def protrain_log():
    """INFO records of the `protrain` logger (it does not propagate to pytest's caplog)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(logging.INFO)
    logger = logging.getLogger("protrain")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return train(validate_config(fast_config(tmp_path_factory.mktemp("plain"))))


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    memory = {"auto": True, "gpu_budget": BUDGET}
    return train(validate_config(fast_config(tmp_path_factory.mktemp("auto"), memory=memory)))


def assert_same_training(a, b, rtol=1e-5, atol=1e-6):
    assert b.losses == pytest.approx(a.losses, rel=rtol, abs=atol)
    wa, wb = final_weights(a.output_dir), final_weights(b.output_dir)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "memory, needle",
    [
        ({"auto": True}, "memory.auto = true needs memory.gpu_budget"),
        ({"gpu_budget": "24GiB"}, "read only by the planner: set memory.auto = true"),
        (
            {"auto": True, "gpu_budget": "24GiB", "n_checkpoint": 1, "offload_checkpoint": True},
            "offload_checkpoint = true is not planned by memory.auto",
        ),
        ({"auto": True, "gpu_budget": "lots"}, "memory.gpu_budget = 'lots'"),
    ],
)
def test_auto_config_errors(tmp_path, memory, needle):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, memory=memory))
    assert needle in str(err.value)


def test_auto_with_gradient_checkpointing_is_refused(tmp_path):
    raw = tiny_config(tmp_path, gradient_checkpointing=True,
                      memory={"auto": True, "gpu_budget": "24GiB"})  # fmt: skip
    with pytest.raises(ConfigError, match="the plan chooses which blocks are recomputed"):
        validate_config(raw)


def test_auto_matches_plain_pytorch_and_reports_the_check(plain_run, auto_run):
    assert_same_training(plain_run, auto_run)
    checks = [r for r in read_metrics(auto_run.output_dir) if "plan_predicted_peak_gib" in r]
    assert len(checks) == 1 and checks[0]["step"] == 3
    for key in ("plan_measured_peak_gib", "plan_predicted_step_s", "plan_measured_step_s"):
        assert checks[0][key] > 0, key


def test_auto_keeps_the_knobs_the_user_fixed(tmp_path, plain_run, protrain_log):
    memory = {"auto": True, "gpu_budget": BUDGET, "n_persist": 0, "n_checkpoint": 2,
              "chunk_size": "256KiB"}  # fmt: skip
    run = train(validate_config(fast_config(tmp_path, memory=memory)))
    assert_same_training(plain_run, run)
    log = "\n".join(protrain_log)
    assert "knobs fixed by the user: n_persist=0, n_checkpoint=2" in log
    assert "searching n_buffer, n_swap" in log
    plan_line = next(m for m in protrain_log if m.startswith("memory plan:"))
    assert "n_persist=0," in plan_line and "n_checkpoint=2" in plan_line


def test_closed_loop_correction_replans_in_place_exactly(
    tmp_path, auto_run, monkeypatch, protrain_log
):
    """A check that asks for other knobs: the model and optimizer move to the new plan after
    step 3 and the run continues as if nothing happened."""
    import protrain.plan as plan_api
    from protrain.plan import PlanCheck, PlanProblem, search

    real_check = plan_api.check_plan
    corrected = []

    def check_and_correct(plan, problem, **measured):
        check = real_check(plan, problem, **measured)
        other = {"n_persist": 0, "n_checkpoint": 1}
        new = search(PlanProblem(problem.profile, problem.hardware, gpu_budget_bytes=1 << 40,
                                 fixed_knobs=other)).plan  # fmt: skip
        assert new.knobs != plan.knobs
        corrected.append(new)
        return dataclasses.replace(check, corrected=new) if isinstance(check, PlanCheck) else None

    monkeypatch.setattr(plan_api, "check_plan", check_and_correct)
    memory = {"auto": True, "gpu_budget": BUDGET}
    run = train(validate_config(fast_config(tmp_path, memory=memory)))
    assert len(corrected) == 1
    assert any(m.startswith("memory plan, corrected:") for m in protrain_log)
    checks = [r for r in read_metrics(run.output_dir) if "plan_predicted_peak_gib" in r]
    assert checks[0]["plan_corrected"] is True
    assert run.losses == auto_run.losses
    assert_same_training(auto_run, run, rtol=0, atol=0)


def test_budget_too_small_is_one_line_naming_the_smallest_budget(tmp_path):
    raw = fast_config(tmp_path, memory={"auto": True, "gpu_budget": "1MiB"})
    proc = run_cli("train", str(write_config(tmp_path, raw)))
    assert_one_line_error(proc, "memory.gpu_budget = 1.00MiB", "smallest budget that would is")
    assert not (tmp_path / "run").exists()


def test_plan_command_prints_the_plan_and_candidates(tmp_path):
    raw = fast_config(tmp_path, memory={"auto": True, "gpu_budget": BUDGET, "n_checkpoint": 1})
    proc = run_cli("plan", str(write_config(tmp_path, raw)), "--set", "micro_batch_size=1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Plan: n_persist=")
    assert "n_checkpoint=1" in proc.stdout.splitlines()[0]
    assert "fixed by the user: n_checkpoint=1" in proc.stdout
    assert "n_persist  n_buffer  n_swap  n_ckpt  peak GiB  step s  tokens/s" in proc.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["step.html", "step.png"])
def test_profile_command_writes_the_picture(tmp_path, name):
    raw = fast_config(tmp_path, memory={"auto": True, "gpu_budget": BUDGET})
    out = tmp_path / name
    proc = run_cli("profile", str(write_config(tmp_path, raw)), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"profile of one step written to {out}"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if name.endswith(".png") else b"<svg" in data
    assert not (tmp_path / "run").exists()


def test_profile_without_a_budget_is_one_line(tmp_path):
    proc = run_cli("profile", str(write_config(tmp_path, fast_config(tmp_path))))
    assert_one_line_error(proc, "memory.gpu_budget is not set")


@pytest.mark.parametrize(
    ("max_grad_norm", "dtype", "clipping"),
    [(1.0, None, True), (None, None, False), (None, torch.float16, True)],
)
def test_the_plan_assumes_the_host_optimizer_schedule_the_run_uses(
    tmp_path, monkeypatch, max_grad_norm, dtype, clipping
):
    """No clipping (and not fp16): the engine steps offloaded chunks inside backward, and
    the plan is searched for that schedule; otherwise for steps after the backward."""
    import protrain.plan as plan_api
    from protrain.train.planning import PlanSettings, plan_memory

    memory = {"auto": True, "gpu_budget": "1GiB"}
    cfg = validate_config(tiny_config(tmp_path, max_grad_norm=max_grad_norm, memory=memory))
    settings = PlanSettings.from_config(cfg, torch.device("cpu"), dtype)
    assert settings.clipping is clipping
    seen = {}
    monkeypatch.setattr(plan_api, "profile_and_plan", lambda *a, **kw: seen.update(kw) or (1, 2))
    assert plan_memory(torch.nn.Linear(2, 2), {}, settings, {}) == (1, 2)
    assert seen["clipping"] is clipping
