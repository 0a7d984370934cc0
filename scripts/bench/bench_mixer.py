"""Benchmark the resolvent mixer on CPU: reference vs parallel form vs PyTorch causal SDPA.

For every length n and pattern, times the forward and the forward + backward of

- ``reference``: materialised A and B and one triangular solve (skipped above ``--max-reference``),
- ``parallel``: the block forward substitution of ``hf_resolvent.ops.parallel``,
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` on the same
  shapes (one row per n, pattern ``"attention"``), the yardstick of the ratios.

Shapes follow docs/DESIGN.md: batch 1, 8 heads, head width 64, float32. Timings are medians of
``--repeats`` runs after one warm-up, taken round-robin over the implementations of one (n, pattern)
so that load from other processes disturbs all of them alike; compare ratios, not absolute times.

Usage::

    python scripts/bench/bench_mixer.py --out runs/bench/mixer.json       # n = 512 ... 8192
    python scripts/bench/bench_mixer.py --out runs/bench/mixer.json --quick  # n <= 2048, under a minute

Writes ``{"rows": [{"impl", "pattern", "n", "fwd_ms", "fwdbwd_ms", ...}], "machine": {...}}`` to the
JSON file, a PNG plot next to it (same stem), and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_resolvent.ops import parallel_mix, reference_mix
from hf_resolvent.training import cli

PATTERNS = ("dense", "exp2", "exp2:ce", "square", "square:ce", "banded:8")
LENGTHS = (512, 1024, 2048, 4096, 8192)


def _inputs(n: int, batch: int, heads: int, dim: int, grad: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qa, ka, qb, kb, x = (torch.randn(batch, heads, n, dim, generator=gen) for _ in range(5))
    g = torch.rand(batch, heads, n, generator=gen) * 0.9 + 0.05
    ins = [qa, ka, qb, kb, x, g]
    if grad:
        for t in ins:
            t.requires_grad_(True)
    return ins


def _runner(impl: str, pattern: str, ins, backward: bool):
    qa, ka, qb, kb, x, g = ins
    if impl == "sdpa":
        fn = lambda: F.scaled_dot_product_attention(qa, ka, x, is_causal=True)
    elif impl == "parallel":
        fn = lambda: parallel_mix(qa, ka, qb, kb, x, g, pattern)
    elif impl == "reference":
        fn = lambda: reference_mix(qa, ka, qb, kb, x, g, pattern)
    else:
        raise ValueError(f"unknown impl {impl!r}")
    if not backward:
        def run():
            with torch.no_grad():
                fn()
        return run
    used = [t for t in ins if t is not None]

    def run_bwd():
        out = fn()
        out.backward(torch.ones_like(out))
        for t in used:
            t.grad = None
    return run_bwd


def _time_round_robin(runs: dict, repeats: int) -> dict:
    """Median seconds per entry of ``runs`` (name -> callable), one warm-up, interleaved repeats."""
    for fn in runs.values():
        fn()
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def bench(lengths, patterns, repeats: int, max_reference: int, batch: int, heads: int, dim: int, log=print,
          on_row=None):
    """Time every (n, pattern, impl); returns the rows. ``on_row(rows)`` is called after each new row."""
    rows = []
    for n in lengths:
        reps = repeats if n <= 2048 else max(1, min(repeats, 3))  # long runs: fewer repeats
        sdpa_f, sdpa_b = [], []
        for pattern in patterns:
            impls = ["sdpa", "parallel"] + (["reference"] if n <= max_reference else [])
            fwd_ins = _inputs(n, batch, heads, dim, grad=False)
            bwd_ins = _inputs(n, batch, heads, dim, grad=True)
            fwd = _time_round_robin({i: _runner(i, pattern, fwd_ins, False) for i in impls}, reps)
            fb = _time_round_robin({i: _runner(i, pattern, bwd_ins, True) for i in impls}, reps)
            sdpa_f.append(fwd["sdpa"])
            sdpa_b.append(fb["sdpa"])
            for impl in impls[1:]:
                row = {
                    "impl": impl,
                    "pattern": pattern,
                    "n": n,
                    "fwd_ms": fwd[impl] * 1e3,
                    "fwdbwd_ms": fb[impl] * 1e3,
                    # SDPA measured side by side with this very row: the ratio that matters.
                    "sdpa_fwd_ms": fwd["sdpa"] * 1e3,
                    "sdpa_fwdbwd_ms": fb["sdpa"] * 1e3,
                    "fwd_ratio_to_sdpa": fwd[impl] / fwd["sdpa"],
                    "fwdbwd_ratio_to_sdpa": fb[impl] / fb["sdpa"],
                }
                rows.append(row)
                log(_format_row(row))
                if on_row is not None:
                    on_row(rows)
        rows.append(
            {
                "impl": "sdpa",
                "pattern": "attention",
                "n": n,
                "fwd_ms": statistics.median(sdpa_f) * 1e3,
                "fwdbwd_ms": statistics.median(sdpa_b) * 1e3,
                "fwd_ratio_to_sdpa": 1.0,
                "fwdbwd_ratio_to_sdpa": 1.0,
            }
        )
        log(_format_row(rows[-1]))
        if on_row is not None:
            on_row(rows)
    return rows


def targets(rows) -> dict:
    """The issue's targets, from ratios measured side by side: dense parallel forward / SDPA at n = 2048
    (goal <= 2.5) and SDPA / exp2 parallel forward at n = 8192 (goal >= 5), where measured."""
    found = {}
    for r in rows:
        if r["impl"] == "parallel" and r["pattern"] == "dense" and r["n"] == 2048:
            found["dense_fwd_x_sdpa_at_2048"] = r["fwd_ratio_to_sdpa"]
        if r["impl"] == "parallel" and r["pattern"] == "exp2" and r["n"] == 8192:
            found["exp2_fwd_speedup_over_sdpa_at_8192"] = 1 / r["fwd_ratio_to_sdpa"]
    return found


HEADER = f"{'impl':<10}{'pattern':<11}{'n':>6}{'fwd ms':>10}{'x sdpa':>8}{'fwd+bwd ms':>12}{'x sdpa':>8}"


def _format_row(r: dict) -> str:
    return (
        f"{r['impl']:<10}{r['pattern']:<11}{r['n']:>6}{r['fwd_ms']:>10.1f}{r['fwd_ratio_to_sdpa']:>8.2f}"
        f"{r['fwdbwd_ms']:>12.1f}{r['fwdbwd_ratio_to_sdpa']:>8.2f}"
    )


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=False)
    series = sorted({(r["impl"], r["pattern"]) for r in rows})
    styles = {"parallel": "-", "reference": ":", "sdpa": "--"}
    patterns = sorted({p for i, p in series if i != "sdpa"})
    colours = {p: plt.cm.tab10(i % 10) for i, p in enumerate(patterns)}
    for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwdbwd_ms", "forward + backward")):
        for impl, pattern in series:
            pts = sorted((r["n"], r[key]) for r in rows if r["impl"] == impl and r["pattern"] == pattern)
            colour = "black" if impl == "sdpa" else colours[pattern]
            label = "sdpa (causal)" if impl == "sdpa" else f"{impl} {pattern}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(impl, "-"), marker="o", ms=3,
                    color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("Resolvent mixer on CPU (B=1, H=8, d=64, float32); solid: parallel, dotted: reference")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log(line: str) -> None:
    print(line, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write (a PNG with the same stem goes next to it)")
    parser.add_argument("--quick", action="store_true", help="n <= 2048, reference only at 512, 7 repeats")
    parser.add_argument("--lengths", type=int, nargs="*", help=f"sequence lengths (default {LENGTHS})")
    parser.add_argument("--patterns", nargs="*", help=f"patterns (default {PATTERNS})")
    parser.add_argument("--repeats", type=int,
                        help="timed runs per measurement after one warm-up (default 9, quick 7; at most 3 for n > 2048)")
    parser.add_argument("--max-reference", type=int, help="largest n for the reference (default 2048, quick 512)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)

    lengths = args.lengths or [n for n in LENGTHS if not args.quick or n <= 2048]
    patterns = args.patterns or list(PATTERNS)
    repeats = args.repeats or (7 if args.quick else 9)
    max_reference = args.max_reference if args.max_reference is not None else (512 if args.quick else 2048)
    if repeats < 1 or any(n < 2 for n in lengths):
        parser.error("--repeats must be >= 1 and lengths >= 2")
    cli.check(parser, files=[("--out", args.out)])

    machine = _machine()
    print(f"# {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} ({machine['torch_threads']} threads)")
    _log(f"# B={args.batch} H={args.heads} d={args.dim} float32, median of {repeats} after warm-up")
    _log(HEADER)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"batch": args.batch, "heads": args.heads, "dim": args.dim, "dtype": "float32", "repeats": repeats,
              "max_reference": max_reference, "command": " ".join(sys.argv)}

    def write(rows, complete: bool) -> dict:
        result = {"rows": rows, "targets": targets(rows), "machine": machine, "config": config,
                  "complete": complete, "seconds": time.perf_counter() - t0}
        out.write_text(json.dumps(result, indent=1))
        return result

    # Partial results are written after every row, so an interrupted run still leaves its table.
    rows = bench(lengths, patterns, repeats, max_reference, args.batch, args.heads, args.dim, log=_log,
                 on_row=lambda r: write(r, False))
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result = write(rows, True)
    png = out.with_suffix(".png")
    plot(rows, png)
    for name, value in result["targets"].items():
        print(f"{name}: {value:.2f}")
    print(f"wrote {out} and {png} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
