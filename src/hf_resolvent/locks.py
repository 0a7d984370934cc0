"""Exclusive locks for work two processes must not do at once: a kernel build, a training run's output folder.

The lock is an operating-system lock on a file (``filelock``: ``flock`` on Unix), held through an open file
descriptor, so it ends with its holder: a process killed at any moment never leaves a lock that blocks the next
one. Beside the lock file, an owner file names the holder (pid, host, command, start time) for the messages of
whoever finds the lock taken. An owner file found under a lock that *could* be taken was left by a holder that
died without cleaning up; it is reported as taken over.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout


class LockHeld(RuntimeError):
    """Another live process holds the lock (the message names it and what to do)."""


def say(message: str) -> None:
    """One line on stderr, shown at any log level (long or blocking work must say what it is doing)."""
    print(f"hf_resolvent: {message}", file=sys.stderr, flush=True)


def _owner_path(lock_path: Path) -> Path:
    return lock_path.with_name(lock_path.name + ".owner")


def _describe(owner_path: Path) -> str:
    """``pid 123 on host (python train.py ..., since 12:00:01)``, or ``another process`` when unknown."""
    try:
        info = json.loads(owner_path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on {info['host']} ({info['command']}, since {started})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextmanager
def exclusive(path: str | os.PathLike, what: str, fix: str, wait_s: float = 0.0,
              report: Callable[[str], None] = say) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the enclosed block.

    ``what`` names the guarded thing in messages ("the run folder runs/tiny"), ``fix`` tells the user what to do
    when it is taken. With ``wait_s`` = 0 a lock held by a live process raises :class:`LockHeld` at once;
    otherwise the wait is announced through ``report`` and bounded by ``wait_s`` seconds, then LockHeld.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = _owner_path(path)
    lock = FileLock(str(path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = _describe(owner)
        if wait_s <= 0:
            raise LockHeld(f"{what} is in use by {holder} (lock {path}); {fix}") from None
        report(f"waiting up to {wait_s:.0f} s for {holder}, which holds {what} (lock {path})")
        try:
            lock.acquire(timeout=wait_s)
        except Timeout:
            raise LockHeld(f"{what} was still in use by {_describe(owner)} after {wait_s:.0f} s (lock {path}); "
                           f"{fix}") from None
    try:
        if owner.exists():
            report(f"took over {what} from {_describe(owner)}, which ended without releasing it")
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200] if sys.argv else "python"
        tmp = owner.with_name(owner.name + f".{os.getpid()}")
        tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                                   "since": time.time()}))
        os.replace(tmp, owner)
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()
