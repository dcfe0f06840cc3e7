"""axolotl 0.21.0 ``src/axolotl/cli/__init__.py``: importing it sets three environment
defaults and configures logging, which ``axolotl train`` does before it loads the config and
its plugins."""

import os

from axolotl.logging_config import configure_logging

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

configure_logging()
