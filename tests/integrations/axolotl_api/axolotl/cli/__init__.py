"""axolotl 0.21.0 ``src/axolotl/cli/__init__.py``: importing it configures logging, which
``axolotl train`` does before it loads the config and its plugins."""

from axolotl.logging_config import configure_logging

configure_logging()
