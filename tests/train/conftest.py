"""Fixtures shared by the application's tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def protrain_log():
    """The lines the `protrain` logger writes (it does not propagate to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("protrain")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
