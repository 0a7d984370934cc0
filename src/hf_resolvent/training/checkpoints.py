"""Checkpoint folders written atomically with a checksum manifest, and the newest intact one found again
(:func:`finalize_checkpoint`, :func:`resumable_checkpoint`); the final model folder published so that a kill never
leaves one that loads half-written (:func:`publish_model_folder`)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..files import atomic_write_json, file_problem, file_record
from .config import RunError

CKPT_RE = re.compile(r"^step_(\d{7,})$")
MANIFEST = "manifest.json"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:07d}"


def _checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of the finished checkpoint folders, oldest first (temporary folders of saves are not)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := CKPT_RE.match(p.name)) and p.is_dir())


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder with the highest step, intact or not (see :func:`resumable_checkpoint`)."""
    found = _checkpoints(output_dir)
    return found[-1][1] if found else None


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file of ``folder`` in ``manifest.json``, written last."""
    files = {str(p.relative_to(folder)): file_record(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    atomic_write_json(folder / MANIFEST, {"files": files})


def manifest_problem(folder: Path) -> str | None:
    """What is wrong with ``folder`` against its manifest (a missing, truncated or altered file), or None."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (an interrupted save, or a checkpoint of an older version)"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    return next((p for name, record in files.items() if (p := file_problem(folder, name, record, full=True))), None)


def resumable_checkpoint(output_dir: str | os.PathLike, report=print) -> Path | None:
    """The newest checkpoint whose files match its manifest, or None when the run has no checkpoint.

    Each damaged newer checkpoint is named through ``report`` and skipped; when checkpoints exist but none is
    intact, :class:`RunError` names them all."""
    found = _checkpoints(output_dir)
    skipped = []
    for _, folder in reversed(found):
        problem = manifest_problem(folder)
        if problem is None:
            if skipped:
                report(f"warning: skipped the damaged checkpoint(s) {'; '.join(skipped)}; resuming from "
                       f"{folder.name}")
            return folder
        skipped.append(f"{folder.name} ({problem})")
    if skipped:
        raise RunError(f"no intact checkpoint in {Path(output_dir) / 'checkpoints'}: {'; '.join(skipped)}. Delete "
                       f"the damaged folders to start this run again from step 0, or train into another --output-dir")
    return None


def sharded_problem(folder: Path) -> str | None:
    """What is missing from the sharded (DCP) parts of a checkpoint folder: every file that a ``.metadata`` names,
    at least as long as the data it places there; None when all are there (or the folder holds no DCP part)."""
    from torch.distributed.checkpoint import FileSystemReader

    for meta in sorted(Path(folder).rglob(".metadata")):
        part = meta.parent
        needed: dict[str, int] = {}
        for info in FileSystemReader(str(part)).read_metadata().storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for rel, size in sorted(needed.items()):
            path = part / rel
            if not path.is_file() or path.stat().st_size < size:
                return (f"{path.relative_to(folder)} is missing or short: a rank's shard did not reach the folder the "
                        f"main process sees. With several nodes, --output-dir must be on a filesystem shared by all "
                        f"of them")
    return None


def finalize_checkpoint(tmp: Path, final: Path, keep: int) -> None:
    """Write the manifest of a fully written checkpoint folder and rename it into place (the atomic step), then
    prune to the newest ``keep``. A sharded checkpoint must hold every rank's shard (:class:`RunError` otherwise)."""
    problem = sharded_problem(tmp)
    if problem is not None:
        raise RunError(f"the checkpoint {final.name} is incomplete: {problem}")
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep and keep > 0:
        for _, p in _checkpoints(final.parent.parent)[:-keep]:
            shutil.rmtree(p, ignore_errors=True)


def clean_temporary_checkpoints(output_dir: str | os.PathLike) -> None:
    root = Path(output_dir) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)


WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def publish_model_folder(staged: Path, dest: Path) -> None:
    """Move the files of a fully written ``save_pretrained`` folder ``staged`` into ``dest``.

    ``dest`` also holds the run's checkpoints and logs, so it cannot be swapped whole; instead its ``config.json``
    (what makes a folder load) is removed first and the new one moved in last, so a kill at any moment leaves
    either the previous complete model, no loadable model, or the new complete one. Weight files of an earlier
    save that the new one lacks (other shards) are removed."""
    (dest / "config.json").unlink(missing_ok=True)
    new = {p.name for p in staged.iterdir()}
    for p in dest.iterdir():
        if WEIGHT_FILE.match(p.name) and p.name not in new:
            p.unlink()
    for p in sorted(staged.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(p, dest / p.name)
    staged.rmdir()
