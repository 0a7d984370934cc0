"""Benchmark the Triton kernels of the resolvent mixer (GPU), or check that they compile for one (any machine).

GPU benchmark (the default): with ``triton.testing.do_bench``, forward and forward+backward times of

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (causal, flash backend);
- ``triton:<pattern>``: ``hf_resolvent.ops.resolvent_mix(..., impl="triton")`` for each pattern;
- ``parallel:<pattern>``: the PyTorch parallel form, same inputs (skipped above --parallel-max-n, where
  it gets slow or runs out of memory);
- ``fla:gated_deltanet`` (with ``--fla``): flash-linear-attention's chunked gated DeltaNet kernel
  (``chunk_gated_delta_rule``, keys normalised in the kernel) on inputs of the same size, a linear-time mixer a
  user might pick instead;

for n = 1k..16k, head dim 64, bfloat16 (``--dtype``). Writes a JSON file and a PNG plot (time vs n,
one panel per pass). On a machine without CUDA it says so and exits with status 2.

    python scripts/bench/bench_kernels.py --out runs/bench/kernels     # GPU
    python scripts/bench/bench_kernels.py --compile-check              # any machine: compile for sm_80 / sm_90

``--compile-check`` records every kernel launch of a forward, backward and decode step (the real
launch code, nothing runs), compiles each for the CUDA targets with Triton's bundled ptxas and
reports registers, spill stack and shared memory; it exits non-zero if a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PATTERNS = ["attention", "dense", "banded:64", "exp2", "exp2:ce", "square:ce"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/kernels", help="output prefix: <out>.json and <out>.png")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--patterns", default=",".join(DEFAULT_PATTERNS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--parallel-max-n", type=int, default=4096, help="largest n for the PyTorch parallel form")
    p.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    p.add_argument("--fla", action="store_true", help="also time flash-linear-attention's gated DeltaNet")
    p.add_argument("--compile-check", action="store_true", help="compile every kernel for GPU targets, no GPU needed")
    p.add_argument("--arch", default="80,90", help="compute capabilities for --compile-check")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Compile check


def compile_check(args) -> int:
    import torch
    from hf_resolvent.backends.triton import aot

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    cases = [(p, dtypes[args.dtype], False) for p in args.patterns.split(",")]
    cases += [("dense", torch.float32, False), ("exp2:ce", torch.float32, False), ("square", dtypes[args.dtype], True)]
    rows, failed, seen = [], 0, set()
    for pattern, dtype, tied in cases:
        launches = aot.record_launches(pattern, dtype=dtype, n=4096, d=args.head_dim, e=args.head_dim,
                                       batch=2, heads=4, tied=tied)
        for launch in launches:
            for arch in (int(a) for a in args.arch.split(",")):
                key = (launch.name, repr(sorted(launch.constexprs.items())), str(dtype), arch)
                if key in seen:
                    continue
                seen.add(key)
                t0 = time.time()
                row = {"kernel": launch.name, "arch": f"sm_{arch}", "dtype": str(dtype).replace("torch.", ""),
                       "pattern": pattern + (" (tied)" if tied else ""), "constexprs": launch.constexprs,
                       "options": launch.options}
                try:
                    row.update(aot.compile_launch(launch, arch))
                except Exception as err:  # report every failure, then exit non-zero
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    failed += 1
                row["compile_s"] = round(time.time() - t0, 1)
                rows.append(row)
                flags = {k: v for k, v in launch.constexprs.items() if not k.startswith("B") and k != "LOG2_BLOCK"}
                usage = row.get("error") or (f"regs {row['registers']:3d}  spill {row['spill_stack_bytes']:5d} B  "
                                             f"smem {row['shared']:6d} B")
                print(f"{row['arch']} {row['dtype']:9s} {launch.name:24s} "
                      f"{[v for k, v in launch.constexprs.items() if k.startswith('B')]} {flags} {usage}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + "_compile.json", "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print(f"{len(rows)} compilations, {failed} failed; wrote {args.out}_compile.json")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# GPU benchmark


def bench(args) -> int:
    import torch
    import torch.nn.functional as F
    import triton

    from hf_resolvent.ops import resolvent_mix
    from hf_resolvent.patterns import get_pattern

    dtype = getattr(torch, args.dtype)
    B, H, d = args.batch, args.heads, args.head_dim
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "batch": B, "heads": H, "head_dim": d, "dtype": args.dtype, "rows": []}

    for n in (int(v) for v in args.lengths.split(",")):
        results["rows"] += bench_length(args, n, dtype, F, resolvent_mix, get_pattern, triton)
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 0


def bench_length(args, n, dtype, F, resolvent_mix, get_pattern, triton) -> list[dict]:
    """Time every candidate at length n; returns rows {name, n, forward_ms, forward_backward_ms}."""
    import torch

    dev, B, H, d = "cuda", args.batch, args.heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(n)
    qa, ka, qb, kb, x = (torch.randn(B, H, n, d, device=dev, dtype=dtype, generator=gen).requires_grad_()
                         for _ in range(5))
    g = torch.rand(B, H, n, device=dev, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(B, H, n, d, device=dev, dtype=dtype, generator=gen)
    leaves = [qa, ka, qb, kb, x, g]

    def timed(fn, backward: bool):
        if backward:
            def step():
                fn().backward(grad)
        else:
            def step():
                with torch.no_grad():
                    fn()
        try:
            return triton.testing.do_bench(step, rep=args.rep, grad_to_none=leaves if backward else None)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    candidates = {"sdpa": lambda: _sdpa(F, qa, ka, x)}
    for p in args.patterns.split(","):
        has_b = get_pattern(p).has_recurrence
        ins = (qa, ka, qb if has_b else None, kb if has_b else None, x, g if has_b else None)
        candidates[f"triton:{p}"] = lambda ins=ins, p=p: resolvent_mix(*ins, p, impl="triton")
        if n <= args.parallel_max_n:
            candidates[f"parallel:{p}"] = lambda ins=ins, p=p: resolvent_mix(*ins, p, impl="parallel")
    if args.fla:
        candidates["fla:gated_deltanet"] = _gated_deltanet(B, H, n, d, dtype, gen, leaves)
    rows = []
    for name, fn in candidates.items():
        try:
            fwd, fwd_bwd = timed(fn, backward=False), timed(fn, backward=True)
        except Exception as err:  # a candidate that cannot run (fla missing or failing) is reported, not fatal
            print(f"n={n:6d} {name:24s} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
            rows.append({"name": name, "n": n, "forward_ms": None, "forward_backward_ms": None,
                         "error": f"{type(err).__name__}: {err}"[:500]})
            continue
        rows.append({"name": name, "n": n, "forward_ms": fwd, "forward_backward_ms": fwd_bwd})
        print(f"n={n:6d} {name:24s} fwd {_fmt(fwd)} ms  fwd+bwd {_fmt(fwd_bwd)} ms", flush=True)
    return rows


def _gated_deltanet(B, H, n, d, dtype, gen, leaves):
    """fla's chunked gated DeltaNet on [B, n, H, d] inputs (its layout): log-decay g < 0, beta in (0, 1).

    Its inputs join ``leaves`` so that their gradients are cleared between timed steps like ours."""
    import torch

    q, k, v = (torch.randn(B, n, H, d, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    decay = torch.nn.functional.logsigmoid(torch.randn(B, n, H, device="cuda", generator=gen)).requires_grad_()
    beta = torch.rand(B, n, H, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    leaves += [q, k, v, decay, beta]

    def run():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        out, _ = chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)
        return out.transpose(1, 2)  # [B, H, n, d], the layout of the gradient the timer feeds back

    return run


def _sdpa(F, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fmt(v):
    return "   oom" if v is None else f"{v:8.3f}"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = sorted({r["name"] for r in results["rows"]}, key=lambda s: (s != "sdpa", s))
    for ax, key, title in zip(axes, ("forward_ms", "forward_backward_ms"), ("forward", "forward + backward")):
        for name in names:
            pts = [(r["n"], r[key]) for r in results["rows"] if r["name"] == name and r[key] is not None]
            if pts:
                style = "-" if name.startswith(("triton", "sdpa")) else ":"
                ax.plot(*zip(*pts), style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{title}: B={results['batch']} H={results['heads']} d={results['head_dim']} {results['dtype']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(results["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_check:
        return compile_check(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False). "
              "Run it on a GPU machine, or use --compile-check here to compile the kernels for GPU targets.",
              file=sys.stderr)
        return 2
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
