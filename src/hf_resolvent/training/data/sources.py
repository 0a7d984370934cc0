"""Where documents come from: local text, JSON lines, CSV or Parquet files (checked before ``datasets`` reads
them), and Hub datasets, OpenWebText's archives included (:func:`load_source`)."""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .corpus import STDLIB, stdlib_corpus
from .errors import DataError, first_line

# ------------------------------------------------------------------------------------------- local input files

_FILE_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                  ".parquet": "parquet"}
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def files_builder(files: Sequence[str]) -> str:
    """The ``datasets`` builder for ``files`` (one kind of file per preparation)."""
    builders = {_FILE_BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in builders or len(builders) > 1:
        exts = sorted({Path(f).suffix.lower() or "(none)" for f in files})
        raise DataError(f"--files must all be .txt/.md, all .jsonl/.json or all .parquet; got {exts}")
    return builders.pop()


def check_input_path(path: Path) -> None:
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


def check_input_file(path: Path, builder: str) -> None:
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
        return f"{path} is not a readable parquet file ({first_line(err)})"
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


def files_error(files: Sequence[str], builder: str, column: str, err: BaseException | None = None) -> DataError:
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
    return DataError(f"could not read --files {list(files)} ({type(cause).__name__}: {first_line(cause)})")


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

    A few bad documents are skipped, as ``datasets`` users expect of a web corpus, each named on stderr: a member
    whose text is not UTF-8, and the rest of an inner ``.xz`` member that does not decompress. An archive that
    cannot be read as a whole (empty, not a tar, cut short by a download) stops with a :class:`DataError` naming it:
    its documents would be silently missing.
    """
    import lzma
    import tarfile

    import fsspec

    def files(tar, suffix: str):
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if member.isfile() and name.endswith(suffix) and not name.startswith((".", "__")):
                yield member.name, tar.extractfile(member)

    def skipped(url: str, member: str, why: str) -> None:
        print(f"[prepare] skipped {member} in {url}: {why}", file=sys.stderr, flush=True)

    for url, _, _ in archives:
        try:
            with fsspec.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r|") as outer:
                for xz_name, xz in files(outer, ".xz"):
                    try:
                        with tarfile.open(fileobj=xz, mode="r|*") as inner:
                            for txt_name, txt in files(inner, ".txt"):
                                try:
                                    text = txt.read().decode("utf-8")
                                except UnicodeDecodeError as err:
                                    skipped(url, f"{xz_name}/{txt_name}", f"not UTF-8 text ({err.reason} at byte "
                                                                         f"{err.start})")
                                    continue
                                yield {"text": _BLANK_LINES.sub("\n\n", text).strip()}
                    except (tarfile.TarError, lzma.LZMAError, EOFError) as err:
                        skipped(url, f"{xz_name} (the rest of it)", f"it does not decompress ({type(err).__name__}: "
                                                                   f"{err})")
        except (tarfile.TarError, EOFError) as err:
            raise DataError(f"the archive {url} cannot be read ({type(err).__name__}: {err}): it is empty, not a tar, "
                            f"or cut short; download it again (hf download ... --local-dir DIR re-fetches a damaged "
                            f"file), or leave it out of the folder") from None


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
    try:
        with _quiet_datasets():
            return datasets.Dataset.from_generator(_archive_documents, num_proc=procs if procs > 1 else None,
                                                   **kwargs)
    except Exception as err:  # noqa: BLE001 - datasets wraps what the generator raised
        cause = err
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        if "corresponds to no data" in str(err):
            raise DataError(f"the archives hold no documents ({', '.join(url for url, _, _ in archives)}): each is "
                            f"a tar of .xz members holding .txt documents; check the folder") from None
        raise


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
        tried.append(f"its archives {OWT_ARCHIVES} ({type(err).__name__}: {first_line(err)})")
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
                     f"{first_line(err)})")
    raise DataError(f"could not load dataset {source!r}: {script}, and reading its data without the script failed: "
                    f"{'; '.join(tried)}. Check the network and re-run, or download the repository (hf download "
                    f"{source} --repo-type dataset --local-dir DIR) and pass --source DIR, or pass its documents as "
                    f"--files (.txt/.md, .jsonl/.json or .parquet)") from refusal


def load_source(source: str, files: Sequence[str] | None, text_column: str, streaming: bool,
                 max_docs: int | None, text_sample_by: str, num_proc: int):
    """Returns (kind, dataset-or-list, description)."""
    if source == STDLIB:
        docs = stdlib_corpus(max_docs=max_docs)
        v = sys.version_info
        return "list", docs, f"offline default: Python {v.major}.{v.minor}.{v.micro} standard library text " \
                             f"(pydoc_data help topics + module docstrings, {len(docs)} documents)"
    import datasets

    if files:
        builder = files_builder(files)
        kwargs = {"sample_by": text_sample_by} if builder == "text" else {}
        for f in files:  # the cheap checks ran in prepare_dataset; a parquet schema is cheap too (the footer)
            if builder == "parquet" and (problem := _parquet_problem(Path(f), text_column, rows=False)):
                raise DataError(problem)
        try:
            with _quiet_datasets():
                ds = datasets.load_dataset(builder, data_files=list(files), split="train", streaming=streaming,
                                           **kwargs)
        except Exception as err:  # noqa: BLE001 - datasets wraps the reader's errors in several types
            raise files_error(files, builder, text_column, err) from err
        desc = f"local {builder} files: {', '.join(str(f) for f in files)}"
    else:
        ds, desc = _load_hub_dataset(source, streaming, num_proc)
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        if files:
            raise files_error(files, builder, text_column)
        raise DataError(f"the dataset has no {text_column!r} column (columns: {columns}); pass --text-column NAME")
    if not streaming:
        feature = ds.features[text_column]
        nulls = ds.data.table.column(text_column).null_count
        if getattr(feature, "dtype", None) not in ("string", "large_string") or nulls:
            if files:
                raise files_error(files, builder, text_column)
            raise DataError(f"the {text_column!r} column of {source!r} must hold text in every row; it is "
                            f"{feature} with {nulls} missing values")
    if text_column != "text":  # keep only that column: a 'text' column beside it would block the rename
        ds = ds.select_columns([text_column]).rename_column(text_column, "text")
    if not streaming and max_docs is not None:
        ds = ds.select(range(min(max_docs, len(ds))))
    return ("stream" if streaming else "dataset"), ds, desc
