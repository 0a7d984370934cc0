"""Data preparation: offline corpus, tokenizer fallback, split, shards (resume), readers and the step sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import load_script

from hf_resolvent.training import data as D
from hf_resolvent.training.data import prepare
from hf_resolvent.training.data.tokenizer import text_pieces

NO_SUCH_TOKENIZER = "hf-resolvent-tests/no-such-tokenizer"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def docs():
    return D.stdlib_corpus(max_docs=40)


def test_stdlib_corpus_is_deterministic_english_text(docs):
    again = D.stdlib_corpus(max_docs=40)
    assert [d["text"] for d in docs] == [d["text"] for d in again]
    assert len(docs) == 40
    assert docs[0]["source"].startswith("pydoc_data.topics:")  # the language reference topics come first
    assert any(not d["source"].startswith("pydoc_data") for d in D.stdlib_corpus(max_docs=100))
    text = " ".join(d["text"] for d in docs)
    assert len(text) > 100_000
    words = text.split()
    common = sum(w.lower() in {"the", "a", "of", "is", "to", "and"} for w in words)
    assert common / len(words) > 0.05  # prose, not code


def test_bpe_tokenizer_roundtrip_and_special_tokens(docs, tmp_path):
    tok = D.train_bpe_tokenizer([d["text"] for d in docs], vocab_size=600)
    assert len(tok) == 600
    assert tok.eos_token == D.EOT and tok.bos_token == D.EOT
    assert tok.convert_tokens_to_ids(D.EOT) == 0
    sample = "Resolvent mixers: y_i = Σ α_ij x_j — naïve café 東京 \t\n  end"
    ids = tok(sample)["input_ids"]
    assert tok.decode(ids) == sample  # byte level: any text round-trips
    assert D.EOT not in tok.decode(ids)
    tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again(sample)["input_ids"] == ids and again.eos_token == D.EOT
    # deterministic training
    tok2 = D.train_bpe_tokenizer([d["text"] for d in docs], vocab_size=600)
    assert tok2.get_vocab() == tok.get_vocab()


def test_a_vocabulary_of_257_is_byte_level_and_256_is_refused(docs):
    tok = D.train_bpe_tokenizer([d["text"] for d in docs[:20]], vocab_size=257)
    sample = "naïve café: 東京"
    assert len(tok) == 257 and len(tok(sample)["input_ids"]) == len(sample.encode()) and tok.decode(
        tok(sample)["input_ids"]) == sample  # one token per byte
    with pytest.raises(D.DataError, match=r"vocab_size must be in \[257, 65536\]"):
        D.train_bpe_tokenizer(["text"], vocab_size=256)


def test_tokenizer_fallback_says_what_is_used(docs):
    messages = []
    choice = D.load_or_train_tokenizer(NO_SUCH_TOKENIZER, [d["text"] for d in docs[:10]], vocab_size=400,
                                       log=messages.append)
    assert choice.name == "bpe-400"
    text = "\n".join(messages)
    assert NO_SUCH_TOKENIZER in text and "byte-level BPE" in text
    assert "fallback" in choice.description
    with pytest.raises(D.DataError, match="--tokenizer PATH"):
        D.load_or_train_tokenizer(NO_SUCH_TOKENIZER, None, log=messages.append)


def test_hub_probe_respects_offline_env():
    assert D.hub_reachable() is False  # HF_HUB_OFFLINE=1 set by the fixture: no connection attempted


def test_validation_split_is_seeded_and_has_the_right_size():
    idx = np.arange(200_000)
    a = D.is_validation(idx, seed=1337, fraction=0.05)
    assert np.array_equal(a, D.is_validation(idx, seed=1337, fraction=0.05))
    assert abs(a.mean() - 0.05) < 0.003
    b = D.is_validation(idx, seed=7, fraction=0.05)
    assert not np.array_equal(a, b)
    small = D.is_validation(np.arange(2_000_000), seed=1337, fraction=0.0005)
    assert abs(small.mean() - 0.0005) < 0.0001
    # a document's membership depends only on its index (any batching gives the same answer)
    assert np.array_equal(D.is_validation(idx[1000:2000], 1337, 0.05), a[1000:2000])


def _prepare(out, **kw):
    kw = {"source": D.STDLIB, "tokenizer": NO_SUCH_TOKENIZER, "vocab_size": 500, "max_docs": 30, "num_proc": 1,
          "log": lambda *a: None, **kw}
    return D.prepare_dataset(out, **kw)


def test_prepare_offline_default_writes_shards_meta_and_tokenizer(tmp_path, docs):
    meta = _prepare(tmp_path / "one", docs_per_shard=1000)
    assert meta["source"] == "stdlib" and "standard library" in meta["data"]
    assert meta["tokenizer"] == "bpe-500" and "fallback" in meta["tokenizer_description"]
    assert json.loads((tmp_path / "one" / "meta.json").read_text()) == meta
    assert meta["num_docs"] == 30 and meta["train_docs"] + meta["val_docs"] == 30 and meta["val_docs"] >= 1
    train = np.fromfile(tmp_path / "one" / meta["shards"]["train"][0], dtype=np.uint16)
    val = np.fromfile(tmp_path / "one" / meta["shards"]["val"][0], dtype=np.uint16)
    assert train.size == meta["train_tokens"] and val.size == meta["val_tokens"]
    # one end-of-text after every document, the last token of each split
    assert (train == meta["eot_id"]).sum() == meta["train_docs"] and train[-1] == meta["eot_id"]
    assert (val == meta["eot_id"]).sum() == meta["val_docs"]
    # the first training document decodes to the corpus text
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "one" / "tokenizer")
    val_mask = D.is_validation(np.arange(30), meta["seed"], meta["val_fraction"])
    first_train = next(i for i in range(30) if not val_mask[i])
    end = int(np.argmax(train == meta["eot_id"]))
    assert tok.decode(train[:end].tolist()) == docs[first_train]["text"]

    # several shards hold the same tokens as one
    meta3 = _prepare(tmp_path / "three", docs_per_shard=12)
    assert len(meta3["shards"]["train"]) == 3
    ts = D.TokenShards(tmp_path / "three", "train")
    assert len(ts) == train.size
    assert np.array_equal(ts.read(0, len(ts)), train.astype(np.int64))


def test_prepare_resumes_and_skips_finished_shards(tmp_path, monkeypatch):
    out = tmp_path / "d"
    meta = _prepare(out, docs_per_shard=10)
    before = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    # simulate a crash while shard 1 was being written: its marker and train file are missing
    (out / "shards" / "00001.json").unlink()
    (out / "shards" / "train_00001.bin").unlink()
    calls = []
    real = prepare._write_shard
    monkeypatch.setattr(prepare, "_write_shard", lambda out_, shard, *a, **k: calls.append(shard) or real(out_, shard, *a, **k))
    meta2 = _prepare(out, docs_per_shard=10)
    assert calls == [1]
    assert meta2 == meta
    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before
    assert D.is_prepared(out)
    # other settings: refused with overwrite=False (nothing changed), rebuilt by default
    with pytest.raises(D.DataError, match=r"other settings \(seed: 1337 -> 5\).*--no-overwrite"):
        _prepare(out, docs_per_shard=10, seed=5, overwrite=False)
    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before
    messages = []
    meta5 = _prepare(out, docs_per_shard=10, seed=5, log=messages.append)
    assert any("other settings" in m and "rebuilding" in m for m in messages)
    assert meta5["seed"] == 5 and D.verify_prepared(out, full=True) == meta5


def test_prepare_local_text_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"Document number {i} talks about resolvent mixers and token routing." for i in range(25)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": r}) + "\n" for r in rows))
    pq.write_table(pa.table({"text": rows}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("\n\n".join(rows) + "\n")
    metas = {}
    for name, kw in (("jsonl", {"text_column": "body"}), ("parquet", {}), ("txt", {})):
        metas[name] = D.prepare_dataset(tmp_path / f"out_{name}", files=[str(tmp_path / f"a.{name}")],
                                        tokenizer="bpe", vocab_size=300, val_fraction=0.1, num_proc=1,
                                        log=lambda *a: None, **kw)
        assert metas[name]["num_docs"] == 25, name
        assert "local" in metas[name]["data"]
    assert metas["jsonl"]["train_tokens"] == metas["parquet"]["train_tokens"]
    # paragraphs of a .txt file keep their final newline (one more token for the last document at most)
    assert 0 <= metas["txt"]["train_tokens"] - metas["jsonl"]["train_tokens"] <= 1
    with pytest.raises(D.DataError, match="--text-column"):
        D.prepare_dataset(tmp_path / "bad", files=[str(tmp_path / "a.jsonl")], tokenizer="bpe", vocab_size=300,
                          log=lambda *a: None)
    with pytest.raises(D.DataError, match="not found"):
        D.prepare_dataset(tmp_path / "bad2", files=[str(tmp_path / "missing.txt")], log=lambda *a: None)


def _seal(folder, files):
    """A manifest for a hand-made folder holding meta.json and ``files`` (what prepare_dataset writes last)."""
    import hashlib

    records = {rel: {"bytes": (folder / rel).stat().st_size,
                     "sha256": hashlib.sha256((folder / rel).read_bytes()).hexdigest()}
               for rel in ["meta.json", *files]}
    (folder / D.MANIFEST).write_text(json.dumps({"format": D.DATA_FORMAT, "settings": {}, "files": records}))


def test_token_shards_and_step_sampler(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = [np.arange(0, 50, dtype=np.uint16), np.arange(50, 60, dtype=np.uint16), np.arange(60, 130, dtype=np.uint16)]
    for i, p in enumerate(parts):
        p.tofile(shards / f"train_{i:05d}.bin")
    names = [f"shards/train_{i:05d}.bin" for i in range(3)]
    (tmp_path / "meta.json").write_text(json.dumps({"shards": {"train": names}}))
    _seal(tmp_path, names)
    ts = D.TokenShards(tmp_path, "train")
    assert len(ts) == 130
    assert ts.read(45, 30).tolist() == list(range(45, 75))  # spans three shards
    with pytest.raises(IndexError):
        ts.read(120, 11)
    one = D.StepSampler(ts, seq_len=8, micro_batch=2, grad_accum=2, world=1, seed=3)
    two = D.StepSampler(ts, seq_len=8, micro_batch=2, grad_accum=1, world=2, seed=3)
    assert one.global_batch == two.global_batch == 4
    for step in (0, 5, 123):
        a = np.concatenate([one.batch(step, m, 0) for m in range(2)])
        b = np.concatenate([two.batch(step, 0, r) for r in range(2)])
        assert np.array_equal(a, b)  # the global batch does not depend on the process count
        assert a.shape == (4, 9)
        assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows
        assert np.array_equal(one.batch(step, 1, 0), one.batch(step, 1, 0))
    assert not np.array_equal(one.batch(0, 0, 0), one.batch(1, 0, 0))
    starts = D.eval_windows(ts, 8)
    assert starts == list(range(0, 129 - 8 + 1, 8))[: (130 - 1) // 8]
    assert len(D.eval_windows(ts, 8, max_windows=4)) == 4


def test_prepare_data_cli_reports_errors(tmp_path, capsys):
    mod = load_script("prepare_data")
    assert mod.main(["--output-dir", str(tmp_path / "x"), "--files", str(tmp_path / "nope.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


class _RecordingTokenizer:
    """A tokenizer whose backend records how many characters each encode call gets."""

    def __init__(self, tok):
        self.backend_tokenizer, self._backend, self.calls = self, tok.backend_tokenizer, []

    def encode_batch(self, texts, **kwargs):
        self.calls.append([len(t) for t in texts])
        return self._backend.encode_batch(texts, **kwargs)


def _long_text(docs) -> str:
    """Prose with every kind of whitespace run (spaces, tabs, blank lines, spaces before newlines) and symbols."""
    parts = [d["text"] for d in docs] + ["naïve café 東京 — x = 3.14;\t\ty  \n  z\n\n\n  (end)  "] * 50
    return "  \n".join(parts)


def test_long_documents_are_tokenised_in_pieces_with_the_same_tokens(docs):
    tok = D.train_bpe_tokenizer([d["text"] for d in docs], vocab_size=600)
    text = _long_text(docs)
    short = [d["text"] for d in docs[:20]]
    assert len(text) > 50_000
    budget = 4_000
    rec = _RecordingTokenizer(tok)
    out = prepare._tokenize_batch({"text": [short[0], text, *short[1:]]}, rec, eot_id=0, max_chars=budget)["ids"]
    assert max(sum(call) for call in rec.calls) <= budget  # no call sees more text than the budget
    assert len(rec.calls) > len(text) // budget  # the long document went in pieces
    whole = [e.ids for e in tok.backend_tokenizer.encode_batch([short[0], text, *short[1:]], add_special_tokens=False)]
    assert [list(ids) for ids in out] == [ids + [0] for ids in whole]  # cut before words: GPT-2 pre-tokens kept
    assert tok.decode(list(out[1][:-1])) == text


def test_a_bpe_trained_on_one_huge_document_sees_it_in_pieces(docs, monkeypatch):
    """Training a BPE on one 26 MB line took 3 GB where the same bytes as 9,400 lines took 0.66 GB: the trainer now
    gets pieces cut at word starts, which hold the same words, so the vocabulary is the same."""
    from tokenizers import Tokenizer

    text = _long_text(docs)
    seen = []
    real = Tokenizer.train_from_iterator

    def recording(self, iterator, *args, **kwargs):
        items = list(iterator)
        seen.extend(map(len, items))
        return real(self, items, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "train_from_iterator", recording)
    pieces = D.train_bpe_tokenizer([text], vocab_size=400, max_chars=2_000)
    assert max(seen) <= 2_000 and sum(seen) == len(text) and len(seen) > len(text) // 2_000
    monkeypatch.undo()
    whole = D.train_bpe_tokenizer([text], vocab_size=400, max_chars=len(text))
    assert pieces.get_vocab() == whole.get_vocab()


def test_text_without_word_starts_is_cut_at_the_budget_and_still_decodes(docs):
    tok = D.train_bpe_tokenizer([d["text"] for d in docs], vocab_size=600)
    blob = "QUJD" * 3_000 + " and then words" + "\t" * 2_000 + "end"  # base64-like: no whitespace for 12,000 chars
    pieces = text_pieces(blob, 1_000)
    assert "".join(pieces) == blob and max(map(len, pieces)) <= 1_000
    rec = _RecordingTokenizer(tok)
    ids = prepare._tokenize_batch({"text": [blob]}, rec, eot_id=0, max_chars=1_000)["ids"][0]
    assert max(sum(call) for call in rec.calls) <= 1_000
    assert tok.decode(list(ids[:-1])) == blob


def test_prepare_tokenises_a_long_jsonl_document_in_pieces(tmp_path, docs, monkeypatch):
    """The budget reaches the tokenizer from the command line, and the shard holds the document's own tokens."""
    text = _long_text(docs)
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in [text, docs[0]["text"], docs[1]["text"]]))
    tok_dir = tmp_path / "tok"
    D.train_bpe_tokenizer([d["text"] for d in docs], vocab_size=600).save_pretrained(tok_dir)
    sizes = []
    real = prepare._encode_groups
    monkeypatch.setattr(prepare, "_encode_groups", lambda texts, max_chars: (
        sizes.append(max_chars) or g for g in real(texts, max_chars)))
    mod = load_script("prepare_data")
    out = tmp_path / "out"
    assert mod.main(["--output-dir", str(out), "--files", str(src), "--tokenizer", str(tok_dir), "--val-fraction", "0",
                     "--num-proc", "1", "--max-encode-chars", "3000"]) == 0
    assert sizes and set(sizes) == {3000}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ts = D.TokenShards(out, "train")
    ids = ts.read(0, len(ts))
    first = ids[: int(np.argmax(ids == tok.eos_token_id))]
    assert first.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(first.tolist()) == text
