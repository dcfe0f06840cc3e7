"""A model or tokenizer named by hub id, refused at once where it cannot be had.

A name that is no local directory is a hub id. Where it is not in the Hugging Face cache
and the hub cannot be reached (an offline machine, `HF_HUB_OFFLINE=1`), huggingface_hub
retries the connection for 30 to 60 s before transformers fails; a typo'd name on such a
machine would cost that every time. One TCP connection to the hub's host (3 s at most)
says it first. Behind a proxy (`HTTPS_PROXY`, ...) the direct connection says nothing, so
no check is made there.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, try_to_load_from_cache

from protrain.train.errors import ConfigError

_CONNECT_TIMEOUT_S = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")
# a file every model or tokenizer repository has at least one of
_MARKER_FILES = ("config.json", "tokenizer_config.json")


def check_hub_source(key: str, name: str, revision: str | None) -> None:
    """ConfigError naming ``key`` when ``name`` is neither a local path nor in the hub
    cache and the hub cannot be reached (or is switched off by HF_HUB_OFFLINE)."""
    if Path(name).expanduser().exists() or _in_cache(name, revision):
        return
    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set"
    else:
        if any(os.environ.get(v) for v in _PROXY_VARIABLES):
            return
        why = _unreachable(endpoint)
        if why is None:
            return
    raise ConfigError(
        f"{key} = {name!r} is not a local directory nor in the Hugging Face cache, and the "
        f"hub ({endpoint}) cannot be reached: {why}; check the name (a typo?), or give a "
        "local directory"
    )


def _in_cache(name: str, revision: str | None) -> bool:
    for filename in _MARKER_FILES:
        try:
            found = try_to_load_from_cache(name, filename, revision=revision)
        except ValueError:  # not a valid hub id: the loader names it
            return True
        if isinstance(found, str):
            return True
    return False


def _unreachable(endpoint: str) -> str | None:
    """Why the hub's host does not accept a connection; None where it does."""
    url = urlparse(endpoint)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError as exc:  # a port out of range or not a number in HF_ENDPOINT
        return f"{endpoint!r} is no address ({exc})"
    try:
        socket.create_connection((url.hostname, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None
