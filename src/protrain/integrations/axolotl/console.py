"""ProTrain's log lines on axolotl's console at its default log level.

axolotl's console handlers drop records below WARNING from loggers outside its ``axolotl``
namespace unless ``LOG_LEVEL=INFO`` (``axolotl/logging_config.py``,
``AxolotlOrWarnErrorFilter``), so the plan, what the plugin took over and the engine's INFO
lines would not show. The plugin hands the ``protrain`` logger's records to axolotl's own
``axolotl`` logger, under the name ``axolotl.protrain...``: they pass that filter, get
axolotl's format, and go to its debug log too. Warnings already pass (WARNING and above).
"""

from __future__ import annotations

import copy
import logging

AXOLOTL_LOGGER = "axolotl"


class ToAxolotl(logging.Handler):
    """Re-emits a record through axolotl's logger, named under its namespace."""

    def emit(self, record: logging.LogRecord) -> None:
        record = copy.copy(record)
        record.name = f"{AXOLOTL_LOGGER}.{record.name}"
        logging.getLogger(AXOLOTL_LOGGER).handle(record)


def show_in_axolotl_console() -> None:
    """Send ``protrain``'s INFO and above through axolotl's logger (the handler once per
    process; called again from later hooks, after axolotl has configured its logging)."""
    # axolotl's dictConfig (disable_existing_loggers) disables loggers that existed before it
    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.split(".")[0] == "protrain" and isinstance(logger, logging.Logger):
            logger.disabled = False
    source = logging.getLogger("protrain")
    if any(isinstance(h, ToAxolotl) for h in source.handlers):
        return
    source.addHandler(ToAxolotl())
    source.setLevel(logging.INFO)
    source.propagate = False  # axolotl's root handler would print the warnings a second time
