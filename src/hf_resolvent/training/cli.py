"""Checks of a command line's device and output paths, made before any work starts: a script must not train for a
minute and only then find that it cannot use its device or write its result."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path


def device_problem(spec: str) -> str | None:
    """Why ``--device spec`` cannot be used here, or None."""
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as err:
        return f"--device {spec!r} is not a device ({err}); pass cpu, or cuda where PyTorch has a GPU"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "is a CPU build" if torch.version.cuda is None else "sees no GPU"
            return (f"--device {spec}: this PyTorch ({torch.__version__}) {why}; pass --device cpu, or install a "
                    f"CUDA build of PyTorch on a machine with a GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (f"--device {spec}: there are {torch.cuda.device_count()} GPUs here (cuda:0 to "
                    f"cuda:{torch.cuda.device_count() - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return f"--device {spec}: this PyTorch has no Apple GPU (MPS) here; pass --device cpu"
    elif device.type not in ("cpu", "cuda", "mps"):
        return f"--device {spec}: this script runs on cpu, cuda or mps"
    return None


def output_problem(path: str | os.PathLike, flag: str, kind: str = "folder") -> str | None:
    """Why ``path`` cannot be the output ``flag`` names (a folder, created if missing, or a file with
    ``kind="file"``), or None."""
    path = Path(path)
    if kind == "folder" and path.exists() and not path.is_dir():
        return (f"{flag} {path} is an existing file, not a folder; pass a folder (one that does not exist yet is "
                f"created), or move the file away")
    if kind == "file" and path.is_dir():
        return f"{flag} {path} is a folder; pass the path of a file to write"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return (f"{flag} {path} is inside {parent}, which is a file, not a folder; pass a path under a "
                        f"folder, or move the file away")
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"{flag} {path}: cannot write in {parent}; pass a path in a folder you can write to"
            break
    return None


def check(parser: argparse.ArgumentParser, device: str | None = None, folders: Iterable = (),
          files: Iterable = ()) -> None:
    """``parser.error`` (exit code 2, one line) on the first problem of ``device`` (None: not checked), the output
    ``folders`` and ``files``, each a (flag, path) pair (a path of None is not checked)."""
    problems = [device_problem(device) if device is not None else None]
    problems += [output_problem(path, flag) for flag, path in folders if path is not None]
    problems += [output_problem(path, flag, "file") for flag, path in files if path is not None]
    problem = next((p for p in problems if p), None)
    if problem:
        parser.error(problem)
