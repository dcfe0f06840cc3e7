"""axolotl 0.21.0 ``src/axolotl/core/trainers/base.py``: what ``AxolotlTrainer`` does that a
trainer class put in front of it meets: its own keyword arguments over
``transformers.Trainer``, the loss-normalisation check at the end of ``__init__``, the
``axolotl_cfg`` the builder sets on the trainer (``core/builders/causal.py``), and the
plugins' ``create_lr_scheduler`` asked first when the scheduler is made
(``mixins/scheduler.py``). Its other mixins (packing, optimizer groups, checkpoint saving,
offloading) and axolotl's own schedulers are left out: without a plugin's scheduler,
``transformers.Trainer``'s is made."""

import inspect

from transformers import Trainer

from axolotl.integrations.base import PluginManager
from axolotl.utils.dict import DictDefault


def model_loss_accepts_num_items_in_batch(model) -> bool:
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()

    loss_fn = getattr(model, "loss_function", None)
    if loss_fn is None:
        return True

    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return True

    return "num_items_in_batch" in params


class SchedulerMixin(Trainer):
    """``mixins/scheduler.py``'s ``create_scheduler``: a plugin's scheduler first."""

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if optimizer is None:
            if self.optimizer is None:
                raise ValueError(
                    "Optimizer must be set before calling create_scheduler or passed as an argument."
                )
            optimizer = self.optimizer

        if self.lr_scheduler is None:
            plugin_manager = PluginManager.get_instance()
            lr_scheduler = plugin_manager.create_lr_scheduler(
                trainer=self, optimizer=optimizer, num_training_steps=num_training_steps
            )
            if lr_scheduler is not None:
                self.lr_scheduler = lr_scheduler
            else:  # axolotl's own schedulers (one_cycle, rex, cosine variants) left out
                super().create_scheduler(num_training_steps, optimizer=optimizer)
        return self.lr_scheduler


class AxolotlTrainer(SchedulerMixin, Trainer):
    tag_names = ["axolotl"]
    reports_token_perplexity = True
    _axolotl_cfg: DictDefault | None = None

    @property
    def axolotl_cfg(self):
        return self._axolotl_cfg

    @axolotl_cfg.setter
    def axolotl_cfg(self, cfg):
        self._axolotl_cfg = cfg

    @classmethod
    def requires_all_columns(cls, cfg: DictDefault) -> bool:
        return False

    def post_set_axolotl_cfg(self):
        """Finish configuration that depends on ``axolotl_cfg``."""

    def __init__(
        self, *_args, bench_data_collator=None, eval_data_collator=None, dataset_tags=None, **kwargs
    ):
        self.bench_data_collator = bench_data_collator
        self.eval_data_collator = eval_data_collator
        self.dataset_tags = dataset_tags
        self._signature_columns = None

        super().__init__(*_args, **kwargs)

        # a wrong False here mis-normalises the loss under gradient accumulation
        unwrapped_model = self.accelerator.unwrap_model(self.model)
        if self.model_accepts_loss_kwargs and not model_loss_accepts_num_items_in_batch(
            unwrapped_model
        ):
            self.model_accepts_loss_kwargs = False

        self.train_data_collator = self.data_collator
