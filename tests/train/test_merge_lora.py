"""`protrain merge-lora`: a LoRA or DoRA adapter merged into a tiny local base (built from a
config, no download) gives a plain model whose logits equal base + adapter's, that loads
with AutoModelForCausalLM and generates; what cannot be merged is one line."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from protrain.cli import main
from protrain.train.config import validate_config
from protrain.train.loop import train
from protrain.train.modeling import TINY_MODEL_CONFIG, TINY_TOKENIZER_DIR

from .helpers import tiny_config

TOKENS = torch.tensor([[1, 17, 42, 99, 7, 300, 5, 11], [1, 8, 9, 250, 31, 2, 64, 3]])


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """The built-in tiny Llama at a fixed random init, saved with its tokenizer."""
    path = tmp_path_factory.mktemp("base") / "base"
    spec = json.loads(TINY_MODEL_CONFIG.read_text())
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR).save_pretrained(path)
    return path


def _adapter(base_dir: Path, out: Path, *, dora: bool, with_tokenizer: bool) -> Path:
    """A trained-looking adapter: random B (peft's init makes B zero, a no-op to merge), and
    for DoRA a magnitude moved off the weight norms it starts at."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora, init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
            if "lora_magnitude" in name:
                p.mul_(1 + 0.1 * torch.rand_like(p))
    peft_model.save_pretrained(out)
    if with_tokenizer:
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


def _unmerged_logits(base_dir: Path, adapter: Path, dtype: torch.dtype) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _merged(path: Path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_the_merged_model_is_base_plus_adapter(tmp_path, base_dir, dora):
    adapter = _adapter(base_dir, tmp_path / "adapter", dora=dora, with_tokenizer=dora)
    out = tmp_path / "merged"
    assert main(["merge-lora", str(adapter), str(out)]) == 0
    assert not (out / "adapter_config.json").exists()
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # the adapter folder's tokenizer (DoRA case), else the base's
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"]

    want = _unmerged_logits(base_dir, adapter, torch.float32)
    merged = _merged(out)
    assert merged.dtype == torch.float32
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(TOKENS).logits
    # W x + B (A x) against (W + B A) x: the two differ by fp32 rounding of sums of a few
    # hundred products, far below the adapter's own effect on the logits
    plain = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        effect = (want - plain(TOKENS).logits).abs().max().item()
    assert effect > 1e-2, "the adapter must change the logits for the test to mean anything"
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())

    # greedy generation: the merged model continues as base + adapter does
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), str(adapter)
    ).eval()
    prompt = TOKENS[:1, :4]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    generated = merged.generate(prompt, **kw)
    assert generated.shape == (1, 10)
    assert torch.equal(generated, peft_model.generate(input_ids=prompt, **kw))


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_bf16_merge_matches_to_bf16_tolerance(tmp_path, base_dir, dora):
    adapter = _adapter(base_dir, tmp_path / "adapter", dora=dora, with_tokenizer=False)
    out = tmp_path / "merged"
    assert main(["merge-lora", str(adapter), str(out), "--dtype", "bfloat16"]) == 0
    merged = _merged(out)
    assert merged.dtype == torch.bfloat16
    with torch.no_grad():
        got = merged(TOKENS).logits.float()
    want = _unmerged_logits(base_dir, adapter, torch.float32)
    # bf16 keeps 8 bits of mantissa: weights and activations each round at 2^-9 relative
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * scale)


def test_base_from_option_and_shipped_folder(tmp_path, base_dir):
    """--base wins over adapter_config.json; a `base_model/` folder beside the adapter (as a
    run of the tiny model exports) is used when --base is not given."""
    adapter = _adapter(base_dir, tmp_path / "adapter", dora=False, with_tokenizer=False)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert main(["merge-lora", str(adapter), str(tmp_path / "a"), "--base", str(base_dir)]) == 0
    shutil.copytree(base_dir, adapter / "base_model")
    assert main(["merge-lora", str(adapter), str(tmp_path / "b")]) == 0
    a = _merged(tmp_path / "a").state_dict()
    b = _merged(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _error(capsys) -> str:
    # transformers' progress bars (loading the base) aside
    err = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.strip() and "it/s]" not in line
    ]
    assert len(err) == 1 and err[0].startswith("error: merge-lora: "), err
    return err[0]


def test_what_cannot_be_merged_is_one_line(tmp_path, base_dir, capsys):
    out = str(tmp_path / "out")
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "adapter_config.json").write_text("{}")
    assert main(["merge-lora", str(run), out]) == 2
    line = _error(capsys)
    assert "not a PEFT adapter directory" in line
    assert f"the run's adapter is in '{run / 'final'}'" in line

    assert main(["merge-lora", str(base_dir), out]) == 2
    assert "holds a whole model" in _error(capsys)
    assert main(["merge-lora", str(tmp_path / "nowhere"), out]) == 2
    assert "no such directory" in _error(capsys)

    (run / "final" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    assert main(["merge-lora", str(run / "final"), out]) == 2
    assert "'IA3' adapter; merge-lora merges LoRA and DoRA" in _error(capsys)

    adapter = _adapter(base_dir, tmp_path / "adapter", dora=False, with_tokenizer=False)
    capsys.readouterr()  # the set-up's progress bars
    missing = str(tmp_path / "gone" / "base")
    assert main(["merge-lora", str(adapter), out, "--base", missing]) == 2
    assert f"the base model {missing!r} (--base) is not a directory" in _error(capsys)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert main(["merge-lora", str(adapter), out]) == 2
    assert "names no base model" in _error(capsys)
    assert not Path(out).exists()


def test_an_existing_output_is_kept_unless_forced(tmp_path, base_dir, capsys):
    adapter = _adapter(base_dir, tmp_path / "adapter", dora=False, with_tokenizer=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier work")
    capsys.readouterr()  # the set-up's progress bars
    assert main(["merge-lora", str(adapter), str(out)]) == 2
    assert "already exists" in _error(capsys) and (out / "keep.txt").exists()
    assert main(["merge-lora", str(adapter), str(adapter)]) == 2
    assert "would replace the adapter" in _error(capsys)
    assert main(["merge-lora", str(adapter), str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, base_dir, capsys, monkeypatch):
    adapter = _adapter(base_dir, tmp_path / "adapter", dora=False, with_tokenizer=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier work")

    def full(self, path, *args, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", full)
    capsys.readouterr()  # the set-up's progress bars
    assert main(["merge-lora", str(adapter), str(out), "--force"]) == 2
    line = _error(capsys)
    assert "no space left on the device" in line and "nothing was written" in line
    assert (out / "keep.txt").exists(), "the existing output is kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out"], "no partial copy"


def test_a_runs_exported_adapter_merges(tmp_path):
    """The app's own export of a `tiny` DoRA run (adapter, tokenizer and the base shipped in
    `final/base_model`) merges with no option."""
    cfg = tiny_config(tmp_path, adapter={"type": "dora", "r": 4}, max_steps=2, sequence_len=32)
    final = train(validate_config(cfg)).final_dir
    assert main(["merge-lora", str(final), str(tmp_path / "merged")]) == 0
    want = _unmerged_logits(final / "base_model", final, torch.float32)
    with torch.no_grad():
        got = _merged(tmp_path / "merged")(TOKENS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * want.abs().max().item())
