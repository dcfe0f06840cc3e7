"""`make install`'s PyTorch step (scripts/install_torch.sh): the CPU index where it answers,
PyPI within seconds where it does not (a machine whose only package source is PyPI)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_torch.sh"


def install(index: str, *, use_index: bool = True, probe_timeout: float = 30.0):
    """Runs the script with `echo` as pip: (the pip command it ran, stderr, seconds). The
    probe's timeout is generous unless a test times it: a local index on a loaded machine
    may take over a second to answer."""
    env = dict(
        os.environ,
        TORCH_SPEC="torch==2.13.0",
        USE_CPU_INDEX="1" if use_index else "0",
        TORCH_CPU_INDEX=index,
        PROBE_TIMEOUT=str(probe_timeout),
        PIP="echo pip",
    )
    t0 = time.perf_counter()
    done = subprocess.run(
        ["bash", str(SCRIPT), sys.executable], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr, time.perf_counter() - t0


@contextmanager
def server(answer: bool) -> Iterator[str]:
    """A local index: answers every GET (answer=True) or accepts and never replies."""
    if answer:
        httpd = http.server.HTTPServer(("127.0.0.1", 0), _Ok)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}/whl/cpu"
        finally:
            httpd.shutdown()
            httpd.server_close()
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # connections complete in the backlog; nothing is ever sent
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}/whl/cpu"
        finally:
            sock.close()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html></html>")

    def log_message(self, *args) -> None:
        pass


def test_an_index_that_answers_is_used() -> None:
    with server(answer=True) as url:
        cmd, err, _ = install(url)
    assert cmd == f"pip install -q --timeout 30 --retries 1 --index-url {url} torch==2.13.0"
    assert err == ""


def test_an_index_that_never_answers_falls_back_to_pypi_within_seconds() -> None:
    with server(answer=False) as url:
        cmd, err, seconds = install(url, probe_timeout=1.0)
    assert cmd == "pip install -q --timeout 30 --retries 1 torch==2.13.0"
    assert f"PyTorch's CPU index ({url}) did not answer within 1.0 s" in err
    assert seconds < 15


def test_a_refused_connection_falls_back_to_pypi() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens on this port
    cmd, err, _ = install(f"http://127.0.0.1:{port}/whl/cpu")
    assert "--index-url" not in cmd and cmd.endswith("torch==2.13.0")
    assert "did not answer" in err


def test_no_probe_where_the_machine_has_its_own_wheels() -> None:
    cmd, err, seconds = install("http://127.0.0.1:9/never", use_index=False)
    assert cmd == "pip install -q --timeout 30 --retries 1 torch==2.13.0"
    assert err == ""
