"""Byte units, for budgets and messages (no dependency: every layer may import it)."""

GIB = 1 << 30
