"""Shared pytest set-up: GPU tests are skipped where no CUDA device is present."""

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    skip_multi = pytest.mark.skip(reason="needs at least 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)
