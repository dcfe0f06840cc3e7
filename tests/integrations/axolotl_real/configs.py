"""The configs ``make test-axolotl`` trains with the real axolotl, written into a work folder:

- ``example``: ``examples/axolotl/protrain.yaml`` with absolute paths;
- ``lora-1b``: axolotl's own ``examples/llama-3/lora-1b.yml`` (``lora-1b.yml`` here, as
  axolotl ships it) pointed at the tiny local model and local alpaca-format data
  (``base_model``, ``datasets``, ``output_dir``), plus the plugin line and a
  ``protrain_memory`` section: no other key is changed.

    python tests/integrations/axolotl_real/configs.py {example,lora-1b} WORK_DIR > config.yml
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CHAT = REPO / "src/protrain/train/quickstart/data/chat.jsonl"
PLUGIN = "protrain.integrations.axolotl.ProTrainPlugin"
# One 512 KiB chunk stays on the device (n_persist: 1), the rest move. lora-1b packs 2 x 2048
# tokens a micro-batch (sample_packing, sequence_len 2048): the smallest plan for that needs
# 0.13 GiB on the tiny model, so its budget is larger than the example's 100 MiB.
MEMORY = {"auto": True, "gpu_budget": "256MiB", "n_persist": 1, "chunk_size": "512KiB"}


def alpaca_rows(out: Path) -> Path:
    """The quickstart chats as alpaca rows (instruction, input, output)."""
    path = out / "alpaca.jsonl"
    with path.open("w") as f:
        for line in CHAT.read_text().splitlines():
            turns = {m["role"]: m["content"] for m in json.loads(line)["messages"]}
            row = {"instruction": turns["user"], "input": "", "output": turns["assistant"]}
            f.write(json.dumps(row) + "\n")
    return path


def example(work: Path) -> dict:
    cfg = yaml.safe_load((REPO / "examples/axolotl/protrain.yaml").read_text())
    cfg["base_model"] = str(work / "tiny-llama")
    cfg["datasets"][0]["path"] = str(CHAT)
    cfg["dataset_prepared_path"] = str(work / "example-prepared")
    cfg["output_dir"] = str(work / "example-out")
    return cfg


def lora_1b(work: Path) -> dict:
    cfg = yaml.safe_load((HERE / "lora-1b.yml").read_text())
    cfg["base_model"] = str(work / "tiny-llama")
    cfg["datasets"] = [{"path": str(alpaca_rows(work)), "type": "alpaca", "ds_type": "json"}]
    cfg["output_dir"] = str(work / "lora-1b-out")
    cfg["plugins"] = [PLUGIN]
    cfg["protrain_memory"] = dict(MEMORY)
    return cfg


if __name__ == "__main__":
    which, work = sys.argv[1], Path(sys.argv[2])
    print(yaml.safe_dump({"example": example, "lora-1b": lora_1b}[which](work), sort_keys=False))
