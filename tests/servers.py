"""Helpers of the tests that start a server or a launcher in a process of its own: a free loopback port, and the wait
for a server to answer. (A module of its own, not conftest.py: tests/vllm has a conftest.py of its own, which the name
``conftest`` finds there.)"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Return once ``url`` answers 200; an AssertionError with the end of ``log`` if ``proc`` exits first or
    ``timeout`` seconds pass."""
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        try:
            with no_proxy.open(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise AssertionError(f"the server did not answer {url} within {timeout} s:\n{log.read_text()[-3000:]}")
