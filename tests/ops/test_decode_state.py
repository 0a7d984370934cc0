"""Tests of hf_resolvent.ops.DecodeState on its own: keep and read rules, advance, prefill, crop, batch selection
and repetition, device and dtype moves, bytes held. No mixer runs here: the rows are labelled tensors, so a row
in the wrong place shows.

Shapes: B batch, H heads, S rows held, K slots, n tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

from hf_resolvent import ops
from hf_resolvent.cache_resolvent import ResolventCacheLayer
from hf_resolvent.ops import DecodeState
from hf_resolvent.patterns import get_pattern

KEEP_ALL = ["attention", "dense", "exp2", "square", "f:2*k+1"]
FORGETTING = ["local_attention:3", "banded:2", "diagonal", "exp2:ce", "square:ce", "f:k**3+1:ce"]
WIDTH = {"keys_a": 2, "keys_b": 2, "values": 3, "outputs": 3}


def _rows(batch: int, n: int, seed: int = 0, heads: int = 2) -> dict[str, torch.Tensor]:
    """Random per-position rows (B, H, n, w) of every name a state stores."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(batch, heads, n, w, generator=gen) for k, w in WIDTH.items()}


def _stepped(pattern, rows, start=None, state=None) -> DecodeState:
    """The state after advancing token by token through ``rows`` (each (B, H, n, w))."""
    state = DecodeState(start=start) if state is None else state
    ref = next(iter(rows.values()))
    for t in range(state.seen, ref.shape[2]):
        r = state.next_position(ref.shape[0], ref.device)
        state.advance(pattern, {k: v[:, :, t] for k, v in rows.items()}, r)
    return state


def _assert_same(got: DecodeState, want: DecodeState) -> None:
    """Same positions, register, seen and start; same tensors on every row a token can read (position >= 0)."""
    assert got.seen == want.seen
    assert torch.equal(got.positions, want.positions), (got.positions, want.positions)
    assert (got.slots is None) == (want.slots is None)
    if want.slots is not None:
        assert torch.equal(got.slots, want.slots)
    assert (got.start is None) == (want.start is None)
    if want.start is not None:
        assert torch.equal(got.start, want.start)
    assert got.tensors().keys() == want.tensors().keys()
    held = (want.positions >= 0)[:, None, :, None]
    for name, t in want.tensors().items():
        assert got.tensors()[name].shape == t.shape, name
        assert torch.equal(torch.where(held, got.tensors()[name], 0.0), torch.where(held, t, 0.0)), name


# --------------------------------------------------------------------------------------------------
# Rules


@pytest.mark.parametrize(("spec", "every", "register", "trailing"), [
    ("attention", True, False, None),
    ("dense", True, False, None),
    ("exp2", True, False, None),
    ("local_attention:5", False, False, 4),
    ("banded:3", False, False, 3),
    ("diagonal", False, False, 1),
    ("exp2:ce", False, True, None),
])
def test_keep_rule(spec, every, register, trailing):
    assert DecodeState.keeps_every_position(spec) is every
    assert DecodeState.uses_register(spec) is register
    assert DecodeState.trailing_rows(spec) == trailing


def _read(pattern, p: torch.Tensor, r: torch.Tensor) -> list[int]:
    """1-indexed positions among the rows at positions p (S,) that the token at r (1,) reads, by the read rule."""
    mode, lo, offsets = DecodeState.read_rule(pattern, r)
    read = p >= 0
    if mode == DecodeState.READ_WINDOW:
        read &= p >= r - lo
    elif mode == DecodeState.READ_OFFSETS:
        read &= torch.isin(r - p, torch.tensor(offsets))
    return sorted(int(x) + 1 for x in p[read])


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_rows_read_are_held_and_follow_the_pattern(spec):
    """Token i (1-indexed) reads, among the held rows, exactly P^B_i (resolvent kinds) or P^A_i without itself
    (attention kinds); rows carry the token they were made from."""
    pattern = get_pattern(spec)
    state = DecodeState()
    for t in range(40):
        r = state.next_position(1, "cpu")
        i = t + 1
        want = pattern.attended(i) if pattern.has_recurrence else [j for j in pattern.direct(i) if j != i]
        assert _read(pattern, state.row_positions(1, "cpu")[0], r) == want, f"token {i}"
        if not DecodeState.uses_register(pattern):  # the read rule alone, as if every past row were held
            assert _read(pattern, torch.arange(t), r) == want, f"token {i}, every row held"
        label = torch.full((1, 1, 1), float(t))
        state.advance(pattern, {"keys_a": label, "outputs": label}, r)
        assert state.seen == i
        held = state.positions[0] >= 0
        assert torch.equal(state.keys_a[0, 0, held, 0], state.positions[0, held].float()), "a row holds another token"
    assert state.rows() == pattern.cache_size(40)


# --------------------------------------------------------------------------------------------------
# Prefill


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_from_prefill_equals_step_by_step(spec):
    for n in (1, 2, 7, 20):
        for start in (None, torch.tensor([0, min(3, n - 1), n - 1])):
            rows = _rows(3, n, seed=n)
            built = DecodeState.from_prefill(spec, rows, start)
            _assert_same(built, _stepped(spec, rows, start))
            for t in built.tensors().values():  # copies, not views of the prefill's tensors
                assert all(t.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in rows.values())


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_extend_equals_advancing_token_by_token(spec):
    """L tokens taken at once leave the state that L calls of advance leave, and hold copies of the new rows."""
    for n, cuts in ((20, (7, 8, 20)), (40, (3, 30, 40))):
        start = torch.tensor([0, 1, 2])
        rows = _rows(3, n, seed=n)
        state = DecodeState.from_prefill(spec, {k: v[:, :, :cuts[0]] for k, v in rows.items()}, start)
        for a, b in zip(cuts, cuts[1:]):
            new = {k: v[:, :, a:b] for k, v in rows.items()}
            r = state.next_position(3, "cpu")[:, None] + torch.arange(b - a)
            state.extend(spec, new, r)
            for t in state.tensors().values():
                assert all(t.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in rows.values())
        _assert_same(state, _stepped(spec, rows, start))


def test_layers_advancing_the_same_token_share_one_register_plan():
    """The bookkeeping of a register state (slots, positions, which rows move) is worked out once per token for
    all the layers of a cache; each layer still gathers its own rows, and a state in another place (a different
    register, another pattern, a callable of the same name) gets its own plan."""
    rows = _rows(2, 9)
    layers = [DecodeState.from_prefill("exp2:ce", rows) for _ in range(3)]
    token = {k: v[:, :, 0] for k, v in _rows(2, 1, seed=1).items()}
    for state in layers:
        state.advance("exp2:ce", token, state.next_position(2, "cpu"))
    assert layers[0].positions is layers[1].positions is layers[2].positions
    assert layers[0].keys_a is not layers[1].keys_a
    _assert_same(layers[2], _stepped("exp2:ce", {k: torch.cat([v, token[k][:, :, None]], 2) for k, v in rows.items()}))

    def f(k):
        return 2**k

    def g(k):
        return k * k + 1

    doubling, squares = (get_pattern(fn, cache_efficient=True) for fn in (f, g))
    g.__name__ = "f"
    squares = get_pattern(g, cache_efficient=True)
    assert doubling.name == squares.name
    rows = _rows(1, 30, seed=2)
    for pattern in (doubling, squares, doubling):
        _assert_same(_stepped(pattern, rows), DecodeState.from_prefill(pattern, rows))


def test_from_prefill_refuses_bad_inputs():
    rows = _rows(2, 5)
    with pytest.raises(ValueError, match="may only hold"):
        DecodeState.from_prefill("exp2:ce", {"keys": rows["keys_a"]})
    with pytest.raises(ValueError, match="empty"):
        DecodeState.from_prefill("exp2:ce", {})
    with pytest.raises(ValueError, match=r"start must be"):
        DecodeState.from_prefill("dense", rows, torch.tensor([0, 5]))


# --------------------------------------------------------------------------------------------------
# Crop


@pytest.mark.parametrize("spec", KEEP_ALL)
def test_crop_equals_the_shorter_sequence_and_decodes_on(spec):
    start = torch.tensor([0, 3])
    rows = _rows(2, 12, seed=1)
    state = _stepped(spec, rows, start)
    state.crop(spec, 7)
    _assert_same(state, DecodeState.from_prefill(spec, {k: v[:, :, :7] for k, v in rows.items()}, start))
    # rollback then new tokens (assisted decoding): as if the rejected ones had never come
    other = {k: torch.cat([v[:, :, :7], -v[:, :, 7:]], 2) for k, v in rows.items()}
    _assert_same(_stepped(spec, other, state=state), DecodeState.from_prefill(spec, other, start))
    state.crop(spec, 12)  # nothing to drop
    assert state.seen == 12
    with pytest.raises(ValueError, match=">= 0"):
        state.crop(spec, -1)


@pytest.mark.parametrize("spec", FORGETTING)
def test_crop_refuses_a_forgetting_pattern_that_did_not_record(spec):
    state = DecodeState.from_prefill(spec, _rows(2, 9))
    before = state.positions.clone()
    with pytest.raises(ValueError, match=re.escape(f"pattern {spec!r} cannot be cropped back 4 token(s): the pattern")):
        state.crop(spec, 5)
    assert state.seen == 9 and torch.equal(state.positions, before)  # untouched
    state.crop(spec, 9)  # nothing dropped: allowed
    assert state.seen == 9


@pytest.mark.parametrize("spec", FORGETTING)
def test_a_recording_state_crops_back_inside_its_prefill_and_its_steps(spec):
    start = torch.tensor([0, 3])
    rows = _rows(2, 16, seed=4)
    upto = lambda n, src=rows: {k: v[:, :, :n] for k, v in src.items()}  # noqa: E731
    state = DecodeState.from_prefill(spec, upto(9), start, record=True)
    _stepped(spec, upto(13), state=state)  # 4 decoded tokens, recorded
    state.crop(spec, 11)  # back over two steps
    _assert_same(state, DecodeState.from_prefill(spec, upto(11), start))
    # rejected drafts replaced by others (assisted decoding): as if the rejected ones had never come
    other = {k: torch.cat([v[:, :, :11], -v[:, :, 11:]], 2) for k, v in rows.items()}
    _stepped(spec, upto(14, other), state=state)
    _assert_same(state, DecodeState.from_prefill(spec, upto(14, other), start))
    state.crop(spec, 7)  # back inside the prefill: rebuilt from its recorded rows
    _assert_same(state, DecodeState.from_prefill(spec, upto(7), start))
    assert state.history == [] and state.prefill_rows is not None
    state.forget_history()  # the tokens so far are accepted: nothing to go back to
    assert state.prefill_rows is None and not state.can_crop_to(spec, 6)
    _stepped(spec, upto(9), state=state)
    state.crop(spec, 8)
    _assert_same(state, DecodeState.from_prefill(spec, upto(8), start))
    with pytest.raises(ValueError, match="cannot be cropped back 2 token"):
        state.crop(spec, 6)


@pytest.mark.parametrize("spec", ["exp2:ce", "banded:2"])
def test_recorded_states_follow_batch_selection(spec):
    rows = _rows(3, 12, seed=5)
    state = DecodeState.from_prefill(spec, {k: v[:, :, :8] for k, v in rows.items()}, record=True)
    _stepped(spec, rows, state=state)
    index = torch.tensor([2, 2, 0])
    state.select_batch(index)
    state.crop(spec, 10)
    _assert_same(state, DecodeState.from_prefill(spec, {k: v[index, :, :10] for k, v in rows.items()}))
    state.crop(spec, 5)
    _assert_same(state, DecodeState.from_prefill(spec, {k: v[index, :, :5] for k, v in rows.items()}))


def test_cache_layer_records_from_the_prefill_after_activation():
    layer = ResolventCacheLayer("exp2:ce")
    assert not layer.is_croppable
    layer.activate_past_recording()
    assert layer.is_croppable
    rows = _rows(1, 10, seed=6)
    layer.state = DecodeState.from_prefill("exp2:ce", {k: v[:, :, :6] for k, v in rows.items()}, record=True)
    _stepped("exp2:ce", rows, state=layer.state)
    layer.crop(-3)
    _assert_same(layer.state, DecodeState.from_prefill("exp2:ce", {k: v[:, :, :7] for k, v in rows.items()}))
    assert layer.state.history == []  # a crop accepts what is left
    layer.crop(0)
    with pytest.raises(ValueError, match="cannot be cropped back 1 token"):
        layer.crop(-1)


def test_cache_layer_crop_counts_from_the_end():
    layer = ResolventCacheLayer("dense")
    layer.state = DecodeState.from_prefill("dense", _rows(1, 6))
    layer.crop(-2)
    assert layer.get_seq_length() == 4 and layer.state.rows() == 4
    layer.crop(-10)  # more than was seen: nothing left, as for DynamicLayer
    assert layer.get_seq_length() == 0 and layer.state.rows() == 0


# --------------------------------------------------------------------------------------------------
# Batch selection and repetition


@pytest.mark.parametrize("spec", ["dense", "local_attention:3", "banded:2", "exp2", "exp2:ce", "square:ce"])
def test_select_and_repeat_batch(spec):
    n, more = 11, 6
    start = torch.tensor([0, 2, 5])
    rows = _rows(3, n + more, seed=2)
    first = {k: v[:, :, :n] for k, v in rows.items()}

    index = torch.tensor([2, 0, 2, 1])
    state = DecodeState.from_prefill(spec, first, start)
    state.select_batch(index)
    assert state.batch_size == 4
    _assert_same(state, DecodeState.from_prefill(spec, {k: v[index] for k, v in first.items()}, start[index]))
    # the register and start follow too: decoding on equals the selected batch from the start
    _stepped(spec, {k: v[index] for k, v in rows.items()}, state=state)
    _assert_same(state, DecodeState.from_prefill(spec, {k: v[index] for k, v in rows.items()}, start[index]))

    state = DecodeState.from_prefill(spec, first, start)
    state.repeat_batch(2)
    twice = {k: v.repeat_interleave(2, 0) for k, v in rows.items()}
    _stepped(spec, twice, state=state)
    _assert_same(state, DecodeState.from_prefill(spec, twice, start.repeat_interleave(2)))


def test_repeat_batch_before_the_first_token():
    state = DecodeState(start=torch.tensor([1, 0]))
    state.repeat_batch(3)
    assert state.start.tolist() == [1, 1, 1, 0, 0, 0]
    empty = DecodeState()
    empty.repeat_batch(3)  # no batch yet: nothing to repeat
    assert empty.batch_size == -1 and empty.start is None


# --------------------------------------------------------------------------------------------------
# Device, dtype, size


def test_to_dtype_and_device():
    rows = _rows(2, 9, seed=3)
    state = DecodeState.from_prefill("exp2:ce", rows, torch.tensor([0, 2]))
    want = {k: v.clone() for k, v in state.tensors().items()}
    assert state.to(dtype=torch.float64) is state
    for name, t in state.tensors().items():
        assert t.dtype == torch.float64 and torch.equal(t, want[name].double()), name
    assert state.positions.dtype == state.slots.dtype == state.start.dtype == torch.int64
    state.to("meta")
    held = list(state.tensors().values()) + [state.positions, state.slots, state.start]
    assert len(held) == 7 and all(t.device.type == "meta" for t in held)


@pytest.mark.parametrize(("spec", "rows_held", "slots"), [("exp2:ce", None, True), ("dense", 32, False),
                                                          ("banded:3", 3, False)])
def test_nbytes(spec, rows_held, slots):
    """Keys, values and outputs (float32, B = 1, H = 2) plus int64 positions and register; ``start`` is free."""
    n = 32
    pattern = get_pattern(spec)
    state = DecodeState.from_prefill(spec, _rows(1, n), torch.tensor([0]))
    rows_held = len(pattern.attended(n + 1)) if rows_held is None else rows_held
    k = len(pattern.offsets(n + 1)) if slots else 0
    assert state.rows() == rows_held
    per_row = 2 * sum(WIDTH.values()) * 4 + 8
    assert state.nbytes() == rows_held * per_row + k * 8
    assert DecodeState().nbytes() == 0


# --------------------------------------------------------------------------------------------------
# Static layout (preallocated, written in place: the static cache)


def _read_rows(state: DecodeState, pattern, r: torch.Tensor) -> list[list[tuple[int, list[float]]]]:
    """Per sequence, the (position, keys_a row) pairs the token at r reads, by position: the layout left out."""
    mask = state.read_mask(get_pattern(pattern), r)
    return [sorted((int(p), state.keys_a[b, 0, s].tolist()) for s, p in enumerate(state.positions[b]) if mask[b, s])
            for b in range(mask.shape[0])]


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_static_state_reads_what_the_growing_state_reads(spec):
    """After a prefill, both layouts read the same rows at every later token, and a mixer step on either gives the
    same output; the static one keeps its buffers and shapes."""
    capacity, n = 24, 9
    start = torch.tensor([0, 4])
    rows = _rows(2, capacity, seed=8)
    grow = DecodeState.from_prefill(spec, {k: v[:, :, :n] for k, v in rows.items()}, start)
    static = ops.StaticDecodeState.preallocate(spec, grow, capacity)
    buffers = {k: t.data_ptr() for k, t in static.tensors().items()}
    shapes = {k: t.shape for k, t in static.tensors().items()}
    gen = torch.Generator().manual_seed(9)
    for t in range(n, capacity):
        r = grow.next_position(2, "cpu")
        assert torch.equal(static.next_position(2, "cpu"), r)
        assert _read_rows(static, spec, r) == _read_rows(grow, spec, r), f"token {t}"
        q, g = torch.randn(2, 2, 2, generator=gen), torch.rand(2, 2, generator=gen)
        token = {k: v[:, :, t] for k, v in rows.items()}
        ys = [ops.recurrent_step(s, q, token["keys_a"], q, token["keys_b"], token["values"], g, spec)
              for s in (grow, static)]
        torch.testing.assert_close(ys[1], ys[0], atol=1e-6, rtol=1e-6)
        assert int(static.seen) == grow.seen == t + 1
    assert {k: t.data_ptr() for k, t in static.tensors().items()} == buffers
    assert {k: t.shape for k, t in static.tensors().items()} == shapes


@pytest.mark.parametrize("spec", ["dense", "exp2:ce", "banded:2"])
def test_static_state_refuses_a_token_past_its_capacity(spec):
    rows = _rows(1, 6)
    static = ops.StaticDecodeState.preallocate(spec, DecodeState.from_prefill(spec, rows), 6)
    with pytest.raises(ValueError, match="the static cache is full: it holds max_cache_len = 6 tokens"):
        static.advance(spec, {k: v[:, :, 0] for k, v in rows.items()}, static.next_position(1, "cpu"))
    with pytest.raises(ValueError, match="max_cache_len = 5 tokens, but the prompt already has 6"):
        ops.StaticDecodeState.preallocate(spec, DecodeState.from_prefill(spec, rows), 5)


def test_static_state_crops_patterns_that_keep_every_position_only():
    rows = _rows(2, 12, seed=3)
    static = ops.StaticDecodeState.preallocate("dense", DecodeState.from_prefill("dense", rows), 16)
    static.crop("dense", 7)
    shorter = ops.StaticDecodeState.preallocate("dense", DecodeState.from_prefill("dense", {k: v[:, :, :7] for k, v
                                                                                          in rows.items()}), 16)
    r = static.next_position(2, "cpu")
    assert int(static.seen) == 7 and _read_rows(static, "dense", r) == _read_rows(shorter, "dense", r)
    forgetting = ops.StaticDecodeState.preallocate("exp2:ce", DecodeState.from_prefill("exp2:ce", rows), 16)
    with pytest.raises(ValueError, match="a static cache cannot be cropped back to 7 tokens for pattern 'exp2:ce'"):
        forgetting.crop("exp2:ce", 7)
    layer = ResolventCacheLayer("exp2:ce", max_cache_len=16)
    with pytest.raises(ValueError, match="a static cache cannot record past states for pattern 'exp2:ce'"):
        layer.activate_past_recording()


@pytest.mark.parametrize("spec", ["dense", "exp2:ce", "banded:2"])
def test_static_state_selects_a_batch_in_its_buffers(spec):
    rows = _rows(3, 8, seed=4)
    start = torch.tensor([0, 2, 1])
    grow = DecodeState.from_prefill(spec, rows, start)
    static = ops.StaticDecodeState.preallocate(spec, grow, 12)
    pointers = [t.data_ptr() for t in static.tensors().values()]
    index = torch.tensor([2, 2, 0])
    grow.select_batch(index)
    static.select_batch(index)
    assert [t.data_ptr() for t in static.tensors().values()] == pointers  # same size: in place
    r = grow.next_position(3, "cpu")
    assert _read_rows(static, spec, r) == _read_rows(grow, spec, r)
    static.repeat_batch(2)  # another size: new buffers
    assert static.batch_size == 6 and static.start.tolist() == [1, 1, 1, 1, 0, 0]


def test_a_state_that_keeps_every_position_appends_without_copying_its_rows():
    """Appending writes into spare rows of one buffer (reallocated a quarter larger when full), not a copy of every
    row per token; the rows read are those of the whole sequence, and an earlier view keeps what it showed."""
    rows = _rows(2, 300, seed=7)
    state = DecodeState.from_prefill("dense", {k: v[:, :, :100] for k, v in rows.items()})
    buffers = set()
    for t in range(100, 300):
        _stepped("dense", {k: v[:, :, :t + 1] for k, v in rows.items()}, state=state)
        buffers.add(state.keys_a.data_ptr())
        if t == 150:
            earlier, shown = state.values, state.values.clone()
    assert len(buffers) <= 4  # 100 -> 164 -> 228 -> 292 -> 365 rows of capacity
    _assert_same(state, DecodeState.from_prefill("dense", rows))
    assert torch.equal(earlier, shown)
    state.crop("dense", 120)  # then decoding on overwrites the dropped rows only
    other = {k: torch.cat([v[:, :, :120], -v[:, :, 120:]], 2) for k, v in rows.items()}
    _stepped("dense", other, state=state)
    _assert_same(state, DecodeState.from_prefill("dense", other))
