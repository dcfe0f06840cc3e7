"""`memory: {auto: true}`: config checks, auto plans that keep the math of plain PyTorch,
fixed knobs, the closed-loop re-plan, and `protrain plan` / `protrain profile`."""

import dataclasses
import time

import pytest
import torch

from protrain.train.checkpoint.directory import verify
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError, PlanRefusedError
from protrain.train.loop import train
from protrain.train.metrics import read_metrics
from protrain.train.plan_checker import PlanChecker
from protrain.train.trainable import AutoTrainable

from .helpers import tiny_config, write_config
from .test_cli_errors import assert_one_line_error, run_cli
from .test_train import final_weights

# Small and fast: 4 blocks, 2 x 32 tokens, 7 steps of 2 micro-batches (the plan check runs
# after step 5: 2 warm-up steps and 3 steady ones; 2 steps follow it).
FAST = {"sequence_len": 32, "micro_batch_size": 2, "max_steps": 7}
BUDGET = "100MiB"  # on the CPU: the engine's tensor bytes as the planner counts them


def fast_config(tmp_path, **overrides):
    return tiny_config(tmp_path, **{**FAST, **overrides})


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
        ({"device_step_search": True}, "memory.device_step_search = true is read only by"),
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
    assert len(checks) == 1 and checks[0]["step"] == PlanChecker.CHECK_AFTER_STEPS == 5
    for key in ("plan_measured_peak_gib", "plan_predicted_step_s", "plan_measured_step_s"):
        assert checks[0][key] > 0, key
    # the step compared is steady state: the warm-up steps are left out
    assert (checks[0]["plan_warmup_steps"], checks[0]["plan_steady_steps"]) == (2, 3)


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
    step 5 and the run continues as if nothing happened."""
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
    if name.endswith(".html"):  # the config's budget drawn, and the host optimizer's lane
        assert b'class="budget"' in data and b"host AdamW" in data
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
    from protrain.train import planning
    from protrain.train.planning import PlanSettings, plan_memory

    memory = {"auto": True, "gpu_budget": "1GiB"}
    cfg = validate_config(tiny_config(tmp_path, max_grad_norm=max_grad_norm, memory=memory))
    settings = PlanSettings.from_config(cfg, torch.device("cpu"), dtype)
    assert settings.request.clipping is clipping
    seen = []
    monkeypatch.setattr(planning, "profile_and_plan", lambda m, r, **kw: seen.append(r) or (1, 2))
    assert plan_memory(torch.nn.Linear(2, 2), {}, settings) == (1, 2)
    assert seen[0].clipping is clipping
    assert seen[0].device_step_search is False  # memory.device_step_search's default


def test_memory_device_step_search_reaches_the_planner(tmp_path, monkeypatch):
    from protrain.train import planning
    from protrain.train.planning import PlanSettings, plan_memory

    memory = {"auto": True, "gpu_budget": "1GiB", "device_step_search": True}
    cfg = validate_config(tiny_config(tmp_path, memory=memory))
    settings = PlanSettings.from_config(cfg, torch.device("cpu"), None)
    seen = []
    monkeypatch.setattr(planning, "profile_and_plan", lambda m, r, **kw: seen.append(r) or (1, 2))
    plan_memory(torch.nn.Linear(2, 2), {}, settings)
    assert seen[0].device_step_search is True


def test_a_slow_host_optimizer_replans_in_place_to_the_faster_plan(
    tmp_path, plain_run, monkeypatch, protrain_log
):
    """The planner is told the host AdamW is free and the device AdamW slow (100 s a step
    for every parameter), so it offloads. The host is slower than it was told: each chunk's
    host update takes 1000 s more, which the engine's counters record and the next forward
    waits for. The step is timed on a clock that these seconds (and 10**6 s in each warm-up
    step) advance, so the run takes no longer and the decision does not hang on this
    machine's load. The compared step is the steady steps' (no warm-up second in it), the
    check corrects the host rate and re-plans in place to the plan that rate favours (every
    chunk persistent), and training stays plain PyTorch's to 1e-6."""
    import protrain.plan as plan_api
    import protrain.plan.auto as auto
    from protrain.chunks.manager import ChunkManager
    from protrain.plan import PlanProblem, search
    from protrain.profile.hardware import HardwareProfile

    n_params = 869_504  # the tiny model's, every one trainable
    claimed = HardwareProfile(
        device="cpu", device_name="told", h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12,
        duplex_bytes_per_s=1e12, cpu_adam_params_per_s=1e13,
        device_adam_params_per_s=n_params / 100, collective_bytes_per_s=None, cpu_threads=1,
    )  # fmt: skip
    monkeypatch.setattr(auto, "measure_hardware", lambda *a, **kw: claimed)
    extra = [0.0]  # seconds the step clock is ahead of the real one
    monkeypatch.setattr(PlanChecker, "clock", lambda self: time.perf_counter() + extra[0])
    real_forward, real_wait = AutoTrainable.forward_loss_sum, ChunkManager._wait_update

    def forward(self, batch):
        loss = real_forward(self, batch)
        if self.checker.steps_run < PlanChecker.WARMUP_STEPS and self.checker.micro == 1:
            extra[0] += 1e6
        return loss

    def wait_update(self, c, pieces=None):
        update = c.update_future
        if update is not None and not getattr(update, "slow_host_counted", False):
            update.slow_host_counted = True  # once per chunk update
            extra[0] += 1000.0
            self.stats["host_adam_s"] = self.stats.get("host_adam_s", 0.0) + 1000.0
            self.stats["wait_cpu_optimizer_s"] += 1000.0
        real_wait(self, c, pieces)

    monkeypatch.setattr(AutoTrainable, "forward_loss_sum", forward)
    monkeypatch.setattr(ChunkManager, "_wait_update", wait_update)
    real_check, seen = plan_api.check_plan, []
    monkeypatch.setattr(plan_api, "check_plan", lambda plan, problem, **measured: seen.append(
        (plan, problem, measured)) or real_check(plan, problem, **measured))  # fmt: skip
    run = train(validate_config(fast_config(tmp_path, memory={"auto": True, "gpu_budget": BUDGET})))

    ((plan, problem, measured),) = seen
    waits = plan.n_chunks - plan.n_persist  # offloaded chunks, one update each a step
    assert waits > 0  # it offloaded
    assert measured["steady"] is True
    # the steady steps' median: each has its waits, none a warm-up step's 10**6 s
    assert 1000 * waits <= measured["measured_step_s"] < 1000 * waits + 100
    assert measured["measured_host_adam_s"] == pytest.approx(1000 * waits, abs=1)
    (record,) = [r for r in read_metrics(run.output_dir) if "plan_predicted_peak_gib" in r]
    assert record["plan_corrected"] is True and record["plan_correction"] == "step"
    assert record["plan_steady_steps"] == 3
    # the plan a search with the measured host rate makes from the start
    rt = problem.runtime
    offloaded = rt.trainable[rt.n_chunks] - rt.trainable[plan.n_persist]
    rate = offloaded / measured["measured_host_adam_s"]
    told = PlanProblem(
        problem.profile, dataclasses.replace(claimed, cpu_adam_busy_params_per_s=rate),
        gpu_budget_bytes=problem.gpu_budget_bytes, cpu_budget_bytes=problem.cpu_budget_bytes,
        clipping=problem.clipping,
    )  # fmt: skip
    favoured = search(told).plan
    assert favoured.n_persist == favoured.n_chunks
    corrected_line = next(m for m in protrain_log if m.startswith("memory plan, corrected:"))
    assert f"n_persist={favoured.n_persist}" in corrected_line
    assert any("re-planned to" in m and "host AdamW" in m for m in protrain_log)
    assert_same_training(plain_run, run, rtol=1e-6, atol=1e-6)


def test_a_slow_link_replans_in_place_to_the_faster_plan(
    tmp_path, plain_run, monkeypatch, protrain_log
):
    """The planner is told copies and the host AdamW cost nothing and the device AdamW is
    slow (100 s a step for every parameter), so it offloads. The link is slower than it was
    told: once training has begun, every byte copied takes 1 ms more, on a clock that the
    engine's copy counters and the step timing share (the trace before it is as it ran).
    The check reads the link's rates from the engine's counters and re-plans in place to the
    plan a search with the true link makes (every chunk persistent), and training stays
    plain PyTorch's to 1e-6."""
    import protrain.plan as plan_api
    import protrain.plan.auto as auto
    from protrain.chunks.copy_times import CopyTimes, Span
    from protrain.plan import PlanProblem, search
    from protrain.profile.hardware import HardwareProfile

    true_link = 1e3  # bytes a second, each way and both together (CPU copies take turns)
    n_params = 869_504  # the tiny model's, every one trainable
    claimed = HardwareProfile(
        device="cpu", device_name="told", h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12,
        duplex_bytes_per_s=1e12, cpu_adam_params_per_s=1e13,
        device_adam_params_per_s=n_params / 100, collective_bytes_per_s=None, cpu_threads=1,
    )  # fmt: skip
    monkeypatch.setattr(auto, "measure_hardware", lambda *a, **kw: claimed)
    extra, training = [0.0], [False]  # seconds the clock is ahead of the real one

    def clock() -> float:
        return time.perf_counter() + extra[0]

    real_add, real_forward = Span.add, AutoTrainable.forward_loss_sum

    def add(self, nbytes):
        real_add(self, nbytes)  # the copy's start is marked: the slow link's seconds follow
        if training[0]:
            extra[0] += nbytes / true_link

    def forward(self, batch):
        training[0] = True
        return real_forward(self, batch)

    monkeypatch.setattr(PlanChecker, "clock", lambda self: clock())
    monkeypatch.setattr(CopyTimes, "clock", staticmethod(clock))
    monkeypatch.setattr(Span, "add", add)
    monkeypatch.setattr(AutoTrainable, "forward_loss_sum", forward)
    real_check, seen = plan_api.check_plan, []
    monkeypatch.setattr(plan_api, "check_plan", lambda plan, problem, **measured: seen.append(
        (plan, problem, real_check(plan, problem, **measured))) or seen[-1][2])  # fmt: skip
    run = train(validate_config(fast_config(tmp_path, memory={"auto": True, "gpu_budget": BUDGET})))

    ((plan, problem, check),) = seen
    assert plan.n_persist < plan.n_chunks  # it offloaded
    (record,) = [r for r in read_metrics(run.output_dir) if "plan_predicted_peak_gib" in r]
    assert record["plan_corrected"] is True and record["plan_correction"] == "step"
    for key in ("h2d", "d2h", "duplex"):
        assert record[f"plan_corrected_{key}_bytes_per_s"] == pytest.approx(true_link, rel=1e-3)
    assert record["plan_measured_h2d_bytes"] > 0 and record["plan_measured_d2h_bytes"] > 0
    # CPU: every copy second is a second the compute waited
    assert record["plan_measured_wait_copy_s"] == pytest.approx(record["plan_measured_copy_busy_s"])
    # the plan a search with the true link makes from the start
    told = PlanProblem(
        problem.profile,
        dataclasses.replace(claimed, h2d_bytes_per_s=true_link, d2h_bytes_per_s=true_link,
                            duplex_bytes_per_s=true_link),
        gpu_budget_bytes=problem.gpu_budget_bytes, cpu_budget_bytes=problem.cpu_budget_bytes,
        clipping=problem.clipping,
    )  # fmt: skip
    favoured = search(told).plan
    assert favoured.n_persist == favoured.n_chunks
    assert check.corrected.knobs == favoured.knobs
    assert any("re-planned to" in m and "copies: h2d" in m for m in protrain_log)
    assert_same_training(plain_run, run, rtol=1e-6, atol=1e-6)


def test_a_plan_check_after_the_last_step_keeps_the_finished_run(tmp_path, monkeypatch):
    """A run shorter than the check's warm-up is checked after its last step: a check
    finding that no plan fits is recorded and warned, and the last checkpoint and the
    export are written all the same (nothing is left to protect)."""
    import protrain.plan as plan_api
    from protrain.plan import NoPlanFits

    def nothing_fits(plan, problem, **measured):
        raise NoPlanFits("with the measured peak counted, no plan fits (test)", None)

    monkeypatch.setattr(plan_api, "check_plan", nothing_fits)
    memory = {"auto": True, "gpu_budget": BUDGET}
    cfg = fast_config(tmp_path, memory=memory, max_steps=3, save_steps=2)
    run = train(validate_config(cfg))
    assert len(run.losses) == 3
    assert (run.output_dir / "checkpoint-3").is_dir() and (run.output_dir / "final").is_dir()
    records = [r for r in read_metrics(run.output_dir) if "plan_check" in r]
    assert records and records[0]["plan_corrected"] is False


def test_a_plan_refused_after_a_step_keeps_that_step(tmp_path, monkeypatch):
    # the steps trained are sound, only the plan for the next ones is refused: they are
    # saved before the run ends (save_minutes alone would have saved none of them)
    def refuse(self, step, total_steps):
        if self.checker.due(step, total_steps):
            raise PlanRefusedError("after the first steps, with the measured peak: no plan fits")

    monkeypatch.setattr(AutoTrainable, "check_plan", refuse)
    memory = {"auto": True, "gpu_budget": BUDGET}
    cfg = validate_config(fast_config(tmp_path, memory=memory))
    with pytest.raises(ConfigError, match=r"no plan fits; checkpoint-(\d+) holds step \1"):
        train(cfg)
    (saved,) = sorted((tmp_path / "run").glob("checkpoint-*"))
    assert verify(saved) is None
    step = int(saved.name.removeprefix("checkpoint-"))
    logged = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert logged[-1] == step  # its record is written before it is saved


def test_a_replan_that_fails_is_its_own_error_not_a_save(tmp_path, monkeypatch):
    def fail(self, step, total_steps):
        if self.checker.due(step, total_steps):
            raise ConfigError("memory: the corrected plan could not be applied")

    monkeypatch.setattr(AutoTrainable, "check_plan", fail)
    memory = {"auto": True, "gpu_budget": BUDGET}
    with pytest.raises(ConfigError, match="^memory: the corrected plan could not be applied$"):
        train(validate_config(fast_config(tmp_path, memory=memory)))
