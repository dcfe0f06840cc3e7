"""One INFO line per dataset with the resolved masking settings."""

from __future__ import annotations

from pathlib import Path

from protrain.train.data.config import DataSettings
from protrain.train.data.masks import resolve_mask_settings
from protrain.train.data.templates import BUILTIN_TEMPLATES


def _template_name(spec: str | None) -> str:
    if spec is None:
        return "the tokenizer's own"
    if spec in BUILTIN_TEMPLATES:
        return spec
    if "{{" in spec or "{%" in spec:
        return "a Jinja string"
    return f"file {Path(spec).name}"


def describe_masking(settings: DataSettings) -> list[str]:
    """Lines such as `dataset 'a.jsonl' (chat, template chatml): trains roles ['assistant'] ...`."""
    lines = []
    groups = [("train", settings.datasets), ("eval", settings.eval_datasets)]
    for split, configs in groups:
        for cfg in configs:
            mask = resolve_mask_settings(settings, cfg)
            head = f"{split} dataset {cfg.path!r} ({cfg.type}"
            if cfg.type == "chat":
                spec = (
                    cfg.chat_template if cfg.chat_template is not None else settings.chat_template
                )
                head += f", chat template: {_template_name(spec)}"
            head += ")"
            if cfg.type == "text":
                what = "trains every token"
            elif mask.train_on_inputs:
                what = "trains every token (train_on_inputs=True)"
            elif cfg.type == "completion":
                what = f"trains the completion; train_on_eos={mask.train_on_eos}"
            else:
                what = (
                    f"trains roles {list(mask.roles_to_train)}; train_on_eos={mask.train_on_eos}; "
                    f"train_on_tool_calls={mask.train_on_tool_calls}; "
                    "headers, media tokens and padding never trained"
                )
            if cfg.type == "chat" and settings.role_boundaries is not None:
                what += f"; turns found by role_boundaries from the config ({len(settings.role_boundaries)} entries)"
            lines.append(f"{head}: {what}; sample_packing={settings.sample_packing}")
    return lines
