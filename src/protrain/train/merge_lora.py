"""`protrain merge-lora ADAPTER OUTPUT_DIR`: a trained LoRA or DoRA adapter merged into its
base model, written as a plain Hugging Face model (safetensors, config, tokenizer) that
loads with `AutoModelForCausalLM.from_pretrained` and needs no peft.

    protrain merge-lora outputs/run/final outputs/run-merged
    protrain merge-lora outputs/run/final merged --base meta-llama/Llama-3.2-1B --dtype bfloat16

The merge is peft's own `merge_and_unload`: each adapted weight becomes W + scale * B @ A
(DoRA: rescaled by its magnitude vector), computed in the dtype the base is loaded in
(`--dtype`; default the checkpoint's own). The base is, first found: `--base`, the
`base_model/` folder a run of the built-in `tiny` model ships beside its adapter, or the
`base_model_name_or_path` of the adapter's `adapter_config.json`. A QLoRA adapter merges
into the unquantized base (the weights the quantized ones approximate). The tokenizer is the
adapter folder's (the run's export writes it there), else the base's.
Another adapter of the run (`final/<name>/`) merges alone by naming its folder; the adapters
are not merged together.

OUTPUT_DIR is written whole under another name and then put in place (`final_dir.publish`):
a failed merge (a full disk) leaves no partial model, and an existing OUTPUT_DIR is kept
unless `--force` replaces it.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
)

from protrain.train.checkpoint.final_dir import publish, tmp_dir
from protrain.train.errors import ConfigError, OutputDirError
from protrain.train.log import logger
from protrain.train.modeling import DTYPES, TOKENIZER_FILES, model_kind
from protrain.train.run_lock import check_free_space

ADAPTER_CONFIG = "adapter_config.json"
SHIPPED_BASE = "base_model"  # beside the adapter of a `tiny` run (loop._tiny_base_writer)
MERGEABLE = ("LORA",)  # peft_type of LoRA and DoRA (use_dora) adapters


class MergeError(ConfigError):
    """The adapter or base named on the command line cannot be merged as asked."""


def merge_lora(
    adapter_dir: Path,
    output_dir: Path,
    *,
    base: str | None = None,
    dtype: str = "auto",
    force: bool = False,
) -> Path:
    """Merge the adapter in ``adapter_dir`` into its base and write ``output_dir``;
    ``dtype`` is `auto` (the base checkpoint's) or a key of `DTYPES`."""
    adapter_dir, output_dir = Path(adapter_dir), Path(output_dir)
    peft_config = read_adapter_config(adapter_dir)
    base = resolve_base(adapter_dir, peft_config, base)
    _check_output_dir(output_dir, adapter_dir, base, force)
    model = _merged_model(adapter_dir, base, dtype)
    tokenizer = _tokenizer(adapter_dir, base)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    check_free_space(output_dir.parent, model_bytes, "the merged model")
    tmp = tmp_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        publish(tmp, output_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = " (the existing one is kept)" if output_dir.exists() else ""
            raise OutputDirError(
                f"merge-lora: no space left on the device while writing {str(output_dir)!r}: the merged "
                f"model needs about {model_bytes / 2**20:,.0f} MiB; nothing was written{kept}"
            ) from None
        raise
    logger.info("merged %s into %s: written to %s", adapter_dir, base, output_dir)
    return output_dir


def read_adapter_config(adapter_dir: Path) -> dict:
    """The adapter's `adapter_config.json`, checked to be a LoRA or DoRA adapter."""
    if not adapter_dir.is_dir():
        raise MergeError(f"merge-lora: {str(adapter_dir)!r}: no such directory")
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        hint = ""
        if (adapter_dir / "final" / ADAPTER_CONFIG).is_file():
            hint = f"; the run's adapter is in {str(adapter_dir / 'final')!r}"
        elif (adapter_dir / "config.json").is_file():
            hint = "; it holds a whole model, which has no adapter to merge"
        raise MergeError(
            f"merge-lora: {str(adapter_dir)!r} is not a PEFT adapter directory (no "
            f"{ADAPTER_CONFIG}){hint}"
        )
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise MergeError(f"merge-lora: {path} is not valid JSON ({exc})") from None
    peft_type = config.get("peft_type") if isinstance(config, dict) else None
    if peft_type not in MERGEABLE:
        raise MergeError(
            f"merge-lora: {path} is a {peft_type!r} adapter; merge-lora merges LoRA and DoRA "
            "adapters (peft_type 'LORA')"
        )
    return config


def resolve_base(adapter_dir: Path, peft_config: dict, base: str | None) -> str:
    """The base model's directory or hub id (see the module's docstring for the order)."""
    if base is None and (adapter_dir / SHIPPED_BASE / "config.json").is_file():
        return str(adapter_dir / SHIPPED_BASE)
    where = "--base"
    if base is None:
        base = peft_config.get("base_model_name_or_path")
        where = f"{ADAPTER_CONFIG}'s base_model_name_or_path"
    if not base:
        raise MergeError(
            f"merge-lora: {str(adapter_dir)!r} names no base model (its {ADAPTER_CONFIG} has "
            "no base_model_name_or_path): pass --base with the model it was trained on"
        )
    is_path = base.startswith((".", "/", "~")) or base.count("/") > 1
    if is_path and not Path(base).expanduser().is_dir():
        raise MergeError(
            f"merge-lora: the base model {base!r} ({where}) is not a directory; pass --base "
            "with the model the adapter was trained on"
        )
    return str(Path(base).expanduser()) if is_path else base


def _check_output_dir(output_dir: Path, adapter_dir: Path, base: str, force: bool) -> None:
    out = output_dir.resolve()
    for source, what in ((adapter_dir, "the adapter"), (Path(base), "the base model")):
        src = source.resolve()
        if source.exists() and (out == src or src.is_relative_to(out)):
            raise OutputDirError(
                f"merge-lora: the output {str(output_dir)!r} would replace {what} it is "
                "merged from; choose another output directory"
            )
    if output_dir.exists() and not force:
        raise OutputDirError(
            f"merge-lora: {str(output_dir)!r} already exists; choose another output "
            "directory, or pass --force to replace it"
        )


def _merged_model(adapter_dir: Path, base: str, dtype: str) -> torch.nn.Module:
    # peft loads only where an adapter is used (its import is slow: it loads bitsandbytes)
    from peft import PeftModel

    try:
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise MergeError(
            f"merge-lora: the base model {base!r} could not be loaded: {_first_line(exc)}"
        ) from None
    auto_class = _auto_class(config, base)
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    model = auto_class.from_pretrained(base, dtype=torch_dtype)
    try:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (KeyError, RuntimeError, ValueError) as exc:  # names or shapes of another model
        raise MergeError(
            f"merge-lora: the adapter {str(adapter_dir)!r} does not fit the base model "
            f"{base!r}: {_first_line(exc)}; pass --base with the model it was trained on"
        ) from None
    return model.merge_and_unload()


def _auto_class(config, base: str) -> type:
    kind = model_kind(config)
    classes = {
        "causal": AutoModelForCausalLM,
        "vision-language": AutoModelForImageTextToText,
        "seq2seq": AutoModelForSeq2SeqLM,
    }
    if kind not in classes:
        raise MergeError(f"merge-lora: the base model {base!r} is {kind}")
    return classes[kind]


def _tokenizer(adapter_dir: Path, base: str):
    """The adapter folder's tokenizer, else the base's; None (logged) where neither has one."""
    has_own = any((adapter_dir / name).is_file() for name in TOKENIZER_FILES)
    for source in ([str(adapter_dir)] if has_own else []) + [base]:
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            logger.warning("merge-lora: no tokenizer read from %s (%s)", source, _first_line(exc))
    logger.warning("merge-lora: the merged model is written without a tokenizer")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
