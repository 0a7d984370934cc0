#!/usr/bin/env python
"""Upload a trained model folder (scripts/pretrain.py output) to the Hugging Face Hub, with its code and card.

    python scripts/push_to_hub.py runs/44m-dense --repo-id me/resolvent-44m-dense --dry-run   # writes the files
    python scripts/push_to_hub.py runs/44m-dense --repo-id me/resolvent-44m-dense             # uploads them

The upload is built in a staging folder first: the model folder's files without training state (checkpoints/,
logs/), the model code that ``trust_remote_code=True`` loads (the ``auto_map`` modules; re-written with the
installed hf_resolvent if the folder lacks them) and the model card ``README.md`` with the repository id filled in
(rendered from hf_resolvent/training/model_card.md when the folder has none). ``--dry-run [DIR]`` stops there and leaves
exactly what would be uploaded in DIR (default ``FOLDER.hub-upload``) with a manifest; without ``--dry-run`` the
staged folder is uploaded with ``huggingface_hub`` (needs a token: ``hf auth login`` or ``HF_TOKEN``, and network).

Before anything is staged, what would be uploaded is checked: ``config.json`` parses, and every weight file opens
and holds finite values. DIR is only ever replaced when this tool made it (it holds the file
``.push_to_hub-staging``): an existing folder with other files in it, the model folder itself, a folder inside it
or above it is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
from pathlib import Path

from hf_resolvent.training import data as hdata
from hf_resolvent.training.card import render_model_card
from hf_resolvent.training.models import mixer_slug

EXCLUDE_DIRS = {"checkpoints", "logs", "eval", "__pycache__", ".git"}
STAGING_MARK = ".push_to_hub-staging"  # in every --dry-run folder this tool made, so that it replaces only those
EXCLUDE_FILES = re.compile(r"(^\.|\.tmp|\.lock$|^random_states_.*\.pkl$|^optimizer\.bin$)")


class HubError(RuntimeError):
    """An upload problem the user can fix (the message says how)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a save_pretrained folder (the --output-dir of scripts/pretrain.py)")
    p.add_argument("--repo-id", required=True, help="namespace/name on the Hub")
    p.add_argument("--dry-run", nargs="?", const="", default=None, metavar="DIR",
                   help="write what would be uploaded to DIR (default FOLDER.hub-upload) and stop")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    p.add_argument("--revision", default=None, help="branch to upload to")
    p.add_argument("--commit-message", default="Upload resolvent model (hf-resolvent)")
    return p


def _check_folder(folder: Path) -> dict:
    """The folder's config, once the folder is a model folder whose config parses and whose weights are whole."""
    if not (folder / "config.json").exists():
        raise HubError(f"{folder} is not a model folder (no config.json); pass the --output-dir of a finished "
                       f"scripts/pretrain.py run")
    if not any((folder / f).exists() for f in ("model.safetensors", "model.safetensors.index.json",
                                                 "pytorch_model.bin")):
        raise HubError(f"{folder} has no model weights (model.safetensors); did the training run finish?")
    if not (folder / "tokenizer_config.json").exists():
        raise HubError(f"{folder} has no tokenizer (tokenizer_config.json); save one with tokenizer.save_pretrained")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HubError(f"{folder / 'config.json'} is not valid JSON ({err}); the folder is damaged: save the model "
                       f"again (model.save_pretrained) or use a checkpoint of the run") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise HubError(f"{folder / 'config.json'} is not a model config (no model_type); save the model again with "
                       f"model.save_pretrained")
    _check_weights(folder)
    return config


def _check_weights(folder: Path) -> None:
    """Every weight file of ``folder`` opens and holds finite values: the safetensors files (the shards of an index
    too) as from_pretrained checks them, a legacy pytorch_model.bin tensor by tensor."""
    import torch

    from hf_resolvent.remote_code import check_saved_weights, unsafe_pickle_problem

    try:
        check_saved_weights(folder)
    except OSError as err:  # it names the file and the fix
        raise HubError(str(err)) from None
    legacy = folder / "pytorch_model.bin"
    if legacy.is_file() and not (folder / "model.safetensors").is_file():
        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:  # it names code to run; torch's message would suggest running it
            raise HubError(unsafe_pickle_problem(legacy, err)) from None
        except (OSError, RuntimeError, ValueError, EOFError) as err:
            raise HubError(f"cannot read the weights file {legacy} ({type(err).__name__}: {err}): the file is "
                           f"truncated or damaged; save the model again (model.save_pretrained)") from None
        bad = next((key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
        if bad is not None:
            raise HubError(f"the weights file {legacy} holds NaN or infinite values in {bad}: the weights are not "
                           f"worth uploading; use an earlier checkpoint of the run")


def prepare_staging(dest: Path, folder: Path) -> None:
    """Make ``dest`` an empty folder marked as this tool's, replacing it only when this tool made it: a path whose
    removal could take a user's files (the model folder, one inside it or above it, a folder of other files, a
    link) is refused."""
    d, f = dest.resolve(), folder.resolve()
    if d == f or d in f.parents:
        raise HubError(f"--dry-run {dest} holds the model folder {folder}; stage the upload in a folder of its own "
                       f"(default: {folder.name}.hub-upload beside the model)")
    if f in d.parents:
        raise HubError(f"--dry-run {dest} is inside the model folder {folder}, whose files it would copy; name a "
                       f"folder outside it (default: {folder.name}.hub-upload beside the model)")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise HubError(f"--dry-run {dest} exists and is not a folder; name a new folder")
    if dest.is_dir() and any(dest.iterdir()):
        if not (dest / STAGING_MARK).is_file():
            raise HubError(f"--dry-run {dest} is a folder with files this tool did not stage; name a new folder "
                           f"(it is replaced on later runs), or empty this one yourself")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / STAGING_MARK).write_text(f"staged by scripts/push_to_hub.py from {folder}; replaced by its next run\n")


def _code_modules(config: dict) -> list[str]:
    """File names of the modules ``auto_map`` points at (``modeling_resolvent.py``, ...)."""
    names = set()
    for ref in (config.get("auto_map") or {}).values():
        refs = ref if isinstance(ref, list) else [ref]
        for r in refs:
            if r and "--" not in r:  # "repo--module.Class" refers to another repository
                names.add(r.rsplit(".", 1)[0] + ".py")
    return sorted(names)


def stage(folder: Path, repo_id: str, dest: Path, config: dict, log=print) -> list[dict]:
    """Build the upload of a checked ``folder`` in ``dest``, an empty folder (its staging mark aside); returns the
    manifest (path, bytes, sha256 per file)."""
    dest.mkdir(parents=True, exist_ok=True)
    for src in sorted(folder.rglob("*")):
        rel = src.relative_to(folder)
        if any(part in EXCLUDE_DIRS for part in rel.parts) or not src.is_file() or EXCLUDE_FILES.search(src.name):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    is_resolvent = config.get("model_type") == "resolvent"
    missing = [m for m in _code_modules(config) if not (dest / m).exists()]
    if is_resolvent and (missing or not config.get("auto_map")):
        # folders saved before the code was attached: re-save config and code with the installed library
        from transformers import AutoModelForCausalLM

        import hf_resolvent  # noqa: F401

        log(f"[push] {folder} lacks its model code ({missing or 'auto_map'}); re-saving it with hf_resolvent "
            f"{hf_resolvent.__version__}")
        AutoModelForCausalLM.from_pretrained(folder).save_pretrained(dest)
        config = json.loads((dest / "config.json").read_text())
        missing = [m for m in _code_modules(config) if not (dest / m).exists()]
        if missing or not config.get("auto_map"):
            raise HubError(f"could not attach the model code to {folder} (missing {missing}); the installed "
                           f"hf_resolvent does not register its classes for remote code")
    card = dest / "README.md"
    if card.exists():
        text = card.read_text().replace("REPO_ID", repo_id)
    else:
        mixer = "gpt2" if config.get("model_type") == "gpt2" else str(config.get("mixer"))
        text = render_model_card({"model_name": repo_id.split("/")[-1], "mixer": mixer, "repo_id": repo_id,
                                    "model_type": (config.get("architectures") or ["?"])[0],
                                    "tags": ["hf-resolvent", "resolvent", f"mixer-{mixer_slug(mixer)}"]})
    if not is_resolvent:
        text = text.replace(", trust_remote_code=True", "")
    card.write_text(text)
    manifest = []
    for f in sorted(p for p in dest.rglob("*") if p.is_file() and p.name != STAGING_MARK):
        data = f.read_bytes()
        manifest.append({"path": f.relative_to(dest).as_posix(), "bytes": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()})
    return manifest


def _is_manifest(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and set(data) == {"repo_id", "files"}


def upload(dest: Path, repo_id: str, token: str | None, private: bool, revision: str | None, message: str) -> str:
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login` (or set HF_TOKEN, or pass --token); "
                       "--dry-run shows what would be uploaded without one")
    if not hdata.hub_reachable():
        raise HubError("the Hugging Face Hub is not reachable (no network, or HF_HUB_OFFLINE=1); connect and "
                       "retry, or use --dry-run to write the upload locally")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(dest), repo_id=repo_id, repo_type="model", revision=revision,
                                 commit_message=message)
    except Exception as err:  # noqa: BLE001 - huggingface_hub raises HTTP and OS errors
        raise HubError(f"upload to {repo_id} failed: {type(err).__name__}: {err}") from err
    return str(getattr(info, "commit_url", info))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.folder)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo_id):
        print(f"error: --repo-id must look like namespace/name, got {args.repo_id!r}", file=sys.stderr)
        return 2
    try:
        config = _check_folder(folder)
        if args.dry_run is not None:
            dest = Path(args.dry_run) if args.dry_run else folder.with_name(folder.name + ".hub-upload")
            listing = dest.parent / (dest.name + ".manifest.json")
            if listing.exists() and not _is_manifest(listing):
                raise HubError(f"{listing} exists and is not a manifest this tool wrote; move it, or name another "
                               f"--dry-run folder")
            prepare_staging(dest, folder)
            manifest = stage(folder, args.repo_id, dest, config)
            listing.write_text(json.dumps({"repo_id": args.repo_id, "files": manifest}, indent=2) + "\n")
            total = sum(m["bytes"] for m in manifest)
            for m in manifest:
                print(f"  {m['bytes']:>12,}  {m['path']}")
            print(f"[push] dry run: {len(manifest)} files, {total:,} bytes would be uploaded to {args.repo_id}; "
                  f"they are in {dest} (manifest {dest.name}.manifest.json)")
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "upload"
            manifest = stage(folder, args.repo_id, dest, config)
            url = upload(dest, args.repo_id, args.token, args.private, args.revision, args.commit_message)
        print(f"[push] uploaded {len(manifest)} files to https://huggingface.co/{args.repo_id} ({url})")
    except HubError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
