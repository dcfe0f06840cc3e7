"""The training config: one pydantic schema for the YAML file of `protrain train`.

Keys are flat at the top level, like axolotl's, where the meaning is the same
(`sequence_len`, `micro_batch_size`, `gradient_accumulation_steps`, `learning_rate`, ...);
the model, the adapter, evaluation and memory have their own sections. The data keys
(`datasets`, `chat_template`, `train_on_inputs`, ...) come from `protrain.train.data`.

Every validation error names the key, the bad value and what is allowed, and a misspelled
key gets the closest known key as a suggestion. Nothing here loads a model or touches disk
beyond reading the YAML file.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import math
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import torch
import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from protrain.knobs import Knobs
from protrain.train.data import DataSettings
from protrain.train.data.errors import not_utf8_place
from protrain.train.errors import ConfigError
from protrain.train.tracking import TrackingSettings

QUICKSTART_DIR = Path(__file__).resolve().parent / "quickstart"
QUICKSTART_CONFIG = QUICKSTART_DIR / "config.yaml"

# transformers.SchedulerType values that need no extra arguments beyond warmup and length.
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


# axolotl's names of the optimizers built here -> the engine's (protrain/optim/adamw_8bit.py)
ENGINE_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_bnb_8bit": "adamw_8bit"}
OPTIMIZERS = tuple(ENGINE_OPTIMIZERS)


# protrain.model.kernels.KERNELS, spelled here so that the config imports no torch module
KernelName = Literal["rms_norm", "swiglu", "geglu", "rope", "fused_linear_cross_entropy"]


def _not_a_bool(cls: type[BaseModel], value: Any, info) -> Any:
    """pydantic takes true for 1 in a number's field: `save_steps: true` would save every
    step. A number's field (int or float, optional or not) refuses true and false."""
    if not isinstance(value, bool):
        return value
    annotation = cls.model_fields[info.field_name].annotation
    kinds = set(get_args(annotation)) | {annotation}
    numbers = [k for k in kinds if isinstance(k, type) and issubclass(k, (int, float))]
    if bool not in kinds and numbers:  # ByteSize too (an int)
        raise ValueError("a number is needed here, not true or false")
    return value


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are re-validated on set."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    _numbers_not_bools = field_validator("*", mode="before")(classmethod(_not_a_bool))


class ModelConfig(StrictModel):
    name_or_path: str = Field(
        "tiny", description="Hub id, local directory, or `tiny` (built-in random Llama)."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer hub id or directory; defaults to the model's."
    )
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the trained weights (the master copy)."
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] | None = (
        Field(
            None,
            description="Unset: sdpa where the model supports it, else eager (logged). "
            "Set: used as given.",
        )
    )
    sdpa_backend: Literal["default", "flash", "cudnn", "efficient", "math"] = Field(
        "default",
        description="The SDPA kernel forced for the whole run (attn_implementation: sdpa); "
        "default: torch's choice. At long context cudnn ran causal attention 1.66x faster "
        "than flash on an H200.",
    )
    trust_remote_code: bool = False
    kernels: Literal["auto", "none"] | list[KernelName] = Field(
        "auto",
        description="Liger Kernel's fused kernels (protrain[kernels]): auto = every kernel "
        "of the family on a CUDA GPU where liger-kernel is installed, else none (logged); "
        "none; or a list of rms_norm, swiglu, geglu, rope, fused_linear_cross_entropy "
        "(the loss without a logits tensor; it replaces memory.chunked_loss_tokens).",
    )

    @model_validator(mode="after")
    def _check_sdpa_backend(self) -> ModelConfig:
        # unset: the backend asks for sdpa (refused at load where the model lacks it)
        if self.sdpa_backend != "default" and self.attn_implementation not in (None, "sdpa"):
            raise ValueError(
                f"model.sdpa_backend = {self.sdpa_backend!r} needs model.attn_implementation "
                f"= 'sdpa' (it is {self.attn_implementation!r}); leave sdpa_backend at "
                "'default' for other attention implementations"
            )
        return self


# an adapter's name is a key of peft's ModuleDicts and a subfolder of the export
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]+")
# subfolders of a run's `final/` that are not adapters (the tiny base beside an adapter)
RESERVED_ADAPTER_NAMES = ("base_model",)
LORA_TARGETS_DESCRIPTION = "Module names (or all-linear) the adapter wraps."


def _check_adapter_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError("an adapter name is letters, digits, '_' and '-' (no dots or spaces)")
    if name in RESERVED_ADAPTER_NAMES:
        raise ValueError(f"{name!r} is the folder of the tiny base model; choose another name")
    return name


def _set_off_default(model: BaseModel, names: set[str]) -> set[str]:
    """The fields of ``names`` set to a value other than their default. A key written with
    its default value says nothing: the config a run records (every key, defaults included)
    must load back as it was."""
    fields = type(model).model_fields
    return {
        n
        for n in names & model.model_fields_set
        if getattr(model, n) != fields[n].get_default(call_default_factory=True)
    }


class ExtraAdapterConfig(StrictModel):
    """One more adapter on the same model, active in every forward next to the main one:
    a new LoRA/DoRA adapter (type, r, ...) or one loaded from a PEFT adapter directory
    (path), whose own adapter_config.json then decides its shape."""

    name: str
    path: str | None = Field(
        None, description="A PEFT adapter directory (adapter_config.json) to load it from."
    )
    trainable: bool | None = Field(
        None,
        description="Trained with the main adapter; default: true when new, false "
        "when loaded from path (frozen: in the forward, no gradient, no optimizer state).",
    )
    type: Literal["lora", "dora"] = "lora"
    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description=LORA_TARGETS_DESCRIPTION
    )

    _check_name = field_validator("name")(_check_adapter_name)

    @model_validator(mode="after")
    def _check_source(self) -> ExtraAdapterConfig:
        shape = sorted(_set_off_default(self, {"type", "r", "alpha", "dropout", "target_modules"}))
        if self.path is not None and shape:
            raise ValueError(
                f"adapter {self.name!r}: path and {', '.join(shape)} both set: an adapter loaded "
                "from path has the shape its adapter_config.json says; remove "
                f"{', '.join(shape)}, or remove path to make a new adapter"
            )
        if self.path is None and self.trainable is False:
            raise ValueError(
                f"adapter {self.name!r}: trainable = false for a new adapter (no path): it would "
                "stay at its initial value, which adds nothing; set path to load a trained "
                "adapter, or make it trainable"
            )
        return self

    @property
    def is_trainable(self) -> bool:
        return self.trainable if self.trainable is not None else self.path is None


class AdapterConfig(StrictModel):
    type: Literal["none", "lora", "qlora", "dora"] = "none"
    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description=LORA_TARGETS_DESCRIPTION
    )
    bits: Literal[4, 8] = Field(
        4, description="Base-weight bits for qlora: 4 (NF4, double quantization) or 8 (LLM.int8)."
    )
    int8_threshold: float = Field(
        6.0,
        description="qlora with bits 8: LLM.int8's outlier threshold on activations (input "
        "columns holding a larger value multiply in 16 bits); 6.0 as transformers', 0 "
        "quantizes every column. The same with or without the chunked engine.",
    )
    name: str = Field(
        "default", description="The main adapter's name (peft's; `default` exports to final/)."
    )
    extra: list[ExtraAdapterConfig] = Field(
        default_factory=list,
        description="More adapters on the same model, trained with the main one or frozen.",
    )

    _check_name = field_validator("name")(_check_adapter_name)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        # `adapter: lora` is shorthand for `adapter: {type: lora}`.
        if isinstance(value, str):
            return {"type": value}
        return value

    @field_validator("int8_threshold", mode="before")
    @classmethod
    def _check_int8_threshold(cls, value: Any) -> Any:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value >= 0):
            raise ValueError(
                "use a finite number >= 0 (6.0 by default, as transformers'; 0 quantizes "
                "every input column)"
            )
        return value

    @field_validator("extra")
    @classmethod
    def _check_extra(cls, extra: list[ExtraAdapterConfig], info) -> list[ExtraAdapterConfig]:
        if not extra:
            return extra
        if info.data.get("type", "none") == "none":
            raise ValueError(
                "more adapters need a main one: set adapter.type to lora, qlora or dora"
            )
        names = [info.data.get("name", "default")] + [e.name for e in extra]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"adapter names {repeated} appear more than once (adapter.name and "
                "adapter.extra[].name); every adapter needs its own name"
            )
        return extra

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    @property
    def trained_names(self) -> list[str]:
        """The adapters trained (and exported), the main one first."""
        return [self.name] + [e.name for e in self.extra if e.is_trainable]

    @property
    def all_names(self) -> list[str]:
        return [self.name] + [e.name for e in self.extra]


# The schedule's arguments the run sets (get_scheduler's own and the resume's place).
_SET_BY_THE_RUN = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}


class EvalConfig(StrictModel):
    """When to evaluate. The evaluation data is `val_set_size` or `eval_datasets`."""

    steps: int | None = Field(None, gt=0, description="Evaluate every N optimizer steps.")
    max_batches: int | None = Field(None, gt=0, description="Cap on micro-batches per evaluation.")


class NonFiniteConfig(StrictModel):
    """What a step whose loss or gradient norm is not finite does (it never updates weights)."""

    policy: Literal["stop", "skip"] = Field(
        "stop", description="stop: end the run, naming the step; skip: drop the step and go on."
    )
    max_consecutive_skips: int = Field(
        10, gt=0, description="skip: stop after this many non-finite steps in a row."
    )


class MemoryConfig(StrictModel):
    """How model states and activations are placed; the engine's knobs.

    With no knob set, training runs on plain PyTorch. Setting `n_persist` or `n_buffer`
    turns on the chunked engine with those knobs. The activation knobs (`n_swap`,
    `n_checkpoint`, `tiled_mlp_tokens`, `chunked_loss_tokens`) work with or without it.
    With `auto: true` the planner profiles one step and picks the fastest knobs whose
    predicted peak fits `gpu_budget`; knobs set next to it are kept, the others searched.
    """

    auto: bool = Field(False, description="Search the fastest plan that fits the budgets.")
    gpu_budget: ByteSize | None = Field(
        None, description="Device memory the plan may use (auto), e.g. 24GiB."
    )
    cpu_budget: ByteSize | None = Field(
        None,
        description="Host memory the plan may use (auto); default: 90% of what the host has "
        "available when the plan is made.",
    )
    n_persist: int | None = Field(None, ge=0, description="Chunks kept on the GPU.")
    n_buffer: int | None = Field(None, ge=1, description="GPU buffers for offloaded chunks.")
    n_device_step: int | None = Field(
        None,
        ge=0,
        description="Offloaded chunks (the last in forward order) whose AdamW runs on the GPU, "
        "their fp32 masters and Adam moments streamed over the host link; default 0.",
    )
    device_step_search: bool = Field(
        False,
        description="With memory.auto: the plan also chooses n_device_step (the offloaded "
        "chunks whose AdamW runs on the GPU), where it is not set.",
    )
    chunk_size: ByteSize | None = Field(None, description="Chunk size; default: least waste.")
    n_swap: int | None = Field(None, ge=0, description="Blocks whose activations go to the host.")
    n_checkpoint: int | None = Field(None, ge=0, description="Blocks recomputed in backward.")
    offload_checkpoint: bool = Field(
        False, description="Checkpointed blocks keep their inputs on the host."
    )
    tiled_mlp_tokens: int | None = Field(
        None,
        gt=0,
        description="Compute each block's MLP and norms (and the final norm) over tiles of "
        "this many tokens.",
    )
    chunked_loss_tokens: int | None = Field(
        None, gt=0, description="Compute logits and loss over chunks of this many tokens."
    )
    mode: Literal["sharded", "replicated"] | None = Field(
        None,
        description="Several GPUs (torchrun): offloaded chunks split across the ranks "
        "(sharded, the default) or whole on every rank (replicated).",
    )

    @field_validator("gpu_budget", "cpu_budget", "chunk_size", mode="before")
    @classmethod
    def _size_in_bytes(cls, value: Any) -> Any:
        """A size is a whole number of bytes or a number with its unit ('24GiB'); a bare
        fraction or a number written in YAML's exponent form reads as bytes, or is refused."""
        if isinstance(value, str) and re.fullmatch(
            r"\s*[0-9_]*\.?[0-9_]+([eE][+-]?[0-9]+)?\s*", value
        ):
            value = float(value)  # a number without a unit (YAML 1.1 reads 1e9 as a string)
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(
                    f"{value} bytes is not a whole number: give a size with its unit "
                    f"('{value:g}GiB', '512MiB') or whole bytes"
                )
            value = int(value)
        return value

    @field_validator("gpu_budget", "cpu_budget", "chunk_size")
    @classmethod
    def _positive_size(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("a size of more than 0 bytes is needed ('24GiB', '512MiB')")
        return value

    @model_validator(mode="after")
    def _check_auto(self) -> MemoryConfig:
        if self.auto and self.gpu_budget is None:
            raise ValueError(
                "memory.auto = true needs memory.gpu_budget, the device memory the plan may "
                "use (e.g. gpu_budget: 24GiB)"
            )
        if not self.auto and (self.gpu_budget is not None or self.cpu_budget is not None):
            raise ValueError(
                "memory.gpu_budget/cpu_budget are read only by the planner: set memory.auto = "
                "true, or remove them"
            )
        if self.n_device_step and not self.engine_enabled:
            raise ValueError(
                f"memory.n_device_step = {self.n_device_step} needs the chunked engine: set "
                "memory.n_persist (the chunks kept on the GPU; the others are offloaded)"
            )
        if self.device_step_search and not self.auto:
            raise ValueError(
                "memory.device_step_search = true is read only by the planner: set "
                "memory.auto = true, or set memory.n_device_step yourself"
            )
        if self.auto and self.offload_checkpoint:
            raise ValueError(
                "memory.offload_checkpoint = true is not planned by memory.auto (the plan "
                "chooses keep, swap or checkpoint per block): remove one of them"
            )
        return self

    def knobs(self) -> Knobs:
        """The section's placement knobs as the engine and the planner take them (None: the
        engine's default, or searched with `auto`)."""
        return Knobs(
            n_persist=self.n_persist,
            n_buffer=self.n_buffer,
            n_swap=self.n_swap,
            n_checkpoint=self.n_checkpoint,
            n_device_step=self.n_device_step,
            chunk_size_bytes=int(self.chunk_size) if self.chunk_size is not None else None,
            distributed_mode=self.mode,
            offload_checkpoint=self.offload_checkpoint,
            tiled_mlp_tokens=self.tiled_mlp_tokens,
        )

    @property
    def engine_enabled(self) -> bool:
        return self.auto or self.n_persist is not None or self.n_buffer is not None

    @property
    def activation_knobs_set(self) -> bool:
        return bool(self.n_swap or self.n_checkpoint or self.tiled_mlp_tokens)


# The memory: options the FSDP2 engine takes (no collective of their own).
FSDP2_MEMORY_KEYS = ("tiled_mlp_tokens", "chunked_loss_tokens")


# FSDP1 keys that axolotl configs carry, and what FSDP2 (fully_shard) has instead
_FSDP1_KEYS = {
    "sharding_strategy": "FSDP2 shards every unit; reshard_after_forward: false keeps the "
    "gathered parameters between forward and backward (SHARD_GRAD_OP's behaviour)",
    "use_orig_params": "FSDP2 always keeps the original parameters: remove it",
    "sync_module_states": "every rank builds the same model here: remove it",
}


class FSDPConfig(StrictModel):
    """The FSDP2 engine (`fsdp_version: 2`), in axolotl's `fsdp_config` vocabulary.

    Keys may carry axolotl's older `fsdp_` prefix (`fsdp_offload_params`). Units of
    `fully_shard` are chosen by `auto_wrap_policy`; see `protrain.distributed.fsdp2`.
    """

    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"] = Field(
        "TRANSFORMER_BASED_WRAP",
        description="TRANSFORMER_BASED_WRAP: one unit per layer class listed; SIZE_BASED_WRAP: "
        "units of at least min_num_params parameters, as FSDP1's size_based_auto_wrap_policy.",
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        None, description="Layer class names; default: the blocks ProTrain discovers."
    )
    min_num_params: int | None = Field(
        None, gt=0, description="SIZE_BASED_WRAP: parameters per unit; default 1e8 (accelerate's)."
    )
    offload_params: bool = Field(
        False, description="Sharded parameters, gradients and AdamW on the host (CPUOffloadPolicy)."
    )
    reshard_after_forward: bool = Field(
        True, description="Free the gathered parameters after each unit's forward."
    )
    cpu_ram_efficient_loading: bool = Field(
        False,
        description="Accepted for axolotl configs: every rank builds the model on its host and "
        "fully_shard moves only its own shard to the device, with or without this key.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute every discovered block in backward (any wrap policy)."
    )
    forward_prefetch: bool = Field(
        False,
        description="Each unit issues the next unit's all-gather as soon as its own is done "
        "(FSDP2's explicit forward prefetch, in forward order); false: FSDP2's implicit "
        "overlap.",
    )
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = Field(
        "BACKWARD_PRE",
        description="BACKWARD_PRE: each unit's pre-backward prefetches the unit before it "
        "(explicit, in backward order); BACKWARD_POST is issued the same way (FSDP2 has no "
        "post-backward prefetch, the log says so); NO_PREFETCH: FSDP2's implicit default "
        "(fully_shard cannot turn backward prefetch off).",
    )
    state_dict_type: str = Field(
        "FULL_STATE_DICT",
        description="FULL_STATE_DICT or SHARDED_STATE_DICT, as axolotl writes it. Several ranks "
        "always write the sharded format (each rank its own shards, no gather; it resumes at any "
        "world size and in either engine, and `protrain convert-checkpoint` makes a whole one); "
        "one process writes whole tensors.",
    )

    @model_validator(mode="before")
    @classmethod
    def _without_prefix(cls, value: Any) -> Any:
        # axolotl's older spelling: fsdp_offload_params, fsdp_auto_wrap_policy, ...; a key
        # that is not one of ours keeps the user's spelling for the unknown-key error
        if not isinstance(value, dict):
            return value
        out = {}
        for key, item in value.items():
            name = key
            if isinstance(key, str) and key.removeprefix("fsdp_") in cls.model_fields:
                name = key.removeprefix("fsdp_")
            if isinstance(key, str) and key.removeprefix("fsdp_") in _FSDP1_KEYS:
                raise ValueError(
                    f"fsdp_config.{key} is FSDP1's; {_FSDP1_KEYS[key.removeprefix('fsdp_')]}"
                )
            if name in out:
                raise ValueError(f"fsdp_config.{name} is set twice (as {name} and fsdp_{name})")
            out[name] = item
        return out

    @field_validator("min_num_params", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would take true for 1
            raise ValueError("a number of parameters, e.g. 100000000, not true or false")
        return value

    @field_validator("transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        if isinstance(value, str):  # axolotl takes one class name or a comma-separated list
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("state_dict_type")
    @classmethod
    def _full_only(cls, value: str) -> str:
        if value not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            raise ValueError(
                "use FULL_STATE_DICT or SHARDED_STATE_DICT (several "
                "ranks write sharded checkpoints either way; one process writes whole tensors)"
            )
        return value

    @model_validator(mode="after")
    def _check_policy_keys(self) -> FSDPConfig:
        if self.auto_wrap_policy == "SIZE_BASED_WRAP" and self.transformer_layer_cls_to_wrap:
            raise ValueError(
                "fsdp_config.transformer_layer_cls_to_wrap is read only by "
                "auto_wrap_policy = TRANSFORMER_BASED_WRAP: remove one of them"
            )
        if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and self.min_num_params is not None:
            raise ValueError(
                "fsdp_config.min_num_params is read only by auto_wrap_policy = "
                "SIZE_BASED_WRAP: remove one of them"
            )
        return self


class TrainConfig(DataSettings, TrackingSettings):
    """The whole YAML file. Data keys are inherited from `DataSettings`, the experiment
    trackers' (`report_to`, `wandb_project`, ...) from `TrackingSettings`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    _numbers_not_bools = field_validator("*", mode="before")(classmethod(_not_a_bool))

    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)

    sequence_len: int = Field(512, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    num_epochs: int = Field(1, gt=0)
    max_steps: int | None = Field(None, gt=0, description="Overrides num_epochs when set.")

    learning_rate: float = Field(2e-4, gt=0.0)
    lr_scheduler: Literal[LR_SCHEDULERS] = "cosine"  # type: ignore[valid-type]
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The schedule's own arguments (transformers' get_scheduler): min_lr or "
        "min_lr_rate for cosine_with_min_lr, num_decay_steps for warmup_stable_decay, ...",
    )
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)
    optimizer: Literal[OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "adamw_torch",
        description="adamw_torch: fp32 Adam moments. adamw_bnb_8bit: bitsandbytes' 8-bit "
        "AdamW (blockwise uint8 moments, fp32 masters) for what is updated on the GPU: every "
        "parameter on plain PyTorch, the persistent chunks with the chunked engine; offloaded "
        "chunks keep fp32 moments on the host (bitsandbytes' CPU update ran 20x slower than "
        "the host's fused AdamW).",
    )
    optimizer_state: Literal["fp32", "bf16", "8bit"] = Field(
        "fp32",
        description="How the host keeps the offloaded chunks' Adam moments (chunked engine): "
        "fp32 (torch's AdamW); opt-in, changing the math: bf16 (stochastic rounding) or 8bit "
        "(blockwise, an fp32 absmax per 256). Masters stay fp32. Not with several GPUs or "
        "memory.n_device_step.",
    )
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="null turns clipping off.")

    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="Autocast dtype; auto = bf16 on a GPU that has it, else no."
    )
    gradient_checkpointing: bool = False
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    seed: int = Field(
        42,
        ge=-(2**63),
        lt=2**63,
        description="Seeds the weights' initialization, data order and dropout (torch takes "
        "64 bits; each epoch's order adds its number to it).",
    )

    output_dir: str = "outputs/run"
    save_steps: int | None = Field(None, gt=0)
    save_minutes: float | None = Field(
        30.0,
        gt=0.0,
        description="Unless save_steps is set: a checkpoint after every this many "
        "minutes of the run; null: none.",
    )
    save_total_limit: int | None = Field(None, gt=0)
    logging_steps: int = Field(10, gt=0)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    nonfinite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    fsdp_version: int | None = Field(
        None, description="2: the FSDP2 engine (fully_shard) instead of the chunked engine."
    )
    fsdp_config: FSDPConfig | None = Field(
        None, description="The FSDP2 engine's settings (fsdp_version: 2)."
    )

    @model_validator(mode="before")
    @classmethod
    def _fsdp_version_in_fsdp_config(cls, value: Any) -> Any:
        # axolotl also takes the version inside fsdp_config (fsdp_version or version) and
        # moves it to the top level: so does this
        if not isinstance(value, dict) or not isinstance(value.get("fsdp_config"), dict):
            return value
        inner = dict(value["fsdp_config"])
        found = {k: inner.pop(k) for k in ("fsdp_version", "version") if k in inner}
        if not found:
            return value
        versions = set(found.values()) | (
            {value["fsdp_version"]} if value.get("fsdp_version") is not None else set()
        )
        if len(versions) > 1:
            where = ", ".join(f"fsdp_config.{k} = {v!r}" for k, v in found.items())
            raise ValueError(
                f"{where} and fsdp_version = {value.get('fsdp_version')!r} disagree; set one"
            )
        return {**value, "fsdp_config": inner, "fsdp_version": versions.pop()}

    @field_validator("fsdp_version")
    @classmethod
    def _fsdp2_only(cls, value: int | None) -> int | None:
        if value is not None and value != 2:
            raise ValueError("only FSDP2 (torch.distributed.fsdp.fully_shard) is built: use 2")
        return value

    @property
    def fsdp(self) -> FSDPConfig | None:
        """The FSDP2 engine's settings when `fsdp_version: 2` is set, else None."""
        if self.fsdp_version is None:
            return None
        return self.fsdp_config or FSDPConfig()

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        self._check_fsdp()
        self._check_optimizer_state()
        self._check_bitsandbytes()
        self._check_scheduler()
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if self.gradient_checkpointing and self.memory.auto:
            raise ValueError(
                "gradient_checkpointing = true and memory.auto = true both set: the plan "
                "chooses which blocks are recomputed; remove gradient_checkpointing (or fix "
                "memory.n_checkpoint)"
            )
        if self.gradient_checkpointing and (self.memory.n_swap or self.memory.n_checkpoint):
            raise ValueError(
                "gradient_checkpointing = true and memory.n_swap/n_checkpoint both set: use "
                "one (memory.n_checkpoint chooses which blocks are recomputed)"
            )
        if self.eval.steps and not (self.val_set_size or self.eval_datasets):
            raise ValueError(
                f"eval.steps = {self.eval.steps} set with no evaluation data: set val_set_size "
                "(the rows held out of training) or eval_datasets, or remove eval.steps"
            )
        if self.memory.offload_checkpoint and not self.memory.n_checkpoint:
            raise ValueError("memory.offload_checkpoint = true needs memory.n_checkpoint > 0")
        adapter = self.adapter
        if _set_off_default(adapter, {"bits"}) and adapter.type != "qlora":
            raise ValueError(
                f"adapter.bits = {adapter.bits} set with adapter.type = {adapter.type!r}: it is "
                "the quantized base weights' bits and applies to type qlora only (lora and dora "
                "train on the unquantized base); remove it, or set adapter.type = 'qlora'"
            )
        is_int8 = (adapter.type, adapter.bits) == ("qlora", 8)
        if _set_off_default(adapter, {"int8_threshold"}) and not is_int8:
            raise ValueError(
                f"adapter.int8_threshold = {adapter.int8_threshold!r} set with adapter.type = "
                f"{adapter.type!r} and adapter.bits = {adapter.bits}: it is LLM.int8's outlier "
                "threshold and applies to type qlora with bits 8 only; remove it, or set those"
            )
        return self

    def _check_bitsandbytes(self) -> None:
        """What needs bitsandbytes is refused when the config is read, before any data or
        model loads, where it is not installed (found without importing it: its import is
        slow)."""
        needs = [
            what
            for what, used in (
                ("optimizer = 'adamw_bnb_8bit'", self.optimizer == "adamw_bnb_8bit"),
                ("adapter.type = 'qlora'", self.adapter.type == "qlora"),
            )
            if used
        ]
        if needs and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                f"{' and '.join(needs)} needs bitsandbytes, which is not installed: "
                "pip install 'protrain[qlora]', or use optimizer = 'adamw_torch' and "
                "adapter.type = 'lora'"
            )

    def _check_scheduler(self) -> None:
        """The schedule is built once on a stand-in parameter, so that arguments it lacks
        or does not take are refused when the config is read, not after the data work.
        transformers is imported here, not at the top: reading a config (the CLI's first
        step) does not load it otherwise."""
        # CLI start-up time: transformers loads here, where a config names its schedule
        from transformers import SchedulerType, get_scheduler
        from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

        schedule = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(self.lr_scheduler)]
        # what the run sets itself, and what get_scheduler would drop without a word
        # (constant schedules take none)
        takes = set(inspect.signature(schedule).parameters) - _SET_BY_THE_RUN
        unknown = sorted(set(self.lr_scheduler_kwargs) - takes)
        if unknown:
            raise ValueError(
                f"lr_scheduler_kwargs {unknown} are not allowed with lr_scheduler = "
                f"{self.lr_scheduler!r}: it takes {sorted(takes) or 'none'} (the run sets "
                f"{sorted(_SET_BY_THE_RUN - {'optimizer'})} itself)"
            )
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=self.learning_rate)
        try:
            get_scheduler(
                self.lr_scheduler, optimizer, num_warmup_steps=0, num_training_steps=2,
                scheduler_specific_kwargs=self.lr_scheduler_kwargs,
            )  # fmt: skip
        except Exception as exc:  # a bad value: whatever the schedule's own check raises
            raise ValueError(
                f"lr_scheduler = {self.lr_scheduler!r} with lr_scheduler_kwargs = "
                f"{self.lr_scheduler_kwargs}: {exc}; set the schedule's arguments in "
                "lr_scheduler_kwargs"
            ) from None

    def _check_optimizer_state(self) -> None:
        if self.optimizer_state == "fp32":
            return
        where = (
            "the chunked engine, not fsdp_version = 2: remove fsdp_version and set "
            "memory.n_persist or memory.auto (the offloaded chunks' host state is what it "
            "compresses)"
            if self.fsdp_version is not None
            else "the chunked engine: set memory.n_persist or memory.auto (the offloaded "
            "chunks' host state is what it compresses)"
            if not self.memory.engine_enabled
            else "memory.n_device_step = 0 (the device step streams fp32 moments)"
            if self.memory.n_device_step or self.memory.device_step_search
            else None
        )
        if where is not None:
            raise ValueError(f"optimizer_state = {self.optimizer_state!r} needs {where}")

    def _check_fsdp(self) -> None:
        if self.fsdp_config is not None and self.fsdp_version is None:
            raise ValueError("fsdp_config needs fsdp_version = 2 (the FSDP2 engine)")
        if self.fsdp_version is None:
            return
        # The chunk engine's knobs (and the activation knobs built on its hooks) contradict
        # the FSDP2 engine: one error naming every key set. The tiled MLP and the chunked
        # loss issue no collective of their own and run under FSDP2 as well.
        defaults = MemoryConfig()
        memory_keys = [
            f"memory.{key} = {getattr(self.memory, key)!r}"
            for key in MemoryConfig.model_fields
            if key not in FSDP2_MEMORY_KEYS and getattr(self.memory, key) != getattr(defaults, key)
        ]
        if memory_keys:
            raise ValueError(
                f"fsdp_version = 2 with {', '.join(memory_keys)} is not allowed: the memory: "
                "section configures the chunked engine; remove it (fsdp_config."
                "activation_checkpointing recomputes blocks under FSDP2; of memory:, only "
                f"{' and '.join(FSDP2_MEMORY_KEYS)} apply to it), or remove fsdp_version"
            )
        fsdp = self.fsdp
        if self.gradient_checkpointing and fsdp.activation_checkpointing:
            raise ValueError(
                "gradient_checkpointing = true and fsdp_config.activation_checkpointing = true "
                "both set: use one (they recompute the same blocks)"
            )
        if self.adapter.type == "qlora" and self.adapter.bits == 8:
            raise ValueError(
                "adapter.bits = 8 with fsdp_version = 2 is not supported: FSDP2 shards 4-bit "
                "base weights (stored in the computing dtype); use adapter.bits = 4, or the "
                "chunked engine (memory.auto or n_persist), which holds 8-bit base weights"
            )
        if self.optimizer != "adamw_torch":
            raise ValueError(
                f"optimizer = {self.optimizer!r} with fsdp_version = 2 is not supported: the "
                "FSDP2 engine steps torch's AdamW over sharded parameters; use optimizer = "
                "'adamw_torch', or the chunked engine (memory.auto or n_persist) or plain "
                "PyTorch for 'adamw_bnb_8bit'"
            )
        if self.mixed_precision == "fp16":
            raise ValueError(
                "mixed_precision = 'fp16' with fsdp_version = 2 is not allowed: FSDP2 runs "
                "without loss scaling here; use bf16, auto or no"
            )


# --------------------------------------------------------------------------------------
# Loading and error messages


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (the quickstart's when `path` is None), apply `key=value` overrides
    and validate. Raises ConfigError with one readable message."""
    path = Path(path) if path is not None else QUICKSTART_CONFIG
    raw = read_yaml_mapping(path, what="config file")
    if path == QUICKSTART_CONFIG:
        _resolve_quickstart_paths(raw)
    overridden = {}
    for item in overrides or []:
        overridden[apply_override(raw, item)] = item
    return validate_config(raw, source=str(path), overridden=overridden)


def read_yaml_mapping(path: Path, *, what: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (empty: `{}`); ConfigError with one line
    naming the file for anything else: missing, a directory, unreadable, not UTF-8, not
    YAML, not a mapping."""
    text = _read_text_file(path, what=what)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {one_line(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{what} {str(path)!r}: the top level must be a mapping of keys, "
            f"got {type(raw).__name__}"
        )
    return raw


def _read_text_file(path: Path, *, what: str) -> str:
    """The UTF-8 text of a file; ConfigError with one line naming it otherwise."""
    name = repr(str(path))
    if path.is_dir():
        raise ConfigError(f"{what} {name} is a directory, not a file")
    if not path.exists():
        raise ConfigError(f"{what} {name} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {name}: cannot read it ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {name} is not UTF-8 text at {not_utf8_place(data, exc)}"
        ) from None


def one_line(exc: BaseException | str) -> str:
    """A message on one line, whatever the library that wrote it put in it."""
    return " ".join(str(exc).split())


def validate_config(
    raw: dict[str, Any], source: str = "config", overridden: dict[tuple, str] | None = None
) -> TrainConfig:
    """``overridden``: the key paths ``--set`` gave (``apply_override``'s), with the item
    that set each: an error about one of them names that ``--set``, not ``source``."""
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(
            format_validation_error(exc, TrainConfig, raw, source, overridden)
        ) from None
    if not cfg.datasets:
        given = "= [] is not allowed" if "datasets" in raw else "is not set"
        raise ConfigError(
            f"{source}: datasets {given}: training needs at least one dataset, e.g. "
            "datasets: [{path: data.jsonl, type: chat}]"
        )
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> tuple[str, ...]:
    """Apply one `--set a.b.c=value`; the value is parsed as a YAML scalar or list. Returns
    the key path it set."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set learning_rate=1e-4")
    key, _, text = item.partition("=")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if isinstance(child, list):
            raise ConfigError(
                f"--set {key}: {part!r} is a list, and --set reaches only the keys of sections; "
                "edit its items in the config file"
            )
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value
    return tuple(parts)


def _resolve_quickstart_paths(raw: dict[str, Any]) -> None:
    # The embedded config names its data relative to the package, wherever it is installed.
    for dataset in raw.get("datasets") or []:
        if isinstance(dataset, dict) and "path" in dataset:
            dataset["path"] = str(QUICKSTART_DIR / dataset["path"])


def format_validation_error(
    exc: ValidationError,
    schema: type[BaseModel],
    raw: dict[str, Any],
    source: str,
    overridden: dict[tuple, str] | None = None,
) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        where = _source_of(loc, overridden or {}, source)
        key = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(schema, err["loc"][:-1])
            hint = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.6)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            lines.append(
                f"{where}: unknown key {key!r}{suggestion} (allowed here: {', '.join(allowed)})"
            )
            continue
        message = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        if err["type"] == "value_error" and (not err["loc"] or isinstance(value, dict)):
            # a section's own check (its message names its keys), not one value's
            lines.append(f"{where}: {message}")
            continue
        shown = f"{value!r}" if not isinstance(value, dict | list) else type(value).__name__
        lines.append(f"{where}: {key} = {shown} is not allowed: {message}")
    return "\n".join(lines)


def _source_of(loc: list[str], overridden: dict[tuple, str], file_source: str) -> str:
    """Where the value an error is about came from: the ``--set`` whose key path is the
    error's or holds it (a section set whole), else the config file."""
    for n in range(len(loc), 0, -1):
        item = overridden.get(tuple(loc[:n]))
        if item is not None:
            return f"--set {item}"
    return file_source


def _fields_at(schema: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the (nested) model that `loc` points into."""
    model: Any = schema
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None or get_args(annotation):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
