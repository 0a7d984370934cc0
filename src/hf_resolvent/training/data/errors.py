"""The error a data problem the user can fix is reported as."""

from __future__ import annotations


class DataError(RuntimeError):
    """A data-preparation problem the user can fix (the message says how)."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (library messages can span screens)."""
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]
