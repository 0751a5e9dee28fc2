#!/usr/bin/env bash
# The project's test command (see README). Runs the whole suite on the CPU with 8 simulated devices, so the
# mesh tests exercise real sharding, split over 2 worker processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS=cpu
exec "$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests "$@"
