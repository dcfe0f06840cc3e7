"""Hardware profile on the CPU: rates measured, cached per machine, read back."""

from __future__ import annotations

import json

from protrain.profile.hardware import HardwareProfile, cache_dir, measure_hardware


def test_cpu_rates_are_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    hw = measure_hardware("cpu")
    assert hw.device == "cpu" and hw.collective_bytes_per_s is None
    for rate in (hw.h2d_bytes_per_s, hw.d2h_bytes_per_s, hw.duplex_bytes_per_s,
                 hw.cpu_adam_params_per_s, hw.device_adam_params_per_s):  # fmt: skip
        assert rate > 0
    files = list(tmp_path.glob("hardware-*.json"))
    assert len(files) == 1 and hw.key in files[0].name
    assert HardwareProfile.from_dict(json.loads(files[0].read_text())) == hw
    # a second call reads the cache (change the file to see it is what comes back)
    d = hw.to_dict() | {"cpu_adam_params_per_s": 1.0}
    files[0].write_text(json.dumps(d))
    assert measure_hardware("cpu").cpu_adam_params_per_s == 1.0
