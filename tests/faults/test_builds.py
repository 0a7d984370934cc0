"""Faults injected into the first-use build of the C++ CPU kernels and into the locks that guard it: a build
killed mid-way (torch's lock file left behind), a build killed while its compilers run, a truncated library in the
cache, a live builder holding the folder, a holder killed with kill -9. Each build here runs in a subprocess with its
own TORCH_EXTENSIONS_DIR, so a hang fails the test by timeout instead of blocking the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil  # a dependency of accelerate
import pytest
from conftest import load_script, tiny_run_args

from hf_resolvent import locks
from hf_resolvent.backends import cpu as cpu_kernels

# What a user runs first: a model's generate(), which reaches the mixer and so the lazy build.
_GENERATE = textwrap.dedent("""
    import sys
    import torch
    from hf_resolvent import ResolventConfig, ResolventForCausalLM
    from hf_resolvent.backends import cpu as cpu_kernels

    config = ResolventConfig(vocab_size=50, n_layer=1, n_embd=32, n_head=2, n_inner=64, n_positions=64,
                             mixer="exp2:ce")
    ResolventForCausalLM(config).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    sys.exit(0 if cpu_kernels.available() else 3)
""")


def _run(code: str, extensions_dir, timeout: float, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir), "OMP_NUM_THREADS": "1", **env}
    env.pop(cpu_kernels._DISABLE, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def _build_dir(extensions_dir, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir))
    return cpu_kernels.build_dir()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real build, shared by the tests that need a built folder: (TORCH_EXTENSIONS_DIR, build folder, the first
    run). It starts from what a build killed mid-way leaves: torch's lock file."""
    extensions_dir = tmp_path_factory.mktemp("extensions")
    with pytest.MonkeyPatch.context() as mp:
        folder = _build_dir(extensions_dir, mp)
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what torch.utils.cpp_extension leaves when its build is killed
    return extensions_dir, folder, _run(_GENERATE, extensions_dir, timeout=400)


@pytest.mark.slow
def test_a_build_killed_mid_way_is_recovered_and_the_build_says_what_it_does(built):
    extensions_dir, folder, first = built
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"removing {folder / 'lock'}, left by a kernel build that was interrupted" in first.stderr
    # what it does, with a range rather than a time it cannot keep on a busy machine
    assert "compiling the CPU kernels, once: from about 20 s on idle cores to a few minutes on a busy machine" \
        in first.stderr
    assert "compiled the CPU kernels in" in first.stderr
    again = _run(_GENERATE, extensions_dir, timeout=200)  # cached: loads without a word
    assert again.returncode == 0 and "compiling" not in again.stderr, again.stderr[-3000:]


@pytest.mark.slow
def test_a_truncated_library_in_the_cache_is_rebuilt_with_a_message_instead_of_ending_the_process(built):
    """A truncated library that ninja takes for up to date used to end every later run with SIGBUS (no message) until
    the folder was deleted by hand."""
    extensions_dir, folder, first = built
    assert first.returncode == 0, first.stderr[-3000:]
    library = folder / f"{folder.name}.so"
    size = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(size // 2)
    out = _run(_GENERATE, extensions_dir, timeout=400)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])  # not -7, SIGBUS
    assert f"{library.name} is damaged: {size // 2:,} bytes where {size:,} were written (truncated or replaced); " \
           f"removing it and rebuilding the CPU kernels" in out.stderr, out.stderr[-3000:]
    assert "compiled the CPU kernels in" in out.stderr
    assert cpu_kernels._damage(library) is None  # a new record vouches for the new library


def test_a_library_is_loaded_only_when_its_build_record_vouches_for_it(tmp_path):
    """The record's checks on a small stand-in for a library (no build needed)."""
    library, source = tmp_path / "hf_resolvent_cpu_generic.so", tmp_path / "kernel.cpp"
    source.write_text("// a source older than the library")
    library.write_bytes(b"\x7fELF" + bytes(1000))
    flags = {"cflags": ["-O3"], "ldflags": []}
    assert "has no build record" in cpu_kernels._damage(library)  # a build that did not finish, an older version
    assert not cpu_kernels._is_current(library, [source], flags)
    cpu_kernels._write_record(library, flags)
    assert cpu_kernels._damage(library) is None and cpu_kernels._is_current(library, [source], flags)
    assert not cpu_kernels._is_current(library, [source], {"cflags": ["-O2"], "ldflags": []})  # flags changed
    library.write_bytes(b"\x7fELF" + bytes(500))
    assert "is damaged: 504 bytes where 1,004 were written" in cpu_kernels._damage(library)
    library.write_bytes(b"\x7fELF" + bytes(999) + b"x")  # the same size, other bytes
    assert "sha256 differs" in cpu_kernels._damage(library)
    cpu_kernels._record_path(library).write_text('{"library": ')  # a record cut short
    assert "has no build record" in cpu_kernels._damage(library)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return "(ended)"


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE  # dead, waiting for a parent to reap it
    except psutil.NoSuchProcess:
        return True


def test_killing_a_build_ends_its_compilers(tmp_path):
    """kill -9 of a process that builds the kernels ends the build's ninja and compilers too. ninja starts each
    compiler in a process group of its own, so they used to go on compiling, orphaned, for a minute or more."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop(cpu_kernels._DISABLE, None)
    user = subprocess.Popen([sys.executable, "-c", "from hf_resolvent.backends import cpu; cpu.available()"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    build: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 150
        while not any(_name(p).startswith("cc1plus") for p in build if not _ended(p)):
            assert user.poll() is None and time.monotonic() < deadline, "no compiler was seen running"
            time.sleep(0.2)
            build = psutil.Process(user.pid).children(recursive=True)
        user.kill()
        user.wait()
        deadline = time.monotonic() + 20
        while not all(_ended(p) for p in build) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_ended(p) for p in build), [_name(p) for p in build if not _ended(p)]
    finally:
        user.kill()
        for process in build:  # what a failing run left
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.slow
def test_error_messages_survive_a_compiler_that_offers_only_the_static_cpp_runtime(tmp_path):
    """Where the compiler finds libstdc++.a before libstdc++.so (a CUDA machine's gcc 13 did), the kernels must still
    link the shared runtime the process holds: with a second, static copy inside the library, an error message that
    prints a number killed the process there (segmentation fault) and comes back cut short here ("got [")."""
    static = subprocess.run(["c++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("this compiler has no libstdc++.a to offer in place of the shared runtime")
    only_static = tmp_path / "lib"
    only_static.mkdir()
    (only_static / "libstdc++.a").symlink_to(static)
    code = textwrap.dedent(f"""
        import torch
        from hf_resolvent.backends import cpu as cpu_kernels

        cpu_kernels._LDFLAGS = ["-L{only_static}"] + cpu_kernels._LDFLAGS  # that machine's search order
        assert cpu_kernels.available()
        q, x, read, r = torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.ones(2, 6, dtype=torch.bool), torch.tensor([6, 6])
        try:
            cpu_kernels.operators().decode_step(q, q, None, None, x, None, None, torch.randn(2, 3, 5, 4),
                                                torch.randn(2, 3, 6, 5), None, None, read, r, 0.5)
        except RuntimeError as err:
            print(str(err).splitlines()[0])
    """)
    out = _run(code, tmp_path / "extensions", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode_step: keys_a must be [2, 3, 6, 4], got [2, 3, 5, 4]" in out.stdout, out.stdout


def test_building_twice_in_one_process_loads_one_library(monkeypatch):
    """torch's load() appends to the linker flags it is given; our list must not grow, or a second build in the process
    (pretrain after a failed first try, these tests) loads a second library with the same operators and aborts."""
    before = list(cpu_kernels._LDFLAGS)
    for _ in range(2):
        monkeypatch.setattr(cpu_kernels, "_state", {})  # as in a process that builds again
        assert cpu_kernels.available()
    assert cpu_kernels._LDFLAGS == before


def test_a_live_builder_is_waited_on_for_a_bounded_time(tmp_path, monkeypatch):
    folder = _build_dir(tmp_path, monkeypatch)
    with locks.exclusive(folder / "hf_resolvent.lock", what="a test's build", fix="-"):
        t0 = time.monotonic()
        waiter = _run(_GENERATE, tmp_path, timeout=200, HF_RESOLVENT_BUILD_WAIT="2")
        waited = time.monotonic() - t0
    assert waiter.returncode == 3, waiter.stderr[-3000:]  # generate ran, on the PyTorch path
    assert f"waiting up to 2 s for pid {os.getpid()}" in waiter.stderr
    assert "could not be built (LockHeld" in waiter.stderr and "HF_RESOLVENT_BUILD_WAIT" in waiter.stderr
    assert waited < 150


# ---------------------------------------------------------------------------------------- the lock itself

_HOLDER = textwrap.dedent("""
    import sys, time
    from hf_resolvent import locks
    with locks.exclusive(sys.argv[1], what="the folder", fix="-"):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def holder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "x.lock")], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_lock_held_by_a_live_process_is_refused_at_once_or_after_the_wait(tmp_path, holder):
    said = []
    t0 = time.monotonic()
    with pytest.raises(locks.LockHeld, match=f"the folder is in use by pid {holder.pid} .*; do this"):
        with locks.exclusive(tmp_path / "x.lock", what="the folder", fix="do this"):
            pass
    with pytest.raises(locks.LockHeld, match=f"still in use by pid {holder.pid} .* after 1 s"):
        with locks.exclusive(tmp_path / "x.lock", what="the folder", fix="do this", wait_s=1, report=said.append):
            pass
    assert time.monotonic() - t0 < 30
    assert len(said) == 1 and said[0].startswith(f"waiting up to 1 s for pid {holder.pid}"), said


def test_a_lock_whose_holder_was_killed_is_taken_over(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    said = []
    with locks.exclusive(tmp_path / "x.lock", what="the folder", fix="-", report=said.append):
        assert (tmp_path / "x.lock.owner").exists()
    assert len(said) == 1 and said[0].startswith(f"took over the folder from pid {holder.pid}")
    assert not (tmp_path / "x.lock.owner").exists()


def test_pretrain_builds_the_kernels_before_its_progress_bar(tiny_data, tmp_path, monkeypatch):
    import tqdm.auto

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # on a GPU machine the run would need no CPU kernels
    pretrain = load_script("pretrain")
    events, build, bar = [], cpu_kernels._build, tqdm.auto.tqdm
    monkeypatch.setattr(cpu_kernels, "_state", {})  # as in a fresh process: nothing built or loaded yet
    monkeypatch.setattr(cpu_kernels, "_build", lambda: events.append("build") or build())
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: events.append("bar") or bar(*a, **k))
    pretrain.train(tiny_run_args(tiny_data, tmp_path / "run", "--max-steps", "1", "--no-final-save"))
    assert events == ["build", "bar"]
