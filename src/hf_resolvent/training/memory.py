"""A training process's memory: glibc's allocator told to keep freed blocks (:func:`keep_freed_memory`), and the
peak resident memory with the share of the token shards held in it (:func:`memory_use`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the system (CPU training).

    Every step of the 44M shape allocates and frees blocks of about 100 MB (logits, their gradient, the tied
    embedding's gradients); glibc serves blocks that large with fresh ``mmap`` pages, so the kernel faults in
    and zeroes all of them again every step, a large share of the step spent as system time. With mmap off and
    trimming at 2 GB the freed blocks are reused and most of those faults go away (figures: bench/NOTES.md).
    PyTorch's CPU tuning guide gets the same from jemalloc or tcmalloc. Returns False where there is no glibc
    (nothing changed).
    """
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's <malloc.h> parameter numbers
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def memory_use(files) -> dict | None:
    """This process's peak resident memory (``VmHWM``) and how much of ``files`` (memory-mapped token shards) is
    resident in its mappings, in bytes; None where /proc is not Linux's."""
    try:
        status = Path("/proc/self/status").read_text()
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    peak = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    if peak is None:
        return None
    files = [Path(f).resolve() for f in files]
    targets = {str(f) for f in files}
    resident, current = 0, None
    for line in smaps.splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = " ".join(fields[5:]) if len(fields) > 5 else None
        elif fields and fields[0] == "Rss:" and current in targets:
            resident += int(fields[1]) * 1024
    return {"peak_rss_bytes": int(peak.group(1)) * 1024, "shards_resident_bytes": resident,
            "shards_bytes": sum(f.stat().st_size for f in files)}
