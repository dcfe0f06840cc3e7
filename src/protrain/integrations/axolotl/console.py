"""ProTrain's log lines on axolotl's console at its default log level.

``axolotl train`` configures logging when it starts (``axolotl/cli/__init__.py`` calls
``logging_config.configure_logging``), before it loads the plugin, and that setup drops
records below WARNING from outside its ``axolotl`` namespace unless ``LOG_LEVEL=INFO``, twice:

- its console handlers carry ``AxolotlOrWarnErrorFilter``;
- ``logging.setLoggerClass(AxolotlLogger)``: every logger created afterwards whose name is
  not under ``axolotl`` carries that filter itself, and a logger's own filter drops the
  record before any handler sees it. protrain's modules are imported after that setup, so
  all their loggers carry it.

So the plan, what the plugin took over and the engine's INFO lines would not show. The
plugin takes that filter off protrain's loggers (those that exist, and, through a logger
class in front of axolotl's, those created later, such as by a module imported during
``protrain.wrap``) and hands the ``protrain`` logger's records to axolotl's own ``axolotl``
logger, under the name ``axolotl.protrain...``: they pass the handlers' filter and get
axolotl's format. Other libraries' loggers keep axolotl's filter.
"""

from __future__ import annotations

import copy
import logging

AXOLOTL_LOGGER = "axolotl"
PROTRAIN = "protrain"
AXOLOTL_FILTER = "AxolotlOrWarnErrorFilter"  # axolotl/logging_config.py, by name: no import


class ToAxolotl(logging.Handler):
    """Re-emits a record through axolotl's logger, named under its namespace."""

    def emit(self, record: logging.LogRecord) -> None:
        record = copy.copy(record)
        record.name = f"{AXOLOTL_LOGGER}.{record.name}"
        logging.getLogger(AXOLOTL_LOGGER).handle(record)


def _is_protrain(name: str) -> bool:
    return name.split(".")[0] == PROTRAIN


def _unfilter(logger: logging.Logger) -> None:
    """Enabled (a logging config with disable_existing_loggers disables it) and without
    axolotl's per-logger filter."""
    logger.disabled = False
    for found in [f for f in logger.filters if type(f).__name__ == AXOLOTL_FILTER]:
        logger.removeFilter(found)


def _protrain_loggers_unfiltered() -> None:
    """The logger class from now on: axolotl's, less its filter on protrain's loggers."""
    current = logging.getLoggerClass()
    if getattr(current, "protrain_unfiltered", False):
        return

    def __init__(self, name: str, level: int = logging.NOTSET) -> None:
        current.__init__(self, name, level)
        if _is_protrain(name):
            _unfilter(self)

    logging.setLoggerClass(
        type(current.__name__, (current,), {"__init__": __init__, "protrain_unfiltered": True})
    )


def show_in_axolotl_console() -> None:
    """Send ``protrain``'s INFO and above through axolotl's logger. Called from every hook
    that runs before training (axolotl may configure its logging again in between); the
    handler is added once per process."""
    for name, logger in logging.Logger.manager.loggerDict.items():
        if _is_protrain(name) and isinstance(logger, logging.Logger):
            _unfilter(logger)
    _protrain_loggers_unfiltered()
    source = logging.getLogger(PROTRAIN)
    if any(isinstance(h, ToAxolotl) for h in source.handlers):
        return
    source.addHandler(ToAxolotl())
    source.setLevel(logging.INFO)
    source.propagate = False  # axolotl's root handler would print the warnings a second time
