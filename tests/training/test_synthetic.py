"""Synthetic task generators (copy, associative recall, multi-hop recall, MQAR): labels checked against an
independent solver, structure, randomisation, curriculum; the training script's metric, loss, summary and smoke
runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import load_script

import synthetic_tasks as S
from long_context import token_carry_batch

V = S.Vocab(n_noise=4, n_keys=16, n_values=16)
SPECS = [S.TaskSpec("copy", 12, vocab=V), S.TaskSpec("assoc", 30, 8, vocab=V), S.TaskSpec("multihop", 30, 8, vocab=V),
         S.TaskSpec("mqar", 30, 8, vocab=V, min_pairs=2)]


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


# ---------------------------------------------------------------------------------------------------- MQAR

MQAR = SPECS[3]


def _mqar_parts(ids, labels):
    """(keys, values, query positions) of one MQAR sample, read from its layout."""
    m = int((labels != S.IGNORE).sum())
    return ids[0:2 * m:2], ids[1:2 * m:2], np.where(labels != S.IGNORE)[0]


def test_mqar_keys_and_values_from_disjoint_halves_answers_correct():
    rng = np.random.default_rng(4)
    counts, first_query = set(), set()
    for _ in range(300):
        b = S.make_batch(MQAR, 1, rng)
        ids, labels = b.input_ids[0].numpy(), b.labels[0].numpy()
        assert len(ids) == MQAR.max_len  # every sample has the full length, no padding
        keys, values, asked = _mqar_parts(ids, labels)
        m = len(keys)
        counts.add(m)
        # keys from the lower half, values from the upper half of the key/value tokens, none repeated
        assert V.is_key(keys).all() and V.is_value(values).all() and V.n_keys == V.n_values
        assert len(set(keys.tolist())) == m and len(set(values.tolist())) == m
        # after the pairs: every key exactly once, the rest fillers (no value, no other key)
        rest = ids[2 * m:]
        assert sorted(rest[V.is_key(rest)].tolist()) == sorted(keys.tolist())
        assert not V.is_value(rest).any()
        assert ((rest >= V.noise0) & (rest < V.key0) | V.is_key(rest)).all()
        # the label at each query is its key's value, and only queries are labelled
        value_of = dict(zip(keys.tolist(), values.tolist()))
        assert (asked >= 2 * m).all() and set(asked.tolist()) == set((2 * m + np.where(V.is_key(rest))[0]).tolist())
        assert [labels[t] for t in asked] == [value_of[int(ids[t])] for t in asked]
        assert np.array_equal(b.query_mask[0].numpy(), labels != S.IGNORE)
        assert (b.hops[0].numpy()[asked] == 0).all()
        first_query.add(int(asked[0]) - 2 * m)
    assert counts == set(range(2, 9))  # pairs drawn from [min_pairs, max_pairs], all reached
    assert len(first_query) > 5  # queries at random positions


def test_mqar_fixed_pair_count_by_default_and_with_pairs():
    spec = S.TaskSpec("mqar", 64, 8, vocab=V)
    assert spec.pair_range == (8, 8)
    rng = np.random.default_rng(5)
    assert ((S.make_batch(spec, 32, rng).labels != S.IGNORE).sum(dim=1) == 8).all()
    assert ((S.make_batch(MQAR.with_pairs(3), 32, rng).labels != S.IGNORE).sum(dim=1) == 3).all()
    # queries come in random order: 8 keys asked in the context's order has probability 1 / 8!
    b = S.make_batch(spec, 200, rng)
    in_order = sum([int(ids[t]) for t in np.where(lab != S.IGNORE)[0]] == ids[0:16:2].tolist()
                   for ids, lab in zip(b.input_ids.numpy(), b.labels.numpy()))
    assert in_order <= 1


def test_mqar_is_deterministic_with_a_seed():
    a = S.make_batch(MQAR, 16, np.random.default_rng(7))
    b = S.make_batch(MQAR, 16, np.random.default_rng(7))
    c = S.make_batch(MQAR, 16, np.random.default_rng(8))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids, c.input_ids)


class _Fixed(torch.nn.Module):
    """Returns the given logits whatever the input."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.logits})()


def test_mqar_loss_is_on_the_answers_only():
    batch = S.make_batch(MQAR, 8, np.random.default_rng(9))
    labelled = batch.labels != S.IGNORE
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch.labels.shape, V.size, generator=gen)
    right = logits.clone()
    right[labelled] = 0.0
    right[labelled.nonzero(as_tuple=True) + (batch.labels[labelled],)] = 50.0  # certain of every answer
    assert S.task_loss(_Fixed(right), batch, "cpu").item() < 1e-6
    # changing what is predicted anywhere else leaves the loss as it is
    other = right.clone()
    other[~labelled] = torch.randn(int((~labelled).sum()), V.size, generator=gen) * 10
    assert S.task_loss(_Fixed(other), batch, "cpu").item() == pytest.approx(S.task_loss(_Fixed(right), batch, "cpu").item())
    # an answer left uniform costs log(vocab), averaged over the answers only
    wrong = right.clone()
    b, t = labelled.nonzero()[0].tolist()
    wrong[b, t] = 0.0
    expected = math.log(V.size) / int(labelled.sum())
    assert S.task_loss(_Fixed(wrong), batch, "cpu").item() == pytest.approx(expected, rel=1e-4)


def test_mqar_spec_errors_name_the_fix():
    with pytest.raises(ValueError, match="n_keys must equal n_values"):
        S.TaskSpec("mqar", 64, 8, vocab=S.Vocab(4, 16, 32))
    with pytest.raises(ValueError, match="3 \\* max_pairs"):
        S.TaskSpec("mqar", 20, 8, vocab=V)
    with pytest.raises(ValueError, match="n_noise"):
        S.TaskSpec("mqar", 64, 8, vocab=S.Vocab(0, 16, 16))
    with pytest.raises(ValueError, match="n_keys"):
        S.TaskSpec("mqar", 100, 20, vocab=V)
    with pytest.raises(ValueError, match="min_pairs"):
        S.TaskSpec("mqar", 64, 8, vocab=V, min_pairs=9)


def test_recall_min_pairs_widens_the_pair_range():
    rng = np.random.default_rng(10)
    spec = S.TaskSpec("multihop", 64, 12, vocab=S.Vocab(4, 32, 32), min_pairs=1)
    counts = {len(_pairs(S.make_batch(spec, 1, rng).input_ids[0].numpy(), spec)[0]) for _ in range(300)}
    assert counts == set(range(1, 13))
    assert S.TaskSpec("assoc", 30, 8, vocab=V).pair_range == (4, 8)  # the default: half to full


def test_long_and_mqar_presets_resolve():
    mod = load_script("synthetic")
    long = mod.task_spec("multihop", mod.resolve_preset("multihop", "cpu-long"))
    assert long.max_len >= 64 and long.max_pairs > 4 and long.pair_range[0] == 1
    for preset in ("cpu", "cpu-long", "paper"):
        cfg = mod.resolve_preset("mqar", preset)
        spec = mod.task_spec("mqar", cfg)
        assert spec.vocab.size <= 8192 and 32 <= spec.max_len <= 256 and 4 <= spec.max_pairs <= 64
        assert max(cfg["eval_pairs"]) == spec.max_pairs
    assert mod.resolve_preset("mqar", "cpu")["layers"] == 2 and 64 <= mod.resolve_preset("mqar", "cpu")["d"] <= 128
    assert mod.resolve_preset("mqar", "paper")["steps"] == 20_000


def test_mqar_script_smoke_and_summary(tmp_path, capsys):
    mod = load_script("synthetic")
    results = []
    for mixer, conv in (("attention", "0"), ("dense", "0"), ("dense", "4")):
        out = tmp_path / f"mqar_{mixer}_{conv}.json"
        assert mod.main(["--task", "mqar", "--mixer", mixer, "--preset", "smoke", "--quiet", "--out", str(out),
                         "--conv-size", conv]) == 0
        res = json.loads(out.read_text())
        assert res["conv_size"] == int(conv)
        assert res["task"] == "mqar" and set(res["by_pairs"]) == {"1", "4"}
        assert all(0.0 <= v <= 1.0 for v in res["by_pairs"].values()) and res["spec"]["min_pairs"] == 1
        results.append(str(out))
    summary = tmp_path / "sum" / "mqar.json"
    assert mod.main(["--summary", *results, "--out", str(summary)]) == 0
    rows = json.loads(summary.read_text())["rows"]
    assert [r["mixer"] for r in rows] == ["attention", "dense", "dense"] and "history" not in rows[0]
    table = summary.with_suffix(".md").read_text()
    assert "| attention |" in table and "| dense |" in table and "up to 4 pairs in 16 tokens, 8 steps" in table
    assert "| dense [conv 4] |" in table
    assert summary.with_suffix(".png").stat().st_size > 1000
    capsys.readouterr()
    (tmp_path / "bad.json").write_text("{}")
    assert mod.main(["--summary", str(tmp_path / "bad.json")]) == 2
    assert "not a result of this script" in capsys.readouterr().err
    assert mod.main(["--preset", "smoke"]) == 2
    assert "--task and --mixer" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- recall at a distance


def _bag_of_tokens_accuracy(draw, vocab: S.Vocab, steps: int = 300) -> float:
    """A model that ignores order, trained on ``draw(rng, n)``: an MLP on the counts of the tokens before the query
    and on the query token. Its accuracy on 2,000 fresh samples."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    size = vocab.size
    net = torch.nn.Sequential(torch.nn.Linear(2 * size, 256), torch.nn.ReLU(), torch.nn.Linear(256, size))
    opt = torch.optim.Adam(net.parameters(), 3e-3)

    def features(batch):
        ids = batch.input_ids
        return torch.cat([F.one_hot(ids[:, :-1], size).sum(1).float(), F.one_hot(ids[:, -1], size).float()], 1)

    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = draw(rng, 64)
        loss = F.cross_entropy(net(features(batch)), batch.labels[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    batch = draw(np.random.default_rng(1), 2000)
    with torch.no_grad():
        return float((net(features(batch)).argmax(-1) == batch.labels[:, -1]).float().mean())


def test_recall_with_decoys_needs_the_key_and_the_plain_passkey_does_not():
    """A bag of tokens answers the plain passkey (one pair: its value is the sample's only value token, as in the long
    context study's token carry) but not the passkey with decoys, where only the key says which of the values
    present is asked."""
    vocab = S.Vocab(8, 16, 16)
    plain = _bag_of_tokens_accuracy(lambda rng, n: S.passkey_batch(vocab, 32, 1, n, rng), vocab)
    carry = _bag_of_tokens_accuracy(lambda rng, n: token_carry_batch(vocab, (20, 20), 0, n, rng), vocab)
    decoys = _bag_of_tokens_accuracy(lambda rng, n: S.passkey_batch(vocab, 32, 4, n, rng), vocab)
    assert plain > 0.95 and carry > 0.95
    assert decoys < 0.4  # chance over the values present: 1/4, a little more where two pairs share a value


def _first_value_accuracy(batch, vocab: S.Vocab) -> float:
    """A rule that never reads the key: answer the first value token of the sample."""
    ids = batch.input_ids.numpy()
    first = [row[np.flatnonzero(vocab.is_value(row))[0]] for row in ids]
    return float(np.mean(np.array(first) == batch.labels.numpy()[:, -1]))


def test_the_far_layout_is_for_reading_only_a_model_trained_on_it_need_not_read_the_key():
    """Read one query far back (the asked pair first, every decoy after it), the first value of the sample is the
    answer, so a model trained on that layout can score at T without reading the key, and lose it with distance as
    the first value moves away. Training samples put the asked pair anywhere, where the same rule scores chance
    over the values present."""
    vocab, rng = S.Vocab(8, 16, 16), np.random.default_rng(3)
    assert _first_value_accuracy(S.passkey_batch(vocab, 64, 8, 500, rng, far=True), vocab) == 1.0
    assert _first_value_accuracy(S.passkey_batch(vocab, 64, 8, 2000, rng), vocab) < 0.2  # 1/8, values repeat


def test_passkey_samples_hold_distinct_keys_and_the_asked_pair_far_back():
    vocab = S.Vocab(8, 16, 16)
    batch = S.passkey_batch(vocab, 64, 4, 200, np.random.default_rng(0), far=True)
    ids, labels = batch.input_ids.numpy(), batch.labels.numpy()
    assert ids.shape == (200, 64) and (ids[:, 0] == S.BOS).all() and batch.query_mask[:, -1].all()
    assert (labels[:, :-1] == S.IGNORE).all()
    for row, answer in zip(ids, labels[:, -1]):
        keys = np.flatnonzero(vocab.is_key(row[:-1]))
        assert len(keys) == 4 and len(set(row[keys])) == 4 and vocab.is_value(row[keys + 1]).all()
        (asked,) = keys[row[keys] == row[-1]]
        assert row[asked + 1] == answer and asked + 1 < 16  # in the first quarter
        assert (keys[keys != asked] >= 16).all()  # every decoy after it
    with pytest.raises(ValueError, match="cannot hold BOS, 8 pairs and 1 query"):
        S.passkey_batch(vocab, 16, 8, 1, np.random.default_rng(0))
    # training samples may end in several queries: distinct keys of the sample's pairs, each labelled
    batch = S.passkey_batch(vocab, 32, 4, 50, np.random.default_rng(1), queries=3)
    for row, label in zip(batch.input_ids.numpy(), batch.labels.numpy()):
        pairs = {int(row[t]): int(row[t + 1]) for t in np.flatnonzero(vocab.is_key(row[:-3]))}
        assert len(set(row[-3:])) == 3 and [pairs[int(k)] for k in row[-3:]] == list(label[-3:])
        assert (label[:-3] == S.IGNORE).all()
    with pytest.raises(ValueError, match="queries must be in"):
        S.passkey_batch(vocab, 32, 4, 1, np.random.default_rng(0), queries=5)


def test_mqar_at_a_distance_asks_every_pair_and_holds_them_all_far_back():
    vocab = S.Vocab(8, 16, 16)
    batch = S.passkey_batch(vocab, 64, 4, 100, np.random.default_rng(2), far=True, queries=4)
    for row, label in zip(batch.input_ids.numpy(), batch.labels.numpy()):
        keys = np.flatnonzero(vocab.is_key(row[:-4]))
        assert len(keys) == 4 and (keys + 1 < 16).all()  # every pair in the first quarter
        pairs = {int(row[t]): int(row[t + 1]) for t in keys}
        assert sorted(row[-4:]) == sorted(pairs) and [pairs[int(k)] for k in row[-4:]] == list(label[-4:])
    with pytest.raises(ValueError, match="the asked pairs in the first quarter"):
        S.passkey_batch(vocab, 32, 4, 1, np.random.default_rng(0), far=True, queries=4)  # a quarter of 8 tokens


def test_mqar_at_a_distance_needs_the_keys():
    """A bag of tokens, which sees every pair but not which key each value follows, answers at chance over the
    values present."""
    vocab = S.Vocab(8, 16, 16)
    bag = _bag_of_tokens_accuracy(lambda rng, n: S.passkey_batch(vocab, 64, 4, n, rng, far=True, queries=4), vocab)
    assert bag < 0.4
