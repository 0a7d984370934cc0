"""Readiness checks and loading of the ``@triton.jit`` kernels in the right Triton mode.

``triton.jit`` decides when a function is *decorated* whether it is compiled for the GPU or run by the
interpreter (``TRITON_INTERPRET=1``). To let the interpreter be switched on for some code only (a
test module, say) without leaking into the rest of a process, the kernel package ``jit/`` (one module per op)
is loaded once per mode, as a separate package with its own copy of every module, the first time that mode is
used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

_MODULES: dict[bool, ModuleType] = {}
_COMPILED_ONLY = False  # set within ``compiled_kernels()``
_JIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jit")

NOT_READY = (
    "the Triton kernels cannot run here: {why}. They need CUDA tensors on a GPU with Triton installed, "
    "or TRITON_INTERPRET=1 in the environment to run them on CPU tensors through Triton's interpreter "
    "(slow: tests only). Use impl='torch' (PyTorch) or 'auto' otherwise."
)


def _triton():
    try:
        import triton
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return triton


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set (as Triton reads it: 1, true, on, yes)."""
    triton = _triton()
    if triton is None:
        return False
    return bool(triton.knobs.runtime.interpret)


def triton_ready() -> bool:
    """True when the kernels can run: Triton importable and either a CUDA device or the interpreter."""
    if _triton() is None:
        return False
    return interpreting() or torch.cuda.is_available()


def check_ready(*tensors: torch.Tensor | None) -> None:
    """Raise a RuntimeError saying why the kernels cannot run on these tensors, and what to do."""
    if _triton() is None:
        raise RuntimeError(NOT_READY.format(why="the triton package is not installed"))
    if interpreting():
        return
    devices = {t.device.type for t in tensors if t is not None}
    if devices != {"cuda"}:
        where = ", ".join(sorted(devices)) or "no tensors"
        if not torch.cuda.is_available():
            why = f"no CUDA device is available and TRITON_INTERPRET is not set (tensors on {where})"
        else:
            why = f"the tensors are on {where}, not on a CUDA device, and TRITON_INTERPRET is not set"
        raise RuntimeError(NOT_READY.format(why=why))


def jit_module(interpret: bool | None = None) -> ModuleType:
    """The kernel package ``jit/`` for the current mode (compiled or interpreted), loaded once per mode.

    ``interpret`` forces a mode (``False``: GPU-compilable kernels, for ahead-of-time compilation).
    """
    if interpret is None:
        interpret = interpreting() and not _COMPILED_ONLY
    mode = bool(interpret)
    module = _MODULES.get(mode)
    if module is None:
        name = f"{__package__}._jit_{'interpreted' if mode else 'compiled'}"
        # a package of its own per mode: the op modules' relative imports load that mode's copy of .common
        spec = importlib.util.spec_from_file_location(name, os.path.join(_JIT_DIR, "__init__.py"),
                                                      submodule_search_locations=[_JIT_DIR])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # the op modules import through it; triton resolves helpers via their globals
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if mode else "0"  # read by triton.jit at decoration
        try:
            spec.loader.exec_module(module)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
        _MODULES[mode] = module
    return module


@contextlib.contextmanager
def compiled_kernels():
    """Within the block :func:`jit_module` gives the GPU-compiled kernels whatever ``TRITON_INTERPRET`` says: what
    ``aot.recording_launches`` records, and what ``aot.compile_launch`` builds."""
    global _COMPILED_ONLY
    old, _COMPILED_ONLY = _COMPILED_ONLY, True
    try:
        yield
    finally:
        _COMPILED_ONLY = old
