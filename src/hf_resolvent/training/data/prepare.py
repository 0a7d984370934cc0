"""Preparing a folder: documents split by a seeded hash, tokenised in bounded pieces and written as shards,
each marked finished so that a re-run resumes at the first unfinished one (:func:`prepare_dataset`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...files import atomic_write_bytes, atomic_write_json, file_problem, file_record, file_sha256
from ..cli import output_problem
from .corpus import DEFAULT_VAL_FRACTION, EOT, OWT_VAL_FRACTION, STDLIB, corpus_fingerprint
from .errors import DataError
from .manifest import DATA_FORMAT, MANIFEST, PREPARED_FILES, TOKEN_DTYPE, TOKENIZER_FILES, read_json, verify_prepared
from .sources import check_input_file, check_input_path, files_builder, files_error, load_source
from .tokenizer import (
    DEFAULT_MAX_ENCODE_CHARS,
    TokenizerChoice,
    check_tokenizer_path,
    load_or_train_tokenizer,
    text_pieces,
)

# Longest text the tokenizer gets in one call (long documents are cut): bounds the memory tokenising takes.


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


def _encode_groups(texts: Sequence[str], max_chars: int):
    """``(document index, piece)`` pairs in groups of at most ``max_chars`` characters: short documents share a
    group, a longer one is cut (:func:`.tokenizer.text_pieces`)."""
    group: list[tuple[int, str]] = []
    size = 0
    for i, text in enumerate(texts):
        for piece in text_pieces(text, max_chars):
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
        tok["files"] = {n: file_sha256(folder / n) for n in TOKENIZER_FILES if (folder / n).is_file()}
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
    info = read_json(out / "tokenizer_info.json")
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
    found = [name for name in PREPARED_FILES if (out / name).exists()]
    if not found:
        return "empty", None
    if not any(name in found for name in (MANIFEST, "meta.json", "settings.json")):
        # every preparation writes settings.json before anything else: these are someone else's files
        raise DataError(f"--output-dir {out} holds {', '.join(found)} but no record of a preparation (settings.json, "
                        f"meta.json): it is not a folder this tool prepared, and rebuilding it would remove them. "
                        f"Name a new --output-dir, or move those files away")
    old = read_json(out / "settings.json")
    if not isinstance(old, dict) or old.get("format") != DATA_FORMAT:
        return "stale", "was prepared by an earlier version of hf_resolvent (no manifest to check it against)"
    if old != settings:
        return "stale", f"was prepared with other settings ({_settings_diff(old, settings)})"
    if (out / "tokenizer").exists() or any((out / "shards").glob("*.json")):
        if problem := _tokenizer_problem(out):
            return "stale", problem
    manifest = read_json(out / MANIFEST)
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
    info = read_json(marker_path)
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
    if problem := output_problem(out, "--output-dir"):
        raise DataError(problem)


def _clear(out: Path) -> None:
    """Remove what an earlier preparation wrote in ``out`` (only the names in ``PREPARED_FILES``)."""
    for name in PREPARED_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


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
            check_input_path(Path(f))
        builder = files_builder(files)
        for f in files:
            check_input_file(Path(f), builder)
    settings = _settings(source, files, tokenizer, vocab_size, seed, val_fraction, docs_per_shard, text_column,
                         text_sample_by)
    state, found = _existing_state(out, settings, max_docs)
    if state == "done":
        log(f"[data] {out} already holds this preparation (manifest and checksums verified); reusing it")
        return found
    if state == "stale" and not overwrite:
        raise DataError(f"{out} {found}. Not rebuilding it (--no-overwrite): delete it or choose another "
                        f"--output-dir, or run without --no-overwrite to rebuild it")
    kind, data, data_desc = load_source(source, files, text_column, streaming, max_docs, text_sample_by, num_proc)
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
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "settings.json", settings)  # first: the record that this folder is a preparation's
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
        choice = load_or_train_tokenizer(tokenizer, sample_texts, vocab_size, allow_download, log, max_encode_chars)
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
    if meta["train_tokens"] + meta["val_tokens"] == meta["num_docs"]:  # one separator per document, nothing else
        raise DataError(f"the corpus holds no text: its {meta['num_docs']:,} documents are all empty ({data_desc}); "
                        f"check that the text is in the column read (--text-column) and not elsewhere")
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
                        raise files_error(files, files_builder(files), text_column)
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
        raise files_error(files, files_builder(files), text_column, err) from err
    finally:
        bar.close()
    return infos
