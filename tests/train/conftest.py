"""Fixtures shared by the application's tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def protrain_log():
    """The lines the `protrain` logger writes at INFO and above (it does not propagate to
    pytest's caplog)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("protrain")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
