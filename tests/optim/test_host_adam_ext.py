"""How the one-pass kernel is built and found: its cache, its name, its lock, its ninja
([Note: the kernel's build cache] in optim/host_adam_ext.py)."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import types
from pathlib import Path

from protrain.optim import host_adam_ext


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host_adam_ext.cache_root() == tmp_path / "xdg" / "protrain"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert host_adam_ext.cache_root() == tmp_path / "ext"


def test_the_name_changes_with_the_source_and_the_capability(monkeypatch, tmp_path):
    src = tmp_path / "host_adam.cpp"
    src.write_text("// one\n")
    monkeypatch.setattr(host_adam_ext, "_SOURCE", src)
    first = host_adam_ext.build_name("AVX2")
    assert first == host_adam_ext.build_name("AVX2")  # stable across calls and processes
    assert first.isidentifier()  # it is the operators' namespace
    assert host_adam_ext.build_name("AVX512") != first
    src.write_text("// two\n")
    assert host_adam_ext.build_name("AVX2") != first


def test_a_dead_builders_baton_does_not_block(one_pass_kernel):
    """torch's load waits for as long as its ``lock`` file exists; one left by a builder
    that was killed is removed under the flock, so the next process loads."""
    cap = host_adam_ext.capability()
    directory = host_adam_ext.cache_root() / host_adam_ext.build_name(cap)
    (directory / "built").unlink(missing_ok=True)  # through torch's load, as a first build
    (directory / "lock").touch()
    result = []
    loader = threading.Thread(target=lambda: result.append(host_adam_ext._build(cap)), daemon=True)
    loader.start()
    loader.join(timeout=120)
    assert not loader.is_alive(), "the build waited on a dead builder's lock"
    assert result == [one_pass_kernel]
    assert not (directory / "lock").exists()
    assert (directory / "built").exists()  # later processes load it directly


def test_ninja_from_the_package_when_none_is_on_path(monkeypatch, tmp_path):
    """``make test`` runs the venv's python without activating it: the ``ninja`` package's
    program is then not on PATH, and torch's build would say ninja is missing."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bin").mkdir()
    program = tmp_path / "bin" / "ninja"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    package = types.ModuleType("ninja")
    package.BIN_DIR = str(tmp_path / "bin")
    monkeypatch.setitem(sys.modules, "ninja", package)
    with host_adam_ext._ninja_on_path():
        assert Path(shutil.which("ninja")) == program
    assert os.environ["PATH"] == str(tmp_path / "empty")


def test_a_damaged_library_is_built_again_not_loaded(monkeypatch, tmp_path):
    """Loading a truncated library ends the process with a bus error, which no except
    catches: a library whose bytes are not those the stamp recorded is removed and built
    again; an intact one is loaded without the build tooling."""
    import torch
    from torch.utils import cpp_extension

    name = "protrain_host_adam_test"
    library, stamp = tmp_path / f"{name}.so", tmp_path / "built"
    library.write_bytes(b"\x7fELF the library as built")
    stamp.write_text(host_adam_ext._sha256(library))
    loaded, built = [], []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]) or None)

    def build_writes_the_library(**kw):
        built.append(kw["name"])
        library.write_bytes(b"\x7fELF built again")

    host_adam_ext._load(name, "AVX2", tmp_path)
    assert loaded == [str(library)] and built == []  # intact: loaded directly
    library.write_bytes(b"\x7fELF trunc")  # damaged after it was stamped
    monkeypatch.setattr(cpp_extension, "load", build_writes_the_library)
    host_adam_ext._load(name, "AVX2", tmp_path)
    assert built == [name] and loaded == [str(library)]  # built again, not loaded as it was
    assert stamp.read_text() == host_adam_ext._sha256(library)
