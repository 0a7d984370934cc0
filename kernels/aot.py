"""Ahead-of-time compilation of the kernels for a GPU target, on a machine without a GPU.

``record_launches`` runs the real launch code of :mod:`.mix` / :mod:`.decode` (``record_projection_launches``: of
:mod:`.rope_gate`, the launches around the mixer) with the kernel module swapped for a recorder, so it sees every
launch exactly as it would happen (arguments, tile sizes, flags) without running anything. ``compile_launch`` then builds each recorded launch with
Triton's compiler for a CUDA target (``ptxas`` ships with the triton wheel; no driver or device is
needed), specialised on its arguments as Triton's JIT specialises a real launch, and reports registers,
spills, shared memory and static counts of telling PTX instructions (warpgroup and warp-level tensor-core
products, atomics). This catches what the interpreter cannot: code that runs as Python but does not lower to
the GPU, tiles that spill registers or pass a block's shared memory, and products that miss the tensor-core
path their tiles allow.

Used by ``scripts/bench/bench_kernels.py --compile-check``, tests/backends/test_aot.py (the default tiles on
sm_90), tests/backends/test_triton.py and tests/backends/test_triton_rope_gate.py.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

from . import _loader, launching
from . import decode as _decode
from . import mix as _mix
from . import rope_gate as _rope_gate
from ._loader import jit_module

_TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "u1"}
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
    choice: dict = field(default_factory=dict)  # the BlockConfig's kernel choice (KERNEL_FIELDS) at the launch


class _RecordedKernel:
    """Stands in for one kernel: ``kernel[grid](*args, **kw)`` records the launch, and runs it with ``run``."""

    def __init__(self, name: str, fn, launches: list, run: bool):
        self.name, self.fn, self.launches, self.run = name, fn, launches, run
        # The compile-time parameters, as annotated (an interpreted kernel keeps no list of them)
        self.constexpr_names = {name for name, p in inspect.signature(fn.fn).parameters.items()
                                if "constexpr" in str(p.annotation)}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = dict(zip(self.fn.arg_names, args))
            bound.update({k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS})
            constexprs = {k: bound[k] for k in self.fn.arg_names if k in self.constexpr_names}
            runtime = {k: bound[k] for k in self.fn.arg_names if k not in constexprs}
            options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
            choice = kernel_choice(launching.get_block_config())
            self.launches.append(Launch(self.name, tuple(grid), runtime, constexprs, options, choice))
            if self.run:
                self.fn[grid](*args, **kwargs)

        return launch


class _Recorder:
    """What :func:`recording_launches` yields: ``launches``, every launch of the block in order."""

    def __init__(self):
        self.launches: list[Launch] = []


@contextlib.contextmanager
def recording_launches(run: bool = False):
    """Within the block, every kernel launch (kernel, grid, arguments) is recorded: yields the recorder, whose
    ``launches`` the caller reads. Without ``run`` nothing runs: the launchers reach the GPU-compiled kernels (what
    ``compile_launch`` builds) on any tensors, CPU or meta. With ``run`` the launches also run, in the current
    Triton mode (a test's view of which kernels a call starts)."""
    rec = _Recorder()
    # Running, the launchers reach the kernels of whichever mode is current at each call: watch both.
    packages = [jit_module(interpret=False)] + ([jit_module(interpret=True)] if run else [])
    swapped = [(op, name, getattr(op, name)) for jit in packages for op in jit.OPS for name in dir(op)
               if name.endswith("_kernel")]
    for op, name, fn in swapped:
        setattr(op, name, _RecordedKernel(name, fn, rec.launches, run))
    try:
        if run:
            yield rec
        else:
            with _loader.compiled_kernels(), _skipping_readiness():
                yield rec
    finally:
        for op, name, fn in swapped:
            setattr(op, name, fn)


@contextlib.contextmanager
def _skipping_readiness():
    """The readiness checks of the entries that check it themselves (decode, RoPE and the gate) off: nothing runs,
    so CPU tensors are fine."""
    modules = (_decode, _rope_gate)
    old = [module.check_ready for module in modules]
    for module in modules:
        module.check_ready = lambda *tensors: None
    try:
        yield
    finally:
        for module, check in zip(modules, old):
            module.check_ready = check


def record_passes(pattern: str, dtype=torch.bfloat16, n: int = 1024, d: int = 64, e: int = 64, batch: int = 1,
                  heads: int = 1, tied: bool = False, device: str = "cpu") -> dict:
    """The kernel launches of a forward and of a backward of ``pattern``: {"forward": [...], "backward": [...]}.

    Tensors are made on ``device`` (``"meta"``: nothing allocated) and never read (nothing runs). The current
    BlockConfig applies."""
    from hf_resolvent.patterns import get_pattern

    plan = launching.make_plan(get_pattern(pattern), n)
    BH = batch * heads
    with torch.device(device):
        qa, ka = (None, None) if tied else (torch.zeros(BH, n, d, dtype=dtype) for _ in range(2))
        qb, kb = (torch.zeros(BH, n, d, dtype=dtype) for _ in range(2)) if plan.has_b else (None, None)
        x = torch.zeros(BH, n, e, dtype=dtype)
        g = torch.zeros(BH, n, dtype=dtype) if plan.has_b else None
        start = torch.zeros(batch, dtype=torch.int32)
        dy = torch.zeros(BH, n, e, dtype=torch.float32 if tied else dtype)  # the output's dtype, as is its gradient
    sh = launching.LaunchShapes(BH=BH, H=heads, n=n, da=d, db=d, e=e, scale=d**-0.5,
                                prec=launching.FP32_PREC if dtype == torch.float32 else "tf32")
    cfg = launching.fitted_block_config(dtype, max(d, e))
    with recording_launches() as rec:
        _, saved = _mix.launch_forward(qa, ka, qb, kb, x, g, start, plan, sh, cfg, tied)
        n_forward = len(rec.launches)
        _mix.launch_backward(dy, qa, ka, qb, kb, x, g, start, saved, plan, sh, cfg, tied)
    return {"forward": rec.launches[:n_forward], "backward": rec.launches[n_forward:]}


def record_launches(pattern: str, dtype=torch.bfloat16, n: int = 1024, d: int = 64, e: int = 64,
                    batch: int = 1, heads: int = 1, tied: bool = False) -> list[Launch]:
    """Every kernel launch of a forward + backward (:func:`record_passes`) and of a decode step for ``pattern`` (from
    separate tensors, and where d == e from the mixer's projection), on CPU tensors that nothing reads. The current BlockConfig applies."""
    from hf_resolvent.ops import DecodeState
    from hf_resolvent.patterns import get_pattern

    passes = record_passes(pattern, dtype, n, d, e, batch, heads, tied)
    pat = get_pattern(pattern)
    one = lambda w: torch.zeros(batch, heads, w, dtype=dtype)
    g = torch.zeros(batch, heads, dtype=dtype) if pat.has_recurrence else None
    qb, kb = (one(d), one(d)) if pat.has_recurrence else (None, None)
    names = ("keys_b", "outputs") if tied else ("keys_a", "values") + (("keys_b", "outputs") if pat.has_recurrence
                                                                      else ())
    state = DecodeState.empty(pat, {k: e if k in ("values", "outputs") else d for k in names}, batch, heads,
                              dtype=dtype)
    with recording_launches() as rec:
        if tied:
            _decode.triton_decode_step(state, None, None, qb, kb, one(e), g, d=torch.zeros(batch, heads, dtype=dtype))
        else:
            _decode.triton_decode_step(state, one(d), one(d), qb, kb, one(e), g)
        if d == e:  # the model's step: from the projection, RoPE and the gate's activation in the kernel
            parts = ("x", "qb", "kb") if tied else ("qa", "ka", "x") + (("qb", "kb") if pat.has_recurrence else ())
            table = torch.zeros(1, d)
            gate = None if g is None else (g, torch.zeros(heads), torch.zeros(heads))
            _decode.triton_decode_projected(state, torch.zeros(batch, len(parts), heads, d, dtype=dtype), parts,
                                            (table, table, "ab"), gate, g if tied else None)
    return passes["forward"] + passes["backward"] + rec.launches


def record_projection_launches(parts: tuple[str, ...] = ("qa", "ka", "x", "qb", "kb"), rotated: str = "ab",
                               dtype=torch.bfloat16, n: int = 1024, d: int = 64, batch: int = 1, heads: int = 1,
                               shared_tables: bool = True) -> list[Launch]:
    """The kernel launches around a training step's mixer call on Triton, forward then backward, from the real entry
    points (``triton_rope_heads`` over the whole projection, as ``ops.rope.rotated_parts`` calls it, and
    ``triton_gate_values``), on CPU tensors that nothing reads: RoPE rotating the queries and keys of ``rotated``
    ("ab", "a", "b" or "" for none) among ``parts``, tables (1 or B, n, d) (``shared_tables``: 1), and the gate of
    ``heads`` heads. Not part of :func:`record_launches`, which records the mixer's own kernels."""
    names = {f"{kind}{channel}" for channel in rotated for kind in "qk"}
    rotate = tuple(name in names for name in parts)
    proj = torch.zeros(batch, n, len(parts), heads, d, dtype=dtype, requires_grad=True)
    table = torch.zeros(1 if shared_tables else batch, n, d)
    pre = torch.zeros(batch, n, heads, dtype=dtype, requires_grad=True)
    dt_bias, a_log = (torch.zeros(heads, requires_grad=True) for _ in range(2))
    with recording_launches() as rec:
        rope_parts = _rope_gate.triton_rope_heads(proj, table, table, rotate)
        g = _rope_gate.triton_gate_values(pre, dt_bias, a_log, dtype)
        n_forward = len(rec.launches)
        torch.autograd.backward([*rope_parts, g], [torch.zeros_like(t) for t in (*rope_parts, g)])
    return rec.launches[:n_forward] + rec.launches[n_forward:]


def parse_config(text: str) -> dict:
    """BlockConfig settings from ``NAME=VALUE[,NAME=VALUE...]`` ("" for none), checked by BlockConfig: the
    ``--config`` option of the scripts that build, check and time kernel variants (scripts/bench/)."""
    from dataclasses import fields

    types = {f.name: type(getattr(launching.BlockConfig(), f.name)) for f in fields(launching.BlockConfig)}
    settings = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise ValueError(f"{item!r} is not NAME=VALUE with NAME a BlockConfig field ({', '.join(types)})")
        if types[name] is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{name} takes true or false, got {value!r}")
            settings[name] = value.lower() in ("true", "1")
            continue
        try:
            settings[name] = types[name](value)
        except ValueError:
            raise ValueError(f"{name} takes an integer, got {value!r}") from None
    launching.BlockConfig(**settings)  # its own checks: powers of two, known variant names
    return settings


# The BlockConfig fields that choose which kernels run (the others are tiles): what a measurement records, so that
# its figures stay attached to the kernels it timed when the defaults change.
KERNEL_FIELDS = ("sparse_solver", "dense_solver", "solved_copy", "attn_bwd")


# The scripts' --dry-run tiles: every tile of the interpreter tests' size (the chunked solves' chunk and the atomic
# backward's tiles too), so that their tiny lengths span several blocks; --config settings apply on top.
DRY_RUN_TILES = dict(attn_m=16, attn_n=16, bwd_m=16, bwd_n=16, solve=16, sparse_m=16, sparse_grads_m=16, decode=16,
                     chunk=16, atomic_m=16, atomic_n=16)


def kernel_choice(cfg) -> dict:
    """{field: value} of ``cfg``'s KERNEL_FIELDS."""
    return {k: getattr(cfg, k) for k in KERNEL_FIELDS}


def relevant(settings: dict, pattern: str) -> dict:
    """The settings among ``settings`` that change the kernels ``pattern`` runs (mix.py's table): the
    attention backward for attention and dense, the dense solver and its copy for dense, the sparse solver for
    the other patterns with a B term; the chunk for either chunked solver."""
    from hf_resolvent.patterns import get_pattern

    pat = get_pattern(pattern)
    keys = set()
    if pat.is_dense or pattern == "attention":
        keys |= {"attn_bwd", "atomic_m", "atomic_n", "atomic_warps"}
    if pat.is_dense and pat.has_recurrence:
        keys |= {"dense_solver", "solved_copy", "chunk"}
    elif pat.has_recurrence:
        keys |= {"sparse_solver", "chunk"}
    return {k: v for k, v in settings.items() if k in keys}


def config_label(settings: dict) -> str:
    """``name=value,...`` of some BlockConfig settings, the inverse of :func:`parse_config` ("" for none)."""
    return ",".join(f"{k}={v}" for k, v in settings.items())


def _specialize(launch: Launch, fn) -> tuple[dict, dict, dict]:
    """Signature, constants and attributes of ``launch`` as Triton's JIT derives them when it launches the kernel:
    an integer equal to 1 (or None) becomes a constant; integers divisible by 16, and tensors whose address is, are
    marked so (``tt.divisibility``), which lets the compiler vectorise the loads and stores of whole rows."""
    signature, constants, attrs = {}, dict(launch.constexprs), {}
    for index, name in enumerate(fn.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        v = launch.args[name]
        aligned = False
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            signature[name], constants[name] = "constexpr", v
            continue
        if isinstance(v, torch.Tensor):
            signature[name], aligned = "*" + _TYPES[v.dtype], v.data_ptr() % 16 == 0
        elif isinstance(v, bool):
            signature[name] = "u1"
        elif isinstance(v, int):
            signature[name], aligned = ("i32" if -2**31 <= v < 2**31 else "i64"), v % 16 == 0
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {name}={v!r}")
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


# Static instruction counts read from the PTX: each instruction as it is written in the PTX text, once, however
# often it runs (an instruction inside a loop counts once; an unrolled loop counts once per copy). They say which
# hardware paths a kernel uses, not how much work it does.
PTX_COUNTS = {
    "wgmma": ("wgmma.mma_async",),  # Hopper warpgroup products: one m64nNk16 step of 4 warps each
    "mma_sync": ("mma.sync",),  # warp-level tensor-core products (m16n8k16 for 16-bit, m16n8k8 for tf32)
    "atomics": ("atom.", "red."),  # atomic read-modify-writes and reductions, global or shared
    "ld_shared": ("ld.shared", "ldmatrix"),  # reads of shared memory, into registers or MMA fragments
    "cp_async": ("cp.async",),  # asynchronous copies global -> shared (software pipelining; .bulk: TMA)
}
_PTX_INSTRUCTION = re.compile(r"^[ \t]*(?:@!?%\w+[ \t]+)?([a-z][\w.:]*)", re.M)


def ptx_counts(ptx: str) -> dict:
    """Static counts of the instruction groups of :data:`PTX_COUNTS` in a PTX text (a predicate ``@%p`` may lead),
    and ``atomic_ops``: each atomic instruction as written (e.g. ``red.global.gpu.relaxed.add.v4.f32``) and its
    count, which says what the atomics do (integer tickets, float32 sums) and how wide they are."""
    opcodes = _PTX_INSTRUCTION.findall(ptx)
    counts = {key: sum(op.startswith(prefixes) for op in opcodes) for key, prefixes in PTX_COUNTS.items()}
    atomic = [op for op in opcodes if op.startswith(PTX_COUNTS["atomics"])]
    counts["atomic_ops"] = {op: atomic.count(op) for op in sorted(set(atomic))}
    return counts


def compile_key(launch: Launch) -> tuple:
    """What decides the compiled code of ``launch`` (kernel, argument types and specialisation, constants,
    options): launches with equal keys share one binary, as in Triton's own cache."""
    fn = jit_module(interpret=False).KERNELS[launch.name]
    signature, constants, attrs = _specialize(launch, fn)
    return (launch.name, tuple(signature.items()), tuple(sorted(constants.items(), key=repr)),
            tuple(sorted(attrs)), tuple(sorted(launch.options.items())))


def compile_launch(launch: Launch, arch: int = 90) -> dict:
    """Compile a recorded launch for ``sm_<arch>``, specialised on its arguments as a real launch would be.

    Returns registers per thread, spill stack (bytes per thread), shared memory (bytes per block) and the static
    PTX instruction counts of :func:`ptx_counts`; raises ``RuntimeError`` where the shared memory is over what a
    block of that target may hold."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_module(interpret=False).KERNELS[launch.name]
    signature, constants, attrs = _specialize(launch, fn)
    src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    usage = _resource_usage(compiled.asm["cubin"])
    usage["shared"] = compiled.metadata.shared
    usage.update(ptx_counts(compiled.asm["ptx"]))
    limit = SHARED_MEMORY_LIMIT.get(arch)
    if limit is not None and usage["shared"] > limit:
        raise RuntimeError(f"{launch.name} {launch.constexprs} asks for {usage['shared']} B of shared memory per block, "
                           f"over the {limit} B of sm_{arch}: it would fail at launch; fit its tiles "
                           f"(launching.fitted_block_config)")
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
