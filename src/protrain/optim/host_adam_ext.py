"""The host AdamW's one-pass kernel (``csrc/host_adam.cpp``): built on first use, or none.

The kernel is compiled with ``torch.utils.cpp_extension.load`` (g++ and ninja, as DeepSpeed
builds its CPU Adam) for the CPU capability torch dispatches its own kernels to at run time
(``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` lowers), with the
defines and instruction-set flags ATen compiles that capability's kernels with, so that its
``Vectorized<float>`` arithmetic is the same instructions as torch's fused AdamW (see [Note:
same bits as torch's fused AdamW] in the source). It registers its operators with torch's
dispatcher (``torch.ops.<build name>``), not as a pybind11 module: see [Note: the kernel's
build cache].

Where no compiler is present, the build fails, or ``PROTRAIN_HOST_ADAM=torch`` is set, the
engine runs torch's fused AdamW as before (``optim/flat_adamw.py``) and casts on the device;
the log says once which path runs and why.

[Note: the kernel's build cache]
A build lives in ``$TORCH_EXTENSIONS_DIR/<name>`` where that is set, else in
``$XDG_CACHE_HOME/protrain/<name>`` (``~/.cache/protrain/<name>``). The name carries the
capability and a hash of everything the binary depends on (the source, the flags, torch's
version and install path, the Python ABI), and it compiles its own copy of the source, so
ninja's command is the same from any checkout and a directory's library never changes once
built: a process that has it mapped is never rebuilt under, two checkouts or venvs never
rebuild each other's, and an edited source is a new build. Ranks that start at once build it
once: each takes an exclusive ``flock`` on the directory's ``build.lock`` around torch's
``load``, which waits while another builds, then finds the build done (ninja's no-op). The
operating system drops a ``flock`` when its holder dies, so a rank killed mid-build never blocks the
next run; torch's own baton (a ``lock`` file, created and removed by the builder) would, so
one found while holding the ``flock`` is a dead builder's and is removed. The first build
takes about 10 s of one core per capability (most of it parsing ``torch/library.h``); once
it has loaded, a ``built`` stamp lets later processes load the library directly, in a few
milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

ENV_VAR = "PROTRAIN_HOST_ADAM"  # "torch": always the fallback (tests, a suspect build)
_SOURCE = Path(__file__).with_name("csrc") / "host_adam.cpp"
# The project's headers the source includes: part of the build's hash, as the source is.
_HEADERS = [Path(__file__).with_name("csrc") / "state_codes.h"]
# ATen's flags for each capability's kernels (cmake/Codegen.cmake); DEFAULT: none.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
# No contraction of a multiply and an add into one fma unless the source says fmadd: the
# operations round as written, as torch's kernels do. -O3 and -O2 build equally fast.
# -fno-trapping-math (no trap is ever enabled; no value changes) lets the compact moments'
# loops compute both sides of a select, so that they vectorize (csrc/state_codes.h).
# -fno-math-errno (nothing reads errno; sqrt's value is the same) lets them call sqrt in a
# vector loop.
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # capability -> operators (None: unavailable)
_reported: set[str] = set()


def capability() -> str:
    """The CPU capability torch's kernels run at now (AVX512, AVX2, DEFAULT, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def kernel() -> ModuleType | None:
    """The one-pass kernel's operators (``adamw_step``, ``vec_size``, ``capability``) for
    torch's current CPU capability, built on first use; None where it is forced off, cannot
    be built, or the capability has no matching build."""
    if os.environ.get(ENV_VAR, "").lower() == "torch":
        _report("torch", f"{ENV_VAR}=torch")
        return None
    cap = capability()
    with _lock:
        if cap not in _loaded:
            _loaded[cap] = _build(cap)
    return _loaded[cap]


def compiler() -> str | None:
    """The C++ compiler torch's build runs (``$CXX``, else ``c++``), where it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_root() -> Path:
    """Where builds are kept ([Note: the kernel's build cache])."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "protrain"


def build_flags(cap: str) -> list[str]:
    """The compiler flags of ``cap``'s build (without the operators' namespace)."""
    return [*_COMMON_FLAGS, *_ISA_FLAGS[cap], f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]


def build_name(cap: str) -> str:
    """The build's name (also its operators' namespace): the capability and a hash of what
    the binary depends on."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    for header in _HEADERS:
        h.update(b"\0" + header.read_bytes())
    for part in (
        *build_flags(cap),
        torch.__version__,
        torch.__file__,
        sys.implementation.cache_tag,
    ):
        h.update(b"\0" + part.encode())
    return f"protrain_host_adam_{cap.lower()}_{h.hexdigest()[:16]}"


def _build(cap: str) -> ModuleType | None:
    if cap not in _ISA_FLAGS:  # another architecture's vectors: no build matches torch
        _report(cap, f"torch's CPU capability {cap!r} has no matching build")
        return None
    if compiler() is None:
        _report(cap, f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
        return None
    name = build_name(cap)
    directory = cache_root() / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory), _ninja_on_path():
            _load(name, cap, directory)
        ops = getattr(torch.ops, name)
        built_for = ops.capability()
    except Exception as e:  # no compiler, no ninja, a compile error: torch's path runs
        _report(cap, f"the build in {directory} failed: {type(e).__name__}: {_first_line(e)}")
        return None
    if built_for != cap:
        _report(cap, f"the build is for {built_for}, torch runs {cap}")
        return None
    _report(cap, None)
    return ops


def _load(name: str, cap: str, directory: Path) -> None:
    """Build (where not built yet) and load the library, whose operators register as
    ``torch.ops.<name>``. A build that loaded once is stamped ``built`` with the library's
    sha256: later processes load it without torch's build tooling (its import alone takes a
    second or two) when the library still has that hash. A library that changed since (a
    truncated or damaged file, which loading would end the process over with a bus error)
    or is gone is built again."""
    library, stamp = directory / f"{name}.so", directory / "built"
    if stamp.exists():
        if library.exists() and stamp.read_text().strip() == _sha256(library):
            torch.ops.load_library(str(library))
            return
        log.warning("protrain: the host AdamW kernel in %s changed since it was built; "
                    "building it again", directory)  # fmt: skip
        stamp.unlink()
        library.unlink(missing_ok=True)
    from torch.utils import cpp_extension  # compiler tooling: only where a build may run

    log.info("protrain: building the host AdamW kernel (%s) in %s", cap, directory)
    source = directory / _SOURCE.name  # the same path from every checkout: one command
    for path in (_SOURCE, *_HEADERS):  # the headers beside it, as #include "..." finds them
        if not (directory / path.name).exists():
            (directory / path.name).write_bytes(path.read_bytes())
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=[*build_flags(cap), f"-DPROTRAIN_OPS={name}"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    stamp.write_text(_sha256(library))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """One process at a time builds in ``directory``; a dead builder's baton is removed."""
    with open(directory / "build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the system if this process dies
        try:
            (directory / "lock").unlink(missing_ok=True)  # torch's baton: no live builder
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs ``ninja`` from PATH; a venv's ``ninja`` package (a dependency) puts it in
    the venv's bin, which is on PATH only in an activated venv: add it for the build."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja  # the PyPI package: only where no ninja is on PATH
    except ImportError:
        yield  # torch's load says ninja is missing
        return
    if not ninja.BIN_DIR:  # the package without its program
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


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
