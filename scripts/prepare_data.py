#!/usr/bin/env python
"""Tokenise a corpus into uint16 token shards for scripts/pretrain.py.

Examples::

    # offline default: Python's standard-library text, GPT-2 tokenizer if cached else a trained byte-level BPE
    python scripts/prepare_data.py --output-dir data/stdlib

    # the papers' data: OpenWebText with the GPT-2 tokenizer, 0.05% validation documents (needs network)
    python scripts/prepare_data.py --source Skylion007/openwebtext --output-dir data/openwebtext --num-proc 16
    python scripts/prepare_data.py --source Skylion007/openwebtext --streaming --output-dir data/openwebtext
    # (its loading script is not run: datasets 4 and later refuse scripts, so its archives are read directly;
    # a local copy works too: hf download Skylion007/openwebtext --repo-type dataset --local-dir DIR, --source DIR)

    # local files (.txt / .md split into paragraphs, .jsonl / .parquet with a text column)
    python scripts/prepare_data.py --files corpus/*.jsonl --output-dir data/mine

Re-running the same command reuses a finished folder once its manifest and checksums verify, and otherwise
resumes (after a crash) keeping the shards that are intact. With other inputs or settings the folder is rebuilt,
or, with --no-overwrite, left alone with an error. The folder's ``meta.json`` records which data and tokenizer
were used; ``manifest.json``, written last, the size and sha256 of every file (check it with --verify).
"""

from __future__ import annotations

import argparse
import sys

from hf_resolvent.training.data import (
    DEFAULT_MAX_ENCODE_CHARS,
    OPENWEBTEXT,
    STDLIB,
    DataError,
    prepare_dataset,
    verify_prepared,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--output-dir", required=True, help="folder for meta.json, tokenizer/ and shards/")
    p.add_argument("--source", default=STDLIB,
                   help=f"'{STDLIB}' (offline default: Python standard-library text), a Hugging Face dataset id "
                        f"such as {OPENWEBTEXT}, or a local copy of a dataset repository")
    p.add_argument("--files", nargs="+", help="local .txt/.md, .jsonl/.json or .parquet files (overrides --source)")
    p.add_argument("--text-column", default="text", help="column holding the documents (jsonl/parquet/datasets)")
    p.add_argument("--text-sample-by", default="paragraph", choices=["line", "paragraph", "document"],
                   help="how .txt files are cut into documents")
    p.add_argument("--tokenizer", default="gpt2",
                   help="AutoTokenizer name or folder (falls back to a trained BPE when it cannot be loaded), or "
                        "'bpe' to train a byte-level BPE on the corpus")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="vocabulary of a trained BPE tokenizer (257: byte-level, one token per byte)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="share of documents for validation (default 0.05 for stdlib, 0.0005 otherwise)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the validation split")
    p.add_argument("--docs-per-shard", type=int, default=100_000)
    p.add_argument("--num-proc", type=int, default=None, help="tokenisation processes (default: CPU count, max 8)")
    p.add_argument("--streaming", action="store_true", help="stream the dataset instead of downloading it whole")
    p.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    p.add_argument("--max-encode-chars", type=int, default=DEFAULT_MAX_ENCODE_CHARS,
                   help="most characters the tokenizer gets at once: longer documents are cut before a word (the "
                        "same tokens for GPT-2-style tokenizers), so memory does not grow with the longest document")
    p.add_argument("--offline", action="store_true", help="never try the network (also: HF_HUB_OFFLINE=1)")
    p.add_argument("--no-overwrite", action="store_true",
                   help="stop with an error instead of rebuilding when --output-dir holds data prepared from other "
                        "inputs or settings, by an earlier version, or with damaged files")
    p.add_argument("--verify", action="store_true",
                   help="only check --output-dir against its manifest (sizes and sha256 of every file); exit 2 "
                        "naming the first damaged file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.verify:
            meta = verify_prepared(args.output_dir, full=True)
            print(f"{args.output_dir}: verified ({meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens)")
            return 0
        prepare_dataset(
            args.output_dir, source=args.source, files=args.files, tokenizer=args.tokenizer,
            vocab_size=args.vocab_size, val_fraction=args.val_fraction, seed=args.seed,
            docs_per_shard=args.docs_per_shard, num_proc=args.num_proc, streaming=args.streaming,
            max_docs=args.max_docs, text_column=args.text_column, text_sample_by=args.text_sample_by,
            allow_download=not args.offline, overwrite=not args.no_overwrite, max_encode_chars=args.max_encode_chars,
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
