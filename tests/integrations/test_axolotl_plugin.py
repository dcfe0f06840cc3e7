"""ProTrainPlugin through axolotl 0.21.0's plugin API, hook by hook in axolotl's order
(axolotl itself cannot be installed next to protrain[hf]: see axolotl_api/README.md).
The example YAML trains with the engine under the auto plan from the heaviest micro-batch, to the
same losses as axolotl's trainer without the plugin; the trained adapter is a normal PEFT
directory; what the engine cannot run is one clear error naming the axolotl key."""

from __future__ import annotations

import importlib
import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
API = Path(__file__).resolve().parent / "axolotl_api"
EXAMPLE = REPO / "examples/axolotl/protrain.yaml"
QUICKSTART = REPO / "src/protrain/train/quickstart"
PLUGIN = "protrain.integrations.axolotl.ProTrainPlugin"


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """The plugin routes protrain's loggers into axolotl's (a handler, propagation off, a
    logger class): process-wide in axolotl's own process, undone here so that later tests'
    log captures see protrain's records once, as they do without the plugin."""
    import logging

    source = logging.getLogger("protrain")
    handlers, propagate, level = list(source.handlers), source.propagate, source.level
    logger_class = logging.getLoggerClass()
    yield
    source.handlers[:] = handlers
    source.propagate, source.level = propagate, level
    logging.setLoggerClass(logger_class)


def _drop_modules(*prefixes: str) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "axolotl" or n.startswith(prefixes)]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def axolotl_api():
    """axolotl's plugin API on the path, and the plugin imported under it."""
    sys.path.insert(0, str(API))
    _drop_modules("protrain.integrations.axolotl")
    import axolotl.integrations.base as base

    yield base
    sys.path.remove(str(API))
    _drop_modules("protrain.integrations.axolotl")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    sys.path.insert(0, str(REPO / "examples/axolotl"))
    try:
        from make_tiny_model import make_tiny_model
    finally:
        sys.path.remove(str(REPO / "examples/axolotl"))
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def example_config(tmp_path: Path, model_dir: Path, **overrides) -> dict:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["base_model"] = str(model_dir)
    raw["datasets"][0]["path"] = str(QUICKSTART / "data/chat.jsonl")
    raw["output_dir"] = str(tmp_path / "out")
    raw.update(max_steps=3, micro_batch_size=2, logging_steps=1, bf16=False)
    raw.update(overrides)
    return raw


def chat_rows(tokenizer, cfg) -> list[dict]:
    """axolotl's dataset step for ``type: chat_template`` (not the plugin's business), cut
    short: every token trained."""
    rows = []
    for line in Path(cfg.datasets[0].path).read_text().splitlines()[:64]:
        messages = json.loads(line)[cfg.datasets[0].field_messages]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        ids = ids[: cfg.sequence_len]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    return rows


def run_like_axolotl(raw: dict):
    """``axolotl train`` on one process, as 0.21.0 calls the plugin hooks: cli/config.py
    (load_cfg: prepare_plugins, validation, plugin_set_cfg), cli/train.py (load_datasets),
    loaders/model.py and loaders/adapter.py (ModelLoader.load, load_lora),
    core/builders/causal.py (build), train.py (train, execute_training, save_trained_model)."""
    from axolotl.core.trainers.base import AxolotlTrainer
    from axolotl.integrations.base import PluginManager
    from axolotl.utils.dict import DictDefault
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        TrainingArguments,
    )

    cfg = DictDefault(raw)
    manager = PluginManager()
    for name in cfg.plugins or []:
        manager.register(name, required=True)
    for plugin in manager.plugins.values():
        plugin.register(cfg)
    try:  # validate_config: the plugins' schemas merged into axolotl's
        for path in manager.get_input_args():
            module, name = path.rsplit(".", 1)
            schema = getattr(importlib.import_module(module), name)
            validated = schema.model_validate(cfg)  # a mixin of axolotl's schema: sees it all
            cfg = DictDefault({**cfg, **validated.model_dump(exclude_none=True)})
    except Exception:
        manager.on_config_validation_error(cfg)
        raise
    manager.cfg = cfg
    torch.manual_seed(cfg.seed)

    assert manager.load_datasets(cfg, preprocess=False) is None  # axolotl's own datasets
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    train_dataset = chat_rows(tokenizer, cfg)

    manager.pre_model_load(cfg)
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    manager.post_model_build(cfg, model)
    manager.pre_lora_load(cfg, model)
    if cfg.adapter == "lora":
        model = get_peft_model(model, LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            target_modules="all-linear", task_type="CAUSAL_LM",
            **manager.get_lora_config_kwargs(cfg)))  # fmt: skip
        for name, p in model.named_parameters():  # a non-zero B: the adapter trains from step 1
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    manager.post_lora_load(cfg, model)
    manager.post_model_load(cfg, model)

    trainer_cls = manager.get_trainer_cls(cfg) or AxolotlTrainer
    assert not trainer_cls.requires_all_columns(cfg)
    assert manager.get_training_args_mixin() == []  # no fields added to the arguments class
    training_args = dict(
        output_dir=cfg.output_dir, max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, optim=cfg.optimizer, bf16=bool(cfg.bf16), fp16=False,
        gradient_checkpointing=bool(cfg.gradient_checkpointing), logging_steps=cfg.logging_steps,
        save_strategy=cfg.save_strategy, seed=cfg.seed, report_to="none", disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
    )  # fmt: skip
    training_args.update(manager.get_training_args(cfg))
    assert manager.get_collator_cls_and_kwargs(cfg, is_eval=True) is None  # axolotl's collator
    assert manager.get_collator_cls_and_kwargs(cfg) is None
    collator = DataCollatorForSeq2Seq(tokenizer, return_tensors="pt", padding=True)
    trainer = trainer_cls(
        model=model, train_dataset=train_dataset, eval_dataset=None,
        args=TrainingArguments(**training_args), data_collator=collator,
        callbacks=manager.add_callbacks_pre_trainer(cfg, model),
        eval_data_collator=collator, bench_data_collator=collator,
        dataset_tags=[d["path"] for d in cfg.datasets], processing_class=tokenizer,
    )  # fmt: skip
    trainer.axolotl_cfg = cfg
    trainer.post_set_axolotl_cfg()
    for callback in manager.add_callbacks_post_trainer(cfg, trainer):
        trainer.add_callback(callback)
    manager.post_trainer_create(cfg, trainer)

    trainer.train(resume_from_checkpoint=None)  # create_scheduler asks create_lr_scheduler
    manager.post_train(cfg, trainer.model)
    model.save_pretrained(cfg.output_dir)  # save_trained_model: one process, no FSDP
    tokenizer.save_pretrained(cfg.output_dir)
    manager.post_train(cfg, model)
    manager.post_train_unload(cfg)
    return trainer, model


def step_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_example_trains_under_the_plan_like_axolotls_trainer(axolotl_api, tiny_model_dir,
                                                             tmp_path):  # fmt: skip
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from protrain.integrations.transformers import ProTrainTrainer

    # chunks offloaded (n_persist, chunk_size fixed); the plan searches the rest
    memory = {"auto": True, "gpu_budget": "100MiB", "n_persist": 1, "chunk_size": "512KiB"}
    raw = example_config(tmp_path / "p", tiny_model_dir, protrain_memory=memory)
    trainer, model = run_like_axolotl(raw)
    assert isinstance(trainer, ProTrainTrainer)
    from axolotl.core.trainers.base import AxolotlTrainer

    assert isinstance(trainer, AxolotlTrainer)  # axolotl's trainer, ProTrainTrainer in front
    assert trainer.plan is not None and trainer.plan.n_persist == 1
    assert sum(not c.persistent for c in trainer.layout.chunks) >= 2
    assert not hasattr(model, "_protrain_engine")  # given back in post_train

    plain_raw = {k: v for k, v in raw.items() if k not in ("plugins", "protrain_memory")}
    plain, plain_model = run_like_axolotl({**plain_raw, "output_dir": str(tmp_path / "plain")})
    assert type(plain).__name__ == "AxolotlTrainer"
    losses = step_losses(trainer)
    assert len(losses) == raw["max_steps"]
    torch.testing.assert_close(losses, step_losses(plain), rtol=1e-5, atol=1e-6)

    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), raw["output_dir"]
    )
    want = {n: p for n, p in plain_model.named_parameters() if p.requires_grad}
    got = dict(reloaded.named_parameters())
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"protrain_memory": None}, "protrain_memory is not set"),
        ({"protrain_memory": {"n_swap": 1}}, "protrain_memory sets no engine knob"),
        ({"protrain_memory": {"auto": True, "gpu_budget": "1GiB", "chunked_loss_tokens": 64}},
         "protrain_memory.chunked_loss_tokens is not supported"),
        ({"optimizer": "lion_8bit"}, "optimizer: 'lion_8bit' is not supported"),
        ({"loraplus_lr_ratio": 16}, "loraplus_lr_ratio: not supported"),
        ({"fp16": True}, "fp16: not supported"),
        ({"deepspeed": "zero3.json"}, "deepspeed: another engine"),
        ({"rl": "dpo"}, "rl: ProTrainPlugin trains with axolotl's causal LM trainer only"),
        ({"lora_mlp_kernel": True}, "lora_mlp_kernel: axolotl's fused LoRA kernels read"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_run_names_the_key(axolotl_api, tmp_path, change, message):
    from axolotl.utils.dict import DictDefault

    plugin = axolotl_api.load_plugin(PLUGIN)
    raw = {**example_config(tmp_path, tmp_path), **change}
    with pytest.raises(ValueError, match=message):
        plugin.pre_model_load(DictDefault({k: v for k, v in raw.items() if v is not None}))


def test_a_config_that_cannot_run_is_refused_when_axolotl_validates_it(axolotl_api, tmp_path):
    """The validator of the schema the plugin merges into axolotl's runs at load_cfg, before
    any dataset is tokenized: one line naming the key."""
    from pydantic import ValidationError

    from protrain.integrations.axolotl.args import ProTrainArgs

    raw = {**example_config(tmp_path, tmp_path), "fp16": True}
    with pytest.raises(ValidationError, match="fp16: not supported with ProTrainPlugin"):
        ProTrainArgs.model_validate(raw)


def test_register_takes_over_what_the_engine_does(axolotl_api, tmp_path):
    """lora-1b.yml's keys: gradient_checkpointing, bf16: auto and flash-attention are the
    engine's (off for axolotl itself, the engine's in the Trainer's arguments)."""
    from axolotl.utils.dict import DictDefault

    plugin = axolotl_api.load_plugin(PLUGIN)
    raw = DictDefault({**example_config(tmp_path, tmp_path), "gradient_checkpointing": True,
                       "bf16": "auto", "fp16": None, "attn_implementation": "flash_attention_2"})  # fmt: skip
    plugin.register(raw)
    assert raw["gradient_checkpointing"] is False and raw["bf16"] is False
    assert raw["fp16"] is False  # bf16: auto would turn fp16 on without a bf16 GPU
    assert raw["attn_implementation"] == "sdpa"  # flash_attn is not installed on the CPU
    args = plugin.get_training_args(raw)
    assert args["gradient_checkpointing"] and not args["fp16"]
    assert args["bf16"] == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def test_each_config_registered_is_read_afresh(axolotl_api, tmp_path):
    """axolotl keeps one plugin instance per process (PluginManager is a singleton) and calls
    register for each config it loads there: a config without bf16 or checkpointing trains
    in fp32 without recomputation, whatever the config before it asked for."""
    from axolotl.utils.dict import DictDefault

    plugin = axolotl_api.load_plugin(PLUGIN)
    plugin.register(DictDefault({**example_config(tmp_path, tmp_path), "bf16": True,
                                 "gradient_checkpointing": True}))  # fmt: skip
    assert plugin.get_training_args({})["bf16"]
    plugin.register(DictDefault({**example_config(tmp_path, tmp_path), "bf16": None,
                                 "gradient_checkpointing": None}))  # fmt: skip
    args = plugin.get_training_args({})
    assert not args["bf16"] and not args["gradient_checkpointing"]


@pytest.mark.parametrize("mode", [True, "legacy", "disk", "hidden_states"])
@pytest.mark.parametrize("checkpointing", [True, None])
def test_activation_offloading_is_taken_over_like_checkpointing(
    axolotl_api, tmp_path, mode, checkpointing
):
    """axolotl's activation_offloading (each of its modes) saves activation memory with the
    same math: the engine's activation placement, off for axolotl itself, and not refused."""
    from axolotl.utils.dict import DictDefault

    plugin = axolotl_api.load_plugin(PLUGIN)
    raw = {**example_config(tmp_path, tmp_path), "activation_offloading": mode,
           "gradient_checkpointing": checkpointing}  # fmt: skip
    plugin.register(raw)
    assert raw["activation_offloading"] is False and not raw["gradient_checkpointing"]
    assert plugin.get_training_args(raw)["gradient_checkpointing"]
    plugin.pre_model_load(DictDefault(raw))  # checked when axolotl loads it: not refused


def test_lora_1b_keys_train_under_the_engine(axolotl_api, tiny_model_dir, tmp_path):
    """gradient_checkpointing: true, bf16: auto and optimizer: adamw_8bit (as in axolotl's
    examples/llama-3/lora-1b.yml) train with the engine: activations planned, 8-bit AdamW."""
    memory = {"auto": True, "gpu_budget": "100MiB", "n_persist": 1, "chunk_size": "512KiB"}
    raw = example_config(tmp_path, tiny_model_dir, protrain_memory=memory,
                         gradient_checkpointing=True, bf16="auto", optimizer="adamw_8bit")  # fmt: skip
    raw.pop("fp16", None)
    trainer, _ = run_like_axolotl(raw)
    assert trainer._optimizer_name == "adamw_8bit"
    losses = step_losses(trainer)
    assert len(losses) == raw["max_steps"] and all(map(math.isfinite, losses))


def test_protrain_log_lines_reach_axolotls_logger(axolotl_api, tmp_path):
    """axolotl's console shows INFO only from its own namespace: the plugin hands
    protrain's records to the axolotl logger."""
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.getMessage()))

    axolotl_logger = logging.getLogger("axolotl")
    handler = Keep(level=logging.INFO)
    axolotl_logger.addHandler(handler)
    try:
        axolotl_api.load_plugin(PLUGIN).register(example_config(tmp_path, tmp_path))
        logging.getLogger("protrain.integrations.transformers.trainer").info("the plan")
    finally:
        axolotl_logger.removeHandler(handler)
    assert ("axolotl.protrain.integrations.transformers.trainer", "the plan") in seen


CONSOLE_RUN = """
import logging, sys
from pathlib import Path
sys.path[:0] = [{api!r}, {tests!r}]
import axolotl.cli  # axolotl train: logging configured before the plugin is loaded
from integrations.test_axolotl_plugin import example_config, run_like_axolotl
memory = {{"auto": True, "gpu_budget": "100MiB", "n_persist": 1, "chunk_size": "512KiB"}}
run_like_axolotl(example_config(Path({tmp!r}), {model!r}, protrain_memory=memory,
                                gradient_checkpointing=True))
logging.getLogger("protrain.created.late").info("late info")
logging.getLogger("protrain.created.late").warning("late warning")
"""


def test_protrain_log_lines_reach_axolotls_console_at_its_default_level(
    axolotl_api, tiny_model_dir, tmp_path
):
    """A process that starts as ``axolotl train`` does (axolotl 0.21.0's logging set-up, then
    the plugin): its console shows the plugin's take-over lines, the plan and the INFO lines
    of a protrain logger created after the hooks ran, warnings once, with no log level set."""
    import os
    import subprocess

    script = CONSOLE_RUN.format(api=str(API), tests=str(REPO / "tests"),
                                tmp=str(tmp_path), model=str(tiny_model_dir))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_LEVEL", "AXOLOTL_LOG_LEVEL")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    console = run.stdout
    plugin = "[axolotl.protrain.integrations.axolotl.plugin] ProTrainPlugin: "
    assert plugin + "gradient_checkpointing: the engine saves activation memory" in console
    assert plugin + "the memory plan is made from the heaviest" in console
    assert (
        "[INFO] [axolotl.protrain.integrations.transformers.trainer] protrain memory plan"
        in console
    )
    assert "[INFO] [axolotl.protrain.created.late] late info" in console
    assert console.count("late warning") == 1


def test_register_turns_off_the_lora_kernels_axolotl_would_enable(axolotl_api, tmp_path):
    from protrain.integrations.axolotl.plugin import LORA_KERNEL_KEYS

    raw = {**example_config(tmp_path, tmp_path), "lora_qkv_kernel": False}
    axolotl_api.load_plugin(PLUGIN).register(raw)
    assert all(raw[key] is False for key in LORA_KERNEL_KEYS)


def test_protrain_memory_is_validated_with_the_config(axolotl_api):
    from pydantic import ValidationError

    from protrain.integrations.axolotl.args import ProTrainArgs

    assert axolotl_api.load_plugin(PLUGIN).get_input_args().endswith(".args.ProTrainArgs")
    with pytest.raises(ValidationError, match="memory.auto = true needs memory.gpu_budget"):
        ProTrainArgs.model_validate({"protrain_memory": {"auto": True}})
    with pytest.raises(ValidationError, match="n_persit"):
        ProTrainArgs.model_validate({"protrain_memory": {"n_persit": 1}})


def test_hooks_have_the_plugin_apis_signatures(axolotl_api):
    from protrain.integrations.axolotl import ProTrainPlugin

    assert issubclass(ProTrainPlugin, axolotl_api.BasePlugin)
    overridden = [n for n, v in vars(ProTrainPlugin).items()
                  if inspect.isfunction(v) and hasattr(axolotl_api.BasePlugin, n)]  # fmt: skip
    assert {"get_input_args", "pre_model_load", "get_trainer_cls", "post_train"} <= set(overridden)
    for name in overridden:
        if name == "__init__":
            continue
        ours = list(inspect.signature(getattr(ProTrainPlugin, name)).parameters)
        theirs = list(inspect.signature(getattr(axolotl_api.BasePlugin, name)).parameters)
        assert ours == theirs, name


def test_protrain_does_not_import_axolotl_or_the_plugin():
    """Only the plugin's own package names axolotl or imports the plugin."""
    plugin_dir = REPO / "src/protrain/integrations/axolotl"
    for path in (REPO / "src/protrain").rglob("*.py"):
        if plugin_dir in path.parents:
            continue
        text = path.read_text()
        assert "import axolotl" not in text and "from axolotl" not in text, path
        assert "integrations.axolotl" not in text, path
