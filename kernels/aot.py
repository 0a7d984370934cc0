"""Ahead-of-time compilation of the kernels for a GPU target, on a machine without a GPU.

``record_launches`` runs the real launch code of :mod:`.resolvent` / :mod:`.decode` with the kernel
module swapped for a recorder, so it sees every launch exactly as it would happen (arguments, tile
sizes, flags) without running anything. ``compile_launch`` then builds each recorded launch with
Triton's compiler for a CUDA target (``ptxas`` ships with the triton wheel; no driver or device is
needed) and reports registers, spills and shared memory. This catches what the interpreter cannot:
code that runs as Python but does not lower to the GPU, and tile sizes that spill registers.

Used by ``scripts/bench/bench_kernels.py --compile-check`` and by tests/backends/test_triton.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

from . import decode as _decode
from . import resolvent as _resolvent
from ._loader import jit_module

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")
# Shared memory one block may hold on each target (bytes, with the opt-in above 48 KiB); a kernel compiled past it
# fails at its first launch (Triton's OutOfResources), which the compiler itself does not report.
SHARED_MEMORY_LIMIT = {80: 166912, 90: 232448}


@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its grid, runtime arguments and compile-time options."""

    name: str
    grid: tuple
    args: dict
    constexprs: dict
    options: dict = field(default_factory=dict)


class _Recorder:
    """Stands in for the kernel module: ``rec.kernel[grid](*args, **kw)`` records instead of launching."""

    def __init__(self, jit):
        self.jit = jit
        self.launches: list[Launch] = []

    def __getattr__(self, name):
        fn = getattr(self.jit, name)
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    names = fn.arg_names
                    options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
                    bound = dict(zip(names, args))
                    bound.update(kwargs)
                    constexprs = {k: bound[k] for k in names if k in fn.constexprs_names}
                    runtime = {k: bound[k] for k in names if k not in constexprs}
                    recorder.launches.append(Launch(name, tuple(grid), runtime, constexprs, options))

                return launch

        return _Grid()


def _constexpr_names(fn) -> set:
    return {fn.arg_names[i] for i in fn.constexprs}


@contextlib.contextmanager
def recording_launches():
    """Within the block, the launchers record every kernel launch (kernel, grid, arguments) instead of running it:
    yields the recorder, whose launches the caller reads."""
    jit = jit_module(interpret=False)
    for name in dir(jit):
        obj = getattr(jit, name)
        if hasattr(obj, "arg_names") and hasattr(obj, "constexprs") and not hasattr(obj, "constexprs_names"):
            obj.constexprs_names = _constexpr_names(obj)
    rec = _Recorder(jit)
    old = (_resolvent.jit_module, _decode.jit_module, _decode.check_ready)
    _resolvent.jit_module = _decode.jit_module = lambda: rec
    _decode.check_ready = lambda *tensors: None  # nothing runs: CPU tensors are fine
    try:
        yield rec
    finally:
        _resolvent.jit_module, _decode.jit_module, _decode.check_ready = old


def record_launches(pattern: str, dtype=torch.bfloat16, n: int = 1024, d: int = 64, e: int = 64,
                    batch: int = 1, heads: int = 1, tied: bool = False) -> list[Launch]:
    """Every kernel launch of a forward + backward (and one decode step) for ``pattern``.

    Tensors are allocated on CPU and never read (nothing runs). The current BlockConfig applies.
    """
    from hf_resolvent.ops import DecodeState
    from hf_resolvent.patterns import get_pattern

    pat = get_pattern(pattern)
    plan = _resolvent.make_plan(pat, n)
    BH = batch * heads
    mk = lambda *s: torch.zeros(*s, dtype=dtype)
    qa, ka, qb, kb = (mk(BH, n, d) for _ in range(4))
    x = mk(BH, n, e)
    g = mk(BH, n) if plan.has_b else None
    if not plan.has_b:
        qb = kb = None
    start = torch.zeros(batch, dtype=torch.int32)
    sh = _resolvent.LaunchShapes(BH=BH, H=heads, n=n, da=d, db=d, e=e, scale=d**-0.5,
                            prec=_resolvent.FP32_PREC if dtype == torch.float32 else "tf32")
    cfg = _resolvent.fitted_block_config(dtype, max(d, e))
    with recording_launches() as rec:
        if tied:
            qa = ka = None
        y, saved = _resolvent.launch_forward(qa, ka, qb, kb, x, g, start, plan, sh, cfg, tied)
        _resolvent.launch_backward(torch.zeros(BH, n, e), qa, ka, qb, kb, x, g, start, saved, plan, sh, cfg, tied)
        state = DecodeState()
        one = lambda w: torch.zeros(batch, heads, w, dtype=dtype)
        gg = torch.zeros(batch, heads, dtype=dtype) if plan.has_b else None
        if tied:
            _decode.triton_decode_step_tied(state, one(d), one(d), one(e), gg, torch.zeros(batch, heads, dtype=dtype),
                                            pat)
        else:
            _decode.triton_decode_step(state, one(d), one(d), one(d) if plan.has_b else None,
                                       one(d) if plan.has_b else None, one(e), gg, pat)
    return rec.launches


def _signature(launch: Launch) -> dict:
    sig = {}
    for k, v in launch.args.items():
        if isinstance(v, torch.Tensor):
            sig[k] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[k] = "i1"
        elif isinstance(v, int):
            sig[k] = "i32"
        elif isinstance(v, float):
            sig[k] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {k}={v!r}")
    for k in launch.constexprs:
        sig[k] = "constexpr"
    return sig


def compile_launch(launch: Launch, arch: int = 90) -> dict:
    """Compile a recorded launch for ``sm_<arch>``. Returns registers, spill stack, shared memory (bytes); raises
    ``RuntimeError`` where the shared memory is over what a block of that target may hold."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(jit_module(interpret=False), launch.name)
    src = ASTSource(fn=fn, signature=_signature(launch), constexprs=dict(launch.constexprs))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    usage = _resource_usage(compiled.asm["cubin"])
    usage["shared"] = compiled.metadata.shared
    limit = SHARED_MEMORY_LIMIT.get(arch)
    if limit is not None and usage["shared"] > limit:
        raise RuntimeError(f"{launch.name} {launch.constexprs} asks for {usage['shared']} B of shared memory per block, "
                           f"over the {limit} B of sm_{arch}: it would fail at launch; fit its tiles "
                           f"(resolvent.fitted_block_config)")
    return usage


def _resource_usage(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"could not read the resource usage from cuobjdump:\n{text}")
    return {"registers": int(match.group(1)), "spill_stack_bytes": int(match.group(2))}
