"""Shared pytest set-up: GPU tests are skipped where no CUDA device is present; the host
AdamW's one-pass kernel for the tests that run it."""

from types import ModuleType

import pytest
import torch

from protrain.optim import host_adam_ext


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    skip_multi = pytest.mark.skip(reason="needs at least 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session")
def one_pass_kernel() -> ModuleType:
    """The one-pass kernel's operators. Skipped where no C++ compiler is present; where one
    is (CI), a failed build fails the test rather than hiding behind torch's fallback."""
    k = host_adam_ext.kernel()
    if k is None:
        if host_adam_ext.compiler() is None:
            pytest.skip("no C++ compiler: the one-pass kernel cannot be built here")
        pytest.fail("a C++ compiler is present but the one-pass kernel did not build (see the log)")
    return k
