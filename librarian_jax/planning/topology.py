"""Cloud TPU slices by the accelerator type a user creates, their chips' published figures, and their devices
as the TPU compiler sees them on any host (no TPU needed).

    accel = parse("v5p-64")        # Accelerator(generation="v5p", chips=32, topology="v5p:2x4x4", ...)
    devices = accel.devices()      # 32 TPU v5 devices of a compile-only client, 8 hosts of 4
    CHIPS["v5p"].hbm_bytes         # 95 GiB a chip; peak bf16 FLOP/s, HBM bytes/s

Accelerator types count as Cloud TPU counts them: TensorCores for v4, v5p and TPU7x (two a chip: `v5p-128` is
64 chips), chips for v5e (`v5litepod-N`, also `v5e-N`) and v6e (`v6e-N`). An explicit topology
(`v5p:4x4x4`, `v6e:8x8`) is taken as it is. The devices come from `jax.experimental.topologies`, which needs
the TPU compiler (`pip install -e '.[tpu]'`, or the test extra): programs lowered with shardings over them
compile for that slice, and `memory_analysis()` / `cost_analysis()` report per device. v4 compiles as
megacore (one device a chip, as JAX runs it); TPU7x as two devices a chip (each TensorCore one device).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's published figures (Cloud TPU documentation, December 2026): HBM bytes, peak dense bf16
    FLOP/s and HBM bytes/s; `cores`: TensorCores a chip (the unit v4 / v5p / TPU7x accelerator types
    count); `dims`: the torus's dimensions (3 for v4 / v5p / TPU7x, 2 for v5e / v6e)."""

    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    cores: int
    dims: int
    config: str = ""  # the compiler's chip config ("megacore": one device a chip)


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9, cores=2, dims=3, config="megacore"),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, cores=1, dims=2),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, cores=2, dims=3),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1638e9, cores=1, dims=2),
    "tpu7x": Chip("tpu7x", 192 * GiB, 2307e12, 7380e9, cores=2, dims=3),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v7x": "tpu7x", "ironwood": "tpu7x"}


class TopologyError(ValueError):
    """An accelerator type or topology this module cannot resolve (the message names it and what is known)."""


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """A slice: `name` as asked, its chip generation, chip count and compiler topology (`v5p:2x4x4`)."""

    name: str
    generation: str
    chips: int
    topology: str

    @property
    def chip(self) -> Chip:
        return CHIPS[self.generation]

    def devices(self) -> list[Any]:
        """The slice's devices (a compile-only TPU client; cached per topology), ordered by id."""
        return list(_devices(self.topology, self.chip.config))

    def devices_per_chip(self) -> int:
        return max(1, len(self.devices()) // self.chips)

    def hbm_per_device(self) -> int:
        return self.chip.hbm_bytes // self.devices_per_chip()

    def hosts(self) -> int:
        return len({d.process_index for d in self.devices()})

    def describe(self) -> str:
        c = self.chip
        return (f"{self.name}: {self.chips} {c.name} chips ({self.topology}, {self.hosts()} hosts, "
                f"{len(self.devices())} devices), {c.hbm_bytes / GiB:.0f} GiB HBM, "
                f"{c.peak_flops / 1e12:.0f} TFLOP/s bf16, {c.hbm_bandwidth / 1e9:.0f} GB/s a chip")


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice shape of `chips` chips: a power of two split as evenly as possible, smallest first
    (3-D: 4 -> 2x2x1, 8 -> 2x2x2, 32 -> 2x4x4, 64 -> 4x4x4; 2-D: 8 -> 2x4, 64 -> 8x8, 256 -> 16x16)."""
    if chips < 1 or chips & (chips - 1):
        raise TopologyError(f"{chips} chips: slices here are powers of two; give a topology such as "
                            f"'v5p:2x2x3' for another shape")
    if dims == 3 and chips < 4:
        raise TopologyError(f"{chips} chips: a 3-D slice has at least 4 (2x2x1)")
    k = int(math.log2(chips))
    exps = [k // dims + (1 if i < k % dims else 0) for i in range(dims)]
    shape = sorted(2**e for e in exps)
    if dims == 3 and shape[0] == 1:  # 4 chips: 2x2x1, the way Cloud TPU writes it
        shape = [2, 2, 1]
    return tuple(shape)


def parse(name: str) -> Accelerator:
    """The slice `name` names: an accelerator type (`v5p-8`, `v5p-128`, `v6e-64`, `v5litepod-256`, `v4-32`,
    `tpu7x-16`) or a compiler topology (`v5p:4x4x4`, `v6e:8x8`)."""
    text = str(name).strip().lower()
    m = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", text)
    if m:
        gen = _ALIASES.get(m.group(1), m.group(1))
        if gen not in CHIPS:
            raise TopologyError(f"topology {name!r}: unknown TPU generation {m.group(1)!r}; known: "
                                f"{sorted(CHIPS)}")
        dims = [int(x) for x in m.group(2).split("x")]
        return Accelerator(str(name), gen, math.prod(dims), f"{gen}:{m.group(2)}")
    m = re.fullmatch(r"([a-z0-9]+?)-(\d+)", text)
    if not m:
        raise TopologyError(f"topology {name!r}: expected an accelerator type such as 'v5p-8', 'v6e-64', "
                            f"'v5litepod-256', or a topology such as 'v5p:2x2x1'")
    gen = _ALIASES.get(m.group(1), m.group(1))
    if gen not in CHIPS:
        raise TopologyError(f"topology {name!r}: unknown TPU generation {m.group(1)!r}; known: "
                            f"{sorted(CHIPS)} (and {sorted(_ALIASES)})")
    chip, count = CHIPS[gen], int(m.group(2))
    if count % chip.cores:
        raise TopologyError(f"topology {name!r}: a {gen} accelerator type counts TensorCores, "
                            f"{chip.cores} a chip; {count} is not a multiple")
    chips = count // chip.cores
    return Accelerator(str(name), gen, chips, f"{gen}:{'x'.join(map(str, _grid(chips, chip.dims)))}")


# A plan is made on a host without a TPU: libtpu must neither look for the TPU VM's metadata server (and
# print its warnings) nor take its single-process lock file (two planning processes, the test suite's
# workers, may compile at once).
_COMPILE_ONLY_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1",
                     "TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}


@functools.lru_cache(maxsize=16)
def _devices(topology: str, config: str) -> tuple[Any, ...]:
    for k, v in _COMPILE_ONLY_ENV.items():
        os.environ.setdefault(k, v)
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - jax always ships it
        raise TopologyError(f"jax.experimental.topologies is missing: {e}") from e
    kwargs = {"chip_config_name": config} if config else {}
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
    except Exception as e:  # noqa: BLE001 - libtpu missing or the topology unknown: one line naming it
        hint = compiler_hint(has_libtpu())
        raise TopologyError(f"topology {topology!r}: the TPU compiler could not describe it{hint}: "
                            f"{str(e).splitlines()[0][:300]}") from e
    return tuple(sorted(desc.devices, key=lambda d: d.id))


def has_libtpu() -> bool:
    """Whether the TPU compiler (the `libtpu` package, `pip install -e '.[tpu]'`) is installed here."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def compiler_hint(installed: bool) -> str:
    """What a failed topology lookup adds to its message: how to install the compiler when it is missing."""
    return "" if installed else (" (the TPU compiler is not installed: pip install -e '.[tpu]', "
                                 "matching this jax)")
