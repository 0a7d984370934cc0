"""Per-kernel GPU time of the Triton mixer's forward + backward (``torch.profiler``), to see which kernel limits
a pattern before changing one.

    python scripts/bench/profile_kernels.py --lengths 8192,32768 --patterns dense,exp2:ce,banded:64 --out runs/bench/profile

Inputs as in ``bench_kernels.py`` (B4 H16 d64, bfloat16 by default). For each (n, pattern): two warm-up steps,
then ``--steps`` profiled ones; prints torch.profiler's table (CUDA time per kernel, summed over the steps) and
writes ``<out>.json`` (per kernel: calls and total CUDA ms), rewritten after every case. Needs a CUDA GPU: without
one it says so and exits 2; ``--dry-run`` runs the same code on CPU through Triton's interpreter at tiny shapes
and 16-row tiles (CPU time per operator: a check of the script, its times mean nothing).

Each ``--config NAME=VALUE[,NAME=VALUE...]`` (BlockConfig settings, e.g. ``sparse_solver=chunked``) profiles every
case again under those settings, so the kernels of two variants show side by side:

    python scripts/bench/profile_kernels.py --patterns exp2:ce --config sparse_solver=blocked \
        --config sparse_solver=chunked --out runs/bench/profile_variants
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# --dry-run: tiny shapes, at the tiles of aot.DRY_RUN_TILES
DRY = dict(lengths="32", batch=1, heads=2, head_dim=16, steps=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/profile", help="output prefix: <out>.json")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--patterns", default="dense,exp2:ce,banded:64")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--steps", type=int, default=3, help="profiled forward + backward steps per case")
    p.add_argument("--config", action="append", default=None, metavar="NAME=VALUE[,NAME=VALUE...]",
                   help="BlockConfig settings to profile every case under; repeat it to compare variants")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes (checks the script)")
    args = p.parse_args(argv)
    if args.dry_run:
        for name, value in DRY.items():
            setattr(args, name, value)
    from hf_resolvent.backends.triton import aot

    from hf_resolvent.training import cli

    try:
        args.configs = [aot.parse_config(text) for text in args.config or [""]]
    except ValueError as err:
        p.error(f"--config: {err}")
    cli.check(p, files=[("--out", args.out + ".json")])
    return args


def profile_case(args, n: int, pattern: str, label: str = "") -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hf_resolvent.ops import resolvent_mix

    B, H, d = args.batch, args.heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    dev, activity = ("cpu", ProfilerActivity.CPU) if args.dry_run else ("cuda", ProfilerActivity.CUDA)
    gen = torch.Generator(device=dev).manual_seed(0)
    qa, ka, qb, kb, x = (torch.randn(B, H, n, d, device=dev, dtype=dtype, generator=gen).requires_grad_()
                         for _ in range(5))
    g = torch.rand(B, H, n, device=dev, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(B, H, n, d, device=dev, dtype=dtype, generator=gen)

    def step():
        resolvent_mix(qa, ka, qb, kb, x, g, pattern, impl="triton").backward(grad)

    def sync():
        if not args.dry_run:
            torch.cuda.synchronize()

    for _ in range(2):  # compile and warm up outside the profile
        step()
    sync()
    with profile(activities=[activity]) as prof:
        for _ in range(args.steps):
            step()
        sync()
    sort = "cpu_time_total" if args.dry_run else "cuda_time_total"
    print(f"=== n={n} {pattern} ({args.steps} steps)" + (f" [{label}]" if label else ""), flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=40), flush=True)
    total = (lambda e: e.cpu_time_total) if args.dry_run else (lambda e: e.device_time_total)
    rows = [{"kernel": e.key, "calls": e.count, "cuda_ms": total(e) / 1e3} for e in prof.key_averages()
            if total(e) > 0]
    return sorted(rows, key=lambda r: -r["cuda_ms"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first loaded
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("profile_kernels: no CUDA GPU here; it times the Triton kernels on a GPU (see docs/GPU.md); "
              "--dry-run runs the script through Triton's interpreter", file=sys.stderr)
        return 2
    from hf_resolvent.backends.triton import aot, block_config

    device = "cpu (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name()
    meta = {"device": device, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
            "dtype": args.dtype, "dry_run": args.dry_run}
    results = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for settings in args.configs:
        with block_config(**{**(aot.DRY_RUN_TILES if args.dry_run else {}), **settings}) as cfg:
            # the case line names the kernels it ran, whatever the defaults of the day (roofline.py reads it)
            label = aot.config_label({**aot.kernel_choice(cfg), **settings})
            for n in (int(v) for v in args.lengths.split(",")):
                for pattern in args.patterns.split(","):
                    kernels = profile_case(args, n, pattern, label)
                    results.append({"n": n, "pattern": pattern, "config": settings, "steps": args.steps,
                                    "kernels": kernels})
                    with open(args.out + ".json", "w") as f:  # after every case: a run stopped early keeps them
                        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
