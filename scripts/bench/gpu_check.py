"""Check every Triton kernel against the PyTorch forms on a GPU, in one command (docs/GPU.md says how to run it and read it).

Each case runs one kernel family on random inputs and compares it with an oracle in float64:

- ``mix``: ``kernels.triton_mix`` (forward and the gradients of qa, ka, qb, kb, x, g) against
  ``ops.reference_mix`` (n x n matrices, where they fit) or ``ops.parallel_mix`` (long sequences; in float32
  where the float64 attention of its dense path would not fit, or after an out-of-memory error);
- ``tied``: ``kernels.triton_mix`` with ``d`` (and the gradients of qb, kb, x, g, d) against the tied forms;
- ``decode``, ``decode_tied``: a few ``kernels.triton_decode_step`` calls (with ``d`` for the tied variant) on a
  state cut from a random prefill of n rows, against ``ops.recurrent_step`` on a float64 copy (outputs and the final
  cache).

for every pattern (attention, local attention, dense, banded, diagonal, exp2, exp2:ce, square, square:ce),
float32 and bfloat16, with left padding in some shapes. Kernel outputs are allocated filled with NaN
(``kernels.set_nan_fill``), so unwritten memory fails. Bfloat16 kernels are compared with the oracle run on
the same rounded inputs. A check (an output, a gradient, a cache tensor) passes when its values are finite,
max |kernel - oracle| / max |oracle| <= MAX (a wrong row or block shows here) and ||kernel - oracle|| /
||oracle|| <= NORM (a precision loss spread over every value shows here), per dtype: --tol-fp32, --tol-bf16.

    python scripts/bench/gpu_check.py --out runs/gpu_check                  # GPU: the full grid (under 8 min, H100)
    python scripts/bench/gpu_check.py --pytest --skip-kernels --out DIR     # GPU: the test suite only
    python scripts/bench/gpu_check.py --dry-run --out /tmp/gpu_check        # any machine: interpreter, tiny shapes
    python scripts/bench/gpu_check.py --config sparse_solver=chunked,attn_bwd=atomic --out runs/gpu_check_variants

``--shapes full`` runs n = 512..16k, d = 64 and 128, H = 8-16, batch 1-8; ``variants`` n = 512..4k (no decode);
``quick`` one mid-size shape;
``--dry-run`` the same code on CPU under TRITON_INTERPRET=1 at n <= 64 with 16-row tiles. ``--config`` runs every
case under BlockConfig settings (``NAME=VALUE[,NAME=VALUE...]``: a kernel variant such as ``sparse_solver=chunked``
or ``attn_bwd=atomic``, or tiles), recorded in the JSON (``config``, ``block_config``). On a GPU the
kernels of all cases are first compiled by --jobs worker processes (a shared Triton cache), which
saves most of the compile time. Writes DIR/gpu_check.json, rewritten after every case (so a run cut short
keeps its results), and DIR/pytest.log with --pytest. Exit status: 0 when every case (and pytest) passed,
1 otherwise, 2 when there is no GPU and no --dry-run.
"""

import argparse
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENVIRON = dict(os.environ)  # as started: pytest runs without the settings of --dry-run

PATTERNS = ["attention", "local_attention:64", "dense", "banded:64", "diagonal", "exp2", "exp2:ce", "square",
            "square:ce"]
DRY_PATTERNS = ["attention", "local_attention:6", "dense", "banded:6", "diagonal", "exp2", "exp2:ce", "square",
                "square:ce"]  # small windows: the interpreter's time grows with the slots per row
TIED_PATTERNS = ["dense", "exp2:ce", "square", "diagonal"]
KINDS = ("mix", "tied", "decode", "decode_tied")
DTYPES = ("float32", "bfloat16")
DECODE_STEPS = 4

# Shape rows: (name, batch, heads, n, d, padded, oracle of mix/tied, kinds run at this shape).
# Decode rows use n as the number of cached rows. Memory of the oracles (float64): the reference form holds a
# dozen (B, H, n, n) tensors (0.27 GB each at "train", 0.54 GB at "d128"); parallel_mix's dense and attention
# paths take one causal attention through PyTorch's math kernel in float64 ((B, H, n, n), 2.1 GB at "long",
# 4.3 GB at "long-d128"), and fall back to float32 (memory-efficient kernel, O(n)) above PARALLEL_F64_BYTES.
SHAPES = {
    "full": [
        ("train", 8, 16, 512, 64, True, "reference", ("mix", "tied")),
        ("cache", 8, 16, 4096, 64, True, "recurrent", ("decode", "decode_tied")),
        ("d128", 2, 8, 2048, 128, True, "reference", ("mix",)),
        ("long", 2, 8, 4096, 64, False, "parallel", ("mix", "tied")),
        ("cache-d128", 2, 8, 16384, 128, False, "recurrent", ("decode",)),
        ("long-d128", 1, 8, 8192, 128, True, "parallel", ("mix",)),
        ("xlong", 1, 8, 16384, 64, False, "parallel", ("mix",)),
    ],
    # The kernel variants (scripts/bench/gpu_measure.py): d 64 and 128, padding, the tied forms, 8 to 64 chunks.
    "variants": [
        ("train", 8, 16, 512, 64, True, "reference", ("mix", "tied")),
        ("d128", 2, 8, 2048, 128, True, "reference", ("mix",)),
        ("long", 2, 8, 4096, 64, False, "parallel", ("mix", "tied")),
    ],
    "quick": [
        ("quick", 2, 8, 1024, 64, True, "reference", ("mix", "tied")),
        ("quick-cache", 2, 8, 2048, 64, True, "recurrent", ("decode", "decode_tied")),
    ],
    "dry": [
        ("tiny", 2, 1, 33, 16, True, "reference", ("mix", "tied")),
        ("tiny-par", 1, 2, 64, 32, False, "parallel", ("mix",)),
        ("tiny-cache", 2, 2, 33, 16, True, "recurrent", ("decode", "decode_tied")),
    ],
}
# Dry-run: which (kind, shape) runs which (patterns, dtypes) (the interpreter is slow: every pattern once in
# float32, a few in bfloat16); full and quick run every pattern in both dtypes.
DRY_SELECTION = {
    ("mix", "tiny"): [(DRY_PATTERNS, ("float32",)), (["attention", "dense", "exp2:ce"], ("bfloat16",))],
    ("mix", "tiny-par"): [(["dense", "exp2:ce"], ("float32",))],
    ("tied", "tiny"): [(["dense"], ("float32",)), (["exp2:ce"], ("bfloat16",))],
    ("decode", "tiny-cache"): [(DRY_PATTERNS, ("float32",)), (["dense"], ("bfloat16",))],
    ("decode_tied", "tiny-cache"): [(["exp2:ce"], ("bfloat16",))],
}
PARALLEL_F64_BYTES = 6 << 30
WARM_LIMIT_S = 300  # the compile workers are stopped after this


@dataclass(frozen=True)
class Case:
    kind: str
    pattern: str
    dtype: str
    shape: str
    batch: int
    heads: int
    n: int
    d: int
    padded: bool
    oracle: str

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.pattern}/{self.dtype}/{self.shape}"

    @property
    def compile_key(self) -> tuple:
        """Cases that launch the same compiled kernels (Triton specialises integers on % 16 and == 1)."""
        return self.kind, self.pattern, self.dtype, self.d, self.heads % 16 == 0, self.batch == 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check", help="output folder (gpu_check.json, pytest.log)")
    p.add_argument("--shapes", default=None, choices=sorted(SHAPES), help="grid (default: full; dry with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma list of " + ", ".join(KINDS))
    p.add_argument("--patterns", default=None, help="comma list: only these patterns (default: all)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of float32, bfloat16")
    p.add_argument("--tol-fp32", default="2e-4,5e-5", help="MAX,NORM tolerances of float32 inputs (see above)")
    p.add_argument("--tol-bf16", default="6e-2,2e-2", help="MAX,NORM tolerances of bfloat16 inputs")
    p.add_argument("--jobs", type=int, default=None, help="processes compiling the kernels first (GPU default 8)")
    p.add_argument("--budget-s", type=float, default=0, help="skip the cases left after this many seconds (0: none)")
    p.add_argument("--pytest", action="store_true", help="first run python -m pytest -x -q (log: OUT/pytest.log)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    p.add_argument("--pytest-timeout", type=float, default=480, help="seconds before pytest is stopped")
    p.add_argument("--skip-kernels", action="store_true", help="no kernel cases (with --pytest)")
    p.add_argument("--config", default="", metavar="NAME=VALUE[,NAME=VALUE...]",
                   help="BlockConfig settings every case runs under (a kernel variant, e.g. sparse_solver=chunked)")
    # Hidden: tests/scripts/bench/test_gpu_check.py perturbs the kernel outputs to see the check fail.
    p.add_argument("--inject-error", choices=["offset", "nan"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)  # "k/N": a compile worker
    args = p.parse_args(argv)
    args.shapes = args.shapes or ("dry" if args.dry_run else "full")
    if args.jobs is None:
        args.jobs = 0 if args.dry_run else 8
    for name in ("tol_fp32", "tol_bf16"):
        try:
            tmax, tnorm = (float(v) for v in getattr(args, name).split(","))
        except ValueError:
            p.error(f"--{name.replace('_', '-')} takes two numbers MAX,NORM, got {getattr(args, name)!r}")
        setattr(args, name, (tmax, tnorm))
    for name, allowed in (("kinds", KINDS), ("dtypes", DTYPES)):
        bad = set(getattr(args, name).split(",")) - set(allowed)
        if bad:
            p.error(f"--{name}: unknown {sorted(bad)}; choose from {', '.join(allowed)}")
    from hf_resolvent.backends.triton import aot

    from hf_resolvent.training import cli

    try:
        args.settings = aot.parse_config(args.config)
    except ValueError as err:
        p.error(f"--config: {err}")
    cli.check(p, folders=[("--out", args.out)])
    return args


def plan_cases(args) -> list[Case]:
    """Every case of the selected grid, in run order (shape by shape: the cheap, most telling ones first)."""
    kinds, dtypes = args.kinds.split(","), args.dtypes.split(",")
    only = None if args.patterns is None else set(args.patterns.split(","))
    cases = []
    for name, batch, heads, n, d, padded, oracle, shape_kinds in SHAPES[args.shapes]:
        for kind in (k for k in KINDS if k in shape_kinds and k in kinds):
            if args.shapes == "dry":
                selection = DRY_SELECTION.get((kind, name), [])
            else:
                pats = {"tied": TIED_PATTERNS, "decode_tied": ["dense", "exp2:ce"]}.get(kind, PATTERNS)
                selection = [(pats, DTYPES)]
            for pats, dts in selection:
                for dtype in (t for t in dts if t in dtypes):
                    for pattern in pats:
                        if only is None or pattern in only:
                            cases.append(Case(kind, pattern, dtype, name, batch, heads, n, d, padded, oracle))
    return cases


# --------------------------------------------------------------------------------------------------
# One case


def compare(got, want, tol: tuple[float, float]) -> dict:
    """One check: max and norm-relative errors of ``got`` against ``want`` and whether they pass ``tol`` (max, norm)."""
    import torch

    got, want = got.detach().double(), want.detach().double()
    finite = bool(torch.isfinite(got).all())
    ref_max = float(want.abs().max()) if want.numel() else 0.0
    ref_norm = float(want.norm()) if want.numel() else 0.0
    if not finite:
        return {"ok": False, "finite": False, "max_abs": None, "rel": None, "norm_rel": None, "ref_max": ref_max,
                "nonfinite": int((~torch.isfinite(got)).sum())}
    diff = got - want
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    rel = max_abs / ref_max if ref_max > 0 else max_abs
    # An oracle of zeros (a gradient the pattern makes zero, e.g. of qb and kb under diagonal's one-entry softmax):
    # the kernel's rounding is judged by its root mean square, not by a norm summed over millions of values.
    norm_rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm()) / max(diff.numel(), 1) ** 0.5
    return {"ok": rel <= tol[0] and norm_rel <= tol[1], "finite": True, "max_abs": max_abs, "rel": rel,
            "norm_rel": norm_rel, "ref_max": ref_max}


class Runner:
    """Runs cases on one device: random inputs, the kernel, the oracle and the comparison."""

    def __init__(self, args, device):
        import torch

        from hf_resolvent import ops
        from hf_resolvent.backends import triton as kernels
        from hf_resolvent.patterns import get_pattern

        self.torch, self.kernels, self.ops, self.get_pattern = torch, kernels, ops, get_pattern
        self.args, self.device = args, device
        self.tol = {"float32": args.tol_fp32, "bfloat16": args.tol_bf16}  # (max, norm)

    # inputs -------------------------------------------------------------------------------------

    def _gen(self, case: Case):
        torch = self.torch
        gen = torch.Generator(device=self.device)
        gen.manual_seed(zlib.crc32(case.id.encode()))
        return gen

    def _randn(self, gen, *shape, dtype):
        return self.torch.randn(*shape, generator=gen, device=self.device).to(getattr(self.torch, dtype))

    def _rand(self, gen, *shape, lo, hi, dtype):
        u = self.torch.rand(*shape, generator=gen, device=self.device)
        return (lo + (hi - lo) * u).to(getattr(self.torch, dtype))

    def _start(self, case: Case):
        if not case.padded:
            return None
        B, n = case.batch, case.n
        values = [n // 3 + 1] if B == 1 else [0 if b == 0 else (b * n) // (2 * B) + 3 for b in range(B)]
        return self.torch.tensor(values, device=self.device)

    def _tamper(self, y):
        """--inject-error: a wrong value (or NaN) in the kernel's last output row, as a broken kernel would give."""
        mode = self.args.inject_error
        if mode is None:
            return y
        bump = self.torch.zeros_like(y)
        bump[..., -1, 0] = float("nan") if mode == "nan" else 1.0
        return y + bump

    # kinds --------------------------------------------------------------------------------------

    def run(self, case: Case, warm: bool = False) -> dict:
        """Checks {name: comparison} of one case, plus the oracle used and timings (warm: the kernel only)."""
        if case.kind in ("mix", "tied"):
            return self._run_mix(case, warm)
        return self._run_decode(case, warm)

    def _mix_inputs(self, case: Case):
        gen = self._gen(case)
        B, H, n, d = case.batch, case.heads, case.n, case.d
        has_b = self.get_pattern(case.pattern).has_recurrence
        qa, ka, qb, kb, x = (self._randn(gen, B, H, n, d, dtype=case.dtype) for _ in range(5))
        g = self._rand(gen, B, H, n, lo=0.05, hi=0.95, dtype=case.dtype)
        cot = self._randn(gen, B, H, n, d, dtype=case.dtype)
        if case.kind == "tied":
            dd = self._rand(gen, B, H, n, lo=-0.5, hi=1.0, dtype=case.dtype)
            return {"qb": qb, "kb": kb, "x": x, "g": g, "d": dd}, cot
        if not has_b:
            qb = kb = g = None
        return {"qa": qa, "ka": ka, "qb": qb, "kb": kb, "x": x, "g": g}, cot

    def _grads(self, fn, named: dict, cot):
        torch = self.torch
        leaves = {k: (None if t is None else t.detach().clone().requires_grad_()) for k, t in named.items()}
        y = fn(**leaves)
        used = {k: t for k, t in leaves.items() if t is not None}
        grads = torch.autograd.grad(y, list(used.values()), grad_outputs=cot.to(y.dtype))
        return y.detach(), dict(zip(used, grads))

    def _mix_fn(self, case: Case, impl: str, start):
        k, o, pattern = self.kernels, self.ops, case.pattern
        if case.kind == "tied":
            if impl == "triton":
                return lambda qb, kb, x, g, d: self._tamper(k.triton_mix(None, None, qb, kb, x, g, pattern, start=start,
                                                                         d=d))
            f = o.reference_mix if impl == "reference" else o.parallel_mix
            return lambda qb, kb, x, g, d: f(None, None, qb, kb, x, g, pattern, start, d=d)
        if impl == "triton":
            return lambda qa, ka, qb, kb, x, g: self._tamper(k.triton_mix(qa, ka, qb, kb, x, g, pattern, start=start))
        f = o.reference_mix if impl == "reference" else o.parallel_mix
        return lambda qa, ka, qb, kb, x, g: f(qa, ka, qb, kb, x, g, pattern, start)

    def _oracle_dtype(self, case: Case) -> str:
        if case.oracle == "reference":
            return "float64"
        pat = self.get_pattern(case.pattern)
        dense_bytes = case.batch * case.heads * case.n * case.n * 8
        return "float32" if pat.is_dense and dense_bytes > PARALLEL_F64_BYTES else "float64"

    def _run_mix(self, case: Case, warm: bool) -> dict:
        torch = self.torch
        named, cot = self._mix_inputs(case)
        start = self._start(case)
        t0 = time.time()
        y, grads = self._grads(self._mix_fn(case, "triton", start), named, cot)
        self._sync()
        t_kernel = time.time() - t0
        if warm:
            return {"kernel_s": t_kernel}
        first = self._oracle_dtype(case)
        tries = [first] + (["float32"] if first == "float64" else [])
        t0 = time.time()
        for i, oracle_dtype in enumerate(tries):
            try:
                ref_named = {k: None if t is None else t.to(getattr(torch, oracle_dtype)) for k, t in named.items()}
                y_ref, g_ref = self._grads(self._mix_fn(case, case.oracle, start), ref_named, cot)
                break
            except torch.cuda.OutOfMemoryError:
                if i == len(tries) - 1:
                    raise
            ref_named = None  # reached after an out-of-memory error only (its traceback is gone here)
            torch.cuda.empty_cache()
            print(f"    oracle out of memory in {oracle_dtype}: again in {tries[i + 1]}", flush=True)
        self._sync()
        tol = self.tol[case.dtype]
        checks = {"y": compare(y, y_ref, tol)}
        for name in g_ref:
            checks["d_" + name] = compare(grads[name], g_ref[name], tol)
        return {"oracle": f"{case.oracle}_mix{' (d: tied)' if case.kind == 'tied' else ''} {oracle_dtype}", "tol": tol,
                "checks": checks, "kernel_s": t_kernel, "oracle_s": time.time() - t0}

    def _run_decode(self, case: Case, warm: bool) -> dict:
        torch, ops = self.torch, self.ops
        tied = case.kind == "decode_tied"
        pat = self.get_pattern(case.pattern)
        gen = self._gen(case)
        B, H, S, d = case.batch, case.heads, case.n, case.d
        names = ["keys_b", "outputs"] if tied else ["keys_a", "values"] + (["keys_b", "outputs"] if pat.has_recurrence
                                                                          else [])
        prefill = {k: self._randn(gen, B, H, S, d, dtype=case.dtype) for k in names}
        start = self._start(case)
        state = ops.DecodeState.from_prefill(pat, prefill, start)
        ref = ops.DecodeState.from_prefill(pat, {k: v.double() for k, v in prefill.items()}, start)
        tol = self.tol[case.dtype]
        worst = None
        t_kernel = t_oracle = 0.0
        for _ in range(DECODE_STEPS):
            tok = {k: self._randn(gen, B, H, d, dtype=case.dtype) for k in ("qa", "ka", "qb", "kb", "x")}
            tok["g"] = self._rand(gen, B, H, lo=0.05, hi=0.95, dtype=case.dtype)
            tok["d"] = self._rand(gen, B, H, lo=-0.5, hi=1.0, dtype=case.dtype)
            if not pat.has_recurrence:
                tok["qb"] = tok["kb"] = tok["g"] = None
            t0 = time.time()
            if tied:
                y = self.kernels.triton_decode_step(state, None, None, *(tok[k] for k in ("qb", "kb", "x", "g")), pat,
                                                    d=tok["d"])
            else:
                y = self.kernels.triton_decode_step(state, *(tok[k] for k in ("qa", "ka", "qb", "kb", "x", "g")), pat)
            y = self._tamper(y[..., None, :])[..., 0, :]
            self._sync()
            t_kernel += time.time() - t0
            if warm:
                continue
            t0 = time.time()
            tok64 = {k: None if v is None else v.double() for k, v in tok.items()}
            if tied:
                y_ref = ops.recurrent_step(ref, None, None, *(tok64[k] for k in ("qb", "kb", "x", "g")), pat,
                                           d=tok64["d"])
            else:
                y_ref = ops.recurrent_step(ref, *(tok64[k] for k in ("qa", "ka", "qb", "kb", "x", "g")), pat)
            t_oracle += time.time() - t0
            step = compare(y, y_ref, tol)
            if worst is None or _badness(step) > _badness(worst):
                worst = step
        if warm:
            return {"kernel_s": t_kernel}
        checks = {"y": worst}
        got, want = state.tensors(), ref.tensors()
        if got.keys() != want.keys() or not torch.equal(state.positions, ref.positions):
            checks["cache_layout"] = {"ok": False, "finite": True, "max_abs": None, "rel": None, "norm_rel": None,
                                      "ref_max": 0.0, "note": f"rows {sorted(got)} vs {sorted(want)}, or positions "
                                                              "differ"}
        else:
            for name in got:
                checks["cache_" + name] = compare(got[name], want[name], tol)
        return {"oracle": f"recurrent_step{' (d: tied)' if tied else ''} float64", "tol": tol, "checks": checks,
                "kernel_s": t_kernel, "oracle_s": t_oracle, "steps": DECODE_STEPS}

    def _sync(self):
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def free(self):
        if self.device != "cpu":
            self.torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# Driver


def environment(torch, device) -> dict:
    import transformers
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "device": "cpu (Triton interpreter)"}
    if device != "cpu":
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def warm_up(args, cases: list[Case]) -> dict:
    """Compile the kernels of every case in --jobs worker processes (they fill the shared Triton cache)."""
    keys = {}
    for c in cases:
        keys.setdefault(c.compile_key, c)
    jobs = min(args.jobs, len(keys))
    # Within --budget-s the warm-up takes at most 75% of it (the cases left compile as they run, slower: one
    # process): compiling is most of a check on a fresh machine.
    limit = min(WARM_LIMIT_S, 0.75 * args.budget_s) if args.budget_s else WARM_LIMIT_S
    print(f"warm-up: compiling the kernels of {len(keys)} case groups in {jobs} processes", flush=True)
    t0 = time.time()
    base = [sys.executable, os.path.abspath(__file__), "--shapes", args.shapes, "--kinds", args.kinds,
            "--dtypes", args.dtypes, "--jobs", "0"] + (["--dry-run"] if args.dry_run else [])
    if args.patterns:
        base += ["--patterns", args.patterns]
    if args.config:
        base += ["--config", args.config]
    procs = [subprocess.Popen(base + ["--warm-part", f"{k}/{jobs}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in range(jobs)]
    failed = 0
    for k, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:  # a stuck worker must not stall the run: the cases compile anyway
            proc.kill()
            out, _ = proc.communicate()
            out += f"\nstopped after {limit:.0f} s"
        if proc.returncode != 0:
            failed += 1
            print(f"  warm-up worker {k} exited with {proc.returncode} (its cases still run below):\n"
                  + "\n".join("    " + line for line in out.strip().splitlines()[-15:]), flush=True)
    seconds = time.time() - t0
    print(f"warm-up: done in {seconds:.0f} s ({failed} workers failed)", flush=True)
    return {"groups": len(keys), "jobs": jobs, "failed_workers": failed, "seconds": round(seconds, 1)}


def warm_worker(args, runner: Runner, cases: list[Case]) -> int:
    k, jobs = (int(v) for v in args.warm_part.split("/"))
    keys = {}
    for c in cases:
        keys.setdefault(c.compile_key, c)
    mine = list(keys.values())[k::jobs]
    t0, failed = time.time(), 0
    for case in mine:
        try:
            runner.run(case, warm=True)
        except Exception as err:  # this case reports it when it runs; the worker goes on compiling the others
            failed += 1
            print(f"warm-up worker {k}/{jobs}: {case.id}: {type(err).__name__}: {str(err)[:300]}", flush=True)
        runner.free()
    print(f"warm-up worker {k}/{jobs}: {len(mine)} case groups in {time.time() - t0:.0f} s", flush=True)
    return 1 if failed else 0


def run_pytest(args, out: Path) -> dict:
    """python -m pytest -x -q in the repository, output to OUT/pytest.log, stopped after --pytest-timeout s."""
    log = out / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", *shlex.split(args.pytest_args)]
    print(f"pytest: {shlex.join(cmd[1:])} (log {log}, at most {args.pytest_timeout:.0f} s)", flush=True)
    env = dict(ENVIRON, PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.pytest_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    lines = log.read_text(errors="replace").splitlines()
    summary = next((s for s in reversed(lines) if " passed" in s or " failed" in s or " error" in s), "")
    result = {"command": shlex.join(cmd[1:]), "returncode": rc, "timed_out": rc is None,
              "seconds": round(time.time() - t0, 1), "summary": summary.strip("= "),
              "failures": [s for s in lines if s.startswith(("FAILED", "ERROR"))][:20], "tail": lines[-40:]}
    status = "timed out" if rc is None else f"exit {rc}"
    print(f"pytest: {status} after {result['seconds']:.0f} s: {result['summary']}", flush=True)
    return result


def _clean(obj):
    """JSON without NaN/inf (they become null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(result), indent=1, allow_nan=False))
    os.replace(tmp, path)


def _badness(check: dict) -> float:
    """Orders checks from best to worst: the relative error, and non-finite values last."""
    return math.inf if check["rel"] is None else check["rel"]


def _fmt(x):
    return "   -   " if x is None else f"{x:.1e}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first loaded
        os.environ["HF_RESOLVENT_CPU_KERNELS"] = "0"  # the oracles' PyTorch code, as on a GPU (and no C++ build)
    import torch

    if args.dry_run:
        torch.set_num_threads(1)
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 oracles in float32
        torch.backends.cudnn.allow_tf32 = False
    else:
        print("gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run to run the same "
              "checks on CPU through Triton's interpreter at tiny shapes.", file=sys.stderr)
        return 2

    from hf_resolvent.backends.triton import aot

    from hf_resolvent.backends import triton as kernels

    cases = plan_cases(args)
    # --dry-run: 16-row tiles, as tests/backends/test_triton.py; --config on top
    tiles = kernels.block_config(**{**(aot.DRY_RUN_TILES if args.dry_run else {}), **args.settings})
    kernels.set_nan_fill(True)
    with tiles:
        runner = Runner(args, device)
        if args.warm_part:
            return warm_worker(args, runner, cases)
        return drive(args, runner, cases, torch, device)


def drive(args, runner: Runner, cases: list[Case], torch, device) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    t_start = time.time()
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("warm_part", "settings")},
              "environment": environment(torch, device), "config": args.settings,
              "block_config": asdict(runner.kernels.get_block_config()),
              "tolerance": {"float32": args.tol_fp32, "bfloat16": args.tol_bf16}, "cases": [], "complete": False}
    env = result["environment"]
    print(f"gpu_check: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"transformers {env['transformers']}" + (f", block config {args.config}" if args.config else ""), flush=True)
    write(path, result)
    ok = True
    if args.pytest:
        result["pytest"] = run_pytest(args, out)
        ok = result["pytest"]["returncode"] == 0
        write(path, result)
    if args.skip_kernels:
        cases = []
    counts = {k: sum(c.kind == k for c in cases) for k in KINDS}
    print(f"gpu_check: {len(cases)} cases ({', '.join(f'{k} {v}' for k, v in counts.items() if v)}), "
          f"grid {args.shapes}, writing {path}", flush=True)
    if cases and args.jobs > 0:
        result["warm_up"] = warm_up(args, cases)
    for i, case in enumerate(cases, 1):
        row = {"id": case.id, **asdict(case)}
        head = f"[{i:3d}/{len(cases)}] {case.id:42s} B{case.batch} H{case.heads} n{case.n} d{case.d}"
        if args.budget_s and time.time() - t_start > args.budget_s:
            row["status"] = "SKIP"
            print(f"{head}  SKIP (past --budget-s {args.budget_s:.0f})", flush=True)
        else:
            t0 = time.time()
            try:
                row.update(runner.run(case))
                row["status"] = "PASS" if all(c["ok"] for c in row["checks"].values()) else "FAIL"
            except Exception as err:  # report and go on: one broken case must not hide the others
                row["status"] = "ERROR"
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            row["seconds"] = round(time.time() - t0, 2)
            runner.free()
            if row["status"] == "ERROR":
                detail = row["error"].splitlines()[0][:150]
            else:
                name, worst = max(row["checks"].items(), key=lambda kv: _badness(kv[1]))
                bad = [k for k, c in row["checks"].items() if not c["ok"]]
                errors = (f"max {_fmt(worst['rel'])} norm {_fmt(worst['norm_rel'])}" if worst["finite"]
                          else f"{worst.get('nonfinite', '')} non-finite values")
                detail = (f"worst {name} {errors}  {row['oracle']}"
                          + (f"  failing: {', '.join(bad)}" if bad else ""))
            print(f"{head}  {row['status']}  {detail}  {row['seconds']:.1f} s", flush=True)
        ok = ok and row["status"] == "PASS"
        result["cases"].append(row)
        write(path, result)
    statuses = [r["status"] for r in result["cases"]]
    result["summary"] = {s: statuses.count(s) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
    result["summary"]["seconds"] = round(time.time() - t_start, 1)
    result["complete"] = True
    result["passed"] = ok
    write(path, result)
    print_table(result)
    return 0 if ok else 1


def print_table(result: dict) -> None:
    """Worst relative error per kind and dtype, the failures, and the verdict (the last lines of the output)."""
    rows = result["cases"]
    if rows:
        print("\nkind         dtype      cases  pass  worst max  worst norm  (case, check of the worst max)")
        groups = {}
        for r in rows:
            groups.setdefault((r["kind"], r["dtype"]), []).append(r)
        for (kind, dtype), rs in groups.items():
            worst, where, worst_norm = None, "", None
            for r in rs:
                for name, c in r.get("checks", {}).items():
                    if c["rel"] is not None and (worst is None or c["rel"] > worst):
                        worst, where = c["rel"], f"{r['pattern']} {r['shape']}, {name}"
                    if c["norm_rel"] is not None and (worst_norm is None or c["norm_rel"] > worst_norm):
                        worst_norm = c["norm_rel"]
            passed = sum(r["status"] == "PASS" for r in rs)
            print(f"{kind:12s} {dtype:9s} {len(rs):6d} {passed:5d}  {_fmt(worst):9s}  {_fmt(worst_norm):10s}  "
                  f"({where})")
        for r in rows:
            if r["status"] in ("FAIL", "ERROR"):
                bad = {k: (c["rel"], c["norm_rel"]) for k, c in r.get("checks", {}).items() if not c["ok"]}
                print(f"{r['status']}: {r['id']} {r.get('error', '')[:200]}{bad if bad else ''}")
    s = result["summary"]
    pytest = result.get("pytest")
    if pytest:
        print(f"pytest: {'timed out' if pytest['timed_out'] else 'exit ' + str(pytest['returncode'])}: "
              f"{pytest['summary']}")
    print(f"gpu_check: {s['PASS']} passed, {s['FAIL']} failed, {s['ERROR']} errors, {s['SKIP']} skipped in "
          f"{s['seconds']:.0f} s -> {'PASS' if result['passed'] else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
