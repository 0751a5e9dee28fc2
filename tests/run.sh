#!/usr/bin/env bash
# The project's test command (README). 8 simulated CPU devices so mesh tests exercise real sharding.
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS=cpu
python -m pytest -n 2 --dist loadfile tests "$@"
