"""What a prepared folder holds and its checks: the manifest, written last, against which a folder counts as
prepared (:func:`verify_prepared`, :func:`is_prepared`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...files import file_problem
from .errors import DataError

TOKEN_DTYPE = np.uint16


# -------------------------------------------------------------------------------------- manifest and checks

MANIFEST = "manifest.json"
# Written in settings.json and manifest.json. The first layout (meta.json only) had neither, so its shards
# cannot be checked: such folders are rebuilt, not trusted.
DATA_FORMAT = "hf_resolvent-token-shards/2"
# Everything prepare_dataset writes in its folder (a rebuild removes these, and nothing else); manifest first,
# so that an interrupted rebuild never leaves a manifest next to half-removed files.
PREPARED_FILES = (MANIFEST, "meta.json", "settings.json", "tokenizer_info.json", "tokenizer", "shards")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when it is missing or unreadable (callers treat both as 'not there')."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rebuild_hint(data_dir: Path) -> str:
    return (f"re-run scripts/prepare_data.py --output-dir {data_dir} with the options that prepared it (it rewrites "
            f"what is damaged)")


def verify_prepared(data_dir: str | os.PathLike, full: bool = False) -> dict:
    """Check a prepared folder against its ``manifest.json``; returns its meta.

    Compares the size of every file (and the sha256 of the small ``meta.json``); ``full=True`` compares every
    sha256 (reads all shards). Raises :class:`DataError` naming the first missing or damaged file, or saying
    why there is no manifest (preparation unfinished, or a folder from a version that wrote none).
    """
    d = Path(data_dir)
    if d.exists() and not d.is_dir():
        raise DataError(f"{d} is a file, not a prepared data folder; pass the folder that scripts/prepare_data.py "
                        f"--output-dir wrote")
    manifest = read_json(d / MANIFEST)
    if not (d / MANIFEST).exists():
        settings = read_json(d / "settings.json")
        if isinstance(settings, dict) and settings.get("format") == DATA_FORMAT:
            raise DataError(f"{d}: its preparation did not finish (no {MANIFEST}); re-run the scripts/prepare_data.py "
                            f"command that started it to finish it")
        if (d / "meta.json").exists():
            raise DataError(f"{d} was prepared by an earlier version of hf_resolvent (meta.json but no {MANIFEST}, so "
                            f"its shards cannot be checked); re-run scripts/prepare_data.py --output-dir {d} with the "
                            f"same options to rebuild it")
        raise DataError(f"{d} is not a prepared data folder (no {MANIFEST}); run scripts/prepare_data.py "
                        f"--output-dir {d}")
    if not (isinstance(manifest, dict) and manifest.get("format") == DATA_FORMAT
            and isinstance(manifest.get("files"), dict) and "meta.json" in manifest["files"]):
        raise DataError(f"{d / MANIFEST} is damaged or was written by another version; {_rebuild_hint(d)}")
    for rel, record in manifest["files"].items():
        if problem := file_problem(d, rel, record, full=full or rel == "meta.json"):
            raise DataError(f"{d}: {problem}; {_rebuild_hint(d)}")
    return json.loads((d / "meta.json").read_text())


def is_prepared(data_dir: str | os.PathLike) -> bool:
    """True when ``data_dir`` holds a finished preparation consistent with its manifest (sizes; see
    :func:`verify_prepared`, which also says what is wrong)."""
    try:
        verify_prepared(data_dir)
    except DataError:
        return False
    return True
