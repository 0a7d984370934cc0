"""Pretraining data: corpora, tokenizers, uint16 token shards and a step-indexed sampler.

Layout written by :func:`prepare_dataset` (the flat ``uint16`` layout popularised by nanoGPT, split in shards)::

    OUT/
      meta.json                 what was used (data, tokenizer, seed, split rule) and the token counts
      tokenizer/                the tokenizer the shards were written with (``AutoTokenizer.from_pretrained``)
      shards/train_00000.bin    uint16 token ids, documents separated by the end-of-text token
      shards/val_00000.bin      the validation documents of the same block of documents
      shards/00000.json         marks shard 0 finished: its documents, sizes and sha256 (a re-run keeps it)
      settings.json             what the shards depend on (inputs and their checksums, tokenizer, split)
      manifest.json             written last: settings, and size and sha256 of meta.json, tokenizer and shards

Only a folder with a consistent ``manifest.json`` counts as prepared (:func:`is_prepared`, :class:`TokenShards`):
an interrupted preparation, a damaged shard or a folder written by a version without manifests is refused with a
message saying which file is wrong. Readers compare file sizes at open (cheap); :func:`verify_prepared` with
``full=True`` and a re-run of :func:`prepare_dataset` also compare sha256 checksums.

Shard ``i`` holds documents ``i * docs_per_shard ... (i + 1) * docs_per_shard - 1`` of the source, so a re-run
(after a crash, or with more ``--max-docs``) resumes at the first unfinished shard; a re-run with other inputs or
settings rebuilds the folder (or stops, with ``overwrite=False``). A document goes to the validation split when a
seeded hash of its index is below ``val_fraction`` (0.05% for OpenWebText, like the papers and nanoGPT): the split
does not depend on shard size, process count or streaming.

A Hugging Face dataset is read with ``datasets.load_dataset``. OpenWebText's repository is a loading script, which
``datasets`` 4 and later refuse to run: its archive files are read here instead (the same documents, see
:func:`_load_hub_dataset`), from the Hub or from a local copy of the repository given as the source.

Long documents reach the tokenizer in pieces of at most ``max_encode_chars`` characters, cut before a word (the
same tokens for GPT-2-style tokenizers), so memory does not grow with the longest document.

The offline default corpus (:func:`stdlib_corpus`) is the English text that ships with every CPython: the
interactive help topics of ``pydoc_data`` (the language reference) and the docstrings of the standard library
modules. When the GPT-2 tokenizer cannot be loaded (no network, nothing cached) a byte-level BPE tokenizer is
trained on the corpus with ``tokenizers`` (:func:`train_bpe_tokenizer`).
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .files import atomic_write_bytes, atomic_write_json, file_problem, file_record, file_sha256

EOT = "<|endoftext|>"
STDLIB = "stdlib"
OPENWEBTEXT = "Skylion007/openwebtext"
DEFAULT_VAL_FRACTION = {STDLIB: 0.05}
OWT_VAL_FRACTION = 0.0005
TOKEN_DTYPE = np.uint16
# Longest text the tokenizer gets in one call (long documents are cut): bounds the memory tokenising takes.
DEFAULT_MAX_ENCODE_CHARS = 100_000

# Parts of the standard library left out of the offline corpus: tests, demos, bundled third-party code and
# modules whose docstrings are mostly tables or code.
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "encodings",
                "__pycache__", "__phello__", "pydoc_data"}


class DataError(RuntimeError):
    """A data-preparation problem the user can fix (the message says how)."""


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message (library messages can span screens)."""
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]


# ----------------------------------------------------------------------------------------------- corpora


def _docstrings_in_order(tree: ast.AST) -> list[str]:
    """Docstrings of a module, its classes and functions in source order (depth first)."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc.split()) >= 3:
                out.append(doc.strip())
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)

    visit(tree)
    return out


def stdlib_corpus(max_docs: int | None = None) -> list[dict[str, str]]:
    """The offline default corpus: English text shipped inside this Python's standard library.

    Documents, in a fixed order: first the ``pydoc_data.topics`` help topics (sorted by name; the text of the
    language reference that ``help("if")`` prints), then one document per standard-library module (sorted by
    relative path) made of the module's, classes' and functions' docstrings in source order. Tests, demos,
    ``site-packages`` and codec modules are skipped. The result depends only on the Python version.

    Returns a list of ``{"text": ..., "source": ...}`` dicts (about 700 documents, 2 MB of text on 3.11).
    """
    docs: list[dict[str, str]] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        topics = {}
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            docs.append({"text": text, "source": f"pydoc_data.topics:{name}"})
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if any(part in _STDLIB_SKIP for part in rel.parts) or rel.parts[0].startswith("config-"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        pieces = _docstrings_in_order(tree)
        if pieces:
            docs.append({"text": "\n\n".join(pieces), "source": rel.as_posix()})
        if max_docs is not None and len(docs) >= max_docs:
            break
    return docs[:max_docs] if max_docs is not None else docs


def corpus_fingerprint(texts: Iterable[str]) -> str:
    """sha256 of the documents joined by end-of-text (identifies a corpus in ``meta.json``)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(EOT.encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- tokenizers


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """True when a TCP connection to the Hub opens within ``timeout`` seconds (False offline, quickly).

    ``HF_HUB_OFFLINE=1`` makes this False without trying.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a GPT-2-style byte-level BPE tokenizer on ``texts``; returns a ``PreTrainedTokenizerFast``.

    Same design as GPT-2's tokenizer (byte-level pre-tokenisation with GPT-2's regex, no normalisation, every
    byte in the initial alphabet so any text is encodable), with ``<|endoftext|>`` as id 0 and as the
    bos/eos/unk token. Training is deterministic for a given corpus and ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 + 1 or vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"vocab_size must be in [258, 65536] (256 bytes + <|endoftext|>, uint16 shards), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, model_max_length=int(1e9)
    )


@dataclass
class TokenizerChoice:
    """The tokenizer a preparation used and why (``description`` is printed and stored in ``meta.json``)."""

    tokenizer: Any
    name: str
    description: str


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _looks_like_path(name: str) -> bool:
    """True when ``name`` is meant as a local file or folder rather than a Hub id.

    Hub ids are ``name`` or ``namespace/name`` (one slash, no ``..``), so a relative or absolute path prefix, a
    second separator, a Windows separator or a ``.json`` suffix can only mean a path.
    """
    return (name.startswith(("./", "../", ".\\", "..\\", "~")) or os.path.isabs(name) or name.endswith(".json")
            or (os.sep in name and os.sep != "/") or _HUB_ID.fullmatch(name) is None or ".." in name)


def check_tokenizer_path(name: str | None) -> None:
    """Raise :class:`DataError` when ``name`` is a local path (see :func:`_looks_like_path`) that does not exist.

    Such a name is a typo, not a network problem: falling back to a trained tokenizer would hide it.
    """
    if name and name != "bpe" and _looks_like_path(name) and not Path(name).expanduser().exists():
        raise DataError(f"tokenizer path {name!r} does not exist ({Path(name).expanduser().absolute()}); check the "
                        f"path (a tokenizer folder is what save_pretrained writes), or pass a Hub name such as gpt2, "
                        f"or 'bpe' to train one on the corpus")


def load_or_train_tokenizer(
    name: str | None,
    texts: Sequence[str] | None,
    vocab_size: int = 8192,
    allow_download: bool = True,
    log=print,
) -> TokenizerChoice:
    """GPT-2's tokenizer (or ``name``) when it can be loaded, else a byte-level BPE trained on ``texts``.

    Order: a local folder or the local Hugging Face cache (no network); then the Hub, only when
    :func:`hub_reachable` (a 3 s probe, so that an offline machine does not wait for the Hub client's retries);
    then, when ``texts`` is given, :func:`train_bpe_tokenizer`. ``name="bpe"`` trains without trying GPT-2.
    A local path that does not exist, or exists but holds no tokenizer, raises :class:`DataError` (no fallback).
    """
    from transformers import AutoTokenizer

    check_tokenizer_path(name)
    if name and name != "bpe":
        local = Path(name).expanduser()
        try:
            tok = AutoTokenizer.from_pretrained(local if local.exists() else name, local_files_only=True)
            return TokenizerChoice(tok, name, f"{name} (from {'local folder' if local.is_dir() else 'local cache'})")
        except (OSError, ValueError) as err:
            if local.exists():
                raise DataError(f"{name!r} exists but could not be loaded as a tokenizer ({type(err).__name__}: "
                                f"{_first_line(err)}); pass a folder written by save_pretrained (tokenizer.json, "
                                f"tokenizer_config.json)") from err
            first_error = err
        tried_hub = allow_download and hub_reachable()
        if tried_hub:
            try:
                tok = AutoTokenizer.from_pretrained(name)
                return TokenizerChoice(tok, name, f"{name} (downloaded from the Hugging Face Hub)")
            except (OSError, ValueError) as err:
                first_error = err
        where = ("not in the local cache, and the Hub could not provide it" if tried_hub
                 else "no network and not in the local cache")
        reason = f"could not load tokenizer {name!r} ({where}: {type(first_error).__name__})"
        if texts is None:
            raise DataError(f"{reason}; pass --tokenizer PATH to a saved tokenizer folder, or connect to the Hub.")
        log(f"[data] {reason}.")
        log(f"[data] Using instead a byte-level BPE tokenizer (vocab {vocab_size}) trained on the corpus with `tokenizers`.")
    elif texts is None:
        raise DataError("tokenizer 'bpe' needs a corpus to train on")
    t0 = time.time()
    tok = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    desc = f"byte-level BPE, vocab {len(tok)}, trained on this corpus with `tokenizers` in {time.time() - t0:.1f}s"
    if name and name != "bpe":
        desc += f" (fallback: {name} unavailable offline)"
    return TokenizerChoice(tok, f"bpe-{len(tok)}", desc)


# ------------------------------------------------------------------------------------------ split and shards


def split_hash(indices: np.ndarray, seed: int) -> np.ndarray:
    """Uniform numbers in [0, 1) from document indices and a seed (splitmix64; vectorised, platform independent)."""
    with np.errstate(over="ignore"):
        z = np.asarray(indices, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def is_validation(indices: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Boolean mask: which documents (by global index) belong to the validation split."""
    return split_hash(indices, seed) < fraction


# Where a long document may be cut for the tokenizer: just before the whitespace character that starts a word
# (" word", "\nword"). GPT-2's pre-tokenizer regex always starts a token there (a leading space belongs to the
# word, and a run of whitespace gives its last character to what follows), so a byte-level BPE gives the pieces
# exactly the tokens of the whole document. ``.*`` is greedy: the match ends at the last such start it can reach.
_LAST_WORD_START = re.compile(r"(?s:.*)\s(?=\S)")


def _text_pieces(text: str, max_chars: int) -> list[str]:
    """``text`` cut into pieces of at most ``max_chars`` characters, each cut at the last word start within the
    budget (see ``_LAST_WORD_START``); a stretch with no word start in it is cut where the budget ends."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        last = _LAST_WORD_START.match(text, start + 1, start + max_chars + 1)
        end = last.end() - 1 if last else start + max_chars
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _encode_groups(texts: Sequence[str], max_chars: int):
    """``(document index, piece)`` pairs in groups of at most ``max_chars`` characters: short documents share a
    group, a longer one is cut (:func:`_text_pieces`)."""
    group: list[tuple[int, str]] = []
    size = 0
    for i, text in enumerate(texts):
        for piece in _text_pieces(text, max_chars):
            if group and size + len(piece) > max_chars:
                yield group
                group, size = [], 0
            group.append((i, piece))
            size += len(piece)
    if group:
        yield group


def _tokenize_batch(batch: dict, tokenizer, eot_id: int, max_chars: int) -> dict:
    """Token ids (the shards' dtype) of a batch of documents, each followed by ``eot_id``.

    The tokenizer gets at most ``max_chars`` characters per call: its encodings keep strings and offsets for every
    token (hundreds of bytes each), so a call on a whole 28 MB document took gigabytes. Cut at word starts, the
    pieces' tokens are the document's own for GPT-2-style tokenizers.
    """
    parts: list[list[np.ndarray]] = [[] for _ in batch["text"]]
    for group in _encode_groups(batch["text"], max_chars):
        encodings = tokenizer.backend_tokenizer.encode_batch([piece for _, piece in group], add_special_tokens=False)
        for (i, _), enc in zip(group, encodings):
            parts[i].append(np.asarray(enc.ids, dtype=TOKEN_DTYPE))
    eot = np.array([eot_id], dtype=TOKEN_DTYPE)
    return {"ids": [np.concatenate([*p, eot]) for p in parts]}


def _write_shard(out: Path, shard: int, texts_ds, offset: int, tokenizer, eot_id: int, seed: int,
                 val_fraction: float, forced_val: int, num_proc: int, log, end_of_data: bool | None = None,
                 max_chars: int = DEFAULT_MAX_ENCODE_CHARS) -> dict:
    """Tokenise one block of documents (a ``datasets.Dataset`` with a ``text`` column) and write its shard.

    ``max_chars`` bounds the text the tokenizer gets at once (:func:`_tokenize_batch`).

    The marker written last records the block, and the size and sha256 of both files, so that a re-run keeps the
    shard only when it is intact and holds the documents that run needs.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(texts_ds)
    mapped = texts_ds.map(
        _tokenize_batch,
        batched=True,
        batch_size=256,
        fn_kwargs=dict(tokenizer=tokenizer, eot_id=eot_id, max_chars=max_chars),
        remove_columns=texts_ds.column_names,
        num_proc=num_proc if num_proc > 1 and n >= 4 * num_proc else None,
        desc=f"tokenizing shard {shard}",
        load_from_cache_file=False,
    )
    table = mapped.data.table
    val_mask = np.asarray(is_validation(np.arange(offset, offset + n), seed, val_fraction))
    if 0 <= forced_val - offset < n:
        val_mask[forced_val - offset] = True
    ids_col = table.column("ids").combine_chunks()
    counts, files = {}, {}
    for split, mask in (("train", ~val_mask), ("val", val_mask)):
        chosen = pc.filter(ids_col, pa.array(mask))
        flat = pc.list_flatten(chosen).to_numpy(zero_copy_only=False).astype(TOKEN_DTYPE, copy=False)
        flat = np.ascontiguousarray(flat)
        rel = f"shards/{split}_{shard:05d}.bin"
        atomic_write_bytes(out / rel, flat)
        files[rel] = {"bytes": int(flat.nbytes), "sha256": hashlib.sha256(flat).hexdigest()}
        counts[split] = {"tokens": int(flat.size), "docs": int(mask.sum())}
    info = {"shard": shard, "first_doc": offset, "num_docs": n,
            "forced_val": forced_val if 0 <= forced_val - offset < n else -1, **counts, "files": files}
    if end_of_data is not None:
        info["end_of_data"] = end_of_data
    atomic_write_json(out / "shards" / f"{shard:05d}.json", info)
    return info


# -------------------------------------------------------------------------------------- manifest and checks

MANIFEST = "manifest.json"
# Written in settings.json and manifest.json. The first layout (meta.json only) had neither, so its shards
# cannot be checked: such folders are rebuilt, not trusted.
DATA_FORMAT = "hf_resolvent-token-shards/2"
# Everything prepare_dataset writes in its folder (a rebuild removes these, and nothing else); manifest first,
# so that an interrupted rebuild never leaves a manifest next to half-removed files.
_OWN = (MANIFEST, "meta.json", "settings.json", "tokenizer_info.json", "tokenizer", "shards")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")


def _read_json(path: Path) -> Any:
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
    manifest = _read_json(d / MANIFEST)
    if not (d / MANIFEST).exists():
        settings = _read_json(d / "settings.json")
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


def _settings(source: str, files: Sequence[str] | None, tokenizer: str | None, vocab_size: int, seed: int,
              val_fraction: float, docs_per_shard: int, text_column: str, text_sample_by: str) -> dict:
    """Everything the shards depend on: a re-run whose settings differ rebuilds the folder.

    ``max_docs`` is not in here: with more documents the finished shards stay valid (the manifest records it).
    """
    if source == STDLIB:
        inputs: Any = {"python": ".".join(map(str, sys.version_info[:3]))}  # the corpus depends only on this
    elif files:
        inputs = [{"path": str(f), **file_record(Path(f))} for f in files]
    else:
        inputs = {"dataset": source}
    tok: dict[str, Any] = {"name": tokenizer, "vocab_size": vocab_size}
    if tokenizer and tokenizer != "bpe" and Path(tokenizer).expanduser().is_dir():  # a local folder: its contents
        folder = Path(tokenizer).expanduser()
        tok["files"] = {n: file_sha256(folder / n) for n in _TOKENIZER_FILES if (folder / n).is_file()}
    return {"format": DATA_FORMAT, "source": source, "inputs": inputs, "tokenizer": tok, "seed": seed,
            "val_fraction": val_fraction, "docs_per_shard": docs_per_shard, "text_column": text_column,
            "text_sample_by": text_sample_by}


def _settings_diff(old: dict, new: dict) -> str:
    parts = []
    for key in new:
        if old.get(key) != new[key]:
            if key == "inputs" and isinstance(new[key], list):
                parts.append("inputs: other files, or their contents changed")
            else:
                parts.append(f"{key}: {old.get(key)!r} -> {new[key]!r}")
    return "; ".join(parts)


def _tokenizer_problem(out: Path) -> str | None:
    """Why the tokenizer saved in ``out`` cannot be reused (None when it is intact)."""
    info = _read_json(out / "tokenizer_info.json")
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict) or not info["files"]:
        return "its tokenizer is missing or has no record of its files"
    for rel, record in info["files"].items():
        if problem := file_problem(out, rel, record, full=True):
            return f"its tokenizer is damaged ({problem})"
    return None


def _existing_state(out: Path, settings: dict, max_docs: int | None) -> tuple[str, Any]:
    """What a preparation into ``out`` finds there: ``("empty", None)``; ``("done", meta)`` when the manifest
    matches the request and every checksum; ``("resume", None)`` when an unfinished, extended or damaged
    preparation of the same settings can be completed (each shard is checked later); ``("stale", reason)``."""
    if not any((out / name).exists() for name in _OWN):
        return "empty", None
    old = _read_json(out / "settings.json")
    if not isinstance(old, dict) or old.get("format") != DATA_FORMAT:
        if (out / "meta.json").exists() or old is not None:
            return "stale", "was prepared by an earlier version of hf_resolvent (no manifest to check it against)"
        return "stale", "holds an unfinished preparation without a record of its settings"
    if old != settings:
        return "stale", f"was prepared with other settings ({_settings_diff(old, settings)})"
    if (out / "tokenizer").exists() or any((out / "shards").glob("*.json")):
        if problem := _tokenizer_problem(out):
            return "stale", problem
    manifest = _read_json(out / MANIFEST)
    if isinstance(manifest, dict) and manifest.get("settings") == settings and manifest.get("max_docs") == max_docs:
        try:
            return "done", verify_prepared(out, full=True)
        except DataError:
            pass  # the shard checks find the damaged files; the rest is kept
    return "resume", None


def _finished_shard(out: Path, shard: int, first_doc: int, num_docs: int, forced_val: int,
                    may_end_early: bool = False) -> tuple[dict | None, str | None]:
    """``(marker, None)`` when shard ``shard`` is finished, intact (sha256) and holds the documents this run
    needs; ``(None, why)`` when it exists but must be rewritten; ``(None, None)`` when it was never finished.

    ``may_end_early``: a streamed source may have ended inside the block (the marker says so).
    """
    marker_path = out / "shards" / f"{shard:05d}.json"
    if not marker_path.exists():
        return None, None
    info = _read_json(marker_path)
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict):
        return None, "its marker is unreadable"
    count_ok = info.get("num_docs") == num_docs or (
        may_end_early and info.get("end_of_data") and info.get("num_docs", num_docs) < num_docs)
    if info.get("first_doc") != first_doc or not count_ok or info.get("forced_val", -1) != forced_val:
        lo = info.get("first_doc", 0)
        return None, (f"it holds documents {lo} to {lo + info.get('num_docs', 0) - 1}, this run needs {first_doc} "
                      f"to {first_doc + num_docs - 1}")
    for rel, record in info["files"].items():
        if problem := file_problem(out, rel, record, full=True):
            return None, problem
    return info, None


def _check_output_dir(out: Path) -> None:
    """Raise :class:`DataError` when ``out``, or the nearest existing path above it, is not a folder (the folder
    could not be created: the OS would say NotADirectoryError or FileExistsError half-way through)."""
    for path in (out, *out.parents):
        if not path.exists():
            continue
        if path.is_dir():
            return
        where = "is an existing file" if path == out else f"is inside {path}, which is a file"
        raise DataError(f"--output-dir {out} {where}, not a folder; pass a folder (one that does not exist yet is "
                        f"created), or move the file away")


def _clear(out: Path) -> None:
    """Remove what an earlier preparation wrote in ``out`` (only the names in ``_OWN``)."""
    for name in _OWN:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ------------------------------------------------------------------------------------------- local input files

_FILE_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                  ".parquet": "parquet"}
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _files_builder(files: Sequence[str]) -> str:
    """The ``datasets`` builder for ``files`` (one kind of file per preparation)."""
    builders = {_FILE_BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in builders or len(builders) > 1:
        exts = sorted({Path(f).suffix.lower() or "(none)" for f in files})
        raise DataError(f"--files must all be .txt/.md, all .jsonl/.json or all .parquet; got {exts}")
    return builders.pop()


def _check_input_path(path: Path) -> None:
    """``path`` exists and is a file. Run before the kind of the files is worked out from their suffixes, which a
    folder or a missing name would otherwise fail as a file of no known kind.

    A folder is refused, not read: which of its files to take (suffixes, subfolders, order) would be a guess that
    the settings could not record; the message gives the glob to pass instead.
    """
    if path.is_dir():
        kinds = sorted({p.suffix.lower() for p in path.iterdir() if p.suffix.lower() in _FILE_BUILDERS})
        hint = (" or ".join(f"--files {path / ('*' + k)}" for k in kinds) if kinds
                else "its .txt/.md, .jsonl/.json or .parquet files")
        raise DataError(f"--files takes files; got a folder {path}: pass {hint}")
    if not path.exists():
        raise DataError(f"--files: {path} not found")
    if not path.is_file():
        raise DataError(f"--files: {path} is not a file")


def _check_input_file(path: Path, builder: str) -> None:
    """Cheap checks that catch the usual wrong inputs (empty, binary, not parquet) before ``datasets`` turns them
    into a traceback; reads at most the first 64 KiB (and the last bytes of a parquet file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        if builder == "parquet":
            f.seek(max(0, size - 4))
            tail = f.read(4)
    if builder == "parquet":
        if size == 0:
            raise DataError(f"--files: {path} is empty (0 bytes); remove it from --files or write it again")
        if size < 12 or head[:4] != b"PAR1" or tail != b"PAR1":
            raise DataError(f"--files: {path} is not a parquet file (no PAR1 magic bytes at its start and end: "
                            f"truncated, or another format named .parquet); write it again or remove it from --files")
        return
    if not head.strip() and size <= len(head):
        raise DataError(f"--files: {path} is empty (no text); remove it from --files or write it again")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        binary = b"\0" in head
    except UnicodeDecodeError:
        binary = True
    if binary:
        raise DataError(f"--files: {path} is not UTF-8 text (a binary file?); --files takes UTF-8 .txt/.md and "
                        f".jsonl/.json files, or .parquet")


def _json_problem(path: Path, column: str) -> str | None:
    """The first problem of a .jsonl/.json file as a message naming the line (None when it looks fine).

    Only run after ``datasets`` failed or loaded something unusable: it parses every line in Python.
    """

    def row_problem(where: str, row) -> str | None:
        if not isinstance(row, dict):
            return f"{path} {where} is {_JSON_TYPES.get(type(row), type(row).__name__)}, not an object"
        if column not in row:
            fields = sorted(row)[:10]
            return (f"{path} {where} has no {column!r} field (its fields: {fields}); give every document a "
                    f"{column!r} field, or pass --text-column NAME if the text is under another field")
        if not isinstance(row[column], str):
            return (f"{path} {where}: field {column!r} is {_JSON_TYPES.get(type(row[column]), 'not text')}, "
                    f"not a string")
        return None

    with open(path, "rb") as f:
        if f.read(1 << 12).lstrip()[:1] == b"[":  # a .json file holding one array of documents
            f.seek(0)
            try:
                rows = json.load(f)
            except ValueError as err:
                return f"{path} is not valid JSON ({err})"
            if not isinstance(rows, list):  # pragma: no cover - '[' always starts an array
                return f"{path} is not a JSON array"
            return next((p for i, row in enumerate(rows) if (p := row_problem(f"item {i}", row))), None)
        f.seek(0)
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are skipped by the reader too
            try:
                row = json.loads(line)
            except UnicodeDecodeError:
                return f"{path} line {lineno} is not UTF-8 text"
            except json.JSONDecodeError as err:
                what = err.msg.removesuffix(" at")  # json's messages read "Unterminated string starting at"
                return (f"{path} line {lineno} is not valid JSON ({what} at column {err.colno}); each line must "
                        f"hold one JSON object (JSON Lines)")
            if problem := row_problem(f"line {lineno}", row):
                return problem
    return None


def _parquet_problem(path: Path, column: str, rows: bool = True) -> str | None:
    """The first problem of a parquet file: unreadable, no text column, not strings, or (``rows``) a null text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        return f"{path} is not a readable parquet file ({_first_line(err)})"
    if column not in schema.names:
        return (f"{path} has no {column!r} column (its columns: {schema.names}); pass --text-column NAME if the "
                f"text is in another column")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f"{path}: column {column!r} holds {kind}, not strings"
    if rows:
        offset = 0
        for group in range(pf.num_row_groups):
            values = pf.read_row_group(group, columns=[column]).column(0)
            if values.null_count:
                first = next(i for i, v in enumerate(values.is_null().to_pylist()) if v)
                return f"{path} row {offset + first}: {column!r} is null (a document without text)"
            offset += len(values)
    return None


def _files_error(files: Sequence[str], builder: str, column: str, err: BaseException | None = None) -> DataError:
    """A :class:`DataError` naming the first bad input file (and line or row) for a failure of ``datasets``."""
    for f in files:
        if builder == "json":
            problem = _json_problem(Path(f), column)
        elif builder == "parquet":
            problem = _parquet_problem(Path(f), column)
        else:
            problem = None
        if problem:
            return DataError(problem)
    if err is None:
        return DataError(f"the --files have unusable {column!r} values; check them, or pass --text-column NAME")
    cause = err.__cause__ or err.__context__ or err
    return DataError(f"could not read --files {list(files)} ({type(cause).__name__}: {_first_line(cause)})")


@contextlib.contextmanager
def _quiet_datasets():
    """Silence the ``datasets`` logger: its error lines would repeat, less clearly, the error raised here."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------------------------------- Hub datasets

# OpenWebText's repository (Skylion007/openwebtext) holds 21 archives, each holding ``.xz`` files, each an
# xz-compressed tar of ``.txt`` files, one per document; its loading script, which read them, is what ``datasets``
# 4 and later refuse to run.
OWT_ARCHIVES = "subsets/*.tar"
# The branch where the Hub keeps the parquet files its dataset viewer converted a repository to.
PARQUET_REVISION = "refs/convert/parquet"
_BLANK_LINES = re.compile("\n\n\n+")


def _archive_documents(archives: list[tuple[str, int, int]]):
    """``{"text": ...}`` for each document of OpenWebText-layout archives, in archive order.

    ``archives`` are ``(path or URL, size, mtime)``: the size and mtime only make ``datasets``' cache key change
    with the files. The documents are the ones the repository's script gave: members named ``.*`` or ``__*`` are
    skipped (as ``datasets``' archive iterator skipped them), runs of three or more newlines become one blank line
    and the text is stripped. Every archive is read as a stream (``fsspec``: a local path or an ``hf://`` URL).
    """
    import tarfile

    import fsspec

    def files(tar, suffix: str):
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if member.isfile() and name.endswith(suffix) and not name.startswith((".", "__")):
                yield tar.extractfile(member)

    for url, _, _ in archives:
        with fsspec.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r|") as outer:
            for xz in files(outer, ".xz"):
                with tarfile.open(fileobj=xz, mode="r|*") as inner:
                    for txt in files(inner, ".txt"):
                        yield {"text": _BLANK_LINES.sub("\n\n", txt.read().decode("utf-8")).strip()}


def _owt_archives(source: str, streaming: bool) -> list[tuple[str, int, int]]:
    """The OpenWebText-layout archives of ``source``, a local folder or a Hub dataset id (``[]`` when it has none),
    as :func:`_archive_documents` takes them. From the Hub they are downloaded (``snapshot_download``: cached and
    resumed like ``load_dataset``'s downloads), or, when ``streaming``, read over ``hf://``."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        if streaming:
            from huggingface_hub import HfFileSystem

            found = HfFileSystem().glob(f"datasets/{source}/{OWT_ARCHIVES}", detail=True)
            return [(f"hf://{path}", int(info["size"]), 0) for path, info in sorted(found.items())]
        import huggingface_hub

        folder = Path(huggingface_hub.snapshot_download(repo_id=source, repo_type="dataset",
                                                        allow_patterns=[OWT_ARCHIVES]))
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.glob(OWT_ARCHIVES))]


def _archive_dataset(archives: list[tuple[str, int, int]], streaming: bool, num_proc: int):
    """A ``datasets`` dataset (iterable when ``streaming``) with the documents of ``archives`` in a ``text``
    column; ``num_proc`` processes read different archives."""
    import datasets

    kwargs = dict(features=datasets.Features({"text": datasets.Value("string")}), gen_kwargs={"archives": archives})
    if streaming:
        return datasets.IterableDataset.from_generator(_archive_documents, **kwargs)
    procs = min(num_proc, len(archives))
    return datasets.Dataset.from_generator(_archive_documents, num_proc=procs if procs > 1 else None, **kwargs)


def _is_script_refusal(err: BaseException) -> bool:
    """True when ``load_dataset`` refused a repository because it is a loading script: ``datasets`` 4 and later
    run none, 3.x none without ``trust_remote_code`` (which this package does not pass: it runs no one's code)."""
    return "scripts are no longer supported" in str(err) or "trust_remote_code" in str(err)


def _load_hub_dataset(source: str, streaming: bool, num_proc: int):
    """``(dataset, description)`` for a Hugging Face dataset id, or a local folder laid out like a Hub repository.

    ``load_dataset(source)`` reads every repository of data files. A loading script (OpenWebText's) is refused by
    ``datasets`` 4 and later, so its data is read without it: the repository's OpenWebText-layout archives
    (:data:`OWT_ARCHIVES`, the same documents the script gave), else the Hub's parquet conversion
    (:data:`PARQUET_REVISION`). A local folder holding such archives is read directly. When nothing works, the
    :class:`DataError` says what was tried and what to pass instead.
    """
    import datasets

    local = Path(source).expanduser().is_dir()
    streamed = ", streaming" if streaming else ""
    if local and (archives := _owt_archives(source, streaming)):
        return (_archive_dataset(archives, streaming, num_proc),
                f"{len(archives)} OpenWebText-layout archives {OWT_ARCHIVES} in {source}, read directly (split "
                f"train{streamed})")
    kwargs = {} if streaming else {"num_proc": max(1, num_proc)}
    try:
        return (datasets.load_dataset(source, split="train", streaming=streaming, **kwargs),
                f"Hugging Face dataset {source} (split train{streamed})")
    except Exception as err:  # noqa: BLE001 - datasets raises many types for "not reachable"
        if not _is_script_refusal(err):
            raise DataError(
                f"could not load dataset {source!r} ({type(err).__name__}: {str(err)[:200]}). Without network, use "
                f"the offline default (--source stdlib) or local files (--files a.txt b.jsonl c.parquet)."
            ) from err
        refusal = err
    script = f"{source!r} is a loading script, which datasets {datasets.__version__} does not run"
    if local:
        raise DataError(f"{script}, and holds no {OWT_ARCHIVES} archives to read instead; pass its documents as "
                        f"--files (.txt/.md, .jsonl/.json or .parquet), or its Hub id as --source to read the Hub's "
                        f"parquet conversion") from refusal
    tried = []
    try:
        archives = _owt_archives(source, streaming)
    except Exception as err:  # noqa: BLE001 - the Hub client raises many types for "not reachable"
        archives = []
        tried.append(f"its archives {OWT_ARCHIVES} ({type(err).__name__}: {_first_line(err)})")
    if archives:
        return (_archive_dataset(archives, streaming, num_proc),
                f"Hugging Face dataset {source}: its {len(archives)} archives {OWT_ARCHIVES} read directly (the "
                f"documents of its loading script, which datasets {datasets.__version__} does not run; split "
                f"train{streamed})")
    if not tried:
        tried.append(f"it has no {OWT_ARCHIVES} archives")
    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(source, revision=PARQUET_REVISION, split="train", streaming=streaming,
                                       **kwargs)
        return ds, (f"Hugging Face dataset {source}: the Hub's parquet conversion (revision {PARQUET_REVISION}; "
                    f"its loading script is not run by datasets {datasets.__version__}; split train{streamed})")
    except Exception as err:  # noqa: BLE001 - as above
        tried.append(f"the Hub's parquet conversion, revision {PARQUET_REVISION} ({type(err).__name__}: "
                     f"{_first_line(err)})")
    raise DataError(f"could not load dataset {source!r}: {script}, and reading its data without the script failed: "
                    f"{'; '.join(tried)}. Check the network and re-run, or download the repository (hf download "
                    f"{source} --repo-type dataset --local-dir DIR) and pass --source DIR, or pass its documents as "
                    f"--files (.txt/.md, .jsonl/.json or .parquet)") from refusal


def _load_source(source: str, files: Sequence[str] | None, text_column: str, streaming: bool,
                 max_docs: int | None, text_sample_by: str, num_proc: int):
    """Returns (kind, dataset-or-list, description)."""
    if source == STDLIB:
        docs = stdlib_corpus(max_docs=max_docs)
        v = sys.version_info
        return "list", docs, f"offline default: Python {v.major}.{v.minor}.{v.micro} standard library text " \
                             f"(pydoc_data help topics + module docstrings, {len(docs)} documents)"
    import datasets

    if files:
        builder = _files_builder(files)
        kwargs = {"sample_by": text_sample_by} if builder == "text" else {}
        for f in files:  # the cheap checks ran in prepare_dataset; a parquet schema is cheap too (the footer)
            if builder == "parquet" and (problem := _parquet_problem(Path(f), text_column, rows=False)):
                raise DataError(problem)
        try:
            with _quiet_datasets():
                ds = datasets.load_dataset(builder, data_files=list(files), split="train", streaming=streaming,
                                           **kwargs)
        except Exception as err:  # noqa: BLE001 - datasets wraps the reader's errors in several types
            raise _files_error(files, builder, text_column, err) from err
        desc = f"local {builder} files: {', '.join(str(f) for f in files)}"
    else:
        ds, desc = _load_hub_dataset(source, streaming, num_proc)
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        if files:
            raise _files_error(files, builder, text_column)
        raise DataError(f"the dataset has no {text_column!r} column (columns: {columns}); pass --text-column NAME")
    if not streaming:
        feature = ds.features[text_column]
        nulls = ds.data.table.column(text_column).null_count
        if getattr(feature, "dtype", None) not in ("string", "large_string") or nulls:
            if files:
                raise _files_error(files, builder, text_column)
            raise DataError(f"the {text_column!r} column of {source!r} must hold text in every row; it is "
                            f"{feature} with {nulls} missing values")
    if text_column != "text":  # keep only that column: a 'text' column beside it would block the rename
        ds = ds.select_columns([text_column]).rename_column(text_column, "text")
    if not streaming and max_docs is not None:
        ds = ds.select(range(min(max_docs, len(ds))))
    return ("stream" if streaming else "dataset"), ds, desc


def prepare_dataset(
    output_dir: str | os.PathLike,
    source: str = STDLIB,
    files: Sequence[str] | None = None,
    tokenizer: str | None = "gpt2",
    vocab_size: int = 8192,
    val_fraction: float | None = None,
    seed: int = 1337,
    docs_per_shard: int = 100_000,
    num_proc: int | None = None,
    streaming: bool = False,
    max_docs: int | None = None,
    text_column: str = "text",
    text_sample_by: str = "paragraph",
    allow_download: bool = True,
    overwrite: bool = True,
    max_encode_chars: int = DEFAULT_MAX_ENCODE_CHARS,
    log=print,
) -> dict:
    """Tokenise a corpus into uint16 shards under ``output_dir`` (layout in the module docstring); returns meta.

    Args:
        source: ``"stdlib"`` (offline default), a Hugging Face dataset id (``"Skylion007/openwebtext"``) or
            ``"files"`` together with ``files`` (local ``.txt`` / ``.jsonl`` / ``.parquet``).
        tokenizer: a name or folder for ``AutoTokenizer`` (default GPT-2, falling back to a trained BPE when it
            cannot be loaded) or ``"bpe"`` to train one. Re-runs reuse the tokenizer saved in ``output_dir``.
        val_fraction: share of documents in the validation split (default 5% for the small stdlib corpus,
            0.05% otherwise). The document with the smallest hash goes to validation when none would.
        docs_per_shard: documents per shard (a unit of resumption).
        streaming: iterate the source without downloading it whole (``datasets`` streaming).
        overwrite: what to do with a folder holding other data (other inputs or settings, an earlier version's
            layout, a damaged tokenizer or shard): rebuild it (default) or raise :class:`DataError` (False).
        max_encode_chars: the most text the tokenizer gets at once. Longer documents are cut before a word and
            their pieces' tokens joined (for GPT-2-style byte-level tokenizers, the document's own tokens), so the
            memory tokenising takes is bounded by this, not by the longest document. Not part of the settings:
            documents shorter than it are never cut.

    A folder whose manifest matches this request and all its checksums is reused as it is; an unfinished one
    (same settings) is completed, keeping the shards that are intact.
    """
    out = Path(output_dir)
    num_proc = num_proc or max(1, min(os.cpu_count() or 1, 8))
    if files:
        source = "files"
    if val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION.get(source, OWT_VAL_FRACTION)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if docs_per_shard < 1:
        raise DataError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"max_docs must be >= 1, got {max_docs}")
    if max_encode_chars < 1:
        raise DataError(f"max_encode_chars must be >= 1, got {max_encode_chars}")
    check_tokenizer_path(tokenizer)
    _check_output_dir(out)
    if files:
        for f in files:
            _check_input_path(Path(f))
        builder = _files_builder(files)
        for f in files:
            _check_input_file(Path(f), builder)
    settings = _settings(source, files, tokenizer, vocab_size, seed, val_fraction, docs_per_shard, text_column,
                         text_sample_by)
    state, found = _existing_state(out, settings, max_docs)
    if state == "done":
        log(f"[data] {out} already holds this preparation (manifest and checksums verified); reusing it")
        return found
    if state == "stale" and not overwrite:
        raise DataError(f"{out} {found}. Not rebuilding it (--no-overwrite): delete it or choose another "
                        f"--output-dir, or run without --no-overwrite to rebuild it")
    kind, data, data_desc = _load_source(source, files, text_column, streaming, max_docs, text_sample_by, num_proc)
    log(f"[data] data: {data_desc}")
    if state == "stale":
        log(f"[data] {out} {found}: rebuilding it")
        _clear(out)

    # Which finished shards stay: checked (sha256) before anything is changed, so that --no-overwrite can stop.
    keep: dict[int, dict] = {}
    rewrite: list[str] = []
    n_docs = forced_val = 0
    if kind in ("list", "dataset"):
        n_docs = len(data)
        if n_docs == 0:
            raise DataError(f"the corpus is empty ({data_desc})")
        val = is_validation(np.arange(n_docs), seed, val_fraction)
        forced_val = -1
        if not val.any() and val_fraction > 0:
            forced_val = int(np.argmin(split_hash(np.arange(n_docs), seed)))
        for shard in range((n_docs + docs_per_shard - 1) // docs_per_shard):
            lo, hi = shard * docs_per_shard, min(n_docs, (shard + 1) * docs_per_shard)
            info, why = _finished_shard(out, shard, lo, hi - lo, forced_val if lo <= forced_val < hi else -1)
            if info is not None:
                keep[shard] = info
            elif why:
                rewrite.append(f"shard {shard} ({why})")
    else:
        done = 0
        while max_docs is None or done < max_docs:
            want = docs_per_shard if max_docs is None else min(docs_per_shard, max_docs - done)
            info, why = _finished_shard(out, len(keep), done, want, -1, may_end_early=True)
            if info is None:
                if why:
                    rewrite.append(f"shard {len(keep)} ({why})")
                break
            keep[len(keep)] = info
            done += info["num_docs"]
            if info.get("end_of_data"):
                break
    if rewrite and not overwrite:
        raise DataError(f"{out}: {'; '.join(rewrite)} would have to be rewritten. Not rewriting (--no-overwrite): "
                        f"delete the folder or choose another --output-dir, or run without --no-overwrite")
    for item in rewrite:
        log(f"[data] rewriting {item}")
    for name in (MANIFEST, "meta.json"):  # until the new manifest is written, the folder is not prepared
        (out / name).unlink(missing_ok=True)
    (out / "shards").mkdir(parents=True, exist_ok=True)

    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer_config.json").exists():  # checked intact by _existing_state
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        tok_info = json.loads((out / "tokenizer_info.json").read_text())
        choice = TokenizerChoice(tok, tok_info["name"], tok_info["description"])
        log(f"[data] reusing the tokenizer saved in {tok_dir}")
    else:
        sample_texts = None
        if kind == "list":
            sample_texts = [d["text"] for d in data]
        elif kind == "dataset":
            sample_texts = data.select(range(min(len(data), 20_000)))["text"]
        choice = load_or_train_tokenizer(tokenizer, sample_texts, vocab_size, allow_download, log)
        tmp = out / f".tokenizer.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        choice.tokenizer.save_pretrained(tmp)
        shutil.rmtree(tok_dir, ignore_errors=True)
        os.replace(tmp, tok_dir)
        tok_info = {"name": choice.name, "description": choice.description,
                    "files": {f"tokenizer/{p.name}": file_record(p) for p in sorted(tok_dir.iterdir()) if p.is_file()}}
        atomic_write_json(out / "tokenizer_info.json", tok_info)
    tok = choice.tokenizer
    eot_id = tok.convert_tokens_to_ids(EOT) if EOT in tok.get_vocab() else tok.eos_token_id
    if eot_id is None:
        raise DataError(f"tokenizer {choice.name} has no {EOT!r} / eos token to separate documents")
    if len(tok) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"tokenizer vocab {len(tok)} does not fit uint16 shards")
    log(f"[data] tokenizer: {choice.description}; end-of-text id {eot_id}")
    atomic_write_json(out / "settings.json", settings)

    if num_proc > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    from tqdm.auto import tqdm

    shard_infos: list[dict] = []
    fingerprint = None
    if kind in ("list", "dataset"):
        if kind == "list":
            fingerprint = corpus_fingerprint(d["text"] for d in data)
            ds = datasets.Dataset.from_list([{"text": d["text"]} for d in data])
        else:
            ds = data
        n_shards = (n_docs + docs_per_shard - 1) // docs_per_shard
        for shard in tqdm(range(n_shards), desc="shards", unit="shard", disable=n_shards == 1):
            if shard in keep:
                shard_infos.append(keep[shard])
                continue
            lo, hi = shard * docs_per_shard, min(n_docs, (shard + 1) * docs_per_shard)
            shard_infos.append(_write_shard(out, shard, ds.select(range(lo, hi)), lo, tok, eot_id, seed,
                                            val_fraction, forced_val, num_proc, log, max_chars=max_encode_chars))
    else:
        shard_infos = [keep[i] for i in range(len(keep))]
        done = sum(info["num_docs"] for info in shard_infos)
        if not (shard_infos and shard_infos[-1].get("end_of_data")):
            shard_infos += _stream_shards(out, data, len(shard_infos), done, max_docs, docs_per_shard, tok,
                                          eot_id, seed, val_fraction, num_proc, log, files, text_column,
                                          max_encode_chars)
    meta = {
        "format": "uint16 token shards (nanoGPT layout), documents separated by end-of-text",
        "data": data_desc,
        "source": source,
        "corpus_sha256": fingerprint,
        "tokenizer": choice.name,
        "tokenizer_description": choice.description,
        "tokenizer_dir": "tokenizer",
        "vocab_size": len(tok),
        "eot_id": int(eot_id),
        "dtype": "uint16",
        "seed": seed,
        "val_fraction": val_fraction,
        "split_rule": "document i is validation iff splitmix64(i, seed) / 2**64 < val_fraction",
        "docs_per_shard": docs_per_shard,
        "num_docs": sum(s["num_docs"] for s in shard_infos),
        "train_tokens": sum(s["train"]["tokens"] for s in shard_infos),
        "val_tokens": sum(s["val"]["tokens"] for s in shard_infos),
        "train_docs": sum(s["train"]["docs"] for s in shard_infos),
        "val_docs": sum(s["val"]["docs"] for s in shard_infos),
        "shards": {
            "train": [f"shards/train_{s['shard']:05d}.bin" for s in shard_infos],
            "val": [f"shards/val_{s['shard']:05d}.bin" for s in shard_infos],
        },
        "python": sys.version.split()[0],
    }
    if meta["num_docs"] == 0:
        raise DataError(f"the corpus is empty ({data_desc})")
    if meta["val_tokens"] == 0:
        log("[data] warning: the validation split is empty; pass a larger --val-fraction")
    atomic_write_json(out / "meta.json", meta)
    manifest_files = {"meta.json": file_record(out / "meta.json"), **tok_info["files"]}
    for info in shard_infos:
        manifest_files.update(info["files"])
    # Last: the manifest is what makes the folder count as prepared.
    atomic_write_json(out / MANIFEST, {"format": DATA_FORMAT, "settings": settings, "max_docs": max_docs,
                                       "files": manifest_files})
    log(f"[data] wrote {meta['train_tokens']:,} train tokens ({meta['train_docs']} docs) and "
        f"{meta['val_tokens']:,} val tokens ({meta['val_docs']} docs) in {len(shard_infos)} shard(s) to {out}")
    return meta


def _stream_shards(out: Path, data, first_shard: int, done: int, max_docs: int | None, docs_per_shard: int, tok,
                   eot_id: int, seed: int, val_fraction: float, num_proc: int, log, files: Sequence[str] | None,
                   text_column: str, max_chars: int = DEFAULT_MAX_ENCODE_CHARS) -> list[dict]:
    """Write the shards of a streamed source from shard ``first_shard``, document ``done`` on (the earlier ones
    are finished)."""
    import datasets
    from tqdm.auto import tqdm

    infos: list[dict] = []
    shard = first_shard
    it = iter(data.skip(done)) if done else iter(data)
    bar = tqdm(desc="documents", unit="doc", initial=done)
    try:
        while max_docs is None or done < max_docs:
            want = docs_per_shard if max_docs is None else min(docs_per_shard, max_docs - done)
            block = []
            for row in it:
                text = row.get("text")
                if not isinstance(text, str):
                    if files:
                        raise _files_error(files, _files_builder(files), text_column)
                    raise DataError(f"document {done + len(block)} has no text in column {text_column!r}")
                block.append(text)
                if len(block) >= want:
                    break
            if not block:
                break
            infos.append(_write_shard(out, shard, datasets.Dataset.from_dict({"text": block}), done, tok, eot_id,
                                      seed, val_fraction, -1, num_proc, log, end_of_data=len(block) < want,
                                      max_chars=max_chars))
            done += len(block)
            bar.update(len(block))
            shard += 1
            if len(block) < want:
                break
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - a bad local file surfaces while streaming it
        if not files:
            raise
        raise _files_error(files, _files_builder(files), text_column, err) from err
    finally:
        bar.close()
    return infos


def is_prepared(data_dir: str | os.PathLike) -> bool:
    """True when ``data_dir`` holds a finished preparation consistent with its manifest (sizes; see
    :func:`verify_prepared`, which also says what is wrong)."""
    try:
        verify_prepared(data_dir)
    except DataError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- reading


class TokenShards:
    """One split of a prepared folder as a single virtual array of token ids (memory-mapped shards).

    ``len(ts)`` is the number of tokens; ``ts.read(start, length)`` returns int64 ids ``(length,)`` and may span
    shards.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        data_dir = Path(data_dir)
        # sizes of all files against the manifest (cheap): a truncated shard is named here, not met mid-training
        self.meta = verify_prepared(data_dir)
        if split not in self.meta["shards"]:
            raise DataError(f"split must be one of {list(self.meta['shards'])}, got {split!r}")
        self.arrays = []
        for rel in self.meta["shards"][split]:
            path = data_dir / rel
            if path.stat().st_size:
                self.arrays.append(np.memmap(path, dtype=TOKEN_DTYPE, mode="r"))
        self.offsets = np.cumsum([0] + [a.size for a in self.arrays])
        self.split = split

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside the {self.split} split of {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        pos, filled = int(start), 0
        k = int(np.searchsorted(self.offsets, pos, side="right") - 1)
        while filled < length:
            a = self.arrays[k]
            lo = pos - int(self.offsets[k])
            take = min(length - filled, a.size - lo)
            out[filled:filled + take] = a[lo:lo + take]
            filled += take
            pos += take
            k += 1
        return out


class StepSampler:
    """Deterministic random windows indexed by optimizer step (so a resumed run reads the same data).

    Step ``s`` draws ``global_batch`` window starts from ``numpy.random.default_rng([seed, s])``; the process
    ``rank`` of ``world`` takes, for micro-step ``m``, rows ``(m * world + rank) * micro_batch`` onwards. The
    global batch of a step is therefore the same for any number of processes.
    """

    def __init__(self, tokens: TokenShards, seq_len: int, micro_batch: int, grad_accum: int, world: int,
                 seed: int):
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.grad_accum, self.world, self.seed = grad_accum, world, seed
        self.global_batch = micro_batch * grad_accum * world
        if len(tokens) < seq_len + 2:
            raise DataError(f"the {tokens.split} split has {len(tokens)} tokens, fewer than one window of "
                            f"{seq_len + 1}; prepare more data or lower seq_len")

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)

    def batch(self, step: int, micro: int, rank: int) -> np.ndarray:
        """int64 ``(micro_batch, seq_len + 1)``: inputs are ``[:, :-1]``, next-token targets ``[:, 1:]``."""
        starts = self.starts(step)
        lo = (micro * self.world + rank) * self.micro_batch
        return np.stack([self.tokens.read(int(s), self.seq_len + 1) for s in starts[lo:lo + self.micro_batch]])


def eval_windows(tokens: TokenShards, seq_len: int, max_windows: int | None = None) -> list[int]:
    """Starts of consecutive non-overlapping windows of ``seq_len + 1`` tokens over a split (fixed eval set).

    Raises :class:`DataError` when the split is shorter than one window: an empty evaluation would report a
    NaN loss as if it were a result.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        split = getattr(tokens, "split", "evaluation")
        raise DataError(f"the {split} split has {len(tokens):,} tokens, fewer than one evaluation window of "
                        f"{seq_len + 1} (seq_len {seq_len} + 1); lower seq_len or prepare more validation data "
                        f"(a larger --val-fraction, or more documents)")
    if max_windows is not None and n > max_windows:
        # spread the windows evenly over the split
        idx = np.linspace(0, n - 1, max_windows).round().astype(np.int64)
        return [int(i) * seq_len for i in idx]
    return [i * seq_len for i in range(n)]
