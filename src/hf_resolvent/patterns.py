"""Sparsity patterns of the resolvent mixer: which alpha_ij and beta_ij may be non-zero.

A pattern fixes, for every position, the set P^B_i of earlier outputs that the recurrent channel B
reads and the set P^A_i of inputs that the direct channel A reads (docs/DESIGN.md section 2).

Conventions
-----------
The papers index positions from 1; so do :meth:`Pattern.attended`, :meth:`Pattern.direct` and the
analysis functions, to make the papers' examples checkable verbatim (``exp2:ce`` gives
``attended(100) == [64, 80, 88, 92, 96, 98, 99]``). Everything that feeds tensors (``source_index``,
``masks``) is 0-indexed: row ``t`` is the papers' position ``i = t + 1`` and a source position ``s`` is
the papers' ``j = s + 1``.

``python -m hf_resolvent --plot runs/patterns.png`` prints the named patterns' costs and draws their masks.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "Pattern",
    "get_pattern",
    "PATTERN_NAMES",
    "shortest_path_lengths",
    "congestion_bounds",
    "complexity_table",
    "plot_patterns",
]

# Kinds of pattern. "attention" kinds have B = 0; the others are resolvent patterns (B != 0).
ATTENTION_KINDS = ("attention", "local_attention")
RESOLVENT_KINDS = ("dense", "banded", "diagonal", "pattern")
PATTERN_NAMES = (
    "attention",
    "local_attention:<w>",
    "dense",
    "banded:<w>",
    "diagonal",
    "exp2",
    "exp2:ce",
    "square",
    "square:ce",
    "f:<expression in k>",
    "f:<expression in k>:ce",
)


def _exp2(k: int) -> int:
    return 2**k


def _square(k: int) -> int:
    return k * k + 1


NAMED_F: dict[str, Callable[[int], int]] = {"exp2": _exp2, "square": _square}
# Per-token cost class of each named f (f^-1(n)), used by the complexity table.
NAMED_F_CLASS = {"exp2": "O(log n)", "square": "O(sqrt n)"}

_ALLOWED_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
# Bounds that keep every f: expression cheap whatever a config file holds: Python ints are exact but
# unbounded, so '9**9**9' would otherwise run for hours. Values of f are sequence distances, and no
# sequence is longer than 2**63, so 2**256 leaves ample room for intermediate results; with operands
# below it, each operation costs microseconds. The text bound also bounds the tree's size and depth.
_MAX_EXPRESSION_CHARS = 200
_MAX_VALUE_BITS = 256


class _ExpressionError(ValueError):
    """A bad value of an f: expression, raised while evaluating it; its message is final (names the spec)."""


def _shown(text: str) -> str:
    """The expression as error messages quote it: long ones cut to their start."""
    return repr(text) if len(text) <= 60 else f"{text[:50]!r}... ({len(text)} characters)"


def _compile_expression(text: str) -> Callable[[int], int]:
    """Turn ``"k**3 + 1"`` into a function of k, accepting only integer arithmetic on k.

    The expression is parsed, not ``eval``-ed: names other than ``k`` and anything but + - * // **
    and integer literals are refused, so a config file cannot run code through its pattern field.
    Its cost is bounded too: at most 200 characters, and every literal and intermediate value below
    2**256 in magnitude (a power is refused before it is computed), else a ValueError names it.
    """
    where = f"pattern expression {_shown('f:' + text)}"
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"{where} is too long: at most {_MAX_EXPRESSION_CHARS} characters (for example 'f:k**3+1')")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"{where} is not valid Python arithmetic: {err.msg}") from None
    except (MemoryError, RecursionError):  # the parser's own nesting limits
        raise ValueError(f"{where} is nested too deeply; write it with fewer parentheses and signs") from None

    def too_large(what: str) -> str:
        return (
            f"{where}: {what} reaches 2**{_MAX_VALUE_BITS}; f gives offsets between positions, so its values "
            "must stay within sequence lengths (for example 'f:k**3+1' or 'exp2')"
        )

    def check(node: ast.AST) -> None:
        if isinstance(node, ast.Expression):
            check(node.body)
        elif isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_BINOPS:
            check(node.left)
            check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            check(node.operand)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            if node.value.bit_length() > _MAX_VALUE_BITS:
                raise ValueError(too_large("an integer literal"))
        elif isinstance(node, ast.Name) and node.id == "k":
            pass
        else:
            raise ValueError(
                f"{where} may only use the variable k, integer literals and + - * // ** (for example 'f:k**3+1')"
            )

    check(tree)

    def power(base: int, exponent: int, k: int) -> int:
        if exponent < 0:
            raise _ExpressionError(
                f"{where}: a negative exponent at k = {k} gives a fraction; pattern functions must return integers"
            )
        # |base| >= 2 gives at least (bit_length - 1) * exponent bits: refuse before computing.
        if abs(base) >= 2 and (abs(base).bit_length() - 1) * exponent > _MAX_VALUE_BITS:
            raise _ExpressionError(too_large(f"a power at k = {k}"))
        return base**exponent

    def evaluate(node: ast.AST, k: int) -> int:
        if isinstance(node, ast.Expression):
            return evaluate(node.body, k)
        if isinstance(node, ast.BinOp):
            left, right = evaluate(node.left, k), evaluate(node.right, k)
            if isinstance(node.op, ast.Pow):
                value = power(left, right, k)
            else:
                value = _ALLOWED_BINOPS[type(node.op)](left, right)
            if value.bit_length() > _MAX_VALUE_BITS:
                raise _ExpressionError(too_large(f"a value at k = {k}"))
            return value
        if isinstance(node, ast.UnaryOp):
            return -evaluate(node.operand, k)
        if isinstance(node, ast.Constant):
            return node.value
        return k

    def f(k: int) -> int:
        return evaluate(tree, k)

    f.__name__ = text
    return f


@dataclass(frozen=True)
class Pattern:
    """One sparsity pattern. Build it with :func:`get_pattern`.

    Attributes:
        kind: ``"attention"``, ``"local_attention"``, ``"dense"``, ``"banded"``, ``"diagonal"`` or
            ``"pattern"`` (offsets given by a strictly increasing ``f``).
        window: ``w`` of local attention and banded patterns (1 for diagonal), else ``None``.
        f: the offset function of ``"pattern"`` kinds, else ``None``.
        cache_efficient: ``"pattern"`` kinds only: use the cache-efficient sets S_i (Prop. 4.12).
        name: the canonical spec string (``"exp2:ce"``, ``"banded:8"``, ...).
    """

    kind: str
    window: int | None = None
    f: Callable[[int], int] | None = None
    cache_efficient: bool = False
    name: str = ""

    # ----------------------------------------------------------------------------------------------
    # Basic properties
    @property
    def has_recurrence(self) -> bool:
        """True when B != 0 (every kind but attention and local attention)."""
        return self.kind in RESOLVENT_KINDS

    @property
    def is_dense(self) -> bool:
        """True when P^A_i (and P^B_i for dense) is the whole causal prefix."""
        return self.kind in ("attention", "dense")

    @property
    def band(self) -> int | None:
        """Number of earlier positions in P^B for banded kinds (diagonal is banded with w = 1)."""
        if self.kind == "banded":
            return self.window
        if self.kind == "diagonal":
            return 1
        return None

    def offsets(self, n: int) -> list[int]:
        """Values f(k) < n of a ``"pattern"`` kind, checked to be integers, strictly increasing, >= 1."""
        if self.kind != "pattern":
            raise ValueError(f"pattern {self.name!r} has no offset function")
        values = list(_offsets(self.f, n))
        if self.cache_efficient and self.f(0) != 1:
            # The slot register's first slot is always the previous token (p_0(i) = i - 1); with
            # f(0) > 1 the decode cache would also need a window of recent tokens.
            raise ValueError(
                f"pattern {self.name!r}: cache-efficient patterns need f(0) = 1, got f(0) = {self.f(0)}; "
                "use the plain pattern (drop ':ce') or shift f"
            )
        return values

    def steps(self, n: int) -> list[int]:
        """The periods a_k of the cache-efficient closed form, for every k with f(k) < n."""
        fs = self.offsets(n)
        a = [1] if fs else []
        for k in range(1, len(fs)):
            a.append(a[-1] * -(-(fs[k] - fs[k - 1]) // a[-1]))
        return a

    def num_slots(self, n: int) -> int:
        """Entries of a row of the sparse index (``source_index(n).shape[1]``) for rows up to n."""
        if self.kind == "pattern":
            return len(self.offsets(n))
        if self.band is not None:
            return self.band
        if self.kind == "local_attention":
            return self.window - 1
        return n  # dense kinds

    # ----------------------------------------------------------------------------------------------
    # Sets, 1-indexed as in the papers
    def attended(self, i: int) -> list[int]:
        """Sorted 1-indexed positions of P^B_i (empty for attention kinds)."""
        if i < 1:
            raise ValueError(f"positions are 1-indexed, got i = {i}")
        if not self.has_recurrence:
            return []
        if self.kind == "dense":
            return list(range(1, i))
        return sorted(int(s) + 1 for s in self.source_index(i)[i - 1] if s >= 0)

    def direct(self, i: int) -> list[int]:
        """Sorted 1-indexed positions of P^A_i (always contains i)."""
        if self.kind == "attention":
            return list(range(1, i + 1))
        if self.kind == "local_attention":
            return list(range(max(1, i - self.window + 1), i + 1))
        return self.attended(i) + [i]

    def cache_size(self, n: int) -> int:
        """Positions the decode cache holds after n tokens (what token n + 1 and later may read)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if self.kind == "local_attention":
            return min(n, self.window - 1)
        if self.band is not None:
            return min(n, self.band)
        if self.kind == "pattern" and self.cache_efficient:
            return len(self.attended(n + 1))
        return n

    def cost(self, n: int) -> int:
        """Positions read to produce token n (1-indexed): |P^A_n|, which contains P^B_n."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.kind == "pattern":
            return len(self.attended(n)) + 1
        return len(self.direct(n))

    # ----------------------------------------------------------------------------------------------
    # Tensors, 0-indexed
    def source_index(self, n: int) -> torch.Tensor:
        """0-indexed sources of P^B (resolvent kinds) or of P^A minus the diagonal (local attention).

        Returns a LongTensor (n, M): row t lists the earlier positions that row t reads, -1 where a
        slot is empty (not yet valid, or a position already listed by an earlier slot: S_i is a set).
        Slot m of a banded row is t - 1 - m; slot k of a pattern row is its k-th offset or S_i element.
        Not defined for dense kinds, whose rows are the whole prefix.
        """
        if self.is_dense:
            raise ValueError(f"pattern {self.name!r} is dense: use masks() instead of source_index()")
        return _source_index(self, n).clone()

    def masks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean (n, n) masks of A and B: mask[t, s] is True where the entry may be non-zero."""
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if self.kind == "attention":
            return causal, torch.zeros(n, n, dtype=torch.bool)
        if self.kind == "dense":
            return causal, causal.tril(-1)
        idx = _source_index(self, n)
        sparse = torch.zeros(n, n + 1, dtype=torch.bool)  # column n soaks up the -1 entries
        sparse.scatter_(1, torch.where(idx >= 0, idx, n), True)
        sparse = sparse[:, :n]
        mask_a = sparse | torch.eye(n, dtype=torch.bool)
        if self.kind == "local_attention":
            return mask_a, torch.zeros(n, n, dtype=torch.bool)
        return mask_a, sparse

    def __str__(self) -> str:
        return self.name


@lru_cache(maxsize=64)
def _offsets_cached(f: Callable[[int], int], n: int) -> tuple[int, ...]:
    values: list[int] = []
    k = 0
    while True:
        v = _f_value(f, k, values[-1] if values else None)
        if v >= n:
            return tuple(values)
        values.append(v)
        k += 1


def _f_value(f: Callable[[int], int], k: int, previous: int | None) -> int:
    """f(k) checked: an integer, f(0) >= 1, and above ``previous`` = f(k - 1)."""
    # named as get_pattern names the pattern: 'f:k**3+1' for an expression, 'f:my_function' for a callable
    who = f"pattern function {_shown('f:' + getattr(f, '__name__', 'f'))}"
    try:
        v = f(k)
    except _ExpressionError as err:  # already says what and where; raised as the plain ValueError it is
        raise ValueError(str(err)) from None
    except Exception as err:  # a user function failing is a config problem, say which
        raise ValueError(f"{who} raised {type(err).__name__} at k = {k}: {err}") from err
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{who} must return integers, got f({k}) = {v!r}")
    v = int(v)
    if k == 0 and v < 1:
        raise ValueError(f"{who} must satisfy f(0) >= 1, got f(0) = {v}")
    if previous is not None and v <= previous:
        raise ValueError(f"{who} must be strictly increasing, got f({k - 1}) = {previous} and f({k}) = {v}")
    return v


def _check_f(pattern: "Pattern", probes: int = 8) -> None:
    """Validate f(0..probes-1) when the pattern is built, whatever length it is used at later.

    (``offsets(n)`` checks only the values below n: 'f:5-k' would pass until n > 5.) Values beyond the
    probes are still checked by ``offsets`` when a length first reaches them.
    """
    previous = None
    for k in range(probes):
        if previous is not None and previous >= 2**31:  # beyond any sequence length: no need to go on
            break
        previous = _f_value(pattern.f, k, previous)
    pattern.offsets(2)  # cache-efficient patterns also need f(0) = 1


def _offsets(f: Callable[[int], int], n: int) -> tuple[int, ...]:
    if torch.compiler.is_compiling():  # dynamo traces through the memo anyway, and warns that it does
        return _offsets_cached.__wrapped__(f, n)
    try:
        return _offsets_cached(f, n)
    except TypeError:  # unhashable callable
        return _offsets_cached.__wrapped__(f, n)


@lru_cache(maxsize=64)
def _source_index(pattern: Pattern, n: int) -> torch.Tensor:
    t = np.arange(n)[:, None]
    if pattern.kind == "local_attention":
        m = np.arange(1, pattern.window)[None, :]
        idx = t - m
    elif pattern.band is not None:
        m = np.arange(1, pattern.band + 1)[None, :]
        idx = t - m
    else:
        fs = np.array(pattern.offsets(n), dtype=np.int64)[None, :]
        if not pattern.cache_efficient:
            idx = t - fs
        else:
            a = np.array(pattern.steps(n), dtype=np.int64)[None, :]
            i = t + 1  # 1-indexed row
            # S_i = { a_k * ceil((i - f(k)) / a_k) : f(k) < i }, then back to 0-indexed.
            pos = a * (-(-(i - fs) // a)) - 1
            idx = np.where(fs < i, pos, -1)
            # S_i is a set: keep the first slot of each position (positions are non-increasing in k
            # within a row, so equal positions sit in adjacent slots).
            dup = np.zeros_like(idx, dtype=bool)
            dup[:, 1:] = (idx[:, 1:] == idx[:, :-1]) & (idx[:, 1:] >= 0)
            idx = np.where(dup, -1, idx)
    idx = np.where(idx >= 0, idx, -1)
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))


def _positive_int(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"pattern {spec!r}: {what} must be a positive integer, got {text!r}")
    return value


def get_pattern(spec: "str | Pattern | Callable[[int], int]", cache_efficient: bool = False) -> Pattern:
    """Build a :class:`Pattern` from a spec.

    Specs: ``"attention"``, ``"local_attention:8"``, ``"dense"``, ``"banded:8"``, ``"diagonal"``,
    ``"exp2"``, ``"exp2:ce"``, ``"square"``, ``"square:ce"``, ``"f:k**3+1"`` (any arithmetic in k),
    ``"f:k**3+1:ce"``; or a callable ``f(k)`` (strictly increasing integers, ``f(0) >= 1``) with
    ``cache_efficient`` choosing the cache-efficient variant. A :class:`Pattern` is returned as is.
    """
    if isinstance(spec, Pattern):
        return spec
    if callable(spec):
        name = getattr(spec, "__name__", "f")
        pattern = Pattern("pattern", f=spec, cache_efficient=cache_efficient,
                          name=f"f:{name}" + (":ce" if cache_efficient else ""))
        _check_f(pattern)
        return pattern
    if not isinstance(spec, str):
        raise ValueError(f"pattern spec must be a string or a callable f(k), got {type(spec).__name__}")
    text = spec.strip()
    ce = cache_efficient
    if text.endswith(":ce"):
        ce, text = True, text[: -len(":ce")]
    head, _, arg = text.partition(":")
    known = "known patterns: " + ", ".join(PATTERN_NAMES)
    if head in ("attention", "dense", "diagonal") and not arg:
        kind = head
        pattern = Pattern(kind, window=1 if kind == "diagonal" else None, name=kind)
    elif head in ("local_attention", "banded"):
        if not arg:
            raise ValueError(f"pattern {spec!r} needs a window, for example '{head}:8'")
        w = _positive_int(arg, "the window", spec)
        if head == "local_attention" and w < 2:
            raise ValueError(f"pattern {spec!r}: local attention needs a window of at least 2")
        pattern = Pattern(head, window=w, name=f"{head}:{w}")
    elif head in NAMED_F and not arg:
        pattern = Pattern("pattern", f=NAMED_F[head], cache_efficient=ce, name=head + (":ce" if ce else ""))
        return pattern
    elif head == "f" and arg:
        f = _compile_expression(arg)
        pattern = Pattern("pattern", f=f, cache_efficient=ce, name=f"f:{arg}" + (":ce" if ce else ""))
        _check_f(pattern)
        return pattern
    else:
        raise ValueError(f"unknown pattern {spec!r}; {known}")
    if ce:
        raise ValueError(f"pattern {spec!r}: ':ce' (cache-efficient) applies only to f-patterns such as 'exp2:ce'")
    return pattern


# --------------------------------------------------------------------------------------------------
# Analysis (paper section 4)


def shortest_path_lengths(pattern: "Pattern | str", j: int, n: int) -> list[float]:
    """Shortest information path from input j to every output i in 1..n (1-indexed).

    A path takes one hop through A (x_j -> y_m with j in P^A_m) and then any number of hops through
    B (y_m -> y_i with m in P^B_i); its length counts every hop. Unreachable outputs get ``inf``.
    For exp2 this is popcount(i - j) for i > j, for ``square`` at most 4 (Lagrange).
    Returns a list indexed by i - 1.
    """
    pattern = get_pattern(pattern)
    dist = [math.inf] * n
    if pattern.is_dense:
        for m in range(j, n + 1):
            dist[m - 1] = 1
        return dist
    idx = _source_index(pattern, n).numpy()
    direct_only = not pattern.has_recurrence  # local attention: one hop through A, no B hops
    for i in range(j, n + 1):
        t = i - 1
        best = 1 if (i == j or (j - 1) in idx[t]) else math.inf
        if not direct_only:
            for s in idx[t]:
                if s >= j - 1 and dist[s] + 1 < best:
                    best = dist[s] + 1
        dist[t] = best
    return dist


def congestion_bounds(pattern: "Pattern | str", n: int) -> tuple[float, float]:
    """Bounds on the congestion of copying n tokens to positions n+1..2n (Props. 4.7 and 4.8).

    With d the smallest and D the largest shortest-path length from input i to output i + n over
    i in 1..n: lower = (d + 1) / 2, upper = D. The upper bound is proven for translation-invariant
    patterns; for others it is returned as computed, ``inf`` when some path does not exist.
    """
    pattern = get_pattern(pattern)
    lengths = [shortest_path_lengths(pattern, i, 2 * n)[i + n - 1] for i in range(1, n + 1)]
    return (min(lengths) + 1) / 2, max(lengths)


def complexity_table() -> list[dict[str, str]]:
    """The papers' Table 1 complexity columns for the named patterns: per-token time and cache."""
    rows = [
        ("attention", "O(n)", "O(n)"),
        ("local_attention:w", "O(w)", "O(w)"),
        ("diagonal", "O(1)", "O(1)"),
        ("banded:w", "O(w)", "O(w)"),
        ("dense", "O(n)", "O(n)"),
        ("exp2", "O(log n)", "O(n)"),
        ("exp2:ce", "O(log n)", "O(log n)"),
        ("square", "O(sqrt n)", "O(n)"),
        ("square:ce", "O(sqrt n)", "O(sqrt n)"),
    ]
    return [{"pattern": p, "time_per_token": t, "cache": c} for p, t, c in rows]


def plot_patterns(path: str, specs: "list[str] | None" = None, n: int = 64) -> None:
    """Write the A and B masks of several patterns side by side as a PNG (the papers' Figure 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = specs or ["attention", "local_attention:8", "dense", "banded:8", "exp2", "exp2:ce", "square", "square:ce"]
    fig, axes = plt.subplots(2, len(specs), figsize=(2.2 * len(specs), 4.6))
    for col, spec in enumerate(specs):
        mask_a, mask_b = get_pattern(spec).masks(n)
        for row, (mask, label) in enumerate(((mask_a, "A"), (mask_b, "B"))):
            ax = axes[row, col]
            ax.imshow(mask.numpy(), cmap="Greys", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(spec, fontsize=9)
            if col == 0:
                ax.set_ylabel(label)
    fig.suptitle(f"Non-zero entries of A and B (n = {n})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit("the patterns command is `python -m hf_resolvent [SPEC ...] [-n N] [--plot FILE.png]`")
