"""Files that are either whole or known to be damaged: atomic writes, and records (size and SHA-256) to check a
file against later. The prepared data's manifest and the training checkpoints' manifests are made of these
records."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np


def atomic_write_bytes(path: Path, data: bytes | np.ndarray) -> None:
    """Write ``data`` to ``path`` through a synced temporary file and a rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        if isinstance(data, np.ndarray):
            data.tofile(f)
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
