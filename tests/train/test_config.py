import importlib.util
import re

import pytest

from protrain.train.config import TrainConfig, load_config, validate_config
from protrain.train.errors import ConfigError

from .helpers import tiny_config, write_config


def test_quickstart_config_loads():
    cfg = load_config(None)
    assert cfg.model.name_or_path == "tiny"
    assert cfg.datasets[0].path.endswith("quickstart/data/chat.jsonl")


def test_misspelled_key_names_the_closest_key(tmp_path):
    raw = tiny_config(tmp_path)
    raw["learning_rat"] = 1e-4
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    message = str(err.value)
    assert "unknown key 'learning_rat'" in message
    assert "did you mean 'learning_rate'?" in message


def test_misspelled_nested_key(tmp_path):
    raw = tiny_config(tmp_path, adapter={"type": "lora", "rank": 8})
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert "unknown key 'adapter.rank'" in str(err.value)
    assert "r, " in str(err.value)  # lists what is allowed there


def test_negative_learning_rate_names_key_value_and_rule(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, learning_rate=-0.1))
    assert (
        str(err.value)
        == "config: learning_rate = -0.1 is not allowed: Input should be greater than 0"
    )


def test_bad_literal_lists_allowed_values(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, lr_scheduler="cosin"))
    assert "lr_scheduler = 'cosin'" in str(err.value)
    assert "'cosine'" in str(err.value)


def test_overrides_are_parsed_as_yaml(tmp_path):
    path = write_config(tmp_path, tiny_config(tmp_path))
    cfg = load_config(path, ["learning_rate=5e-4", "adapter.type=lora", "adapter.r=4"])
    assert cfg.learning_rate == 5e-4
    assert cfg.adapter.type == "lora" and cfg.adapter.r == 4


def test_an_override_into_a_list_says_so(tmp_path):
    path = write_config(tmp_path, tiny_config(tmp_path))
    with pytest.raises(ConfigError, match="'datasets' is a list, and --set reaches only"):
        load_config(path, ["datasets.0.type=completion"])


def test_an_error_about_an_override_names_the_override(tmp_path):
    """A bad value from --set is blamed on that --set, one from the file on the file, in one
    message (before, every line named the config file)."""
    raw = tiny_config(tmp_path)
    raw["micro_batch_size"] = 0
    path = write_config(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["learning_rate=fast", "memory.bogus=1", "adapter=3"])
    lines = str(err.value).splitlines()
    assert len(lines) == 4, lines
    assert f"{path}: micro_batch_size = 0 is not allowed" in str(err.value)
    assert "--set learning_rate=fast: learning_rate = 'fast' is not allowed" in str(err.value)
    assert "--set memory.bogus=1: unknown key 'memory.bogus'" in str(err.value)
    assert "--set adapter=3: adapter = 3 is not allowed" in str(err.value)


def test_bad_override_syntax(tmp_path):
    path = write_config(tmp_path, tiny_config(tmp_path))
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(path, ["learning_rate"])


def test_adapter_shorthand_and_defaults(tmp_path):
    cfg = validate_config(tiny_config(tmp_path, adapter="lora"))
    assert cfg.adapter.type == "lora" and cfg.adapter.r == 8


def test_warmup_steps_and_ratio_exclusive(tmp_path):
    with pytest.raises(ConfigError, match="warmup_steps or warmup_ratio"):
        validate_config(tiny_config(tmp_path, warmup_steps=2, warmup_ratio=0.1))


def test_memory_budget_units(tmp_path):
    cfg = validate_config(
        tiny_config(tmp_path, memory={"auto": True, "gpu_budget": "24GiB", "cpu_budget": "64GB"})
    )
    assert int(cfg.memory.gpu_budget) == 24 * 2**30
    assert int(cfg.memory.cpu_budget) == 64 * 10**9
    assert cfg.memory.engine_enabled


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_is_read_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_schema_defaults_are_valid():
    TrainConfig()


def test_sdpa_backend_needs_sdpa_attention(tmp_path):
    raw = tiny_config(tmp_path, model={"name_or_path": "tiny", "attn_implementation": "eager",
                                       "sdpa_backend": "cudnn"})  # fmt: skip
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert "model.sdpa_backend = 'cudnn' needs model.attn_implementation = 'sdpa'" in str(err.value)


def test_unknown_sdpa_backend_lists_the_allowed_ones(tmp_path):
    raw = tiny_config(tmp_path, model={"name_or_path": "tiny", "sdpa_backend": "fast"})
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert "model.sdpa_backend" in str(err.value) and "'cudnn'" in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"adapter": {"type": "lora", "r": 4}},
        {"adapter": {"type": "qlora", "bits": 8, "int8_threshold": 4.0}},
        {
            "adapter": {
                "type": "lora",
                "extra": [{"name": "style", "path": "/x/style"}, {"name": "new", "r": 2}],
            }
        },  # fmt: skip
        {"memory": {"auto": True, "gpu_budget": "24GiB"}},
        {"fsdp_version": 2, "fsdp_config": {"auto_wrap_policy": "SIZE_BASED_WRAP"}},
    ],
)
def test_the_recorded_config_loads_back(tmp_path, extra):
    """What a run records in output_dir/config.yaml (every key, defaults included) loads
    back as the same config: a default written out is not a key set (it was refused, e.g.
    adapter.int8_threshold beside type none, or an extra adapter's r beside its path)."""
    import yaml

    from protrain.train.loop import _yaml

    cfg = validate_config(tiny_config(tmp_path, **extra))
    again = validate_config(yaml.safe_load(_yaml(cfg)))
    assert again.model_dump() == cfg.model_dump()


def test_fsdp_config_in_axolotls_forms(tmp_path):
    """axolotl takes the version inside fsdp_config too and moves it up, as here; FSDP1's
    keys are named as written with what FSDP2 has instead; unknown keys keep the user's
    spelling."""
    fsdp = {"fsdp_version": 2, "fsdp_offload_params": False, "auto_wrap_policy": "SIZE_BASED_WRAP"}
    cfg = validate_config(tiny_config(tmp_path, fsdp_config=fsdp))
    assert cfg.fsdp_version == 2 and cfg.fsdp.auto_wrap_policy == "SIZE_BASED_WRAP"
    assert validate_config(tiny_config(tmp_path, fsdp_config={"version": 2})).fsdp_version == 2

    def error(**raw) -> str:
        with pytest.raises(ConfigError) as err:
            validate_config(tiny_config(tmp_path, **raw))
        return str(err.value)

    message = error(fsdp_version=2, fsdp_config={"fsdp_version": 1})
    assert message.startswith("config: fsdp_config.fsdp_version = 1 and fsdp_version = 2 disagree")
    message = error(fsdp_version=2, fsdp_config={"fsdp_sharding_strategy": "FULL_SHARD"})
    assert message.startswith("config: fsdp_config.fsdp_sharding_strategy is FSDP1's;")
    assert "reshard_after_forward" in message
    assert "unknown key 'fsdp_config.fsdp_limit_all_gathers'" in error(
        fsdp_version=2, fsdp_config={"fsdp_limit_all_gathers": True}
    )
    size = {"auto_wrap_policy": "SIZE_BASED_WRAP"}
    assert "not true or false" in error(
        fsdp_version=2, fsdp_config={**size, "min_num_params": True}
    )
    message = error(fsdp_version=2, fsdp_config={"state_dict_type": "LOCAL_STATE_DICT"})
    assert message.count("LOCAL_STATE_DICT") == 1


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"save_steps": True}, "save_steps = True"),
        ({"max_steps": False}, "max_steps = False"),
        ({"save_minutes": True}, "save_minutes = True"),
        ({"learning_rate": True}, "learning_rate = True"),
        ({"memory": {"n_persist": True}}, "memory.n_persist = True"),
        ({"eval": {"steps": True}}, "eval.steps = True"),
        ({"val_set_size": True}, "val_set_size = True"),
    ],
)
def test_true_or_false_is_not_a_number(tmp_path, raw, key):
    """pydantic would take true for 1 (a checkpoint every step)."""
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, **raw))
    assert str(err.value) == (
        f"config: {key} is not allowed: a number is needed here, not true or false"
    )


def test_true_is_not_a_number_of_samples(tmp_path):
    raw = tiny_config(tmp_path)
    raw["datasets"][0]["max_samples"] = True
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert str(err.value) == (
        "config: datasets.0.max_samples = True is not allowed: a number is needed here, not "
        "true or false"
    )


@pytest.mark.parametrize("kind", ["lora", "dora", "none"])
def test_adapter_bits_without_qlora_is_refused(tmp_path, kind):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, adapter={"type": kind, "bits": 8}))
    assert str(err.value) == (
        f"config: adapter.bits = 8 set with adapter.type = {kind!r}: it is the quantized base "
        "weights' bits and applies to type qlora only (lora and dora train on the unquantized "
        "base); remove it, or set adapter.type = 'qlora'"
    )
    # the default written out, as a recorded config.yaml has it, says nothing
    assert validate_config(tiny_config(tmp_path, adapter={"type": kind, "bits": 4}))


def test_sequence_len_beyond_the_models_positions_warns_once(tmp_path, protrain_log):
    from protrain.train.loop import train

    cfg = tiny_config(tmp_path, sequence_len=4096, max_steps=1, micro_batch_size=1)
    cfg["gradient_accumulation_steps"] = 1
    train(validate_config(cfg))
    notes = [line for line in protrain_log if "is beyond the" in line]
    assert notes == [
        "sequence_len = 4096 is beyond the 2048 positions of 'tiny' (max_position_embeddings): "
        "rows longer than 2048 tokens train at positions the model never saw (with RoPE at a "
        "lower quality, with learned position embeddings not at all: an index error); lower "
        "sequence_len, or extend the model's positions (rope_scaling in its config.json)"
    ]


def test_optimizer_state_needs_the_chunked_engine_without_device_step(tmp_path):
    assert validate_config(tiny_config(tmp_path)).optimizer_state == "fp32"
    ok = validate_config(tiny_config(tmp_path, optimizer_state="8bit", memory={"n_persist": 0}))
    assert ok.optimizer_state == "8bit"
    with pytest.raises(ConfigError, match="optimizer_state = 'bf16' needs the chunked engine"):
        validate_config(tiny_config(tmp_path, optimizer_state="bf16"))
    with pytest.raises(ConfigError, match="needs memory.n_device_step = 0"):
        validate_config(
            tiny_config(
                tmp_path, optimizer_state="bf16", memory={"n_persist": 0, "n_device_step": 1}
            )
        )
    with pytest.raises(ConfigError, match="optimizer_state"):
        validate_config(tiny_config(tmp_path, optimizer_state="fp8"))


def test_what_needs_bitsandbytes_is_refused_when_the_config_is_read(monkeypatch):
    """Without bitsandbytes, the 8-bit optimizer and qlora are refused in one line naming the
    keys, before any data or model loads (not an ImportError traceback at the optimizer)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optimizer=adamw_bnb_8bit"])
    msg = str(err.value)
    assert "optimizer = 'adamw_bnb_8bit' needs bitsandbytes" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="adapter.type = 'qlora' needs bitsandbytes"):
        load_config(None, ["adapter.type=qlora"])
    assert load_config(None).optimizer == "adamw_torch"  # nothing needs it: read as before


def test_evaluation_without_evaluation_data_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, eval={"steps": 4}))
    assert "eval.steps = 4 set with no evaluation data: set val_set_size" in str(err.value)
    validate_config(tiny_config(tmp_path, eval={"steps": 4}, val_set_size=0.05))


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_refused(tmp_path, seed):
    # torch seeds with 64 bits, and each epoch's data order adds its number to the seed
    with pytest.raises(ConfigError, match=f"seed = {seed} is not allowed"):
        validate_config(tiny_config(tmp_path, seed=seed))
    validate_config(tiny_config(tmp_path, seed=2**63 - 1))


@pytest.mark.parametrize(
    "scheduler,kwargs,says",
    [
        ("cosine_with_min_lr", {}, "One of min_lr or min_lr_rate should be set"),
        ("warmup_stable_decay", {}, "missing 1 required positional argument: 'num_decay_steps'"),
        ("linear", {"bogus": 1}, "['bogus'] are not allowed"),
        ("linear", {"last_epoch": 3}, "['last_epoch'] are not allowed"),
        ("constant", {"min_lr": 1e-5}, "it takes none"),  # transformers would drop it
    ],
)
def test_a_schedule_without_the_arguments_it_needs_is_refused(tmp_path, scheduler, kwargs, says):
    raw = tiny_config(tmp_path, lr_scheduler=scheduler, lr_scheduler_kwargs=kwargs)
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert f"lr_scheduler = {scheduler!r}" in str(err.value) and says in str(err.value)


def test_a_schedule_takes_its_arguments(tmp_path):
    cfg = validate_config(
        tiny_config(
            tmp_path, lr_scheduler="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-5}
        )
    )
    assert cfg.lr_scheduler_kwargs == {"min_lr": 1e-5}


@pytest.mark.parametrize(
    "budget,says",
    [
        (True, "a number is needed here, not true or false"),
        (0, "a size of more than 0 bytes is needed"),
        ("0.5B", "a size of more than 0 bytes is needed"),
        (24.5, "24.5 bytes is not a whole number: give a size with its unit ('24.5GiB'"),
        ("1.5", "1.5 bytes is not a whole number"),
    ],
)
def test_a_budget_is_a_size_of_more_than_nothing(tmp_path, budget, says):
    memory = {"auto": True, "gpu_budget": budget}
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate_config(tiny_config(tmp_path, memory=memory))


def test_a_budget_in_bytes_may_be_written_with_an_exponent(tmp_path):
    for budget in ("1e9", 1e9):  # YAML 1.1 reads 1e9 as a string
        memory = {"auto": True, "gpu_budget": budget}
        assert validate_config(tiny_config(tmp_path, memory=memory)).memory.gpu_budget == 10**9


def test_compact_state_under_fsdp2_names_fsdp_version(tmp_path):
    with pytest.raises(ConfigError, match="needs the chunked engine, not fsdp_version = 2"):
        validate_config(tiny_config(tmp_path, optimizer_state="bf16", fsdp_version=2))
