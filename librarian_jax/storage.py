"""Where a run's outputs go: a local directory or object storage (`gs://bucket/...` on Cloud TPU, also
`s3://`, `az://`), through `etils.epath` (the path library Orbax itself uses), with plain local paths as
the fallback.

Everything a command writes under its workdir (config, split, checkpoints' bookkeeping, episode records,
summaries, reports, plots, TensorBoard events) goes through these helpers; Orbax writes the checkpoint
arrays through tensorstore, which opens `gs://` itself (its `gcs` kvstore). On a local path these are the
`os`/`open` calls they replace. `epath` serves `gs://` with `gcsfs` (fsspec) when TensorFlow is absent; a
GCS emulator works too (`STORAGE_EMULATOR_HOST` for gcsfs and google-cloud-storage,
`TENSORSTORE_GCS_HTTP_URL` for tensorstore: tests/test_storage.py).

A few consumers need a real local file (SentencePiece loads its model with a C++ `open`, matplotlib's
`savefig` takes a file object here): `local_cache_dir` gives a local directory for such a remote path, and
files are copied with `copy_file`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
from collections.abc import Iterator
from typing import IO, Any

from etils import epath

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

PathLike = str | os.PathLike[str]


def is_remote(path: PathLike) -> bool:
    """True for a URL such as `gs://bucket/dir` (object storage), False for a local path."""
    return bool(_SCHEME.match(os.fspath(path)))


def path(p: PathLike) -> epath.Path:
    """`p` as an `epath.Path` (local paths made absolute, as `os.path.abspath` did)."""
    p = os.fspath(p)
    return epath.Path(p if is_remote(p) else os.path.abspath(p))


def join(base: PathLike, *parts: str) -> str:
    """`os.path.join` that keeps `gs://` intact."""
    base = os.fspath(base)
    if not is_remote(base):
        return os.path.join(base, *parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def abspath(p: PathLike) -> str:
    """An absolute local path, or the URL unchanged."""
    p = os.fspath(p)
    return p.rstrip("/") if is_remote(p) else os.path.abspath(p)


def basename(p: PathLike) -> str:
    return os.fspath(p).rstrip("/").rsplit("/", 1)[-1]


def dirname(p: PathLike) -> str:
    p = os.fspath(p)
    return p.rstrip("/").rsplit("/", 1)[0] if is_remote(p) else os.path.dirname(p)


def makedirs(p: PathLike) -> None:
    """Creates the directory (and parents); object storage has no directories, so nothing is written."""
    path(p).mkdir(parents=True, exist_ok=True)


def exists(p: PathLike) -> bool:
    return path(p).exists()


def isdir(p: PathLike) -> bool:
    return path(p).is_dir()


def isfile(p: PathLike) -> bool:
    q = path(p)
    return q.exists() and not q.is_dir()


def listdir(p: PathLike) -> list[str]:
    """The names in directory `p` (empty when it does not exist), sorted."""
    q = path(p)
    if not q.is_dir():
        return []
    return sorted(c.name for c in q.iterdir())


def open_file(p: PathLike, mode: str = "r") -> IO[Any]:
    """`open(p, mode)`; writing creates the parent directory. Text modes are UTF-8."""
    if any(c in mode for c in "wax"):
        makedirs(dirname(p) or ".")
    q = path(p)
    if is_remote(p):
        return q.open(mode)  # epath's backends: text modes are UTF-8
    return open(q, mode, encoding=None if "b" in mode else "utf-8")


def write_text(p: PathLike, text: str) -> None:
    with open_file(p, "w") as f:
        f.write(text)


def read_text(p: PathLike) -> str:
    with open_file(p, "r") as f:
        return f.read()


def copy_file(src: PathLike, dst: PathLike) -> None:
    """Copies one file between any two of local disk and object storage."""
    with open_file(src, "rb") as fin, open_file(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)


def move(src: PathLike, dst: PathLike) -> None:
    """Moves a file or a directory tree (object storage: copies every object, then deletes them)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not is_remote(src) and not is_remote(dst):
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        shutil.move(src, dst)
        return
    q = path(src)
    if not q.is_dir():
        copy_file(src, dst)
        q.unlink()
        return
    for f in _files(q):
        copy_file(f, join(dst, *f.relative_to(q).parts))
    q.rmtree()


def _files(q: epath.Path) -> Iterator[epath.Path]:
    for c in q.iterdir():
        if c.is_dir():
            yield from _files(c)
        else:
            yield c


def rmtree(p: PathLike) -> None:
    q = path(p)
    if q.exists():
        q.rmtree()


@contextlib.contextmanager
def writing(p: PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file object to write `p` with, for writers that want a seekable buffer (matplotlib's `savefig`):
    local paths directly, remote ones through memory, uploaded on exit."""
    if not is_remote(p):
        with open_file(p, mode) as f:
            yield f
        return
    buf: io.BytesIO | io.StringIO = io.BytesIO() if "b" in mode else io.StringIO()
    yield buf
    with open_file(p, mode) as f:
        f.write(buf.getvalue())


def local_cache_dir(p: PathLike, purpose: str) -> str:
    """A local directory standing in for remote directory `p` for files that must be local (e.g. a
    SentencePiece model): `p` itself when local, else `$LIBRARIAN_JAX_LOCAL_CACHE` (default
    `~/.cache/librarian_jax/remote`)/`<purpose>-<hash of p>`."""
    p = os.fspath(p)
    if not is_remote(p):
        return p
    root = os.environ.get("LIBRARIAN_JAX_LOCAL_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "librarian_jax", "remote"))
    out = os.path.join(root, f"{purpose}-{hashlib.sha256(p.encode()).hexdigest()[:16]}")
    os.makedirs(out, exist_ok=True)
    return out
