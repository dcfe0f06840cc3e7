"""Several LoRA adapters on one model (`adapter.extra`): one trained next to the main one,
one loaded frozen from a PEFT directory; the chunked engine and the FSDP2 engine (one
process) against plain PyTorch, resume,
the export as peft's multi-adapter layout, and the errors of bad adapter input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from protrain.train import loop
from protrain.train.config import validate_config
from protrain.train.errors import ConfigError
from protrain.train.loop import train
from protrain.train.modeling import build_model, build_tiny_base

from .helpers import tiny_config

# every chunk offloaded; a DoRA layer needs its whole subtree (base weight too) resident
ENGINE = {"n_persist": 0, "n_buffer": 6, "chunk_size": "256KiB"}
SMALL = {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "sequence_len": 48}
IDS = torch.tensor([[1, 5, 6, 7, 9, 11]])


@pytest.fixture(autouse=True)
def one_thread():
    """Matmuls this small gain nothing from a second thread, and on a busy 2-core machine
    OpenMP's waits made a 4-step run take 23 s instead of 0.5 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_config(tmp_path, **overrides):
    """The tiny model on 16 rows of the quickstart data (little to prepare)."""
    cfg = tiny_config(tmp_path, **SMALL, **overrides)
    cfg["datasets"][0]["max_samples"] = 16
    return cfg


def _frozen_adapter_dir(tmp_path, seed: int = 7, lora_extra=None, **model_overrides):
    """A trained-looking LoRA adapter (random A and B, so it changes the output) of the tiny
    model, written by peft's save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from protrain.train.modeling import TINY_MODEL_CONFIG

    spec = json.loads(TINY_MODEL_CONFIG.read_text())
    spec.update(model_overrides)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    lora = LoraConfig(
        r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **(lora_extra or {})
    )
    path = tmp_path / "old_adapter"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        get_peft_model(AutoModelForCausalLM.from_config(config), lora).save_pretrained(path)
    return path


def _adapter(old_dir):
    return {
        "type": "lora",
        "r": 4,
        "dropout": 0.1,  # the resume must restore the RNG of every adapter's dropout
        "extra": [
            {"name": "style", "type": "dora", "r": 2, "target_modules": ["o_proj", "down_proj"]},
            {"name": "old", "path": str(old_dir)},
        ],
    }


def _capture_exported_model(monkeypatch):
    """The trained model as the export sees it (the engine closed: plain tensors)."""
    captured = []
    original = loop.trained_adapter_names

    def spy(model, names):
        captured.append(model)
        return original(model, names)

    monkeypatch.setattr(loop, "trained_adapter_names", spy)
    return captured


def _adapter_weights(run, name):
    sub = run.final_dir if name == "default" else run.final_dir / name
    return load_file(sub / "adapter_model.safetensors")


def test_engine_matches_plain_frozen_stays_exported_dirs_reload_and_resume(tmp_path, monkeypatch):
    from peft import PeftModel

    old_dir = _frozen_adapter_dir(tmp_path)
    adapter = _adapter(old_dir)
    captured = _capture_exported_model(monkeypatch)
    plain = train(validate_config(small_config(tmp_path / "plain", max_steps=4, adapter=adapter)))
    cfg = validate_config(
        small_config(tmp_path / "eng", max_steps=4, save_steps=2, adapter=adapter, memory=ENGINE)
    )
    engine = train(cfg)
    assert engine.losses == pytest.approx(plain.losses, rel=0, abs=1e-6)
    fsdp2 = {"fsdp_version": 2, "fsdp_config": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
    sharded = train(
        validate_config(small_config(tmp_path / "fsdp2", max_steps=4, adapter=adapter, **fsdp2))
    )
    assert sharded.losses == pytest.approx(plain.losses, rel=0, abs=1e-6)

    # one PEFT directory per trained adapter, in peft's layout; none for the frozen one
    assert sorted(p.name for p in engine.final_dir.iterdir() if p.is_dir()) == [
        "base_model",
        "style",
    ]
    for name in ("default", "style"):
        a, b = _adapter_weights(plain, name), _adapter_weights(engine, name)
        assert a.keys() == b.keys() and a
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
        c = _adapter_weights(sharded, name)
        assert c.keys() == a.keys()
        for k in a:
            torch.testing.assert_close(a[k], c[k], rtol=0, atol=1e-6)
        # trained: lora_B starts at zero
        assert all(v.abs().sum() > 0 for k, v in b.items() if "lora_B" in k), name
    assert any("lora_magnitude_vector" in k for k in _adapter_weights(engine, "style"))
    straight = {name: _adapter_weights(engine, name) for name in ("default", "style")}

    # the frozen adapter: in the trained model bit for bit as loaded, without gradient
    saved_old = load_file(old_dir / "adapter_model.safetensors")
    for trained_model in captured:
        params = dict(trained_model.named_parameters())
        for key, value in saved_old.items():
            name = key.replace(".lora_A.weight", ".lora_A.old.weight").replace(
                ".lora_B.weight", ".lora_B.old.weight"
            )
            assert torch.equal(params[name], value), name
            assert not params[name].requires_grad
        assert all(".old." not in n for n, p in params.items() if p.requires_grad)

    # no optimizer state or checkpointed weight of the frozen adapter
    state = load_file(engine.output_dir / "checkpoint-2" / "model.safetensors")
    assert state and not [k for k in state if ".old." in k]
    assert any(".style." in k for k in state) and any(".default." in k for k in state)

    # peft reloads the export (+ the frozen adapter from its own directory): same logits
    trained = captured[1].eval()  # plain, engine, FSDP2: the engine run's
    base = build_tiny_base(cfg)
    reloaded = PeftModel.from_pretrained(base, engine.final_dir)
    reloaded.load_adapter(str(engine.final_dir / "style"), adapter_name="style")
    reloaded.load_adapter(str(old_dir), adapter_name="old")
    reloaded.base_model.set_adapter(["default", "style", "old"])
    reloaded.eval()
    with torch.no_grad():
        want = trained(input_ids=IDS).logits
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, want, rtol=0, atol=1e-6)
        reloaded.base_model.set_adapter(["default", "style"])  # the frozen one counts
        assert not torch.allclose(reloaded(input_ids=IDS).logits, want, atol=1e-3)

    # resume from step 2: the same losses and bit-identical adapters
    shutil.rmtree(engine.output_dir / "checkpoint-4")
    shutil.rmtree(engine.final_dir)
    resumed = train(cfg, resume=True)
    assert resumed.losses == engine.losses[2:]
    for name, a in straight.items():
        b = _adapter_weights(resumed, name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_main_adapter_frozen_extra_trained_exports_under_their_names(tmp_path):
    """A main adapter with another name and a loaded adapter trained further: both in
    their own subfolders, the loaded one starting from its saved weights."""
    old_dir = _frozen_adapter_dir(tmp_path)
    adapter = {
        "type": "lora",
        "r": 2,
        "name": "chat",
        "target_modules": ["q_proj"],
        "extra": [{"name": "old", "path": str(old_dir), "trainable": True}],
    }
    run = train(validate_config(small_config(tmp_path / "run", max_steps=2, adapter=adapter)))
    assert not (run.final_dir / "adapter_config.json").exists()
    saved = load_file(old_dir / "adapter_model.safetensors")
    trained = load_file(run.final_dir / "old" / "adapter_model.safetensors")
    assert trained.keys() == saved.keys()
    assert all(not torch.equal(trained[k], saved[k]) for k in saved)  # trained further
    config = json.loads((run.final_dir / "chat" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["target_modules"] == ["q_proj"]


def _build(tmp_path, adapter):
    return build_model(validate_config(tiny_config(tmp_path, adapter=adapter)), None)


def test_bad_adapter_input_is_one_config_error(tmp_path):
    def error(adapter) -> str:
        with pytest.raises(ConfigError) as info:
            _build(tmp_path, adapter)
        return str(info.value)

    def extra(**item):
        return {"type": "lora", "extra": [{"name": "old", **item}]}

    message = error({"type": "lora", "extra": [{"name": "default"}]})
    assert "adapter names ['default'] appear more than once" in message
    assert "adapter.extra" in error({"type": "none", "extra": [{"name": "style"}]})
    assert "remove r" in error(extra(path=str(tmp_path), r=4))
    assert "adapter.extra.0.type = 'qlora'" in error(extra(type="qlora"))

    not_peft = tmp_path / "not_peft"
    not_peft.mkdir()
    message = error(extra(path=str(not_peft)))
    assert "adapter.extra[0].path" in message and "not a PEFT adapter directory" in message

    wider = _frozen_adapter_dir(tmp_path / "wider", hidden_size=64, intermediate_size=128)
    message = error(extra(path=str(wider)))
    assert "adapter.extra[0].path" in message and "does not fit this model" in message

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(_frozen_adapter_dir(tmp_path / "e"), elsewhere)
    config = json.loads((elsewhere / "adapter_config.json").read_text())
    config["target_modules"] = ["fc_in"]
    (elsewhere / "adapter_config.json").write_text(json.dumps(config))
    message = error(extra(path=str(elsewhere)))
    assert "adapter.extra[0].path" in message and "fc_in" in message

    with_head = _frozen_adapter_dir(tmp_path / "head", lora_extra={"modules_to_save": ["lm_head"]})
    message = error(extra(path=str(with_head)))
    assert "adapter.extra" in message and "modules_to_save" in message

    message = error({"type": "lora", "extra": [{"name": "style", "target_modules": ["fc_in"]}]})
    assert "adapter.extra[0] ('style')" in message and "fc_in" in message
