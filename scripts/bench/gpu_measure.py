"""The whole GPU measurement of the kernel variants in one command: are they right, how fast is each beside SDPA,
where does the time go, and which is the fastest correct one per pattern and length (docs/GPU.md says how to read it).

    python scripts/bench/gpu_measure.py --out runs/gpu_measure                  # GPU: the kernels, at most 8 min
    python scripts/bench/gpu_measure.py --part train --out runs/gpu_measure     # GPU: the 44M training step, 5 min
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
checks, side by side in one process each (``train_<n>.json``). ``--dry-run`` runs every step on CPU through
Triton's interpreter at tiny shapes: the times mean nothing, the plumbing is checked. Exit status: 0 when every
step ran and every check passed, 1 otherwise, 2 without a GPU (and no --dry-run).
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
    "chunked-sparse": "sparse_solver=chunked",
    "blocked": "attn_bwd=split,dense_solver=blocked,solved_copy=false",  # the kernels the defaults replaced
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
                preset="44m", rounds=6),
    "dry": dict(lengths="32", profile_lengths="32", train=((32, 1),), preset="tiny", rounds=1),
}
# Seconds of each step within --budget-s (fractions of it), so a slow step cannot starve the ones after it.
SHARES = {"check": 0.45, "bench": 0.35, "profile": 0.2}
DEFAULT_BUDGET = {"kernels": 480, "train": 240}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (made if missing; files in it are replaced)")
    p.add_argument("--part", default="kernels", choices=["kernels", "train", "all"])
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole run (default: 480 kernels, 240 train, their sum for all); the train part "
                        "gets what the kernel part leaves")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list of the variants to check and time, from " + ", ".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=16, help="compile processes of the checks together, shared by case "
                                                          "count (GPU)")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    # Hidden: tests/scripts/bench/test_gpu_measure.py makes one variant's check fail (gpu_check's --inject-error).
    p.add_argument("--inject-error", default=None, metavar="VARIANT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.variants = ["default"] + [v for v in VARIANTS if v in names and v != "default"]
    parts = ["kernels", "train"] if args.part == "all" else [args.part]
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


def summarize(args, env: dict, chosen, checks, verdicts, bench, profiles, train, steps: Steps) -> dict:
    summary = {"environment": env, "variants": {v: VARIANTS[v] for v in args.variants}, "plan": chosen,
               "checks": {}, "verdicts": verdicts, "steps": steps.log, "dry_run": args.dry_run}
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
    lines += ["## Variants", "", "| variant | settings | patterns | check | compile (s) |", "|---|---|---|---|---:|"]
    for v, settings in summary["variants"].items():
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


def environment(dry_run: bool) -> dict:
    import torch
    import triton

    device = "cpu (Triton interpreter)" if dry_run else torch.cuda.get_device_name()
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.mode = "dry" if args.dry_run else "gpu"
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_measure.py needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run runs the same steps "
              "here through Triton's interpreter at tiny shapes.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps, env = Steps(args), environment(args.dry_run)
    parts_budget = {part: DEFAULT_BUDGET[part] for part in args.parts}
    scale = args.budget_s / sum(parts_budget.values())
    print(f"[gpu_measure] {env['device']}: {', '.join(args.parts)} in at most {args.budget_s:.0f} s, "
          f"variants {', '.join(args.variants)}; writing {out}", flush=True)
    chosen = plan(args.variants, TIMED if args.dry_run else CHECKED)  # the interpreter: the timed patterns only
    checks = bench = None
    profiles, train = {}, {}
    verdicts = {v: {p: "PASS" for p in ps} for v, ps in chosen.items() if v in VERIFIED}
    timed = {v: [p for p in TIMED if p in ps] for v, ps in chosen.items() if v in VERIFIED}
    if "kernels" in args.parts:
        share = {k: f * parts_budget["kernels"] * scale for k, f in SHARES.items()}
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
        train = run_train(args, steps, {v: ps for v, ps in timed.items() if ps}, steps.left())
    summary = summarize(args, env, chosen, checks, verdicts, bench, profiles, train, steps)
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
