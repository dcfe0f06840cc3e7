"""Vision-language rows: processor rendering, media tensors, masks by role boundaries."""

from __future__ import annotations
