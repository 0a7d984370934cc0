"""Synthetic task generators (copy, associative recall, multi-hop recall): labels checked against an independent
solver, structure, randomisation, curriculum; the training script's metric and a smoke run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import load_script

from hf_resolvent.experiments import synthetic as S

V = S.Vocab(n_noise=4, n_keys=16, n_values=16)
SPECS = [S.TaskSpec("copy", 12, vocab=V), S.TaskSpec("assoc", 30, 8, vocab=V), S.TaskSpec("multihop", 30, 8, vocab=V)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.task)
def test_labels_match_an_independent_solver(spec):
    rng = np.random.default_rng(0)
    for phase in (spec.phase(d) for d in S.CURRICULUM):
        batch = S.make_batch(phase, 64, rng)
        assert batch.input_ids.shape == batch.labels.shape == batch.hops.shape
        assert batch.input_ids.shape[1] <= phase.total_length()
        for ids, labels in zip(batch.input_ids.numpy(), batch.labels.numpy()):
            assert np.array_equal(S.solve_reference(ids, phase), labels)
        # padding is never labelled; answers are value tokens
        assert not ((batch.input_ids == S.PAD) & (batch.labels != S.IGNORE)).any()
        lab = batch.labels[batch.labels != S.IGNORE].numpy()
        assert V.is_value(lab).all()
        assert ((batch.hops >= 0) == (batch.labels != S.IGNORE)).all()


def test_copy_structure_and_lengths():
    spec = SPECS[0]
    rng = np.random.default_rng(1)
    lengths = []
    for _ in range(200):
        b = S.make_batch(spec, 1, rng)
        ids = b.input_ids[0].numpy()
        n = (len(ids) - 2) // 2
        lengths.append(n)
        assert ids[0] == S.BOS and ids[n + 1] == S.SEP
        assert np.array_equal(ids[1:n + 1], ids[n + 2:])
        assert int(b.query_mask.sum()) == n  # every copied token is an answer
    assert min(lengths) == 6 and max(lengths) == 12  # lengths in [L/2, L], all reached


def _pairs(ids, spec):
    """(key, slot) pairs of a recall sample's context, in order."""
    real = ids[ids != S.PAD]
    sep = int(np.where(real == S.SEP)[0][0])
    pairs, seen, t = [], set(), 0
    while t < sep:
        tok = int(real[t])
        if spec.vocab.is_key(np.array(tok)) and tok not in seen:
            pairs.append((tok, int(real[t + 1])))
            seen.add(tok)
            t += 2
        else:
            t += 1
    return pairs, real, sep


def test_assoc_keys_distinct_each_queried_once_positions_random():
    spec = SPECS[1]
    rng = np.random.default_rng(2)
    first_key_pos = []
    for _ in range(200):
        b = S.make_batch(spec, 1, rng)
        ids = b.input_ids[0].numpy()
        pairs, real, sep = _pairs(ids, spec)
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == len(keys) and 4 <= len(keys) <= 8
        assert all(V.is_value(np.array(s)) for _, s in pairs)  # no replacement in plain recall
        queries = [int(t) for t in real[sep + 1:] if V.is_key(np.array(t))]
        assert sorted(queries) == sorted(keys)
        assert int(b.query_mask.sum()) == len(keys)
        first_key_pos.append(int(np.argmax(V.is_key(real))))
    assert len(set(first_key_pos)) > 3  # pairs do not always start at the same place


def test_multihop_replacements_chains_and_intermediate_labels():
    spec = SPECS[2]
    rng = np.random.default_rng(3)
    replaced = eligible = 0
    max_hops = 0
    for _ in range(300):
        b = S.make_batch(spec, 1, rng)
        ids, labels, hops = (t[0].numpy() for t in (b.input_ids, b.labels, b.hops))
        pairs, real, sep = _pairs(ids, spec)
        keys = [k for k, _ in pairs]
        for j, (_, slot) in enumerate(pairs):
            if V.is_key(np.array(slot)):
                assert slot in keys[:j]  # replaced by a *preceding* key
        eligible += len(pairs) - 1
        replaced += sum(V.is_key(np.array(s)) for _, s in pairs)
        inter = (labels != S.IGNORE) & ~b.query_mask[0].numpy()
        assert inter.sum() == sum(V.is_key(np.array(s)) for _, s in pairs)
        assert (inter[:sep]).sum() == inter.sum()  # intermediate labels sit in the context
        max_hops = max(max_hops, int(hops.max()))
    assert abs(replaced / eligible - 0.5) < 0.05  # p = 0.5
    assert max_hops >= 3  # chains of several lookups occur


def test_curriculum_phases_and_spec_errors():
    assert [S.curriculum_divisor(s, 100) for s in (0, 24, 25, 49, 50, 74, 75, 99)] == [8, 8, 4, 4, 2, 2, 1, 1]
    full = S.TaskSpec("assoc", 256, 64)
    assert (full.phase(8).max_len, full.phase(8).max_pairs) == (32, 8)
    assert (full.phase(1).max_len, full.phase(1).max_pairs) == (256, 64)
    assert S.TaskSpec("copy", 128).phase(8).max_len == 16 and S.TaskSpec("copy", 128).total_length() == 258
    with pytest.raises(ValueError, match="3 \\* max_pairs"):
        S.TaskSpec("assoc", 20, 8)
    with pytest.raises(ValueError, match="task must be"):
        S.TaskSpec("sort", 20)
    with pytest.raises(ValueError, match="n_keys"):
        S.TaskSpec("assoc", 100, 20, vocab=S.Vocab(4, 8, 8))


class _Oracle(torch.nn.Module):
    """Outputs the reference answer at every labelled position (and token 0 elsewhere)."""

    def __init__(self, spec, flip_every: int = 0):
        super().__init__()
        self.spec, self.flip_every = spec, flip_every

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.spec.vocab.size)
        for b, ids in enumerate(input_ids.numpy()):
            ans = S.solve_reference(ids, self.spec)
            for t in np.where(ans != S.IGNORE)[0]:
                wrong = self.flip_every and b % self.flip_every == 0
                logits[b, t, ans[t] - 1 if wrong else ans[t]] = 1.0
        return type("Out", (), {"logits": logits})()


def test_accuracy_metric():
    mod = load_script("synthetic")
    spec = SPECS[2]
    res = mod.evaluate(_Oracle(spec), spec, 32, seed=0, device="cpu", batch_size=8)
    assert res["accuracy"] == 1.0 and res["sequence_accuracy"] == 1.0 and res["intermediate_accuracy"] == 1.0
    assert sum(v["answers"] for v in res["by_hops"].values()) == res["answers"]
    half = mod.evaluate(_Oracle(spec, flip_every=2), spec, 32, seed=0, device="cpu", batch_size=8)
    assert half["sequence_accuracy"] == 0.5 and 0.3 < half["accuracy"] < 0.7


@pytest.mark.parametrize("mixer", ["dense", "gpt2"])
def test_script_smoke(mixer, tmp_path):
    mod = load_script("synthetic")
    out = tmp_path / "r.json"
    assert mod.main(["--task", "multihop", "--mixer", mixer, "--preset", "smoke", "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["task"] == "multihop" and res["mixer"] == mixer and res["steps"] == 8
    assert 0.0 <= res["accuracy"] <= 1.0 and res["answers"] > 0 and np.isfinite(res["final_loss"])
    assert mod.main(["--task", "assoc", "--mixer", "dense", "--preset", "smoke", "--batch-size", "5",
                     "--micro-batch", "2", "--quiet"]) == 2


def test_script_curriculum_option(tmp_path, capsys):
    mod = load_script("synthetic")
    out = tmp_path / "r.json"
    assert mod.main(["--task", "assoc", "--mixer", "attention", "--preset", "smoke", "--curriculum", "2,1",
                     "--quiet", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["curriculum"] == [2, 1]
    assert mod.main(["--task", "assoc", "--mixer", "attention", "--preset", "smoke", "--curriculum", "8,0",
                     "--quiet"]) == 2
    assert "--curriculum" in capsys.readouterr().err
