"""Device meshes over the named axes ``(data, fsdp, tensor)``, plus ``expert`` when asked for.

The same code builds a mesh on 1 CPU device, 8 simulated CPU devices, a GPU node or a TPU slice: the shape
comes from a config mapping such as ``{"data": -1, "fsdp": 1, "tensor": 1}`` where one ``-1`` takes all
remaining devices. ``{"data": 2, "expert": 4}`` adds the expert-parallel axis (MoE layers split their routed
experts over it, see ``models/moe.py``); a shape that does not name ``expert`` builds the same 3-axis mesh as
before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")
OPTIONAL_AXES: tuple[str, ...] = ("expert",)
"""Axes a mesh has only when its shape names them (so every 3-axis mesh and config stays as it was)."""


def resolve_mesh_shape(shape: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Fills the ``-1`` entry of ``shape`` and checks the product equals ``num_devices``.

    Args:
      shape: axis name -> size; names among ``MESH_AXES``; missing axes get size 1; at most one ``-1``.
        ``None`` means ``{"data": -1}``.
      num_devices: devices the mesh must cover.
    Returns:
      ``{"data": d, "fsdp": f, "tensor": t}`` in ``MESH_AXES`` order (with ``"expert": e`` when ``shape``
      names ``expert``).
    """
    shape = dict(shape or {"data": -1})
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh.shape has unknown axis names {unknown}; allowed: {list(MESH_AXES)}")
    wanted = [n for n in MESH_AXES if n not in OPTIONAL_AXES or n in shape]
    sizes = {name: int(shape.get(name, 1)) for name in wanted}
    wild = [n for n, s in sizes.items() if s == -1]
    if len(wild) > 1:
        raise ValueError(f"mesh.shape {shape}: at most one axis may be -1, got {wild}")
    bad = [n for n, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh.shape {shape}: axis sizes must be positive or -1, bad axes {bad}")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if wild:
        if num_devices % fixed:
            raise ValueError(f"mesh.shape {shape}: {num_devices} devices not divisible by {fixed}")
        sizes[wild[0]] = num_devices // fixed
    total = int(np.prod(list(sizes.values())))
    if total != num_devices:
        raise ValueError(f"mesh.shape {shape} covers {total} devices but {num_devices} are available")
    return sizes


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``("data", "fsdp", "tensor")`` (``("data", "fsdp", "expert", "tensor")``
    when ``shape`` names ``expert``).

    Args:
      shape: see ``resolve_mesh_shape``; e.g. ``{"data": -1, "fsdp": 1, "tensor": 1}``.
      devices: devices to use (default: all of ``jax.devices()``).
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(shape, len(devices))
    names = tuple(n for n in MESH_AXES if n in sizes)
    axis_shape = tuple(sizes[n] for n in names)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(axis_shape, devices=devices)
    except Exception as err:  # noqa: BLE001 - topology-unaware fallback (e.g. odd CPU device counts)
        logging.debug("mesh_utils.create_device_mesh failed (%s); using device order", err)
        grid = np.asarray(devices, dtype=object).reshape(axis_shape)
    logging.info("mesh %s over %d %s devices", sizes, len(devices), devices[0].platform)
    return Mesh(grid, names)
