"""End-to-end training on the tiny model: falling loss, export, resume, atomic checkpoints."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
from protrain.train.loop import train
from protrain.train.metrics import read_metrics

from .helpers import tiny_config, write_config


def final_weights(run_dir, name="model.safetensors"):
    return load_file(run_dir / "final" / name)


def _resume_without_the_end(cfg, run, last_step: int):
    """Train ``cfg`` again with ``resume``, after removing what ``run`` wrote at its last
    step (the checkpoint at ``last_step`` and the final model): it resumes from the one
    before."""
    shutil.rmtree(run.output_dir / f"checkpoint-{last_step}")
    shutil.rmtree(run.final_dir)
    return train(cfg, resume=True)


def test_loss_falls_and_export_loads_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = validate_config(
        tiny_config(
            tmp_path,
            max_steps=30,
            learning_rate=3e-3,
            micro_batch_size=8,
            gradient_accumulation_steps=1,
            val_set_size=0.05,
            eval={"steps": 15},
        )
    )
    result = train(cfg)
    assert len(result.losses) == 30
    assert sum(result.losses[-5:]) / 5 < 0.6 * sum(result.losses[:5]) / 5
    records = read_metrics(result.output_dir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))
    assert [r["step"] for r in records if "eval_loss" in r] == [15, 30]

    tok = AutoTokenizer.from_pretrained(result.final_dir)
    model = AutoModelForCausalLM.from_pretrained(result.final_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Peru?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8 or out[0, -1] == tok.eos_token_id


def test_lora_exports_a_peft_adapter_with_its_tiny_base(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = validate_config(tiny_config(tmp_path, max_steps=3, adapter={"type": "lora", "r": 4}))
    result = train(cfg)
    assert (result.final_dir / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(result.final_dir / "base_model")
    model = PeftModel.from_pretrained(base, result.final_dir)
    ids = torch.tensor([[1, 5, 6, 7]])
    assert model(input_ids=ids).logits.shape == (1, 4, 512)


def _run_resumed(tmp_path, overrides):
    """10 steps straight, and 5 steps + resume + 5 steps; return both."""
    straight = train(validate_config(tiny_config(tmp_path / "a", save_steps=5, **overrides)))
    cfg_b = validate_config(tiny_config(tmp_path / "b", save_steps=5, **overrides))
    first = train(cfg_b)
    # Forget everything after step 5, as if the first run had stopped there.
    shutil.rmtree(first.output_dir / "checkpoint-10")
    shutil.rmtree(first.final_dir)
    resumed = train(cfg_b, resume=True)
    return straight, first, resumed


def test_resume_is_exact_full_finetuning(tmp_path):
    straight, first, resumed = _run_resumed(tmp_path, {})
    assert resumed.losses == straight.losses[5:]
    a, b = final_weights(straight.output_dir), final_weights(resumed.output_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_is_exact_lora_with_dropout(tmp_path):
    # Dropout makes the result depend on the restored RNG state.
    overrides = {"adapter": {"type": "lora", "r": 4, "dropout": 0.1}}
    straight, _, resumed = _run_resumed(tmp_path, overrides)
    assert resumed.losses == straight.losses[5:]
    a = final_weights(straight.output_dir, "adapter_model.safetensors")
    b = final_weights(resumed.output_dir, "adapter_model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_save_total_limit_prunes_old_checkpoints(tmp_path):
    result = train(
        validate_config(tiny_config(tmp_path, max_steps=6, save_steps=2, save_total_limit=2))
    )
    names = sorted(p.name for p in result.output_dir.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-4", "checkpoint-6"]


CRASHING_RUN = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import protrain.train.checkpoint.plain as ckpt
    from protrain.cli import main

    real_save = ckpt._save_tensors

    def save_then_die(path, tensors):
        real_save(path, tensors)
        if ".tmp-checkpoint-4" in str(path) and path.name == "model.safetensors":
            os._exit(9)  # killed in the middle of writing checkpoint 4

    ckpt._save_tensors = save_then_die
    sys.exit(main(["train", sys.argv[1]]))
    """
)


def test_kill_during_save_keeps_previous_checkpoint_and_resume_continues(tmp_path):
    overrides = dict(max_steps=6, save_steps=2)
    straight = train(validate_config(tiny_config(tmp_path / "a", **overrides)))

    raw = tiny_config(tmp_path / "b", **overrides)
    path = write_config(tmp_path, raw)
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_RUN, str(path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 9, proc.stderr
    run_dir = tmp_path / "b" / "run"
    assert (run_dir / "checkpoint-2" / "state.json").exists()
    assert not (run_dir / "checkpoint-4").exists()
    assert (run_dir / ".tmp-checkpoint-4").exists()

    resumed = train(validate_config(raw), resume=True)
    assert not (run_dir / ".tmp-checkpoint-4").exists()
    assert resumed.losses == straight.losses[2:]
    a, b = final_weights(straight.output_dir), final_weights(resumed.output_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_engine_matches_plain_pytorch_and_resumes_exactly(tmp_path):
    """The loop through the chunked engine (everything offloaded) computes what plain
    PyTorch computes, and its checkpoints resume exactly."""
    plain = train(validate_config(tiny_config(tmp_path / "plain", max_steps=6)))
    memory = {"n_persist": 0, "n_buffer": 2, "chunk_size": "256KiB"}
    cfg = validate_config(tiny_config(tmp_path / "a", max_steps=6, save_steps=3, memory=memory))
    straight = train(cfg)
    assert straight.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)
    a, b = final_weights(plain.output_dir), final_weights(straight.output_dir)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)

    resumed = _resume_without_the_end(cfg, straight, 6)
    assert resumed.losses == straight.losses[3:]
    c = final_weights(resumed.output_dir)
    for k in b:
        assert torch.equal(b[k], c[k]), k


def test_engine_without_clipping_steps_in_backward_and_matches_plain(tmp_path, monkeypatch):
    """max_grad_norm: null: the engine starts offloaded chunks' AdamW inside the last
    backward of each step (accumulation 2, cosine schedule); same math as plain PyTorch."""
    from protrain.optim.hybrid_adamw import HybridAdamW

    armed = []
    original = HybridAdamW.step_in_backward
    monkeypatch.setattr(
        HybridAdamW, "step_in_backward", lambda self: (armed.append(1), original(self))[1]
    )
    plain = train(validate_config(tiny_config(tmp_path / "plain", max_steps=4, max_grad_norm=None)))
    memory = {"n_persist": 0, "n_buffer": 2, "chunk_size": "256KiB"}
    cfg = tiny_config(tmp_path / "a", max_steps=4, max_grad_norm=None, memory=memory)
    engine = train(validate_config(cfg))
    assert len(armed) == 4  # once per optimizer step, before its last micro-batch
    assert engine.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)
    a, b = final_weights(plain.output_dir), final_weights(engine.output_dir)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_engine_fp16_trains_on_cpu_with_loss_scaling_and_resumes(tmp_path):
    """fp16 through the engine is allowed on the CPU (the engine casts its own weights and
    scales the loss); plain fp16 autocast on the CPU is still refused."""
    from protrain.train.errors import ConfigError

    with pytest.raises(ConfigError, match="mixed_precision = 'fp16' is not allowed on cpu"):
        train(validate_config(tiny_config(tmp_path / "p16", device="cpu", mixed_precision="fp16")))
    plain = train(validate_config(tiny_config(tmp_path / "plain", max_steps=6, device="cpu")))
    memory = {"n_persist": 1, "n_buffer": 2, "chunk_size": "256KiB"}
    cfg = validate_config(
        tiny_config(
            tmp_path / "a",
            max_steps=6,
            save_steps=3,
            device="cpu",
            mixed_precision="fp16",
            memory=memory,
        )
    )
    straight = train(cfg)
    assert len(straight.losses) == 6
    assert straight.losses == pytest.approx(plain.losses, rel=2e-2), (straight, plain)

    resumed = _resume_without_the_end(cfg, straight, 6)
    assert resumed.losses == straight.losses[3:]


ACTIVATION_MEMORY = {
    "n_swap": 1,
    "n_checkpoint": 2,
    "offload_checkpoint": True,
    "tiled_mlp_tokens": 16,
    "chunked_loss_tokens": 24,
}


@pytest.mark.parametrize("engine", [False, True], ids=["plain", "engine"])
def test_activation_knobs_and_chunked_loss_keep_the_math(tmp_path, engine):
    """Swap, offload-checkpoint, tiled MLP and chunked loss from the `memory:` section give
    the losses and weights of plain PyTorch (tiles sum weight gradients in another order,
    hence 1e-5 on weights after AdamW)."""
    overrides = {"max_steps": 4, "adapter": {"type": "lora", "r": 4}}
    plain = train(validate_config(tiny_config(tmp_path / "plain", **overrides)))
    memory = dict(ACTIVATION_MEMORY)
    if engine:
        memory.update(n_persist=0, n_buffer=5, chunk_size="256KiB")  # a LoRA block spans 5
    knobs = train(validate_config(tiny_config(tmp_path / "knobs", memory=memory, **overrides)))
    assert knobs.losses == pytest.approx(plain.losses, rel=1e-6, abs=1e-6)
    a = final_weights(plain.output_dir, "adapter_model.safetensors")
    b = final_weights(knobs.output_dir, "adapter_model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)


def test_chunked_loss_refused_where_logits_are_not_the_head_s(tmp_path):
    """A model the chunked loss cannot reproduce (here: no output embedding) is a config
    error; families with transforms are tested in tests/activations/
    test_chunked_loss_families.py."""
    from protrain.train.errors import ConfigError
    from protrain.train.trainable import check_chunked_loss_supported

    class Config:
        model_type = "gemma2"

    class Model(torch.nn.Module):
        config = Config()

        def get_output_embeddings(self):
            return None

    with pytest.raises(
        ConfigError, match="chunked_loss_tokens is not allowed for model type 'gemma2'"
    ):
        check_chunked_loss_supported(Model())


def _scale_moves_every_step(monkeypatch):
    """growth_interval=1: the loss scale changes every step, so a resume that lost it shows."""
    import protrain.optim.loss_scaler as loss_scaler

    init = loss_scaler.LossScaler.__init__

    def fast_growth(self, *args, **kwargs):
        kwargs.setdefault("growth_interval", 1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(loss_scaler.LossScaler, "__init__", fast_growth)


def test_fp16_engine_resume_carries_the_loss_scale(tmp_path, monkeypatch):
    _scale_moves_every_step(monkeypatch)
    memory = {"n_persist": 1, "n_buffer": 2, "chunk_size": "256KiB"}
    overrides = dict(max_steps=8, save_steps=4, mixed_precision="fp16", device="cpu", memory=memory)
    straight = train(validate_config(tiny_config(tmp_path / "a", **overrides)))
    cfg = validate_config(tiny_config(tmp_path / "b", **overrides))
    first = train(cfg)
    resumed = _resume_without_the_end(cfg, first, 8)
    assert resumed.losses == straight.losses[4:]


def test_plain_fp16_resume_carries_the_grad_scaler(tmp_path, monkeypatch):
    """Plain fp16 autocast runs on CUDA; on the CPU the loop is made to take the fp16 path
    (autocast on the CPU supports it) so that the GradScaler's state is checked here."""
    import protrain.train.loop as loop

    monkeypatch.setattr(loop, "resolve_autocast_dtype", lambda *a, **k: torch.float16)
    scaler_cls = torch.amp.GradScaler
    monkeypatch.setattr(
        torch.amp, "GradScaler", lambda device: scaler_cls(device, growth_interval=1)
    )
    overrides = dict(max_steps=8, save_steps=4, device="cpu")
    straight = train(validate_config(tiny_config(tmp_path / "a", **overrides)))
    cfg = validate_config(tiny_config(tmp_path / "b", **overrides))
    first = train(cfg)
    resumed = _resume_without_the_end(cfg, first, 8)
    assert resumed.losses == straight.losses[4:]


def test_resume_under_another_data_order_is_refused_and_keeps_the_run(tmp_path):
    from protrain.train.errors import OutputDirError

    first = train(validate_config(tiny_config(tmp_path, max_steps=4, save_steps=2)))
    recorded = (first.output_dir / "config.yaml").read_text()
    metrics = (first.output_dir / "metrics.jsonl").read_text()
    shutil.rmtree(first.final_dir)
    with pytest.raises(OutputDirError, match="micro_batch_size: 4 -> 2"):
        train(validate_config(tiny_config(tmp_path, max_steps=4, micro_batch_size=2)), resume=True)
    # another sequence_len changes which rows there are: the message names it with "rows"
    with pytest.raises(OutputDirError, match=r"rows: \d+ -> \d+\) \(rows follow .*sequence_len"):
        train(validate_config(tiny_config(tmp_path, max_steps=4, sequence_len=32)), resume=True)
    assert (first.output_dir / "config.yaml").read_text() == recorded
    assert (first.output_dir / "metrics.jsonl").read_text() == metrics


def test_resume_moves_superseded_metrics_aside(tmp_path):
    cfg = validate_config(tiny_config(tmp_path, max_steps=6, save_steps=3))
    first = train(cfg)
    shutil.rmtree(first.output_dir / "checkpoint-6")
    shutil.rmtree(first.final_dir)
    train(cfg, resume=True)
    steps = [r["step"] for r in read_metrics(first.output_dir) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    superseded = (first.output_dir / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded] == [4, 5, 6]


def test_accumulation_longer_than_the_data_is_a_config_error(tmp_path):
    from protrain.train.errors import ConfigError

    raw = tiny_config(tmp_path, max_steps=None, num_epochs=1, micro_batch_size=64,
                      gradient_accumulation_steps=16)  # fmt: skip
    with pytest.raises(ConfigError, match="gradient_accumulation_steps = 16 is not allowed"):
        train(validate_config(raw))
    assert not (tmp_path / "run").exists()


def test_sdpa_backend_is_forced_for_the_whole_run(tmp_path, monkeypatch):
    """model.sdpa_backend: math runs every attention call (training and evaluation) under
    torch's math kernel, with the same losses as torch's own choice on the CPU; afterwards
    the kernels torch may pick are as before. A GPU-only kernel on the CPU is refused
    before anything is written."""
    import torch.nn.functional as F

    seen = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(
            (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
        )
        return original(*args, **kwargs)

    default = train(validate_config(tiny_config(tmp_path / "default", max_steps=3)))
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = {"name_or_path": "tiny", "sdpa_backend": "math"}
    forced = train(validate_config(tiny_config(tmp_path / "math", max_steps=3, model=model)))
    assert seen and set(seen) == {(False, True)}
    assert forced.losses == pytest.approx(default.losses, rel=1e-5, abs=1e-6)
    assert torch.backends.cuda.flash_sdp_enabled()  # restored
    model = {"name_or_path": "tiny", "sdpa_backend": "cudnn"}
    with pytest.raises(
        ConfigError, match="needs a CUDA GPU; on cpu use one of default, flash, math"
    ):
        train(validate_config(tiny_config(tmp_path / "cudnn", model=model, device="cpu")))
    assert not (tmp_path / "cudnn").exists()


def test_qlora_through_the_engine_matches_qlora_without_it(tmp_path):
    """adapter: qlora (4-bit NF4 base, quantized in process) trains through the chunked
    engine with every chunk offloaded as it trains without the engine, resumes exactly, and
    exports a PEFT adapter beside the unquantized tiny base."""
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = {"type": "qlora", "r": 4}
    plain = train(validate_config(tiny_config(tmp_path / "plain", max_steps=6, adapter=adapter)))
    memory = {"n_persist": 0, "n_buffer": 2, "chunk_size": "256KiB"}
    cfg = validate_config(
        tiny_config(tmp_path / "a", max_steps=6, save_steps=3, adapter=adapter, memory=memory)
    )
    straight = train(cfg)
    assert straight.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)
    a = final_weights(plain.output_dir, "adapter_model.safetensors")
    b = final_weights(straight.output_dir, "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)

    resumed = _resume_without_the_end(cfg, straight, 6)
    assert resumed.losses == straight.losses[3:]
    c = final_weights(resumed.output_dir, "adapter_model.safetensors")
    for k in b:
        assert torch.equal(b[k], c[k]), k
    base = AutoModelForCausalLM.from_pretrained(straight.final_dir / "base_model")
    assert all(p.is_floating_point() for p in base.parameters())  # shipped unquantized
    model = PeftModel.from_pretrained(base, straight.final_dir)
    assert model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits.shape == (1, 4, 512)


def test_a_resume_trains_with_the_learning_rate_and_decay_of_its_config(tmp_path, protrain_log):
    # load_state_dict brings back the checkpoint's values; the config given wins, as it does
    # for the schedule's other keys
    straight = train(validate_config(tiny_config(tmp_path / "a", max_steps=6, save_steps=3)))
    cfg = validate_config(tiny_config(tmp_path / "b", max_steps=6, save_steps=3))
    first = train(cfg)
    shutil.rmtree(first.output_dir / "checkpoint-6")
    shutil.rmtree(first.final_dir)
    changed = tiny_config(tmp_path / "b", max_steps=6, save_steps=3, learning_rate=5e-4)
    protrain_log.clear()
    train(validate_config({**changed, "weight_decay": 0.1}), resume=True)
    said = "\n".join(protrain_log)
    assert "--resume: learning_rate, weight_decay from this config from step 4 on" in said
    lrs = {r["step"]: r["lr"] for r in read_metrics(straight.output_dir) if "lr" in r}
    resumed = {r["step"]: r["lr"] for r in read_metrics(first.output_dir) if "lr" in r}
    for step in (4, 5):
        assert resumed[step] == pytest.approx(lrs[step] / 2, rel=1e-12)


def test_held_out_rows_without_evaluation_are_named_and_too_few_are_refused(tmp_path, protrain_log):
    train(validate_config(tiny_config(tmp_path / "a", max_steps=1, val_set_size=0.05)))
    said = "\n".join(protrain_log)
    assert "40 evaluation rows (held out of training) but eval.steps is unset" in said
    none_held = tiny_config(tmp_path / "b", max_steps=1, val_set_size=1e-4, eval={"steps": 1})
    with pytest.raises(
        ConfigError,
        match=r"eval.steps = 1 but the evaluation data \(val_set_size = 0.0001\) has no rows",
    ):
        train(validate_config(none_held))
    assert not list((tmp_path / "b" / "run").glob("checkpoint-*"))


def test_a_schedule_with_its_own_arguments_trains_to_them(tmp_path):
    raw = tiny_config(tmp_path, max_steps=4, lr_scheduler="cosine_with_min_lr")
    run = train(validate_config({**raw, "lr_scheduler_kwargs": {"min_lr": 1e-4}}))
    lrs = [r["lr"] for r in read_metrics(run.output_dir) if "lr" in r]
    assert lrs[-1] == pytest.approx(1e-4)


def test_a_resume_under_another_schedule_steps_on_it_from_its_first_step(tmp_path):
    # the learning rate each step runs with, as the optimizer sees it when it steps
    seen = []
    hook = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"])
    )
    try:
        linear = tiny_config(tmp_path / "a", max_steps=6, save_steps=3, lr_scheduler="linear")
        train(validate_config(linear))
        straight, seen[:] = seen[:], []
        cfg = tiny_config(tmp_path / "b", max_steps=6, save_steps=3)  # cosine
        first = train(validate_config(cfg))
        shutil.rmtree(first.output_dir / "checkpoint-6")
        shutil.rmtree(first.final_dir)
        seen.clear()
        train(validate_config({**cfg, "lr_scheduler": "linear"}), resume=True)
    finally:
        hook.remove()
    assert len(straight) == 6 and seen == straight[3:]
