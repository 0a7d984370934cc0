"""Which code runs the mixer: the one switch between the forms and the backends (docs/ARCHITECTURE.md).

``impl`` names a backend of the parallel form, or another form of the mixer:

===============  ==========================================================================================
``"auto"``       no choice here: the next source decides (below); when none does, the Triton kernels for CUDA
                 tensors where Triton can run, else the parallel form on the compiled CPU kernels where they
                 build, else in PyTorch
``"torch"``      the parallel form in PyTorch alone (no compiled code of any kind)
``"cpu"``        the parallel form on the compiled CPU kernels (:mod:`hf_resolvent.backends.cpu`); an error where
                 they cannot run (tensors on another device, no C++ compiler, ``HF_RESOLVENT_CPU_KERNELS=0``)
``"triton"``     the Triton kernels (:mod:`hf_resolvent.backends.triton`); an error where they cannot run
``"parallel"``   the parallel form as ``"auto"`` runs it, but never on Triton
``"graph"``      the graph form (:mod:`.graph`): the parallel form in tensor operations alone, which
                 ``torch.compile`` and ``torch.export`` trace into one graph
``"reference"``  materialised matrices and one triangular solve (an oracle for tests: O(n^2) memory)
``"recurrent"``  one token at a time through the recurrent form (an oracle for tests)
===============  ==========================================================================================

Precedence: the first source that names something other than ``"auto"`` wins: the ``impl=`` argument (the model
passes ``config.mixer_impl``), then the environment variable ``HF_RESOLVENT_MIXER_IMPL``. ``HF_RESOLVENT_CPU_KERNELS=0``
keeps the CPU kernels from being built at all.

Inside ``torch.compile`` and ``torch.export``, ``"auto"``, ``"parallel"`` and ``"torch"`` run the graph form: the
eager parallel form's slices, buffers and C++ kernels do not trace.

Decoding runs the Triton decode kernel (``"triton"``, and ``"auto"`` for CUDA tensors), or else the recurrent step,
whose arithmetic takes the compiled CPU kernel where the parallel form would take the CPU kernels (``"torch"``: its
PyTorch code alone; ``"cpu"``: an error where the kernel cannot run).

Several tokens after a decode state (a chunked prefill's later chunks, assisted decoding's drafts) run in parallel
(:mod:`.extend`) under ``"auto"``, ``"torch"``, ``"parallel"`` and ``"graph"`` (on the compiled CPU kernels where the
parallel form would take them; in PyTorch alone for ``"torch"`` and ``"graph"``); one decode step per token
under the other choices, inside a compiled graph, and while a state records for rollbacks.

The backends live in the installed library. The flat copy of the ops modules that ``save_pretrained`` ships for
``trust_remote_code`` has none: there ``"auto"`` runs PyTorch and ``"cpu"`` or ``"triton"`` is an error.
"""

from __future__ import annotations

import contextvars
import importlib
import os
from contextlib import contextmanager

import torch

from .state import StaticDecodeState

IMPLS = ("auto", "torch", "cpu", "triton", "parallel", "graph", "reference", "recurrent")
ENV = "HF_RESOLVENT_MIXER_IMPL"

# Only the library's own copy of this module reaches the backends; a saved folder's copy has another name and
# runs PyTorch (hf_resolvent.remote_code).
_IN_LIBRARY = __name__ == "hf_resolvent.ops.dispatch"
_modules: dict[str, object] = {}
# inside torch_only(): the compiled CPU kernels are not used (per thread and task, so that concurrent decodes with
# different choices do not see each other's)
_torch_only = contextvars.ContextVar("hf_resolvent_torch_only", default=False)


def resolve(impl: str | None) -> str:
    """The choice in force for a call given ``impl``: the argument, else ``HF_RESOLVENT_MIXER_IMPL``, else "auto"."""
    for value, source in ((impl, "impl"), (os.environ.get(ENV, "").strip() or None, ENV)):
        if value is None or value == "auto":
            continue
        if value not in IMPLS:
            raise ValueError(f"{source} must be one of {IMPLS}, got {value!r}")
        return value
    return "auto"


def backend(name: str):
    """The module ``hf_resolvent.backends.<name>`` ("cpu" or "triton"), or None where it is not shipped."""
    if name not in _modules:
        _modules[name] = importlib.import_module(f"hf_resolvent.backends.{name}") if _IN_LIBRARY else None
    return _modules[name]


def _required(name: str):
    module = backend(name)
    if module is None:
        raise RuntimeError(f"impl={name!r}: this copy of the mixer code (a saved model folder loaded with "
                           "trust_remote_code) has only the PyTorch path; install hf-resolvent and load the model "
                           "without remote code, or use impl='auto' or 'torch'")
    return module


def triton_ready() -> bool:
    """True when the Triton kernels can run here (Triton importable, and a CUDA device or the interpreter)."""
    module = backend("triton")
    try:
        return module is not None and module.triton_ready()
    except ImportError:
        return False


def triton():
    """The Triton backend, for a call that chose it (its functions raise where the kernels cannot run)."""
    return _required("triton")


def choose(impl: str | None, x: torch.Tensor) -> str:
    """The code that runs a mixer call on tensors like ``x``: "reference", "recurrent", "triton", "graph", "cpu" or
    "torch"."""
    impl = resolve(impl)
    if impl in ("reference", "recurrent", "triton", "graph"):
        return impl
    if torch.compiler.is_compiling():  # a graph takes the graph form; the C++ operators have no meta kernels
        if impl == "cpu":
            raise RuntimeError("impl='cpu' cannot run inside torch.compile (the C++ kernels are opaque to it); use "
                               "impl='auto' or 'graph', which compile the PyTorch code")
        return "graph"
    if impl == "torch":
        return impl
    if impl == "auto" and x.is_cuda and triton_ready():
        return "triton"
    cpu = backend("cpu")
    if impl == "cpu":
        cpu = _required("cpu")
        if x.device.type != "cpu":
            raise RuntimeError(f"impl='cpu': the compiled CPU kernels take CPU tensors, got tensors on {x.device}; "
                               "use impl='auto' or 'torch'")
        if not cpu.available():
            raise RuntimeError("impl='cpu': the compiled CPU kernels are not available here (see the warning of "
                               "their build; HF_RESOLVENT_CPU_KERNELS=0 skips it); use impl='auto' or 'torch'")
        return "cpu"
    return "cpu" if cpu is not None and x.device.type == "cpu" and cpu.available() else "torch"


def choose_decode(impl: str | None, x: torch.Tensor, state=None) -> str:
    """The decode step's code for tensors like ``x`` and a layer's ``state``: "triton", or the recurrent step as
    "recurrent" (its compiled CPU twin where :func:`compiled_for` allows it) or "torch" (its PyTorch code alone). A
    preallocated state (static cache) and a compiled graph take the recurrent step."""
    impl = resolve(impl)
    static = isinstance(state, StaticDecodeState)
    if impl == "triton" and static:
        raise RuntimeError("impl='triton': the Triton decode kernel reads the growing decode state; a static cache "
                           "decodes with the PyTorch step (impl='auto' or 'torch', or leave cache_implementation unset)")
    if impl == "triton" or (impl == "auto" and x.is_cuda and not static and not torch.compiler.is_compiling()
                            and triton_ready()):
        return "triton"
    if impl == "torch" and not torch.compiler.is_compiling():  # a graph runs no compiled kernel anyway
        return "torch"
    if impl == "cpu":
        choose(impl, x)  # raises where the compiled CPU kernels cannot run (inside a graph too, as for the forward)
    return "recurrent"


def choose_extend(impl: str | None, state, pattern) -> str:
    """How L > 1 tokens continue a decode ``state``: all at once (:func:`.extend.extend_mix`) as "extend" (its arithmetic
    on the compiled CPU kernels where :func:`compiled_for` allows it) or "torch" (its PyTorch code alone), or "steps"
    (one decode step each, :func:`choose_decode` choosing their code)."""
    impl = resolve(impl)
    if impl not in ("auto", "torch", "parallel", "graph") or torch.compiler.is_compiling():
        return "steps"
    if not state.takes_chunks(pattern):
        return "steps"
    return "torch" if impl in ("torch", "graph") else "extend"


@contextmanager
def torch_only():
    """Run the enclosed code without the compiled CPU kernels (``impl="torch"``; tests compare the two paths)."""
    token = _torch_only.set(True)
    try:
        yield
    finally:
        _torch_only.reset(token)


def compiled_for(*tensors: torch.Tensor) -> bool:
    """True when the parallel form's functions take the compiled CPU kernels for these tensors (float32 or float64
    on the CPU, kernels built, not inside :func:`torch_only`); they take their PyTorch code otherwise."""
    if torch.compiler.is_compiling() or _torch_only.get():  # the C++ operators have no meta kernels for a graph
        return False
    cpu = backend("cpu")
    return cpu is not None and cpu.supports(*tensors) and cpu.available()


def compiled_ops():
    """The compiled CPU kernels' operators (``torch.ops.hf_resolvent``); call after :func:`compiled_for` said yes."""
    return _required("cpu").operators()
