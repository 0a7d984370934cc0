"""The tokenizer of a prepared folder: a Hub or local tokenizer, or a byte-level BPE one trained on the corpus
when that cannot be loaded (:func:`load_or_train_tokenizer`)."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .corpus import EOT
from .errors import DataError, first_line
from .manifest import TOKEN_DTYPE

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


DEFAULT_MAX_ENCODE_CHARS = 100_000  # the most text the tokenizer gets at once (its memory grows with it)

# Where a long document may be cut for the tokenizer: just before the whitespace character that starts a word
# (" word", "\nword"). GPT-2's pre-tokenizer regex always starts a token there (a leading space belongs to the
# word, and a run of whitespace gives its last character to what follows), so a byte-level BPE gives the pieces
# exactly the tokens of the whole document. ``.*`` is greedy: the match ends at the last such start it can reach.
_LAST_WORD_START = re.compile(r"(?s:.*)\s(?=\S)")


def text_pieces(text: str, max_chars: int) -> list[str]:
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



def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2,
                        max_chars: int = DEFAULT_MAX_ENCODE_CHARS):
    """Train a GPT-2-style byte-level BPE tokenizer on ``texts``; returns a ``PreTrainedTokenizerFast``.

    Same design as GPT-2's tokenizer (byte-level pre-tokenisation with GPT-2's regex, no normalisation, every
    byte in the initial alphabet so any text is encodable), with ``<|endoftext|>`` as id 0 and as the
    bos/eos/unk token. Training is deterministic for a given corpus and ``vocab_size``. Documents reach the trainer
    in pieces of at most ``max_chars`` characters cut at word starts (:func:`text_pieces`): the same words, so the
    same vocabulary, without the gigabytes one huge document took.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 or vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"vocab_size must be in [257, 65536] (256 bytes + <|endoftext|>, uint16 shards; 257 is "
                        f"byte-level, no merges), got {vocab_size}")
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
    tok.train_from_iterator((piece for text in texts for piece in text_pieces(text, max_chars)), trainer=trainer)
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
    max_chars: int = DEFAULT_MAX_ENCODE_CHARS,
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
                                f"{first_line(err)}); pass a folder written by save_pretrained (tokenizer.json, "
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
    tok = train_bpe_tokenizer(texts, vocab_size=vocab_size, max_chars=max_chars)
    desc = f"byte-level BPE, vocab {len(tok)}, trained on this corpus with `tokenizers` in {time.time() - t0:.1f}s"
    if name and name != "bpe":
        desc += f" (fallback: {name} unavailable offline)"
    return TokenizerChoice(tok, f"bpe-{len(tok)}", desc)
