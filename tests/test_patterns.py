"""Tests of hf_resolvent.patterns: the allowed sets, the cache-efficient closed form against its recursive
definition, the slot rule, the test vectors of docs/DESIGN.md section 2, the analysis functions and errors.

Positions are 1-indexed as in the papers unless a name says otherwise; ``source_index``/``masks`` rows are
0-indexed (row t is position i = t + 1, source s is position j = s + 1).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cubic_plus_one
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_resolvent.patterns import (
    complexity_table,
    congestion_bounds,
    get_pattern,
    plot_patterns,
    shortest_path_lengths,
)

# --------------------------------------------------------------------------------------------------
# Independent definitions (written from docs/DESIGN.md section 2 / paper Def. 4.10, not from the library)


def f_values(f, n):
    """[f(0), f(1), ...] while f(k) < n."""
    out, k = [], 0
    while f(k) < n:
        out.append(f(k))
        k += 1
    return out


def recursive_sets(f, n):
    """S_i for i = 0..n by the recursive definition (Def. 4.10 as fixed in docs/DESIGN.md):
    the positions allowed at step i are S_{i-1} U {i-1}, and
    S_i = { min{ j in S_{i-1} U {i-1} : j >= i - f(k) } : f(k) < i }."""
    fs = f_values(f, n)
    sets = [set(), set()]  # S_0, S_1 (no f(k) < 1 since f(0) >= 1)
    for i in range(2, n + 1):
        allowed = sets[i - 1] | {i - 1}
        sets.append({min(j for j in allowed if j >= i - fk) for fk in fs if fk < i})
    return sets


def slot_registers(f, n):
    """p_k(i) for i = 0..n by the slot rule: p_0(i) = i - 1; for k >= 1, p_k(i) = p_k(i-1) if
    i - f(k) <= p_k(i-1) (p_k(i-1) existing), else p_{k-1}(i-1). Slot k exists once f(k) < i."""
    fs = f_values(f, n)
    regs = [[], []]
    for i in range(2, n + 1):
        prev = regs[i - 1]
        new = [i - 1]
        for k in range(1, sum(1 for v in fs if v < i)):
            new.append(prev[k] if k < len(prev) and i - fs[k] <= prev[k] else prev[k - 1])
        regs.append(new)
    return regs


def closed_form_steps(f, n):
    """a_0 = 1, a_{k+1} = a_k * ceil((f(k+1) - f(k)) / a_k), for f(k) < n."""
    fs = f_values(f, n)
    a = [1]
    for k in range(1, len(fs)):
        a.append(a[-1] * math.ceil((fs[k] - fs[k - 1]) / a[-1]))
    return a[: len(fs)]


def closed_form_slots(f, i, a):
    """[a_k * ceil((i - f(k)) / a_k) for f(k) < i] (Prop. 4.12), with duplicates, in slot order."""
    return [a[k] * -(-(i - fk) // a[k]) for k, fk in enumerate(f_values(f, i))]


def min_hops(f, n):
    """Fewest offsets f(k) summing to m, for m = 0..n (unbounded coin change)."""
    fs = f_values(f, n + 1)
    best = [0] + [math.inf] * n
    for m in range(1, n + 1):
        best[m] = min((best[m - o] + 1 for o in fs if o <= m), default=math.inf)
    return best


def f_from_values(values):
    """A strictly increasing f with the given first values, continued far beyond any tested n."""

    def f(k):
        if k < len(values):
            return values[k]
        return values[-1] + 10**6 * (k - len(values) + 1)

    return f


@st.composite
def increasing_f(draw, f0_is_one=True):
    """Random strictly increasing f: f(0) = 1 (or drawn), then cumulative sums of positive steps."""
    first = 1 if f0_is_one else draw(st.integers(1, 6))
    steps = draw(st.lists(st.integers(1, 20), min_size=1, max_size=10))
    values = [first]
    for s in steps:
        values.append(values[-1] + s)
    return f_from_values(values)


def _exp2(k):
    return 2**k


def _square(k):
    return k * k + 1


# --------------------------------------------------------------------------------------------------
# Cache-efficient sets: closed form == recursion, subset property, slot rule


def check_cache_efficient(f, n):
    pattern = get_pattern(f, cache_efficient=True)
    sets = recursive_sets(f, n)
    regs = slot_registers(f, n)
    a = closed_form_steps(f, n)
    assert pattern.steps(n) == a
    idx = pattern.source_index(n)
    assert idx.shape == (n, len(f_values(f, n)))
    for i in range(1, n + 1):
        closed = closed_form_slots(f, i, a)
        # slot rule and closed form give the same register, slot by slot
        assert regs[i] == closed, f"slot rule differs from the closed form at i = {i}"
        # closed form as a set equals the recursive definition
        assert set(closed) == sets[i], f"closed form differs from the recursion at i = {i}"
        # S_i is a subset of S_{i-1} U {i-1}
        assert sets[i] <= sets[i - 1] | ({i - 1} if i > 1 else set())
        # the library's 0-indexed row: slot k holds p_k(i) - 1, or -1 for an empty slot or a repeat
        row = idx[i - 1].tolist()
        expected_row, seen = [], set()
        for k in range(idx.shape[1]):
            if k < len(closed) and closed[k] not in seen:
                expected_row.append(closed[k] - 1)
                seen.add(closed[k])
            else:
                expected_row.append(-1)
        assert row == expected_row, f"source_index row {i - 1}"
    for i in (1, 2, n // 2 + 1, n):
        assert pattern.attended(i) == sorted(sets[i])
        assert pattern.direct(i) == sorted(sets[i] | {i})
        assert pattern.cost(i) == len(sets[i]) + 1
    assert pattern.cache_size(n) == len(recursive_sets(f, n + 1)[n + 1])


@settings(max_examples=300)
@given(f=increasing_f(), n=st.integers(30, 220))
def test_cache_efficient_random_f_matches_recursion(f, n):
    check_cache_efficient(f, n)


@pytest.mark.parametrize("f", [_exp2, _square, cubic_plus_one], ids=["exp2", "square", "cubic"])
def test_cache_efficient_named_f_matches_recursion(f):
    check_cache_efficient(f, 300)


@pytest.mark.parametrize("spec", ["exp2:ce", "square:ce"])
def test_named_ce_specs_are_the_callables(spec):
    f = _exp2 if spec.startswith("exp2") else _square
    n = 400
    assert torch.equal(get_pattern(spec).source_index(n), get_pattern(f, cache_efficient=True).source_index(n))


@given(f=increasing_f(f0_is_one=False), n=st.integers(10, 120))
def test_translation_invariant_sets(f, n):
    """Plain f-patterns: P^B_i = {i - f(k) : f(k) < i}, P^A_i = P^B_i U {i}."""
    pattern = get_pattern(f)
    _, mask_b = pattern.masks(n)
    for i in range(1, n + 1):
        expected = sorted(i - fk for fk in f_values(f, i))
        assert pattern.attended(i) == expected
        assert [s + 1 for s in torch.nonzero(mask_b[i - 1]).flatten().tolist()] == expected
    assert pattern.cost(n) == len(f_values(f, n)) + 1
    assert pattern.cache_size(n) == n


# --------------------------------------------------------------------------------------------------
# Test vectors of docs/DESIGN.md section 2


def test_exp2_vectors():
    assert get_pattern("exp2:ce").attended(100) == [64, 80, 88, 92, 96, 98, 99]
    assert get_pattern("exp2").attended(100) == [100 - 2**k for k in range(6, -1, -1)]
    assert get_pattern("exp2:ce").steps(600) == [1, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    for n, k in ((2048, 11), (32768, 15)):
        assert get_pattern("exp2:ce").num_slots(n) == k
        # all K slots hold distinct positions for exp2
        assert len(get_pattern("exp2:ce").attended(n)) == k
    assert get_pattern("exp2:ce").cache_size(2048) == 12  # f(k) < 2049: k = 0..11


def test_square_vectors():
    assert get_pattern("square:ce").attended(100) == [24, 48, 72, 84, 90, 96, 98, 99]
    assert get_pattern("square:ce").steps(51) == [1, 1, 3, 6, 12, 12, 12, 24]
    assert get_pattern("square:ce").num_slots(2048) == 46
    assert len(get_pattern("square:ce").attended(2048)) == 34
    assert get_pattern("square:ce").cache_size(2048) == 34
    assert get_pattern("square").attended(100) == sorted(100 - (k * k + 1) for k in range(10))


# --------------------------------------------------------------------------------------------------
# Sets, masks and sizes of the other kinds


@pytest.mark.parametrize(
    "spec, attended, direct, cache",
    [
        ("attention", lambda i: [], lambda i: list(range(1, i + 1)), lambda n: n),
        ("local_attention:4", lambda i: [], lambda i: list(range(max(1, i - 3), i + 1)), lambda n: min(n, 3)),
        ("dense", lambda i: list(range(1, i)), lambda i: list(range(1, i + 1)), lambda n: n),
        ("banded:3", lambda i: list(range(max(1, i - 3), i)), lambda i: list(range(max(1, i - 3), i + 1)),
         lambda n: min(n, 3)),
        ("diagonal", lambda i: [i - 1] if i > 1 else [], lambda i: [i - 1, i] if i > 1 else [1], lambda n: min(n, 1)),
    ],
)
def test_window_kinds_sets_masks_and_sizes(spec, attended, direct, cache):
    pattern = get_pattern(spec)
    n = 12
    mask_a, mask_b = pattern.masks(n)
    assert mask_a.shape == mask_b.shape == (n, n) and mask_a.dtype == torch.bool
    for i in range(1, n + 1):
        assert pattern.attended(i) == attended(i)
        assert pattern.direct(i) == direct(i)
        assert pattern.cost(i) == len(direct(i))
        assert [s + 1 for s in torch.nonzero(mask_a[i - 1]).flatten().tolist()] == direct(i)
        assert [s + 1 for s in torch.nonzero(mask_b[i - 1]).flatten().tolist()] == attended(i)
    for m in range(0, n + 1):
        assert pattern.cache_size(m) == cache(m)
    assert pattern.has_recurrence == (spec not in ("attention", "local_attention:4"))


@pytest.mark.parametrize("spec", ["exp2", "exp2:ce", "square", "square:ce", "f:k**2+k+1", "f:k**2+k+1:ce"])
def test_f_pattern_masks_match_attended(spec):
    pattern = get_pattern(spec)
    n = 70
    mask_a, mask_b = pattern.masks(n)
    for i in range(1, n + 1):
        b = [s + 1 for s in torch.nonzero(mask_b[i - 1]).flatten().tolist()]
        a = [s + 1 for s in torch.nonzero(mask_a[i - 1]).flatten().tolist()]
        assert b == pattern.attended(i)
        assert a == sorted(set(b) | {i}) == pattern.direct(i)


def test_expression_and_callable_patterns():
    expr = get_pattern("f:k**2+k+1")
    assert expr.offsets(50) == [1, 3, 7, 13, 21, 31, 43]
    assert get_pattern("f:k**2+k+1:ce").cache_efficient and not expr.cache_efficient
    user = get_pattern(cubic_plus_one)
    assert user.offsets(100) == [1, 2, 9, 28, 65]
    assert user.attended(30) == [2, 21, 28, 29]
    assert get_pattern(user) is user


# --------------------------------------------------------------------------------------------------
# Analysis


def test_exp2_shortest_paths_are_popcounts():
    n = 64
    for j in range(1, n + 1):
        dist = shortest_path_lengths("exp2", j, n)
        assert len(dist) == n
        for i in range(1, n + 1):
            if i < j:
                assert dist[i - 1] == math.inf
            elif i == j:
                assert dist[i - 1] == 1  # the single A hop x_j -> y_j
            else:
                assert dist[i - 1] == bin(i - j).count("1"), (i, j)


def test_square_shortest_paths_at_most_four():
    n = 90
    for j in range(1, n + 1):
        dist = shortest_path_lengths("square", j, n)
        assert max(dist[j - 1:]) <= 4, j  # every m >= 1 is a sum of at most 4 values k^2 + 1
        assert all(v == math.inf for v in dist[: j - 1])


@pytest.mark.parametrize("spec, f", [("exp2", _exp2), ("square", _square), ("f:k**2+k+1", lambda k: k * k + k + 1)])
def test_translation_invariant_path_lengths(spec, f):
    """For a plain f-pattern d(i, j) depends on i - j only: the fewest offsets f(k) summing to i - j."""
    n = 48
    best = min_hops(f, n)
    for j in (1, 2, 7, 20):
        dist = shortest_path_lengths(spec, j, n)
        for i in range(j + 1, n + 1):
            assert dist[i - 1] == best[i - j], (i, j)


@given(f=increasing_f(f0_is_one=False))
def test_translation_invariant_path_lengths_random_f(f):
    n = 40
    best = min_hops(f, n)
    for j in (1, 5):
        dist = shortest_path_lengths(get_pattern(f), j, n)
        assert dist[j - 1] == 1
        for i in range(j + 1, n + 1):
            assert dist[i - 1] == best[i - j], (i, j)


def test_window_kinds_path_lengths():
    n, j = 30, 4
    banded = shortest_path_lengths("banded:3", j, n)
    assert [banded[i - 1] for i in range(j + 1, n + 1)] == [math.ceil((i - j) / 3) for i in range(j + 1, n + 1)]
    local = shortest_path_lengths("local_attention:5", j, n)
    assert [local[i - 1] for i in range(j, n + 1)] == [1] * 5 + [math.inf] * (n - j - 4)
    assert shortest_path_lengths("dense", j, n)[j - 1:] == [1] * (n - j + 1)
    assert shortest_path_lengths("attention", j, n)[j - 1:] == [1] * (n - j + 1)
    assert shortest_path_lengths("diagonal", j, n)[n - 1] == n - j
    # cache-efficient patterns stay connected
    for spec in ("exp2:ce", "square:ce"):
        assert all(v < math.inf for v in shortest_path_lengths(spec, j, n)[j - 1:])


@pytest.mark.parametrize("spec", ["dense", "attention", "banded:4", "diagonal", "exp2", "exp2:ce", "square", "square:ce"])
def test_congestion_bounds_ordered(spec):
    n = 16
    lower, upper = congestion_bounds(spec, n)
    assert 1 <= lower <= upper < math.inf
    lengths = [shortest_path_lengths(spec, i, 2 * n)[i + n - 1] for i in range(1, n + 1)]
    assert (lower, upper) == ((min(lengths) + 1) / 2, max(lengths))


def test_congestion_bounds_values():
    assert congestion_bounds("exp2", 16) == (1.0, 1)  # i -> i + 16 is one hop of offset 16
    assert congestion_bounds("banded:4", 8) == (1.5, 2)
    assert congestion_bounds("diagonal", 8) == (4.5, 8)
    assert congestion_bounds("dense", 8) == (1.0, 1)
    assert congestion_bounds("local_attention:4", 8)[1] == math.inf


def test_complexity_table_has_table1_classes():
    table = {row["pattern"]: (row["time_per_token"], row["cache"]) for row in complexity_table()}
    assert table["attention"] == ("O(n)", "O(n)")
    assert table["dense"] == ("O(n)", "O(n)")
    assert table["diagonal"] == ("O(1)", "O(1)")
    assert table["exp2"] == ("O(log n)", "O(n)")
    assert table["exp2:ce"] == ("O(log n)", "O(log n)")
    assert table["square"] == ("O(sqrt n)", "O(n)")
    assert table["square:ce"] == ("O(sqrt n)", "O(sqrt n)")
    local = [v for k, v in table.items() if k.startswith("local_attention")]
    banded = [v for k, v in table.items() if k.startswith("banded")]
    assert local == [("O(w)", "O(w)")] and banded == [("O(w)", "O(w)")]


def test_cost_and_cache_growth_follow_the_classes():
    n = 4096
    assert get_pattern("exp2:ce").cost(n) == math.ceil(math.log2(n)) + 1
    assert get_pattern("exp2:ce").cache_size(n) <= math.log2(n) + 2
    assert get_pattern("square:ce").cache_size(n) <= math.isqrt(n) + 1
    assert get_pattern("exp2").cache_size(n) == n
    assert get_pattern("banded:8").cost(n) == 9 and get_pattern("banded:8").cache_size(n) == 8


def test_plot_cli_writes_png(tmp_path, capsys):
    """``python -m hf_resolvent --plot X.png`` (its main, in-process: no second torch import)."""
    from hf_resolvent.__main__ import main

    out = tmp_path / "patterns.png"
    main(["--plot", str(out), "-n", "64"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "exp2:ce" in printed and "wrote" in printed
    other = tmp_path / "two.png"
    plot_patterns(str(other), ["dense", "square:ce"], n=16)
    assert other.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------------
# Errors


def _late_decrease(k):
    return [1, 2, 4, 8, 16, 32, 64, 128, 256, 100][k] if k < 10 else 10**6 + k


@pytest.mark.parametrize(
    "build, fragments",
    [
        (lambda: get_pattern("flash"), ["unknown pattern", "'flash'", "exp2:ce"]),
        (lambda: get_pattern("exp3"), ["unknown pattern"]),
        (lambda: get_pattern("dense:4"), ["unknown pattern"]),
        (lambda: get_pattern("banded:0"), ["window", "positive integer", "'0'"]),
        (lambda: get_pattern("banded:x"), ["window", "positive integer", "'x'"]),
        (lambda: get_pattern("banded"), ["needs a window", "banded:8"]),
        (lambda: get_pattern("local_attention:1"), ["at least 2"]),
        (lambda: get_pattern("local_attention:-3"), ["positive integer"]),
        (lambda: get_pattern("f:5-k"), ["strictly increasing"]),
        (lambda: get_pattern(lambda k: 3 - k), ["strictly increasing"]),
        (lambda: get_pattern(lambda k: [1, 5, 5][k] if k < 3 else 10 + k), ["strictly increasing", "f(2) = 5"]),
        (lambda: get_pattern("f:k"), ["f(0) >= 1", "f(0) = 0"]),
        (lambda: get_pattern(lambda k: k - 2), ["f(0) >= 1"]),
        (lambda: get_pattern(lambda k: k + 1.5), ["integers", "1.5"]),
        (lambda: get_pattern("f:2**-k+1"), ["integers"]),
        (lambda: get_pattern(lambda k: [1, 2][k]), ["raised", "IndexError", "k = 2"]),
        (lambda: get_pattern("dense:ce"), ["':ce'", "f-patterns"]),
        (lambda: get_pattern("banded:8:ce"), ["':ce'", "f-patterns"]),
        (lambda: get_pattern("attention:ce"), ["':ce'"]),
        (lambda: get_pattern("f:k+2:ce"), ["f(0) = 1", "f(0) = 2"]),
        (lambda: get_pattern(lambda k: 2 * k + 3, cache_efficient=True), ["f(0) = 1", "f(0) = 3"]),
        (lambda: get_pattern('f:__import__("os")'), ["may only use the variable k"]),
        (lambda: get_pattern("f:k.bit_length()+1"), ["may only use the variable k"]),
        (lambda: get_pattern("f:k/2+1"), ["may only use the variable k"]),
        (lambda: get_pattern("f:k+"), ["not valid Python arithmetic"]),
        (lambda: get_pattern(3), ["string or a callable"]),
        (lambda: get_pattern(_late_decrease).source_index(300), ["strictly increasing", "f(9) = 100"]),
        (lambda: get_pattern("dense").source_index(8), ["dense", "masks()"]),
        (lambda: get_pattern("exp2").attended(0), ["1-indexed"]),
        (lambda: get_pattern("exp2").cache_size(-1), ["n must be >= 0"]),
        (lambda: get_pattern("banded:3").offsets(5), ["no offset function"]),
    ],
)
def test_pattern_errors(build, fragments):
    with pytest.raises(ValueError) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
