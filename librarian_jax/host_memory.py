"""Host memory for XLA:CPU: glibc's malloc backed by transparent huge pages, its heap kept between steps.

XLA:CPU takes a compiled program's temporaries (activations, gradients in flight) as one buffer from malloc
each time the program runs: 2.6 GiB for the noisy warm start's SFT step (8 rows of 1,856 tokens). glibc
hands a buffer that large out with mmap and returns it with munmap afterwards, so every step faults it in
again, 4 KiB at a time: ~150,000 page faults a second, a third of the CPU time spent in the kernel on 2
cores. With the glibc tunable `glibc.malloc.hugetlb=1` (glibc >= 2.35) malloc asks the kernel for
transparent huge pages on its mappings (madvise), 2 MiB at a time: the noisy SFT step took 3.2 s instead of
~4.9 (BENCHMARKS.md, 2026-12-07). The kernel still zeroes each fresh mapping (15% of the SFT's CPU time on a
Zen 4 box), so where JAX runs on the CPU only (`cpu_only`) malloc also keeps one arena and no mmap
(`HEAP_TUNABLES`): a freed step buffer stays in the heap for the next step, never trimmed. The noisy default
took 10 min 54 s instead of 12 min 27 s, 32 s of system time instead of 224, at a peak resident size of 6.9 GB
instead of 3.7 (the heap keeps what it held; BENCHMARKS.md, "2026-12-07 (second)"). Not on accelerator hosts,
where XLA:CPU's buffers are small and many host threads would share one arena. Results are the same to the
bit (only where the bytes live changes).

glibc reads its tunables once, when a process starts, so the commands (`python -m librarian_jax.main`)
call `reexec_with_huge_pages()` first thing: it re-executes the same command line once with the tunable
added to `GLIBC_TUNABLES`, where it helps: Linux with glibc >= 2.35 and transparent huge pages in "madvise"
mode (with "always" every mapping has them already; with "never" the tunable does nothing). It leaves the
process alone when `GLIBC_TUNABLES` already sets `glibc.malloc.hugetlb` (the user's choice wins) or
`LIBRARIAN_JAX_HUGE_PAGES=0` (which turns off the heap tunables too); a heap tunable the user sets keeps the
user's value. A re-executed process keeps its pid, arguments and environment.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence

TUNABLE = "glibc.malloc.hugetlb"
# CPU-only runs: one arena (every thread's malloc in the main heap), no mmap (large buffers from the heap
# too), no trimming below 64 GiB (a freed buffer is not handed back to the kernel, so the next step's is not
# zeroed again)
HEAP_TUNABLES = (("glibc.malloc.arena_max", "1"), ("glibc.malloc.mmap_max", "0"),
                 ("glibc.malloc.trim_threshold", str(1 << 36)))
OPT_OUT = "LIBRARIAN_JAX_HUGE_PAGES"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
# device files of accelerators JAX may use: NVIDIA GPUs, TPU VMs (v2-v4 accel, v5+ vfio)
ACCELERATOR_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/accel0", "/dev/vfio/0")


def thp_mode(path: str = THP_MODE_FILE) -> str:
    """The kernel's transparent-huge-page mode, the bracketed word of `path` ("always", "madvise", "never"),
    or "" where the file is absent or unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library this Python runs on when it is glibc, else None."""
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return None
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def cpu_only(environ: Mapping[str, str], accelerator_files: tuple[str, ...] = ACCELERATOR_FILES) -> bool:
    """Whether JAX will run on the CPU only: `JAX_PLATFORMS` is "cpu", or it is unset and no accelerator's
    device file exists."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms == "cpu"
    return not any(os.path.exists(p) for p in accelerator_files)


def tunables_with_huge_pages(environ: Mapping[str, str], *, system: str, glibc: tuple[int, int] | None,
                             thp: str, cpu: bool = False) -> str | None:
    """The `GLIBC_TUNABLES` value to re-execute with, or None to leave the process as it is (see the module
    doc for when); `cpu`: JAX runs on the CPU only (`cpu_only`), so the heap tunables are added too."""
    if environ.get(OPT_OUT, "") == "0" or system != "Linux" or glibc is None or glibc < (2, 35):
        return None
    if thp != "madvise":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if names_tunable(current):
        return None
    parts = [current] if current else []
    parts.append(f"{TUNABLE}=1")
    if cpu:
        parts += [f"{name}={value}" for name, value in HEAP_TUNABLES if not names_tunable(current, name)]
    return ":".join(parts)


def names_tunable(tunables: str, name: str = TUNABLE) -> bool:
    """Whether a `GLIBC_TUNABLES` string sets `name` (default `glibc.malloc.hugetlb`; any value; a longer name
    is not it)."""
    return any(part.split("=", 1)[0] == name for part in tunables.split(":"))


def describe(environ: Mapping[str, str] | None = None) -> str:
    """One line for a run's log: whether malloc uses huge pages here, and why not when it does not."""
    environ = os.environ if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "")
    parts = tunables.split(":")
    if f"{TUNABLE}=1" in parts:
        heap = all(f"{n}={v}" in parts for n, v in HEAP_TUNABLES)
        return (f"malloc on transparent huge pages{', one arena, freed memory kept' if heap else ''} "
                f"(GLIBC_TUNABLES={tunables})")
    mode = thp_mode()
    if mode == "always":
        return "transparent huge pages for every mapping (the kernel's mode 'always')"
    why = ("LIBRARIAN_JAX_HUGE_PAGES=0" if environ.get(OPT_OUT, "") == "0" else
           f"GLIBC_TUNABLES={tunables}" if names_tunable(tunables) else
           f"transparent huge pages {mode or 'unavailable'}, glibc {glibc_version() or 'absent'}")
    return f"4 KiB pages ({why})"


def reexec_with_huge_pages(argv: Sequence[str] | None = None) -> None:
    """Re-executes this Python command (`sys.orig_argv`, or `argv` when given: the interpreter's own
    arguments included) with huge-page malloc where it helps; returns without doing anything otherwise. Call
    it before anything has started threads or opened files worth keeping."""
    tunables = tunables_with_huge_pages(os.environ, system=platform.system(), glibc=glibc_version(),
                                        thp=thp_mode(), cpu=cpu_only(os.environ))
    if tunables is None or not sys.executable:
        return
    args = list(sys.orig_argv if argv is None else argv)
    env = dict(os.environ, GLIBC_TUNABLES=tunables)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args[1:]], env)
