"""Tests of hf_resolvent.ops.DecodeState on its own: layouts and read rules, advance and extend, prefill, crop, batch
selection and repetition, device and dtype moves, bytes held, and the static (fixed) storage. No mixer runs here:
the rows are labelled tensors, so a row in the wrong place shows.

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
CONV = (3, 4)  # (K - 1, C) of a short convolution


def _rows(batch: int, n: int, seed: int = 0, heads: int = 2) -> dict[str, torch.Tensor]:
    """Random per-position rows (B, H, n, w) of every name a state stores, and convolution rows (B, n, C)."""
    gen = torch.Generator().manual_seed(seed)
    rows = {k: torch.randn(batch, heads, n, w, generator=gen) for k, w in WIDTH.items()}
    rows["conv"] = torch.randn(batch, n, CONV[1], generator=gen)
    return rows


def _upto(rows, n):
    return {k: (v[:, :n] if k == "conv" else v[:, :, :n]) for k, v in rows.items()}


def _conv_window(rows):
    """The convolution's rows over a prefill: K - 1 zero rows, then the tokens'."""
    conv = rows["conv"]
    return torch.cat([conv.new_zeros(conv.shape[0], CONV[0], conv.shape[2]), conv], 1)


def _names(spec) -> tuple[str, ...]:
    """The rows a layer of this pattern keeps: attention kinds have no B channel."""
    return tuple(WIDTH) if get_pattern(spec).has_recurrence else ("keys_a", "values")


def _prefill(spec, rows, start=None, **kw) -> DecodeState:
    return DecodeState.from_prefill(spec, {k: rows[k] for k in _names(spec)}, start, conv=_conv_window(rows), **kw)


def _empty(spec, batch, start=None, capacity=None) -> DecodeState:
    return DecodeState.empty(spec, {k: WIDTH[k] for k in _names(spec)}, batch, 2, capacity, start=start,
                             conv_shape=CONV)


def _stepped(spec, rows, start=None, state=None) -> DecodeState:
    """The state after advancing token by token through ``rows``."""
    ref = rows["keys_a"]
    state = _empty(spec, ref.shape[0], start) if state is None else state
    for t in range(state.count(), ref.shape[2]):
        token = {k: rows[k][:, :, t] for k in state.rows}
        state.advance(token, conv=rows["conv"][:, t])
    return state


def _padded(rows: dict, positions: torch.Tensor, size: int) -> tuple[dict, torch.Tensor]:
    """Rows and positions with empty rows appended up to ``size`` (a growing register keeps the slots it grew)."""
    more = size - positions.shape[1]
    return ({k: torch.nn.functional.pad(t, (0, 0, 0, more)) for k, t in rows.items()},
            torch.nn.functional.pad(positions, (0, more), value=-1))


def _assert_same(got: DecodeState, want: DecodeState) -> None:
    """Same tokens taken, positions, start and convolution rows; the same row wherever a row holds a token."""
    assert got.count() == want.count()
    (got_rows, got_pos), (want_rows, want_pos) = got.view(), want.view()
    size = max(got_pos.shape[1], want_pos.shape[1])
    (got_rows, got_pos), (want_rows, want_pos) = _padded(got_rows, got_pos, size), _padded(want_rows, want_pos, size)
    assert torch.equal(got_pos, want_pos), (got_pos, want_pos)
    assert (got.start is None) == (want.start is None)
    if want.start is not None:
        assert torch.equal(got.start, want.start)
    assert torch.equal(got.conv, want.conv)
    assert got_rows.keys() == want_rows.keys()
    held = (want_pos >= 0)[:, None, :, None]
    for name, t in want_rows.items():
        assert torch.equal(torch.where(held, got_rows[name], 0.0), torch.where(held, t, 0.0)), name


def _read(state: DecodeState) -> list[list[tuple[int, list[float]]]]:
    """Per sequence, the (position, keys_a row) pairs the next token reads: the layout left out."""
    rows, positions = state.view()
    mask = state.read_mask(state.next_position(), positions)
    return [sorted((int(p), rows["keys_a"][b, 0, s].tolist()) for s, p in enumerate(positions[b]) if mask[b, s])
            for b in range(mask.shape[0])]


# --------------------------------------------------------------------------------------------------
# Layouts and the read rule


@pytest.mark.parametrize(("spec", "every", "ring"), [
    ("attention", True, None), ("dense", True, None), ("exp2", True, None), ("local_attention:5", False, 4),
    ("banded:3", False, 3), ("diagonal", False, 1), ("exp2:ce", False, None),
])
def test_layouts(spec, every, ring):
    state = _empty(spec, 1)
    assert DecodeState.keeps_every_token(spec) is every
    assert state.ring == ring
    assert state.layout == ("all" if every else "ring" if ring else "slots")


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_rows_read_are_held_and_follow_the_pattern(spec):
    """Token i (1-indexed) reads, among the held rows, exactly P^B_i (resolvent kinds) or P^A_i without itself
    (attention kinds); rows carry the token they were made from."""
    pattern = get_pattern(spec)
    state = _empty(spec, 1)
    for t in range(40):
        i = t + 1
        want = pattern.attended(i) if pattern.has_recurrence else [j for j in pattern.direct(i) if j != i]
        assert [p + 1 for p, _ in _read(state)[0]] == want, f"token {i}"
        label = torch.full((1, 2, 1), float(t))
        state.advance({k: label.expand(1, 2, WIDTH[k]) for k in state.rows},
                      conv=torch.zeros(1, CONV[1]))
        assert state.count() == i
        rows, positions = state.view()
        held = positions[0] >= 0
        assert torch.equal(rows["keys_a"][0, 0, held, 0], positions[0, held].float()), "a row holds another token"
    assert state.rows_held() >= pattern.cache_size(40)
    if state.layout == "slots":  # one slot per offset f(k) <= n: a position may sit in two
        assert state.rows_held() == len(pattern.offsets(41))


# --------------------------------------------------------------------------------------------------
# Prefill and extend


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_from_prefill_equals_step_by_step(spec):
    for n in (1, 2, 7, 20):
        for start in (None, torch.tensor([0, min(3, n - 1), n - 1])):
            rows = _rows(3, n, seed=n)
            built = _prefill(spec, rows, start)
            _assert_same(built, _stepped(spec, rows, start))
            for t in [*built.tensors().values(), built.conv]:  # buffers of its own, not views of the prefill's
                assert all(t.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in rows.values())


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_extend_equals_advancing_token_by_token(spec):
    """L tokens taken at once leave the state that L calls of advance leave."""
    for n, cuts in ((20, (7, 8, 20)), (40, (3, 30, 40))):
        start = torch.tensor([0, 1, 2])
        rows = _rows(3, n, seed=n)
        state = _prefill(spec, _upto(rows, cuts[0]), start)
        for a, b in zip(cuts, cuts[1:]):
            new = {k: rows[k][:, :, a:b] for k in state.rows}
            state.extend(new, state.next_position()[:, None] + torch.arange(b - a), conv=rows["conv"][:, a:b])
        _assert_same(state, _stepped(spec, rows, start))


def test_from_prefill_refuses_bad_inputs():
    rows = {k: v for k, v in _rows(2, 5).items() if k != "conv"}
    with pytest.raises(ValueError, match="may only hold"):
        DecodeState.from_prefill("exp2:ce", {"keys": rows["keys_a"]})
    with pytest.raises(ValueError, match="empty"):
        DecodeState.from_prefill("exp2:ce", {})
    with pytest.raises(ValueError, match=r"start must be"):
        DecodeState.from_prefill("dense", rows, torch.tensor([0, 5]))


# --------------------------------------------------------------------------------------------------
# Crop


@pytest.mark.parametrize("spec", KEEP_ALL)
def test_crop_of_a_state_that_keeps_every_token(spec):
    """Without a convolution such a state crops by itself: as the shorter sequence, and it decodes on."""
    start = torch.tensor([0, 3])
    rows = {k: v for k, v in _rows(2, 12, seed=1).items() if k != "conv"}
    state = DecodeState.from_prefill(spec, rows, start)
    state.crop(7)
    shorter = DecodeState.from_prefill(spec, {k: v[:, :, :7] for k, v in rows.items()}, start)
    assert _read(state) == _read(shorter) and state.count() == 7
    # rollback then new tokens (assisted decoding): as if the rejected ones had never come
    other = {k: torch.cat([v[:, :, :7], -v[:, :, 7:]], 2) for k, v in rows.items()}
    for t in range(7, 12):
        state.advance({k: v[:, :, t] for k, v in other.items()})
    assert _read(state) == _read(DecodeState.from_prefill(spec, other, start))
    state.crop(12)  # nothing to drop
    assert state.count() == 12
    with pytest.raises(ValueError, match=">= 0"):
        state.crop(-1)


@pytest.mark.parametrize("spec", FORGETTING + ["dense"])
def test_crop_refuses_a_state_that_did_not_record(spec):
    """Patterns that drop positions, and any state with convolution rows (it keeps only the last K - 1), crop only
    over what they recorded."""
    state = _prefill(spec, _rows(2, 9))
    before = state.positions.clone()
    with pytest.raises(ValueError, match=re.escape(f"pattern {spec!r} cannot be cropped back 4 token(s): ")):
        state.crop(5)
    assert state.count() == 9 and torch.equal(state.positions, before)  # untouched
    state.crop(9)  # nothing dropped: allowed
    assert state.count() == 9


@pytest.mark.parametrize("spec", FORGETTING + ["dense"])
def test_a_recording_state_crops_back_inside_its_prefill_and_its_steps(spec):
    start = torch.tensor([0, 3])
    rows = _rows(2, 16, seed=4)
    state = _prefill(spec, _upto(rows, 9), start, record=True)
    _stepped(spec, _upto(rows, 13), state=state)  # 4 decoded tokens, recorded
    state.crop(11)  # back over two steps
    _assert_same(state, _prefill(spec, _upto(rows, 11), start))
    # rejected drafts replaced by others (assisted decoding): as if the rejected ones had never come
    other = {k: torch.cat([v[:, :11], -v[:, 11:]], 1) if k == "conv" else torch.cat([v[:, :, :11], -v[:, :, 11:]], 2)
             for k, v in rows.items()}
    _stepped(spec, _upto(other, 14), state=state)
    _assert_same(state, _prefill(spec, _upto(other, 14), start))
    state.crop(7)  # back inside the prefill: rebuilt from its recorded rows
    _assert_same(state, _prefill(spec, _upto(rows, 7), start))
    assert state.history == [] and state.prefill is not None
    state.forget_history()  # the tokens so far are accepted: nothing to go back to
    assert state.prefill is None and not state.can_crop_to(6)
    _stepped(spec, _upto(rows, 9), state=state)
    state.crop(8)
    _assert_same(state, _prefill(spec, _upto(rows, 8), start))
    with pytest.raises(ValueError, match="cannot be cropped back 2 token"):
        state.crop(6)


@pytest.mark.parametrize("spec", ["exp2:ce", "banded:2"])
def test_recorded_states_follow_batch_selection(spec):
    rows = _rows(3, 12, seed=5)
    state = _prefill(spec, _upto(rows, 8), record=True)
    _stepped(spec, rows, state=state)
    index = torch.tensor([2, 2, 0])
    state.select_batch(index)
    picked = {k: v[index] for k, v in rows.items()}
    state.crop(10)
    _assert_same(state, _prefill(spec, _upto(picked, 10)))
    state.crop(5)
    _assert_same(state, _prefill(spec, _upto(picked, 5)))


def test_cache_layer_records_from_the_prefill_after_activation():
    layer = ResolventCacheLayer("exp2:ce", conv_size=CONV[0] + 1)
    assert not layer.is_croppable
    layer.activate_past_recording()
    assert layer.is_croppable
    rows = _rows(1, 10, seed=6)
    first = _upto(rows, 6)
    layer.store_prefill({k: v for k, v in first.items() if k != "conv"}, None, conv=_conv_window(first))
    _stepped("exp2:ce", rows, state=layer.state)
    layer.crop(-3)
    _assert_same(layer.state, _prefill("exp2:ce", _upto(rows, 7)))
    assert layer.state.history == []  # a crop accepts what is left
    layer.crop(0)
    with pytest.raises(ValueError, match="cannot be cropped back 1 token"):
        layer.crop(-1)


def test_cache_layer_crop_counts_from_the_end():
    layer = ResolventCacheLayer("dense")
    layer.store_prefill({k: v for k, v in _rows(1, 6).items() if k != "conv"}, None)
    layer.crop(-2)
    assert layer.get_seq_length() == 4 and layer.state.rows_held() == 4
    layer.crop(-10)  # more than was seen: nothing left, as for DynamicLayer
    assert layer.get_seq_length() == 0 and layer.state.rows_held() == 0


# --------------------------------------------------------------------------------------------------
# Batch selection and repetition


@pytest.mark.parametrize("spec", ["dense", "local_attention:3", "banded:2", "exp2", "exp2:ce", "square:ce"])
def test_select_and_repeat_batch(spec):
    n, more = 11, 6
    start = torch.tensor([0, 2, 5])
    rows = _rows(3, n + more, seed=2)

    index = torch.tensor([2, 0, 2, 1])
    state = _prefill(spec, _upto(rows, n), start)
    state.select_batch(index)
    assert state.batch_size == 4
    picked = {k: v[index] for k, v in rows.items()}
    _assert_same(state, _prefill(spec, _upto(picked, n), start[index]))
    # the register and start follow too: decoding on equals the selected batch from the start
    _stepped(spec, picked, state=state)
    _assert_same(state, _prefill(spec, picked, start[index]))

    state = _prefill(spec, _upto(rows, n), start)
    state.repeat_batch(2)
    twice = {k: v.repeat_interleave(2, 0) for k, v in rows.items()}
    _stepped(spec, twice, state=state)
    _assert_same(state, _prefill(spec, twice, start.repeat_interleave(2)))


# --------------------------------------------------------------------------------------------------
# Device, dtype, size


def test_to_dtype_and_device():
    rows = _rows(2, 9, seed=3)
    state = _prefill("exp2:ce", rows, torch.tensor([0, 2]))
    want = {k: v.clone() for k, v in state.tensors().items()}
    assert state.to(dtype=torch.float64) is state
    for name, t in state.tensors().items():
        assert t.dtype == torch.float64 and torch.equal(t, want[name].double()), name
    assert state.conv.dtype == torch.float64
    assert state.positions.dtype == state.start.dtype == torch.int64
    state.to("meta")
    held = [*state.tensors().values(), state.positions, state.start, state.conv]
    assert len(held) == 7 and all(t.device.type == "meta" for t in held)


@pytest.mark.parametrize(("spec", "rows_held"), [("exp2:ce", None), ("dense", 32), ("banded:3", 3)])
def test_nbytes(spec, rows_held):
    """Keys, values and outputs (float32, B = 1, H = 2) plus an int64 position per row held, and the convolution's
    rows; ``start`` and spare rows are free."""
    n = 32
    pattern = get_pattern(spec)
    state = _prefill(spec, _rows(1, n), torch.tensor([0]))
    rows_held = len(pattern.offsets(n + 1)) if rows_held is None else rows_held
    assert state.rows_held() == rows_held
    per_row = 2 * sum(WIDTH[k] for k in _names(spec)) * 4 + 8
    assert state.nbytes() == rows_held * per_row + CONV[0] * CONV[1] * 4
    assert _empty(spec, 1).nbytes() == CONV[0] * CONV[1] * 4


# --------------------------------------------------------------------------------------------------
# Fixed storage (the static cache): buffers allocated once, written in place


@pytest.mark.parametrize("spec", KEEP_ALL + FORGETTING)
def test_a_fixed_state_reads_what_the_growing_state_reads(spec):
    """After a prefill, both storages read the same rows at every later token, and a mixer step on either gives the
    same output; the fixed one keeps its buffers, shapes and addresses."""
    capacity, n = 24, 9
    start = torch.tensor([0, 4])
    rows = _rows(2, capacity, seed=8)
    grow = _prefill(spec, _upto(rows, n), start)
    fixed = _prefill(spec, _upto(rows, n), start, capacity=capacity)
    buffers = {k: (t.shape, t.data_ptr()) for k, t in fixed.buffers().items()}
    gen = torch.Generator().manual_seed(9)
    for t in range(n, capacity):
        assert torch.equal(fixed.next_position(), grow.next_position())
        assert _read(fixed) == _read(grow), f"token {t}"
        q, g = torch.randn(2, 2, 2, generator=gen), torch.rand(2, 2, generator=gen)
        token = {k: v[:, :, t] for k, v in rows.items() if k != "conv"}
        ys = [ops.recurrent_step(s, q, token["keys_a"], q, token["keys_b"], token["values"], g, conv=rows["conv"][:, t])
              for s in (grow, fixed)]
        torch.testing.assert_close(ys[1], ys[0], atol=1e-6, rtol=1e-6)
        assert int(fixed.seen) == fixed.count() == grow.count() == t + 1
    assert {k: (t.shape, t.data_ptr()) for k, t in fixed.buffers().items()} == buffers
    assert torch.equal(fixed.conv, grow.conv)


@pytest.mark.parametrize("spec", ["dense", "exp2:ce", "banded:2"])
def test_a_fixed_state_refuses_a_token_past_its_capacity(spec):
    rows = {k: v for k, v in _rows(1, 6).items() if k != "conv"}
    fixed = DecodeState.from_prefill(spec, rows, capacity=6)
    with pytest.raises(ValueError, match="the static cache is full: it holds max_cache_len = 6 tokens"):
        fixed.advance({k: v[:, :, 0] for k, v in rows.items()})
    with pytest.raises(ValueError, match="max_cache_len = 5 tokens, but the prompt already has 6"):
        DecodeState.from_prefill(spec, rows, capacity=5)


def test_a_fixed_state_crops_patterns_that_keep_every_token_only():
    rows = {k: v for k, v in _rows(2, 12, seed=3).items() if k != "conv"}
    fixed = DecodeState.from_prefill("dense", rows, capacity=16)
    fixed.crop(7)
    shorter = DecodeState.from_prefill("dense", {k: v[:, :, :7] for k, v in rows.items()}, capacity=16)
    assert int(fixed.seen) == 7 and _read(fixed) == _read(shorter)
    forgetting = DecodeState.from_prefill("exp2:ce", rows, capacity=16)
    with pytest.raises(ValueError, match="a static cache cannot be cropped back to 7 tokens for pattern 'exp2:ce'"):
        forgetting.crop(7)
    layer = ResolventCacheLayer("exp2:ce", max_cache_len=16)
    with pytest.raises(ValueError, match="a static cache cannot record past states for pattern 'exp2:ce'"):
        layer.activate_past_recording()
    layer = ResolventCacheLayer("dense", max_cache_len=16, conv_size=4)
    with pytest.raises(ValueError, match="a static cache cannot record past states for the short convolution"):
        layer.activate_past_recording()


@pytest.mark.parametrize("spec", ["dense", "exp2:ce", "banded:2"])
def test_a_fixed_state_selects_a_batch_in_its_buffers(spec):
    rows = _rows(3, 8, seed=4)
    start = torch.tensor([0, 2, 1])
    grow, fixed = _prefill(spec, rows, start), _prefill(spec, rows, start, capacity=12)
    pointers = [t.data_ptr() for t in fixed.buffers().values()]
    index = torch.tensor([2, 2, 0])
    grow.select_batch(index)
    fixed.select_batch(index)
    assert [t.data_ptr() for t in fixed.buffers().values()] == pointers  # same size: in place
    assert _read(fixed) == _read(grow)
    fixed.repeat_batch(2)  # another size: new buffers
    assert fixed.batch_size == 6 and fixed.start.tolist() == [1, 1, 1, 1, 0, 0]


def test_a_growing_state_that_keeps_every_token_appends_without_copying_its_rows():
    """Taking a token writes one row into spare rows of one buffer (reallocated a quarter larger when full), not a
    copy of every row; the rows read are those of the whole sequence."""
    rows = _rows(2, 300, seed=7)
    state = _prefill("dense", _upto(rows, 100))
    buffers = set()
    for t in range(100, 300):
        _stepped("dense", _upto(rows, t + 1), state=state)
        buffers.add(state.keys_a.data_ptr())
    assert len(buffers) <= 4  # 100 -> 164 -> 228 -> 292 -> 365 rows of capacity
    _assert_same(state, _prefill("dense", rows))


def test_a_decode_step_writes_in_place():
    """Every layout takes a token by writing into its buffers: no buffer of a state is replaced between growths."""
    for spec in ("dense", "banded:3", "exp2:ce"):
        rows = _rows(2, 40, seed=1)
        state = _prefill(spec, _upto(rows, 20), capacity=64)
        before = {k: t.data_ptr() for k, t in state.buffers().items()}
        _stepped(spec, rows, state=state)
        assert {k: t.data_ptr() for k, t in state.buffers().items()} == before, spec
