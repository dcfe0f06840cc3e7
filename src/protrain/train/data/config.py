"""The data keys of the YAML config.

`DatasetConfig` is one entry of the `datasets:` list; `DataSettings` holds the top-level data
keys. The application's `TrainConfig` inherits from `DataSettings`, so the YAML stays flat:

```yaml
datasets:
  - path: data/chat.jsonl
    type: chat
chat_template: chatml
train_on_eos: turn
sample_packing: true
```

Masking keys (`train_on_inputs`, `roles_to_train`, `train_on_eos`, `train_on_tool_calls`,
`chat_template`) may be set at the top level and overridden per dataset; `None` in a dataset
entry means "inherit". `chat_template_kwargs` (variables for every render of the template) is
merged: a dataset's keys over the top-level ones.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protrain.train.data.templates import check_template_spec

TrainOnEos = Literal["turn", "last", "all", "none"]
DatasetType = Literal["chat", "completion", "text"]

# Roles a chat row may use after the legacy names are mapped.
KNOWN_ROLES = ("system", "user", "assistant", "tool")

# Legacy `conversations` rows (ShareGPT style) name roles differently.
DEFAULT_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}

# Keys of `from_pretrained` that the project sets itself; `processor_kwargs` cannot override them.
MANAGED_PROCESSOR_KWARGS = ("revision", "trust_remote_code")


# Names the renderer sets itself; `chat_template_kwargs` cannot set them.
RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "return_assistant_tokens_mask",
    "tokenize",
    "chat_template",
)


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """Config-time check of `chat_template_kwargs`: a mapping of template variable names."""
    if not isinstance(value, dict):
        raise ValueError(
            f"chat_template_kwargs: must be a mapping of template variable names to values, "
            f"e.g. {{enable_thinking: false}}; got {type(value).__name__} {value!r}"
        )
    bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ValueError(f"chat_template_kwargs: {bad} are not template variable names")
    reserved = [k for k in value if k in RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise ValueError(
            f"chat_template_kwargs: {reserved} are set by protrain itself; "
            f"not allowed: {list(RESERVED_TEMPLATE_KWARGS)}"
        )
    return value


def _check_roles(roles: list[str] | None, key: str) -> list[str] | None:
    if roles is None:
        return None
    bad = [r for r in roles if r not in KNOWN_ROLES]
    if bad:
        raise ValueError(f"{key}: unknown role(s) {bad}; allowed roles are {list(KNOWN_ROLES)}")
    return roles


class DatasetConfig(BaseModel):
    """One entry of `datasets:` (or `eval_datasets:`)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="local file or directory (JSONL, JSON, Parquet, CSV) or hub id")
    type: DatasetType = "chat"
    name: str | None = Field(default=None, description="hub dataset configuration name")
    split: str = "train"
    data_files: str | list[str] | None = None
    # Field mapping. Chat rows: `messages` (role/content), or legacy `conversations` (from/value).
    field_messages: str | None = Field(
        default=None, description="column with the messages; default: messages, else conversations"
    )
    message_field_role: str | None = Field(
        default=None, description="role key of a message; default: role (from for conversations)"
    )
    message_field_content: str | None = Field(
        default=None, description="content key of a message; default: content (value)"
    )
    message_field_reasoning: str = "reasoning_content"
    roles: dict[str, str] | None = Field(
        default=None, description="extra role names mapped onto system/user/assistant/tool"
    )
    field_images: str = "images"
    field_audios: str = "audios"
    field_prompt: str = "prompt"
    field_completion: str = "completion"
    field_system: str = "system"
    field_text: str = "text"
    shuffle: bool = False
    max_samples: int | None = Field(default=None, ge=1)
    # Per-dataset overrides of the top-level masking keys (None: inherit).
    train_on_inputs: bool | None = None
    roles_to_train: list[str] | None = None
    train_on_eos: TrainOnEos | None = None
    train_on_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="template variables for this dataset, over the top-level ones"
    )

    @field_validator("max_samples", mode="before")
    @classmethod
    def _count_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # pydantic would take true for 1
            raise ValueError("a number is needed here, not true or false")
        return v

    @field_validator("roles_to_train")
    @classmethod
    def _known_roles(cls, v: list[str] | None) -> list[str] | None:
        return _check_roles(v, "roles_to_train")

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        return check_template_spec(v)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, v: Any) -> Any:
        return None if v is None else check_template_kwargs(v)

    @field_validator("roles")
    @classmethod
    def _known_role_targets(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        bad = {k: t for k, t in v.items() if t not in KNOWN_ROLES}
        if bad:
            raise ValueError(
                f"roles: {bad} maps onto unknown roles; allowed are {list(KNOWN_ROLES)}"
            )
        return v


class RoleBoundary(BaseModel):
    """Where one role's turns start and end, as text markers the tokenizer encodes to tokens.

    `end: eos_token` means the tokenizer's EOS; `end: null` runs to the end of the sequence; a
    list gives several markers, the first found ends the turn (Llama 3.x: `<|eot_id|>`, or
    `<|eom_id|>` after a tool call).
    """

    model_config = ConfigDict(extra="forbid")

    role: str
    start: str
    end: str | list[str] | None
    include_start: bool = False
    include_end: bool = True

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        _check_roles([v], "role_boundaries.role")
        return v

    @field_validator("start")
    @classmethod
    def _non_empty_start(cls, v: str) -> str:
        if not v:
            raise ValueError("role_boundaries.start: '' is not a marker; give the start text")
        return v

    @field_validator("end")
    @classmethod
    def _non_empty_end(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (not v or not all(v)):
            raise ValueError(
                "role_boundaries.end: a list of markers needs at least one, none of them ''"
            )
        return v


class DataSettings(BaseModel):
    """Top-level data keys of the YAML config."""

    model_config = ConfigDict(extra="forbid")

    datasets: list[DatasetConfig] = Field(default_factory=list)
    eval_datasets: list[DatasetConfig] = Field(default_factory=list)
    val_set_size: float = Field(
        default=0.0,
        ge=0.0,
        description="fraction (<1) or number (>=1) of training rows held out for evaluation",
    )
    chat_template: str | None = Field(
        default=None,
        description="built-in name, Jinja string or file; default: the tokenizer's own template",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="variables passed to the chat template on every render (enable_thinking, "
        "date_string, ...); a row's own columns of the same name win",
    )
    train_on_inputs: bool = False
    roles_to_train: list[str] = Field(default_factory=lambda: ["assistant"])
    train_on_eos: TrainOnEos = "turn"
    train_on_tool_calls: bool = Field(
        default=True,
        description="train assistant turns that call tools (tool results: add `tool` to roles_to_train)",
    )
    sample_packing: bool = False
    skip_bad_rows: bool = False
    excess_length_strategy: Literal["truncate", "drop", "raise"] = Field(
        default="truncate",
        description="a row longer than sequence_len: truncate (cut at sequence_len: a cut "
        "answer trains without its end), drop (axolotl's default), or raise (an error naming "
        "the row); rows with media are dropped unless raise",
    )
    processor_type: str | None = None
    processor_kwargs: dict[str, Any] = Field(default_factory=dict)
    role_boundaries: list[RoleBoundary] | None = Field(
        default=None, description="override of the built-in role boundaries; [] is an override"
    )
    dataset_prepared_path: str | None = None

    @field_validator("roles_to_train")
    @classmethod
    def _known_roles(cls, v: list[str]) -> list[str]:
        return _check_roles(v, "roles_to_train")  # type: ignore[return-value]

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        return check_template_spec(v)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, v: Any) -> Any:
        return check_template_kwargs(v)

    @field_validator("processor_type")
    @classmethod
    def _processor_class(cls, v: str | None) -> str | None:
        if v is None:
            return v
        # the config check imports this module: transformers loads where a model is built
        import transformers

        if not v.endswith("Processor") or not hasattr(transformers, v):
            raise ValueError(
                f"processor_type: {v!r} is not a processor class of transformers; "
                "use AutoProcessor or a class such as Qwen2VLProcessor, Gemma3Processor"
            )
        return v

    @field_validator("val_set_size")
    @classmethod
    def _whole_count(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError(
                f"val_set_size: {v} is neither a fraction below 1 nor a whole number of rows"
            )
        return v

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSettings:
        if self.eval_datasets and self.val_set_size:
            raise ValueError(
                "val_set_size and eval_datasets are both set; use one source of evaluation data"
            )
        return self
