"""The layer class named as FSDP2's unit is checked against the model built from its config
on the meta device, before the data is read and the weights load: a config with a wrong
class and a bad row reports the class (the check of the loaded model came after the data)."""

from __future__ import annotations

import subprocess
import sys

from tests.train.helpers import QUICKSTART_DATA, tiny_config, write_config


def test_a_missing_wrap_class_is_refused_before_the_data_is_read(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(QUICKSTART_DATA.read_text() + '{"messages": 5}\n')
    cfg = tiny_config(tmp_path, datasets=[{"path": str(rows), "type": "chat"}], fsdp_version=2)
    cfg["fsdp_config"] = {"transformer_layer_cls_to_wrap": "NoSuchLayer"}
    config = write_config(tmp_path, cfg)
    done = subprocess.run(
        [sys.executable, "-m", "protrain", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "no module of class NoSuchLayer in LlamaForCausalLM" in errors[0], errors
    assert "LlamaDecoderLayer" in errors[0], errors
