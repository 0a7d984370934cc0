"""Synthetic tasks of the papers' section 5.2 / appendix C.1, generated on the fly: copy, associative recall,
multi-hop recall; with the 4-phase curriculum (lengths and pair counts divided by 8, 4, 2, 1). Also multi-query
associative recall (MQAR) of the Zoology benchmark.

Every generator returns a :class:`Batch`: ``input_ids`` (B, T) int64 right-padded with ``PAD``, ``labels``
(B, T) with ``-100`` where nothing is predicted, and ``hops`` (B, T) (the lookup depth of each labelled
position, -1 elsewhere). ``labels[b, t]`` is what the model must output *at* position t (its prediction from
tokens 0..t); no shift is applied.

Vocabulary (:class:`Vocab`): ``PAD`` 0, ``BOS`` 1 (start marker), ``SEP`` 2 (end of the input / start of the
queries), then ``n_noise`` filler tokens, ``n_keys`` key tokens and ``n_values`` value tokens.

- **copy** (Arrow et al. 2016, Jelassi et al. 2024): ``BOS x_1 .. x_l SEP x_1 .. x_l`` with x drawn from the
  value tokens; labels ``x_1`` at ``SEP`` and ``x_{i+1}`` at the i-th copied token; l random up to L.
- **assoc** (associative recall, after Arora et al. 2024): m key-value pairs (key immediately followed by its
  value) at random positions among filler tokens, ``SEP``, then every key once as a query, in random order at
  random positions among filler tokens. The label at a query is the key's value. Keys are distinct in a sequence;
  values are drawn with replacement.
- **multihop**: as assoc, but the value of each pair after the first is replaced, with probability p = 0.5, by
  the key of a uniformly chosen *preceding* pair. A key's answer is resolved recursively (follow the chain to a
  value token). Intermediate labels: at every position where a key stands in a value slot, the label is that
  key's resolved value (the papers "add labels to the intermediary keys"). ``hops`` counts the replacements
  followed (0 = a plain recall).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

PAD, BOS, SEP = 0, 1, 2
IGNORE = -100
TASKS = ("copy", "assoc", "multihop", "mqar")


@dataclass(frozen=True)
class Vocab:
    n_noise: int = 16
    n_keys: int = 128
    n_values: int = 128

    @property
    def noise0(self) -> int:
        return 3

    @property
    def key0(self) -> int:
        return 3 + self.n_noise

    @property
    def value0(self) -> int:
        return 3 + self.n_noise + self.n_keys

    @property
    def size(self) -> int:
        return 3 + self.n_noise + self.n_keys + self.n_values

    def is_key(self, t: np.ndarray) -> np.ndarray:
        return (t >= self.key0) & (t < self.value0)

    def is_value(self, t: np.ndarray) -> np.ndarray:
        return (t >= self.value0) & (t < self.size)


@dataclass(frozen=True)
class TaskSpec:
    """Full-size (phase 4) parameters of a task.

    copy: ``max_len`` = L, the longest copied sequence (total length 2L + 2).
    assoc / multihop: ``max_len`` = longest sequence, ``max_pairs`` = most key-value pairs (needs
    ``max_len >= 3 * max_pairs + 1``: pairs, SEP and one query per key); ``p_hop`` the replacement probability.
    mqar: ``max_len`` = the length of every sample, ``max_pairs`` = most pairs (needs ``max_len >= 3 * max_pairs``:
    pairs and one query per key).
    ``min_pairs``: fewest pairs of a sample; 0 = the task's default (half of ``max_pairs`` rounded up for
    assoc / multihop, ``max_pairs`` for mqar).
    """

    task: str
    max_len: int
    max_pairs: int = 0
    p_hop: float = 0.5
    vocab: Vocab = Vocab()
    min_pairs: int = 0

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.task == "mqar":
            self._check_mqar()
        elif self.task != "copy":
            if self.max_pairs < 1:
                raise ValueError(f"{self.task}: max_pairs must be >= 1, got {self.max_pairs}")
            if self.max_len < 3 * self.max_pairs + 1:
                raise ValueError(f"{self.task}: max_len={self.max_len} < 3 * max_pairs + 1 = {3 * self.max_pairs + 1} "
                                 "(each pair takes 2 tokens and its query 1, plus SEP); raise max_len or lower max_pairs")
            if self.max_pairs > self.vocab.n_keys:
                raise ValueError(f"max_pairs={self.max_pairs} needs at least as many key tokens (n_keys={self.vocab.n_keys})")
        if not 0.0 <= self.p_hop <= 1.0:
            raise ValueError(f"p_hop must be in [0, 1], got {self.p_hop}")
        if not 0 <= self.min_pairs <= max(self.max_pairs, 0):
            raise ValueError(f"{self.task}: min_pairs must be in [0, max_pairs={self.max_pairs}], got {self.min_pairs}")

    def _check_mqar(self) -> None:
        v = self.vocab
        if self.max_pairs < 1:
            raise ValueError(f"mqar: max_pairs must be >= 1, got {self.max_pairs}")
        if self.max_len < 3 * self.max_pairs:
            raise ValueError(f"mqar: max_len={self.max_len} < 3 * max_pairs = {3 * self.max_pairs} (each pair takes 2 "
                             "tokens and its query 1); raise max_len or lower max_pairs")
        if v.n_keys != v.n_values:
            raise ValueError(f"mqar: keys and values are the two halves of the vocabulary, so n_keys must equal "
                             f"n_values, got {v.n_keys} and {v.n_values}; e.g. Vocab(n_noise, 64, 64)")
        if self.max_pairs > v.n_keys:
            raise ValueError(f"mqar: max_pairs={self.max_pairs} needs at least as many key (and value) tokens "
                             f"(n_keys={v.n_keys}); raise n_keys / n_values or lower max_pairs")
        if v.n_noise < 1:
            raise ValueError("mqar: the query region is filled with filler tokens, so n_noise must be >= 1")

    @property
    def pair_range(self) -> tuple[int, int]:
        """(fewest, most) pairs of a sample."""
        if self.min_pairs:
            return self.min_pairs, self.max_pairs
        return (self.max_pairs, self.max_pairs) if self.task == "mqar" else (max(1, math.ceil(self.max_pairs / 2)),
                                                                             self.max_pairs)

    def with_pairs(self, pairs: int) -> TaskSpec:
        """The same task with exactly ``pairs`` pairs in every sample (evaluation at one difficulty)."""
        return TaskSpec(self.task, self.max_len, pairs, self.p_hop, self.vocab, min_pairs=pairs)

    def total_length(self) -> int:
        """Longest sequence the task produces (the model's context must cover it)."""
        return 2 * self.max_len + 2 if self.task == "copy" else self.max_len

    def phase(self, divisor: int) -> TaskSpec:
        """The curriculum phase with lengths and pair counts divided by ``divisor`` (at least one pair)."""
        if self.task == "copy":
            return TaskSpec(self.task, max(1, self.max_len // divisor), 0, self.p_hop, self.vocab)
        pairs = max(1, self.max_pairs // divisor)
        least = min(pairs, max(1, self.min_pairs // divisor)) if self.min_pairs else 0
        length = max(3 * pairs + (self.task != "mqar"), self.max_len // divisor)
        return TaskSpec(self.task, length, pairs, self.p_hop, self.vocab, min_pairs=least)


CURRICULUM = (8, 4, 2, 1)


def curriculum_divisor(step: int, total_steps: int, phases: tuple[int, ...] = CURRICULUM) -> int:
    """Divisor of the phase that ``step`` (0-based) falls in: the run is split into len(phases) equal parts."""
    k = min(len(phases) - 1, step * len(phases) // max(1, total_steps))
    return phases[k]


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) int64
    labels: torch.Tensor  # (B, T) int64, IGNORE where unlabelled
    hops: torch.Tensor  # (B, T) int64, -1 where unlabelled
    query_mask: torch.Tensor  # (B, T) bool: the final answers (copy targets, queries); excludes intermediate labels


def _uniform_half_to_full(rng: np.random.Generator, hi: int) -> int:
    """An integer in [ceil(hi / 2), hi] (randomised sizes that stay near the phase's maximum)."""
    return int(rng.integers(max(1, math.ceil(hi / 2)), hi + 1))


def _copy_sample(spec: TaskSpec, rng: np.random.Generator):
    v = spec.vocab
    n = _uniform_half_to_full(rng, spec.max_len)
    x = rng.integers(v.value0, v.size, size=n)
    ids = np.concatenate([[BOS], x, [SEP], x])
    labels = np.full(ids.shape, IGNORE)
    labels[n + 1: 2 * n + 1] = x  # at SEP predict x_1, at the i-th copy predict x_{i+1}
    hops = np.where(labels != IGNORE, 0, -1)
    return ids, labels, hops, labels != IGNORE


def _interleave(rng: np.random.Generator, items: list[list[int]], n_noise: int, v: Vocab):
    """Random order of ``items`` (token groups kept together) and ``n_noise`` single filler tokens.

    Returns (tokens, start offset of each item)."""
    kinds = np.array([0] * len(items) + [1] * n_noise)
    rng.shuffle(kinds)
    noise = rng.integers(v.noise0, v.noise0 + v.n_noise, size=n_noise) if v.n_noise else np.zeros(n_noise, int)
    out, starts, i_item, i_noise = [], [], 0, 0
    for kind in kinds:
        if kind == 0:
            starts.append(len(out))
            out.extend(items[i_item])
            i_item += 1
        else:
            out.append(int(noise[i_noise]))
            i_noise += 1
    return out, starts


def _recall_sample(spec: TaskSpec, rng: np.random.Generator, multihop: bool):
    v = spec.vocab
    m = int(rng.integers(spec.pair_range[0], spec.pair_range[1] + 1))
    n = int(rng.integers(3 * m + 1, max(3 * m + 1, spec.max_len) + 1))
    keys = v.key0 + rng.choice(v.n_keys, size=m, replace=False)
    values = rng.integers(v.value0, v.size, size=m)
    slot = values.copy()  # what stands in each pair's value slot
    resolved = values.copy()
    depth = np.zeros(m, dtype=np.int64)
    points_to = np.full(m, -1)
    if multihop:
        for j in range(1, m):
            if rng.random() < spec.p_hop:
                jp = int(rng.integers(0, j))
                points_to[j] = jp
                slot[j] = keys[jp]
                resolved[j] = resolved[jp]
                depth[j] = depth[jp] + 1
    # pairs in order of appearance (j' < j must come first): interleave with noise keeping the pair order
    noise_total = n - 1 - 3 * m
    n_ctx_noise = int(rng.integers(0, noise_total + 1))
    ctx, ctx_starts = _interleave(rng, [[int(keys[j]), int(slot[j])] for j in range(m)], n_ctx_noise, v)
    order = rng.permutation(m)
    qry, q_starts = _interleave(rng, [[int(keys[j])] for j in order], noise_total - n_ctx_noise, v)
    ids = np.array(ctx + [SEP] + qry, dtype=np.int64)
    labels = np.full(n, IGNORE, dtype=np.int64)
    hops = np.full(n, -1, dtype=np.int64)
    query = np.zeros(n, dtype=bool)
    if multihop:
        for j in range(m):
            if points_to[j] >= 0:  # intermediate label at the value slot holding key j'
                pos = ctx_starts[j] + 1
                labels[pos] = resolved[points_to[j]]
                hops[pos] = depth[points_to[j]]
    base = len(ctx) + 1
    for k, j in enumerate(order):
        pos = base + q_starts[k]
        labels[pos] = resolved[j]
        hops[pos] = depth[j]
        query[pos] = True
    return ids, labels, hops, query


def _mqar_sample(spec: TaskSpec, rng: np.random.Generator):
    v = spec.vocab
    m = int(rng.integers(spec.pair_range[0], spec.pair_range[1] + 1))
    n = spec.max_len
    keys = v.key0 + rng.choice(v.n_keys, size=m, replace=False)
    values = v.value0 + rng.choice(v.n_values, size=m, replace=False)
    ids = rng.integers(v.noise0, v.noise0 + v.n_noise, size=n)
    ids[0:2 * m:2], ids[1:2 * m:2] = keys, values
    # key i is asked at the i-th drawn position: choice() returns the positions in random order, so the
    # queries come in random order too
    asked = 2 * m + rng.choice(n - 2 * m, size=m, replace=False)
    ids[asked] = keys
    labels = np.full(n, IGNORE, dtype=np.int64)
    labels[asked] = values
    hops = np.where(labels != IGNORE, 0, -1)
    return ids.astype(np.int64), labels, hops, labels != IGNORE


def passkey_batch(vocab: Vocab, length: int, pairs: int, batch_size: int, rng: np.random.Generator,
                  far: bool = False, queries: int = 1) -> Batch:
    """Recall at a distance: samples of exactly ``length`` tokens, ``BOS``, filler tokens holding ``pairs`` (key,
    value) bigrams, and last the keys of ``queries`` of them, in random order, each labelled with its value. Keys
    are distinct in a sample; values come from the one value range, with replacement.

    ``far=False`` (training): the bigrams anywhere, the asked ones any of them. ``far=True`` (reading a distance):
    the asked bigrams in the first quarter and every other one, a decoy, after them, so each answer lies at least
    3/4 of the length back and the decoys are nearer. One query is the passkey with decoys; ``queries=pairs`` is
    multi-query associative recall (MQAR) at a distance, every pair far back and every one asked.

    Chance is 1 / ``vocab.n_values`` over the values, 1 / ``pairs`` over the values present. With ``pairs=1`` the
    value is the sample's only value token: the key is not needed to answer, and the task measures carrying one
    token's identity over the distance, not recall.
    """
    v = vocab
    if pairs < 1 or pairs > v.n_keys:
        raise ValueError(f"passkey: pairs must be in [1, n_keys={v.n_keys}], got {pairs}")
    if not 1 <= queries <= pairs:
        raise ValueError(f"passkey: queries must be in [1, pairs={pairs}], got {queries}")
    quarter = length // 4
    fillers = ((quarter - 1 - 2 * queries, length - queries - quarter - 2 * (pairs - queries)) if far
               else (length - 1 - queries - 2 * pairs,))
    if min(fillers) < 0:
        raise ValueError(f"passkey: {length} tokens cannot hold BOS, {pairs} pairs and {queries} "
                         + ("query" if queries == 1 else "queries")
                         + (", the asked pairs in the first quarter and the others after them" if far else "")
                         + "; raise the length or lower the pairs")
    ids = np.empty((batch_size, length), dtype=np.int64)
    labels = np.full((batch_size, length), IGNORE, dtype=np.int64)
    for b in range(batch_size):
        keys = v.key0 + rng.choice(v.n_keys, size=pairs, replace=False)
        values = rng.integers(v.value0, v.size, size=pairs)
        bigrams = [[int(k), int(x)] for k, x in zip(keys, values)]
        order = rng.permutation(pairs)[:queries]  # the pairs asked, in the order asked
        if far:  # the asked bigrams in positions [1, quarter), the decoys in [quarter, length - queries)
            asked = set(order.tolist())
            head, _ = _interleave(rng, [bigrams[j] for j in range(pairs) if j in asked], fillers[0], v)
            tail, _ = _interleave(rng, [bigrams[j] for j in range(pairs) if j not in asked], fillers[1], v)
            body = head + tail
        else:
            body, _ = _interleave(rng, bigrams, fillers[0], v)
        ids[b] = [BOS, *body, *(bigrams[j][0] for j in order)]
        labels[b, length - queries:] = [bigrams[j][1] for j in order]
    query = labels != IGNORE
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(np.where(query, 0, -1)),
                 torch.from_numpy(query))


def make_batch(spec: TaskSpec, batch_size: int, rng: np.random.Generator) -> Batch:
    """A batch of ``batch_size`` fresh samples of ``spec`` (right-padded to the longest)."""
    if spec.task == "copy":
        samples = [_copy_sample(spec, rng) for _ in range(batch_size)]
    elif spec.task == "mqar":
        samples = [_mqar_sample(spec, rng) for _ in range(batch_size)]
    else:
        samples = [_recall_sample(spec, rng, spec.task == "multihop") for _ in range(batch_size)]
    width = max(len(s[0]) for s in samples)
    ids = np.full((batch_size, width), PAD, dtype=np.int64)
    labels = np.full((batch_size, width), IGNORE, dtype=np.int64)
    hops = np.full((batch_size, width), -1, dtype=np.int64)
    query = np.zeros((batch_size, width), dtype=bool)
    for b, (i, lab, h, q) in enumerate(samples):
        ids[b, : len(i)], labels[b, : len(i)], hops[b, : len(i)], query[b, : len(i)] = i, lab, h, q
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(hops), torch.from_numpy(query))


def solve_reference(ids: np.ndarray, spec: TaskSpec) -> np.ndarray:
    """Independent solver used by the tests: the label every position should have, from the tokens alone.

    copy: after SEP, the i-th input token. mqar: the leading run of (key, value) pairs is the context; every key
    after it is answered by its pair's value. assoc/multihop: a key standing where a value is expected (the token
    after a pair's key in the context) or in the query region is answered by following key -> slot links until a
    value token. Returns (T,) int64 with IGNORE where nothing is asked.
    """
    ids = np.asarray(ids)
    out = np.full(ids.shape, IGNORE, dtype=np.int64)
    v = spec.vocab
    real = ids[ids != PAD]
    if spec.task == "copy":
        sep = int(np.where(real == SEP)[0][0])
        src = real[1:sep]
        for i in range(len(src)):
            out[sep + i] = src[i]
        return out
    if spec.task == "mqar":
        pairs: dict[int, int] = {}
        t = 0
        while t + 1 < len(real) and v.is_key(real[t]) and v.is_value(real[t + 1]):
            pairs[int(real[t])] = int(real[t + 1])
            t += 2
        for s in range(t, len(real)):
            if v.is_key(real[s]):
                out[s] = pairs[int(real[s])]
        return out
    sep = int(np.where(real == SEP)[0][0])
    link: dict[int, int] = {}
    t = 0
    while t < sep:
        tok = int(real[t])
        if v.is_key(np.array(tok)) and tok not in link:  # a new key: the next token is its slot
            link[tok] = int(real[t + 1])
            if v.is_key(np.array(real[t + 1])):
                out[t + 1] = _follow(link, int(real[t + 1]), v)
            t += 2
        else:
            t += 1
    for t in range(sep + 1, len(real)):
        if v.is_key(np.array(real[t])):
            out[t] = _follow(link, int(real[t]), v)
    return out


def _follow(link: dict[int, int], key: int, v: Vocab) -> int:
    seen = set()
    while v.is_key(np.array(key)):
        if key in seen:
            raise AssertionError("cycle in key links")
        seen.add(key)
        key = link[key]
    return key


# --------------------------------------------------------------------------------------------------
# Models of the tasks


def task_model(mixer, vocab_size: int, context: int, d: int, layers: int, heads: int,
               position_embedding: str = "rope", conv_size: int = 0):
    """A causal LM over a task's vocabulary (4 x d MLP, the task's BOS, SEP and PAD ids): the resolvent model of
    ``mixer`` (a spec, or one per layer) or GPT-2 (``mixer="gpt2"``, learned positions), from the training package's
    one model factory. ``position_embedding``: ``rope``, ``learned``, ``none``, or ``rope:a`` / ``rope:b`` for RoPE
    on one channel only (``rope_channels``); GPT-2 ignores it, and ``conv_size`` (the short convolution)."""
    from hf_resolvent.training.models import build_model

    shape = {"n_layer": layers, "n_embd": d, "n_head": heads, "n_inner": 4 * d, "n_positions": context,
             "bos_token_id": BOS, "eos_token_id": SEP, "pad_token_id": PAD}
    if mixer != "gpt2":
        kind, _, channels = position_embedding.partition(":")
        shape["position_embedding"] = kind
        if channels:
            shape["rope_channels"] = channels
        if conv_size:
            shape["conv_size"] = conv_size
    cfg = {"type": "gpt2" if mixer == "gpt2" else "resolvent", "preset": "tiny", "mixer": mixer, "overrides": shape}
    return build_model(cfg, vocab_size, context)


def task_loss(model, batch: Batch, device) -> torch.Tensor:
    """Cross-entropy over a batch's labelled positions (``labels[b, t]`` is the prediction at t: no shift)."""
    logits = model(input_ids=batch.input_ids.to(device)).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten().to(device), ignore_index=IGNORE)
