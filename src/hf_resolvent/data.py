"""Pretraining data: corpora, tokenizers, uint16 token shards and a step-indexed sampler.

Layout written by :func:`prepare_dataset` (the flat ``uint16`` layout popularised by nanoGPT, split in shards)::

    OUT/
      meta.json                 what was used (data, tokenizer, seed, split rule) and the token counts
      tokenizer/                the tokenizer the shards were written with (``AutoTokenizer.from_pretrained``)
      shards/train_00000.bin    uint16 token ids, documents separated by the end-of-text token
      shards/val_00000.bin      the validation documents of the same block of documents
      shards/00000.json         written last: marks shard 0 finished (a re-run skips it)

Shard ``i`` holds documents ``i * docs_per_shard ... (i + 1) * docs_per_shard - 1`` of the source, so a re-run
(after a crash, or with more ``--max-docs``) resumes at the first unfinished shard. A document goes to the
validation split when a seeded hash of its index is below ``val_fraction`` (0.05% for OpenWebText, like the
papers and nanoGPT): the split does not depend on shard size, process count or streaming.

The offline default corpus (:func:`stdlib_corpus`) is the English text that ships with every CPython: the
interactive help topics of ``pydoc_data`` (the language reference) and the docstrings of the standard library
modules. When the GPT-2 tokenizer cannot be loaded (no network, nothing cached) a byte-level BPE tokenizer is
trained on the corpus with ``tokenizers`` (:func:`train_bpe_tokenizer`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
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

EOT = "<|endoftext|>"
STDLIB = "stdlib"
OPENWEBTEXT = "Skylion007/openwebtext"
DEFAULT_VAL_FRACTION = {STDLIB: 0.05}
OWT_VAL_FRACTION = 0.0005
TOKEN_DTYPE = np.uint16

# Parts of the standard library left out of the offline corpus: tests, demos, bundled third-party code and
# modules whose docstrings are mostly tables or code.
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "encodings",
                "__pycache__", "__phello__", "pydoc_data"}


class DataError(RuntimeError):
    """A data-preparation problem the user can fix (the message says how)."""


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
    """
    from transformers import AutoTokenizer

    if name and name != "bpe":
        try:
            tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
            return TokenizerChoice(tok, name, f"{name} (from {'local folder' if Path(name).is_dir() else 'local cache'})")
        except (OSError, ValueError) as err:
            first_error = err
        if allow_download and not Path(name).exists() and hub_reachable():
            try:
                tok = AutoTokenizer.from_pretrained(name)
                return TokenizerChoice(tok, name, f"{name} (downloaded from the Hugging Face Hub)")
            except (OSError, ValueError) as err:
                first_error = err
        reason = f"could not load tokenizer {name!r} (no network and not in the local cache: {type(first_error).__name__})"
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


def _atomic_write_bytes(path: Path, data: bytes | np.ndarray) -> None:
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
    _atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def _tokenize_batch(batch: dict, tokenizer, eot_id: int) -> dict:
    enc = tokenizer.backend_tokenizer.encode_batch(batch["text"], add_special_tokens=False)
    return {"ids": [e.ids + [eot_id] for e in enc]}


def _write_shard(out: Path, shard: int, texts_ds, offset: int, tokenizer, eot_id: int, seed: int,
                 val_fraction: float, forced_val: int, num_proc: int, log) -> dict:
    """Tokenise one block of documents (a ``datasets.Dataset`` with a ``text`` column) and write its shard."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(texts_ds)
    mapped = texts_ds.map(
        _tokenize_batch,
        batched=True,
        batch_size=256,
        fn_kwargs=dict(tokenizer=tokenizer, eot_id=eot_id),
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
    counts = {}
    for split, mask in (("train", ~val_mask), ("val", val_mask)):
        chosen = pc.filter(ids_col, pa.array(mask))
        flat = pc.list_flatten(chosen).to_numpy(zero_copy_only=False).astype(TOKEN_DTYPE, copy=False)
        _atomic_write_bytes(out / "shards" / f"{split}_{shard:05d}.bin", np.ascontiguousarray(flat))
        counts[split] = {"tokens": int(flat.size), "docs": int(mask.sum())}
    info = {"shard": shard, "first_doc": offset, "num_docs": n, **counts}
    atomic_write_json(out / "shards" / f"{shard:05d}.json", info)
    return info


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
        exts = {Path(f).suffix.lower() for f in files}
        if exts <= {".txt", ".text", ".md"}:
            builder, kwargs = "text", {"sample_by": text_sample_by}
        elif exts <= {".jsonl", ".json"}:
            builder, kwargs = "json", {}
        elif exts <= {".parquet"}:
            builder, kwargs = "parquet", {}
        else:
            raise DataError(f"--files must all be .txt/.md, .jsonl/.json or .parquet; got {sorted(exts)}")
        missing = [f for f in files if not Path(f).exists()]
        if missing:
            raise DataError(f"--files not found: {missing}")
        ds = datasets.load_dataset(builder, data_files=list(files), split="train", streaming=streaming, **kwargs)
        desc = f"local {builder} files: {', '.join(str(f) for f in files)}"
    else:
        try:
            ds = datasets.load_dataset(source, split="train", streaming=streaming,
                                       **({} if streaming else {"num_proc": max(1, num_proc)}))
        except Exception as err:  # noqa: BLE001 - datasets raises many types for "not reachable"
            raise DataError(
                f"could not load dataset {source!r} ({type(err).__name__}: {str(err)[:200]}). Without network, use "
                f"the offline default (--source stdlib) or local files (--files a.txt b.jsonl c.parquet)."
            ) from err
        desc = f"Hugging Face dataset {source} (split train{', streaming' if streaming else ''})"
    if text_column != "text":
        if text_column not in (ds.column_names or []):
            raise DataError(f"--text-column {text_column!r} not in the dataset columns {ds.column_names}")
        ds = ds.rename_column(text_column, "text")
    elif ds.column_names is not None and "text" not in ds.column_names:
        raise DataError(f"the dataset has no 'text' column (columns: {ds.column_names}); pass --text-column NAME")
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
    """
    out = Path(output_dir)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    num_proc = num_proc or max(1, min(os.cpu_count() or 1, 8))
    if files:
        source = "files"
    if val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION.get(source, OWT_VAL_FRACTION)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if docs_per_shard < 1:
        raise DataError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    settings = {"source": source, "files": [str(f) for f in files] if files else None, "seed": seed,
                "val_fraction": val_fraction, "docs_per_shard": docs_per_shard, "text_column": text_column}
    settings_path = out / "settings.json"
    if settings_path.exists():
        old = json.loads(settings_path.read_text())
        if old != settings:
            changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            raise DataError(f"{out} holds shards prepared with other settings {changed}; use another --output-dir "
                            f"or delete it.")
    kind, data, data_desc = _load_source(source, files, text_column, streaming, max_docs, text_sample_by, num_proc)
    log(f"[data] data: {data_desc}")

    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        old_meta = json.loads((out / "tokenizer_info.json").read_text())
        choice = TokenizerChoice(tok, old_meta["name"], old_meta["description"])
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
        atomic_write_json(out / "tokenizer_info.json", {"name": choice.name, "description": choice.description})
    tok = choice.tokenizer
    eot_id = tok.convert_tokens_to_ids(EOT) if EOT in tok.get_vocab() else tok.eos_token_id
    if eot_id is None:
        raise DataError(f"tokenizer {choice.name} has no {EOT!r} / eos token to separate documents")
    if len(tok) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"tokenizer vocab {len(tok)} does not fit uint16 shards")
    log(f"[data] tokenizer: {choice.description}; end-of-text id {eot_id}")
    atomic_write_json(settings_path, settings)

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
        n_docs = len(ds)
        if n_docs == 0:
            raise DataError("the corpus is empty")
        val = is_validation(np.arange(n_docs), seed, val_fraction)
        forced_val = -1
        if not val.any() and val_fraction > 0:
            forced_val = int(np.argmin(split_hash(np.arange(n_docs), seed)))
        n_shards = (n_docs + docs_per_shard - 1) // docs_per_shard
        for shard in tqdm(range(n_shards), desc="shards", unit="shard", disable=n_shards == 1):
            marker = out / "shards" / f"{shard:05d}.json"
            if marker.exists():
                shard_infos.append(json.loads(marker.read_text()))
                continue
            lo, hi = shard * docs_per_shard, min(n_docs, (shard + 1) * docs_per_shard)
            shard_infos.append(_write_shard(out, shard, ds.select(range(lo, hi)), lo, tok, eot_id, seed,
                                            val_fraction, forced_val, num_proc, log))
    else:
        done = 0
        shard = 0
        while (out / "shards" / f"{shard:05d}.json").exists():
            info = json.loads((out / "shards" / f"{shard:05d}.json").read_text())
            shard_infos.append(info)
            done += info["num_docs"]
            shard += 1
            if info["num_docs"] < docs_per_shard:
                break
        else:
            it = iter(data.skip(done)) if done else iter(data)
            total_cap = max_docs
            bar = tqdm(desc="documents", unit="doc", initial=done)
            while True:
                want = docs_per_shard if total_cap is None else min(docs_per_shard, total_cap - done)
                if want <= 0:
                    break
                block = []
                for row in it:
                    block.append(row["text"])
                    if len(block) >= want:
                        break
                if not block:
                    break
                info = _write_shard(out, shard, datasets.Dataset.from_dict({"text": block}), done, tok, eot_id,
                                    seed, val_fraction, -1, num_proc, log)
                shard_infos.append(info)
                done += len(block)
                bar.update(len(block))
                shard += 1
                if len(block) < want:
                    break
            bar.close()
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
    if meta["val_tokens"] == 0:
        log("[data] warning: the validation split is empty; pass a larger --val-fraction")
    atomic_write_json(out / "meta.json", meta)
    log(f"[data] wrote {meta['train_tokens']:,} train tokens ({meta['train_docs']} docs) and "
        f"{meta['val_tokens']:,} val tokens ({meta['val_docs']} docs) in {len(shard_infos)} shard(s) to {out}")
    return meta


def is_prepared(data_dir: str | os.PathLike) -> bool:
    """True when ``data_dir`` holds a finished preparation (``meta.json``)."""
    return (Path(data_dir) / "meta.json").exists()


# ---------------------------------------------------------------------------------------------- reading


class TokenShards:
    """One split of a prepared folder as a single virtual array of token ids (memory-mapped shards).

    ``len(ts)`` is the number of tokens; ``ts.read(start, length)`` returns int64 ids ``(length,)`` and may span
    shards.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        data_dir = Path(data_dir)
        meta_path = data_dir / "meta.json"
        if not meta_path.exists():
            raise DataError(f"{data_dir} is not a prepared data folder (no meta.json); run scripts/prepare_data.py")
        self.meta = json.loads(meta_path.read_text())
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
    """Starts of consecutive non-overlapping windows of ``seq_len + 1`` tokens over a split (fixed eval set)."""
    n = (len(tokens) - 1) // seq_len
    if max_windows is not None and n > max_windows:
        # spread the windows evenly over the split
        idx = np.linspace(0, n - 1, max_windows).round().astype(np.int64)
        return [int(i) * seq_len for i in idx]
    return [i * seq_len for i in range(n)]
