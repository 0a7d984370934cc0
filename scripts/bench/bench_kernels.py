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

Kernel variants side by side: each ``--config NAME=VALUE[,NAME=VALUE...]`` (BlockConfig settings: tiles, or the
variants ``sparse_solver``, ``dense_solver`` and ``attn_bwd``) gives one series of the ``triton:`` candidates, named
``triton:<pattern> [<settings>]`` (plain ``triton:<pattern>`` for ``--config ""``, the defaults); the other
candidates are timed once. For example

    python scripts/bench/bench_kernels.py --config "" \
        --config sparse_solver=chunked,dense_solver=chunked,attn_bwd=atomic --out runs/bench/kernels_variants

``--compile-check`` records every kernel launch of a forward, backward and decode step (the real
launch code, nothing runs) under each ``--config``, compiles each distinct one for the CUDA targets with
Triton's bundled ptxas and reports registers, spill stack, shared memory and static PTX instruction counts
(wgmma and mma.sync products, atomics: ``aot.ptx_counts``); it exits non-zero if a kernel fails to compile.
``--dry-run`` runs the benchmark's code on CPU through Triton's interpreter at tiny shapes and 16-row tiles (a
check of the script: its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

DEFAULT_PATTERNS = ["attention", "dense", "banded:64", "exp2", "exp2:ce", "square:ce"]
# Sizes of a GPU run, and of --dry-run (the interpreter: tiny shapes, a few patterns); options given win.
SIZES = {"gpu": {"lengths": "1024,2048,4096,8192,16384", "patterns": ",".join(DEFAULT_PATTERNS), "batch": 4,
                 "heads": 16, "head_dim": 64},
         "dry": {"lengths": "32", "patterns": "attention,exp2:ce", "batch": 1, "heads": 2, "head_dim": 16}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/kernels", help="output prefix: <out>.json and <out>.png")
    p.add_argument("--lengths", default=None, help="comma list of n (default 1024..16384; 32 with --dry-run)")
    p.add_argument("--patterns", default=None, help="comma list (default: " + ",".join(DEFAULT_PATTERNS) + ")")
    p.add_argument("--batch", type=int, default=None, help="default 4 (1 with --dry-run)")
    p.add_argument("--heads", type=int, default=None, help="default 16 (2 with --dry-run)")
    p.add_argument("--head-dim", type=int, default=None, help="default 64 (16 with --dry-run)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--parallel-max-n", type=int, default=4096, help="largest n for the PyTorch parallel form")
    p.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    p.add_argument("--fla", action="store_true", help="also time flash-linear-attention's gated DeltaNet")
    p.add_argument("--config", action="append", default=None, metavar="NAME=VALUE[,NAME=VALUE...]",
                   help="BlockConfig settings of one series of the triton candidates; repeat it to compare variants "
                        "(default: one series at the defaults)")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="leave out the candidate of this name (e.g. 'triton:dense [dense_solver=chunked]'); repeatable")
    p.add_argument("--compile-check", action="store_true", help="compile every kernel for GPU targets, no GPU needed")
    p.add_argument("--arch", default="80,90", help="compute capabilities for --compile-check")
    p.add_argument("--extra-cases", action=argparse.BooleanOptionalAction, default=True,
                   help="--compile-check: also float32 dense and exp2:ce and the tied square")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes (checks the script)")
    args = p.parse_args(argv)
    for name, value in SIZES["dry" if args.dry_run else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    from hf_resolvent.backends.triton import aot

    from hf_resolvent.training import cli

    try:
        args.configs = [aot.parse_config(text) for text in args.config or [""]]
    except ValueError as err:
        p.error(f"--config: {err}")
    cli.check(p, files=[("--out", args.out + (".json" if not args.compile_check else "_compile.json"))])
    return args


# --------------------------------------------------------------------------------------------------
# Compile check


def compile_check(args) -> int:
    """Compile every distinct launch of the cases under every --config; a row per (launch, arch) naming the
    configs that launch it."""
    import torch
    from hf_resolvent.backends.triton import aot, block_config

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    cases = [(p, dtypes[args.dtype], False) for p in args.patterns.split(",")]
    if args.extra_cases:
        cases += [("dense", torch.float32, False), ("exp2:ce", torch.float32, False),
                  ("square", dtypes[args.dtype], True)]
    rows, failed, seen = [], 0, {}
    for settings in args.configs:
        label = aot.config_label(settings) or "defaults"
        for pattern, dtype, tied in cases:
            with block_config(**settings):
                launches = aot.record_launches(pattern, dtype=dtype, n=4096, d=args.head_dim, e=args.head_dim,
                                               batch=2, heads=4, tied=tied)
            for launch in launches:
                for arch in (int(a) for a in args.arch.split(",")):
                    key = (aot.compile_key(launch), arch)
                    if key in seen:
                        if label not in seen[key]["configs"]:
                            seen[key]["configs"].append(label)
                        continue
                    t0 = time.time()
                    row = {"kernel": launch.name, "arch": f"sm_{arch}", "dtype": str(dtype).replace("torch.", ""),
                           "pattern": pattern + (" (tied)" if tied else ""), "configs": [label],
                           "constexprs": launch.constexprs, "options": launch.options}
                    seen[key] = row
                    try:
                        row.update(aot.compile_launch(launch, arch))
                    except Exception as err:  # report every failure, then exit non-zero
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                        failed += 1
                    row["compile_s"] = round(time.time() - t0, 1)
                    rows.append(row)
                    print(_compile_line(row, launch), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + "_compile.json", "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print(f"{len(rows)} compilations, {failed} failed; wrote {args.out}_compile.json")
    return 1 if failed else 0


def _compile_line(row: dict, launch) -> str:
    is_tile = lambda k: k.startswith("B") or k in ("C", "HM")
    tiles = [v for k, v in launch.constexprs.items() if is_tile(k)]
    flags = {k: v for k, v in launch.constexprs.items()
             if not is_tile(k) and not k.startswith("LOG2_") and k not in ("PREC", "SOLVE_PREC")}
    usage = row.get("error") or (f"regs {row['registers']:3d}  spill {row['spill_stack_bytes']:5d} B  "
                                 f"smem {row['shared']:6d} B  wgmma {row['wgmma']:3d}  mma.sync {row['mma_sync']:3d}  "
                                 f"atomics {row['atomics']:2d}")
    config = "" if row["configs"] == ["defaults"] else f" [{row['configs'][0]}]"
    return f"{row['arch']} {row['dtype']:9s} {launch.name:24s} {tiles} {flags}{config} {usage}"


# --------------------------------------------------------------------------------------------------
# Benchmark (GPU; --dry-run: CPU through the interpreter)


def bench(args) -> int:
    import torch
    import triton
    from hf_resolvent.backends.triton import aot, block_config

    dtype = getattr(torch, args.dtype)
    B, H, d = args.batch, args.heads, args.head_dim
    device = "cpu (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name()
    results = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "batch": B, "heads": H,
               "head_dim": d, "dtype": args.dtype, "configs": args.configs, "dry_run": args.dry_run, "rows": []}
    tiles = contextlib.nullcontext()
    if args.dry_run:  # 16-row tiles, as the interpreter tests: every length spans several blocks
        tiles = block_config(**aot.DRY_RUN_TILES)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tiles:
        for n in (int(v) for v in args.lengths.split(",")):
            results["rows"] += bench_length(args, n, dtype)
            if not args.dry_run:
                torch.cuda.empty_cache()
            with open(args.out + ".json", "w") as f:  # after every length: a run stopped early keeps its rows
                json.dump(results, f, indent=1)
    plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 0


def bench_length(args, n, dtype) -> list[dict]:
    """Time every candidate at length n; returns rows {name, config, n, forward_ms, forward_backward_ms}: the
    triton candidates once per --config (their names end in `` [<settings>]`` unless the config is the defaults),
    the others once."""
    import torch
    import torch.nn.functional as F
    from hf_resolvent.backends.triton import aot, block_config

    from hf_resolvent.ops import resolvent_mix
    from hf_resolvent.patterns import get_pattern

    dev = "cpu" if args.dry_run else "cuda"
    B, H, d = args.batch, args.heads, args.head_dim
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
        if args.dry_run:
            return _time_once(step, leaves if backward else [])
        import triton

        try:
            return triton.testing.do_bench(step, rep=args.rep, grad_to_none=leaves if backward else None)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    inputs = {}
    for p in args.patterns.split(","):
        has_b = get_pattern(p).has_recurrence
        inputs[p] = (qa, ka, qb if has_b else None, kb if has_b else None, x, g if has_b else None)
    # (name, settings, fn): settings None for the candidates no BlockConfig changes
    candidates = [("sdpa", None, lambda: _sdpa(F, qa, ka, x))]
    for settings in args.configs:
        label = aot.config_label(settings)
        for p, ins in inputs.items():
            candidates.append((f"triton:{p}" + (f" [{label}]" if label else ""), settings,
                               lambda ins=ins, p=p: resolvent_mix(*ins, p, impl="triton")))
    if n <= args.parallel_max_n:
        candidates += [(f"parallel:{p}", None, lambda ins=ins, p=p: resolvent_mix(*ins, p, impl="torch"))
                       for p, ins in inputs.items()]
    if args.fla:
        candidates.append(("fla:gated_deltanet", None, _gated_deltanet(B, H, n, d, dtype, gen, leaves)))
    rows = []
    for name, settings, fn in candidates:
        if name in args.skip:
            continue
        row = {"name": name, "config": settings or {}, "n": n}
        try:
            with block_config(**(settings or {})) as cfg:
                row["kernels"] = aot.kernel_choice(cfg)  # what it ran, whatever the defaults of the day
                row["first_call_ms"] = first_call(fn, leaves, grad, args.dry_run)
                fwd, fwd_bwd = timed(fn, backward=False), timed(fn, backward=True)
        except Exception as err:  # a candidate that cannot run (fla missing or failing) is reported, not fatal
            print(f"n={n:6d} {name:24s} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
            rows.append({**row, "forward_ms": None, "forward_backward_ms": None,
                         "error": f"{type(err).__name__}: {err}"[:500]})
            continue
        rows.append({**row, "forward_ms": fwd, "forward_backward_ms": fwd_bwd})
        print(f"n={n:6d} {name:24s} fwd {_fmt(fwd)} ms  fwd+bwd {_fmt(fwd_bwd)} ms  "
              f"(first call {row['first_call_ms']:.0f} ms)", flush=True)
    return rows


def first_call(fn, leaves, grad, dry_run: bool) -> float:
    """Wall time (ms) of the candidate's first forward + backward in this process: Triton's compile (or its load from
    the on-disk cache) and the launch set-up, which the steady times of do_bench leave out."""
    import torch

    def step():
        fn().backward(grad)
        if not dry_run:
            torch.cuda.synchronize()

    return _time_once(step, leaves)


def _time_once(step, leaves) -> float:
    """--dry-run: one call's wall time (ms), gradients cleared first as do_bench clears them."""
    for t in leaves:
        t.grad = None
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


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

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), layout="constrained")
    names = sorted({r["name"] for r in results["rows"]}, key=lambda s: (s != "sdpa", s))
    # One colour per candidate; the --config series of a triton candidate share it, one line style each.
    bases = sorted({name.split(" [")[0] for name in names}, key=lambda s: (s != "sdpa", s))
    colours = {base: f"C{i % 10}" for i, base in enumerate(bases)}
    configs = results.get("configs") or [{}]
    for ax, key, title in zip(axes, ("forward_ms", "forward_backward_ms"), ("forward", "forward + backward")):
        for name in names:
            rows = [r for r in results["rows"] if r["name"] == name and r[key] is not None]
            if rows:
                if name.startswith("triton"):
                    style = ("-", "--", "-.", (0, (1, 1)))[configs.index(rows[0]["config"]) % 4]
                else:
                    style = "-" if name == "sdpa" else ":"
                ax.plot([r["n"] for r in rows], [r[key] for r in rows], linestyle=style, marker="o", label=name,
                        color=colours[name.split(" [")[0]])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{title}: B={results['batch']} H={results['heads']} d={results['head_dim']} {results['dtype']}")
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(*axes[1].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=7)
    fig.suptitle(results["device"])
    fig.savefig(path, dpi=120)


@contextlib.contextmanager
def _interpreter():
    """TRITON_INTERPRET=1 within the block (read when the kernels are first loaded in a mode), as it was after."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_check:
        return compile_check(args)
    if args.dry_run:
        with _interpreter():
            return bench(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False). "
              "Run it on a GPU machine, or use --compile-check here to compile the kernels for GPU targets "
              "(--dry-run: the benchmark's code through Triton's interpreter at tiny shapes).",
              file=sys.stderr)
        return 2
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
