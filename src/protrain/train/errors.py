"""Errors that the CLI reports as one clear line, without a traceback.

They describe a problem with the user's input (config, data, output directory), not a bug.
"""


class ConfigError(ValueError):
    """The training config is invalid: the message names the key, the value and what is allowed."""


class OutputDirError(RuntimeError):
    """The output directory cannot be used as asked (it would overwrite earlier work)."""


class PlanRefusedError(ConfigError):
    """No memory plan fits the peak measured over the first steps: the steps run are sound
    (the run saves them before it ends), only the budget is too small for the next."""
