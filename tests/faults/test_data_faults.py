"""Data preparation off the happy path: damaged or foreign prepared folders, bad input files, a mistyped tokenizer
path and a validation split shorter than one window. Each case must end in one clear DataError (exit 2 for the
script) and leave nothing that a later run could take for prepared data."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import load_script

from hf_resolvent.training import data as D
from hf_resolvent.training.data import prepare

prepare_data = load_script("prepare_data")
ROWS = [f"Document {i} is about resolvent mixers, token routing and the number {i * 7}." for i in range(24)]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A saved byte-level BPE: runs that share it write identical tokens for identical documents."""
    path = tmp_path_factory.mktemp("tok") / "bpe"
    D.train_bpe_tokenizer(ROWS, vocab_size=300).save_pretrained(path)
    return path


def _jsonl(path, rows, key="text"):
    path.write_text("".join(json.dumps({key: r}) + "\n" for r in rows))
    return path


def _prepare(out, files, tokenizer, **kw):
    kw = {"docs_per_shard": 10, "val_fraction": 0.2, "num_proc": 1, "log": lambda *a: None, **kw}
    return D.prepare_dataset(out, files=[str(f) for f in files], tokenizer=str(tokenizer), **kw)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = prepare_data.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _assert_one_clear_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]


# ------------------------------------------------------------------------- item 10: the prepared folder


@pytest.fixture
def prepared(tmp_path, tokenizer_dir):
    src = _jsonl(tmp_path / "a.jsonl", ROWS)
    out = tmp_path / "data"
    meta = _prepare(out, [src], tokenizer_dir)
    assert D.is_prepared(out)
    return out, src, meta


def test_truncated_shard_is_named_by_readers_and_rewritten_by_a_rerun(prepared, tokenizer_dir):
    out, src, meta = prepared
    shard = out / "shards" / "train_00001.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # a copy or a crash cut it short
    assert not D.is_prepared(out)
    for split in ("train", "val"):  # either split refuses the folder, naming the damaged shard
        with pytest.raises(D.DataError, match=r"shards/train_00001\.bin is damaged: .* bytes where"):
            D.TokenShards(out, split)
    messages = []
    assert _prepare(out, [src], tokenizer_dir, log=messages.append) == meta
    assert any("rewriting shard 1" in m for m in messages), messages
    assert not any("rewriting shard 0" in m or "rewriting shard 2" in m for m in messages)
    assert shard.read_bytes() == good and D.is_prepared(out)


def test_same_size_corruption_is_found_by_checksums(prepared, tokenizer_dir, capsys):
    out, src, meta = prepared
    shard = out / "shards" / "train_00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(bytes(len(good)))  # same size, other bytes: only a checksum sees it
    assert D.is_prepared(out)  # the cheap check compares sizes
    with pytest.raises(D.DataError, match=r"shards/train_00000\.bin is damaged: its sha256"):
        D.verify_prepared(out, full=True)
    code, err = _cli(capsys, "--output-dir", out, "--verify")
    assert code == 2
    _assert_one_clear_error(err, "shards/train_00000.bin", "sha256", "re-run scripts/prepare_data.py")
    code, err = _cli(capsys, "--output-dir", out, "--files", src, "--tokenizer", tokenizer_dir,
                     "--docs-per-shard", 10, "--val-fraction", 0.2, "--num-proc", 1, "--no-overwrite")
    assert code == 2  # --no-overwrite: a damaged shard is reported, not rewritten
    _assert_one_clear_error(err, "shard 0", "sha256", "--no-overwrite")
    assert shard.read_bytes() == bytes(len(good))
    assert _prepare(out, [src], tokenizer_dir) == meta
    assert shard.read_bytes() == good
    assert D.verify_prepared(out, full=True) == meta


def test_other_inputs_rebuild_or_refuse_with_no_overwrite(prepared, tokenizer_dir, capsys):
    out, src, meta = prepared
    _jsonl(src, ROWS[:13])  # same file name, other contents
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = _cli(capsys, "--output-dir", out, "--files", src, "--tokenizer", tokenizer_dir,
                     "--docs-per-shard", 10, "--val-fraction", 0.2, "--num-proc", 1, "--no-overwrite")
    assert code == 2
    _assert_one_clear_error(err, str(out), "other settings", "inputs: other files, or their contents changed",
                            "--no-overwrite")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # left as it was
    messages = []
    new = _prepare(out, [src], tokenizer_dir, log=messages.append)
    assert any("other settings" in m and "rebuilding" in m for m in messages), messages
    assert new["num_docs"] == 13 and D.verify_prepared(out, full=True) == new
    assert not (out / "shards" / "train_00002.bin").exists()  # nothing left from the 24-document folder


def test_more_documents_rewrite_the_last_partial_shard(tmp_path, tokenizer_dir):
    """A shard written for --max-docs 15 holds documents 10-14; --max-docs 24 needs 10-19 in it."""
    src = _jsonl(tmp_path / "a.jsonl", ROWS)
    for streaming in (False, True):
        out = tmp_path / f"grown_{streaming}"
        _prepare(out, [src], tokenizer_dir, max_docs=15, streaming=streaming)
        grown = _prepare(out, [src], tokenizer_dir, max_docs=24, streaming=streaming)
        fresh = _prepare(tmp_path / f"fresh_{streaming}", [src], tokenizer_dir, max_docs=24, streaming=streaming)
        assert grown["num_docs"] == 24
        for split in ("train", "val"):
            a, b = D.TokenShards(out, split), D.TokenShards(tmp_path / f"fresh_{streaming}", split)
            assert np.array_equal(a.read(0, len(a)), b.read(0, len(b))), (streaming, split)
        assert grown == fresh


def _as_previous_version(out):
    """What the version before manifests left: meta.json, settings without a format, no checksums anywhere."""
    (out / "manifest.json").unlink(missing_ok=True)
    settings = json.loads((out / "settings.json").read_text())
    old_keys = ("source", "seed", "val_fraction", "docs_per_shard", "text_column")
    (out / "settings.json").write_text(json.dumps({k: settings[k] for k in old_keys}))
    info = json.loads((out / "tokenizer_info.json").read_text())
    (out / "tokenizer_info.json").write_text(json.dumps({k: info[k] for k in ("name", "description")}))


def test_folder_from_the_previous_version_is_not_trusted(prepared, tokenizer_dir, capsys):
    out, src, meta = prepared
    _as_previous_version(out)
    assert not D.is_prepared(out)
    with pytest.raises(D.DataError, match=r"earlier version of hf_resolvent .*re-run scripts/prepare_data\.py"):
        D.TokenShards(out, "train")
    code, err = _cli(capsys, "--output-dir", out, "--files", src, "--tokenizer", tokenizer_dir,
                     "--docs-per-shard", 10, "--val-fraction", 0.2, "--num-proc", 1, "--no-overwrite")
    assert code == 2
    _assert_one_clear_error(err, "earlier version", "--no-overwrite")
    messages = []
    assert _prepare(out, [src], tokenizer_dir, log=messages.append) == meta
    assert any("earlier version" in m and "rebuilding" in m for m in messages), messages
    assert D.is_prepared(out)


def test_unfinished_preparation_is_not_prepared_and_resumes(tmp_path, tokenizer_dir, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", ROWS)
    out = tmp_path / "data"
    real = prepare._write_shard

    def crash_at_shard_2(out_, shard, *a, **k):
        if shard == 2:
            raise KeyboardInterrupt
        return real(out_, shard, *a, **k)

    monkeypatch.setattr(prepare, "_write_shard", crash_at_shard_2)
    with pytest.raises(KeyboardInterrupt):
        _prepare(out, [src], tokenizer_dir)
    assert not D.is_prepared(out)
    with pytest.raises(D.DataError, match="did not finish"):
        D.TokenShards(out, "train")
    monkeypatch.setattr(prepare, "_write_shard", real)
    messages = []
    meta = _prepare(out, [src], tokenizer_dir, log=messages.append)
    assert meta["num_docs"] == 24 and D.verify_prepared(out, full=True) == meta
    assert not any("rewriting" in m or "rebuilding" in m for m in messages), messages


# ------------------------------------------------------------------------- item 11: bad input files


def _parquet(path, table):
    import pyarrow.parquet as pq

    pq.write_table(table, path)
    return path


def _bad_inputs(tmp):
    """name -> (file, words the error must contain)."""
    import pyarrow as pa

    good = _jsonl(tmp / "good.jsonl", ROWS[:5])
    cut = _parquet(tmp / "whole.parquet", pa.table({"text": ROWS}))
    rng = np.random.default_rng(0)
    cases = {
        "empty_jsonl": (tmp / "empty.jsonl", b"", ["empty.jsonl", "is empty"]),
        "blank_jsonl": (tmp / "blank.jsonl", b"\n\n  \n", ["blank.jsonl", "is empty"]),
        "binary_jsonl": (tmp / "binary.jsonl", rng.bytes(4000), ["binary.jsonl", "not UTF-8 text"]),
        "malformed_jsonl": (tmp / "bad.jsonl", good.read_bytes() + b'{"text": "unterminated\n' + good.read_bytes(),
                            ["bad.jsonl line 6", "not valid JSON"]),
        "missing_column": (tmp / "nocol.jsonl", b'{"text": "a"}\n{"body": "b"}\n',
                           ["nocol.jsonl line 2", "no 'text' field", "--text-column"]),
        "number_text": (tmp / "num.jsonl", b'{"text": "a"}\n{"text": 7}\n', ["num.jsonl line 2", "a number"]),
        "empty_txt": (tmp / "empty.txt", b"", ["empty.txt", "is empty"]),
        "binary_txt": (tmp / "binary.txt", b"\x00\x01PK" + rng.bytes(2000), ["binary.txt", "not UTF-8 text"]),
        "empty_parquet": (tmp / "empty.parquet", b"", ["empty.parquet", "is empty"]),
        "binary_parquet": (tmp / "binary.parquet", rng.bytes(4000), ["binary.parquet", "not a parquet file"]),
        "truncated_parquet": (tmp / "cut.parquet", cut.read_bytes()[: cut.stat().st_size // 2],
                              ["cut.parquet", "not a parquet file"]),
    }
    files = {}
    for name, (path, data, needles) in cases.items():
        path.write_bytes(data)
        files[name] = (path, needles)
    files["parquet_no_column"] = (_parquet(tmp / "body.parquet", pa.table({"body": ROWS})),
                                  ["body.parquet", "no 'text' column", "--text-column"])
    files["parquet_null_text"] = (_parquet(tmp / "null.parquet", pa.table({"text": ["a", None, "c"]})),
                                  ["null.parquet row 1", "null"])
    return files


BAD_INPUTS = ["empty_jsonl", "blank_jsonl", "binary_jsonl", "malformed_jsonl", "missing_column", "number_text",
              "empty_txt", "binary_txt", "empty_parquet", "binary_parquet", "truncated_parquet", "parquet_no_column",
              "parquet_null_text"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_file_gives_one_clear_error(case, tmp_path, capsys):
    path, needles = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    code, err = _cli(capsys, "--output-dir", out, "--files", path, "--tokenizer", "bpe", "--vocab-size", 300,
                     "--num-proc", 1)
    assert code == 2
    _assert_one_clear_error(err, *needles)
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("tokenizer", ["saved", "bpe"])
def test_a_corpus_of_empty_documents_is_refused_by_name(tmp_path, capsys, tokenizer_dir, tokenizer):
    src = _jsonl(tmp_path / "empty_docs.jsonl", [""] * 49)
    out = tmp_path / "out"
    code, err = _cli(capsys, "--output-dir", out, "--files", src, "--tokenizer",
                     tokenizer_dir if tokenizer == "saved" else "bpe", "--vocab-size", 300, "--num-proc", 1)
    assert code == 2
    _assert_one_clear_error(err, "the corpus holds no text: its 49 documents are all empty", "--text-column")
    assert not D.is_prepared(out)


def test_bad_line_found_while_streaming(tmp_path, tokenizer_dir):
    bad = _jsonl(tmp_path / "a.jsonl", ROWS[:12])
    with bad.open("a") as f:
        f.write('{"title": "no text here"}\n')
    out = tmp_path / "out"
    with pytest.raises(D.DataError, match=r"a\.jsonl line 13 has no 'text' field"):
        _prepare(out, [bad], tokenizer_dir, streaming=True)
    assert not D.is_prepared(out)  # the shard written before the bad line does not make a prepared folder


# ------------------------------------------------------------------------- item 12: a mistyped tokenizer path


@pytest.mark.parametrize("name", ["./typo", "../typo-tokenizer", "/no/such/tokenizer", "~/no-such-tokenizer-dir",
                                  "runs/tok/v2", "typo/tokenizer.json"])
def test_missing_local_tokenizer_path_is_not_blamed_on_the_network(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(D.DataError, match="does not exist") as err:
        D.load_or_train_tokenizer(name, ROWS, vocab_size=300, log=lambda *a: None)
    assert repr(name) in str(err.value) and "network" not in str(err.value)


def test_tokenizer_typo_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = _jsonl(tmp_path / "a.jsonl", ROWS)
    code, err = _cli(capsys, "--output-dir", tmp_path / "out", "--files", src, "--tokenizer", "./typo")
    assert code == 2
    _assert_one_clear_error(err, "'./typo' does not exist", str(tmp_path / "typo"))
    assert "network" not in err and not (tmp_path / "out").exists()


def test_existing_folder_that_is_no_tokenizer(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(D.DataError, match="exists but could not be loaded as a tokenizer"):
        D.load_or_train_tokenizer(str(tmp_path / "empty"), ROWS, vocab_size=300, log=lambda *a: None)


# ------------------------------------------------------------------------- item 6: evaluation windows


def test_split_shorter_than_one_window_is_an_error(tmp_path, tokenizer_dir):
    out = tmp_path / "data"
    _prepare(out, [_jsonl(tmp_path / "a.jsonl", ROWS)], tokenizer_dir)
    val = D.TokenShards(out, "val")
    assert 0 < len(val) < 500
    assert D.eval_windows(val, len(val) - 1) == [0]  # exactly one window fits
    with pytest.raises(D.DataError) as err:
        D.eval_windows(val, len(val))
    message = str(err.value)
    for needle in ("val split", f"has {len(val):,} tokens", f"window of {len(val) + 1}", "lower seq_len",
                   "more validation data"):
        assert needle in message, message


# ------------------------------------------------------------------------- item 9: paths of the wrong kind


@pytest.mark.parametrize("below", ["", "sub"])
def test_output_dir_that_is_a_file(tmp_path, capsys, below):
    src = _jsonl(tmp_path / "a.jsonl", ROWS)
    taken = tmp_path / "taken"
    taken.write_text("someone's notes\n")
    out = taken / below if below else taken
    code, err = _cli(capsys, "--output-dir", out, "--files", src, "--tokenizer", "bpe", "--vocab-size", 300)
    assert code == 2
    _assert_one_clear_error(err, f"--output-dir {out}", "not a folder", "move the file away")
    if below:
        assert f"inside {taken}, which is a file" in err
    assert taken.read_text() == "someone's notes\n"  # left as it was
    code, err = _cli(capsys, "--output-dir", taken, "--verify")
    assert code == 2
    _assert_one_clear_error(err, str(taken), "is a file, not a prepared data folder")


def test_files_given_a_folder(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", ROWS)
    _jsonl(folder / "b.jsonl", ROWS)
    out = tmp_path / "out"
    code, err = _cli(capsys, "--output-dir", out, "--files", folder, "--tokenizer", "bpe", "--vocab-size", 300)
    assert code == 2
    _assert_one_clear_error(err, f"--files takes files; got a folder {folder}", f"--files {folder / '*.jsonl'}")
    assert "(none)" not in err and not out.exists()


def test_files_given_a_missing_name_without_suffix(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _cli(capsys, "--output-dir", out, "--files", tmp_path / "corpus", "--tokenizer", "bpe")
    assert code == 2
    _assert_one_clear_error(err, f"--files: {tmp_path / 'corpus'} not found")
    assert "(none)" not in err and not out.exists()


def test_a_folder_of_someone_elses_files_is_never_cleared(tmp_path, capsys):
    """--output-dir naming a folder that holds files called tokenizer/ or shards/ but no record of a preparation
    (settings.json, written first by every preparation) is refused: rebuilding it would remove them."""
    src = _jsonl(tmp_path / "a.jsonl", ROWS)
    mine = tmp_path / "mine"
    (mine / "tokenizer").mkdir(parents=True)
    (mine / "tokenizer" / "vocab.txt").write_text("my vocabulary\n")
    (mine / "notes.txt").write_text("notes\n")
    code, err = _cli(capsys, "--output-dir", mine, "--files", src, "--tokenizer", "bpe", "--vocab-size", 300)
    assert code == 2
    _assert_one_clear_error(err, f"--output-dir {mine} holds tokenizer", "not a folder this tool prepared")
    assert (mine / "tokenizer" / "vocab.txt").read_text() == "my vocabulary\n" and (mine / "notes.txt").exists()
