"""axolotl 0.19.0 ``src/axolotl/core/trainers/base.py``: ``AxolotlTrainer``'s own keyword
arguments over ``transformers.Trainer`` (its mixins: packing, scheduler, optimizer groups,
checkpoint saving, offloading, are left out)."""

from transformers import Trainer


class AxolotlTrainer(Trainer):
    tag_names = ["axolotl"]

    def __init__(
        self, *_args, bench_data_collator=None, eval_data_collator=None, dataset_tags=None, **kwargs
    ):
        self.bench_data_collator = bench_data_collator
        self.eval_data_collator = eval_data_collator
        self.dataset_tags = dataset_tags
        self._signature_columns = None
        super().__init__(*_args, **kwargs)
