"""Hugging Face dataset sources: OpenWebText (a loading script, which ``datasets`` 4 and later refuse to run) is read
from its archive files, else from the Hub's parquet conversion; when neither works, one clear error says what to
pass instead. Everything runs offline, against a folder built here like the Hub repository."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from conftest import load_script

from hf_resolvent.training import data as D

prepare_data = load_script("prepare_data")
SCRIPT_REFUSAL = "Dataset scripts are no longer supported, but found openwebtext.py"  # datasets 5's message


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def _raw(i: int) -> str:
    return f"\n  Title {i}\n\n\n\nDocument {i} is about resolvent mixers.\n\n\n\n\nIt ends here, {i * 7}.  \n\n"


def _clean(i: int) -> str:
    """What the repository's script made of ``_raw(i)``: 3+ newlines become a blank line, then strip."""
    return f"Title {i}\n\nDocument {i} is about resolvent mixers.\n\nIt ends here, {i * 7}."


def _tar(members: list[tuple[str, bytes]], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _openwebtext_repo(root):
    """A folder laid out like Skylion007/openwebtext: the loading script, and subsets/urlsf_subsetNN.tar archives
    of openwebtext/*.xz files, each an xz-compressed tar of .txt documents. Returns the documents in the order the
    script yields them (archive order, then member order: not sorted by name)."""
    (root / "subsets").mkdir(parents=True)
    (root / "openwebtext.py").write_text("import datasets  # the loading script datasets >= 4 refuses\n")
    (root / "README.md").write_text("---\npretty_name: OpenWebText\n---\n")
    order, i = [], 0
    for archive in range(2):
        xz_files = []
        for part in range(2):
            docs = []
            for name in ("0999-b.txt", "0001-a.txt", "0500-c.txt"):
                docs.append((f"{archive}{part}-{name}", _raw(i).encode()))
                order.append(_clean(i))
                i += 1
            docs.append(("._0999-b.txt", b"\x00\x05 macOS metadata, skipped"))  # hidden: skipped like datasets did
            xz_files.append((f"openwebtext/urlsf_subset{archive:02d}-{part}_data.xz", _tar(docs, "w:xz")))
        (root / "subsets" / f"urlsf_subset{archive:02d}.tar").write_bytes(_tar(xz_files, "w"))
    return order


def _documents(out) -> list[str]:
    """The documents of a prepared folder's train split, decoded with its tokenizer."""
    from transformers import AutoTokenizer

    meta = json.loads((out / "meta.json").read_text())
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    ids = D.TokenShards(out, "train").read(0, meta["train_tokens"])
    ends = np.flatnonzero(ids == meta["eot_id"])
    return [tok.decode(ids[a + 1 if k else 0:b].tolist()) for k, (a, b) in enumerate(zip([-1, *ends], ends))]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A saved byte-level BPE (a streamed source has no corpus to train one on before its shards)."""
    path = tmp_path_factory.mktemp("tok") / "bpe"
    D.train_bpe_tokenizer([_clean(i) for i in range(12)], vocab_size=300).save_pretrained(path)
    return path


def _prepare(out, source, tokenizer, **kw):
    kw = {"val_fraction": 0.0, "num_proc": 1, "log": lambda *a: None, **kw}
    return D.prepare_dataset(out, source=str(source), tokenizer=str(tokenizer), **kw)


@pytest.mark.parametrize("streaming", [False, True])
def test_local_copy_of_the_openwebtext_repository(tmp_path, tokenizer_dir, streaming):
    """``hf download Skylion007/openwebtext --repo-type dataset --local-dir DIR`` then ``--source DIR``."""
    repo = tmp_path / "openwebtext"
    expected = _openwebtext_repo(repo)
    meta = _prepare(tmp_path / "out", repo, tokenizer_dir, streaming=streaming, docs_per_shard=5)
    assert meta["num_docs"] == 12 and "archives" in meta["data"]
    assert _documents(tmp_path / "out") == expected


def test_hub_openwebtext_is_read_from_its_archives(tmp_path, tokenizer_dir, monkeypatch):
    """On the Hub, load_dataset refuses the script; the archives are then downloaded and read."""
    import datasets
    import huggingface_hub

    repo = tmp_path / "hub" / "openwebtext"
    expected = _openwebtext_repo(repo)
    calls = []

    def load_dataset(path, *args, revision=None, **kwargs):
        calls.append((path, revision))
        raise RuntimeError(SCRIPT_REFUSAL)  # what datasets 5 does with a script repository on the Hub

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(repo)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    meta = _prepare(tmp_path / "out", D.OPENWEBTEXT, tokenizer_dir, max_docs=10)
    assert calls[0] == (D.OPENWEBTEXT, None)  # the plain call is tried first (it works for other datasets)
    assert calls[1][0] == D.OPENWEBTEXT and calls[1][1]["repo_type"] == "dataset"
    assert calls[1][1]["allow_patterns"] == ["subsets/*.tar"]  # only the archives: not the script, not the rest
    assert meta["num_docs"] == 10 and "archives" in meta["data"] and D.OPENWEBTEXT in meta["data"]
    assert _documents(tmp_path / "out") == expected[:10]


def test_script_dataset_without_archives_uses_the_parquet_conversion(tmp_path, tokenizer_dir, monkeypatch):
    import datasets
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_clean(i) for i in range(7)]
    converted = tmp_path / "convert" / "plain_text" / "train"
    converted.mkdir(parents=True)
    pq.write_table(pa.table({"text": rows}), converted / "0000.parquet")
    real_load = datasets.load_dataset
    revisions = []

    def load_dataset(path, *args, revision=None, **kwargs):
        revisions.append(revision)
        if revision == "refs/convert/parquet":
            return real_load("parquet", data_files=[str(converted / "0000.parquet")], split="train")
        raise RuntimeError(SCRIPT_REFUSAL)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path / "empty"))
    meta = _prepare(tmp_path / "out", "someone/script-dataset", tokenizer_dir)
    assert revisions == [None, "refs/convert/parquet"]
    assert "parquet conversion" in meta["data"] and meta["num_docs"] == 7
    assert _documents(tmp_path / "out") == rows


def test_script_dataset_that_cannot_be_read_names_the_fix(tmp_path, monkeypatch, capsys):
    import datasets
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def load_dataset(path, *args, revision=None, **kwargs):
        if revision:
            raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")
        raise RuntimeError(SCRIPT_REFUSAL)

    def snapshot_download(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot reach the Hub and nothing is in the local cache")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    out = tmp_path / "out"
    code = prepare_data.main(["--source", D.OPENWEBTEXT, "--output-dir", str(out), "--tokenizer", "bpe"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in ("is a loading script", "subsets/*.tar", "LocalEntryNotFoundError", "refs/convert/parquet",
                   "ConnectionError", f"hf download {D.OPENWEBTEXT} --repo-type dataset", "--source DIR", "--files"):
        assert needle in lines[0], lines[0]
    assert not out.exists()  # nothing written that a later run could take for prepared data


def test_local_script_folder_without_archives_says_what_to_pass(tmp_path, capsys):
    repo = tmp_path / "mydata"
    repo.mkdir()
    (repo / "mydata.py").write_text("import datasets\n")  # a loading script, as datasets finds it in a folder
    out = tmp_path / "out"
    code = prepare_data.main(["--source", str(repo), "--output-dir", str(out), "--tokenizer", "bpe"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "is a loading script" in err and "--files" in err and "no subsets/*.tar archives" in err
    assert not out.exists()


# ------------------------------------------------------------------------------------------- damaged archives


def _one_archive_repo(root, xz_members) -> None:
    """A repository folder with one archive subsets/urlsf_subset00.tar of the given (name, bytes) .xz members."""
    (root / "subsets").mkdir(parents=True)
    (root / "openwebtext.py").write_text("import datasets\n")
    (root / "subsets" / "urlsf_subset00.tar").write_bytes(_tar(xz_members, "w"))


def _good_xz(first: int, name: str = "openwebtext/good.xz"):
    return name, _tar([(f"{first + k}.txt", _raw(first + k).encode()) for k in range(3)], "w:xz")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("damage", ["a corrupted .xz member", "a document that is not UTF-8"])
def test_a_few_bad_documents_are_skipped_and_named(tmp_path, tokenizer_dir, capfd, streaming, damage):
    bad = (("openwebtext/bad.xz", b"\xfd7zXZ\x00" + b"\x13" * 400) if damage == "a corrupted .xz member" else
           ("openwebtext/bad.xz", _tar([("x.txt", b"caf\xe9 au lait"), ("y.txt", b"fine")], "w:xz")))
    repo = tmp_path / "repo"
    _one_archive_repo(repo, [_good_xz(0), bad, _good_xz(3, "openwebtext/good2.xz")])
    meta = _prepare(tmp_path / "out", repo, tokenizer_dir, streaming=streaming)
    kept = [_clean(i) for i in range(6)] + (["fine"] if damage != "a corrupted .xz member" else [])
    assert sorted(_documents(tmp_path / "out")) == sorted(kept) and meta["num_docs"] == len(kept)
    err = capfd.readouterr().err
    named = "openwebtext/bad.xz (the rest of it)" if damage == "a corrupted .xz member" else "openwebtext/bad.xz/x.txt"
    assert f"[prepare] skipped {named} in " in err and "urlsf_subset00.tar" in err, err


@pytest.mark.parametrize("damage", ["cut inside a member", "a 0-byte archive", "an archive with no members"])
def test_an_archive_that_cannot_be_read_stops_with_its_name(tmp_path, tokenizer_dir, damage):
    repo = tmp_path / "repo"
    _one_archive_repo(repo, [_good_xz(0), _good_xz(3, "openwebtext/good2.xz")])
    archive = repo / "subsets" / "urlsf_subset00.tar"
    if damage == "cut inside a member":
        archive.write_bytes(archive.read_bytes()[:900])
    elif damage == "a 0-byte archive":
        archive.write_bytes(b"")
    else:
        archive.write_bytes(_tar([], "w"))
    with pytest.raises(D.DataError) as err:
        _prepare(tmp_path / "out", repo, tokenizer_dir)
    said = "hold no documents" if damage == "an archive with no members" else "cannot be read"
    assert said in str(err.value) and "urlsf_subset00.tar" in str(err.value), str(err.value)
    assert not (tmp_path / "out" / "manifest.json").exists()
