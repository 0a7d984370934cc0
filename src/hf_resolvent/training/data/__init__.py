"""Pretraining data: corpora, tokenizers, uint16 token shards and a step-indexed sampler.

A module per job: :mod:`.corpus` (the corpora known by name), :mod:`.sources` (local files and Hub datasets),
:mod:`.tokenizer`, :mod:`.prepare` (documents to shards), :mod:`.manifest` (what a prepared folder holds and its
checks), :mod:`.shards` (reading a prepared folder) and :mod:`.errors`. What the scripts use is importable from
this package.

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
:func:`.sources._load_hub_dataset`), from the Hub or from a local copy of the repository given as the source.

Long documents reach the tokenizer in pieces of at most ``max_encode_chars`` characters, cut before a word (the
same tokens for GPT-2-style tokenizers), so memory does not grow with the longest document.

The offline default corpus (:func:`stdlib_corpus`) is the English text that ships with every CPython: the
interactive help topics of ``pydoc_data`` (the language reference) and the docstrings of the standard library
modules. When the GPT-2 tokenizer cannot be loaded (no network, nothing cached) a byte-level BPE tokenizer is
trained on the corpus with ``tokenizers`` (:func:`train_bpe_tokenizer`).
"""

from .corpus import EOT, OPENWEBTEXT, STDLIB, corpus_fingerprint, stdlib_corpus
from .errors import DataError
from .manifest import DATA_FORMAT, MANIFEST, is_prepared, verify_prepared
from .prepare import DEFAULT_MAX_ENCODE_CHARS, is_validation, prepare_dataset
from .shards import StepSampler, TokenShards, eval_windows
from .tokenizer import hub_reachable, load_or_train_tokenizer, train_bpe_tokenizer

__all__ = ["DATA_FORMAT", "DEFAULT_MAX_ENCODE_CHARS", "EOT", "MANIFEST", "OPENWEBTEXT", "STDLIB", "DataError", "StepSampler", "TokenShards",
           "corpus_fingerprint", "eval_windows", "hub_reachable", "is_prepared", "is_validation",
           "load_or_train_tokenizer", "prepare_dataset", "stdlib_corpus", "train_bpe_tokenizer", "verify_prepared"]
