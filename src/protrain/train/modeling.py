"""Build the model, its tokenizer and its adapters from the config.

`tiny` is a built-in random-init Llama-architecture model (quickstart/model.json) with the
project's own ChatML tokenizer: nothing is downloaded. Anything else is a hub id or a local
directory loaded through `transformers`; remote code runs only when the user sets
`model.trust_remote_code`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BitsAndBytesConfig,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)
from transformers.processing_utils import ProcessorMixin

from protrain.quant import quantize_linear_4bit, quantize_linear_8bit
from protrain.train.attention import choose_attn_implementation
from protrain.train.config import (
    QUICKSTART_DIR,
    AdapterConfig,
    ExtraAdapterConfig,
    TrainConfig,
    one_line,
)
from protrain.train.data import load_processor
from protrain.train.errors import ConfigError
from protrain.train.frozen_inputs import check_adapter_dir
from protrain.train.hub_source import check_hub_source
from protrain.train.kernels import put_kernels
from protrain.train.log import logger, warn_once
from protrain.train.packing_check import packing_problem

TINY = "tiny"
TINY_MODEL_CONFIG = QUICKSTART_DIR / "model.json"
TINY_TOKENIZER_DIR = QUICKSTART_DIR / "tokenizer"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltModel:
    model: nn.Module  # a PreTrainedModel, or a peft PeftModel around one
    tokenizer: object
    is_tiny: bool


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device = {name!r} is not allowed: no CUDA GPU is present (use cpu or auto)"
        )
    return device


def resolve_autocast_dtype(
    mixed_precision: str, device: torch.device, engine: bool = False
) -> torch.dtype | None:
    """The compute dtype: autocast's for plain runs, the engine's own for engine runs.

    Autocast is refused off CUDA. The chunked engine casts its weights itself and its fp16
    path (with loss scaling) is tested on the CPU, so engine runs may use fp16 there.
    """
    if mixed_precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    if mixed_precision == "no":
        return None
    if device.type != "cuda" and not (engine and mixed_precision == "fp16"):
        allowed = "no, auto or fp16 (with the chunked engine)" if engine else "no or auto"
        raise ConfigError(
            f"mixed_precision = {mixed_precision!r} is not allowed on {device}: use {allowed}"
        )
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]


def load_tokenizer(cfg: TrainConfig):
    key = "model.tokenizer" if cfg.model.tokenizer else "model.name_or_path"
    source = cfg.model.tokenizer or (
        str(TINY_TOKENIZER_DIR) if cfg.model.name_or_path == TINY else cfg.model.name_or_path
    )
    if _looks_like_path(source) and not Path(source).exists():
        raise ConfigError(f"{key} = {source!r}: no such file or directory")
    check_hub_source(key, source, cfg.model.revision)
    if Path(source).is_dir() and not _has_tokenizer_files(Path(source)):
        hint = (
            ""
            if cfg.model.tokenizer
            else ": set model.tokenizer to the tokenizer's hub id or directory"
        )
        raise ConfigError(
            f"{key} = {source!r}: the directory holds no tokenizer files "
            f"({', '.join(TOKENIZER_FILES)}){hint}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        if _needs_remote_code(exc):
            raise ConfigError(_remote_code_message(key, source)) from None
        raise ConfigError(
            f"{key} = {source!r}: cannot load a tokenizer from it ({one_line(exc)})"
        ) from None
    if tokenizer.pad_token is None:
        warn_once(f"tokenizer of {source!r} has no pad token; using its EOS token for padding")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_media_processor(cfg: TrainConfig, auto_class: type | None = None):
    """The processor of a vision-language model (`processor_type`, default AutoProcessor):
    its rows' images reach the model through it alone. None for other models (``auto_class``:
    `model_auto_class`'s answer, read here when not given). A checkpoint whose processor
    cannot be loaded is refused: its images would be dropped from every row."""

    if cfg.model.name_or_path == TINY:
        return None
    if (auto_class or model_auto_class(cfg)) is not AutoModelForImageTextToText:
        return None
    name = cfg.model.name_or_path
    try:
        processor = load_processor(
            cfg, name, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(
            f"model.name_or_path = {name!r}: cannot load the processor of this vision-language "
            f"model ({one_line(exc)})"
        ) from None
    if not isinstance(processor, ProcessorMixin):  # AutoProcessor gave the tokenizer alone
        raise ConfigError(
            f"model.name_or_path = {name!r} is a vision-language model but "
            f"{cfg.processor_type or 'AutoProcessor'} gave a {type(processor).__name__}, not "
            "a processor: its images could not be read; save the processor beside the model "
            "or name its class in processor_type"
        )
    return processor


# A tokenizer directory holds at least one of these (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES) or any(
        directory.glob("*.tiktoken")
    )


def _needs_remote_code(exc: BaseException) -> bool:
    """transformers refuses a model or tokenizer whose code ships with it unless told to
    run that code; its message is the only sign of it."""
    return "trust_remote_code" in str(exc)


def _remote_code_message(key: str, source: str) -> str:
    return (
        f"{key} = {source!r} needs its own Python code to load (transformers does not know "
        "its model type): set model.trust_remote_code: true if you trust that code"
    )


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (`org/name`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def beyond_positions_note(cfg: TrainConfig) -> str | None:
    """The line to log when `sequence_len` passes the positions the model was trained at
    (its `max_position_embeddings`, times a rope scaling's factor). A warning, not a refusal:
    the config does not say whether a family computes past them (RoPE and ALiBi models do,
    at a quality that falls off; learned position embeddings fail with an index error),
    and only rows longer than that limit are concerned."""
    if cfg.model.name_or_path == TINY:
        config = _tiny_config()
    else:
        config = _model_config(cfg)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or cfg.sequence_len <= limit:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    factor = rope.get("factor") if rope.get("rope_type", "default") != "default" else None
    if isinstance(factor, int | float) and cfg.sequence_len <= limit * factor:
        return None
    return (
        f"sequence_len = {cfg.sequence_len} is beyond the {limit} positions of "
        f"{cfg.model.name_or_path!r} (max_position_embeddings): rows longer than {limit} "
        "tokens train at positions the model never saw (with RoPE at a lower quality, with "
        "learned position embeddings not at all: an index error); lower sequence_len, or "
        "extend the model's positions (rope_scaling in its config.json)"
    )


def build_model(cfg: TrainConfig, tokenizer) -> BuiltModel:
    """The model in the config's dtype, on the CPU, with adapters attached when asked."""
    dtype = DTYPES[cfg.model.dtype]
    is_tiny = cfg.model.name_or_path == TINY
    if is_tiny:
        model = _build_tiny(cfg, dtype)
        if cfg.adapter.type == "qlora":  # its export ships the unquantized base beside
            model = _quantize_in_process(model, cfg, dtype)
    else:
        model = _load_pretrained(cfg, dtype)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.adapter.enabled:
        model = attach_adapter(model, cfg.adapter)
    put_kernels(cfg, model, resolve_device(cfg.device))
    return BuiltModel(model=model, tokenizer=tokenizer, is_tiny=is_tiny)


def build_tiny_base(cfg: TrainConfig) -> nn.Module:
    """The built-in `tiny` model as initialized for this run (before any training)."""
    return _build_tiny(cfg, DTYPES[cfg.model.dtype])


def _tiny_config():
    spec = json.loads(TINY_MODEL_CONFIG.read_text())
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _build_tiny(cfg: TrainConfig, dtype: torch.dtype) -> nn.Module:
    config = _tiny_config()
    # Random init is seeded by the run's seed, so a resumed run rebuilds the same frozen base.
    attn = _attn_implementation(cfg, AutoModelForCausalLM, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model


def _load_pretrained(cfg: TrainConfig, dtype: torch.dtype) -> nn.Module:
    config = _model_config(cfg)  # before any weight is read
    auto_class = _auto_class_of(cfg, config)
    kwargs: dict = dict(
        dtype=dtype,
        attn_implementation=_attn_implementation(cfg, auto_class, config),
        revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    # QLoRA under the chunked engine: the base is loaded on the host and quantized here, one
    # layer at a time on the GPU, so that it never has to fit on the GPU whole.
    in_process = cfg.adapter.type == "qlora" and cfg.memory.engine_enabled
    if in_process:  # before the whole base is loaded
        _require_bitsandbytes()
    if cfg.adapter.type == "qlora" and not in_process:
        kwargs["quantization_config"] = _bnb_config(cfg.adapter)
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    name = cfg.model.name_or_path
    try:
        model = auto_class.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        if _needs_remote_code(exc):
            raise ConfigError(_remote_code_message("model.name_or_path", name)) from None
        raise ConfigError(
            f"model.name_or_path = {name!r}: cannot load it ({one_line(exc)})"
        ) from None
    if in_process:
        return _quantize_in_process(model, cfg, dtype)
    if cfg.adapter.type == "qlora":
        # peft loads only where an adapter is used (its import is slow: it loads bitsandbytes)
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.gradient_checkpointing
        )
    return model


def model_on_meta(cfg: TrainConfig) -> nn.Module | None:
    """The model's modules built from its config on the meta device: its classes and
    shapes, no weight read or allocated (a check of the model's structure before the
    data and the weights load). None where the config alone cannot build it (code that
    ships with the model, a class that refuses the meta device): the check then waits for
    the loaded model."""
    if cfg.model.name_or_path == TINY:
        spec = json.loads(TINY_MODEL_CONFIG.read_text())
        config, auto_class = (
            AutoConfig.for_model(spec.pop("model_type"), **spec),
            AutoModelForCausalLM,
        )
    elif cfg.model.trust_remote_code:
        return None
    else:
        config = _model_config(cfg)
        auto_class = _auto_class_of(cfg, config)
    try:
        with torch.device("meta"):
            return auto_class.from_config(config)
    except Exception:  # the loaded model is checked all the same
        return None


def model_auto_class(cfg: TrainConfig) -> type:
    """The `transformers` auto class that loads `model.name_or_path` whole, read from its
    config alone (no weight is loaded): AutoModelForImageTextToText for a vision-language
    model, AutoModelForCausalLM for a causal LM, AutoModelForSeq2SeqLM for a text-to-text
    encoder-decoder (trained as `protrain.train.seq2seq` says). Anything else is a
    `ConfigError` naming the model type: loaded as a causal LM, an encoder-decoder would
    lose its encoder (and BERT-like encoders would be trained to predict tokens they
    already see), so the model trained and exported would not be the one named."""
    return _auto_class_of(cfg, _model_config(cfg))


def _attn_implementation(cfg: TrainConfig, auto_class: type, config) -> str | None:
    """`model.attn_implementation`, or where unset the one the model's class supports for
    this run's rows and device (see `protrain.train.attention`); the class is read from the
    auto class's mapping, unknown (None) for remote code."""
    found = _auto_mappings()[auto_class].get(type(config), None)
    if isinstance(found, (list, tuple)):  # several architectures: the config names its own
        by_name = {c.__name__: c for c in found}
        named = [by_name[a] for a in getattr(config, "architectures", None) or [] if a in by_name]
        found = (named or list(found))[0]
    attn = choose_attn_implementation(
        cfg.model.attn_implementation,
        cfg.model.sdpa_backend,
        found,
        config,
        packing=cfg.sample_packing,
        device=resolve_device(cfg.device),
    )
    problem = packing_problem(config, attn) if cfg.sample_packing else None
    if problem is not None:
        raise ConfigError(
            f"sample_packing = true is not allowed with model.name_or_path = "
            f"{cfg.model.name_or_path!r}: {problem}; set sample_packing: false"
        )
    return attn


def _auto_mappings() -> dict[type, object]:
    """Each auto class's public config -> model class mapping (transformers' own tables)."""
    return {
        AutoModelForCausalLM: MODEL_FOR_CAUSAL_LM_MAPPING,
        AutoModelForSeq2SeqLM: MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
        AutoModelForImageTextToText: MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    }


def _model_config(cfg: TrainConfig):
    """The `transformers` config of `model.name_or_path` (no weight is read)."""
    name = cfg.model.name_or_path
    if _looks_like_path(name) and not Path(name).exists():
        raise ConfigError(f"model.name_or_path = {name!r}: no such file or directory")
    check_hub_source("model.name_or_path", name, cfg.model.revision)
    try:
        config = AutoConfig.from_pretrained(
            name, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        if _needs_remote_code(exc):
            raise ConfigError(_remote_code_message("model.name_or_path", name)) from None
        raise ConfigError(
            f"model.name_or_path = {name!r}: cannot load it ({one_line(exc)})"
        ) from None
    return config


def _auto_class_of(cfg: TrainConfig, config) -> type:
    name = cfg.model.name_or_path
    kind = model_kind(config)
    if kind == "vision-language":
        return AutoModelForImageTextToText
    if kind == "causal":
        return AutoModelForCausalLM
    if kind == "seq2seq":
        _check_seq2seq_run(cfg, config)
        return AutoModelForSeq2SeqLM
    raise ConfigError(
        f"model.name_or_path = {name!r}: model type {config.model_type!r} is {kind}; "
        "protrain train fine-tunes causal (decoder-only) language models, vision-language "
        "models and text-to-text encoder-decoder models only"
    )


def _check_seq2seq_run(cfg: TrainConfig, config) -> None:
    """What an encoder-decoder run cannot take (see `protrain.train.seq2seq`)."""
    name = cfg.model.name_or_path
    start = getattr(config, "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise ConfigError(
            f"model.name_or_path = {name!r}: the encoder-decoder model has no "
            "decoder_start_token_id in its config: the decoder's first input is not known"
        )
    if cfg.sample_packing:
        raise ConfigError(
            "sample_packing = true is not allowed with an encoder-decoder model "
            f"({config.model_type!r}): each row is split into encoder input and decoder labels"
        )
    if cfg.train_on_inputs:
        raise ConfigError(
            "train_on_inputs = true is not allowed with an encoder-decoder model "
            f"({config.model_type!r}): the prompt is the encoder's input, never a label"
        )
    listed = [("datasets", cfg.datasets), ("eval_datasets", cfg.eval_datasets)]
    for key, i, dataset in ((k, i, d) for k, ds in listed for i, d in enumerate(ds)):
        if dataset.train_on_inputs:
            raise ConfigError(
                f"{key}[{i}].train_on_inputs = true is not allowed with an encoder-decoder "
                f"model ({config.model_type!r}): the prompt is the encoder's input, never a label"
            )
        if dataset.type == "text":
            raise ConfigError(
                f"{key}[{i}].type = 'text' is not allowed with an encoder-decoder model "
                f"({config.model_type!r}): its rows have no prompt for the encoder; use chat "
                "or completion rows"
            )


# Encoder-only families that transformers also maps to a causal-LM class (BertLMHeadModel,
# ...): those classes are causal only for a checkpoint trained as a decoder (is_decoder).
def _encoder_only(config) -> bool:
    return (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_decoder", False)
        and not getattr(config, "causal", False)  # XLM's causal (CLM) checkpoints
    )


def model_kind(config) -> str:
    """'causal', 'vision-language', 'seq2seq' (a text-to-text encoder-decoder), or what else
    the model is, as the refusal says it."""
    model_type = getattr(config, "model_type", None)
    auto_map = getattr(config, "auto_map", None) or {}
    vision = type(config) in AutoModelForImageTextToText._model_mapping
    if getattr(config, "is_encoder_decoder", False):
        if vision or model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            return "an encoder-decoder model of images or speech, not supported yet"
        if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            return "seq2seq"
        return "an encoder-decoder model with no sequence-to-sequence LM class in transformers"
    # the whole VLM (vision tower included), where transformers' causal-LM class of some
    # families (Mllama, Llama 4, Qwen3.5) would keep the text model alone
    if vision:
        return "vision-language"
    if type(config) in AutoModelForCausalLM._model_mapping:
        return "an encoder-only model" if _encoder_only(config) else "causal"
    if "AutoModelForCausalLM" in auto_map:  # remote code
        return "causal"
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:  # Qwen2-Audio, Voxtral
        return "an audio-language model, not supported yet"
    return "not a causal language model (transformers has no causal-LM class for it)"


def _require_bitsandbytes() -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            "adapter.type = 'qlora' needs bitsandbytes: pip install 'protrain[qlora]'"
        ) from None


def _quantize_in_process(model: nn.Module, cfg: TrainConfig, dtype: torch.dtype) -> nn.Module:
    """`adapter.bits` base weights, quantized on the GPU when there is one: 4-bit NF4 with
    double quantization (QLoRA's recipe), or 8-bit LLM.int8 (bitsandbytes' row-wise int8);
    the output layer stays in ``dtype``. The layers compute in the run's compute dtype
    (bf16 on a GPU by default), as the engine and autocast do (8-bit layers compute in
    their input's dtype)."""
    _require_bitsandbytes()

    device = resolve_device(cfg.device)
    if cfg.adapter.bits == 8:
        return quantize_linear_8bit(
            model,
            threshold=cfg.adapter.int8_threshold,
            quant_device="cuda" if device.type == "cuda" else None,
        )
    compute = resolve_autocast_dtype(cfg.mixed_precision, device, cfg.memory.engine_enabled)
    return quantize_linear_4bit(
        model,
        compute_dtype=compute or dtype,
        quant_device="cuda" if device.type == "cuda" else None,
    )


def _bnb_config(adapter: AdapterConfig) -> BitsAndBytesConfig:
    _require_bitsandbytes()
    if not torch.cuda.is_available():
        raise ConfigError("adapter.type = 'qlora' needs a CUDA GPU; none is present")
    return bnb_quantization_config(adapter)


def bnb_quantization_config(adapter: AdapterConfig) -> BitsAndBytesConfig:
    """transformers' ``BitsAndBytesConfig`` for ``adapter.bits`` (the 8-bit outlier threshold
    the one ``quantize_linear_8bit`` gets under the engine: the same math either way)."""
    if adapter.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=adapter.int8_threshold)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def is_seq2seq(model: nn.Module) -> bool:
    """An encoder-decoder model (inside a PEFT wrapper or not)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return bool(getattr(getattr(base, "config", None), "is_encoder_decoder", False))


def attach_adapter(model: nn.Module, adapter: AdapterConfig) -> nn.Module:
    """The peft model: the main adapter, then `adapter.extra` (new ones added, existing
    ones loaded from their PEFT directories), all active in the forward; the frozen ones
    get no gradient (and so no optimizer state: the trainables take `requires_grad`)."""
    # peft loads only where an adapter is used (its import is slow: it loads bitsandbytes)
    from peft import get_peft_model

    task = "SEQ_2_SEQ_LM" if is_seq2seq(model) else "CAUSAL_LM"
    try:
        model = get_peft_model(model, _lora_config(adapter, task), adapter_name=adapter.name)
    except ValueError as exc:
        raise ConfigError(f"adapter.target_modules = {adapter.target_modules!r}: {exc}") from None
    if adapter.extra:
        training = model.training  # peft's load_adapter of a frozen adapter sets eval()
        for i, extra in enumerate(adapter.extra):
            if extra.path is None:
                _add_new_adapter(model, extra, f"adapter.extra[{i}]", task)
            else:
                _load_existing_adapter(model, extra, f"adapter.extra[{i}]")
        # every adapter in the forward (peft's multi-adapter API, which marks them all
        # trainable), then the frozen ones frozen
        try:
            model.base_model.set_adapter(adapter.all_names)
        except ValueError as exc:  # e.g. modules_to_save, one active adapter at a time
            raise ConfigError(
                f"adapter.extra: peft cannot make {adapter.all_names} active together: "
                f"{one_line(exc)}; allowed: LoRA/DoRA adapters of the model's layers alone"
            ) from None
        _freeze_adapters(model, [e.name for e in adapter.extra if not e.is_trainable])
        _check_trained_are_adapters(model, adapter.trained_names)
        model.train(training)
    _log_adapters(model, adapter)
    return model


def _lora_config(spec, task: str):
    # peft loads only where an adapter is used (its import is slow: it loads bitsandbytes)
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        use_dora=spec.type == "dora",
        task_type=task,
    )


def _add_new_adapter(model: nn.Module, extra: ExtraAdapterConfig, key: str, task: str) -> None:
    try:
        model.add_adapter(extra.name, _lora_config(extra, task))
    except ValueError as exc:
        raise ConfigError(
            f"{key} ({extra.name!r}): peft refuses it next to the other adapters: "
            f"{one_line(exc)}; allowed: type lora or dora with target_modules of this model"
        ) from None


def _load_existing_adapter(model: nn.Module, extra: ExtraAdapterConfig, key: str) -> None:
    """A PEFT LoRA adapter directory loaded as adapter ``extra.name``: every one of its
    weights must land on a module of this model with its shape."""
    path = check_adapter_dir(extra, key)
    config_file = path / "adapter_config.json"
    try:
        saved = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ConfigError(f"{key}.path: {config_file} is not JSON ({exc})") from None
    if saved.get("peft_type") != "LORA":
        raise ConfigError(
            f"{key}.path = {extra.path!r} holds a {saved.get('peft_type')!r} adapter; "
            "allowed: LORA adapters (LoRA, DoRA, QLoRA)"
        )
    try:
        result = model.load_adapter(
            str(path), adapter_name=extra.name, is_trainable=extra.is_trainable
        )
    except (ValueError, RuntimeError, KeyError) as exc:  # modules absent, or other shapes
        raise ConfigError(
            f"{key}.path = {extra.path!r} does not fit this model (an adapter of another "
            f"base model?): {one_line(exc)}"
        ) from None
    missing = [k for k in result.missing_keys if f".{extra.name}." in k]
    if missing:
        raise ConfigError(
            f"{key}.path = {extra.path!r} lacks weights for {len(missing)} of its modules "
            f"(first: {missing[0]}): an adapter of another base model?"
        )
    base_name = getattr(model.get_base_model().config, "_name_or_path", "")
    saved_base = saved.get("base_model_name_or_path") or ""
    if base_name and saved_base and Path(base_name).name != Path(saved_base).name:
        warn_once(
            f"{key}.path = {extra.path!r} was trained on {saved_base!r}, this model is "
            f"{base_name!r}; its shapes fit this one, so it is used",
        )


def _freeze_adapters(model: nn.Module, names: list[str]) -> None:
    params = dict(model.named_parameters())
    by_adapter = adapter_parameter_names(model)
    for name in names:
        for param_name in by_adapter[name]:
            params[param_name].requires_grad_(False)


def _check_trained_are_adapters(model: nn.Module, trained: list[str]) -> None:
    """What trains is the trained adapters' LoRA weights and nothing else: the export
    writes those alone, so any other trainable weight would be trained and lost."""
    by_adapter = adapter_parameter_names(model)
    allowed = {n for name in trained for n in by_adapter[name]}
    other = [n for n, p in model.named_parameters() if p.requires_grad and n not in allowed]
    if other:
        raise ConfigError(
            f"adapter.extra: {len(other)} trainable weights belong to no trained adapter's "
            f"LoRA layers (first: {other[0]}), e.g. an adapter with modules_to_save; "
            "allowed: LoRA/DoRA adapters of the model's layers alone"
        )


def adapter_parameter_names(model: nn.Module) -> dict[str, list[str]]:
    """Adapter name -> the names of its parameters, for every adapter of a peft model (read
    from its tuner layers, not from name patterns, which an adapter named like a module
    would match)."""
    # peft loads only where an adapter is used (its import is slow: it loads bitsandbytes)
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: dict[str, list[str]] = {name: [] for name in model.peft_config}
    for module_name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for attr in module.adapter_layer_names:
            for key, layer in getattr(module, attr).items():
                prefix = f"{module_name}.{attr}.{key}"
                if isinstance(layer, nn.Parameter):
                    out.setdefault(key, []).append(prefix)
                else:
                    names = [f"{prefix}.{n}" for n, _ in layer.named_parameters()]
                    out.setdefault(key, []).extend(names)
    return out


def trained_adapter_names(model: nn.Module, trained: list[str]) -> list[str] | None:
    """The adapters of a peft model that hold some of the ``trained`` parameter names, in
    the model's order; None for a model without adapters."""
    if not hasattr(model, "peft_config"):
        return None
    trained_set = set(trained)
    return [
        name
        for name, params in adapter_parameter_names(model).items()
        if trained_set.intersection(params)
    ]


def _log_adapters(model: nn.Module, adapter: AdapterConfig) -> None:
    n_all = sum(p.numel() for p in model.parameters())
    params = dict(model.named_parameters())
    specs = {adapter.name: adapter, **{e.name: e for e in adapter.extra}}
    for name, names in adapter_parameter_names(model).items():
        n_params = sum(params[n].numel() for n in names)
        n_train = sum(params[n].numel() for n in names if params[n].requires_grad)
        spec = specs[name]
        source = f"from {spec.path}" if getattr(spec, "path", None) else f"{spec.type} r={spec.r}"
        logger.info(
            "adapter %r (%s): %s parameters, %s (%.2f%% of %s)",
            name,
            source,
            f"{n_params:,}",
            f"{n_train:,} trained" if n_train else "frozen",
            100.0 * n_train / max(n_all, 1),
            f"{n_all:,}",
        )
