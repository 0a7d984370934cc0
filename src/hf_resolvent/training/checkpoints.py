"""Checkpoint folders written atomically with a checksum manifest, and the newest intact one found again
(:func:`save_checkpoint`, :func:`finalize_checkpoint`, :func:`resumable_checkpoint`); what a run must share with a
checkpoint to resume it (:func:`run_record`, :func:`check_resumable`, :func:`check_layout`); the final model folder
published so that a kill never leaves one that loads half-written (:func:`publish_model_folder`)."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from ..files import atomic_write_json, file_problem, file_record, writing
from .config import ConfigError, RunError, as_numbers, recorded_data_dir

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


# fields that may change between an interrupted run and its resumption (they do not change the weights)
RESUMABLE_CHANGES = {("eval", "every"), ("checkpoint", "every"), ("checkpoint", "keep"), ("log", "every"),
                     ("log", "trackers"), ("eval", "max_windows"), ("eval", "micro_batch")}


def absolute_data_dir(record: dict) -> dict:
    """``record`` with its data folder as an absolute path, as this version records it. Records of earlier versions
    hold it as given, relative to the folder the run was started from (which a resume shares), or null for the
    offline default."""
    data = record.get("data")
    if not isinstance(data, dict) or "dir" not in data:
        return record
    return {**record, "data": {**data, "dir": str(recorded_data_dir(record).resolve())}}


def check_resumable(saved: dict, now: dict) -> None:
    """Refuse to resume a checkpoint whose run record (configuration and data) differs from this run's. Numeric
    settings compare as numbers (a record may hold YAML's string ``"1e-3"``)."""
    saved, now = as_numbers(saved), as_numbers(now)
    diffs = []
    for section in sorted(set(saved) | set(now)):
        old, new = saved.get(section), now.get(section)
        if not isinstance(old, dict) or not isinstance(new, dict):
            if old != new and section != "name":
                diffs.append(f"{section}: {old!r} -> {new!r}")
            continue
        for key in sorted(set(old) | set(new)):
            if (section, key) not in RESUMABLE_CHANGES and old.get(key) != new.get(key):
                diffs.append(f"{section}.{key}: {old.get(key)!r} -> {new.get(key)!r}")
    if diffs:
        raise ConfigError("--resume with another configuration or data than the checkpointed run: "
                            + "; ".join(diffs) + ". Use the checkpointed run's options, or another --output-dir.")


def run_record(cfg: dict, data_meta: dict, train_tokens, val_tokens) -> dict:
    """What a checkpoint must match to be resumed: the configuration and the data set (its description,
    tokenizer and split sizes)."""
    data = {"data": data_meta.get("data"), "tokenizer": data_meta.get("tokenizer_description"),
            "train_tokens": len(train_tokens), "val_tokens": len(val_tokens)}
    return {**cfg, "dataset": data}


class _TiedWeightsNotice(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {...} while saving" when every name it lists is a tied parameter
    of the model: the LM head shares the input embedding's matrix, safetensors stores that matrix once, and
    loading ties the two again, so the notice is expected at every checkpoint. A notice naming any other tensor,
    and every other record, passes."""

    def __init__(self, tied: set[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        found = re.search(r"Removed shared tensor (\{.*?\}) while saving", record.getMessage())
        if found is None:
            return True
        try:
            names = ast.literal_eval(found.group(1))
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(names, set) and names <= self.tied)


def _tied_names(model) -> set[str]:
    """Names of the parameters that share their tensor with another parameter (tied embeddings), all of them."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n for group in names.values() if len(group) > 1 for n in group}


@contextlib.contextmanager
def tied_weights_notice_hidden(model):
    """Hide Accelerate's notice about the model's tied weights (:class:`_TiedWeightsNotice`) while it saves."""
    notice = _TiedWeightsNotice(_tied_names(model))
    logger = logging.getLogger("accelerate.utils.other")  # where clean_state_dict_for_safetensors logs it
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def save_checkpoint(accelerator, model, output_dir: Path, step: int, state: dict, keep: int) -> Path:
    """accelerator.save_state into a temporary folder, then an atomic rename to checkpoints/step_N.

    A write the filesystem refuses (a full device, a read-only folder) removes the temporary folder and raises
    :class:`hf_resolvent.files.WriteError`: the checkpoints written before are kept, and --resume continues from the newest."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(f".tmp_{final.name}")
    last = latest_checkpoint(output_dir)
    then = (f"then run the same command with --resume: it continues from {last.name}, the last checkpoint written"
            if last else "then run the same command with --resume (no checkpoint was written yet: it starts again)")
    try:
        with writing(final.parent, f"{then} ({final.name} was not written)"):
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            accelerator.wait_for_everyone()
            with tied_weights_notice_hidden(accelerator.unwrap_model(model)):
                accelerator.save_state(str(tmp), safe_serialization=True)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                atomic_write_json(tmp / "trainer_state.json", state)
                finalize_checkpoint(tmp, final, keep)
    except Exception:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only takes space: resume never reads it
        raise
    accelerator.wait_for_everyone()
    return final


SHARDED_MODEL = "pytorch_model_fsdp_0"  # what accelerator.save_state writes for the model under FSDP (a DCP folder)


def choose_checkpoint(accelerator, output_dir: Path, warn) -> Path | None:
    """The checkpoint to resume: the main process checks the manifests (every file's sha256, read once, not once
    per process) and every process takes its pick, or raises its error (all stop together, none waits)."""
    outcome = [None, None]
    if accelerator.is_main_process:
        try:
            outcome = [resumable_checkpoint(output_dir, report=warn), None]
        except RunError as err:
            outcome = [None, str(err)]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(outcome)
    if outcome[1] is not None:
        raise RunError(outcome[1])
    return outcome[0]


def check_layout(last: Path, sharded_run: bool, how: str) -> None:
    """Refuse a checkpoint whose layout (sharded by FSDP, or whole) this run cannot load, with the command that can."""
    state = json.loads((last / "trainer_state.json").read_text())
    written = state.get("distributed", "an earlier run")
    sharded = (last / SHARDED_MODEL).is_dir()
    if sharded and not sharded_run:
        raise ConfigError(
            f"{last} is a sharded (FSDP) checkpoint, written by {written}, and this run is {how}: resume it with "
            f"--fsdp, on any number of processes (one included: python scripts/pretrain.py --fsdp ... --resume), or "
            f"with the FSDP accelerate config")
    if not sharded and sharded_run:
        raise ConfigError(
            f"{last} is a whole (unsharded) checkpoint, written by {written}, and this run shards with FSDP: resume "
            f"it without --fsdp and the FSDP accelerate config (one process or DDP, any number of processes), or "
            f"start the FSDP run in another --output-dir")
