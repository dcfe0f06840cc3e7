"""The host AdamW's one-pass kernel (``csrc/host_adam.cpp``): built on first use, or none.

The kernel is compiled with ``torch.utils.cpp_extension.load`` (g++ and ninja, as DeepSpeed
builds its CPU Adam) for the CPU capability torch dispatches its own kernels to at run time
(``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` lowers), with the
defines and instruction-set flags ATen compiles that capability's kernels with, so that its
``Vectorized<float>`` arithmetic is the same instructions as torch's fused AdamW (see [Note:
same bits as torch's fused AdamW] in the source). Each capability is a build of its own,
cached under torch's extension directory and reused by later processes.

Where no compiler is present, the build fails, or ``PROTRAIN_HOST_ADAM=torch`` is set, the
engine runs torch's fused AdamW as before (``optim/flat_adamw.py``) and casts on the device;
the log says once which path runs and why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

ENV_VAR = "PROTRAIN_HOST_ADAM"  # "torch": always the fallback (tests, a suspect build)
_SOURCE = Path(__file__).with_name("csrc") / "host_adam.cpp"
# Headers the source includes: torch's build cache hashes only the sources and the flags, so
# the headers' hash goes into the flags, and a changed header rebuilds.
_HEADERS = [Path(__file__).with_name("csrc") / "state_codes.h"]
# ATen's flags for each capability's kernels (cmake/Codegen.cmake); DEFAULT: none.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
# No contraction of a multiply and an add into one fma unless the source says fmadd: the
# operations round as written, as torch's kernels do.
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # capability -> module (None: unavailable)
_reported: set[str] = set()


def capability() -> str:
    """The CPU capability torch's kernels run at now (AVX512, AVX2, DEFAULT, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def kernel() -> ModuleType | None:
    """The one-pass kernel for torch's current CPU capability, built on first use; None
    where it is forced off, cannot be built, or the capability has no matching build."""
    if os.environ.get(ENV_VAR, "").lower() == "torch":
        _report("torch", f"{ENV_VAR}=torch")
        return None
    cap = capability()
    with _lock:
        if cap not in _loaded:
            _loaded[cap] = _build(cap)
    return _loaded[cap]


def _build(cap: str) -> ModuleType | None:
    if cap not in _ISA_FLAGS:  # another architecture's vectors: no build matches torch
        _report(cap, f"torch's CPU capability {cap!r} has no matching build")
        return None
    try:
        from torch.utils import cpp_extension  # compiler tooling: only on first build

        module = cpp_extension.load(
            name=_build_name(cap),
            sources=[str(_SOURCE)],
            extra_cflags=[
                *_COMMON_FLAGS,
                *_ISA_FLAGS[cap],
                f"-DCPU_CAPABILITY={cap}",
                f"-DCPU_CAPABILITY_{cap}",
                f"-DPROTRAIN_HEADERS_SHA={_headers_sha()}",
            ],  # fmt: skip
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a compile error: torch's path runs
        _report(cap, f"the build failed: {type(e).__name__}: {_first_line(e)}")
        return None
    if module.capability() != cap:
        _report(cap, f"the build is for {module.capability()}, torch runs {cap}")
        return None
    _report(cap, None)
    return module


def _headers_sha() -> str:
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS))
    return digest.hexdigest()[:16]


def _build_name(cap: str) -> str:
    """One build per capability and torch version (an extension is tied to torch's ABI)."""
    version = re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__)
    return f"protrain_host_adam_{cap.lower()}_{version}"


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _report(key: str, reason: str | None) -> None:
    """Log once per process (and capability) which host AdamW runs, and why."""
    if key in _reported:
        return
    _reported.add(key)
    if reason is None:
        log.info(
            "protrain: host AdamW: the one-pass kernel (%s), bf16/fp16 gradient in, fp32 "
            "master and moments in place, the weights' copy out",
            key,
        )
    else:
        log.warning(
            "protrain: host AdamW: torch's fused AdamW with a cast on the device (%s); the "
            "one-pass kernel is off",
            reason,
        )
