"""The CPU backend: C++ kernels (``csrc/``) built on first use with ``torch.utils.cpp_extension``.

Why: on CPU the sparse mixers are bound by the count of small PyTorch ops, not by arithmetic (square:ce at
n = 512 issues ~6,700 ops per layer forward + backward); compiled loops do the same work in a few calls. The
dense solve and causal attention become chunks of rows per head whose gemms see every key at once, with no
tree of kernel calls. Each kernel replaces one PyTorch function of the parallel form (``ops/slots.py``,
``ops/sparse_solve.py``, ``ops/dense_solve.py``, ``ops/attention.py``), the rotation of RoPE (``ops/rope.py``), the MLP's GELU
(``ops/gelu.py``) or the arithmetic of the decode step (``ops/recurrent.py``), which stays beside it as the
reference it is tested against and the path taken wherever the kernels are not: other devices, other dtypes, no
C++ compiler, or a choice of ``impl="torch"``. Each of those functions declares its twin and the condition under
which it applies beside its definition (:func:`hf_resolvent.ops.dispatch.cpu_twin`; all of them in
:data:`hf_resolvent.ops.dispatch.CPU_TWINS`). The autograd Functions that pair an operator with its backward are
:mod:`.functions`.

The first use compiles the kernels (a C++ compiler is needed, ninja is a dependency; from about 20 s on idle
cores to a few minutes on a busy 2-core machine) and says so on stderr; the build is cached in :func:`build_dir`
(under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and redone only when a source or a flag
changes. One build runs at a time per folder, under an operating-system lock (:mod:`hf_resolvent.locks`) that ends
with its holder: a second process waits for a live builder at most ``HF_RESOLVENT_BUILD_WAIT`` seconds (default
300) and then takes the PyTorch path, and the lock file that ``torch.utils.cpp_extension`` leaves behind when a
build is killed (it would wait on it forever) is removed, with a message, since no builder can be alive when our
lock is free.

The build runs in a process of its own that ends with the process that asked for it, compilers included, however
that one ends (even ``kill -9``): see :func:`_compile`. A build that succeeded leaves a record beside the library
(its size and SHA-256, and the flags it was built with), written last; a library is loaded only when its record
vouches for it, and one without a record or that differs from it (truncated by a full disk, a build killed while
linking, a partial copy of the cache: loading it would end the process with SIGBUS) is removed and rebuilt, with a
message. ``HF_RESOLVENT_CPU_KERNELS=0`` skips the build. A failed build warns once and leaves the PyTorch path in
place.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from ...files import atomic_write_json, file_problem, file_record
from ...locks import exclusive, say

_CSRC = Path(__file__).resolve().parent / "csrc"
_DISABLE = "HF_RESOLVENT_CPU_KERNELS"
_BUILD_WAIT = "HF_RESOLVENT_BUILD_WAIT"
_state: dict[str, bool] = {}  # "ok": the build's outcome once tried
# Link the C++ runtime that the process already holds, by its file name. Where the compiler's libstdc++.so link is
# missing (seen on a CUDA image: Ubuntu's gcc 13 without the package that makes it), -lstdc++ takes libstdc++.a and the
# library gets a second copy of the runtime whose streams are not set up: every error message that prints a number
# (TORCH_CHECK's shapes) ends the process with a segmentation fault, or comes back cut short. The build gets a copy:
# load() appends torch's own flags to the list it is given, and a list grown here would differ from the flags in the
# build record and make every later build in the process a different library (two that register the same
# operators abort the process).
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


def _record_path(library: Path) -> Path:
    """The build record beside ``library`` (``hf_resolvent_cpu_avx2.so`` -> ``hf_resolvent_cpu_avx2.build.json``)."""
    return library.with_name(library.stem + ".build.json")


def _write_record(library: Path, flags: dict) -> None:
    """Vouch for ``library``, just built with ``flags`` (compiler and linker flags): written last, atomically."""
    atomic_write_json(_record_path(library), {"library": file_record(library), "flags": flags})


def _read_record(library: Path) -> dict | None:
    """The build record of ``library``, or None when there is none or it is cut short."""
    try:
        record = json.loads(_record_path(library).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("library"), dict) else None
    except (OSError, ValueError):
        return None


def _damage(library: Path) -> str | None:
    """Why the existing ``library`` must not be loaded: it has no build record, or differs from it in size or
    SHA-256 (None when the record vouches for it). Loading a truncated library ends the process with SIGBUS."""
    record = _read_record(library)
    if record is None:
        return (f"{library} has no build record ({_record_path(library).name}): a build that did not finish left it, "
                f"or an earlier version of hf_resolvent")
    try:
        problem = file_problem(library.parent, library.name, record["library"], full=True)
    except (KeyError, TypeError):
        return f"the build record of {library} is unreadable"
    return None if problem is None else f"{library.parent}: {problem}"


def _is_current(library: Path, sources: list[Path], flags: dict) -> bool:
    """True when ``library`` is newer than every source and was built with ``flags`` (loading it compiles nothing)."""
    newest = max(p.stat().st_mtime for p in sources)
    record = _read_record(library)
    return (library.exists() and library.stat().st_mtime >= newest and record is not None
            and record.get("flags") == flags)


# Run by _compile in a process of its own (the leader of a new process group). torch.utils.cpp_extension starts ninja
# with subprocess.run and offers no hook on that process (no preexec_fn, no process group, no signal handling), so the
# build is wrapped in a process that can be ended whole: on SIGTERM it sends SIGTERM to its process group, where ninja
# is, and waits; ninja starts each compiler in a process group of its own and passes the signal on to them (SIGKILL
# would leave them running, orphaned). PR_SET_PDEATHSIG has the kernel send that SIGTERM when the parent dies, even
# by kill -9; where it is missing (not Linux) only a parent that exits through Python ends the build.
_BUILDER = """
import ctypes, json, os, signal, sys

def end(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    try:
        while True:
            os.waitpid(-1, 0)  # ninja ends after its compilers
    except ChildProcessError:
        pass
    os._exit(128 + signum)

signal.signal(signal.SIGTERM, end)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    sys.exit("the process that started this kernel build has ended")
try:
    from torch.utils.cpp_extension import load
    load(**json.loads(sys.argv[1]))  # builds, then loads the library once: it is known to load
except Exception as err:
    sys.exit(str(err) or repr(err))
"""


def _compile(**load_args) -> None:
    """Build the library with ``torch.utils.cpp_extension.load(**load_args)`` in a builder process (``_BUILDER``)
    that ends with this one, compilers included: on an exception here (Ctrl-C, a signal handler's exit) it is told
    to stop, and on this process's death the kernel tells it. Raises RuntimeError with the build's message."""
    builder = subprocess.Popen([sys.executable, "-c", _BUILDER, json.dumps(load_args), str(os.getpid())],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)  # outside the terminal's Ctrl-C: ended here
    try:
        output, _ = builder.communicate()
    except BaseException:
        builder.terminate()
        builder.wait()
        raise
    if builder.returncode != 0:
        raise RuntimeError(output.strip() or f"the build process ended with status {builder.returncode}")
    if output.strip():  # warnings of a build that succeeded
        sys.stderr.write(output)


def _build() -> bool:
    if os.environ.get(_DISABLE, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    sources = sorted(_CSRC.glob("*.cpp"))
    try:
        suffix, cflags = _flags()
        name, folder = f"hf_resolvent_cpu_{suffix}", build_dir()
        library, flags = folder / f"{name}.so", {"cflags": cflags, "ldflags": list(_LDFLAGS)}
        wait_s = float(os.environ.get(_BUILD_WAIT, "300"))
        with exclusive(folder / "hf_resolvent.lock", what="the CPU kernels' build", wait_s=wait_s,
                       fix=f"the PyTorch path is used meanwhile; raise {_BUILD_WAIT} to wait longer"):
            baton = folder / "lock"  # torch's own lock file: a build killed mid-way leaves it, and load() waits on it
            if baton.exists():
                say(f"removing {baton}, left by a kernel build that was interrupted (no build is running)")
                baton.unlink()
            if library.exists() and (damage := _damage(library)) is not None:
                say(f"{damage}; removing it and rebuilding the CPU kernels")
                library.unlink()  # ninja would take it for up to date
            if not _is_current(library, sources + list(_CSRC.glob("*.h")), flags):
                say(f"compiling the CPU kernels, once: from about 20 s on idle cores to a few minutes on a busy "
                    f"machine (cached in {folder})")
                t0 = time.perf_counter()
                _record_path(library).unlink(missing_ok=True)  # until the new library is whole
                _compile(name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
                         extra_ldflags=flags["ldflags"], build_directory=str(folder),
                         extra_include_paths=[str(_CSRC)], is_python_module=False, verbose=False)
                _write_record(library, flags)
                say(f"compiled the CPU kernels in {time.perf_counter() - t0:.0f} s")
            torch.ops.load_library(str(library))
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
