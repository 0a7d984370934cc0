"""Which code runs the mixer: the one switch between the backends (docs/ARCHITECTURE.md).

Two words name two different things here. **The CPU kernels** are the C++ operators of
:mod:`hf_resolvent.backends.cpu` (``torch.ops.hf_resolvent.<name>``), each the twin of one PyTorch function of
``ops/``. **In a graph** means traced by ``torch.compile`` or ``torch.export`` (``torch.compiler.is_compiling()``),
where the graph form runs and no CPU kernel does (they have no meta kernels to trace).

A mixer call is run by one backend, chosen once per call: :func:`choose` turns ``impl`` and where the tensors live
into a backend's name, and the row of that name in :data:`hf_resolvent.ops.mixer.BACKENDS` gives what it runs for
each kind of call (the table below). Inside the PyTorch forms, each leaf function that has a CPU twin runs it where
the twin takes the call (:meth:`CpuTwin.takes`: the twin's own condition on the arguments, declared with
:func:`cpu_twin` beside the function: a row limit, a dtype, a layout, no gradient; and the CPU kernels able to take
the tensors, :func:`cpu_kernels_for`); the "torch" backend runs its forms inside :func:`torch_only`, where no twin
runs. :data:`CPU_TWINS` holds every twin by name once the ops modules are imported. An autograd Function's backward
runs on the CPU kernels exactly when its forward did.

``impl`` names a backend, as ``attn_implementation`` does in ``transformers``: "torch" (PyTorch alone), "cpu" (the
CPU kernels, for the leaves whose twin takes the call, PyTorch for the rest), "triton", or "auto". The forms are
not choices of ``impl``: each is a public function that tests and oracles call directly (``reference_mix``,
``parallel_mix``, ``graph_mix``, ``recurrent_mix``, ``recurrent_step``, ``extend_mix``); an old form value of
``impl`` is an error naming that function.

<!-- backend table -->
| backend | chosen for | forward (`resolvent_mix`) | decode step (`decode_step`) | several tokens after a state (`decode_tokens`) |
|---|---|---|---|---|
| `"torch"` | `impl="torch"`, and `"auto"` where no other row applies | parallel, PyTorch alone | recurrent, PyTorch alone | extend, PyTorch alone |
| `"cpu"` | `impl="cpu"` (an error where the kernels cannot run: another device, no compiler, `HF_RESOLVENT_CPU_KERNELS=0`, in a graph), and `"auto"` for CPU tensors where the kernels build | parallel, on the CPU twins | recurrent, on its CPU twin | extend, on its CPU twin |
| `"cuda"` | `"auto"` for CUDA tensors where Triton runs, not in a graph | the attention pattern: sdpa; else triton | triton | extend |
| `"triton"` | `impl="triton"` (an error where it cannot run) | triton | triton | a decode step per token |
| `"graph"` | `"auto"` and `"torch"` in a graph | graph | recurrent | a decode step per token |
<!-- end of backend table -->

"on the CPU twins": where each twin takes the call (the decode step's and the extend path's only without a gradient,
the extend path's for a sparse pattern and a state that holds rows): see :data:`CPU_TWINS`. Several tokens after a
state also go one decode step at a time while the state records itself for rollbacks and its pattern drops
positions (:meth:`~.state.DecodeState.can_extend`). "sdpa" is PyTorch's ``scaled_dot_product_attention``, the
backends a transformers model of attention gets (cuDNN, flash, memory-efficient).

Precedence: the first source that names something other than ``"auto"`` wins: the ``impl=`` argument (the model
passes ``config.mixer_impl``), then the environment variable ``HF_RESOLVENT_MIXER_IMPL``.
``HF_RESOLVENT_CPU_KERNELS=0`` keeps the CPU kernels from being built at all. The model's RoPE, GELU and short
convolution, which run outside the mixer call, follow the same ``impl``: their CPU twins run where :func:`choose`
gives "cpu". RoPE with the head split and the gate's activation also have Triton twins, which run where the mixer
runs on Triton, outside a graph (:func:`triton_twin_runs`).

The backends live in the installed library. The flat copy of the ops modules that ``save_pretrained`` ships for
``trust_remote_code`` has none: there ``"auto"`` runs PyTorch and ``"cpu"`` or ``"triton"`` is an error.
"""

from __future__ import annotations

import contextvars
import importlib
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

IMPLS = ("auto", "torch", "cpu", "triton")
# values impl took when it also named forms: each is now a function to call (the error names it)
FORMS = {"parallel": "parallel_mix", "graph": "graph_mix", "reference": "reference_mix",
         "recurrent": "recurrent_mix (recurrent_step for one token)"}
ENV = "HF_RESOLVENT_MIXER_IMPL"

# Only the library's own copy of this module reaches the backends; a saved folder's copy has another name and
# runs PyTorch (hf_resolvent.remote_code).
_IN_LIBRARY = __name__ == "hf_resolvent.ops.dispatch"
_modules: dict[str, object] = {}
# inside torch_only(): the CPU kernels are not used (per thread and task, so that concurrent decodes with
# different choices do not see each other's)
_torch_only = contextvars.ContextVar("hf_resolvent_torch_only", default=False)


def resolve(impl: str | None) -> str:
    """The choice in force for a call given ``impl``: the argument, else ``HF_RESOLVENT_MIXER_IMPL``, else "auto"."""
    for value, source in ((impl, "impl"), (os.environ.get(ENV, "").strip() or None, ENV)):
        if value is None or value == "auto":
            continue
        if value in FORMS:
            raise ValueError(f"{source}={value!r} names a form, not a backend: call hf_resolvent.ops.{FORMS[value]} "
                             f"directly, or choose a backend among {IMPLS}")
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
    """The backend that runs a mixer call on tensors like ``x`` (a row of the table above): "torch", "cpu",
    "cuda", "triton" or "graph". Raises where a named backend cannot run."""
    impl = resolve(impl)
    if impl == "triton":
        return impl
    if torch.compiler.is_compiling():  # a graph takes the graph form; the C++ operators have no meta kernels
        if impl == "cpu":
            raise RuntimeError("impl='cpu' cannot run inside torch.compile (the C++ kernels are opaque to it); use "
                               "impl='auto' or 'torch', which compile the PyTorch code")
        return "graph"
    if impl == "torch":
        return impl
    if impl == "auto" and x.is_cuda and triton_ready():
        return "cuda"
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


# The dtypes the Triton kernels take (kernels/launching.py SUPPORTED_DTYPES; not imported: a saved folder's copy of
# this module has no backends).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_twin_runs(impl: str | None, *tensors: torch.Tensor) -> bool:
    """True when a function that runs around the mixer call (RoPE with the head split, the gate) runs its Triton
    twin on ``tensors``: where the mixer itself runs on Triton (:func:`choose` gives "triton" or "cuda"), not in a
    graph (which traces the PyTorch code), for the dtypes the kernels take. The one condition of those twins; each
    function adds its own (no gradient for the tables)."""
    impl = resolve(impl)
    if impl in ("torch", "cpu") or torch.compiler.is_compiling() or any(t.dtype not in TRITON_DTYPES for t in tensors):
        return False  # (choose() would raise for a "cpu" that cannot run: the mixer's call says so, not these)
    return choose(impl, tensors[0]) in ("triton", "cuda")


@contextmanager
def torch_only():
    """Run the enclosed code without the CPU kernels (``impl="torch"``; tests compare the two paths)."""
    token = _torch_only.set(True)
    try:
        yield
    finally:
        _torch_only.reset(token)


def cpu_kernels_for(*tensors: torch.Tensor) -> bool:
    """True when the CPU kernels can take these tensors: float32 or float64 on the CPU, the kernels built, not
    inside :func:`torch_only`, not in a graph. The common part of every :class:`CpuTwin`'s condition."""
    if torch.compiler.is_compiling() or _torch_only.get():  # the C++ operators have no meta kernels for a graph
        return False
    cpu = backend("cpu")
    return cpu is not None and cpu.supports(*tensors) and cpu.available()


def cpu_ops():
    """The CPU kernels' operators (``torch.ops.hf_resolvent``); call after a twin or :func:`cpu_kernels_for` said yes."""
    return _required("cpu").operators()


def cpu_functions():
    """The CPU kernels' autograd Functions (:mod:`hf_resolvent.backends.cpu.functions`); call after a twin said yes."""
    _required("cpu")
    return importlib.import_module("hf_resolvent.backends.cpu.functions")


@dataclass(frozen=True, eq=False)
class CpuTwin:
    """A PyTorch function of ``ops/`` and the operators of the CPU kernels that compute the same thing.

    Attributes:
        name: the function, as ``module.function``.
        operators: the names under ``torch.ops.hf_resolvent`` that it calls in its place (forward and backward).
        applies: the twin's own condition on the function's arguments (beyond :func:`cpu_kernels_for`), called with
            what :meth:`takes` gets; None: none.
        follows_impl: the function runs outside a mixer call (RoPE, GELU) and so asks :func:`choose` itself with
            the model's ``impl``; the twin runs only where that gives "cpu".
    """

    name: str
    operators: tuple[str, ...]
    applies: Callable[..., bool] | None = None
    follows_impl: bool = False

    def takes(self, *tensors: torch.Tensor, impl: str | None = None, **arguments) -> bool:
        """True when this call runs the twin: ``applies(*tensors, **arguments)``, then for a function that follows
        ``impl`` ``choose(impl, tensors[0]) == "cpu"`` (which raises where a named "cpu" cannot run), then
        :func:`cpu_kernels_for` ``(*tensors)``, in that order."""
        if self.applies is not None and not self.applies(*tensors, **arguments):
            return False
        if self.follows_impl and choose(impl, tensors[0]) != "cpu":
            return False
        return cpu_kernels_for(*tensors)


# Every CPU twin by name, filled by the cpu_twin() calls beside the functions they replace.
CPU_TWINS: dict[str, CpuTwin] = {}


def cpu_twin(name: str, operators: tuple[str, ...], applies: Callable[..., bool] | None = None,
             follows_impl: bool = False) -> CpuTwin:
    """Declare that the PyTorch function ``name`` has a twin on the CPU kernels (see :class:`CpuTwin`), and return it
    for the function to ask (:meth:`CpuTwin.takes`). A name is declared once."""
    if name in CPU_TWINS:
        raise ValueError(f"the CPU twin of {name} is already declared")
    CPU_TWINS[name] = twin = CpuTwin(name, tuple(operators), applies, follows_impl)
    return twin
