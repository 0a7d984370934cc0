"""Per-token decode latency and cache bytes as the context grows: GPT-2 (DynamicCache) vs resolvent mixers.

Every model has the same width, depth, heads and vocabulary (defaults: width 256, 4 layers, 4 heads of 64,
GPT-2's 50257 tokens, float32, batch 1): ``transformers``' ``GPT2LMHeadModel`` with its ``DynamicCache`` and
one :class:`hf_resolvent.ResolventForCausalLM` per mixer with its :class:`hf_resolvent.ResolventCache`.

For each context c the caches are filled to c tokens directly (random keys/values/outputs of the right shapes,
through ``ResolventCacheLayer.store_prefill`` for resolvent layers, ``DynamicCache.update`` for
GPT-2): decode time depends on the shapes only, and prefilling 16k tokens of every model would dominate the
run. ``--check`` (on by default) verifies at the smallest context that a real prefill through the model holds
the same number of bytes. Then one-token forwards are timed round-robin over the models (so that load from
other processes disturbs all of them alike); the median is reported. Compare ratios, not absolute times.

``--compiled`` adds, for every mixer, its decode step compiled whole (``torch.compile(model, fullgraph=True)``,
inductor) on a static cache (``ResolventCache(config, max_cache_len=...)``, as ``generate(cache_implementation=
"static")`` makes it): one capacity for every context, so each model compiles once, before the timings (the
compile time is printed). A static cache holds its capacity, so patterns that keep every position read, and hold,
``max_cache_len`` rows at every context.

Usage::

    python scripts/bench/bench_decode.py --out runs/bench/decode.json               # contexts 512 ... 16384
    python scripts/bench/bench_decode.py --out runs/bench/decode.json --quick       # contexts 512 ... 4096
    python scripts/bench/bench_decode.py --out runs/bench/decode.json --quick --compiled   # and compiled steps

Writes ``{"rows": [{"model", "context", "ms_per_token", "cache_bytes"}, ...], "settings": {...}}``, a PNG
plot next to the JSON (same stem) and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_resolvent as hr
from hf_resolvent.modeling_resolvent import CACHE_NAME  # the cache's argument name in this transformers
from hf_resolvent.training import cli
from hf_resolvent.training.metrics import log_axes, write_result
from hf_resolvent.training.models import build_model

MIXERS = ("attention", "local_attention:256", "dense", "banded:64", "diagonal", "exp2", "exp2:ce", "square",
          "square:ce", "exp2:ce+tied")
GPT2 = "gpt2 (DynamicCache)"
COMPILED = " compiled"  # suffix of a mixer's compiled decode step on a static cache


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (a PNG with the same stem goes next to it)")
    p.add_argument("--quick", action="store_true", help="stop at 4096 tokens of context")
    p.add_argument("--max-context", type=int, default=16384)
    p.add_argument("--min-context", type=int, default=512)
    p.add_argument("--mixers", nargs="+", default=list(MIXERS), help="resolvent mixer specs to time")
    p.add_argument("--conv-sizes", nargs="+", type=int, default=[0], metavar="K",
                   help="time every mixer with each of these short convolutions (conv_size; 0: none), side by side: "
                        "a model with one is named 'MIXER [conv K]'")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=9, help="timed one-token forwards per model and context")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the real-prefill bytes check")
    p.add_argument("--compiled", action="store_true",
                   help="also time each mixer's decode step compiled (fullgraph, inductor) on a static cache")
    args = p.parse_args(argv)
    cli.check(p, files=[("--out", args.out)])
    return args


def contexts(lo: int, hi: int) -> list[int]:
    out, c = [], lo
    while c <= hi:
        out.append(c)
        c *= 2
    if out[-1] != hi:
        out.append(hi)
    return out


def build_models(args, n_positions: int) -> dict[str, torch.nn.Module]:
    """GPT-2 and every mixer at one shape, each from the training package's model factory with seed 0."""
    shape = dict(n_positions=n_positions, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
                 n_inner=4 * args.width)
    models = {}
    for name, mixer, conv in [(GPT2, GPT2, 0)] + [(m + (f" [conv {k}]" if k else ""), m, k)
                                                   for k in args.conv_sizes for m in args.mixers]:
        torch.manual_seed(0)
        overrides = {**shape, **({"conv_size": conv} if conv else {})}
        cfg = {"type": "gpt2" if name == GPT2 else "resolvent", "preset": "tiny", "mixer": mixer,
               "overrides": overrides}
        models[name] = build_model(cfg, args.vocab, n_positions).eval()
    return models


def filled_cache(name: str, model, context: int, gen: torch.Generator, capacity: int | None = None):
    """A cache holding ``context`` tokens of random content, shaped as a real prefill would leave it; static (for
    ``capacity`` tokens) for a compiled model."""
    if name == GPT2:
        cfg = model.config
        cache = DynamicCache(config=cfg)
        shape = (1, cfg.n_head, context, cfg.n_embd // cfg.n_head)
        for i in range(cfg.n_layer):
            cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), i)
        return cache
    cache = hr.ResolventCache(model.config, max_cache_len=capacity if name.endswith(COMPILED) else None)
    for layer, block in zip(cache.layers, model.transformer.h):
        mixer = block.mixer
        if not mixer.recurrent:
            names = ("keys_a", "values")
        elif mixer.tied:
            names = ("keys_b", "outputs")
        else:
            names = ("keys_a", "values", "keys_b", "outputs")
        shape = (1, mixer.num_heads, context, mixer.head_dim)
        # with a convolution, its input rows over the prefill, as the mixer gives them
        conv = None if mixer.conv is None else torch.randn(1, context + layer.conv_width - 1, mixer.conv.in_channels,
                                                           generator=gen)
        layer.store_prefill({n: torch.randn(shape, generator=gen) for n in names}, None, conv=conv)
    return cache


def cache_bytes(cache) -> int:
    if isinstance(cache, hr.ResolventCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def check_bytes(models, context: int, gen: torch.Generator) -> None:
    """A real prefill of ``context`` tokens holds as many bytes as the synthesised cache."""
    ids = torch.randint(0, next(iter(models.values())).config.vocab_size, (1, context), generator=gen)
    for name, model in models.items():
        if name.endswith(COMPILED):  # a static cache holds its capacity
            continue
        with torch.no_grad():
            real = model(ids, use_cache=True)[CACHE_NAME]
        want = cache_bytes(filled_cache(name, model, context, gen))
        if cache_bytes(real) != want:
            raise SystemExit(f"{name}: a real prefill holds {cache_bytes(real)} bytes, the synthesised cache {want}")
    print(f"check: real prefill of {context} tokens == synthesised cache bytes for the eager models")


def compile_steps(models, capacity: int, gen: torch.Generator) -> None:
    """Compile every mixer's decode step (fullgraph) on a static cache of ``capacity`` tokens, saying so: done once,
    before the timings."""
    for name in [n for n in models if n != GPT2]:
        compiled = torch.compile(models[name], fullgraph=True, dynamic=False)
        cache = filled_cache(name + COMPILED, models[name], 1, gen, capacity)
        print(f"compiling the decode step of {name} (once, on a static cache of {capacity} tokens) ...", flush=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(torch.zeros(1, 1, dtype=torch.long), **{CACHE_NAME: cache}, use_cache=True)
        print(f"  compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        models[name + COMPILED] = compiled


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    hi = min(args.max_context, 4096) if args.quick else args.max_context
    ctxs = contexts(args.min_context, hi)
    capacity = hi + args.warmup + args.steps + 1  # tokens a static cache holds: the largest context and the steps
    models = build_models(args, n_positions=capacity + 8)
    gen = torch.Generator().manual_seed(0)
    if args.check:
        check_bytes(models, ctxs[0], gen)
    if args.compiled:
        compile_steps(models, capacity, gen)
    token = torch.randint(0, args.vocab, (1, 1), generator=gen)
    rows = []
    for context in ctxs:
        caches = {name: filled_cache(name, model, context, gen, capacity) for name, model in models.items()}
        sizes = {name: cache_bytes(cache) for name, cache in caches.items()}
        times: dict[str, list[float]] = {name: [] for name in models}
        with torch.no_grad():
            for step in range(args.warmup + args.steps):
                for name, model in models.items():  # round-robin: shared disturbances hit every model
                    t0 = time.perf_counter()
                    model(token, **{CACHE_NAME: caches[name]}, use_cache=True)
                    if step >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
        for name in models:
            rows.append({"model": name, "context": context, "ms_per_token": 1e3 * statistics.median(times[name]),
                         "cache_bytes": sizes[name]})
            print(f"context {context:6d}  {name:22s} {rows[-1]['ms_per_token']:9.2f} ms/token "
                  f"{sizes[name] / 2**20:10.3f} MiB", flush=True)
        del caches
    settings = dict(width=args.width, layers=args.layers, heads=args.heads, head_dim=args.width // args.heads,
                    vocab=args.vocab, dtype="float32", batch=1, steps=args.steps, warmup=args.warmup,
                    threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version(),
                    machine=platform.machine(), processor=platform.processor() or "unknown",
                    contexts=ctxs, cache_fill="random content of the real shapes (see --check)",
                    compiled=f"fullgraph inductor decode step on a static cache of {capacity} tokens" if args.compiled
                    else None)
    return {"rows": rows, "settings": settings}


def table(result: dict) -> str:
    rows = result["rows"]
    ctxs = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["model"] for r in rows))
    at = {(r["model"], r["context"]): r for r in rows}
    head = "| model | " + " | ".join(f"{c} ms/tok" for c in ctxs) + f" | cache MiB at {ctxs[-1]} |"
    lines = [head, "|" + "---|" * (len(ctxs) + 2)]
    for name in names:
        cells = [f"{at[(name, c)]['ms_per_token']:.1f}" for c in ctxs]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {at[(name, ctxs[-1])]['cache_bytes'] / 2**20:.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: r["context"])
        ctx = [r["context"] for r in mine]
        style = dict(marker="o", linewidth=2.5 if name == GPT2 else 1.5, color="black" if name == GPT2 else None,
                     linestyle="--" if name.endswith(COMPILED) else "-")
        ax1.plot(ctx, [r["ms_per_token"] for r in mine], label=name, **style)
        ax2.plot(ctx, [r["cache_bytes"] / 2**20 for r in mine], label=name, **style)
    s = result["settings"]
    for ax, ylabel in ((ax1, "ms per token (median)"), (ax2, "cache MiB")):
        log_axes(ax, "context (tokens)", ylabel)
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"decode, batch 1, width {s['width']}, {s['layers']} layers, {s['heads']} heads, "
                 f"vocab {s['vocab']}, {s['threads']} threads, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    png = write_result(args.out, result, plot)
    print(table(result))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
