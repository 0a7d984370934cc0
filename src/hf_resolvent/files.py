"""Files that are either whole or known to be damaged: atomic writes, and records (size and SHA-256) to check a
file against later. The prepared data's manifest and the training checkpoints' manifests are made of these
records. Writes the filesystem refuses (a full device, a read-only folder) become one :class:`WriteError` naming
the place (:func:`writing`)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def atomic_write_bytes(path: Path, data: bytes | np.ndarray) -> None:
    """Write ``data`` to ``path`` through a synced temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, np.ndarray):
                data.tofile(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a write cut short (a full device) leaves no partial file behind
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file and a rename (never a half-written file)."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def file_problem(root: Path, rel: str, record: dict, full: bool) -> str | None:
    """Why ``root / rel`` is not the file ``record`` describes (None when it is; sizes only unless ``full``)."""
    path = root / rel
    if not path.is_file():
        return f"{rel} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{rel} is damaged: {size:,} bytes where {record['bytes']:,} were written (truncated or replaced)"
    if full and file_sha256(path) != record["sha256"]:
        return f"{rel} is damaged: its sha256 differs from the one recorded when it was written"
    return None


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


class WriteError(OSError):
    """A write the filesystem refused, for want of space or permission; the message names the place and the fix,
    ``errno`` says which."""


def _errno_of(err: BaseException) -> int | None:
    """The OS error behind a failed write. Not every writer passes it on: safetensors puts it in its message
    ("No space left on device (os error 28)"), and torch's zip writer only finds that a file came out shorter than
    what it wrote ("unexpected pos", "file write failed"), which is a device that filled up."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    text = str(err)
    if (m := re.search(r"\(os error (\d+)\)", text)) is not None:
        return int(m.group(1))
    if isinstance(err, RuntimeError) and ("unexpected pos" in text or "file write failed" in text):
        return errno.ENOSPC
    return None


def _free_space(path: Path) -> str:
    """Free space on the device holding ``path`` (its nearest existing folder), in words."""
    for folder in (path, *path.parents):
        if folder.exists():
            return f"{shutil.disk_usage(folder).free / 2**20:,.1f} MiB free there"
    return "free space unknown"


def write_problem(err: BaseException, path: str | os.PathLike) -> tuple[int, str] | None:
    """(errno, a sentence naming the problem and the fix) when ``err`` is a write into ``path`` that the
    filesystem refused (a full device, a read-only or forbidden folder, a file over the size limit); None for any
    other error."""
    code = _errno_of(err)
    path = Path(path)
    if code in NO_SPACE:
        quota = f"{os.strerror(code)}; " if code != errno.ENOSPC else ""
        return code, f"no space left on the device holding {path} ({quota}{_free_space(path)}): free some space there"
    if code in NOT_WRITABLE:
        return code, f"cannot write to {path} ({os.strerror(code)}): make it writable"
    if code == errno.EFBIG:
        return code, (f"a file under {path} grew past the largest file allowed there ({os.strerror(code)}: a FAT32 "
                      f"drive holds files of at most 4 GiB, and `ulimit -f` may set a lower limit): write to another "
                      f"filesystem or raise the limit")
    return None


@contextmanager
def writing(path: str | os.PathLike, then: str = "") -> Iterator[None]:
    """Turn a write under ``path`` that the filesystem refuses into :class:`WriteError`, whose message names the
    problem, ``path`` and the fix, continued by ``then`` ("or pass another --output-dir"). The writers
    themselves report it each in their own way (OSError, torch's RuntimeError, safetensors' error) and without
    naming the place; other errors pass through unchanged."""
    try:
        yield
    except WriteError:
        raise
    except Exception as err:
        problem = write_problem(err, path)
        if problem is None:
            raise
        failed = WriteError(f"{problem[1]}, {then}" if then else problem[1])
        failed.errno = problem[0]
        raise failed from err
