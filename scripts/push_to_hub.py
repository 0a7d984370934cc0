#!/usr/bin/env python
"""Upload a trained model folder (scripts/pretrain.py output) to the Hugging Face Hub, with its code and card.

    python scripts/push_to_hub.py runs/44m-dense --repo-id me/resolvent-44m-dense --dry-run   # writes the files
    python scripts/push_to_hub.py runs/44m-dense --repo-id me/resolvent-44m-dense             # uploads them

What is published is what a model repository needs, named from the folder's own records, and nothing else:
the weights (``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names; a pickled
``pytorch_model.bin`` only when the folder has no safetensors weights), ``config.json``, ``generation_config.json``,
the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.json``,
``merges.txt``, ``added_tokens.json``, ``tokenizer.model``, ``chat_template.jinja``, ...), the model code that
``trust_remote_code=True`` loads (the ``auto_map`` modules and every module they import, recursively; re-saved with
the installed hf_resolvent if the folder lacks it), the card ``README.md`` (with the repository id filled in;
rendered from hf_resolvent/training/model_card.md when the folder has none) and the files its Markdown links and
images name, and the run records ``train_results.json``, ``eval_results.json``, ``all_results.json`` and
``run_config.json``. Everything else is left out, and each file or folder left out is printed with why (training
state, training log, hidden, not part of a model repository, ...); ``--include PATTERN`` (repeatable; a glob or a
folder, relative to the model folder) publishes more. Never published, even when named: a link whose target is
outside the folder (a link inside it is published as its target's content) and a file whose name looks like a
secret (a token, key or credentials).

No local path is published: in the card and the run records, an absolute path inside the run folder becomes
relative to it, the run folder and any other absolute path become their last name (``--data /home/me/data/owt``
-> ``--data owt``), and one whose name is the home directory or holds the user's name becomes ``LOCAL_PATH``.
Files named with ``--include`` are published as they are.

Before anything is copied, the folder is checked (``config.json`` parses, every published weight file opens and
holds finite values; a pickled ``pytorch_model.bin`` that holds more than tensors is refused without being run) and,
for an upload, the token (``hf auth login``, ``HF_TOKEN`` or ``--token``) and that the Hub is reachable.
``--dry-run [DIR]`` writes exactly what would be uploaded to DIR (default ``FOLDER.hub-upload``) with a manifest
beside it (size and SHA-256 of each file, and what was left out and why); without it the files are uploaded in one
commit with ``huggingface_hub``, read where they are. DIR is only ever replaced when this tool made it (it holds
the file ``.push_to_hub-staging``): an existing folder with other files in it, the model folder itself, a folder
inside it or above it is refused.
"""

from __future__ import annotations

import argparse
import fnmatch
import getpass
import json
import os
import pickle
import posixpath
import re
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote

from hf_resolvent.files import file_sha256
from hf_resolvent.training import data as hdata
from hf_resolvent.training.card import render_model_card
from hf_resolvent.training.models import mixer_slug

STAGING_MARK = ".push_to_hub-staging"  # in every --dry-run folder this tool made, so that it replaces only those

# What a model repository holds, by name at the top of the folder; the weights, the model code and the files the
# card links to are found from the folder's own records (the weights index, auto_map, the card's links).
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "vocab.txt",
                   "merges.txt", "added_tokens.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "chat_template.jinja", "chat_template.json")
CHAT_TEMPLATES = "additional_chat_templates"  # tokenizer.save_pretrained's folder of named templates (*.jinja)
RECORD_FILES = ("train_results.json", "eval_results.json", "all_results.json", "run_config.json")  # paths rewritten
WEIGHTS, WEIGHTS_INDEX, LEGACY_WEIGHTS = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
CARD = "README.md"

# Never published, not even when --include names them: the bytes would leave the folder, or look like credentials.
OUTSIDE = "a link to outside the folder: never published"
SECRET = "looks like a secret (a token, key or credentials): never published; rename it if it is not one"
SECRET_NAME = re.compile(
    r"(^|[._-])(credentials?|secrets?|passwords?|passwd|api[_-]?keys?|private[_-]?keys?)([._-]|$)"
    r"|^((hf|huggingface|access|auth|api|github|gh|wandb|bearer|refresh)[_-])?token(\.(txt|json))?$"
    r"|^id_(rsa|dsa|ecdsa|ed25519)|\.(pem|key|p12|pfx|jks|keystore)$|^\.?(netrc|npmrc|pypirc|git-credentials)$"
    r"|^\.env(\..*)?$")
NEVER = (OUTSIDE, SECRET, "a link to a missing file", "not a regular file")

# Why the rest of a run folder is left out, by the name of the file or of a folder above it (first match wins)
LEFT_OUT = (
    (re.compile(r"^\."), "hidden"),
    (re.compile(r"^(checkpoints?|checkpoint-\d+|global_step\d+)$|^(optimizer|scheduler|scaler)\.(pt|bin|pth)$"
                r"|^rng_state.*\.pth$|^random_states_.*\.pkl$|^training_args\.bin$|^trainer_state\.json$"),
     "training state"),
    (re.compile(r"^(logs|wandb|runs|mlruns|lightning_logs|tensorboard)$|^metrics\.jsonl$|^events\.out\.tfevents"),
     "training log"),
    (re.compile(r"^eval$"), "evaluation output"),
    (re.compile(r"^__pycache__$|\.(tmp|lock|partial|swp)$"), "temporary"),
    (re.compile(r"^pytorch_model.*\.bin(\.index\.json)?$"), f"pickled weights; {WEIGHTS} holds the model"),
    (re.compile(r"^model-\d+-of-\d+\.safetensors$"), f"a weights shard that {WEIGHTS_INDEX} does not name"),
    (re.compile(r"\.py$"), "code that the auto_map modules do not import"),
    (re.compile(r"\.(png|jpe?g|gif|svg|webp)$"), "a figure the card does not link"),
)


class HubError(RuntimeError):
    """An upload problem the user can fix (the message says how)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a save_pretrained folder (the --output-dir of scripts/pretrain.py)")
    p.add_argument("--repo-id", required=True, help="namespace/name on the Hub")
    p.add_argument("--dry-run", nargs="?", const="", default=None, metavar="DIR",
                   help="write what would be uploaded to DIR (default FOLDER.hub-upload) and stop")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="also publish the files PATTERN names (relative to the folder, a glob or a folder; "
                        "repeatable); never a link to outside the folder nor a file that looks like a secret")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the stored login)")
    p.add_argument("--revision", default=None, help="branch to upload to")
    p.add_argument("--commit-message", default="Upload resolvent model (hf-resolvent)")
    return p


def _check_folder(folder: Path) -> dict:
    """The folder's config, once the folder is a model folder (config, weights and tokenizer) whose config parses;
    the weights are checked by _check_weights once the upload is planned."""
    if not (folder / "config.json").exists():
        raise HubError(f"{folder} is not a model folder (no config.json); pass the --output-dir of a finished "
                       f"scripts/pretrain.py run")
    if not any((folder / f).exists() for f in ("model.safetensors", "model.safetensors.index.json",
                                                 "pytorch_model.bin")):
        raise HubError(f"{folder} has no model weights (model.safetensors); did the training run finish?")
    if not (folder / "tokenizer_config.json").exists():
        raise HubError(f"{folder} has no tokenizer (tokenizer_config.json); save one with tokenizer.save_pretrained")
    if not Path(os.path.realpath(folder / "config.json")).is_relative_to(folder.resolve()):
        raise HubError(f"{folder / 'config.json'} is a link to outside the folder, which is never read nor published; "
                       f"copy the file itself into the folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HubError(f"{folder / 'config.json'} is not valid JSON ({err}); the folder is damaged: save the model "
                       f"again (model.save_pretrained) or use a checkpoint of the run") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise HubError(f"{folder / 'config.json'} is not a model config (no model_type); save the model again with "
                       f"model.save_pretrained")
    return config


def _check_weights(folder: Path) -> None:
    """Every weight file of ``folder`` opens and holds finite values: the safetensors files (the shards of an index
    too) as from_pretrained checks them, a legacy pytorch_model.bin (when it is the only weights) tensor by tensor.
    Call it once the upload is planned: the plan refuses weights that are links to outside the folder."""
    import torch

    from hf_resolvent.remote_code import check_saved_weights, unsafe_pickle_problem

    try:
        check_saved_weights(folder)
    except OSError as err:  # it names the file and the fix
        raise HubError(str(err)) from None
    legacy = folder / LEGACY_WEIGHTS
    if legacy.is_file() and not (folder / WEIGHTS).is_file() and not (folder / WEIGHTS_INDEX).is_file():
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


# An absolute path in text (also ~/...): not inside a word, a URL (//host/x) or a tag (</a>); it ends at a space,
# quote, bracket or glob character
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/\\:<-])~?/[^\s\"'`<>|;,()\[\]{}*?]+")
LOCAL_PATH = "LOCAL_PATH"  # stands for a local path whose name would say whose machine it is


class LocalPaths:
    """Takes the local paths out of what is published: an absolute path inside the run folder becomes relative to
    it, the run folder and any other absolute path become their last name (``--data /home/me/data/owt`` ->
    ``--data owt``), and a path whose name is the home directory or holds the user's name becomes LOCAL_PATH."""

    def __init__(self, folder: Path):
        self.runs = sorted({os.path.normpath(folder.absolute()), str(folder.resolve())}, key=len, reverse=True)
        home = os.path.expanduser("~")
        self.homes = sorted({os.path.normpath(home), os.path.realpath(home)} - {"/", "~"}, key=len, reverse=True)
        users = {os.path.basename(h) for h in self.homes}
        try:
            users.add(getpass.getuser())
        except (KeyError, OSError):  # no user name in the environment nor the password database
            pass
        self.user = re.compile("|".join(rf"(?<![a-z0-9]){re.escape(u)}(?![a-z0-9])" for u in sorted(users) if u)
                               or r"(?!)", re.I)

    def path(self, path: str) -> str:
        end = re.search(r"[.:!]*$", path).start()  # sentence punctuation after a path is not part of it
        path, trail = path[:end], path[end:]
        norm = os.path.normpath(os.path.expanduser(path))
        slash = "/" if path.endswith("/") and norm != "/" else ""
        for run in self.runs:
            if norm.startswith(run + "/"):
                return norm[len(run) + 1:] + slash + trail
        name = os.path.basename(norm)
        if not name or norm in self.homes or self.user.search(name):
            name = LOCAL_PATH
        return name + slash + trail

    def text(self, text: str) -> str:
        text = _ABSOLUTE_PATH.sub(lambda m: self.path(m.group()), text)
        for home in self.homes:  # what the pattern cannot see as a path (file:///home/me/x) still hides the home
            text = text.replace(home, "~")
        return text

    def json(self, value):
        """``value`` (parsed JSON) with the local paths in its strings taken out."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.json(v) for v in value]
        if isinstance(value, dict):
            return {k: self.json(v) for k, v in value.items()}
        return value


class Plan:
    """What an upload holds: ``files`` (path in the repository -> the file whose bytes it gets: a link inside the
    folder is read through), ``texts`` (path -> text written instead of a file: the card), what is ``left_out``
    (path -> why) and ``notes`` for the user; ``resave``: the folder lacks its model code, which a re-save with the
    installed hf_resolvent attaches."""

    def __init__(self, left_out: dict[str, str]):
        self.files: dict[str, Path] = {}
        self.texts: dict[str, str] = {}
        self.left_out = left_out
        self.notes: list[str] = []
        self.resave = False


def _scan(folder: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The files of ``folder`` that can be read without leaving it (relative path -> the file to read; a link whose
    target is inside the folder reads the target) and those that cannot (relative path -> why). Links are never
    followed out: a link to a folder is not entered, and a file link is resolved and checked first."""
    root = folder.resolve()
    readable, refused = {}, {}
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames.sort()
        for name in [d for d in dirnames if (here / d).is_symlink()]:  # os.walk lists them, and does not enter them
            inside = Path(os.path.realpath(here / name)).is_relative_to(root)
            refused[(here / name).relative_to(folder).as_posix() + "/"] = (
                "a link to a folder inside the folder (its files are published from where they are)" if inside
                else OUTSIDE)
        for name in sorted(filenames):
            path = here / name
            rel = path.relative_to(folder).as_posix()
            source = Path(os.path.realpath(path)) if path.is_symlink() else root / rel  # absolute, inside root
            if not source.is_relative_to(root):
                refused[rel] = OUTSIDE
            elif not source.exists():
                refused[rel] = "a link to a missing file"
            elif not source.is_file():
                refused[rel] = "not a regular file"
            else:
                readable[rel] = source
    return readable, refused


def _looks_secret(rel: str) -> bool:
    return any(SECRET_NAME.search(part.lower()) for part in rel.split("/"))


def _why_left_out(rel: str) -> str:
    for pattern, why in LEFT_OUT:
        if any(pattern.search(part) for part in rel.split("/")):
            return why
    return "not part of a model repository"


def _weight_files(readable: dict[str, Path], present: set[str]) -> list[str]:
    """The weight files of a folder holding the files ``present`` (``readable``: those it can read): model.safetensors
    and/or its index with the shards it names; a legacy pytorch_model.bin only when there are no safetensors weights
    (it is then the model)."""
    from hf_resolvent.remote_code import read_weight_index

    if WEIGHTS not in present and WEIGHTS_INDEX not in present:
        return [LEGACY_WEIGHTS] if LEGACY_WEIGHTS in present else []
    names = [n for n in (WEIGHTS, WEIGHTS_INDEX) if n in present]
    if WEIGHTS_INDEX in readable:
        try:
            names += sorted(set(read_weight_index(readable[WEIGHTS_INDEX]).values()))
        except OSError as err:  # it names the file and the fix
            raise HubError(str(err)) from None
    return names


def _code_modules(*configs: dict) -> list[str]:
    """File names of the modules the ``auto_map`` of ``configs`` points at (``modeling_resolvent.py``, ...)."""
    names = set()
    for config in configs:
        for ref in (config.get("auto_map") or {}).values():
            refs = ref if isinstance(ref, list) else [ref]
            for r in refs:
                if isinstance(r, str) and r and "--" not in r:  # "repo--module.Class" refers to another repository
                    names.add(r.rsplit(".", 1)[0] + ".py")
    return sorted(names)


def _code_files(readable: dict[str, Path], config: dict) -> tuple[list[str], list[str]]:
    """The model code of a folder, as transformers loads it with trust_remote_code=True: the auto_map modules (of
    config.json and tokenizer_config.json) and every module their ``from .x import`` lines name, recursively; returns
    the files the folder has and those it lacks."""
    from transformers.dynamic_module_utils import get_relative_imports

    tokenizer_config = {}
    if "tokenizer_config.json" in readable:
        try:
            tokenizer_config = json.loads(readable["tokenizer_config.json"].read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass  # the tokenizer's own loading says what is wrong with it; it names no code here
    todo, have, lack = _code_modules(config, tokenizer_config if isinstance(tokenizer_config, dict) else {}), [], []
    while todo:
        module = todo.pop()
        if module in have or module in lack:
            continue
        if module not in readable:
            lack.append(module)
            continue
        have.append(module)
        todo += [f"{name}.py" for name in get_relative_imports(readable[module])]
    return sorted(have), sorted(lack)


# [text](target), ![alt](target) (also nested: [![alt](img)](link)), [label]: target and <img src="target">
_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK_TARGETS = (re.compile(r"\]\(\s*<?([^)\s>]+)"), re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)", re.M),
                 re.compile(r"<(?:img|a|source|video)\b[^>]*?\s(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.I))


def card_links(card: str) -> list[str]:
    """The targets of the links and images of a Markdown card that name files beside it (no URL, no #anchor, not in
    code), as written."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", card))
    found = []
    for pattern in _LINK_TARGETS:
        for target in pattern.findall(prose):
            path = target.split("#", 1)[0].split("?", 1)[0]
            if path and not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", path) and target not in found:
                found.append(target)
    return found


def plan_upload(folder: Path, config: dict, repo_id: str, include=()) -> Plan:
    """What an upload of ``folder`` publishes and what it leaves out, and why; reads only small files (the weights
    index, the model code's imports, the card)."""
    readable, refused = _scan(folder)
    root = folder.resolve()
    plan = Plan(left_out=dict(refused))
    for rel, source in list(readable.items()):
        if _looks_secret(rel) or _looks_secret(source.relative_to(root).as_posix()):
            plan.left_out[rel] = SECRET
            del readable[rel]
    weights = _weight_files(readable, set(readable) | set(plan.left_out))
    for rel in ["config.json", "tokenizer_config.json", *weights]:
        if posixpath.isabs(rel) or posixpath.normpath(rel).startswith("../"):
            raise HubError(f"{folder / WEIGHTS_INDEX} names a shard outside the folder ({rel}); it is damaged or "
                           f"not this model's: save the model again (model.save_pretrained)")
        if rel in plan.left_out:  # a link out of the folder, most likely: the upload would not load without it
            raise HubError(f"{folder / rel} is {plan.left_out[rel].split(':')[0]}, which is never published, and the "
                           f"model needs it: copy the file itself into the folder (cp --remove-destination TARGET "
                           f"{folder / rel})")
    names = [*MODEL_FILES, *TOKENIZER_FILES, *weights]
    names += [rel for rel in readable if rel.startswith(CHAT_TEMPLATES + "/") and rel.endswith(".jinja")]
    code, lack = _code_files(readable, config)
    is_resolvent = config.get("model_type") == "resolvent"
    if is_resolvent and (lack or not config.get("auto_map")):
        plan.resave = True  # a folder saved before the code was attached: stage() re-saves config, weights and code
    elif lack:
        raise HubError(f"the auto_map of {folder / 'config.json'} names model code the folder does not hold "
                       f"({', '.join(lack)}): the upload would not load with trust_remote_code=True; save the model "
                       f"again with its code (model.save_pretrained)")
    for rel in names + code:
        if rel in readable:
            plan.files[rel] = readable[rel]
    if weights == [LEGACY_WEIGHTS]:
        plan.notes.append(f"{LEGACY_WEIGHTS} is published as it is (pickled weights, checked to hold only tensors); "
                          f"safetensors loads faster and safely: model.save_pretrained(folder) writes {WEIGHTS}")

    paths = LocalPaths(folder)
    for rel in RECORD_FILES:  # the run's results and configuration, as the Trainer publishes its *_results.json
        if rel in readable:
            plan.texts[rel] = _record(folder / rel, readable[rel], paths)
    configs = [*([] if plan.resave else MODEL_FILES), "tokenizer_config.json"]  # a re-save writes the model's anew
    for rel in configs:
        if rel in plan.files and (text := _named_path_taken_out(readable[rel], paths)) is not None:
            plan.texts[rel] = text
    plan.texts[CARD] = paths.text(_card(folder, readable, config, repo_id))
    for target in card_links(plan.texts[CARD]):
        rel = posixpath.normpath(unquote(target.split("#", 1)[0].split("?", 1)[0]))
        if rel.startswith("/") or rel == ".." or rel.startswith("../"):
            plan.notes.append(f"the card links {target}, outside the folder: not published (a broken link on the Hub)")
        elif rel in readable:
            plan.files[rel] = readable[rel]
        elif rel not in plan.left_out and not (folder / rel).is_dir():
            plan.notes.append(f"the card links {target}, which the folder does not have (a broken link on the Hub)")

    for pattern in include:
        wanted = posixpath.normpath(pattern)
        if wanted.startswith("/") or wanted == ".." or wanted.startswith("../"):
            raise HubError(f"--include {pattern} is not inside the folder; name files relative to it (e.g. 'eval/*')")
        hits = [rel for rel in [*readable, *plan.left_out] if _included(rel, wanted)]
        if not hits:
            raise HubError(f"--include {pattern} names no file in {folder}; patterns are relative to the folder, "
                           f"e.g. --include metrics.jsonl or --include 'eval/*.json'")
        for rel in hits:
            if rel in readable:
                plan.files[rel] = readable[rel]
    for rel in plan.texts:
        plan.files.pop(rel, None)
    for rel in readable:
        if rel not in plan.files and rel not in plan.texts:
            plan.left_out[rel] = _why_left_out(rel)
    plan.left_out = dict(sorted(plan.left_out.items()))
    return plan


def _record(path: Path, source: Path, paths: LocalPaths) -> str:
    """A run record (JSON) as published: the local paths in its strings taken out."""
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise HubError(f"{path} is not UTF-8 text ({err}); a run record is JSON: fix or remove it") from None
    try:
        return json.dumps(paths.json(json.loads(text)), indent=2) + "\n"
    except json.JSONDecodeError:
        return paths.text(text)  # not JSON after all: its text, with the same paths taken out


def _named_path_taken_out(source: Path, paths: LocalPaths) -> str | None:
    """A config as published when it names the folder it was loaded from (``_name_or_path``, ``name_or_path``, as
    some transformers versions write): that path taken out, nothing else touched (its other strings are tokens and
    settings). None when it names none."""
    try:
        config = json.loads(source.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # the checks of the folder (config.json) and the tokenizer's loading say what is wrong
    if not isinstance(config, dict):
        return None
    named = {k: v for k, v in config.items() if k in ("_name_or_path", "name_or_path") and isinstance(v, str)
             and v.startswith(("/", "~"))}
    if not named:
        return None
    return json.dumps({**config, **{k: paths.path(v) for k, v in named.items()}}, indent=2) + "\n"


def _included(rel: str, pattern: str) -> bool:
    """Whether --include ``pattern`` names the file ``rel``: the file itself, or a folder above it."""
    parts = rel.rstrip("/").split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _card(folder: Path, readable: dict[str, Path], config: dict, repo_id: str) -> str:
    """The card as published: the folder's README.md with the repository id filled in, or one rendered from the
    template for a folder that has none."""
    if CARD in readable:
        try:
            text = readable[CARD].read_text(encoding="utf-8").replace("REPO_ID", repo_id)
        except UnicodeDecodeError as err:
            raise HubError(f"{folder / CARD} is not UTF-8 text ({err}); a model card is Markdown: fix or remove "
                           f"it (a card is rendered from the template for a folder without one)") from None
    else:
        mixer = "gpt2" if config.get("model_type") == "gpt2" else str(config.get("mixer"))
        text = render_model_card({"model_name": repo_id.split("/")[-1], "mixer": mixer, "repo_id": repo_id,
                                    "model_type": (config.get("architectures") or ["?"])[0],
                                    "tags": ["hf-resolvent", "resolvent", f"mixer-{mixer_slug(mixer)}"]})
        if "loss.png" not in readable:  # the template's figure of the run's loss: no run, no figure
            text = re.sub(r"(?m)^.*\]\(loss\.png\).*\n", "", text)
    if config.get("model_type") != "resolvent":
        text = text.replace(", trust_remote_code=True", "")
    return text


def left_out_lines(left_out: dict[str, str]) -> list[str]:
    """What was left out and why, for the user: one line per link out of the folder or secret, one per file at the
    top of the folder, and one per folder (with its count of files) for the rest."""
    groups: dict[tuple[str, str], list[str]] = {}
    for rel, why in left_out.items():
        name = rel if why in NEVER or "/" not in rel.rstrip("/") else rel.split("/", 1)[0] + "/"
        groups.setdefault((name, why), []).append(rel)
    lines = []
    for (name, why), rels in groups.items():
        count = f"{len(rels)} file{'s' if len(rels) > 1 else ''}: " if name.endswith("/") and name not in rels else ""
        lines.append(f"left out: {name} ({count}{why})")
    return lines


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
    (dest / STAGING_MARK).write_text("staged by scripts/push_to_hub.py (not uploaded); replaced by its next run\n")


def _resave(folder: Path, work: Path, log=print) -> dict[str, Path]:
    """Re-save a resolvent model folder saved without its code into ``work`` with the installed hf_resolvent; returns
    the config, weights and code of the re-save (path in the repository -> file)."""
    from transformers import AutoModelForCausalLM

    import hf_resolvent

    log(f"[push] {folder} lacks its model code; re-saving config, weights and code with hf_resolvent "
        f"{hf_resolvent.__version__}")
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(work)
    readable, _ = _scan(work)
    config = json.loads((work / "config.json").read_text())
    code, lack = _code_files(readable, config)
    if lack or not config.get("auto_map"):
        raise HubError(f"could not attach the model code to {folder} (missing {lack or 'auto_map'}); the installed "
                       f"hf_resolvent does not register its classes for remote code")
    weights = _weight_files(readable, set(readable))
    return {rel: readable[rel] for rel in [*MODEL_FILES, *weights, *code] if rel in readable}


def sources(plan: Plan, folder: Path, work: Path, log=print) -> dict[str, Path]:
    """The file each path of the upload copies (the card and other texts aside): the planned files, with config,
    weights and code of a re-save in ``work`` for a folder saved without its code."""
    files = dict(plan.files)
    if plan.resave:
        for rel in [*MODEL_FILES, *_weight_files(plan.files, set(plan.files))]:
            files.pop(rel, None)
        files.update(_resave(folder, work, log))
    return {rel: source for rel, source in files.items() if rel not in plan.texts}


def stage(plan: Plan, folder: Path, dest: Path, log=print) -> list[dict]:
    """Write the upload ``plan`` of ``folder`` into ``dest``, an empty folder (its staging mark aside); returns the
    manifest (path, bytes, sha256 per file; hashed in blocks, so a file of any size takes little memory)."""
    with tempfile.TemporaryDirectory() as work:
        for rel, source in sources(plan, folder, Path(work), log).items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, dest / rel)  # the bytes, never a link
    for rel, text in plan.texts.items():
        (dest / rel).write_text(text, encoding="utf-8")
    return [{"path": f.relative_to(dest).as_posix(), "bytes": f.stat().st_size, "sha256": file_sha256(f)}
            for f in sorted(p for p in dest.rglob("*") if p.is_file() and p.name != STAGING_MARK)]


def _is_manifest(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and {"repo_id", "files"} <= set(data) <= {"repo_id", "files", "left_out"}


def hub_token(token: str | None) -> str:
    """The token to upload with, once the Hub is reachable: checked before anything is staged, so that a missing
    login or network costs nothing."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login` (or set HF_TOKEN, or pass --token); "
                       "--dry-run shows what would be uploaded without one")
    if not hdata.hub_reachable():
        raise HubError("the Hugging Face Hub is not reachable (no network, or HF_HUB_OFFLINE=1); connect and "
                       "retry, or use --dry-run to write the upload locally")
    return token


def upload(plan: Plan, folder: Path, repo_id: str, token: str, private: bool, revision: str | None,
           message: str) -> tuple[int, str]:
    """Upload ``plan`` in one commit: the files are read where they are (huggingface_hub hashes and sends them in
    blocks, nothing is copied first), the card and run records go as the texts of the plan, and a re-save for a
    folder without its code goes to a temporary folder. Returns the number of files and the commit's address."""
    from huggingface_hub import CommitOperationAdd, HfApi

    with tempfile.TemporaryDirectory() as work:
        files = sources(plan, folder, Path(work))
        operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(source))
                      for rel, source in files.items()]
        operations += [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=text.encode("utf-8"))
                       for rel, text in plan.texts.items()]
        operations.sort(key=lambda op: op.path_in_repo)
        api = HfApi(token=token)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            info = api.create_commit(repo_id, operations, commit_message=message, repo_type="model",
                                     revision=revision)
        except Exception as err:  # noqa: BLE001 - huggingface_hub raises HTTP and OS errors
            raise HubError(f"upload to {repo_id} failed: {type(err).__name__}: {err}") from err
    return len(operations), str(getattr(info, "commit_url", info))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.folder)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo_id):
        print(f"error: --repo-id must look like namespace/name, got {args.repo_id!r}", file=sys.stderr)
        return 2
    try:
        config = _check_folder(folder)
        plan = plan_upload(folder, config, args.repo_id, args.include)
        _check_weights(folder)
        for line in [*left_out_lines(plan.left_out), *(f"note: {n}" for n in plan.notes)]:
            print(f"[push] {line}")
        if any(why not in NEVER for why in plan.left_out.values()):
            print("[push] --include PATTERN publishes a file left out (never a link to outside the folder, nor a "
                  "secret)")
        if args.dry_run is not None:
            dest = Path(args.dry_run) if args.dry_run else folder.with_name(folder.name + ".hub-upload")
            listing = dest.parent / (dest.name + ".manifest.json")
            if listing.exists() and not _is_manifest(listing):
                raise HubError(f"{listing} exists and is not a manifest this tool wrote; move it, or name another "
                               f"--dry-run folder")
            prepare_staging(dest, folder)
            manifest = stage(plan, folder, dest)
            left_out = [{"path": rel, "reason": why} for rel, why in plan.left_out.items()]
            listing.write_text(json.dumps({"repo_id": args.repo_id, "files": manifest, "left_out": left_out},
                                          indent=2) + "\n")
            total = sum(m["bytes"] for m in manifest)
            for m in manifest:
                print(f"  {m['bytes']:>12,}  {m['path']}")
            print(f"[push] dry run: {len(manifest)} files, {total:,} bytes would be uploaded to {args.repo_id}; "
                  f"they are in {dest} (manifest {dest.name}.manifest.json)")
            return 0
        token = hub_token(args.token)
        count, url = upload(plan, folder, args.repo_id, token, args.private, args.revision, args.commit_message)
        print(f"[push] uploaded {count} files to https://huggingface.co/{args.repo_id} ({url})")
    except HubError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    sys.exit(main())
