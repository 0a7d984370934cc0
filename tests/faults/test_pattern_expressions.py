"""Hostile f: pattern expressions fail fast with one clear ValueError; valid ones keep working.

Python ints are unbounded, so an unguarded '9**9**9' runs for hours inside one C call that no signal
interrupts: the hostile expressions are tried in a child process that the test kills when a result is late,
so that a regression fails this test instead of hanging the suite.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import textwrap
import threading

import pytest

from hf_resolvent import ResolventConfig
from hf_resolvent.patterns import get_pattern

HOSTILE = [
    "9**9**9",  # a tower of constants: 9**387420489
    "k**k**k",  # a tower in k (and f(0) = 0)
    "10**100000",  # a constant far beyond any sequence length
    "(k+1)**999999",  # f(1) = 2**999999
    "99999999999999999999999999999999999999999999999999999999999999999999999999999999+k",  # 266-bit literal
    "k+" * 100_000 + "1",  # a very long expression (the parser itself recurses too deeply)
    "-" * 150_000 + "k",  # deep nesting
]
# Entry points: the pattern factory (plain and cache-efficient) and the config, which parses every layer's spec.
ENTRIES = ["pattern", "pattern:ce", "config"]
BOUND_S = 2.0  # generous: the guarded evaluation takes about a millisecond
LATE_S = 30.0  # a result this late means the evaluation hangs (the child is killed)

_CHILD = textwrap.dedent(
    """
    import json, sys, time, traceback
    from hf_resolvent import ResolventConfig
    from hf_resolvent.patterns import get_pattern

    expressions = json.load(open(sys.argv[1]))
    build = {
        "pattern": lambda e: get_pattern("f:" + e),
        "pattern:ce": lambda e: get_pattern("f:" + e + ":ce"),
        "config": lambda e: ResolventConfig(mixer="f:" + e, n_layer=2, n_embd=32, n_head=2),
    }
    print(json.dumps({"ready": True}), flush=True)
    for i, e in enumerate(expressions):
        for entry in sys.argv[2:]:
            t0 = time.perf_counter()
            try:
                build[entry](e)
                error = None
            except BaseException as err:
                error = err
            seconds = time.perf_counter() - t0
            out = {"i": i, "entry": entry, "seconds": seconds, "raised": error is not None}
            if error is not None:
                out.update(type=type(error).__module__ + "." + type(error).__qualname__, message=str(error),
                           report="".join(traceback.format_exception(error)))
            print(json.dumps(out), flush=True)
    """
)


def _results(tmp_path, expressions, entries):
    """Run the child on the expressions; yield one result dict per (expression, entry), failing on a late one."""
    (tmp_path / "expressions.json").write_text(json.dumps(expressions))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path / "expressions.json"), *entries],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert json.loads(lines.get(timeout=300)) == {"ready": True}  # importing torch on a loaded machine
        for e in expressions:
            for entry in entries:
                try:
                    line = lines.get(timeout=LATE_S)
                except queue.Empty:
                    pytest.fail(f"{entry} of f:{e[:60]!r} gave no result within {LATE_S} s: its evaluation hangs")
                assert line is not None, f"the child died on f:{e[:60]!r} ({entry})"
                yield e, json.loads(line)
    finally:
        proc.kill()
        proc.wait()


def test_hostile_expressions_fail_fast_with_one_clear_error(tmp_path):
    for e, out in _results(tmp_path, HOSTILE, ENTRIES):
        what = f"{out['entry']} of f:{e[:60]!r}"
        assert out["raised"], f"{what} was accepted"
        assert out["type"] == "builtins.ValueError", (what, out["type"], out["message"][:300])
        assert out["seconds"] < BOUND_S, (what, out["seconds"])
        message = out["message"]
        # one message that names the expression (its start, for long ones), not the whole of a huge one
        assert ("f:" + e)[:40] in message, (what, message[:300])
        assert len(message) < 400, (what, len(message))
        assert out["report"].count("Traceback (most recent call last)") == 1, (what, out["report"][-2000:])
        if out["entry"] == "config":
            assert message.startswith("mixer: "), (what, message)


@pytest.mark.parametrize(
    "spec, reference",
    [
        ("f:k**3+1", lambda k: k**3 + 1),
        ("f:k**3+1:ce", lambda k: k**3 + 1),
        ("f:2**k", lambda k: 2**k),
        ("f:k**k**k+1", lambda k: k**k**k + 1),  # 1, 2, 17, then 3**27 + 1
        ("f:(k+1)**(k+1)**(k+1)", lambda k: (k + 1) ** (k + 1) ** (k + 1)),  # 1, 16, then 3**27
        ("f:2**255//2**250+k", lambda k: 32 + k),  # values just under the bound are computed exactly
        ("f:" + "k+" * 60 + "1", lambda k: 60 * k + 1),  # 123 characters
        ("f:" + "-" * 80 + "k+1", lambda k: k + 1),  # an even number of signs
    ],
)
def test_valid_expressions_still_work(spec, reference):
    expected, k = [], 0
    while reference(k) < 500:
        expected.append(reference(k))
        k += 1
    pattern = get_pattern(spec)
    assert pattern.name == spec
    assert pattern.offsets(500) == expected
    config = ResolventConfig(mixer=spec, n_layer=2, n_embd=32, n_head=2)
    assert [m["pattern"] for m in config.layer_mixers] == [spec, spec]


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("f:2**-k+1", ["'f:2**-k+1'", "negative exponent", "k = 1", "integers"]),
        ("f:2**256+k", ["'f:2**256+k'", "k = 0", "2**256"]),
        ("f:k//0+1", ["'f:k//0+1'", "ZeroDivisionError", "k = 0"]),
        ("f:5-k", ["'f:5-k'", "strictly increasing"]),
    ],
)
def test_bad_values_name_the_expression(spec, fragments):
    with pytest.raises(ValueError) as info:
        get_pattern(spec)
    assert type(info.value) is ValueError
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
