"""JAX's persistent compilation cache, so a second run of the same programs starts warm.

`enable()` points `jax_compilation_cache_dir` at a directory (by default `$LIBRARIAN_JAX_COMPILATION_CACHE`,
else `~/.cache/librarian_jax/jax_compilation_cache`); every program that took at least `min_compile_s` to
compile is written there, keyed by its HLO, the compile options, the JAX/XLA version and the devices, and a
later process that compiles the same program reads it back instead. The main command and the benches call it
before compiling anything; `--compilation_cache_dir=none` (or the variable set to `none`) turns it off.
Multi-process runs: JAX writes entries from process 0 only, and on the CPU (and TPU) a program's key holds its
device assignment, so the process-local engines of process 1, 2, ... (other devices, other keys) would miss
the cache on every start. `enable` lets each process write the entries of programs that run on its own devices
only (`_write_local_programs`), and, with a local cache directory, every program it compiles (a global program
can be one process's own too, e.g. a slice at its share's offsets); with a `gs://` directory programs over
every process's devices are written by process 0 alone, as JAX does. On GPU JAX strips the device assignment
from the key, so every process already reads process 0's entries. Each host keeps its own local directory, or
the processes share one.

Every program is written (`min_compile_s=0` by default), however fast it compiled: a second run of the same
config, or an evaluation of its run, then compiles nothing new (the main command's `done:` line says how many
programs each process compiled and read back).

`CompileClock` measures what compiling costs a run: it counts, from JAX's own monitoring events, the programs
XLA compiled or read back from the persistent cache, and the seconds spent tracing, lowering and compiling
them, so a run can report its compile time apart from its run time (the main command logs it per step and in
its summary).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from typing import Any

import jax
from absl import logging
from jax import monitoring

ENV = "LIBRARIAN_JAX_COMPILATION_CACHE"
OFF = ("", "none", "off")


def default_dir() -> str:
    """`$LIBRARIAN_JAX_COMPILATION_CACHE`, else `~/.cache/librarian_jax/jax_compilation_cache`."""
    return os.environ.get(ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "librarian_jax", "jax_compilation_cache"
    )


MIN_COMPILE_S = 0.0  # `enable`'s default: every program is written (JAX's default is 1 s)


def enable(cache_dir: str | None = None, *, min_compile_s: float = MIN_COMPILE_S) -> str | None:
    """Turns the persistent compilation cache on at `cache_dir` (None: `default_dir()`).

    Args:
      cache_dir: directory for compiled programs (created if missing); "none" / "off" / "" turns it off.
      min_compile_s: programs that compiled faster than this are not written (JAX's default is 1 s). The
        default, 0, writes every program: the embedded default's hundreds of small programs take 0.01-3 s
        each on a CPU and together dominate its start-up, and a restart should compile none of them.
    Returns:
      The directory in use, or None when off.
    """
    path = default_dir() if cache_dir is None else cache_dir
    if path.strip().lower() in OFF:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run
        logging.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _write_local_programs(every_program="://" not in path)
    logging.info("persistent compilation cache: %s", path)
    return path


_local = threading.local()  # .devices_local: the program being compiled runs on this process's devices only
_patched = False
_every_program = False  # processes other than 0 write every program, not only their process-local ones


def _write_local_programs(every_program: bool = False) -> None:
    """Lets a process other than 0 write the cache entries of its process-local programs (see the module
    docstring), and with `every_program` (a local cache directory, where JAX's file locks keep concurrent
    writers apart) all of its programs: a program over every process's devices can still be this process's
    own (a slice of its share of a global batch holds its own offsets), and JAX alone would never write it.
    JAX skips every write from such a process (`jax._src.compiler._cache_write`: write contention on shared
    filesystems such as GCS, where only process-local programs, whose keys no other process has, are
    written). Wraps two of JAX's internal functions once per process; a JAX without them keeps its own rule
    (a warning says so)."""
    global _patched, _every_program
    _every_program = bool(every_program)
    if _patched:
        return
    try:
        from jax._src import compilation_cache as jax_cc
        from jax._src import compiler
        from jax._src import distributed as jax_dist

        compile_or_get_cached, cache_write = compiler.compile_or_get_cached, compiler._cache_write
        put = jax_cc.put_executable_and_time
    except (ImportError, AttributeError) as e:  # pragma: no cover - another JAX's internals
        logging.warning("compilation cache: processes other than 0 will not write entries (%s)", e)
        _patched = True
        return

    def compile_or_get(backend: Any, computation: Any, devices: Any, *args: Any, **kwargs: Any) -> Any:
        here = jax.process_index()
        before = getattr(_local, "devices_local", False)
        _local.devices_local = all(d.process_index == here for d in devices.flat)
        try:
            return compile_or_get_cached(backend, computation, devices, *args, **kwargs)
        finally:
            _local.devices_local = before

    def write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any, executable: Any,
              host_callbacks: Any) -> None:
        mine = _every_program or getattr(_local, "devices_local", False)
        if jax_dist.global_state.process_id in (0, None) or not mine or backend.platform == "gpu":
            # process 0, a program other processes write, or GPU (every process shares process 0's keys)
            return cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - as JAX's own write: a failed entry only warns
            logging.warning("compilation cache: writing %s failed: %s: %s", module_name, type(e).__name__, e)
        return None

    compiler.compile_or_get_cached = compile_or_get
    compiler._cache_write = write
    _patched = True


FLAG_HELP = ("JAX persistent compilation cache directory (a second run starts warm); default "
             "$LIBRARIAN_JAX_COMPILATION_CACHE or ~/.cache/librarian_jax/jax_compilation_cache; 'none': off.")


def define_flag() -> None:
    """Defines `--compilation_cache_dir` (absl) unless already defined: the main command and every bench
    share the one flag, and a process may import several of them (the test suite does)."""
    from absl import flags

    if "compilation_cache_dir" not in flags.FLAGS:
        flags.DEFINE_string("compilation_cache_dir", None, FLAG_HELP)


# ------------------------------------------------------------------------------------- compile accounting

# JAX's monitoring events (jax._src.dispatch / compiler): each backend compile (or persistent-cache read) of a
# program, each jaxpr trace, each lowering to MLIR, and each persistent-cache hit.
_EVENT_COMPILE = "/jax/core/compile/backend_compile_duration"
_EVENT_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_EVENT_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_EVENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileTotals:
    """What compiling has cost this process so far (or between two readings, `CompileClock.since`).

    programs: XLA executables built (compiled, or read back from the persistent cache: `cache_hits` of them);
    compile_s: seconds in XLA's compile or the cache read; trace_s / lower_s: seconds tracing Python to
    jaxprs (`jax.eval_shape` included) and lowering them to MLIR."""

    programs: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled anew (not read back from the persistent cache)."""
        return self.programs - self.cache_hits

    @property
    def total_s(self) -> float:
        return self.compile_s + self.trace_s + self.lower_s

    def __sub__(self, other: CompileTotals) -> CompileTotals:
        return CompileTotals(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                                     strict=True)))

    def metrics(self, prefix: str = "compile/") -> dict[str, float]:
        """TensorBoard scalars: programs, cache_hits, seconds (compile, trace, lower, total)."""
        return {f"{prefix}programs": float(self.programs), f"{prefix}cache_hits": float(self.cache_hits),
                f"{prefix}xla_s": self.compile_s, f"{prefix}trace_s": self.trace_s,
                f"{prefix}lower_s": self.lower_s, f"{prefix}time_s": self.total_s}

    def as_dict(self) -> dict[str, float]:
        """The fields and `total_s` (a run's summary.json `compile`)."""
        return {**dataclasses.asdict(self), "total_s": self.total_s}

    def line(self) -> str:
        """`5 programs (2 from the cache) 12.3s` (empty when nothing compiled)."""
        if not self.programs and self.total_s < 0.05:
            return ""
        hits = f" ({self.cache_hits} from the cache)" if self.cache_hits else ""
        return f"{self.programs} programs{hits} {self.total_s:.1f}s"


class CompileClock:
    """Process-wide compile accounting from JAX's monitoring events (registered once, on first use).

        clock = CompileClock.get()
        before = clock.totals()
        ...                                   # anything that may compile
        spent = clock.since(before)           # a CompileTotals
    """

    _instance: CompileClock | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._totals = CompileTotals()
        self._mutex = threading.Lock()
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)

    @classmethod
    def get(cls) -> CompileClock:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _add(self, **delta: float) -> None:
        with self._mutex:
            t = self._totals
            self._totals = dataclasses.replace(t, **{k: getattr(t, k) + v for k, v in delta.items()})

    def _on_duration(self, event: str, duration: float, **_: object) -> None:
        if event == _EVENT_COMPILE:
            self._add(programs=1, compile_s=duration)
        elif event == _EVENT_TRACE:
            self._add(trace_s=duration)
        elif event == _EVENT_LOWER:
            self._add(lower_s=duration)

    def _on_event(self, event: str, **_: object) -> None:
        if event == _EVENT_CACHE_HIT:
            self._add(cache_hits=1)

    def totals(self) -> CompileTotals:
        with self._mutex:
            return self._totals

    def since(self, before: CompileTotals) -> CompileTotals:
        return self.totals() - before


# ------------------------------------------------------------------------------------- ahead of time


@dataclasses.dataclass(frozen=True)
class AheadReport:
    """What `Ahead` compiled: programs, wall seconds, worker threads, and the names of jobs that failed."""

    programs: int = 0
    seconds: float = 0.0
    threads: int = 1
    failed: tuple[str, ...] = ()

    def line(self) -> str:
        bad = f", {len(self.failed)} failed ({', '.join(self.failed[:3])})" if self.failed else ""
        return f"{self.programs} programs in {self.seconds:.1f}s on {self.threads} threads{bad}"


def abstract(x: Any) -> Any:
    """An array's shape and dtype (`jax.ShapeDtypeStruct`), with its sharding where the array is committed to
    one (an uncommitted array lowers like a struct without one), for lowering a program ahead of time from
    the arguments it will be called with (`Engine.programs_ahead`, `Trainer.programs_ahead`); anything else
    as it is."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
    return x


def ahead_threads() -> int:
    """Worker threads for compiling ahead: the cores but one (the main thread goes on with its work), at
    least 1, at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) - 1))


class Ahead:
    """Compiles `jobs` ((name, job) pairs, e.g. `Engine.programs_ahead`: a job lowers its program, or
    compiles it itself) on `threads` worker threads, in
    the background: the caller goes on, and a program it calls while a worker compiles it waits for that
    compile instead of compiling it twice (JAX's caches). XLA compiles with the GIL released.

        ahead = Ahead(jobs).start()
        ...                                   # the run's own work
        report = ahead.wait()                 # an AheadReport; logged when the last job ends

    A job that raises is logged and named in the report; the others still run (the run itself then compiles
    that program when it calls it, and reports its error there)."""

    def __init__(self, jobs: list[tuple[str, Any]], threads: int | None = None, what: str = "programs"):
        self.jobs = list(jobs)
        self.threads = max(1, int(threads or ahead_threads()))
        self.what = what
        self._report: AheadReport | None = None
        self._thread = threading.Thread(target=self._run, name="compile-ahead", daemon=True)

    def start(self) -> Ahead:
        self._thread.start()
        return self

    def run(self) -> AheadReport:
        """Compiles every job here, now (no background thread)."""
        self._run()
        assert self._report is not None
        return self._report

    def wait(self) -> AheadReport:
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        return self._report or AheadReport(threads=self.threads)

    def _one(self, job: tuple[str, Any]) -> str | None:
        name, fn = job
        try:
            out = fn()
            if isinstance(out, jax.stages.Lowered):  # `programs_ahead` jobs lower; compiling is here
                out.compile()
        except Exception as e:  # noqa: BLE001 - reported; the run compiles it itself when it calls it
            logging.warning("compiling ahead %s failed: %s: %s", name, type(e).__name__, e)
            return name
        return None

    def _run(self) -> None:
        t = time.perf_counter()
        if self.threads == 1:
            failed = [n for n in map(self._one, self.jobs) if n]
        else:
            with concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="compile") as pool:
                failed = [n for n in pool.map(self._one, self.jobs) if n]
        self._report = AheadReport(len(self.jobs) - len(failed), time.perf_counter() - t, self.threads,
                                   tuple(failed))
        logging.info("compiled ahead: %s (%s)", self._report.line(), self.what)
