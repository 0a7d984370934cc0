#!/usr/bin/env python
"""Where a prefill's time goes: one forward over n tokens (with a cache, ``logits_to_keep=1``, as ``generate()``
runs its prefill) under ``torch.profiler``, for GPT-2 or a resolvent mixer at bench_generate's shape.

    python scripts/bench/profile_prefill.py --model exp2:ce --n 32768          # docs/benchmarks/generation.md's profile
    python scripts/bench/profile_prefill.py --model dense --n 16384
    python scripts/bench/profile_prefill.py --model gpt2 --n 16384 --threads 2
    python scripts/bench/profile_prefill.py --model exp2:ce --n 32768 --chunk 512   # as generate(prefill_chunk_size=512)

Prints the wall time of the profiled forward (after an untimed one over 256 tokens) and the operators that took
the most time of their own.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_resolvent.modeling_resolvent import CACHE_NAME  # the cache's argument name in this transformers
from hf_resolvent.training.models import build_model


def build(model: str, width: int, layers: int, heads: int, vocab: int, n: int):
    """GPT-2 or a resolvent model as bench_generate builds it (the training package's model factory)."""
    shape = dict(n_positions=n, n_embd=width, n_layer=layers, n_head=heads, n_inner=4 * width)
    cfg = {"type": "gpt2" if model == "gpt2" else "resolvent", "preset": "tiny", "mixer": model, "overrides": shape}
    return build_model(cfg, vocab, n).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="exp2:ce", help="'gpt2' or a resolvent mixer spec")
    p.add_argument("--n", type=int, default=32768, help="prompt length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=None,
                   help="feed the prompt in chunks of this many tokens through the cache, as generate()'s chunked "
                        "prefill does (default: all at once)")
    p.add_argument("--rows", type=int, default=15, help="operators to list")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.model, args.width, args.layers, args.heads, args.vocab, args.n)
    ids = torch.randint(0, args.vocab, (1, args.n))
    with torch.no_grad():
        model(ids[:, :256], use_cache=True, logits_to_keep=1)  # builds the kernels, warms the allocator
        with torch.profiler.profile() as prof:
            start = time.perf_counter()
            cache = None
            for part in ids.split(args.chunk or args.n, dim=1):
                cache = model(part, **{CACHE_NAME: cache}, use_cache=True, logits_to_keep=1)[CACHE_NAME]
            wall = time.perf_counter() - start
    chunks = f" in chunks of {args.chunk}" if args.chunk else ""
    print(f"{args.model}: prefill of {args.n} tokens{chunks}, {args.threads} thread(s): {wall:.3f} s (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
