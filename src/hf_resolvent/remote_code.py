"""What a saved model folder holds besides the weights' tensors: the code that runs it, and a record of the model
its weights were trained for. The model class's ``save_pretrained`` and ``from_pretrained`` hooks call this module.

Remote code
-----------
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` imports the model from the folder's own
Python files, so that a saved model runs where hf_resolvent is not installed. transformers gathers those files when
it saves: ``modeling_resolvent.py`` and every module its lines ``from .x import ...`` name, followed recursively
(``transformers.dynamic_module_utils``); it copies them as flat files, so only flat siblings reach the folder. Hence:

- the model files (``configuration_resolvent``, ``modeling_resolvent``, ``inputs_resolvent``, ``cache_resolvent``,
  ``gpt2_conversion``, ``patterns``, this module) import only torch, transformers, safetensors and each other as
  flat siblings, and are copied as they are;
- they reach the mixer functions through one flat module, ``resolvent_ops``. In the library it imports them from
  :mod:`hf_resolvent.ops`'s modules with absolute imports, which transformers does not follow. In a saved folder,
  :func:`write_ops_bundle` writes it with those imports made flat, beside verbatim copies of the ops modules they
  reach (:func:`shipped_ops`);
- those ops modules import each other and ``patterns`` as flat siblings (``from .patterns import ...``). Inside the
  package, ``hf_resolvent/ops/patterns.py`` is an alias of :mod:`hf_resolvent.patterns` that makes that import
  true, so no shipped file is ever rewritten;
- ``IS_BUNDLE`` (False in the library's ``resolvent_ops``, True in a generated entry) tells this code where it runs:
  a model loaded from a saved folder saves its files again as they are, without copying any ops module;
- the backends (compiled CPU kernels, Triton) are not shipped. The ops modules reach them only through
  ``ops.dispatch``, whose ``_IN_LIBRARY`` (its module name is ``hf_resolvent.ops.dispatch`` only in the library)
  makes a saved folder's copy run PyTorch for ``"auto"`` and refuse ``"cpu"`` and ``"triton"`` by name.

``tests/models/test_save_load.py`` loads a saved folder in a process where hf_resolvent cannot be imported.

Weights records
---------------
Parameters of the same shapes load into any pattern without complaint, ``config.json`` can be edited, and
``from_pretrained(..., mixer=...)`` overrides it; missing layers or a missing position table start from random
weights. So ``save_pretrained`` writes the mixer of each layer and the kind of positions into the header metadata of
every safetensors file (:func:`architecture_record`), and ``from_pretrained`` checks every file before reading a
weight (:func:`check_weight_files`): a damaged file is an OSError naming it, and a model that differs from the
recorded one is a warning naming each difference.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .configuration_resolvent import ResolventConfig
from .resolvent_ops import IS_BUNDLE

__all__ = [
    "AUTO_MAP",
    "MIXERS_METADATA_KEY",
    "POSITIONS_METADATA_KEY",
    "add_architecture_record",
    "architecture_record",
    "check_saved_weights",
    "check_weight_files",
    "check_weight_index",
    "read_weight_index",
    "shipped_ops",
    "unsafe_pickle_problem",
    "write_ops_bundle",
]

# config.json's auto_map: the classes trust_remote_code imports, by file and name
AUTO_MAP = {
    "AutoConfig": "configuration_resolvent.ResolventConfig",
    "AutoModel": "modeling_resolvent.ResolventModel",
    "AutoModelForCausalLM": "modeling_resolvent.ResolventForCausalLM",
}

# --------------------------------------------------------------------------------------------------
# Remote code

# A saved folder's resolvent_ops.py: the library's, with this docstring and its imports made flat.
_BUNDLE_DOC = '''"""The mixer functions the model code calls (PyTorch paths), written by save_pretrained.

Generated file: it lets `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` run where
hf_resolvent is not installed. Install hf-resolvent and load without remote code for the compiled kernels.
"""'''
# transformers' rule for the relative imports it copies along (dynamic_module_utils), indented ones included
_FLAT_IMPORT = re.compile(r"^\s*from\s+\.(\w+)\s+import", flags=re.MULTILINE)


def shipped_ops(entry: str) -> list[str]:
    """The ops modules a saved folder needs: those the ``entry``'s flat imports name, and theirs, recursively
    (``patterns`` ships with the model files)."""
    ops = Path(importlib.import_module("hf_resolvent.ops").__file__).parent
    todo, reached = _FLAT_IMPORT.findall(entry), set()
    while todo:
        module = todo.pop()
        if module not in reached and module != "patterns":
            reached.add(module)
            todo += _FLAT_IMPORT.findall((ops / f"{module}.py").read_text(encoding="utf-8"))
    return sorted(reached)


def write_ops_bundle(folder: str | Path) -> list[Path]:
    """Write a saved folder's ``resolvent_ops.py`` (the library's, its imports of ``hf_resolvent.ops.<module>`` made
    flat) and copy the ops modules it reaches into the folder as they are; returns the files written. Nothing to do
    when this code already runs from a saved folder: transformers copied the files along."""
    if IS_BUNDLE:
        return []
    folder = Path(folder)
    library = Path(importlib.import_module("hf_resolvent.resolvent_ops").__file__).read_text(encoding="utf-8")
    body = library[library.index('"""', 3) + 3:]  # after the library's docstring
    body = re.sub(r"^from hf_resolvent\.ops\.(\w+) import", r"from .\1 import", body, flags=re.MULTILINE)
    body = re.sub(r"^IS_BUNDLE = False.*$", "IS_BUNDLE = True", body, flags=re.MULTILINE)
    entry = folder / "resolvent_ops.py"
    entry.write_text(_BUNDLE_DOC + body, encoding="utf-8")
    ops = Path(importlib.import_module("hf_resolvent.ops").__file__).parent
    return [*(Path(shutil.copyfile(ops / f"{m}.py", folder / f"{m}.py")) for m in shipped_ops(body)), entry]


# --------------------------------------------------------------------------------------------------
# Weights records

# Keys in the safetensors header metadata (``__metadata__``, str -> str) of every weights file save_pretrained
# writes: a JSON list with one mixer spec per layer (so also the number of layers), the kind of positions and, for
# RoPE, the channels it rotates.
MIXERS_METADATA_KEY = "hf_resolvent.mixers"
POSITIONS_METADATA_KEY = "hf_resolvent.position_embedding"
ROPE_CHANNELS_METADATA_KEY = "hf_resolvent.rope_channels"


def architecture_record(config: ResolventConfig) -> dict[str, str]:
    """The metadata entries save_pretrained adds to every weights file."""
    record = {MIXERS_METADATA_KEY: json.dumps(_mixer_specs(config)), POSITIONS_METADATA_KEY: config.position_embedding}
    if config.position_embedding == "rope":
        record[ROPE_CHANNELS_METADATA_KEY] = config.rope_channels
    return record


def add_architecture_record(config: ResolventConfig, folder: str | Path, variant: str | None) -> None:
    """Write :func:`architecture_record` into every safetensors file save_pretrained wrote into ``folder``."""
    record = architecture_record(config)
    for path in _saved_weight_files(Path(folder), variant):
        _add_safetensors_metadata(path, record)


def check_weight_index(name_or_path: str | os.PathLike, subfolder: str | None, variant: str | None) -> None:
    """Before from_pretrained reads a local folder: its safetensors index must be sound where it is the file read
    (transformers reads it without a check, and a damaged one fails deep inside it); an OSError naming it if not.
    A name on the Hub is no folder here: nothing to check."""
    folder = Path(str(name_or_path), subfolder or "")
    index = folder / _variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    if index.is_file() and not (folder / _variant_name(SAFE_WEIGHTS_NAME, variant)).is_file():
        read_weight_index(index)


def read_weight_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a safetensors index, or an OSError naming the file."""
    problem = None
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        problem = f"is not valid JSON ({err})"
    else:
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(content, dict):
            problem = f"holds a {type(content).__name__}, not a JSON object"
        elif not isinstance(weight_map, dict) or not weight_map:
            problem = "has no weight_map (tensor name -> shard file), or an empty one"
        elif not all(isinstance(name, str) for name in weight_map.values()):
            problem = "has a weight_map whose values are not all shard file names"
    if problem:
        raise OSError(f"the weights index {index} {problem}: the model folder is damaged (an interrupted save, copy "
                      "or download, or a hand edit); save or download the model again")
    return weight_map


def check_weight_files(config: ResolventConfig, files: list[str] | None) -> None:
    """Before from_pretrained reads any weight: every safetensors file must open and hold finite floating weights
    (else an OSError naming the file, and the tensor), and the model recorded at save time (the mixer of each layer,
    the positions) must be the one ``config`` builds (else a warning naming the differences)."""
    saved = _read_checked(files or [])
    if saved is not None:  # else saved without these records (by other code): nothing to compare
        differences = _architecture_differences(config, saved[1])
        if differences:
            warnings.warn(
                f"the weights in {saved[0]} do not match the model the config loading them builds: "
                f"{'; '.join(differences)}. The outputs will not be those of the trained model: load with the saved "
                "config.json (restore it, or drop the overrides given to from_pretrained), or fine-tune if the change "
                "is intended",
                UserWarning,
                stacklevel=2,
            )


def check_saved_weights(folder: str | os.PathLike, variant: str | None = None) -> None:
    """The checks of :func:`check_weight_files` on a saved folder's safetensors files (the single file and the shards
    its index lists), for tools that read a folder without loading it (push_to_hub): an OSError naming the file."""
    _read_checked([str(path) for path in _saved_weight_files(Path(folder), variant)])


def unsafe_pickle_problem(file: str | os.PathLike, err: BaseException) -> str:
    """What to tell a user whose pickled weights file (``pytorch_model.bin``) ``torch.load(weights_only=True)``
    refused with ``err``: the file names code to run, so it is not loaded, and how to convert a trusted one. (torch's
    own message suggests ``weights_only=False``, which would run that code.)"""
    named = re.search(r"GLOBAL (\S+)", str(err))
    what = f"it names {named.group(1)}, " if named else ""
    target = Path(file).with_name("model.safetensors")
    return (f"{file} is a pickle that holds more than tensors ({what}which loading would run): it is not safe to "
            f"load, and was not. If you trust where it came from, convert it to safetensors once and remove it: "
            f"python -c \"import torch; from safetensors.torch import save_file; "
            f"weights = torch.load('{file}', weights_only=False); "
            f"save_file({{k: v.clone() for k, v in weights.items() if isinstance(v, torch.Tensor)}}, '{target}', "
            f"metadata={{'format': 'pt'}})\" && rm '{file}'; otherwise delete it and get the model as safetensors")


def _read_checked(files: list) -> tuple[str, dict] | None:
    """Every safetensors file of ``files`` opened and its floating tensors found finite (else an OSError naming the
    file, and the tensor); returns the first file holding the architecture record, with its metadata."""
    saved = None
    for file in files:
        if not str(file).endswith(".safetensors"):
            continue
        if not os.path.isfile(file):  # a shard listed in the index but not there
            raise FileNotFoundError(
                f"the weights file {file} is missing: the model folder is incomplete; copy or download it again"
            )
        try:
            with safe_open(file, framework="pt") as f:
                metadata = f.metadata() or {}
                bad = next((name for name in f.keys() if _not_finite(f.get_tensor(name))), None)
        except (SafetensorError, OSError) as err:
            raise OSError(
                f"cannot read the weights file {file}: {err}. The file is truncated or damaged (an interrupted save, "
                "copy or download): save or download the model again"
            ) from None
        if bad is not None:
            raise OSError(
                f"the weights file {file} holds NaN or infinite values in {bad}: the file is damaged (overwritten "
                "bytes), or the model diverged before it was saved; save or download the model again, or load an "
                "earlier checkpoint"
            )
        if saved is None and MIXERS_METADATA_KEY in metadata:
            saved = (file, metadata)
    return saved


def _mixer_specs(config: ResolventConfig) -> list[str]:
    """One spec string per layer, as a mixer field writes it: ``"exp2:ce"``, ``"dense+tied"``. The gate_init is left
    out: it only sets the starting values, which the weights replace."""
    return [spec["pattern"] + ("+tied" if spec["tied"] else "") for spec in config.layer_mixers]


def _variant_name(name: str, variant: str | None) -> str:
    """``model.safetensors`` -> ``model.<variant>.safetensors``, as save_pretrained names variants."""
    if not variant:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _saved_weight_files(folder: Path, variant: str | None) -> list[Path]:
    """The safetensors files of a saved folder: the single file and/or the shards its index lists."""
    files = []
    single = folder / _variant_name(SAFE_WEIGHTS_NAME, variant)
    if single.is_file():
        files.append(single)
    index = folder / _variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    if index.is_file():
        files += [folder / name for name in sorted(set(read_weight_index(index).values()))]
    return files


def _add_safetensors_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Add entries to the header metadata of a safetensors file (save_pretrained takes no metadata but a
    quantizer's): the tensors are written again, with the old metadata and the new entries."""
    from safetensors.torch import load_file, save_file

    with safe_open(path, framework="pt") as f:
        old = f.metadata() or {}
    tmp = path.with_name(path.name + ".tmp")
    save_file(load_file(path), tmp, metadata={**old, **metadata})
    os.replace(tmp, path)


def _not_finite(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


def _architecture_differences(config: ResolventConfig, metadata: dict[str, str]) -> list[str]:
    """What the records of a weights file (:func:`architecture_record`) say differs from ``config``, in words."""
    try:
        trained = json.loads(metadata[MIXERS_METADATA_KEY])
    except ValueError:
        trained = [metadata[MIXERS_METADATA_KEY]]
    loading = _mixer_specs(config)
    differences = []
    if len(trained) != len(loading):
        saved_layers, layers = len(trained), len(loading)
        what = (f"layers {saved_layers} to {layers - 1} start from random weights" if layers > saved_layers else
                f"the trained layers {layers} to {saved_layers - 1} are left out")
        differences.append(f"they were saved for n_layer = {saved_layers}, but the config says n_layer = {layers} "
                           f"({what})")
    common = min(len(trained), len(loading))
    if trained[:common] != loading[:common]:
        differences.append(f"they were trained with mixer={_shown_specs(trained[:common])}, but the config says "
                           f"mixer={_shown_specs(loading[:common])}")
    positions = metadata.get(POSITIONS_METADATA_KEY)
    if positions is not None and positions != config.position_embedding:
        effect = (" (its learned position table starts from random weights)" if config.position_embedding == "learned"
                  else " (the trained position table goes unused)")
        differences.append(f"they were trained with position_embedding={positions!r}, but the config says "
                           f"position_embedding={config.position_embedding!r}{effect}")
    channels = metadata.get(ROPE_CHANNELS_METADATA_KEY)
    if channels is not None and config.position_embedding == "rope" and channels != config.rope_channels:
        differences.append(f"they were trained with rope_channels={channels!r}, but the config says "
                           f"rope_channels={config.rope_channels!r}")
    return differences


def _shown_specs(specs: Any) -> str:
    """A mixer record as a mixer field would say it: one spec when every layer has it, else the list."""
    return repr(specs[0]) if isinstance(specs, list) and specs and len(set(map(str, specs))) == 1 else repr(specs)
