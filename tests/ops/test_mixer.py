"""Tests of hf_resolvent.ops: the reference, parallel, graph and recurrent forms agree (plain and tied variants),
left padding, gradients, boundedness, the decode state of cache-efficient patterns, and input errors.

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import cubic_plus_one, empty_state, make_mixer_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_resolvent.ops import (
    graph_mix,
    mixer_matrices,
    parallel_mix,
    recurrent_mix,
    recurrent_step,
    reference_mix,
    resolvent_mix,
)
from hf_resolvent.patterns import get_pattern

# Every kind of pattern, including a user expression and a user callable (plain and cache-efficient).
SPECS = {
    "attention": "attention",
    "local_attention:5": "local_attention:5",
    "dense": "dense",
    "banded:3": "banded:3",
    "diagonal": "diagonal",
    "exp2": "exp2",
    "exp2:ce": "exp2:ce",
    "square": "square",
    "square:ce": "square:ce",
    "f:k**2+k+1": "f:k**2+k+1",
    "f:k**2+k+1:ce": "f:k**2+k+1:ce",
    "callable": get_pattern(cubic_plus_one),
    "callable:ce": get_pattern(cubic_plus_one, cache_efficient=True),
}
RESOLVENT = [k for k in SPECS if get_pattern(SPECS[k]).has_recurrence]
FORMS = ("reference", "parallel", "graph", "recurrent")
TOL = 1e-5  # float32 agreement


# the forms are functions; "parallel" is resolvent_mix's own (on the CPU kernels or PyTorch, as cpu_path sets)
FORM_FUNCTIONS = {"reference": reference_mix, "graph": graph_mix, "recurrent": recurrent_mix}


def mix(spec, inp, form, start=None, **kw):
    """The mixer in ``form`` (a form's name, or an ``impl`` of resolvent_mix) on a dict of inputs; attention patterns
    get None for the unused qb, kb, g."""
    pattern = get_pattern(spec)
    qb, kb, g = (inp["qb"], inp["kb"], inp["g"]) if pattern.has_recurrence else (None, None, None)
    args = (inp["qa"], inp["ka"], qb, kb, inp["x"], g, pattern)
    if form in FORM_FUNCTIONS:
        return FORM_FUNCTIONS[form](*args, start=start, **kw)
    return resolvent_mix(*args, impl="auto" if form == "parallel" else form, start=start, **kw)


def mix_tied(spec, inp, form, start=None, **kw):
    """The tied variant (``d``, no A scores) in ``form``."""
    args = (None, None, inp["qb"], inp["kb"], inp["x"], inp["g"], spec)
    if form in FORM_FUNCTIONS:
        return FORM_FUNCTIONS[form](*args, start=start, d=inp["d_skip"], **kw)
    return resolvent_mix(*args, impl="auto" if form == "parallel" else form, start=start, d=inp["d_skip"], **kw)


def padded_case(n, pad, seed):
    """Inputs of batch 2 where sequence 1 is left-padded by ``pad`` garbage positions, and the inputs of
    sequence 1 alone (its n - pad real positions)."""
    inp = make_mixer_inputs(batch=2, heads=3, n=n, d=8, e=5, seed=seed)
    alone = {k: v[1:2, :, pad:].clone() for k, v in inp.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for k, v in inp.items():  # garbage on the padding: it must never be read
        if k == "g":
            v[1, :, :pad] = torch.rand(v[1, :, :pad].shape, generator=gen)
        else:
            v[1, :, :pad] = 30 * torch.randn(v[1, :, :pad].shape, generator=gen)
    return inp, alone, torch.tensor([0, pad])


def assert_close(actual, expected, what, tol=TOL):
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= tol, f"{what}: max abs difference {err:.3g} > {tol:g}"


# --------------------------------------------------------------------------------------------------
# The three forms agree


@pytest.mark.parametrize("key", list(SPECS))
def test_three_forms_agree(key, cpu_path):
    """For n a multiple of the default chunk (64) and not (97), batch 2, 3 heads, d = 8 != e = 5."""
    spec = SPECS[key]
    for n in (64, 97):
        inp = make_mixer_inputs(batch=2, heads=3, n=n, d=8, e=5, seed=n)
        out = {impl: mix(spec, inp, impl) for impl in FORMS}
        assert out["reference"].shape == (2, 3, n, 5) and out["reference"].dtype == torch.float32
        for impl in FORMS[1:]:
            assert out[impl].dtype == torch.float32
            assert_close(out[impl], out["reference"], f"{impl} vs reference, n = {n}")


@pytest.mark.parametrize("key", list(SPECS))
def test_three_forms_agree_with_left_padding(key, cpu_path):
    """Left padding: the padded sequence equals the sequence alone on its real rows, padded rows are 0."""
    spec = SPECS[key]
    for n, pad in ((64, 13), (97, 40)):
        inp, alone, start = padded_case(n, pad, seed=n)
        out = {impl: mix(spec, inp, impl, start=start) for impl in FORMS}
        for impl in FORMS:
            y = out[impl]
            assert_close(y, out["reference"], f"{impl} vs reference with start, n = {n}")
            assert torch.all(y[1, :, :pad] == 0), f"{impl}: padded rows must be 0"
            y_alone = mix(spec, alone, impl)
            assert_close(y[1:2, :, pad:], y_alone, f"{impl}: padded sequence vs the sequence alone")
            unpadded = mix(spec, {k: v[0:1] for k, v in inp.items()}, impl)
            assert_close(y[0:1], unpadded, f"{impl}: unpadded row of a padded batch vs alone")


@pytest.mark.parametrize("key", list(SPECS))
def test_parallel_chunk_boundaries(key, cpu_path):
    """Small chunks: many chunk boundaries, lengths that are and are not multiples, a custom scale."""
    pattern = get_pattern(SPECS[key])
    for n, chunk in ((48, 16), (53, 16), (29, 5)):
        clean = make_mixer_inputs(batch=2, heads=3, n=n, d=8, e=5, seed=chunk + n)
        padded, _, start = padded_case(n, 7, seed=chunk + n)
        for s, inp in ((None, clean), (start, padded)):
            qb, kb, g = (inp["qb"], inp["kb"], inp["g"]) if pattern.has_recurrence else (None, None, None)
            ref = reference_mix(inp["qa"], inp["ka"], qb, kb, inp["x"], g, pattern, start=s, scale=0.3)
            for name, form in (("parallel", parallel_mix), ("graph", graph_mix)):
                par = form(inp["qa"], inp["ka"], qb, kb, inp["x"], g, pattern, start=s, scale=0.3, chunk=chunk)
                assert_close(par, ref, f"{name} (chunk {chunk}, n {n}, start {s}) vs reference")
                if pattern.has_recurrence:
                    ref_t = reference_mix(None, None, qb, kb, inp["x"], g, pattern, start=s, scale=0.3, d=inp["d_skip"])
                    par_t = form(None, None, qb, kb, inp["x"], g, pattern, start=s, scale=0.3, chunk=chunk,
                                 d=inp["d_skip"])
                    assert_close(par_t, ref_t, f"tied {name} (chunk {chunk}, n {n}, start {s}) vs reference")


@pytest.mark.parametrize("spec", ["dense", "exp2:ce", "banded:3"])
def test_recurrent_gradients_equal_reference_gradients(spec, cpu_path):
    """The compiled decode step has no backward: a step whose inputs need gradients takes the PyTorch code."""
    inp = make_mixer_inputs(batch=2, heads=2, n=23, d=8, e=5, seed=7, dtype=torch.float64)
    grads = {}
    for impl in ("reference", "recurrent"):
        leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
        mix(spec, leaves, impl).sum().backward()
        grads[impl] = {k: v.grad for k, v in leaves.items() if k != "d_skip"}
    for k, g in grads["reference"].items():
        assert_close(grads["recurrent"][k], g, f"d{k}", tol=1e-10)


@pytest.mark.parametrize("key", RESOLVENT)
def test_tied_forms_agree(key, cpu_path):
    spec = SPECS[key]
    for n, pad in ((64, 9), (97, 31)):
        inp = make_mixer_inputs(batch=2, heads=3, n=n, d=8, e=5, seed=3 * n)
        out = {impl: mix_tied(spec, inp, impl) for impl in FORMS}
        for impl in FORMS[1:]:
            assert_close(out[impl], out["reference"], f"tied {impl} vs reference, n = {n}")
        inp, alone, start = padded_case(n, pad, seed=n + 5)
        ref = mix_tied(spec, inp, "reference", start=start)
        for impl in FORMS:
            y = mix_tied(spec, inp, impl, start=start)
            assert_close(y, ref, f"tied {impl} vs reference with start")
            assert torch.all(y[1, :, :pad] == 0)
            assert_close(y[1:2, :, pad:], mix_tied(spec, alone, impl), f"tied {impl}: padded vs alone")


def test_tied_is_the_untied_mixer_with_a_equal_b_d_plus_d_prime():
    """Tied y = (I - B)^-1 (B D + D') x with D' = 1 - g - D, checked against an explicit solve in float64."""
    inp = make_mixer_inputs(batch=1, heads=2, n=23, d=4, e=3, dtype=torch.float64, seed=11)
    for spec in ("dense", "exp2:ce", "banded:2"):
        _, b = mixer_matrices(None, None, inp["qb"], inp["kb"], inp["g"], spec)
        g_eff = b.sum(-1)
        dd = inp["d_skip"]
        a = b * dd[..., None, :] + torch.diag_embed(1 - g_eff - dd)
        eye = torch.eye(23, dtype=torch.float64)
        expected = torch.linalg.solve(eye - b, a @ inp["x"])
        for impl in FORMS:
            assert_close(mix_tied(spec, inp, impl), expected, f"tied {impl} {spec}", tol=1e-12)


def test_reference_is_the_definition():
    """y_i = sum_j alpha_ij x_j + sum_{j<i} beta_ij y_j, by a Python loop in float64."""
    inp = make_mixer_inputs(batch=1, heads=1, n=17, d=4, e=3, dtype=torch.float64, seed=2)
    for spec in ("dense", "square:ce", "local_attention:3"):
        pattern = get_pattern(spec)
        scale = 4**-0.5
        y = torch.zeros(17, 3, dtype=torch.float64)
        for i in range(1, 18):
            pa, pb = pattern.direct(i), pattern.attended(i)
            sa = torch.stack([inp["qa"][0, 0, i - 1] @ inp["ka"][0, 0, j - 1] * scale for j in pa])
            out = torch.softmax(sa, 0) @ inp["x"][0, 0, [j - 1 for j in pa]]
            if pb:
                sb = torch.stack([inp["qb"][0, 0, i - 1] @ inp["kb"][0, 0, j - 1] * scale for j in pb])
                gi = inp["g"][0, 0, i - 1]
                out = (1 - gi) * out + gi * torch.softmax(sb, 0) @ y[[j - 1 for j in pb]]
            y[i - 1] = out
        for impl in FORMS:
            assert_close(mix(spec, inp, impl)[0, 0], y, f"{impl} {spec} vs the definition", tol=1e-12)


EDGE_SPECS = list(SPECS.values()) + ["f:2*k+3", "local_attention:40", "banded:40"]


@pytest.mark.parametrize("n", [1, 2, 3, 66])
def test_forms_agree_float64_edge_lengths(n):
    """float64, every pattern plus f(0) > 1 and windows longer than n, single-token and short sequences,
    a start leaving one real token; 'auto' is the parallel form on CPU tensors."""
    for spec in EDGE_SPECS:
        pattern = get_pattern(spec)
        inp = make_mixer_inputs(batch=2, heads=2, n=n, d=4, e=3, dtype=torch.float64, seed=n)
        for start in (None, torch.tensor([n - 1, 0], dtype=torch.int32)):
            ref = mix(spec, inp, "reference", start=start)
            assert ref.dtype == torch.float64
            for impl in ("parallel", "recurrent", "auto"):
                assert_close(mix(spec, inp, impl, start=start), ref, f"{impl} {pattern.name} n={n}", tol=1e-12)
            if pattern.has_recurrence:
                ref = mix_tied(spec, inp, "reference", start=start)
                for impl in ("parallel", "recurrent", "auto"):
                    assert_close(mix_tied(spec, inp, impl, start=start), ref, f"tied {impl} {pattern.name}",
                                 tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_their_dtype(dtype):
    inp = make_mixer_inputs(batch=1, heads=2, n=40, d=8, e=4, seed=21)
    ref = mix("exp2:ce", inp, "reference")
    low = {k: v.to(dtype) for k, v in inp.items()}
    for impl in FORMS:
        y = mix("exp2:ce", low, impl)
        assert y.dtype == dtype
        assert_close(y.float(), ref, f"{impl} in {dtype}", tol=0.05)


# --------------------------------------------------------------------------------------------------
# Gradients


def _grads(fn, inputs, names):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    y = fn(leaves)
    weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=y.dtype)
    (y * weight).sum().backward()
    return {k: leaves[k].grad for k in names}


@pytest.mark.parametrize("key", list(SPECS))
def test_parallel_gradients_equal_reference_gradients(key, cpu_path):
    check_gradients(key, parallel_mix)


@pytest.mark.parametrize("key", list(SPECS))
def test_graph_gradients_equal_reference_gradients(key):
    """The graph form has no backward of its own: autograd's, through gathers and triangular solves."""
    check_gradients(key, graph_mix)


def check_gradients(key, form):
    pattern = get_pattern(SPECS[key])
    inp, _, start = padded_case(21, 5, seed=4)
    inp = {k: v.double() for k, v in inp.items()}
    if pattern.has_recurrence:
        names = ["qa", "ka", "qb", "kb", "x", "g"]

        def run(impl_fn, **kw):
            return lambda t: impl_fn(t["qa"], t["ka"], t["qb"], t["kb"], t["x"], t["g"], pattern, start=start, **kw)
    else:
        names = ["qa", "ka", "x"]

        def run(impl_fn, **kw):
            return lambda t: impl_fn(t["qa"], t["ka"], None, None, t["x"], None, pattern, start=start, **kw)

    ref = _grads(run(reference_mix), inp, names)
    par = _grads(run(form, chunk=8), inp, names)
    for k in names:
        assert ref[k] is not None and par[k] is not None, k
        assert_close(par[k], ref[k], f"gradient of {k}", tol=1e-10)
        assert torch.all(par[k][1, :, :5] == 0), f"padding of {k} must get no gradient"
    if pattern.has_recurrence:
        names = ["qb", "kb", "x", "g", "d_skip"]
        args = lambda t: (None, None, t["qb"], t["kb"], t["x"], t["g"], pattern)  # noqa: E731
        ref = _grads(lambda t: reference_mix(*args(t), start=start, d=t["d_skip"]), inp, names)
        par = _grads(lambda t: form(*args(t), start=start, chunk=8, d=t["d_skip"]), inp, names)
        for k in names:
            assert_close(par[k], ref[k], f"tied gradient of {k}", tol=1e-10)


@pytest.mark.parametrize("spec", ["attention", "dense"])
def test_parallel_at_split_causal_lengths(spec, cpu_path):
    """n = 400, d = e, left padding: the lengths where the PyTorch path's direct term is a row tree of flash calls
    (ops.attention.causal_attention), and the compiled attention's chunks there; outputs and gradients equal the
    reference's."""
    pattern = get_pattern(spec)
    inp, _, start = padded_case(400, 7, seed=9)
    inp["x"] = torch.randn(2, 3, 400, 8, generator=torch.Generator().manual_seed(9))
    names = ["qa", "ka", "x"] + (["qb", "kb", "g"] if pattern.has_recurrence else [])
    inp = {k: v.requires_grad_(k in names) for k, v in inp.items()}
    dy = torch.randn(2, 3, 400, 8, generator=torch.Generator().manual_seed(10))
    out = {impl: mix(spec, inp, impl, start=start) for impl in ("reference", "parallel")}
    assert_close(out["parallel"], out["reference"], f"{spec} n=400")
    grads = {impl: torch.autograd.grad(y, [inp[k] for k in names], dy) for impl, y in out.items()}
    for k, par, ref in zip(names, grads["parallel"], grads["reference"]):
        assert_close(par, ref, f"gradient of {k}", tol=1e-4)


@pytest.mark.parametrize("spec", ["dense", "exp2:ce", "square"])
def test_gradcheck_parallel(spec, cpu_path):
    pattern = get_pattern(spec)
    inp = make_mixer_inputs(batch=2, heads=1, n=10, d=3, e=2, dtype=torch.float64, seed=5, requires_grad=True)
    start = torch.tensor([0, 3])
    args = (inp["qa"], inp["ka"], inp["qb"], inp["kb"], inp["x"], inp["g"])
    fn = lambda *a: parallel_mix(*a, pattern, start=start, chunk=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)
    fn_nostart = lambda *a: parallel_mix(*a, pattern, chunk=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn_nostart, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ["dense", "exp2:ce"])
def test_gradcheck_parallel_tied(spec):
    pattern = get_pattern(spec)
    inp = make_mixer_inputs(batch=2, heads=1, n=10, d=3, e=2, dtype=torch.float64, seed=6, requires_grad=True)
    start = torch.tensor([2, 0])
    args = (inp["qb"], inp["kb"], inp["x"], inp["g"], inp["d_skip"])
    fn = lambda qb, kb, x, g, d: parallel_mix(None, None, qb, kb, x, g, pattern, start=start, chunk=4, d=d)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Boundedness: rows of A + B sum to 1, so ||y_i|| <= max_{j <= i} ||x_j|| at any length, in any dtype


@pytest.mark.parametrize("key", list(SPECS))
def test_rows_of_a_plus_b_sum_to_one(key):
    pattern = get_pattern(SPECS[key])
    inp, _, start = padded_case(30, 6, seed=8)
    inp = {k: v.double() for k, v in inp.items()}
    a, b = mixer_matrices(inp["qa"], inp["ka"], inp["qb"], inp["kb"], inp["g"], pattern, start=start)
    mask_a, mask_b = pattern.masks(30)
    assert torch.all(a >= 0) and torch.all(b >= 0)
    sums = (a + b).sum(-1)
    assert_close(sums[0], torch.ones_like(sums[0]), "row sums", tol=1e-12)
    assert_close(sums[1, :, 6:], torch.ones_like(sums[1, :, 6:]), "row sums after padding", tol=1e-12)
    assert torch.all(a[1, :, :6] == 0) and torch.all(b[1, :, :6] == 0) and torch.all(a[1, :, :, :6] == 0)
    assert torch.all(a[0][:, ~mask_a] == 0) and torch.all(b[0][:, ~mask_b] == 0)
    assert torch.all(a[1, :, 6:, 6:][:, ~mask_a[:24, :24]] == 0)
    assert torch.all(b[1, :, 6:, 6:][:, ~mask_b[:24, :24]] == 0)
    assert torch.all(b[:, :, :, :].triu() == 0), "B must be strictly lower triangular"
    assert torch.all(b[0, :, 0] == 0) and torch.all(b[1, :, 6] == 0), "first real row has no B set: g = 0"


def _check_bounded(y, x):
    norms_y = y.float().norm(dim=-1)
    running_max = x.float().norm(dim=-1).cummax(dim=-1).values
    tol = 1e-4 if y.dtype == torch.float32 else 1e-2  # bf16 output rounding is ~2^-8 relative
    excess = (norms_y - running_max * (1 + tol)).max().item()
    assert torch.isfinite(y.float()).all()
    assert excess <= 1e-6, f"||y_i|| exceeds max_(j<=i) ||x_j|| by {excess:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec, n", [("exp2", 8192), ("exp2:ce", 8192), ("square:ce", 8192), ("banded:16", 8192),
                                     ("dense", 1024)])
def test_boundedness(spec, n, dtype):
    """Random inputs with sharp softmaxes, gates close to 1 and values of very different norms."""
    inp = make_mixer_inputs(batch=1, heads=2, n=n, d=16, e=8, seed=9, qk_scale=3.0, gate_range=(0.5, 0.9999))
    gen = torch.Generator().manual_seed(10)
    inp["x"] = inp["x"] * torch.exp(2 * torch.randn(1, 2, n, 1, generator=gen))
    inp = {k: v.to(dtype) for k, v in inp.items()}
    y = mix(spec, inp, "parallel")
    assert y.dtype == dtype and y.shape == (1, 2, n, 8)
    _check_bounded(y, inp["x"])
    # One value everywhere: a convex combination returns it exactly (a row sum of 1 + eps would compound)
    const = dict(inp, x=torch.ones_like(inp["x"]) * torch.tensor([0.5, -1.0, 2.0, 0.25, 1.0, -0.5, 0.75, 1.5]).to(dtype))
    y_const = mix(spec, const, "parallel").float()
    assert (y_const - const["x"].float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)
    y_tied_z = mix_tied(spec, inp, "parallel") + inp["d_skip"][..., None].float() * inp["x"].float()
    _check_bounded(y_tied_z.to(dtype), inp["x"])  # the tied z = y + d x is a convex combination too


# --------------------------------------------------------------------------------------------------
# Decode state


@pytest.mark.parametrize("key", list(SPECS))
def test_recurrent_state_rows_follow_cache_size(key):
    pattern = get_pattern(SPECS[key])
    n = 70
    inp = make_mixer_inputs(batch=1, heads=2, n=n, d=4, e=3, seed=12)
    state = empty_state(pattern, inp)
    ys = []
    for t in range(n):
        step = {k: v[:, :, t] for k, v in inp.items()}
        ys.append(recurrent_step(state, step["qa"], step["ka"], step["qb"], step["kb"], step["x"], step["g"],
                                 pattern))
        # a register keeps one slot per offset f(k) <= n (a position may sit in two), the others what later read
        want = len(pattern.offsets(t + 2)) if state.layout == "slots" else pattern.cache_size(t + 1)
        assert state.rows_held() == want, f"rows held after {t + 1} tokens"
        assert state.seen == t + 1
    assert_close(torch.stack(ys, 2), mix(SPECS[key], inp, "reference"), "step by step vs reference")


@pytest.mark.parametrize("key", ["exp2:ce", "square:ce", "f:k**2+k+1:ce", "callable:ce"])
def test_cache_efficient_state_holds_exactly_s_next(key):
    """After n tokens a sequence's state holds the distinct positions of S_{n+1}, nothing else."""
    pattern = get_pattern(SPECS[key])
    n, batch, heads, d, e = 150, 2, 2, 4, 3
    start = torch.tensor([0, 11])
    inp = make_mixer_inputs(batch=batch, heads=heads, n=n, d=d, e=e, seed=13)
    state = empty_state(pattern, inp, start)
    row_bytes = batch * (heads * (2 * d + 2 * e) * 4 + 8)  # keys a/b, values, outputs (fp32) + position
    sizes = {}
    for t in range(n):
        step = {k: v[:, :, t] for k, v in inp.items()}
        recurrent_step(state, step["qa"], step["ka"], step["qb"], step["kb"], step["x"], step["g"], pattern)
        for b in range(batch):
            m = t + 1 - int(start[b])  # real tokens of sequence b so far
            got = sorted({int(p) + 1 for p in state.positions[b] if p >= 0})
            want = pattern.attended(m + 1) if m >= 1 else []
            assert got == want, f"sequence {b} after {m} real tokens holds {got}, S_{m + 1} = {want}"
        assert state.rows_held() == pattern.num_slots(t + 2)  # one row per slot of the register
        assert state.nbytes() == row_bytes * state.rows_held()
        sizes[t + 1] = state.nbytes()
    # grows like the number of slots (logarithmic / square root), well below n's growth (x 3.75)
    assert sizes[150] / sizes[40] < 0.6 * 150 / 40
    p_plain = get_pattern(SPECS[key.replace(":ce", "")]) if key != "callable:ce" else get_pattern(cubic_plus_one)
    first = {k: v[:1] for k, v in inp.items()}
    plain = empty_state(p_plain, first)
    recurrent_mix(*(first[k] for k in ("qa", "ka", "qb", "kb", "x", "g")), p_plain, state=plain)
    assert plain.rows_held() == n and state.rows_held() < n / 5


@st.composite
def _random_f(draw):
    values = [1]
    for step in draw(st.lists(st.integers(1, 12), min_size=1, max_size=8)):
        values.append(values[-1] + step)

    def f(k):
        return values[k] if k < len(values) else values[-1] + 10**6 * (k - len(values) + 1)

    return f


@settings(max_examples=12)
@given(f=_random_f(), pad=st.integers(0, 6))
def test_cache_efficient_state_random_f(f, pad):
    """The decode register follows S_{n+1} for random f too, and the steps equal the reference."""
    pattern = get_pattern(f, cache_efficient=True)
    n = 45
    inp = make_mixer_inputs(batch=2, heads=1, n=n, d=2, e=2, dtype=torch.float64, seed=pad)
    start = torch.tensor([pad, 0])
    state = empty_state(pattern, inp, start)
    ys = []
    for t in range(n):
        step = {k: v[:, :, t] for k, v in inp.items()}
        ys.append(recurrent_step(state, step["qa"], step["ka"], step["qb"], step["kb"], step["x"], step["g"], pattern))
        for b in range(2):
            m = t + 1 - int(start[b])
            got = sorted({int(p) + 1 for p in state.positions[b] if p >= 0})
            assert got == (pattern.attended(m + 1) if m >= 1 else [])
    ref = reference_mix(inp["qa"], inp["ka"], inp["qb"], inp["kb"], inp["x"], inp["g"], pattern, start=start)
    assert_close(torch.stack(ys, 2), ref, "recurrent steps vs reference", tol=1e-12)


def test_state_select_batch_and_continue():
    """Reordering the batch of a state (beam search) then decoding on equals decoding the reordered batch."""
    n, split = 40, 25
    for spec in ("exp2:ce", "dense", "banded:3"):
        pattern = get_pattern(spec)
        inp = make_mixer_inputs(batch=3, heads=2, n=n, d=4, e=3, seed=14)
        start = torch.tensor([0, 4, 9])
        order = torch.tensor([2, 0, 1])
        state = empty_state(pattern, inp, start)
        first = recurrent_mix(*(inp[k][:, :, :split] for k in ("qa", "ka", "qb", "kb", "x", "g")), pattern,
                              start=start, state=state)
        state.select_batch(order)
        second = recurrent_mix(*(inp[k][order][:, :, split:] for k in ("qa", "ka", "qb", "kb", "x", "g")), pattern,
                               state=state)
        full = reference_mix(*(inp[k][order] for k in ("qa", "ka", "qb", "kb", "x", "g")), pattern,
                             start=start[order])
        assert_close(torch.cat([first[order], second], 2), full, f"{spec}: select_batch then continue")


# --------------------------------------------------------------------------------------------------
# Errors


def _shape_error_cases():
    base = make_mixer_inputs(batch=2, heads=3, n=12, d=4, e=5)
    q, k, qb, kb, x, g, dd = (base[n] for n in ("qa", "ka", "qb", "kb", "x", "g", "d_skip"))
    short = make_mixer_inputs(batch=2, heads=3, n=10, d=4, e=5)
    return [
        ("qa shorter than x", (short["qa"], k, qb, kb, x, g, "dense"), {}, ["qa must be", "(2, 3, 12, dim)"]),
        ("ka wider than qa", (q, torch.zeros(2, 3, 12, 6), qb, kb, x, g, "exp2"), {}, ["same last dim"]),
        ("kb other heads", (q, k, qb, torch.zeros(2, 2, 12, 4), x, g, "exp2"), {}, ["kb must be"]),
        ("x not 4-d", (q, k, qb, kb, x[0], g, "dense"), {}, ["x must be (batch, heads, n, value_dim)"]),
        ("g wrong shape", (q, k, qb, kb, x, g[:, :, :5], "exp2:ce"), {}, ["g must be (batch, heads, n)"]),
        ("g with a value dim", (q, k, qb, kb, x, g[..., None], "banded:2"), {}, ["g must be"]),
        ("missing g", (q, k, qb, kb, x, None, "dense"), {}, ["g must be", "got None"]),
        ("missing qb", (q, k, None, kb, x, g, "dense"), {}, ["qb is required", "'dense'"]),
        ("missing kb", (q, k, qb, None, x, g, "square:ce"), {}, ["kb is required", "'square:ce'"]),
        ("start 2-d", (q, k, qb, kb, x, g, "exp2"), {"start": torch.zeros(2, 1, dtype=torch.long)},
         ["start must be (batch,)"]),
        ("start wrong batch", (q, k, qb, kb, x, g, "exp2"), {"start": torch.zeros(3, dtype=torch.long)},
         ["start must be (batch,) = (2,)"]),
        ("start too large", (q, k, qb, kb, x, g, "dense"), {"start": torch.tensor([0, 12])}, ["[0, n)"]),
        ("start negative", (q, k, qb, kb, x, g, "dense"), {"start": torch.tensor([-1, 0])}, ["[0, n)"]),
        ("start float", (q, k, qb, kb, x, g, "dense"), {"start": torch.tensor([1.0, 0.0])}, ["integer tensor"]),
        ("start list", (q, k, qb, kb, x, g, "exp2"), {"start": [1, 0]}, ["integer tensor", "got list"]),
    ] + [
        ("tied d wrong shape", (None, None, qb, kb, x, g, "dense"), {"d": dd[:, :, :4]},
         ["d must be (batch, heads, n)"]),
        ("tied without recurrence", (None, None, qb, kb, x, g, "attention"), {"d": dd}, ["needs a recurrent pattern"]),
        ("tied missing g", (None, None, qb, kb, x, None, "exp2"), {"d": dd}, ["g must be"]),
        ("tied with A scores", (q, k, qb, kb, x, g, "exp2"), {"d": dd}, ["reads no A scores: pass qa=None and ka=None"]),
    ]


@pytest.mark.parametrize("form", FORMS)
def test_shape_errors(form):
    for what, args, kwargs, fragments in _shape_error_cases():
        fn = FORM_FUNCTIONS[form] if form in FORM_FUNCTIONS else functools.partial(resolvent_mix, impl="auto")
        with pytest.raises(ValueError) as info:
            fn(*args, **kwargs)
        for fragment in fragments:
            assert fragment in str(info.value), (what, fragment, str(info.value))


def test_bad_impl_and_pattern_errors():
    inp = make_mixer_inputs(batch=1, heads=1, n=6, d=4, e=3)
    for fn in (lambda impl: mix("dense", inp, impl), lambda impl: mix_tied("dense", inp, impl)):
        with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'torch', 'cpu', 'triton'\), got 'cuda'"):
            fn("cuda")
    # a form's name is not a backend: the error names the function to call
    for form, function in (("reference", "reference_mix"), ("parallel", "parallel_mix"), ("graph", "graph_mix"),
                           ("recurrent", "recurrent_mix")):
        with pytest.raises(ValueError, match=f"impl='{form}' names a form, not a backend: call hf_resolvent.ops"
                                             f".{function}"):
            resolvent_mix(inp["qa"], inp["ka"], inp["qb"], inp["kb"], inp["x"], inp["g"], "dense", impl=form)
    with pytest.raises(ValueError, match="unknown pattern 'exp3'"):
        mix("exp3", inp, "parallel")
    with pytest.raises(ValueError, match="window"):
        mix("banded:0", inp, "reference")


@pytest.mark.parametrize("key", [k for k in SPECS if not get_pattern(SPECS[k]).is_dense])
def test_graph_form_sources_are_the_patterns_own_table(key):
    """The graph form rebuilds the sources from the slots' closed form (no numpy in a graph): the pattern's table."""
    from hf_resolvent.ops.graph import source_table

    pattern = get_pattern(SPECS[key])
    for n in (1, 2, 5, 64, 97, 300):
        assert torch.equal(source_table(pattern, torch.arange(n), n), pattern.source_index(n).T), n
