"""axolotl 0.21.0 ``src/axolotl/integrations/base.py``: ``BasePlugin`` with every hook's
signature and default, ``load_plugin``, and the ``PluginManager`` calls made on the way
through ``axolotl train`` of a causal LM with LoRA, and by ``axolotl merge-lora``
(``post_lora_merge``). Left out: docstrings, logging, the bundled plugins and entry-point
discovery, the managers of hooks that path never calls (``create_optimizer``, which nothing
in 0.21.0 calls; the RL-only ``on_rollouts_scored``; ``load_adapter`` and the adapter
capabilities, asked only for adapters other than lora), ``BaseOptimizerFactory``."""

from __future__ import annotations

import collections
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from peft import PeftModel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedModel, Trainer

from axolotl.utils.dict import DictDefault


@dataclass(frozen=True)
class AdapterCapabilities:
    name: str
    lora_like: bool = False
    relora: bool = False


class BasePlugin:
    def __init__(self):
        """Initializes the BasePlugin."""

    def register(self, cfg: dict):
        pass

    def on_config_validation_error(self, cfg: dict):
        pass

    def get_input_args(self) -> str | None:
        pass

    def get_training_args_mixin(self) -> str | None:
        pass

    def get_adapter_capabilities(self) -> list[AdapterCapabilities]:
        return []

    def get_lora_config_kwargs(self, cfg: DictDefault) -> dict:
        return {}

    def load_adapter(self, model: PreTrainedModel, cfg: DictDefault, inference: bool = False,
                     config_only: bool = False):  # fmt: skip
        pass

    def load_datasets(self, cfg: DictDefault, preprocess: bool = False):
        pass

    def pre_model_load(self, cfg: DictDefault):
        pass

    def post_model_build(self, cfg: DictDefault, model: PreTrainedModel):
        pass

    def pre_lora_load(self, cfg: DictDefault, model: PreTrainedModel):
        pass

    def post_lora_load(self, cfg: DictDefault, model: PreTrainedModel | PeftModel):
        pass

    def post_model_load(self, cfg: DictDefault, model: PreTrainedModel | PeftModel):
        pass

    def get_trainer_cls(self, cfg: DictDefault) -> type[Trainer] | None:
        pass

    def post_trainer_create(self, cfg: DictDefault, trainer: Trainer):
        pass

    def get_training_args(self, cfg: DictDefault):
        pass

    def get_collator_cls_and_kwargs(self, cfg: DictDefault, is_eval: bool = False):
        pass

    def create_optimizer(self, cfg: DictDefault, trainer: Trainer) -> Optimizer | None:
        pass

    def create_lr_scheduler(self, cfg: DictDefault, trainer: Trainer, optimizer: Optimizer,
                            num_training_steps: int) -> LRScheduler | None:  # fmt: skip
        pass

    def add_callbacks_pre_trainer(self, cfg: DictDefault, model: PreTrainedModel) -> list[Callable]:
        return []

    def add_callbacks_post_trainer(self, cfg: DictDefault, trainer: Trainer) -> list[Callable]:
        return []

    def on_rollouts_scored(self, cfg: DictDefault, trainer, prompts: list[str],
                           completions: list[str], rewards: dict[str, list[float]],
                           advantages: list[float]):  # fmt: skip
        pass

    def post_train(self, cfg: DictDefault, model: PreTrainedModel | PeftModel):
        pass

    def post_lora_merge(self, cfg: DictDefault, adapter_path: str, output_path: str) -> None:
        pass

    def post_train_unload(self, cfg: DictDefault):
        pass


def normalize_plugin_name(target: str) -> str:
    module_name, separator, class_name = target.partition(":")
    return f"{module_name}.{class_name}" if separator else target


def load_plugin(plugin_name: str) -> BasePlugin:
    module_name, separator, class_name = plugin_name.partition(":")
    if not separator:
        module_name, class_name = plugin_name.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as orig_exc:
        try:
            if not module_name.startswith("axolotl.integrations."):
                module = importlib.import_module("axolotl.integrations." + module_name)
            else:
                raise orig_exc
        except ModuleNotFoundError as exc:
            raise orig_exc from exc
    plugin_class = getattr(module, class_name)
    return plugin_class()


class PluginManager:
    """0.21.0's manager is a process-wide singleton whose ``get_instance`` also registers
    its bundled plugins (context and expert parallelism, whose hooks do nothing unless
    their own config sections are set); here ``PluginManager()`` starts a fresh one per
    run, without them, and ``get_instance`` returns it."""

    _instance: PluginManager | None = None

    def __init__(self):
        self.plugins: collections.OrderedDict[str, BasePlugin] = collections.OrderedDict()
        self.cfg: DictDefault | None = None
        PluginManager._instance = self

    @staticmethod
    def get_instance() -> PluginManager:
        return PluginManager._instance or PluginManager()

    def register(self, plugin_name: str, *, required: bool = False):
        try:
            self.plugins[plugin_name] = load_plugin(plugin_name)
        except Exception:
            if required:  # prepare_plugins registers the config's plugins as required
                raise

    def on_config_validation_error(self, cfg):
        configured_plugins = {normalize_plugin_name(name) for name in cfg.get("plugins") or []}
        for plugin_name, plugin in self.plugins.items():
            if plugin_name in configured_plugins:
                plugin.on_config_validation_error(cfg)

    def get_input_args(self) -> list[str]:
        input_args = []
        for plugin in self.plugins.values():
            input_args_from_plugin = plugin.get_input_args()
            if input_args_from_plugin is not None:
                input_args.append(input_args_from_plugin)
        return input_args

    def get_training_args_mixin(self):
        training_args = []
        for plugin in self.plugins.values():
            training_args_from_plugin = plugin.get_training_args_mixin()
            if training_args_from_plugin is not None:
                training_args.append(training_args_from_plugin)
        return training_args

    def get_lora_config_kwargs(self, cfg: DictDefault) -> dict:
        lora_config_kwargs = {}
        for plugin in self.plugins.values():
            plugin_kwargs = plugin.get_lora_config_kwargs(cfg)
            if plugin_kwargs:
                lora_config_kwargs.update(plugin_kwargs)
        return lora_config_kwargs

    def load_datasets(self, cfg: DictDefault, preprocess: bool = False):
        return_ds_meta = None
        for plugin in self.plugins.values():
            dataset_meta = plugin.load_datasets(cfg, preprocess)
            if dataset_meta is not None:
                if return_ds_meta is None:
                    return_ds_meta = dataset_meta
                else:
                    raise RuntimeError("Multiple plugins loaded datasets")
        return return_ds_meta

    def pre_model_load(self, cfg):
        for plugin in self.plugins.values():
            plugin.pre_model_load(cfg)

    def post_model_build(self, cfg, model):
        for plugin in self.plugins.values():
            plugin.post_model_build(cfg, model)

    def pre_lora_load(self, cfg, model):
        for plugin in self.plugins.values():
            plugin.pre_lora_load(cfg, model)

    def post_lora_load(self, cfg, model):
        for plugin in self.plugins.values():
            plugin.post_lora_load(cfg, model)

    def post_model_load(self, cfg, model):
        for plugin in self.plugins.values():
            plugin.post_model_load(cfg, model)

    def get_trainer_cls(self, cfg):
        for plugin in self.plugins.values():
            trainer_cls = plugin.get_trainer_cls(cfg)
            if trainer_cls is not None:
                return trainer_cls
        return None

    def get_training_args(self, cfg):
        training_args_kwargs = {}
        for plugin in self.plugins.values():
            training_args = plugin.get_training_args(cfg)
            if training_args is not None:
                training_args_kwargs.update(training_args)
        return training_args_kwargs

    def get_collator_cls_and_kwargs(self, cfg, is_eval=False):
        for plugin in self.plugins.values():
            collator = plugin.get_collator_cls_and_kwargs(cfg, is_eval=is_eval)
            if collator is not None:
                collator_cls, collator_kwargs = collator
                return collator_cls, collator_kwargs
        return None

    def post_trainer_create(self, cfg, trainer):
        for plugin in self.plugins.values():
            plugin.post_trainer_create(cfg, trainer)

    def create_lr_scheduler(self, trainer, optimizer, num_training_steps):
        for plugin in self.plugins.values():
            scheduler = plugin.create_lr_scheduler(
                self.cfg, trainer=trainer, optimizer=optimizer,
                num_training_steps=num_training_steps,
            )  # fmt: skip
            if scheduler is not None:
                return scheduler
        return None

    def add_callbacks_pre_trainer(self, cfg, model):
        callbacks = []
        for plugin in self.plugins.values():
            plugin_callbacks = plugin.add_callbacks_pre_trainer(cfg, model)
            if plugin_callbacks:
                callbacks.extend(plugin_callbacks)
        return callbacks

    def add_callbacks_post_trainer(self, cfg, trainer):
        callbacks = []
        for plugin in self.plugins.values():
            plugin_callbacks = plugin.add_callbacks_post_trainer(cfg, trainer)
            if plugin_callbacks:
                callbacks.extend(plugin_callbacks)
        return callbacks

    def post_train(self, cfg, model):
        for plugin in self.plugins.values():
            plugin.post_train(cfg, model)

    def post_lora_merge(self, cfg, adapter_path, output_path):
        for plugin in self.plugins.values():
            plugin.post_lora_merge(cfg, adapter_path, output_path)

    def post_train_unload(self, cfg):
        for plugin in self.plugins.values():
            plugin.post_train_unload(cfg)
