"""The chunked solves (``BlockConfig.sparse_solver = "chunked"``, ``dense_solver = "chunked"``) against the float64
reference, under Triton's interpreter.

Chunks of 16 rows (``chunk=16``), so the short sequences of the interpreter cross several chunks and reach held
rows far back (exp2:ce at n = 70 holds rows 64 positions before a chunk). The oracles, tolerances, NaN-filled
outputs and the interpreter fixture are those of ``test_triton.py``.
"""

from __future__ import annotations

import pytest
import torch
from hf_resolvent.backends.triton import aot, launching
from test_triton import _check_mix, _check_tied, _inputs, interpreter  # noqa: F401 (interpreter: autouse fixture)

from hf_resolvent.backends import triton as kernels
from hf_resolvent.ops.reference import mixer_matrices
from hf_resolvent.patterns import get_pattern

CHUNK = 16
SPARSE_RECURRENT = ["banded:2", "diagonal", "exp2", "exp2:ce", "square", "square:ce", "f:k**2+2"]


@pytest.fixture(autouse=True)
def chunked():
    with kernels.block_config(sparse_solver="chunked", dense_solver="chunked", chunk=CHUNK):
        yield


@pytest.mark.parametrize("pattern", ["dense", *SPARSE_RECURRENT])
def test_float32_forward_and_gradients(pattern):
    # n = 70: four full chunks and a partial one; e != d exercises the column masks.
    _check_mix(pattern, batch=1, heads=2, n=70, d=16, e=24, dtype=torch.float32, rel=1e-4)


@pytest.mark.parametrize("pattern", ["dense", "exp2:ce", "square:ce", "banded:3"])
def test_bfloat16_forward_and_gradients(pattern):
    _check_mix(pattern, batch=2, heads=1, n=45, d=16, e=16, dtype=torch.bfloat16, rel=3e-2)


@pytest.mark.parametrize("pattern", ["dense", "exp2:ce", "banded:2", "square"])
def test_left_padding(pattern):
    start = torch.tensor([0, 5, 21])  # 21 > one chunk: the padded rows span a whole chunk of positions
    _check_mix(pattern, batch=3, heads=1, n=53, d=16, e=16, dtype=torch.float32, rel=1e-4, start=start)


@pytest.mark.parametrize("n", [1, 5, 16])
def test_short_sequences(n):
    for pattern in ("dense", "exp2:ce"):
        _check_mix(pattern, batch=1, heads=2, n=n, d=16, e=16, dtype=torch.float32, rel=1e-4)


@pytest.mark.parametrize(("pattern", "dtype", "rel", "padded"), [
    ("square:ce", torch.float32, 1e-4, True),
    ("exp2", torch.bfloat16, 3e-2, False),
    ("dense", torch.float32, 1e-4, True),
])
def test_tied_variant(pattern, dtype, rel, padded):
    _check_tied(pattern, dtype, rel, padded)


@pytest.mark.parametrize("dense_solver", ["blocked", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_solves_reading_a_copy_of_the_solved_rows(dense_solver, dtype):
    """``solved_copy``: the dense solves' P.Y over earlier blocks, B^T W over later blocks and channel B's attention
    backward read the solved rows from a copy in the input dtype (rounded to bfloat16 here); forward and every
    gradient stay within the bfloat16 tolerance of the float64 reference, and float32 inputs read the rows
    themselves."""
    rel = 3e-2 if dtype == torch.bfloat16 else 1e-4
    with kernels.block_config(dense_solver=dense_solver, solved_copy=True):
        _check_mix("dense", batch=2, heads=1, n=45, d=16, e=16, dtype=dtype, rel=rel, start=torch.tensor([0, 20]))
        launches = aot.record_launches("dense", dtype=dtype, n=64, d=16, e=16)
    copy = dtype == torch.bfloat16
    for direction, read in (("fwd", "YREAD"), ("bwd", "WREAD")):
        solve = next(launch for launch in launches if launch.name.startswith("dense_") and direction in launch.name)
        assert solve.constexprs["COPY"] == copy and solve.args[read].dtype == dtype, direction
    channel_b = [launch for launch in launches if launch.name.startswith("attn_bwd") and launch.constexprs["STRICT"]]
    assert channel_b and all(launch.args["V"].dtype == dtype for launch in channel_b)


def test_the_chunked_solvers_run_the_chunk_kernels_and_the_blocked_ones_do_not():
    chunked = [launch.name for launch in aot.record_launches("exp2:ce", n=64, d=16, e=16)]
    assert chunked == ["sparse_direct_kernel", "chunk_prepare_kernel", "chunk_carry_kernel", "chunk_carry_kernel",
                       "chunk_rows_bwd_kernel", "chunk_grads_kernel", "decode_step_kernel", "decode_step_kernel"]
    dense = {launch.name: launch.grid for launch in aot.record_launches("dense", n=64, d=16, e=16)}
    assert {"dense_chunk_fwd_kernel", "dense_chunk_bwd_kernel"} <= set(dense)
    assert dense["dense_chunk_fwd_kernel"] == (64 // CHUNK,)  # one program per chunk of the one head
    with kernels.block_config(sparse_solver="blocked", dense_solver="blocked"):
        blocked = {launch.name for launch in aot.record_launches("exp2:ce", n=64, d=16, e=16)}
        blocked |= {launch.name for launch in aot.record_launches("dense", n=64, d=16, e=16)}
    assert not any("chunk" in name for name in blocked)
    assert {"sparse_solve_fwd_kernel", "dense_solve_fwd_kernel"} <= blocked


@pytest.mark.parametrize("pattern", ["dense", "exp2:ce"])
def test_every_block_of_a_chunked_dense_solve_is_claimed_once_and_published(pattern, monkeypatch):
    """The chunked dense solves keep the ticket schedule: after a forward and backward every chunk of every head is
    published and every ticket taken (a chunk that never published would leave the next one waiting on a GPU).
    The sparse chunked solves take no tickets at all."""
    schedules = []
    real = launching.progress_buffer
    monkeypatch.setattr(launching, "progress_buffer", lambda BH, device: schedules.append(real(BH, device)) or schedules[-1])
    batch, heads, n = 2, 2, 37
    _check_mix(pattern, batch=batch, heads=heads, n=n, d=16, e=16, dtype=torch.float32, rel=1e-4)
    nblk, BH = -(-n // CHUNK), batch * heads
    assert len(schedules) == (2 if pattern == "dense" else 0)
    for progress in schedules:
        assert progress.tolist() == [nblk] * BH + [nblk * BH]


@pytest.mark.parametrize(("pattern", "start"), [("dense", [0, 20]), ("exp2:ce", [0, 21]), ("square:ce", None)])
def test_the_forward_saves_each_blocks_inverse_for_the_backward(pattern, start, monkeypatch):
    """The backward applies T_c^T as the forward left it, so what the forward saves must be T_c = (I - B_cc)^-1
    of the pattern's B, for every block of every head: the dense blocks at fixed positions, the sparse chunks
    counted from the first real token; the identity on rows past n and in the padding."""
    saved = []
    real = launching.block_inverses
    monkeypatch.setattr(launching, "block_inverses", lambda *args: saved.append(real(*args)) or saved[-1])
    batch, n = 2, 45
    qa, ka, qb, kb, x, g, _ = _inputs(batch, 1, n, 16, 16, seed=3)
    start = None if start is None else torch.tensor(start)
    kernels.triton_mix(qa, ka, qb, kb, x.requires_grad_(), g, pattern, start=start)
    (inverses,) = saved
    nc = -(-n // CHUNK)
    assert inverses.shape == (batch, nc, CHUNK, CHUNK)
    _, b = mixer_matrices(*(t.double() for t in (qa, ka, qb, kb, g)), pattern, start=start)
    for i in range(batch):
        first = 0 if pattern == "dense" or start is None else int(start[i])
        for c in range(nc):
            rows = torch.arange(first + c * CHUNK, first + (c + 1) * CHUNK)
            real_rows = rows < n
            block = torch.zeros(CHUNK, CHUNK, dtype=torch.float64)
            inside = torch.nonzero(real_rows).flatten()
            block[inside[:, None], inside[None, :]] = b[i, 0][rows[inside][:, None], rows[inside][None, :]]
            want = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) - block)
            torch.testing.assert_close(inverses[i, c].double(), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, i=i, c=c: f"sequence {i}, block {c}: {m}")


@pytest.mark.parametrize("pattern", ["dense", "exp2:ce"])
def test_a_forward_without_gradients_keeps_no_inverses(pattern, monkeypatch):
    """Where no input needs a gradient (inference, or torch.no_grad on activations), no backward can follow: the
    forward keeps no block inverses, and its output is the same to the bit."""
    saved = []
    real = launching.block_inverses
    monkeypatch.setattr(launching, "block_inverses", lambda *args: saved.append(real(*args)) or saved[-1])
    qa, ka, qb, kb, x, g, _ = _inputs(2, 1, 45, 16, 16, seed=4)
    start = torch.tensor([0, 20])
    y = kernels.triton_mix(qa, ka, qb, kb, x, g, pattern, start=start)
    assert saved == []
    y_training = kernels.triton_mix(qa, ka, qb, kb, x.clone().requires_grad_(), g, pattern, start=start)
    assert len(saved) == 1
    assert torch.equal(y, y_training.detach())


@pytest.mark.parametrize("pattern", SPARSE_RECURRENT)
@pytest.mark.parametrize("n", [70, 300])
def test_held_table_lists_exactly_the_rows_each_chunk_reads(pattern, n):
    """Row c of the held table holds every source before chunk c that one of its rows reads, once, and nothing else;
    the reads table marks exactly the (row, source) pairs of the pattern, by column of the chunk or of its held row.
    Both are checked here against the pattern's source index."""
    held, reads = launching.held_table(get_pattern(pattern), n, CHUNK)
    sources = get_pattern(pattern).source_index(n)
    HM = held.shape[1]
    assert held.shape[0] == -(-n // CHUNK) and HM >= 16 and HM & (HM - 1) == 0
    assert reads.shape == (held.shape[0], CHUNK, CHUNK + HM) and reads.dtype == torch.int8
    for c in range(held.shape[0]):
        c0 = c * CHUNK
        read = sources[c0:c0 + CHUNK]
        expected = sorted({int(j) for j in read[(read >= 0) & (read < c0)]})
        row = held[c].tolist()
        assert row[:len(expected)] == expected and all(v == -1 for v in row[len(expected):]), c
        columns = {j: c0 + j for j in range(CHUNK)} | {CHUNK + h: j for h, j in enumerate(expected)}
        marked = {(i, columns[int(col)]) for i, col in reads[c].nonzero().tolist()}
        assert marked == {(i, int(j)) for i in range(read.shape[0]) for j in read[i] if j >= 0}, c


def test_cache_efficient_chunks_carry_few_rows():
    """What the chain carries per chunk of 64 rows: exp2:ce holds at most 16 earlier rows up to 32k (one tile),
    square:ce a few tiles; a plain f-pattern holds far more (why the cache-efficient patterns suit the chain)."""
    assert launching.held_table(get_pattern("exp2:ce"), 32768, 64)[0].shape[1] == 16
    assert launching.held_table(get_pattern("square:ce"), 4096, 64)[0].shape[1] == 64
    assert launching.held_table(get_pattern("exp2"), 4096, 64)[0].shape[1] >= 256


def test_held_tables_are_copied_to_the_device_once_for_every_launch():
    """Each forward looks the held tables up once, later calls at the same length reading the same device copy, and
    its backward reads what the forward read (saved beside the other tensors)."""
    launching.held_tables_on.cache_clear()
    for _ in range(2):
        _check_mix("exp2:ce", batch=1, heads=1, n=40, d=16, e=16, dtype=torch.float32, rel=1e-4)
    info = launching.held_tables_on.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_held_tables_stay_on_the_cpu_whatever_the_callers_device():
    launching.held_table.cache_clear()
    with torch.device("meta"):
        held, reads = launching.held_table(get_pattern("exp2:ce"), 100, CHUNK)
    assert held.device.type == reads.device.type == "cpu"
    with pytest.raises(ValueError, match="'dense' has no held rows"):
        launching.held_table(get_pattern("dense"), 100, CHUNK)


def test_bad_solver_settings_are_refused():
    with pytest.raises(ValueError, match="BlockConfig.chunk must be a power of two >= 16"):
        kernels.block_config(chunk=48).__enter__()
    for name in ("sparse_solver", "dense_solver"):
        with pytest.raises(ValueError, match=f"BlockConfig.{name} must be one of 'blocked', 'chunked'"):
            kernels.block_config(**{name: "parallel"}).__enter__()
