"""`librarian_jax.host_memory`: when the commands re-execute with huge-page malloc, and that it helps."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from librarian_jax import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINUX = dict(system="Linux", glibc=(2, 36), thp="madvise")

# Re-executes (as main does), then, in a thread other than the main one (as XLA:CPU runs a program), faults
# in a 256 MiB buffer from malloc, frees it and takes and faults in another; prints the tunables it runs with
# and the minor page faults each buffer took.
_PROBE = """
import os, resource, sys, threading
from librarian_jax import host_memory
host_memory.reexec_with_huge_pages()
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = libc.malloc(256 << 20)
    ctypes.memset(buf, 1, 256 << 20)  # not numpy: it asks for huge pages itself
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(buf)
def two_steps():
    step()
    step()
t = threading.Thread(target=two_steps)
t.start()
t.join()
print(os.environ.get("GLIBC_TUNABLES", ""), faults[0], faults[1], sys.argv[1:], sep="|")
"""
HEAP = ":".join(f"{n}={v}" for n, v in host_memory.HEAP_TUNABLES)


def test_the_tunable_is_added_only_where_it_helps_and_the_user_has_not_chosen():
    assert host_memory.tunables_with_huge_pages({}, **LINUX) == "glibc.malloc.hugetlb=1"
    # JAX on the CPU only: the heap tunables too, each unless the user set it (the user's value stays)
    assert HEAP == "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
    assert host_memory.tunables_with_huge_pages({}, **LINUX, cpu=True) == f"glibc.malloc.hugetlb=1:{HEAP}"
    assert host_memory.tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, **LINUX,
                                                cpu=True) == \
        "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:" \
        "glibc.malloc.trim_threshold=68719476736"
    assert host_memory.tunables_with_huge_pages({"LIBRARIAN_JAX_HUGE_PAGES": "0"}, **LINUX, cpu=True) is None
    # the user's other tunables are kept
    assert host_memory.tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **LINUX) == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # the user's own setting of it wins (either value), as does the opt-out
    for given in ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"):
        assert host_memory.tunables_with_huge_pages({"GLIBC_TUNABLES": given}, **LINUX) is None, given
    assert host_memory.tunables_with_huge_pages({"LIBRARIAN_JAX_HUGE_PAGES": "0"}, **LINUX) is None
    # a longer tunable that contains the name is not it
    assert host_memory.tunables_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlbx=1"}, **LINUX) == \
        "glibc.malloc.hugetlbx=1:glibc.malloc.hugetlb=1"
    # nowhere it would not help: other systems, other C libraries, old glibc, THP always / never / absent
    for other in (dict(system="Darwin"), dict(glibc=None), dict(glibc=(2, 34)), dict(thp="always"),
                  dict(thp="never"), dict(thp="")):
        assert host_memory.tunables_with_huge_pages({}, **{**LINUX, **other}) is None, other


def test_cpu_only_reads_jax_platforms_then_the_accelerators_device_files(tmp_path):
    absent, present = (str(tmp_path / "nvidia0"),), (str(tmp_path),)
    assert host_memory.cpu_only({}, absent) and not host_memory.cpu_only({}, present)
    assert host_memory.cpu_only({"JAX_PLATFORMS": "cpu"}, present)
    for platforms in ("cuda", "tpu", "cuda,cpu", "cpu,cuda"):
        assert not host_memory.cpu_only({"JAX_PLATFORMS": platforms}, absent), platforms


def test_the_kernels_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host_memory.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert host_memory.thp_mode(str(f)) == "always"
    f.write_text("garbage\n")
    assert host_memory.thp_mode(str(f)) == ""
    assert host_memory.thp_mode(str(tmp_path / "absent")) == ""


@pytest.mark.skipif(host_memory.tunables_with_huge_pages(
    {}, system=platform.system(), glibc=host_memory.glibc_version(), thp=host_memory.thp_mode()) is None,
    reason="this machine's kernel or C library gives the tunable nothing to do")
def test_a_reexecuted_process_faults_in_large_buffers_by_huge_pages():
    """The same command line runs again with the tunables (its arguments kept): a 256 MiB buffer takes a few
    hundred page faults instead of 65,536 (at least 4x fewer), and on the CPU only (JAX_PLATFORMS=cpu) the
    next one, after the first is freed, almost none (the heap kept it); with the opt-out the process is left
    alone and each buffer faults in anew."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LIBRARIAN_JAX_HUGE_PAGES")}
    runs = {}
    for name, extra in (("huge", {"JAX_PLATFORMS": "cuda"}), ("cpu", {"JAX_PLATFORMS": "cpu"}),
                        ("opted out", {"LIBRARIAN_JAX_HUGE_PAGES": "0"})):
        out = subprocess.run([sys.executable, "-c", _PROBE, "--a=1", "b"], cwd=ROOT, env={**env, **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        tunables, first, second, args = out.stdout.strip().split("|")
        runs[name] = (tunables, int(first), int(second), args)
    assert runs["huge"][0] == "glibc.malloc.hugetlb=1" and runs["huge"][3] == "['--a=1', 'b']"
    assert runs["cpu"][0] == f"glibc.malloc.hugetlb=1:{HEAP}"
    assert runs["opted out"][0] == ""
    assert min(runs["opted out"][1:3]) >= 60_000  # 4 KiB pages, each buffer anew
    for name in ("huge", "cpu"):  # ~640 here: 2 MiB at a time where the kernel has them (a fragmented
        # machine may fall back to some 4 KiB pages, hence not an exact figure)
        assert runs[name][1] * 4 < runs["opted out"][1], runs
    assert runs["huge"][2] * 4 < runs["opted out"][2], runs  # mapped anew, by huge pages
    assert runs["cpu"][2] * 4 < runs["huge"][2], runs  # the freed buffer reused: (almost) nothing to fault in


def test_the_log_line_says_which_pages_and_why():
    assert "huge pages" in host_memory.describe({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert host_memory.describe({"LIBRARIAN_JAX_HUGE_PAGES": "0"}).endswith("(LIBRARIAN_JAX_HUGE_PAGES=0)") \
        or host_memory.thp_mode() == "always"
