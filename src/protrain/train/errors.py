"""Errors that the CLI reports as one clear line, without a traceback.

They describe a problem with the user's input (config, data, output directory), not a bug.
"""


class ConfigError(ValueError):
    """The training config is invalid: the message names the key, the value and what is allowed."""


class OutputDirError(RuntimeError):
    """The output directory cannot be used as asked (it would overwrite earlier work)."""
