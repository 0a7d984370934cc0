"""The whole GPU measurement of the kernel variants in one command: are they right, how fast is each beside SDPA,
where does the time go, and which is the fastest correct one per pattern and length (docs/GPU.md says how to read it).

    python scripts/bench/gpu_measure.py --out runs/gpu_measure                  # GPU: the kernels, at most 8 min
    python scripts/bench/gpu_measure.py --part train --out runs/gpu_measure     # GPU: the 44M step's variants, 4 min
    python scripts/bench/gpu_measure.py --part model --out runs/gpu_measure     # GPU: the 44M step profiled, 5 min
    python scripts/bench/gpu_measure.py --part decode --out runs/gpu_measure    # GPU: generate(), 4 min
    python scripts/bench/gpu_measure.py --dry-run --part all --out /tmp/gpu_measure   # any machine: the plumbing

The kernel part runs, each step a process of its own with what is left of --budget-s (a step cut short keeps the
files it wrote):

1. ``check/<variant>/gpu_check.json``: ``gpu_check.py --shapes variants`` (bfloat16 and float32, head width 64 and
   128, left padding, the tied forms) of every variant on the patterns whose kernels it changes; the checks run
   side by side, since they are not timed. Each check's compile warm-up is Triton's compile time of the variant.
2. ``kernels.json``: ``bench_kernels.py`` at n = 4k..32k (B4 H16 d64 bfloat16): SDPA, the default kernels and each
   variant that passed its check, in one process; a variant is timed only on the patterns it changes. A variant
   whose check failed is not timed (the run stops early on a wrong result, variant by variant).
3. ``profile_<pattern>.json``: ``profile_kernels.py`` of dense and exp2:ce at 8k and 32k under each of their
   timed variants: the time per kernel, and so the real time of a chain step.
4. ``summary.md`` and ``summary.json``: the verdicts, compile times, every time over SDPA's, the fastest correct
   variant per pattern and length, the targets met or missed, and the kernels that take the time.

The train part (``--part train``) times the 44M training step (``bench_train.py``, bf16, GPT-2 beside attention,
dense, exp2:ce and square:ce) at context 512 and 4096 under the defaults and under the variants that passed their
checks, side by side in one process each (``train_<n>.json``).

The model part (``--part model``, one process) times the same step under the defaults at 512 x 32, 4096 x 4,
16384 x 1 and 65536 x 1 (context x batch; dense not at 65536, where no target is set), the models side by side
in rounds as ``bench_train.py`` does (its model factory and training step), each step also over GPT-2's in the
same round; then profiles two steps of each model with ``torch.profiler``: GPU-busy time against wall time, CUDA
kernel launches and host syncs per step, the kernels that take the time; and counts one step's aten calls with
``op_counts.py`` (kernel-launching calls, host syncs and where each sync is made). ``model.json`` / ``.md`` /
``.png``, and ``launches_per_layer.json`` / ``.md``: the aten calls that launch a kernel per layer of a training
step (one more layer's count minus the model's), for each model and over GPT-2's.

The decode part (``--part decode``, one process) runs ``generate()`` (greedy, bf16, 44M) of GPT-2 (SDPA's default
backend, and the flash backend forced with ``sdpa_kernel``) and attention, dense, exp2:ce and square:ce, at
prompts of 4096 and 32768 tokens, batch 1 and 32 (not batch 32 at 32768 for the models whose cache keeps every
position), eager and captured (``cache_implementation="static"`` with ``CompileConfig(fullgraph=True)``: the decode
step compiled by ``generate()``, CUDA graphs where inductor takes them): time to first token, ms per token, and per
generated token the CUDA kernel launches, graph launches and host syncs (``torch.profiler``) and the aten calls
and syncs (``op_counts.py``, eager only: a dispatch mode stops ``torch.compile``). ``decode.json`` / ``.md`` /
``.png``. A captured row that fails to compile is recorded with its error; the run goes on.

Both parts write their JSON after every row, skip what the time left cannot hold (a row is not started when less
time is left than the last row of its kind took) and say why in the row. ``--part all`` runs the four parts in
that order, each with its share of what is left of ``--budget-s``.

``--dry-run`` runs every step on CPU through Triton's interpreter at tiny shapes (the tiny preset, prompts of 16
and 32 tokens, 3 new tokens, vocabulary 512, float32; the captured decode traced by dynamo without inductor, once
per model): the times mean nothing, the plumbing is checked; the CUDA counts are left out and the aten counts
stand for them. On a CPU the timed rows run the resolvent mixers' PyTorch form; the per-layer launch counts
(``launches_per_layer``) run them on the Triton kernels, interpreted, as a GPU does (but for softmax attention
alone, which a GPU runs through SDPA). Exit status: 0 when every step ran and every check passed, 1 otherwise, 2 without a GPU (and no
--dry-run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"

# Variants, each a BlockConfig setting string; "" is the defaults. Order matters: a variant is timed on a pattern
# only where its settings for that pattern differ from every variant before it.
VARIANTS = {
    "default": "",
    "blocked-sparse": "sparse_solver=blocked",  # the sparse patterns' solves before the chunked ones
    # the kernels the defaults replaced
    "blocked": "attn_bwd=split,dense_solver=blocked,solved_copy=false,sparse_solver=blocked",
}
# Variants already checked on a GPU (bench/gpu/): timed without a check of their own.
VERIFIED = {"default", "blocked"}
TIMED = ["attention", "dense", "exp2:ce", "square:ce"]  # the patterns of the targets below
CHECKED = TIMED + ["banded:64", "diagonal", "exp2", "square"]  # every kernel path the variants change
PROFILED = ["dense", "exp2:ce"]
# Targets, forward + backward over SDPA's at the same n (B4 H16 d64 bfloat16): (pattern, lengths, at most).
TARGETS = [("exp2:ce", (4096, 8192, 16384, 32768), 1.0), ("exp2:ce", (32768,), 0.25),
           ("square:ce", (16384, 32768), 1.0), ("dense", (8192, 32768), 2.5),
           ("attention", (4096, 8192, 16384, 32768), 1.3)]
SIZES = {  # per mode: lengths, profile lengths, check grid, training contexts (batch), train preset
    "gpu": dict(lengths="4096,8192,16384,32768", profile_lengths="8192,32768", train=((512, 32), (4096, 4)),
                preset="44m", rounds=6,
                # the model part: (context, batch) of the step, rounds, profiled steps; the per-layer count's context
                model=((512, 32), (4096, 4), (16384, 1), (65536, 1)), model_rounds=3, profile_steps=2, layer_n=512,
                # the decode part: prompt lengths, batches, new tokens of the timed run, counted runs' new tokens
                prompts=(4096, 32768), batches=(1, 32), new_tokens=33, counted=(1, 9), vocab=50257),
    "dry": dict(lengths="32", profile_lengths="32", train=((32, 1),), preset="tiny", rounds=1,
                model=((16, 4), (32, 2), (64, 1), (128, 1)), model_rounds=1, profile_steps=1, layer_n=32,
                prompts=(16, 32), batches=(1, 2), new_tokens=3, counted=(1, 3), vocab=512),
}
# Seconds of each step within --budget-s (fractions of it), so a slow step cannot starve the ones after it.
SHARES = {"check": 0.45, "bench": 0.35, "profile": 0.2}
PARTS = ("kernels", "train", "model", "decode")  # --part all, in this order
DEFAULT_BUDGET = {"kernels": 480, "train": 240, "model": 300, "decode": 240}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (made if missing; files in it are replaced)")
    p.add_argument("--part", default="kernels",
                   help=f"what to measure: {', '.join(PARTS)}, a comma list of them, or all (the four in that order)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole run (default: 480 kernels, 240 train, 300 model, 240 decode, their sum "
                        "for several); each part gets its share of what the parts before it leave")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list of the variants to check and time, from " + ", ".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=16, help="compile processes of the checks together, shared by case "
                                                          "count (GPU)")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    # Hidden: tests/scripts/bench/test_gpu_measure.py makes one variant's check fail (gpu_check's --inject-error).
    p.add_argument("--inject-error", default=None, metavar="VARIANT", help=argparse.SUPPRESS)
    # Hidden: the child process of the model or the decode part (the parent's Steps start it).
    p.add_argument("--worker", default=None, choices=["model", "decode"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.variants = ["default"] + [v for v in VARIANTS if v in names and v != "default"]
    parts = list(PARTS) if args.part == "all" else args.part.split(",")
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        p.error(f"--part: unknown {unknown}; choose from {', '.join(PARTS)} or all")
    parts = [part for part in PARTS if part in parts]
    if args.budget_s is None:
        args.budget_s = float(sum(DEFAULT_BUDGET[part] for part in parts))
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    args.parts = parts
    from hf_resolvent.training import cli

    cli.check(p, folders=[("--out", args.out)])
    return args


# --------------------------------------------------------------------------------------------------
# Which variant changes which pattern


def settings_of(variant: str) -> dict:
    from hf_resolvent.backends.triton import aot

    return aot.parse_config(VARIANTS[variant])


def plan(variants: list[str], patterns: list[str]) -> dict[str, list[str]]:
    """{variant: the patterns on which it runs kernels of its own}: for each pattern, the first variant of each
    distinct relevant setting (the defaults on every pattern)."""
    from hf_resolvent.backends.triton import aot

    chosen, seen = {v: [] for v in variants}, {p: [] for p in patterns}
    for v in variants:
        for p in patterns:
            key = aot.relevant(settings_of(v), p)
            if v == "default" or (key and key not in seen[p]):
                seen[p].append(key)
                chosen[v].append(p)
    return chosen


def series_name(pattern: str, variant: str, prefix: str = "triton:") -> str:
    """bench_kernels.py's name of a triton candidate (bench_train.py's of a model with prefix "")."""
    from hf_resolvent.backends.triton import aot

    label = aot.config_label(settings_of(variant))
    return f"{prefix}{pattern}" + (f" [{label}]" if label else "")


# --------------------------------------------------------------------------------------------------
# Steps


class Steps:
    """Runs each step as a child process within the time left, logging its command and outcome."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.deadline = time.monotonic() + args.budget_s
        self.log: list[dict] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, name: str, cmd: list[str], log_path: Path) -> tuple[subprocess.Popen, dict]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.args.dry_run:
            env.update(TRITON_INTERPRET="1", HF_RESOLVENT_CPU_KERNELS="0")
        f = open(log_path, "w")
        print(f"[gpu_measure] {name}: {' '.join(cmd[1:])} (log {log_path.name})", flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        entry = {"step": name, "command": " ".join(cmd[1:]), "log": log_path.name, "started": time.monotonic()}
        proc._log_file = f
        return proc, entry

    def wait(self, proc: subprocess.Popen, entry: dict, seconds: float) -> dict:
        try:
            rc = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # with its compile workers
            proc.wait()
            rc = None
        proc._log_file.close()
        entry["seconds"] = round(time.monotonic() - entry.pop("started"), 1)
        entry["returncode"], entry["timed_out"] = rc, rc is None
        status = "stopped at its time limit" if rc is None else f"exit {rc}"
        print(f"[gpu_measure] {entry['step']}: {status} after {entry['seconds']:.0f} s", flush=True)
        self.log.append(entry)
        return entry

    def run(self, name: str, cmd: list[str], seconds: float) -> dict:
        proc, entry = self.start(name, cmd, self.out / f"{name}.log")
        return self.wait(proc, entry, min(seconds, self.left()))


def script(name: str) -> list[str]:
    """The command of a benchmark script, relative to the repository (the steps run there)."""
    return [sys.executable, str((BENCH / name).relative_to(REPO))]


def run_checks(args, steps: Steps, chosen: dict, seconds: float) -> dict:
    """gpu_check of every variant not yet verified on its patterns, side by side; {variant: its gpu_check.json}."""
    running = []
    checked = {v: ps for v, ps in chosen.items() if v not in VERIFIED and ps}
    total = sum(len(ps) for ps in checked.values())
    for v, patterns in checked.items():
        out = steps.out / "check" / v
        cmd = script("gpu_check.py") + ["--out", str(out), "--kinds", "mix,tied", "--patterns", ",".join(patterns),
                                        "--config", VARIANTS[v], "--budget-s", str(int(seconds * 0.8))]
        jobs = max(1, round(args.jobs * len(patterns) / total))  # the compile warm-up, shared by the checks
        cmd += ["--dry-run", "--jobs", "0"] if args.dry_run else ["--shapes", "variants", "--jobs", str(jobs)]
        if args.inject_error == v:
            cmd += ["--inject-error", "offset"]
        out.mkdir(parents=True, exist_ok=True)
        running.append((v, out, *steps.start(f"check_{v}", cmd, steps.out / f"check_{v}.log")))
    t0, results = time.monotonic(), {}
    for v, out, proc, entry in running:
        steps.wait(proc, entry, min(seconds - (time.monotonic() - t0), steps.left()))
        path = out / "gpu_check.json"
        results[v] = json.loads(path.read_text()) if path.exists() else None
    return results


def check_verdicts(chosen: dict, checks: dict) -> dict:
    """{variant: {pattern: "PASS" | "PASS, k of m skipped" | "FAIL" | "ERROR" | "MISSING"}}: FAIL or ERROR when a
    case did, PASS when the others passed (a check cut short by its time limit says how many it skipped), MISSING
    when none ran; the VERIFIED variants pass (their checks on a GPU are in bench/gpu/)."""
    verdicts = {}
    for v, patterns in chosen.items():
        result = checks.get(v)
        verdicts[v] = {}
        for p in patterns:
            if v in VERIFIED:
                verdicts[v][p] = "PASS"
                continue
            cases = [c for c in (result or {}).get("cases", []) if c["pattern"] == p]
            statuses = [c["status"] for c in cases]
            skipped = statuses.count("SKIP")
            if skipped == len(statuses):
                verdicts[v][p] = "MISSING"
            else:
                verdicts[v][p] = next((s for s in ("ERROR", "FAIL") if s in statuses),
                                      f"PASS, {skipped} of {len(statuses)} skipped" if skipped else "PASS")
    return verdicts


def passed(verdict: str | None) -> bool:
    """No case of the check failed and at least one ran."""
    return bool(verdict) and verdict.startswith("PASS")


def run_bench(args, steps: Steps, timed: dict, seconds: float) -> dict | None:
    cmd = script("bench_kernels.py") + ["--out", str(steps.out / "kernels"), "--lengths", SIZES[args.mode]["lengths"],
                                        "--patterns", ",".join(TIMED), "--parallel-max-n", "0"]
    if args.dry_run:
        cmd.append("--dry-run")
    for v in timed:
        cmd += ["--config", VARIANTS[v]]
    for v in timed:
        cmd += [f"--skip={series_name(p, v)}" for p in TIMED if p not in timed[v]]
    steps.run("bench", cmd, seconds)
    path = steps.out / "kernels.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_profiles(args, steps: Steps, timed: dict, seconds: float) -> dict:
    from hf_resolvent.training.models import mixer_slug

    results, t0 = {}, time.monotonic()
    for i, pattern in enumerate(PROFILED):
        variants = [v for v in timed if pattern in timed[v]]
        name = f"profile_{mixer_slug(pattern)}"
        out = steps.out / name
        cmd = script("profile_kernels.py") + ["--out", str(out), "--patterns", pattern,
                                              "--lengths", SIZES[args.mode]["profile_lengths"]]
        cmd += [f"--config={VARIANTS[v]}" for v in variants] + (["--dry-run"] if args.dry_run else [])
        share = (seconds - (time.monotonic() - t0)) / (len(PROFILED) - i)
        steps.run(name, cmd, share)
        path = out.with_suffix(".json")
        if path.exists():
            results[pattern] = json.loads(path.read_text())
    return results


def run_train(args, steps: Steps, timed: dict, seconds: float) -> dict:
    """bench_train at each context: GPT-2, and each mixer under every variant timed on it, side by side."""
    sizes, results, t0 = SIZES[args.mode], {}, time.monotonic()
    mixers = ["exp2:ce"] if args.dry_run else TIMED
    for i, (n, batch) in enumerate(sizes["train"]):
        out = steps.out / f"train_{n}.json"
        cmd = script("bench_train.py") + ["--out", str(out), "--preset", sizes["preset"], "--seq-len", str(n),
                                          "--batch", str(batch), "--rounds", str(sizes["rounds"]), "--mixers", *mixers]
        cmd += [f"--config={VARIANTS[v]}" for v in timed]
        cmd += [f"--skip={series_name(m, v, prefix='')}" for v in timed for m in mixers if m not in timed[v]]
        cmd += ["--device", "cpu", "--vocab", "512"] if args.dry_run else ["--device", "cuda", "--bf16"]
        steps.run(f"train_{n}", cmd, (seconds - (time.monotonic() - t0)) / (len(sizes["train"]) - i))
        if out.exists():
            results[n] = json.loads(out.read_text())
    return results


def run_worker(args, steps: Steps, part: str, seconds: float) -> dict | None:
    """The model or the decode part as one step: this script with ``--worker`` in a child process, which stops
    itself before ``seconds`` (the step is killed at it)."""
    cmd = script("gpu_measure.py") + ["--worker", part, "--out", str(steps.out), "--budget-s", f"{max(seconds, 1):.0f}"]
    if args.dry_run:
        cmd.append("--dry-run")
    steps.run(part, cmd, seconds)
    path = steps.out / f"{part}.json"
    return json.loads(path.read_text()) if path.exists() else None


# --------------------------------------------------------------------------------------------------
# The model and decode parts, in the child process (--worker). Each writes its JSON after every row, so that a
# part stopped at its time limit keeps what it measured.

DECODE_MODELS = ["gpt2", "gpt2 [flash]", "attention", "dense", "exp2:ce", "square:ce"]
FLASH = " [flash]"  # GPT-2 with SDPA's flash backend forced (torch.nn.attention.sdpa_kernel)
GROWING_CACHE = {"gpt2", "attention", "dense"}  # caches that keep every position: O(n) per sequence
# torch.profiler's names of the CUDA runtime and driver calls that launch one kernel (the Ex and ExC forms too)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")


class Clock:
    """The worker's time: its budget less a margin to write its files, and how long the last row of each kind
    took, so that a row is started only where the time left holds another like it."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds - min(20.0, 0.1 * seconds)
        self.took: dict[str, float] = {}

    def why_not(self, kind: str) -> str | None:
        left, need = self.deadline - time.monotonic(), self.took.get(kind, 0.0)
        if left > need:
            return None
        return f"out of time: {max(left, 0):.0f} s left of --budget-s, the last {kind} row took {need:.0f} s"

    def done(self, kind: str, started: float) -> None:
        self.took[kind] = time.monotonic() - started


def write_json(path: Path, obj) -> None:
    """Whole or not at all: a worker killed while writing leaves the previous file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def failure(err: BaseException) -> dict:
    """A row's record of an exception: out of memory is a limit of the machine (skipped), the rest an error."""
    import torch

    text = f"{type(err).__name__}: {str(err).strip()[:600]}"
    if isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower():
        return {"skipped": "out of memory: " + text[:200]}
    return {"error": text}


def profile_counts(events) -> dict:
    """From ``torch.profiler``'s ``key_averages()``: kernel launches (CUDA runtime and driver calls), CUDA graph
    launches, host syncs (stream and event synchronisations, as ``.item()`` makes, and synchronous ``cudaMemcpy``;
    not ``cudaDeviceSynchronize``, which is the timing's own ``torch.cuda.synchronize()``), device-to-host copies,
    and the GPU's busy milliseconds (the rows' own device time: each kernel once, under its aten op or alone)."""
    counts = {"cuda_launches": 0, "graph_launches": 0, "cuda_syncs": 0, "dtoh_copies": 0, "gpu_ms": 0.0}
    for e in events:
        if e.key.startswith(LAUNCH_EVENTS):
            counts["cuda_launches"] += e.count
        elif e.key == "cudaGraphLaunch":
            counts["graph_launches"] += e.count
        elif ("Synchronize" in e.key and "DeviceSynchronize" not in e.key) or e.key == "cudaMemcpy":
            counts["cuda_syncs"] += e.count
        if e.key.startswith("Memcpy DtoH"):
            counts["dtoh_copies"] += e.count
        counts["gpu_ms"] += e.self_device_time_total / 1e3
    return counts


def top_kernels(events, steps: int, k: int = 8) -> list[dict]:
    """The ``k`` rows of ``key_averages()`` that take the most GPU time: calls and ms per step."""
    rows = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    return [{"name": e.key, "calls": e.count / steps, "ms": e.self_device_time_total / 1e3 / steps} for e in rows[:k]]


def op_counter(device):
    """An ``op_counts.OpCounter`` for this device: on a GPU the host's own small tensors do not count. Each sync's
    site names its caller too (a sync is often made in a helper such as a check)."""
    from op_counts import OpCounter

    return OpCounter(device_type="cuda" if device.type == "cuda" else None, site_depth=2)


def counted_per_token(run, counted: tuple[int, int], device) -> dict:
    """Per generated token, the aten calls that launch a kernel and the host syncs (``op_counts``): the counts of a
    run of k2 new tokens less those of k1, over k2 - k1 (what the prefill costs cancels), and where the syncs of
    the decode steps are made."""
    from collections import Counter

    runs = []
    for k in counted:
        with op_counter(device) as c:
            run(k)
        runs.append(c)
    (k1, a), (k2, b) = zip(counted, runs)
    tokens = k2 - k1
    sites = Counter(b.sync_sites)
    sites.subtract(Counter(a.sync_sites))
    return {"counted_tokens": tokens, "aten_launches": b.n_launches - a.n_launches, "aten_syncs": b.n_syncs - a.n_syncs,
            "aten_launches_per_token": (b.n_launches - a.n_launches) / tokens,
            "aten_syncs_per_token": (b.n_syncs - a.n_syncs) / tokens,
            "sync_sites_per_token": {site: c / tokens for site, c in sites.most_common(8) if c > 0}}


def profiled_per_token(run, counted: tuple[int, int]) -> dict:
    """Per generated token, from ``torch.profiler`` (CUDA), as :func:`counted_per_token` takes its difference."""
    from torch.profiler import ProfilerActivity, profile

    got = []
    for k in counted:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(k)
        got.append(profile_counts(prof.key_averages()))
    tokens = counted[1] - counted[0]
    return {f"{key}_per_token": (got[1][key] - got[0][key]) / tokens for key in got[0]}


def stop_at(length: int):
    """A stopping criterion that ends generate() at ``length`` tokens. A captured row runs every generate() with
    the same max_new_tokens, so with one static cache and one compiled graph, and stops the shorter runs with this;
    its answers are made once, so it adds no kernel of its own (generate()'s own stopping work is there anyway)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAt(StoppingCriteria):
        answers = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.answers is None:
                self.answers = [torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
                                for done in (False, True)]
            return self.answers[input_ids.shape[1] >= length]

    return StoppingCriteriaList([StopAt()])


class CudagraphNotes:
    """Inductor's reasons for not taking CUDA graphs (its ``cudagraphs`` log, warnings) while compiling."""

    def __init__(self):
        import logging

        import torch._logging

        self.notes: list[str] = []
        self.log = torch._logging.getArtifactLogger("torch._inductor.cudagraph_utils", "cudagraphs")
        notes = self.notes

        class Keep(logging.Handler):
            def emit(self, record):
                line = record.getMessage().split("\n")[0].strip()
                if line not in notes:
                    notes.append(line)

        self.handler = Keep(logging.WARNING)

    def __enter__(self):
        self.log.addHandler(self.handler)
        return self.notes

    def __exit__(self, *exc):
        self.log.removeHandler(self.handler)


def decode_plan(sizes: dict, dry_run: bool) -> list[dict]:
    """The decode rows in the order they run: every eager row, then the captured ones, batch 1 first (compiling
    takes the time: the rows most worth having come first). Rows left out say why."""
    combos = [(n, b) for n in sizes["prompts"] for b in sizes["batches"]]
    longest, widest = max(sizes["prompts"]), max(sizes["batches"])
    rows = []
    for mode in ("eager", "captured"):
        for i, (n, batch) in enumerate(combos if mode == "eager" else sorted(combos, key=lambda c: (c[1], c[0]))):
            for name in DECODE_MODELS:
                row = {"model": name, "context": n, "batch": batch, "mode": mode}
                if widest > 1 and (n, batch) == (longest, widest) and name.removesuffix(FLASH) in GROWING_CACHE:
                    row["skipped"] = (f"its cache keeps every position: batch {batch} at {n} tokens is left out (the "
                                      "prefill's time and the cache's memory)")
                elif dry_run and mode == "captured" and i > 0:
                    row["skipped"] = "dry run: captured at the first prompt and batch only (each shape compiles anew)"
                rows.append(row)
    return rows


def decode_row(model, row: dict, sizes: dict, device, config) -> dict:
    """Time to first token, ms per token and the counts per token of one (model, prompt, batch, mode)."""
    import torch

    n, batch, new, captured = row["context"], row["batch"], sizes["new_tokens"], row["mode"] == "captured"
    gen = torch.Generator().manual_seed(n + batch)
    ids = torch.randint(1, sizes["vocab"], (batch, n), generator=gen).to(device)
    mask = torch.ones_like(ids)
    static = {"cache_implementation": "static", "compile_config": config} if captured else {}

    def run(k: int) -> float:
        """Seconds of a greedy generate() of k new tokens."""
        limit = ({"max_new_tokens": new, "min_new_tokens": new, "stopping_criteria": stop_at(n + k)} if captured
                 else {"max_new_tokens": k, "min_new_tokens": k})
        synchronize(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=0, **limit,
                             **static)
        synchronize(device)
        if tuple(out.shape) != (batch, n + k):
            raise RuntimeError(f"generate() gave {tuple(out.shape)}, expected {(batch, n + k)}")
        return time.perf_counter() - t0

    from torch._dynamo.utils import counters

    if captured:  # a graph of its own: dynamo would reuse another model's of the same class (and SDPA backend)
        torch._dynamo.reset()
    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    with torch.no_grad(), CudagraphNotes() as notes:
        t0 = time.perf_counter()
        run(new)  # compiles the decode step (captured), Triton's kernels, and sizes the static cache for every run
        out = {"warmup_s": time.perf_counter() - t0}
        if captured:
            out["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs
            out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
            out["cudagraph_notes"] = notes
        out["ttft_ms"] = 1e3 * min(run(1) for _ in range(2))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        total_ms = 1e3 * run(new)
        out["decode_ms_per_token"] = (total_ms - out["ttft_ms"]) / (new - 1)
        out["tokens_per_s"] = batch * 1e3 / out["decode_ms_per_token"] if out["decode_ms_per_token"] > 0 else None
        if device.type == "cuda":
            out["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        if not captured:  # a dispatch mode stops torch.compile: the captured rows have the profiler's counts only
            out.update(counted_per_token(run, sizes["counted"], device))
        if device.type == "cuda":
            out.update(profiled_per_token(run, sizes["counted"]))
    return out


def measure_decode(args, sizes: dict, device, clock: Clock, result: dict, path: Path) -> None:
    import contextlib

    import torch
    from bench_train import make_model
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import CompileConfig

    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:  # dynamo's capture without inductor's compile: the plumbing, in seconds
        config = dict(fullgraph=True, dynamic=False, backend="eager", mode=None)
    else:
        config = dict(fullgraph=True)  # as the README says; transformers' default mode: CUDA graphs
    for limit in ("recompile_limit", "cache_size_limit"):  # every shape of every model compiles its graph
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
            break
    models, configs = {}, {}
    length = max(sizes["prompts"]) + sizes["new_tokens"] + 8
    for name in DECODE_MODELS:
        torch.manual_seed(0)
        models[name] = make_model(name.removesuffix(FLASH), sizes["preset"], sizes["vocab"], length).to(device, dtype)
        models[name].eval()
        configs[name] = CompileConfig(**config)
        configs[name]._compile_all_devices = True  # transformers' switch for compiling on a CPU too
    result["settings"] = {"dtype": str(dtype).removeprefix("torch."), "preset": sizes["preset"],
                          "vocab": sizes["vocab"], "new_tokens": sizes["new_tokens"], "counted": sizes["counted"],
                          "compile_config": config}
    for row in decode_plan(sizes, args.dry_run):
        kind = f"{row['mode']} {row['context']} x {row['batch']}"
        why = row.get("skipped") or clock.why_not(kind)
        if why:
            row["skipped"] = why
        else:
            flash = row["model"].endswith(FLASH)
            t0 = time.monotonic()
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext():
                    row.update(decode_row(models[row["model"]], row, sizes, device, configs[row["model"]]))
            except Exception as err:  # noqa: BLE001 - a row's failure (a capture that fails included) is recorded
                row.update(failure(err))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            clock.done(kind, t0)
        result["rows"].append(row)
        print(f"[decode] {decode_line(row)}", flush=True)
        write_json(path, result)


def model_plan(sizes: dict) -> list[tuple[int, int, list[str], list[dict]]]:
    """Per (context, batch) of the model part: the models that run, and the rows of those left out with why."""
    plan, longest = [], sizes["model"][-1]
    for n, batch in sizes["model"]:
        names, left_out = ["gpt2"] + TIMED, []
        if (n, batch) == longest:
            names.remove("dense")
            left_out.append({"model": "dense", "context": n, "batch": batch,
                             "skipped": "not at the longest context: no target is set there, and its solves would take "
                                        "much of the part's time"})
        plan.append((n, batch, names, left_out))
    return plan


def step_counts(trainee, data, sizes: dict, device) -> dict:
    """One training step's aten calls (``op_counts``), and on a GPU ``profile_steps`` steps under
    ``torch.profiler``: GPU-busy ms per step (against the unprofiled step time of the rounds: the profiler's own
    host time would lengthen the wall time), CUDA launches and syncs per step, the top kernels."""
    from collections import Counter

    with op_counter(device) as c:
        trainee.step(data)
    out = {"aten_launches_per_step": c.n_launches, "aten_syncs_per_step": c.n_syncs,
           "top_aten": c.launches.most_common(8), "sync_sites": Counter(c.sync_sites).most_common(8)}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        steps = sizes["profile_steps"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = sum(trainee.step(data) for _ in range(steps))
        events = prof.key_averages()
        counts = profile_counts(events)
        out.update({f"{k}_per_step": v / steps for k, v in counts.items() if k != "gpu_ms"})
        out.update(gpu_busy_ms=counts["gpu_ms"] / steps, profiled_wall_ms=1e3 * wall / steps,
                   top_kernels=top_kernels(events, steps))
    return out


def train_rows(names: list[str], n: int, batch: int, sizes: dict, device, bf16: bool) -> list[dict]:
    """The models side by side at one (context, batch), as bench_train.py runs them: a warm-up step each, then
    rounds of one step per model in a fresh random order; the ratio to GPT-2 is the median over rounds."""
    import statistics

    import torch
    from bench_train import Trainee, _round_ratios, make_model

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, sizes["vocab"], (batch, n + 1), generator=gen).to(device)
    trainees, rows = {}, {}
    for name in names:
        rows[name] = {"model": name, "context": n, "batch": batch}
        try:
            torch.manual_seed(0)
            trainee = Trainee(make_model(name, sizes["preset"], sizes["vocab"], n).to(device).train(), device, bf16, {})
            trainee.step(data)  # the optimizer's state, Triton's compile
            trainees[name] = trainee
        except Exception as err:  # noqa: BLE001 - recorded in the model's row, the others go on
            rows[name].update(failure(err))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    times: dict[str, list[float]] = {name: [] for name in trainees}
    order = list(trainees)
    for _ in range(sizes["model_rounds"]):
        for i in torch.randperm(len(order), generator=gen).tolist():
            times[order[i]].append(trainees[order[i]].step(data))
    for name, trainee in trainees.items():
        step = statistics.median(times[name])
        row = rows[name]
        row.update(step_ms=1e3 * step, tokens_per_s=batch * n / step, ratio_to_gpt2=None, ratio_quartiles=None)
        if "gpt2" in times:
            row["ratio_to_gpt2"], row["ratio_quartiles"] = _round_ratios(times[name], times["gpt2"])
        try:
            row.update(step_counts(trainee, data, sizes, device))
        except Exception as err:  # noqa: BLE001 - the times stand without the profile
            row["profile_error"] = failure(err)
    return list(rows.values())


def launches_per_layer(sizes: dict, device, bf16: bool) -> dict:
    """The CPU proxy of the launch counts: per model, a training step's aten calls that launch a kernel (and its
    host syncs) per layer, as the count of the preset's depth plus one less the preset's depth; what is left of
    the step's count is outside the layers (embeddings, the loss, the optimizer)."""
    import torch
    from bench_train import Trainee, make_model

    from hf_resolvent.configuration_resolvent import PRESETS

    depth, n = PRESETS[sizes["preset"]]["n_layer"], sizes["layer_n"]
    data = torch.randint(0, sizes["vocab"], (1, n + 1), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name in ["gpt2"] + TIMED:
        counted = []
        for layers in (depth, depth + 1):
            torch.manual_seed(0)
            model = make_model(name, sizes["preset"], sizes["vocab"], n, n_layer=layers).to(device).train()
            if device.type == "cpu" and name != "gpt2":  # the Triton kernels, interpreted: what a GPU launches
                model.config.mixer_impl = "triton"
            trainee = Trainee(model, device, bf16, {})
            trainee.step(data)  # the first step makes the optimizer's state
            with op_counter(device) as c:
                trainee.step(data)
            counted.append(c)
        (a, b) = counted
        per, syncs = b.n_launches - a.n_launches, b.n_syncs - a.n_syncs
        rows.append({"model": name, "launches_per_layer": per, "launches_outside_layers": a.n_launches - depth * per,
                     "syncs_per_layer": syncs, "syncs_outside_layers": a.n_syncs - depth * syncs,
                     "launches_per_step": a.n_launches, "syncs_per_step": a.n_syncs})
    base = rows[0]["launches_per_layer"]
    for row in rows:
        row["per_layer_vs_gpt2"] = row["launches_per_layer"] / base if base else None
    return {"device": str(device), "preset": sizes["preset"], "layers": depth, "context": n, "batch": 1,
            "bf16": bf16, "rows": rows}


def measure_model(args, sizes: dict, device, clock: Clock, result: dict, path: Path) -> None:
    import gc

    import torch

    bf16 = not args.dry_run
    result["settings"] = {"preset": sizes["preset"], "vocab": sizes["vocab"], "bf16": bf16,
                          "rounds": sizes["model_rounds"], "profile_steps": sizes["profile_steps"]}
    for n, batch, names, left_out in model_plan(sizes):
        kind = f"{n} x {batch}"
        why = clock.why_not(kind)
        t0 = time.monotonic()
        rows = ([{"model": m, "context": n, "batch": batch, "skipped": why} for m in names] if why
                else train_rows(names, n, batch, sizes, device, bf16))
        clock.done(kind, t0)
        for row in rows + left_out:
            result["rows"].append(row)
            print(f"[model] {model_line(row)}", flush=True)
        write_json(path, result)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    why = clock.why_not("per-layer count")
    if why:
        result["launches_per_layer"] = {"skipped": why}
    else:
        result["launches_per_layer"] = launches_per_layer(sizes, device, bf16)


def worker(args) -> int:
    """The child process of the model or the decode part: ``<part>.json`` / ``.md`` / ``.png`` in --out (and
    ``launches_per_layer.json`` / ``.md`` for the model part). Exit 1 when a row failed; a captured decode that
    does not compile is a finding, recorded in its row, not a failure of the run."""
    import torch

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # bench_train's model factory and training step, op_counts
    if args.dry_run:
        torch.set_num_threads(1)  # tiny ops: more threads only wait on each other
    sizes = dict(SIZES[args.mode])
    device = torch.device("cpu" if args.dry_run else "cuda")
    out, clock = Path(args.out), Clock(args.budget_s)
    path = out / f"{args.worker}.json"
    result = {"part": args.worker, "environment": environment(args.dry_run), "dry_run": args.dry_run, "rows": []}
    if args.worker == "model":
        measure_model(args, sizes, device, clock, result, path)
        write_json(out / "launches_per_layer.json", result["launches_per_layer"])
        (out / "launches_per_layer.md").write_text(layers_markdown(result["launches_per_layer"]))
        text = model_markdown(result)
    else:
        measure_decode(args, sizes, device, clock, result, path)
        text = decode_markdown(result)
    write_json(path, result)
    path.with_suffix(".md").write_text(text)
    try:
        plot_part(result, path.with_suffix(".png"))
    except Exception as err:  # noqa: BLE001 - the figure is a convenience; the tables are written
        print(f"[{args.worker}] no figure: {type(err).__name__}: {err}", flush=True)
    print(text, flush=True)
    failed = [r for r in result["rows"] if "error" in r and r.get("mode") != "captured"]
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# Summary


def fastest(bench: dict, verdicts: dict) -> dict:
    """{pattern: {n: (variant, forward+backward ms, over SDPA)}}: the fastest variant that passed its check."""
    rows = {(r["name"], r["n"]): r for r in bench["rows"]}
    best = {}
    for p in TIMED:
        for n in sorted({r["n"] for r in bench["rows"]}):
            sdpa = (rows.get(("sdpa", n)) or {}).get("forward_backward_ms")
            for v, ps in verdicts.items():
                ms = (rows.get((series_name(p, v), n)) or {}).get("forward_backward_ms")
                if passed(ps.get(p)) and ms is not None:
                    if n not in best.setdefault(p, {}) or ms < best[p][n][1]:
                        best[p][n] = (v, ms, ms / sdpa if sdpa else None)
    return best


def targets(best: dict) -> list[dict]:
    out = []
    for pattern, lengths, limit in TARGETS:
        for n in lengths:
            got = best.get(pattern, {}).get(n)
            ratio = got[2] if got else None
            out.append({"pattern": pattern, "n": n, "at_most": limit, "variant": got[0] if got else None,
                        "ratio": ratio, "met": ratio is not None and ratio <= limit})
    return out


def summarize(args, env: dict, chosen, checks, verdicts, bench, profiles, train, steps: Steps,
              parts: dict | None = None) -> dict:
    """The run's summary; ``parts``: the JSON of the model and decode parts, by part (None: not run or no file)."""
    summary = {"environment": env, "variants": {v: VARIANTS[v] for v in args.variants}, "plan": chosen,
               "checks": {}, "verdicts": verdicts, "steps": steps.log, "dry_run": args.dry_run, "parts": args.parts}
    for part, result in (parts or {}).items():
        summary[part] = result
    for v, result in (checks or {}).items():
        summary["checks"][v] = None if result is None else {
            "summary": result.get("summary"), "passed": result.get("passed"),
            "compile_s": (result.get("warm_up") or {}).get("seconds"), "complete": result.get("complete")}
    if bench:
        best = fastest(bench, verdicts)
        summary["fastest"] = {p: {str(n): list(v) for n, v in d.items()} for p, d in best.items()}
        summary["targets"] = targets(best)
    if profiles:
        summary["profiles"] = {p: [{"n": r["n"], "config": r["config"], "steps": r["steps"],
                                    "kernels": r["kernels"][:8]} for r in res["results"]] for p, res in profiles.items()}
    if train:
        summary["train"] = {str(n): [{k: r[k] for k in ("model", "step_ms", "ratio_to_gpt2", "tokens_per_s")}
                                     for r in res["rows"]] for n, res in train.items()}
    return summary


def markdown(summary: dict, bench: dict | None) -> str:
    env = summary["environment"]
    lines = [f"# GPU measurement: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}" + (" (dry run: times mean nothing)"
                                                                 if summary["dry_run"] else ""), ""]
    variants = {} if set(summary["parts"]).isdisjoint(("kernels", "train")) else summary["variants"]
    if variants:
        lines += ["## Variants", "", "| variant | settings | patterns | check | compile (s) |",
                  "|---|---|---|---|---:|"]
    for v, settings in variants.items():
        check = summary["checks"].get(v)
        verdict = ", ".join(f"{p} {s}" for p, s in summary["verdicts"].get(v, {}).items())
        compile_s = check.get("compile_s") if check else None
        lines.append(f"| {v} | `{settings or '(defaults)'}` | {verdict or '-'} | {_check_cell(v, check)} | "
                     f"{'-' if compile_s is None else compile_s} |")
    if bench:
        lengths = sorted({r["n"] for r in bench["rows"]})
        rows = {(r["name"], r["n"]): r for r in bench["rows"]}
        lines += ["", f"## Forward + backward, ms and over SDPA (B{bench['batch']} H{bench['heads']} "
                  f"d{bench['head_dim']} {bench['dtype']})", "",
                  "| candidate | " + " | ".join(f"n={n}" for n in lengths) + " | first call (ms) |",
                  "|---|" + "---:|" * (len(lengths) + 1)]
        for name in dict.fromkeys(r["name"] for r in bench["rows"]):
            cells = []
            for n in lengths:
                r, sdpa = rows.get((name, n)), (rows.get(("sdpa", n)) or {}).get("forward_backward_ms")
                ms = r and r.get("forward_backward_ms")
                cells.append("-" if not ms else f"{ms:.2f}" + (f" ({ms / sdpa:.2f}x)" if sdpa and name != "sdpa"
                                                                else ""))
            first = (rows.get((name, lengths[0])) or {}).get("first_call_ms")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if first is None else f'{first:.0f}'} |")
        lines += ["", "## Fastest correct variant", "", "| pattern | " + " | ".join(f"n={n}" for n in lengths) + " |",
                  "|---|" + "---:|" * len(lengths)]
        for p, by_n in summary.get("fastest", {}).items():
            cells = [(f"{by_n[str(n)][0]} ({by_n[str(n)][2]:.2f}x)" if str(n) in by_n and by_n[str(n)][2]
                      else "-") for n in lengths]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines += ["", "## Targets", "", "| pattern | n | at most | got | variant | met |", "|---|---:|---:|---:|---|---|"]
        for t in summary.get("targets", []):
            got = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
            lines.append(f"| {t['pattern']} | {t['n']} | {t['at_most']}x | {got} | {t['variant'] or '-'} | "
                         f"{'yes' if t['met'] else 'no'} |")
    for pattern, cases in summary.get("profiles", {}).items():
        lines += ["", f"## Profile: {pattern} (CUDA ms per step, top kernels)", ""]
        for c in cases:
            label = ",".join(f"{k}={v}" for k, v in c["config"].items()) or "defaults"
            top = ", ".join(f"{k['kernel'][:40]} {k['cuda_ms'] / c['steps']:.2f}" for k in c["kernels"][:5])
            lines.append(f"- n={c['n']} [{label}]: {top}")
    for n, rows in summary.get("train", {}).items():
        lines += ["", f"## 44M training step, context {n}", "", "| model | step (ms) | vs GPT-2 | tokens/s |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['step_ms']:.1f} | {r['ratio_to_gpt2']:.2f}x | {r['tokens_per_s']:,.0f} |"
                  for r in rows]
    if summary.get("model"):
        lines += ["", model_markdown(summary["model"])]
        if "launches_per_layer" in summary["model"]:
            lines.append(layers_markdown(summary["model"]["launches_per_layer"]))
    if summary.get("decode"):
        lines += ["", decode_markdown(summary["decode"])]
    lines += ["", "## Steps", "", "| step | exit | seconds | command |", "|---|---|---:|---|"]
    for s in summary["steps"]:
        status = "time limit" if s["timed_out"] else str(s["returncode"])
        lines.append(f"| {s['step']} | {status} | {s['seconds']} | `{s['command']}` |")
    return "\n".join(lines) + "\n"


def _check_cell(variant: str, check: dict | None) -> str:
    if variant in VERIFIED:
        return "checked before (bench/gpu/)"
    if check is None or not check.get("summary"):
        return "not run"
    c = check["summary"]
    return f"{c['PASS']} passed, {c['FAIL']} failed, {c['ERROR']} errors, {c['SKIP']} skipped in {c['seconds']:.0f} s"


def _cell(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _note(row: dict) -> str:
    if "skipped" in row:
        return "skipped: " + row["skipped"]
    if "error" in row:
        return "error: " + row["error"].splitlines()[0][:200]
    notes = [f"compile {row['warmup_s']:.1f} s" if row.get("mode") == "captured" and "warmup_s" in row else ""]
    if row.get("mode") == "captured" and row.get("graphs_compiled") == 0:
        notes.append("generate() compiled no graph")
    notes += row.get("cudagraph_notes") or []
    if "profile_error" in row:
        notes.append("profile: " + next(iter(row["profile_error"].values())))
    return "; ".join(n for n in notes if n)


def decode_line(row: dict) -> str:
    head = f"{row['model']:13s} n {row['context']:6d} batch {row['batch']:3d} {row['mode']:8s}"
    if "ttft_ms" not in row:
        return f"{head} {_note(row)}"
    counts = f", aten {_cell(row.get('aten_launches_per_token'), '{:.0f}')} launches " \
             f"{_cell(row.get('aten_syncs_per_token'), '{:.1f}')} syncs per token"
    return f"{head} first token {row['ttft_ms']:.1f} ms, {row['decode_ms_per_token']:.2f} ms/token{counts}"


def model_line(row: dict) -> str:
    head = f"{row['model']:10s} {row['context']:6d} x {row['batch']:2d}"
    if "step_ms" not in row:
        return f"{head} {_note(row)}"
    return (f"{head} step {row['step_ms']:.1f} ms ({_cell(row['ratio_to_gpt2'])}x GPT-2), aten "
            f"{_cell(row.get('aten_launches_per_step'), '{:.0f}')} launches per step")


def decode_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"## Decode: generate() on {result['environment']['device']}", "",
             f"44M shape ({s['preset']} preset), {s['dtype']}, greedy, {s['new_tokens']} new tokens timed; counts per "
             f"token from runs of {s['counted'][1]} and {s['counted'][0]} new tokens"
             + (" (dry run: times mean nothing)" if result["dry_run"] else ""), "",
             "| model | prompt | batch | mode | first token (ms) | ms/token | tokens/s | aten launches/token | "
             "aten syncs/token | CUDA launches/token | graph launches/token | CUDA syncs/token | note |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        cells = [_cell(r.get("ttft_ms"), "{:.1f}"), _cell(r.get("decode_ms_per_token")),
                 _cell(r.get("tokens_per_s"), "{:,.0f}"), _cell(r.get("aten_launches_per_token"), "{:.0f}"),
                 _cell(r.get("aten_syncs_per_token"), "{:.1f}"), _cell(r.get("cuda_launches_per_token"), "{:.0f}"),
                 _cell(r.get("graph_launches_per_token"), "{:.1f}"), _cell(r.get("cuda_syncs_per_token"), "{:.1f}")]
        lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {r['mode']} | " + " | ".join(cells)
                     + f" | {_note(r)} |")
    sites = {}
    for r in result["rows"]:
        if r.get("sync_sites_per_token") and r["model"] not in sites:
            sites[r["model"]] = r["sync_sites_per_token"]
    if sites:
        lines += ["", "Host syncs of a decode step, eager, where the code asks for them (per token, first prompt):", ""]
        lines += [f"- {model}: " + ", ".join(f"`{site}` {n:g}" for site, n in by.items())
                  for model, by in sites.items()]
    return "\n".join(lines) + "\n"


def model_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"## 44M training step: {result['environment']['device']}", "",
             f"{s['preset']} preset, {'bf16 autocast' if s['bf16'] else 'float32'}, forward + backward + optimizer "
             f"step, median of {s['rounds']} rounds side by side; the profile over {s['profile_steps']} steps"
             + (" (dry run: times mean nothing)" if result["dry_run"] else ""), "",
             "| model | context x batch | step (ms) | vs GPT-2 (quartiles) | tokens/s | GPU busy / wall (ms) | "
             "CUDA launches/step | aten launches/step | aten syncs/step | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        q = r.get("ratio_quartiles")
        ratio = "-" if r.get("ratio_to_gpt2") is None else f"{r['ratio_to_gpt2']:.2f}x ({q[0]:.2f}-{q[1]:.2f})"
        busy = "-" if r.get("gpu_busy_ms") is None else f"{r['gpu_busy_ms']:.1f} / {r['step_ms']:.1f}"
        cells = [_cell(r.get("step_ms"), "{:.1f}"), ratio, _cell(r.get("tokens_per_s"), "{:,.0f}"), busy,
                 _cell(r.get("cuda_launches_per_step"), "{:.0f}"), _cell(r.get("aten_launches_per_step"), "{:.0f}"),
                 _cell(r.get("aten_syncs_per_step"), "{:.0f}")]
        lines.append(f"| {r['model']} | {r['context']} x {r['batch']} | " + " | ".join(cells) + f" | {_note(r)} |")
    tops = [r for r in result["rows"] if r.get("top_kernels")]
    if tops:
        lines += ["", "The kernels that take the GPU's time (ms per step):", ""]
        lines += [f"- {r['model']}, {r['context']} x {r['batch']}: " + ", ".join(
            f"`{k['name'][:48]}` {k['ms']:.2f}" for k in r["top_kernels"][:5]) for r in tops]
    return "\n".join(lines) + "\n"


def layers_markdown(layers: dict) -> str:
    if "rows" not in layers:
        return f"## aten calls that launch a kernel, per layer\n\n{layers.get('skipped', 'not measured')}\n"
    lines = ["## aten calls that launch a kernel, per layer of a training step", "",
             f"{layers['preset']} preset, context {layers['context']}, batch 1, on {layers['device']}: forward, "
             f"backward and optimizer step; per layer = the count at {layers['layers'] + 1} layers less the count at "
             f"{layers['layers']} (op_counts.py: views, allocations and metadata ops excluded)", "",
             "| model | per layer | vs GPT-2 | outside the layers | syncs per layer | syncs outside the layers |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in layers["rows"]:
        lines.append(f"| {r['model']} | {r['launches_per_layer']} | {_cell(r['per_layer_vs_gpt2'])}x | "
                     f"{r['launches_outside_layers']} | {r['syncs_per_layer']} | {r['syncs_outside_layers']} |")
    return "\n".join(lines) + "\n"


def plot_part(result: dict, png: Path) -> None:
    """decode.png: ms per token per model at each prompt and batch, eager and captured; model.png: each model's
    step time over GPT-2's against the context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    if result["part"] == "decode":
        done = [r for r in result["rows"] if r.get("decode_ms_per_token")]
        groups = list(dict.fromkeys((r["context"], r["batch"], r["mode"]) for r in done))
        width = 0.8 / max(1, len(DECODE_MODELS))
        for j, name in enumerate(DECODE_MODELS):
            ms = {(r["context"], r["batch"], r["mode"]): r["decode_ms_per_token"] for r in done if r["model"] == name}
            xs = [i + j * width for i, g in enumerate(groups) if g in ms]
            ax.bar(xs, [ms[g] for g in groups if g in ms], width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))],
                      [f"{n} x {b}\n{mode}" for n, b, mode in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("decode ms per token")
        ax.set_title(f"generate(), {result['settings']['dtype']}, {result['environment']['device']}")
    else:
        for name in ["gpt2"] + TIMED:
            mine = [r for r in result["rows"] if r["model"] == name and r.get("ratio_to_gpt2") is not None]
            ax.plot([r["context"] for r in mine], [r["ratio_to_gpt2"] for r in mine], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (batch: 32 at 512, 4 at 4096, 1 beyond)" if not result["dry_run"] else "context")
        ax.set_ylabel("training step time / GPT-2's")
        ax.set_title(f"44M training step, {result['environment']['device']}")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def environment(dry_run: bool) -> dict:
    import torch
    import triton

    device = "cpu (Triton interpreter)" if dry_run else torch.cuda.get_device_name()
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.mode = "dry" if args.dry_run else "gpu"
    if args.worker:
        return worker(args)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_measure.py needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run runs the same steps "
              "here through Triton's interpreter at tiny shapes.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps, env = Steps(args), environment(args.dry_run)

    def seconds_for(part: str) -> float:
        """A part's share of the time left: its default budget over those of the parts still to run, so that
        the time a part leaves goes to the ones after it."""
        rest = args.parts[args.parts.index(part):]
        return steps.left() * DEFAULT_BUDGET[part] / sum(DEFAULT_BUDGET[p] for p in rest)

    print(f"[gpu_measure] {env['device']}: {', '.join(args.parts)} in at most {args.budget_s:.0f} s, "
          f"variants {', '.join(args.variants)}; writing {out}", flush=True)
    chosen = plan(args.variants, TIMED if args.dry_run else CHECKED)  # the interpreter: the timed patterns only
    checks = bench = None
    profiles, train, parts = {}, {}, {}
    verdicts = {v: {p: "PASS" for p in ps} for v, ps in chosen.items() if v in VERIFIED}
    timed = {v: [p for p in TIMED if p in ps] for v, ps in chosen.items() if v in VERIFIED}
    if "kernels" in args.parts:
        share = {k: f * seconds_for("kernels") for k, f in SHARES.items()}
        checks = run_checks(args, steps, chosen, share["check"])
        verdicts = check_verdicts(chosen, checks)
        timed = {v: [p for p in TIMED if passed(verdicts[v].get(p))] for v in args.variants}
        timed = {v: ps for v, ps in timed.items() if ps}
        dropped = {v: [p for p, s in verdicts[v].items() if not passed(s)] for v in args.variants}
        for v, ps in dropped.items():
            if ps:
                print(f"[gpu_measure] {v}: not timed on {', '.join(ps)} (check: "
                      f"{', '.join(verdicts[v][p] for p in ps)})", flush=True)
        bench = run_bench(args, steps, timed, share["bench"])
        profiles = run_profiles(args, steps, timed, share["profile"])
    if "train" in args.parts:
        if "kernels" not in args.parts:  # trained as they are: their checks are the kernel part's
            timed = {v: [p for p in TIMED if p in chosen[v]] for v in args.variants}
        train = run_train(args, steps, {v: ps for v, ps in timed.items() if ps}, seconds_for("train"))
    for part in ("model", "decode"):  # the defaults only: the variants are the kernel and train parts' business
        if part in args.parts:
            parts[part] = run_worker(args, steps, part, seconds_for(part))
    summary = summarize(args, env, chosen, checks, verdicts, bench, profiles, train, steps, parts)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    text = markdown(summary, bench)
    (out / "summary.md").write_text(text)
    print(text, flush=True)
    ok = all(s["returncode"] == 0 for s in steps.log) and all(
        s == "PASS" for per in verdicts.values() for s in per.values())  # a skipped case is not a pass
    print(f"[gpu_measure] {'done' if ok else 'done, with failures (see above)'}: {out / 'summary.md'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
