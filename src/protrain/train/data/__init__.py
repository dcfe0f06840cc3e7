"""The data side of `protrain train`: datasets, chat templates, loss masks, packing, collation.

The folder is the table of contents: `config` (YAML keys), `loading` (files and hub),
`formats` (row shapes), `templates` (built-in chat templates), `rendering` (turns in the
rendered chat), `masks` (which tokens are trained), `encoding` (text samples to ids),
`role_boundaries` and `vision` (vision-language rows), `packing`, `collate`, `items`
(dataset items), `dataset` (the builders), `prepared` (the cache), `preprocess` (`protrain
preprocess`), `inspect` (`protrain inspect-data`), `masking_info`.
"""

from protrain.train.data.collate import build_collator
from protrain.train.data.config import DatasetConfig, DataSettings, RoleBoundary
from protrain.train.data.dataset import build_eval_dataset, build_train_dataset, check_settings
from protrain.train.data.errors import DataError
from protrain.train.data.inspect import render_inspection
from protrain.train.data.masking_info import describe_masking
from protrain.train.data.masks import IGNORE_INDEX
from protrain.train.data.preprocess import preprocess
from protrain.train.data.templates import BUILTIN_TEMPLATES
from protrain.train.data.vision import load_processor

__all__ = [
    "BUILTIN_TEMPLATES",
    "IGNORE_INDEX",
    "DataError",
    "DataSettings",
    "DatasetConfig",
    "RoleBoundary",
    "build_collator",
    "build_eval_dataset",
    "build_train_dataset",
    "check_settings",
    "describe_masking",
    "load_processor",
    "preprocess",
    "render_inspection",
]
