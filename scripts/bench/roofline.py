"""Roofline model of the Triton mixer's kernels: what each kernel moves and computes, and the time that implies.

    python scripts/bench/roofline.py --out runs/bench/roofline.json
    python scripts/bench/roofline.py --patterns dense,exp2:ce --lengths 8192 --step-latency-us 1
    python scripts/bench/roofline.py --config default \
        --config chunked:sparse_solver=chunked,dense_solver=chunked,attn_bwd=atomic

For each pattern and length (B4 H16 d64 bfloat16 by default, the shapes of ``bench/gpu/kernels_h100.json``) the
forward and backward launches are recorded from the real launch code (``kernels/aot.py``'s recorder, on meta
tensors: nothing runs and nothing is allocated), so grids, tile sizes and dtypes follow the code. Each
``--config [NAME:]FIELD=VALUE,...`` (BlockConfig settings, e.g. the solvers ``sparse_solver=chunked``,
``dense_solver=chunked`` and the backward ``attn_bwd=atomic``; ``default`` for none) is one variant, recorded
under those settings and named NAME (its settings without one) in the rows and the JSON. Per launch:

- programs, chain steps, bytes (the memory floor, and the tile bytes L2 serves) and FLOPs by precision, as each
  kernel's cost model beside its code counts them (``hf_resolvent.backends.triton.cost``, which says what counts);
- roofline time: max(compute time, bytes / bandwidth) + chain steps x the per-step latency, with the compute
  time the sum over precisions of FLOPs / peak, scaled up when the grid has fewer programs than the GPU has
  SMs; integer work (the sources the row-by-row sparse kernels compute per row and slot) is left out. Beside
  it, the overlapped time max(compute, memory, chain): the chain's steps and the parallel work fully
  overlapped, where the roofline time has them one after the other.

The per-step latency is an assumption (``DEFAULT_STEP_LATENCY_US``, ``--step-latency-us``; per kernel
``--kernel-step-latency-us``), and so is how many blocks of a ticket-ordered solve are still in flight when a
block's program starts (``DEFAULT_BLOCKS_IN_FLIGHT``, ``--blocks-in-flight``): the chunked dense forward scores
those blocks twice. Every pass line gives its work time (the sum of max(compute, memory)) and its chain steps,
so the time at another latency L is work + steps x L.

A pass is its kernels one after another (the small PyTorch operations between them are left out). SDPA is the
reference: FlashAttention-2's count, 4 n^2/2 d FLOPs per head forward and 2.5 times that backward. Beside each
pass: the measured time from ``--measured`` (a bench_kernels.py JSON; its rows of the variant's settings) and
measured / roofline, and per kernel the time per step from ``--profile`` (a profile_kernels.py log) where it has
the case. Prints a table per case, a summary of the passes against SDPA, and writes the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from hf_resolvent.backends.triton.cost import DEFAULT_BLOCKS_IN_FLIGHT, launch_cost

from hf_resolvent.training import cli

REPO = Path(__file__).resolve().parents[2]

# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense, no sparsity): BF16 tensor core 989 TFLOP/s,
# TF32 tensor core 494.5 TFLOP/s, FP32 66.9 TFLOP/s, HBM3 3.35 TB/s, 132 SMs.
H100_BF16_TFLOPS = 989.0
H100_TF32_TFLOPS = 494.5
H100_FP32_TFLOPS = 66.9
H100_HBM_TBPS = 3.35
H100_SMS = 132
# Assumed, not measured: the time one step of a solve's chain takes on its own (a wait on the previous block's
# publication, the L2 round trip of its rows, the dependent products after the wait).
DEFAULT_STEP_LATENCY_US = 2.0

DEFAULT_PATTERNS = "attention,dense,exp2:ce,square:ce"
DEFAULT_LENGTHS = "4096,8192,32768"
DEFAULT_MEASURED = "bench/gpu/kernels_h100.json"
DEFAULT_PROFILE = "bench/gpu/profile_h100_lookback.log"
SDPA = "sdpa"
DEFAULT_VARIANT = "default"
# A measurement names the kernels it timed by aot.KERNEL_FIELDS; files written before they recorded them
# (bench_kernels rows without "kernels", profile logs whose case lines name only what they changed) meant the
# defaults of their day, LEGACY_DEFAULTS, which the measured kernels later replaced.
LEGACY_DEFAULTS = {"sparse_solver": "blocked", "dense_solver": "blocked", "solved_copy": False, "attn_bwd": "split"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/roofline.json")
    p.add_argument("--patterns", default=DEFAULT_PATTERNS, help=f"comma-separated; '{SDPA}' is always added")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--bf16-tflops", type=float, default=H100_BF16_TFLOPS, help="16-bit tensor-core peak")
    p.add_argument("--tf32-tflops", type=float, default=H100_TF32_TFLOPS, help="tf32 tensor-core peak")
    p.add_argument("--fp32-tflops", type=float, default=H100_FP32_TFLOPS, help="float32 CUDA-core peak")
    p.add_argument("--hbm-tbps", type=float, default=H100_HBM_TBPS, help="memory bandwidth, TB/s")
    p.add_argument("--sms", type=int, default=H100_SMS, help="streaming multiprocessors")
    p.add_argument("--step-latency-us", type=float, default=DEFAULT_STEP_LATENCY_US,
                   help="assumed time of one chain step of a solve (microseconds)")
    p.add_argument("--kernel-step-latency-us", default="", metavar="KERNEL=US[,KERNEL=US...]",
                   help="per-kernel chain-step latencies over --step-latency-us, e.g. chunk_carry=1")
    p.add_argument("--blocks-in-flight", type=int, default=DEFAULT_BLOCKS_IN_FLIGHT,
                   help="assumed blocks of a ticket-ordered solve not yet published when a block starts (>= 1)")
    p.add_argument("--config", action="append", default=None, metavar="[NAME:]FIELD=VALUE[,FIELD=VALUE...]",
                   help="BlockConfig settings of one variant ('default' for none); repeat it to model variants "
                        "side by side (default: the defaults alone)")
    p.add_argument("--measured", default=DEFAULT_MEASURED, help="bench_kernels.py JSON ('' for none)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profile_kernels.py log ('' for none)")
    args = p.parse_args(argv)
    try:
        args.variants = [parse_variant(text) for text in args.config or [DEFAULT_VARIANT]]
        args.kernel_step_latency = parse_kernel_latencies(args.kernel_step_latency_us)
    except ValueError as err:
        p.error(str(err))
    names = [name for name, _ in args.variants]
    if len(set(names)) != len(names):
        p.error(f"--config: two variants share a name ({', '.join(names)}); name them NAME:FIELD=VALUE,...")
    if args.blocks_in_flight < 1:
        p.error(f"--blocks-in-flight must be >= 1 (the block before is always in flight), got {args.blocks_in_flight}")
    cli.check(p, files=[("--out", args.out)])
    return args


def parse_variant(text: str) -> tuple[str, dict]:
    """(name, BlockConfig settings) of a ``--config`` value: ``[NAME:]FIELD=VALUE,...``, or ``default`` (or "")
    for the defaults. Without a name the variant is named by its settings."""
    from hf_resolvent.backends.triton import aot

    text = text.strip()
    name, sep, rest = text.partition(":")
    if not sep or "=" in name:
        name, rest = "", text
    if rest in ("", DEFAULT_VARIANT):
        return name or DEFAULT_VARIANT, {}
    try:
        settings = aot.parse_config(rest)
    except ValueError as err:
        raise ValueError(f"--config {text!r}: {err}") from None
    return name or aot.config_label(settings), settings


def parse_kernel_latencies(text: str) -> dict:
    """{kernel: microseconds} from ``KERNEL=US,...`` (kernel names with or without ``_kernel``)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        try:
            out[name.strip().removesuffix("_kernel")] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--kernel-step-latency-us: {item!r} is not KERNEL=MICROSECONDS (e.g. chunk_carry=1)")
    return out


# --------------------------------------------------------------------------------------------------
# Recording the launches


def record_passes(pattern: str, n: int, batch: int, heads: int, d: int, dtype, settings: dict | None = None) -> dict:
    """The launches of a forward and of a backward of ``pattern`` under the BlockConfig ``settings`` (default: the
    current config), recorded on meta tensors: {"forward": [...], "backward": [...]} of ``aot.Launch``."""
    from hf_resolvent.backends.triton import aot, block_config

    with block_config(**(settings or {})):
        return aot.record_passes(pattern, dtype, n=n, d=d, e=d, batch=batch, heads=heads, device="meta")


# --------------------------------------------------------------------------------------------------
# Time of a launch (its counts: kernels/cost.py and each op's cost model beside its kernels)


def roofline_seconds(row: dict, hw: dict) -> dict:
    """Compute, memory and chain times of a launch (or of SDPA), the roofline time they imply (the chain after
    the larger of the other two) and the overlapped time (the largest of the three)."""
    f = row["work_flops"]
    fill = min(1.0, row["programs"] / hw["sms"]) if row.get("programs") else 1.0
    compute = (f["16bit"] / hw["bf16_flops"] + f["tf32"] / hw["tf32_flops"] + f["fp32"] / hw["fp32_flops"]) / fill
    memory = row["bytes"] / hw["hbm_bytes"]
    chain = row["chain_steps"] * hw["kernel_step_latency_s"].get(row["kernel"], hw["step_latency_s"])
    return {"compute_s": compute, "memory_s": memory, "chain_s": chain, "roofline_s": max(compute, memory) + chain,
            "overlapped_s": max(compute, memory, chain)}


def sdpa_cost(n: int, batch: int, heads: int, d: int, elem: int) -> dict:
    """FlashAttention-2's count for causal attention: forward 4 n^2/2 d FLOPs per head, backward 2.5 times that.
    Bytes: q, k, v read and o written forward; q, k, v, o, dO read and dq, dk, dv written backward (16-bit),
    and the float32 log-sum-exp. Programs are not modelled (the whole GPU is taken as busy)."""
    BH = batch * heads
    forward = 4 * n * n // 2 * d * BH
    rows = BH * n
    fwd_bytes, bwd_bytes = rows * (4 * d * elem + 4), rows * (8 * d * elem + 4)
    return {"forward": {"kernel": f"{SDPA}_fwd", "programs": None, "chain_steps": 0, "bytes": fwd_bytes,
                        "tile_bytes": fwd_bytes,
                        "flops": forward, "work_flops": {"16bit": forward, "tf32": 0, "fp32": 0}},
            "backward": {"kernel": f"{SDPA}_bwd", "programs": None, "chain_steps": 0, "bytes": bwd_bytes,
                         "tile_bytes": bwd_bytes,
                         "flops": int(2.5 * forward),
                         "work_flops": {"16bit": int(2.5 * forward), "tf32": 0, "fp32": 0}}}


# --------------------------------------------------------------------------------------------------
# Measured times


def load_measured(path: str, args) -> dict:
    """The rows of a bench_kernels.py JSON whose shapes are the modelled ones (none otherwise, or without a path):
    {"rows": [{"name", "config", "n", "forward_ms", "forward_backward_ms"}], ...} with the file's device. A row's
    name is its candidate without the `` [settings]`` bench_kernels.py adds; rows without a config are the
    defaults'."""
    if not path:
        return {"rows": [], "source": None, "device": None}
    with open(REPO / path if not os.path.isabs(path) else path) as f:
        data = json.load(f)
    same = (data.get("batch"), data.get("heads"), data.get("head_dim"), data.get("dtype")) == (
        args.batch, args.heads, args.head_dim, args.dtype)
    rows = []
    if same:
        for r in data["rows"]:
            if r.get("forward_ms") is not None:
                rows.append({"name": r["name"].split(" [")[0], "config": r.get("config") or {}, "n": r["n"],
                             "defaults": r.get("kernels") or LEGACY_DEFAULTS,
                             "forward_ms": r["forward_ms"], "forward_backward_ms": r.get("forward_backward_ms")})
    return {"rows": rows, "source": path, "device": data.get("device"), "shapes_match": same}


def measured_times(measured: dict, name: str, settings: dict, n: int) -> dict:
    """The measured row of candidate ``name`` on the kernels BlockConfig ``settings`` runs today, at length n ({} if
    none)."""
    pattern = name.split(":", 1)[-1]
    want = _kernels_key(settings, current_defaults(), pattern)
    for r in measured["rows"]:
        if (r["name"], r["n"]) == (name, n) and _kernels_key(r["config"], r["defaults"], pattern) == want:
            return r
    return {}


def current_defaults() -> dict:
    from hf_resolvent.backends.triton import BlockConfig, aot

    return aot.kernel_choice(BlockConfig())


def _kernels_key(settings: dict, defaults: dict, pattern: str) -> tuple:
    """What ``pattern`` runs under ``settings`` on top of the kernel choice ``defaults``, as sorted (field, value)
    pairs: the kernel-choosing fields that matter to the pattern, and the other settings (tiles) as given."""
    from hf_resolvent.backends.triton import aot

    if pattern == SDPA:
        return ()
    full = {**defaults, **settings}
    choice = aot.relevant({k: full[k] for k in aot.KERNEL_FIELDS}, pattern)
    return _settings_key({**choice, **{k: v for k, v in settings.items() if k not in aot.KERNEL_FIELDS}})


_CASE = re.compile(r"^=== n=(\d+) (\S+) \((\d+) steps\)(?: \[(.*)\])?")
_TIME = re.compile(r"^([\d.]+)(ms|us|s)$")


def _settings_key(settings: dict) -> tuple:
    return tuple(sorted(settings.items()))


def parse_profile(text: str) -> dict:
    """{(pattern, n, kernels): {kernel: ms per forward + backward step}} from a profile_kernels.py log: the Self
    CUDA column of each ``*_kernel`` row of torch.profiler's table, divided by the case's steps; kernels (sorted
    (field, value) pairs) from the `` [settings]`` of the case's line over LEGACY_DEFAULTS (profile_kernels.py
    names every kernel-choosing field there)."""
    from hf_resolvent.backends.triton import aot

    cases, current, steps = {}, None, 1
    for line in text.splitlines():
        head = _CASE.match(line)
        if head:
            try:
                settings = _kernels_key(aot.parse_config(head.group(4) or ""), LEGACY_DEFAULTS, head.group(2))
            except ValueError:  # settings this code does not know: a case no variant matches
                settings = (("unknown", head.group(4)),)
            current, steps = (head.group(2), int(head.group(1)), settings), int(head.group(3))
            cases[current] = {}
            continue
        cols = re.split(r"\s{2,}", line.strip())
        if current is None or len(cols) < 11 or not cols[0].endswith("_kernel"):
            continue
        t = _TIME.match(cols[6])
        if t:
            scale = {"s": 1e3, "ms": 1.0, "us": 1e-3}[t.group(2)]
            name = cols[0].removesuffix("_kernel")
            cases[current][name] = cases[current].get(name, 0.0) + float(t.group(1)) * scale / steps
    return cases


# --------------------------------------------------------------------------------------------------
# The model, the table, the JSON


def hardware(args) -> dict:
    return {"bf16_flops": args.bf16_tflops * 1e12, "tf32_flops": args.tf32_tflops * 1e12,
            "fp32_flops": args.fp32_tflops * 1e12, "hbm_bytes": args.hbm_tbps * 1e12, "sms": args.sms, "step_latency_s": args.step_latency_us * 1e-6,
            "kernel_step_latency_s": {k: v * 1e-6 for k, v in args.kernel_step_latency.items()}}


TOTALS = ("bytes", "tile_bytes", "flops", "chain_steps", "compute_s", "memory_s", "chain_s", "work_s",
          "roofline_s", "overlapped_s")


def _launch_row(cost: dict, hw: dict) -> dict:
    row = dict(cost, **roofline_seconds(cost, hw))
    row["work_s"] = max(row["compute_s"], row["memory_s"])
    return row


def _pass_total(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) for k in TOTALS}


def _ratio(measured_ms, roofline_s):
    return None if measured_ms is None else measured_ms / (roofline_s * 1e3)


def model_case(pattern: str, n: int, args, hw: dict, measured: dict, profile: dict,
               variant: tuple[str, dict] = (DEFAULT_VARIANT, {})) -> dict:
    """Every launch of a forward and a backward of ``pattern`` at length n under the variant (name, BlockConfig
    settings), with their roofline times, the kernels' summary (launches of one kernel added up) and the passes'
    totals beside the measured times. SDPA has no variant (None)."""
    import torch

    dtype = getattr(torch, args.dtype)
    name, settings = variant
    if pattern == SDPA:
        passes = sdpa_cost(n, args.batch, args.heads, args.head_dim, torch.empty((), dtype=dtype).element_size())
        launches = {k: [_launch_row(v, hw)] for k, v in passes.items()}
        candidate, name, settings = SDPA, None, {}
    else:
        recorded = record_passes(pattern, n, args.batch, args.heads, args.head_dim, dtype, settings)
        launches = {k: [_launch_row(launch_cost(launch, pattern, args.blocks_in_flight), hw)
                        for launch in v] for k, v in recorded.items()}
        candidate = f"triton:{pattern}"
    forward = _pass_total(launches["forward"])
    forward_backward = _pass_total(launches["forward"] + launches["backward"])
    times = measured_times(measured, candidate, settings, n)
    forward["measured_ms"] = times.get("forward_ms")
    forward_backward["measured_ms"] = times.get("forward_backward_ms")
    for total in (forward, forward_backward):
        total["measured_over_roofline"] = _ratio(total["measured_ms"], total["roofline_s"])
    profiled = profile.get((pattern, n, _kernels_key(settings, current_defaults(), pattern)), {})
    kernels = {}
    for phase in ("forward", "backward"):
        for row in launches[phase]:
            k = kernels.setdefault(row["kernel"], {"kernel": row["kernel"], "pass": phase, "launches": 0,
                                                   "programs": 0, **{key: 0 for key in TOTALS}})
            if k["pass"] != phase:  # launched in both passes (the chunked solves' carry)
                k["pass"] = "both"
            k["launches"] += 1
            for key in ("programs",) + TOTALS:
                k[key] += row[key] or 0
    for k in kernels.values():
        k["profiled_ms"] = profiled.get(k["kernel"])
        k["profiled_over_roofline"] = _ratio(k["profiled_ms"], k["roofline_s"])
        # The step latency that would make the roofline equal the profiled time: everything the model misses is
        # put on the chain, so an upper bound on what a step costs.
        k["profiled_step_us"] = None
        if k["profiled_ms"] is not None and k["chain_steps"]:
            k["profiled_step_us"] = (k["profiled_ms"] * 1e-3 - k["work_s"]) / k["chain_steps"] * 1e6
    return {"pattern": pattern, "n": n, "variant": name, "config": settings, "launches": launches,
            "kernels": list(kernels.values()), "forward": forward, "forward_backward": forward_backward}


def compare_to_sdpa(cases: list[dict]):
    """Adds to each pass total its roofline and overlapped times over SDPA's at the same length, and the chain-step
    latency at which the roofline equals SDPA's (the same latency for every chain; negative where the work alone
    takes longer, None without chain steps)."""
    sdpa = {c["n"]: c for c in cases if c["pattern"] == SDPA}
    for case in cases:
        for phase in ("forward", "forward_backward"):
            total, ref = case[phase], sdpa[case["n"]][phase]["roofline_s"]
            total["roofline_over_sdpa"] = total["roofline_s"] / ref
            total["overlapped_over_sdpa"] = total["overlapped_s"] / ref
            total["sdpa_step_us"] = ((ref - total["work_s"]) / total["chain_steps"] * 1e6 if total["chain_steps"]
                                     else None)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _measured(ms, ratio) -> str:
    return "not measured" if ms is None else f"{ms:.3g} ms ({ratio:.2g}x)"


def _title(case: dict) -> str:
    return f"{case['pattern']} n={case['n']}" + (f" [{case['variant']}]" if case["variant"] else "")


def print_case(case: dict):
    f, fb = case["forward"], case["forward_backward"]
    print(f"\n== {_title(case)}: roofline forward {_ms(f['roofline_s'])} ms, measured "
          f"{_measured(f['measured_ms'], f['measured_over_roofline'])}; forward+backward {_ms(fb['roofline_s'])} ms, "
          f"measured {_measured(fb['measured_ms'], fb['measured_over_roofline'])}")
    print(f"   {'kernel':<16} {'pass':<8} {'launches':>8} {'programs':>9} {'chain':>6} {'HBM GB':>8} {'tile GB':>8} "
          f"{'GFLOP':>9} {'compute':>8} {'memory':>8} {'chain':>8} {'roofline':>9} {'profiled':>9}")
    for k in case["kernels"]:
        prof = "-" if k["profiled_ms"] is None else f"{k['profiled_ms']:.3g}"
        if k["profiled_step_us"] is not None:
            prof += f" ({k['profiled_step_us']:.3g} us/step)"
        print(f"   {k['kernel']:<16} {k['pass']:<8} {k['launches']:>8} {k['programs'] or '-':>9} {k['chain_steps']:>6} "
              f"{k['bytes'] / 1e9:>8.3g} {k['tile_bytes'] / 1e9:>8.3g} {k['flops'] / 1e9:>9.4g} {_ms(k['compute_s']):>8} {_ms(k['memory_s']):>8} {_ms(k['chain_s']):>8} "
              f"{_ms(k['roofline_s']):>9} {prof:>9}")


def print_summary(cases: list[dict]):
    """One line per case: the forward's roofline and the forward + backward's parts, each against SDPA."""
    print("\n== passes against SDPA (ms; work = sum of max(compute, memory) per kernel, roofline = work + chain, "
          "overlapped = sum of max(compute, memory, chain); at a step latency L the roofline is work + steps x L, "
          "equal to SDPA's at L = 'L=SDPA', in us)")
    width = max(len(c["variant"] or "-") for c in cases)
    print(f"   {'pattern':<10} {'n':>6} {'variant':<{width}} {'fwd':>7} {'/SDPA':>6} | {'fwd+bwd: steps':>14} "
          f"{'HBM GB':>7} {'GFLOP':>8} {'work':>7} {'chain':>7} {'roofline':>8} {'/SDPA':>6} "
          f"{'overlap':>7} {'/SDPA':>6} {'L=SDPA':>7} {'measured':>9}")
    for c in cases:
        f, fb = c["forward"], c["forward_backward"]
        meas = "-" if fb["measured_ms"] is None else f"{fb['measured_ms']:.3g}"
        even = fb["sdpa_step_us"]
        even = "-" if even is None else ("never" if even < 0 else f"{even:.3g}")
        print(f"   {c['pattern']:<10} {c['n']:>6} {c['variant'] or '-':<{width}} {_ms(f['roofline_s']):>7} "
              f"{f['roofline_over_sdpa']:>6.2f} | {fb['chain_steps']:>14} {fb['bytes'] / 1e9:>7.3g} "
              f"{fb['flops'] / 1e9:>8.4g} {_ms(fb['work_s']):>7} {_ms(fb['chain_s']):>7} "
              f"{_ms(fb['roofline_s']):>8} {fb['roofline_over_sdpa']:>6.2f} {_ms(fb['overlapped_s']):>7} "
              f"{fb['overlapped_over_sdpa']:>6.2f} {even:>7} {meas:>9}")


def main(argv=None) -> int:
    args = parse_args(argv)
    hw = hardware(args)
    measured = load_measured(args.measured, args)
    profile = {}
    if args.profile:
        with open(REPO / args.profile if not os.path.isabs(args.profile) else args.profile) as f:
            profile = parse_profile(f.read())
    patterns = [p for p in args.patterns.split(",") if p and p != SDPA]
    lengths = [int(v) for v in args.lengths.split(",")]
    latencies = "".join(f", {k} {v} us" for k, v in args.kernel_step_latency.items())
    print(f"roofline: B{args.batch} H{args.heads} d{args.head_dim} {args.dtype}; peaks {args.bf16_tflops} TFLOP/s "
          f"16-bit, {args.tf32_tflops} tf32, {args.fp32_tflops} float32 CUDA cores, {args.hbm_tbps} TB/s, {args.sms} SMs. "
          f"Assumed: chain-step latency {args.step_latency_us} us{latencies}; {args.blocks_in_flight} blocks in "
          f"flight. Variants: "
          + "; ".join(f"{name} = {settings or 'the defaults'}" for name, settings in args.variants)
          + f". Times in ms; measured: {measured['source'] or 'none'} ({measured['device'] or '-'}), profiled: "
          f"{args.profile or 'none'} (ms per forward+backward step)")
    cases = []
    for n in lengths:
        for pattern in patterns:
            for variant in args.variants:
                cases.append(model_case(pattern, n, args, hw, measured, profile, variant))
                print_case(cases[-1])
        cases.append(model_case(SDPA, n, args, hw, measured, profile))
        print_case(cases[-1])
    compare_to_sdpa(cases)
    print_summary(cases)
    settings = {k: getattr(args, k) for k in ("batch", "heads", "head_dim", "dtype", "bf16_tflops", "tf32_tflops",
                                              "fp32_tflops", "hbm_tbps", "sms", "step_latency_us",
                                              "kernel_step_latency", "blocks_in_flight", "measured", "profile")}
    settings["variants"] = [{"name": name, "config": config} for name, config in args.variants]
    settings["assumptions"] = (
        "the chain-step latency is assumed, not measured, and so are the blocks in flight when a ticket-ordered "
        "block starts; bytes (the roofline's) move every distinct tensor argument of a launch once, tile_bytes "
        "every program's loads and stores (an atomic add as one store); FLOPs are 2 m n k per tl.dot and 2 per "
        "multiply-add of the sparse kernels' row dot products; a tf32x3 product takes the time of three tf32 "
        "products; integer work is not counted")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "measured_device": measured["device"], "cases": cases},
                              indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
