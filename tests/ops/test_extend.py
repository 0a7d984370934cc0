"""Tests of several tokens at once after a decode state (hf_resolvent.ops.extend): the chunks equal the reference over
the whole sequence and the same tokens one decode step each (on the compiled slot kernels and in PyTorch), leave the
same state, run where the dispatch says, and refuse a state that does not hold what the pattern reads.

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import make_mixer_inputs
from test_mixer import RESOLVENT, SPECS, assert_close

from hf_resolvent.ops import (
    DecodeState,
    decode_tokens,
    extend_mix,
    mixer,
    recurrent_mix,
    reference_mix,
)
from hf_resolvent.patterns import get_pattern

N, FIRST, CUTS = 90, 23, (23, 24, 61, 90)  # a prefill of FIRST tokens, then chunks of 1, 37 and 29 tokens
NAMES = ("qa", "ka", "qb", "kb", "x", "g")


def _inputs(pattern, seed):
    """float64 inputs of batch 2, sequence 1 left-padded by 5; None for what attention patterns do not take."""
    inp = make_mixer_inputs(batch=2, heads=2, n=N, d=4, e=3, dtype=torch.float64, seed=seed)
    if not pattern.has_recurrence:
        inp.update(qb=None, kb=None, g=None)
    return inp, torch.tensor([0, 5])


def _part(inp, a, b, names=NAMES):
    return [None if inp[k] is None else inp[k][:, :, a:b] for k in names]


def _tied(inp, a, b):
    """The tied variant's positional inputs (no A scores) of tokens [a, b), and its d."""
    return [None, None, *_part(inp, a, b, ("qb", "kb", "x", "g"))], inp["d_skip"][:, :, a:b]


def _empty(pattern, inp, start, tied=False, capacity=None) -> DecodeState:
    """A state before the first token for these inputs (buffers that grow, or for ``capacity`` tokens)."""
    names = ("keys_b", "outputs") if tied else ("keys_a", "values") + (("keys_b", "outputs")
                                                                      if pattern.has_recurrence else ())
    widths = {name: inp["x" if name in ("values", "outputs") else "ka"].shape[-1] for name in names}
    return DecodeState.empty(pattern, widths, 2, 2, capacity, torch.float64, start=start)


def _states(pattern, inp, start, tied=False, capacity=None):
    """Two copies of the state after the first FIRST tokens (one decode step each)."""
    states = []
    for _ in range(2):
        state = _empty(pattern, inp, start, tied, capacity)
        if tied:
            args, d = _tied(inp, 0, FIRST)
            recurrent_mix(*args, pattern, start=start, state=state, d=d)
        else:
            recurrent_mix(*_part(inp, 0, FIRST), pattern, start=start, state=state)
        states.append(state)
    return states


def _assert_same_state(got: DecodeState, want: DecodeState):
    """The same tokens taken, and the same row wherever a row holds one (the buffers may have grown apart)."""
    assert got.count() == want.count()
    (got_rows, got_pos), (want_rows, want_pos) = got.view(), want.view()
    assert torch.equal(got_pos, want_pos)
    held = (want_pos >= 0)[:, None, :, None]
    for name, t in want_rows.items():
        assert_close(torch.where(held, got_rows[name], 0.0), torch.where(held, t, 0.0), name, tol=1e-12)


@pytest.mark.parametrize("key", list(SPECS))
def test_chunks_equal_the_whole_sequence_and_the_same_tokens_step_by_step(key, cpu_path):
    pattern = get_pattern(SPECS[key])
    inp, start = _inputs(pattern, seed=3)
    chunked, stepped = _states(pattern, inp, start)
    ys, steps = [], []
    for a, b in zip(CUTS, CUTS[1:]):
        ys.append(extend_mix(chunked, *_part(inp, a, b), pattern))
        steps.append(recurrent_mix(*_part(inp, a, b), pattern, state=stepped))
    whole = reference_mix(*_part(inp, 0, N), pattern, start=start)
    assert_close(torch.cat(ys, 2), whole[:, :, FIRST:], f"{key}: chunks vs reference", tol=1e-12)
    assert_close(torch.cat(ys, 2), torch.cat(steps, 2), f"{key}: chunks vs steps", tol=1e-12)
    _assert_same_state(chunked, stepped)


@pytest.mark.parametrize("key", RESOLVENT)
def test_tied_chunks_equal_the_whole_sequence_and_the_same_tokens_step_by_step(key, cpu_path):
    pattern = get_pattern(SPECS[key])
    inp, start = _inputs(pattern, seed=4)
    chunked, stepped = _states(pattern, inp, start, tied=True)
    ys, steps = [], []
    for a, b in zip(CUTS, CUTS[1:]):
        args, d = _tied(inp, a, b)
        ys.append(extend_mix(chunked, *args, pattern, d=d))
        steps.append(recurrent_mix(*args, pattern, state=stepped, d=d))
    args, d = _tied(inp, 0, N)
    whole = reference_mix(*args, pattern, start=start, d=d)
    assert_close(torch.cat(ys, 2), whole[:, :, FIRST:], f"{key}: tied chunks vs reference", tol=1e-12)
    assert_close(torch.cat(ys, 2), torch.cat(steps, 2), f"{key}: tied chunks vs steps", tol=1e-12)
    _assert_same_state(chunked, stepped)


@pytest.mark.parametrize("key", list(SPECS))
def test_chunks_continue_a_static_state_in_its_buffers(key, cpu_path):
    """A static state (the static cache) takes chunks too, written in place: the outputs of chunks and of the decode
    steps after them equal the reference, and its buffers keep their shapes and storage."""
    pattern = get_pattern(SPECS[key])
    inp, start = _inputs(pattern, seed=10)
    state = _states(pattern, inp, start, capacity=N + 3)[0]
    buffers = {name: (t.shape, t.data_ptr()) for name, t in state.buffers().items()}
    ys = [extend_mix(state, *_part(inp, a, b), pattern) for a, b in zip(CUTS[:-1], CUTS[1:-1])]
    ys.append(recurrent_mix(*_part(inp, CUTS[-2], N), pattern, state=state))  # then token by token
    whole = reference_mix(*_part(inp, 0, N), pattern, start=start)
    assert_close(torch.cat(ys, 2), whole[:, :, FIRST:], f"{key}: static state, chunks then steps", tol=1e-12)
    assert {name: (t.shape, t.data_ptr()) for name, t in state.buffers().items()} == buffers
    assert int(state.seen) == N
    with pytest.raises(ValueError, match="static cache is full"):  # 3 rows left, 4 tokens
        extend_mix(state, *_part(inp, 0, 4), pattern)


def test_chunks_run_where_the_backend_has_them_and_steps_elsewhere(monkeypatch):
    """decode_tokens runs several tokens at once where the backend's row has that path and the state allows it,
    else one decode step each; both give the same outputs."""
    assert {name for name, b in mixer.BACKENDS.items() if b.tokens is None} == {"triton", "graph"}
    pattern = get_pattern("exp2:ce")
    inp, start = _inputs(pattern, seed=5)
    state, _ = _states(pattern, inp, start)
    assert state.can_extend()
    state.record_history()  # a rollback needs the state before each token: steps
    assert not state.can_extend()
    dense, _ = _states(get_pattern("dense"), inp, start)
    dense.record_history()
    assert dense.can_extend()  # that one crops by marking rows empty
    with pytest.raises(RuntimeError, match="token by token"):
        state.extend({"outputs": inp["x"][:, :, :2]}, torch.tensor([[23, 24], [18, 19]]))
    static, _ = _states(pattern, inp, start, capacity=N)
    assert static.can_extend()
    chunks = []
    cpu = mixer.BACKENDS["cpu"]
    monkeypatch.setitem(mixer.BACKENDS, "cpu", replace(cpu, tokens=lambda *a, **k: chunks.append(1) or cpu.tokens(*a, **k)))
    stepwise = replace(cpu, tokens=None)
    for tied in (False, True):
        args, d = _tied(inp, FIRST, N) if tied else (_part(inp, FIRST, N), None)
        chunked, stepped = _states(pattern, inp, start, tied=tied)
        y = decode_tokens(chunked, *args, pattern, d=d)
        assert chunks.pop() and not chunks
        with monkeypatch.context() as m:
            m.setitem(mixer.BACKENDS, "cpu", stepwise)
            assert_close(y, decode_tokens(stepped, *args, pattern, d=d), f"decode_tokens, tied={tied}", tol=1e-12)


def test_a_state_that_lacks_the_rows_a_pattern_reads_is_refused():
    """A state kept for exp2:ce holds a few rows; read as banded:8 it lacks the last eight: an error, not a guess."""
    inp, start = _inputs(get_pattern("exp2:ce"), seed=6)
    state, _ = _states(get_pattern("exp2:ce"), inp, start)
    state.pattern = get_pattern("banded:8")  # the same rows, read by another pattern's rule
    with pytest.raises(RuntimeError, match="no longer holds"):
        extend_mix(state, *_part(inp, FIRST, N))


def test_tokens_inside_the_left_padding_are_refused():
    pattern = get_pattern("dense")
    inp, _ = _inputs(pattern, seed=7)
    state = _empty(pattern, inp, torch.tensor([0, 40]))  # sequence 1 has 40 padding tokens still to come
    with pytest.raises(ValueError, match="left padding"):
        extend_mix(state, *_part(inp, FIRST, N), pattern)


def test_sparse_chunks_take_the_compiled_slot_kernels_where_the_parallel_form_would(monkeypatch, cpu_path):
    """On the compiled path a sparse pattern's chunk runs the C++ slot kernels; dense patterns, the PyTorch path and
    chunks that record gradients run the PyTorch code."""
    from hf_resolvent.ops import extend

    calls = []
    on_kernels = extend._sparse_on_cpu_kernels
    monkeypatch.setattr(extend, "_sparse_on_cpu_kernels", lambda *a, **k: calls.append(1) or on_kernels(*a, **k))
    for spec in ("exp2:ce", "dense"):
        pattern = get_pattern(spec)
        inp, start = _inputs(pattern, seed=8)
        state, _ = _states(pattern, inp, start)
        extend_mix(state, *_part(inp, FIRST, N), pattern)
    assert len(calls) == (1 if cpu_path == "compiled" else 0)
    pattern = get_pattern("exp2:ce")
    inp, start = _inputs(pattern, seed=9)
    state, _ = _states(pattern, inp, start)
    grads = [None if t is None else t.requires_grad_() for t in _part(inp, FIRST, N)]
    extend_mix(state, *grads, pattern).sum().backward()
    assert len(calls) == (1 if cpu_path == "compiled" else 0) and grads[0].grad is not None
