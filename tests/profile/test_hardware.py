"""Hardware profile on the CPU: rates measured, cached per machine, read back."""

from __future__ import annotations

import json

import pytest
import torch

from protrain.profile import hardware
from protrain.profile.hardware import HardwareProfile, cache_dir, measure_hardware


def test_cpu_rates_are_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    hw = measure_hardware("cpu")
    assert hw.device == "cpu" and hw.collective_bytes_per_s is None
    for rate in (hw.h2d_bytes_per_s, hw.d2h_bytes_per_s, hw.duplex_bytes_per_s,
                 hw.cpu_adam_params_per_s, hw.device_adam_params_per_s,
                 hw.cpu_adam_busy_params_per_s, hw.cpu_clip_params_per_s):  # fmt: skip
        assert rate > 0
    files = list(tmp_path.glob("hardware-*.json"))
    assert len(files) == 1 and hw.key in files[0].name
    assert HardwareProfile.from_dict(json.loads(files[0].read_text())) == hw
    # a second call reads the cache (change the file to see it is what comes back)
    d = hw.to_dict() | {"cpu_adam_params_per_s": 1.0}
    files[0].write_text(json.dumps(d))
    assert measure_hardware("cpu").cpu_adam_params_per_s == 1.0


def _stand_in_adam(seen: dict):
    def adam_rate(device):
        seen["copying"] = seen.get("copying", False)
        return 1.0

    return adam_rate


def test_busy_host_adam_is_timed_only_while_copies_run(monkeypatch):
    """The busy host AdamW rate is timed after the copies have started (the best of the
    timings would otherwise be an idle one); the copier thread is stopped and joined."""
    import threading
    import time

    seen: dict = {}

    def copier(device, stop, copying):
        time.sleep(0.2)  # pinned and device buffers take a while to allocate
        seen["copying"] = True
        copying.set()
        stop.wait()
        seen["stopped"] = True

    monkeypatch.setattr(hardware, "_copy_until", copier)
    monkeypatch.setattr(hardware, "_adam_rate", _stand_in_adam(seen))
    monkeypatch.setattr(hardware.host_adam_ext, "kernel", lambda: None)  # torch's path
    threads = threading.active_count()
    cpu = torch.device("cpu")
    assert hardware._host_adam_rate(cpu, busy_device=cpu, threads=1) == 1.0
    assert seen == {"copying": True, "stopped": True}
    assert threading.active_count() == threads


def test_busy_host_adam_with_failed_copies_is_an_error(monkeypatch):
    seen: dict = {}

    def copier(device, stop, copying):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(hardware, "_copy_until", copier)
    monkeypatch.setattr(hardware, "_adam_rate", _stand_in_adam(seen))
    monkeypatch.setattr(hardware.host_adam_ext, "kernel", lambda: None)  # torch's path
    with pytest.raises(RuntimeError, match="cudaHostAlloc failed"):
        hardware._host_adam_rate(torch.device("cpu"), busy_device=torch.device("cpu"), threads=1)
    assert seen == {}  # nothing timed without the copies
