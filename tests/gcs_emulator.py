"""A Google Cloud Storage emulator on 127.0.0.1 for tests of `gs://` workdirs without a network.

`gcp-storage-emulator` (a test dependency) serves the GCS JSON API from memory; every client the library
uses for `gs://` is pointed at it by its own environment variable: gcsfs and google-cloud-storage (epath's
fsspec backend, tensorboardX) by `STORAGE_EMULATOR_HOST`, tensorstore (Orbax's arrays) by
`TENSORSTORE_GCS_HTTP_URL` with the test token `GOOGLE_AUTH_TOKEN_FOR_TESTING`. Subprocesses given
`env` (e.g. the processes of a multi-process run) write to the same buckets.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clear_client_caches() -> None:
    """gcsfs and epath cache their filesystem objects, which remember the endpoint they were made for."""
    import gcsfs
    from etils.epath import backend

    gcsfs.GCSFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()


@contextlib.contextmanager
def gcs_emulator(bucket: str = "librarian-test") -> Iterator[dict[str, str]]:
    """Runs the emulator with `bucket` while the block runs; yields the environment variables that point
    the clients at it (also set in `os.environ` for the block)."""
    from gcp_storage_emulator.server import create_server

    for name in ("gcp_storage_emulator", "gcsfs"):  # a 404 per probe of a missing object, per request
        logging.getLogger(name).setLevel(logging.CRITICAL)
    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _clear_client_caches()
    try:
        yield env
    finally:
        gc.collect()  # writers that upload on garbage collection (tensorboardX's) do it while the server runs
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _clear_client_caches()


def list_objects(prefix: str) -> list[str]:
    """The object names under `gs://<prefix>` (bucket/path), as `bucket/path/...`."""
    import gcsfs

    return sorted(gcsfs.GCSFileSystem().find(prefix.removeprefix("gs://")))
