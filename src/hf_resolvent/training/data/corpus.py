"""The corpora known by name: the offline default (the English text that ships with every CPython,
:func:`stdlib_corpus`) and OpenWebText, with the validation fraction each uses; and the fingerprint of a
corpus's text."""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from collections.abc import Iterable
from pathlib import Path

EOT = "<|endoftext|>"
STDLIB = "stdlib"
OPENWEBTEXT = "Skylion007/openwebtext"
DEFAULT_VAL_FRACTION = {STDLIB: 0.05}
OWT_VAL_FRACTION = 0.0005


# Parts of the standard library left out of the offline corpus: tests, demos, bundled third-party code and
# modules whose docstrings are mostly tables or code.
_STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "encodings",
                "__pycache__", "__phello__", "pydoc_data"}


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
