"""The CPU backend: C++ kernels (``csrc/``) built on first use with ``torch.utils.cpp_extension``.

Why: on CPU the sparse mixers are bound by the count of small PyTorch ops, not by arithmetic (square:ce at
n = 512 issues ~6,700 ops per layer forward + backward); compiled loops do the same work in a few calls. The
dense solve and causal attention become chunks of rows per head whose gemms see every key at once, with no
tree of kernel calls. Each kernel replaces one PyTorch function of the parallel form (``ops/slots.py``,
``ops/solve.py``, ``ops/dense.py``, ``ops/flash.py``), the rotation of RoPE (``ops/rope.py``), the MLP's GELU
(``ops/gelu.py``) or the arithmetic of the decode step (``ops/recurrent.py``), which stays beside it as the
reference it is tested against and the path taken wherever the kernels are not: other devices, other dtypes, no
C++ compiler, or a choice of ``impl="torch"`` (:mod:`hf_resolvent.ops.dispatch` decides, the one switch;
docs/ARCHITECTURE.md).

The first use compiles for about 20 s on 2 cores (a C++ compiler is needed, ninja is a dependency) and says so on
stderr; the build is cached in :func:`build_dir` (under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and redone only when a source changes. One build runs at a time per folder, under
an operating-system lock (:mod:`hf_resolvent.locks`) that ends with its holder: a second process waits for a live
builder at most ``HF_RESOLVENT_BUILD_WAIT`` seconds (default 300) and then takes the PyTorch path, and the lock
file that ``torch.utils.cpp_extension`` leaves behind when a build is killed (it would wait on it forever) is
removed, with a message, since no builder can be alive when our lock is free.
``HF_RESOLVENT_CPU_KERNELS=0`` skips the build. A failed build warns once and leaves the PyTorch path in place.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from ...locks import exclusive, say

_CSRC = Path(__file__).resolve().parent / "csrc"
_DISABLE = "HF_RESOLVENT_CPU_KERNELS"
_BUILD_WAIT = "HF_RESOLVENT_BUILD_WAIT"
_state: dict[str, bool] = {}  # "ok": the build's outcome once tried
# Link the C++ runtime that the process already holds, by its file name. Where the compiler's libstdc++.so link is
# missing (seen on a CUDA image: Ubuntu's gcc 13 without the package that makes it), -lstdc++ takes libstdc++.a and the
# library gets a second copy of the runtime whose streams are not set up: every error message that prints a number
# (TORCH_CHECK's shapes) ends the process with a segmentation fault, or comes back cut short. load() gets a copy:
# it appends torch's own flags to the list, and a second load() in the process with the grown list would build and
# load a second library that registers the same operators (an abort).
_LDFLAGS = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def _flags() -> tuple[str, list[str]]:
    """(name suffix, compiler flags) for this CPU: the instruction set PyTorch itself found here. The suffix keeps
    builds for different instruction sets apart when a home directory (so the build cache) is shared by machines.

    -fopenmp: ATen's ``at::parallel_for`` is an inline ``omp parallel``; without the flag it runs every (batch x
    head) row on the calling thread. The OpenMP runtime is the one libtorch_cpu already loads."""
    flags = ["-O3", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability() if platform.machine() in ("x86_64", "AMD64") else ""
    if capability == "AVX512":
        return "avx512", flags + ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mavx2", "-mfma"]
    if capability == "AVX2":
        return "avx2", flags + ["-mavx2", "-mfma"]
    return "generic", flags


def build_dir() -> Path:
    """The folder this Python, PyTorch and instruction set build into (delete it to force a rebuild)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # torch's own rule
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    return Path(root) / tag / f"hf_resolvent_cpu_{_flags()[0]}"


def _is_current(folder: Path, name: str, sources: list[Path]) -> bool:
    """True when the folder holds a library newer than every source (loading it compiles nothing)."""
    built = folder / f"{name}.so"
    newest = max(p.stat().st_mtime for p in sources)
    return built.exists() and built.stat().st_mtime >= newest


def _build() -> bool:
    if os.environ.get(_DISABLE, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    sources = sorted(_CSRC.glob("*.cpp"))
    try:
        from torch.utils.cpp_extension import load

        suffix, flags = _flags()
        name, folder = f"hf_resolvent_cpu_{suffix}", build_dir()
        wait_s = float(os.environ.get(_BUILD_WAIT, "300"))
        with exclusive(folder / "hf_resolvent.lock", what="the CPU kernels' build", wait_s=wait_s,
                       fix=f"the PyTorch path is used meanwhile; raise {_BUILD_WAIT} to wait longer"):
            baton = folder / "lock"  # torch's own lock file: a build killed mid-way leaves it, and load() waits on it
            if baton.exists():
                say(f"removing {baton}, left by a kernel build that was interrupted (no build is running)")
                baton.unlink()
            compiling = not _is_current(folder, name, sources + list(_CSRC.glob("*.h")))
            if compiling:
                say(f"compiling the CPU kernels, about 20 s, once (cached in {folder})")
            t0 = time.perf_counter()
            load(name=name, sources=[str(p) for p in sources], extra_cflags=flags, extra_ldflags=list(_LDFLAGS),
                 build_directory=str(folder), extra_include_paths=[str(_CSRC)], is_python_module=False, verbose=False)
            if compiling:
                say(f"compiled the CPU kernels in {time.perf_counter() - t0:.0f} s")
    except Exception as err:  # no compiler, missing headers, a read-only cache, a build that holds the lock, ...
        warnings.warn(
            f"hf_resolvent: the compiled CPU kernels could not be built ({type(err).__name__}: {err}); the PyTorch "
            f"path is used instead (same results, slower for sparse patterns). Set {_DISABLE}=0 to skip the build.",
            RuntimeWarning, stacklevel=3,
        )
        return False
    return True


def available() -> bool:
    """True when the compiled kernels are loaded (building them on the first call)."""
    if "ok" not in _state:
        _state["ok"] = _build()
    return bool(_state["ok"])


def supports(*tensors: torch.Tensor) -> bool:
    """True when the kernels take these tensors: on the CPU, float32 or float64 (whether they are built or not)."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in tensors)


def operators():
    """The kernels' operator namespace, ``torch.ops.hf_resolvent`` (building them on the first call)."""
    if not available():
        raise RuntimeError(f"hf_resolvent: the compiled CPU kernels are not available (no C++ compiler, a failed "
                           f"build, or {_DISABLE}=0); use impl='torch' or 'auto', or see the warning of the build")
    return torch.ops.hf_resolvent
