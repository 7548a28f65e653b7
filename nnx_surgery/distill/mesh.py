"""Device meshes for distillation: parsing "fsdp=4,tp=2", placing models and batches (multi-host start:
distributed.py).

Meshes always use Auto axis types (GSPMD propagation): jax 0.10's `jax.make_mesh` defaults to Explicit axes, under
which the models' row-parallel matmuls fail. Where a parameter lives is the model's answer, not this module's:
`shard_model` places every variable with `model.shardings(mesh)` (the DistillModel contract, interface.py), and a
model without that method is replicated. Batches are split over the data axes ("data", "fsdp") that divide the
batch.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .distributed import initialize_distributed  # noqa: F401  (re-exported: the multi-host start lives there)

log = logging.getLogger("distill")
DATA_AXES = ("data", "fsdp")


class MeshError(ValueError):
    """A mesh that does not fit the devices, the model or the batch: says which sizes would."""


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """"fsdp=4,tp=2" or {"fsdp": 4, "tp": 2} -> ordered {axis: size}; anything else is a MeshError."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = [part.strip().partition("=")[::2] for part in spec.split(",") if part.strip()]
    else:
        raise MeshError(f"mesh {spec!r}: give a string like 'fsdp=4,tp=2', a dict of axis sizes or a jax Mesh.")
    sizes: dict[str, int] = {}
    for name, size in items:
        name = name.strip() if isinstance(name, str) else name
        text = size.strip() if isinstance(size, str) else size
        valid_size = (isinstance(text, str) and text.isascii() and text.isdigit()) or \
            (isinstance(text, int) and not isinstance(text, bool))
        if not isinstance(name, str) or not name.isidentifier() or not valid_size or int(text) < 1:
            raise MeshError(f"mesh spec {spec!r}: each part must look like 'axis=size' with a name and a size "
                            f">= 1, e.g. 'fsdp=4,tp=2'; got {name!r}={size!r}.")
        if name in sizes:
            raise MeshError(f"mesh spec {spec!r} names axis {name!r} twice.")
        sizes[name] = int(text)
    if not sizes:
        raise MeshError(f"mesh spec {spec!r} names no axis; e.g. 'fsdp=8' or 'fsdp=4,tp=2'.")
    return sizes


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{name}={size}" for name, size in sizes.items())


def sizes_using(axes: list[str], count: int, like: Mapping[str, int] | None = None, limit: int = 4) -> list[str]:
    """Up to `limit` mesh specs over `axes` whose sizes multiply to `count`, those closest to `like` first."""
    def splits(n: int, parts: int):
        if parts == 1:
            yield (n,)
            return
        for first in range(1, n + 1):
            if n % first == 0:
                for rest in splits(n // first, parts - 1):
                    yield (first,) + rest

    like = like or {}
    options = sorted(splits(count, len(axes)), key=lambda sizes: (
        sum(size != like.get(axis, size) for axis, size in zip(axes, sizes)), [-s for s in sizes]))
    return [format_mesh_spec(dict(zip(axes, sizes))) for sizes in options[:limit]]


def make_mesh(spec: str | Mapping[str, int] | Mesh, devices: int | list | None = None) -> Mesh:
    """A mesh with Auto axes that uses every device (all processes' devices on multi-host).

    Axis sizes must multiply to the device count: a mesh over fewer devices would leave the rest idle, so it is
    a MeshError that lists the sizes that use them all. To run on a subset on purpose, pass `devices`: a count
    (the first `devices` devices) or a list of devices; the subset is logged."""
    if isinstance(spec, Mesh):
        return spec
    sizes = parse_mesh_spec(spec)
    available = list(jax.devices())
    needed = int(np.prod(list(sizes.values())))
    if devices is None:
        chosen = available
    elif isinstance(devices, bool):
        raise MeshError(f"devices={devices}: give a number of devices or a list of them.")
    elif isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise MeshError(f"devices={devices}: there are {len(available)} device(s); ask for 1 to "
                            f"{len(available)}.")
        chosen = available[:devices]
    else:
        chosen = list(devices)
    if needed > len(available) or (devices is None and needed != len(chosen)):
        hint = f"; sizes that use all of them: {', '.join(sizes_using(list(sizes), len(available), sizes))}"
        subset = (f", or pass devices={needed} (DistillConfig(mesh_devices={needed})) to run on {needed} of them "
                  "on purpose") if needed < len(available) else \
            f" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={needed} before importing jax)"
        raise MeshError(f"mesh {format_mesh_spec(sizes)} uses {needed} device(s) but there are {len(available)}"
                        f"{hint}{subset}.")
    if needed != len(chosen):
        raise MeshError(f"mesh {format_mesh_spec(sizes)} uses {needed} device(s) but devices= gives "
                        f"{len(chosen)}; sizes that use them all: "
                        f"{', '.join(sizes_using(list(sizes), len(chosen), sizes))}.")
    if len(chosen) < len(available):
        log.warning("mesh %s runs on %d of the %d devices, as asked (devices=%d); the other %d stay idle.",
                    format_mesh_spec(sizes), len(chosen), len(available), len(chosen),
                    len(available) - len(chosen))
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes.keys()), axis_types=(AxisType.Auto,) * len(sizes),
                         devices=chosen)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _sharding_by_path(shardings: Any) -> dict[tuple, Any]:
    """{state path: NamedSharding} of a `model.shardings(mesh)` tree (leaves NamedSharding, or Variables holding
    one)."""
    flat = nnx.to_flat_state(shardings) if isinstance(shardings, nnx.State) else \
        nnx.to_flat_state(nnx.State(shardings))
    return {path: leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf for path, leaf in flat}


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place every variable of `model` on `mesh` (in place; returns the model): where `model.shardings(mesh)`
    says when the model has that method, else replicated on every device."""
    shardings = getattr(model, "shardings", None)  # CausalLM.shardings; other modules are replicated
    wanted = _sharding_by_path(shardings(mesh)) if callable(shardings) else None
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value() if isinstance(variable, nnx.Variable) else None
        if not hasattr(value, "shape"):
            continue
        sharding = replicated(mesh) if wanted is None else wanted.get(path)
        if not isinstance(sharding, jax.sharding.Sharding):
            raise MeshError(f"{type(model).__name__}.shardings(mesh) gives no sharding for "
                            f"{'.'.join(map(str, path))}; it must return the tree of nnx.state(model) with a "
                            "NamedSharding for every array.")
        variable.set_value(jax.device_put(value, sharding))
    return model


def model_on_mesh(model: nnx.Module, mesh: Mesh) -> bool:
    leaves = jax.tree.leaves(nnx.state(model))
    return bool(leaves) and all(isinstance(getattr(leaf, "sharding", None), NamedSharding)
                                and leaf.sharding.mesh.shape == mesh.shape for leaf in leaves)


def _mesh_axes(variable: nnx.Variable) -> tuple:
    """The mesh axis each dimension of a parameter is sharded over: its `mesh_axes` metadata (the model's rules
    table applied to its logical `axes`), else the `out_sharding` that Flax's eager sharding records."""
    meta = variable.get_metadata()
    axes = meta.get("mesh_axes")
    return tuple(axes if axes is not None else meta.get("out_sharding") or ())


def data_split(mesh: Mesh) -> tuple[list[str], int]:
    """The data axes of `mesh` with more than one device, and how many ways they split a batch."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    axes = [axis for axis in DATA_AXES if sizes.get(axis, 1) > 1]
    return axes, int(np.prod([sizes[axis] for axis in axes], dtype=np.int64))


def check_batch_fits(mesh: Mesh | None, batch: int) -> None:
    """MeshError unless the data axes split `batch` evenly (otherwise every device would compute all of it)."""
    if mesh is None:
        return
    axes, split = data_split(mesh)
    if batch % split:
        multiples = ", ".join(str(split * k) for k in range(1, 4))
        raise MeshError(f"batch {batch} does not split over the mesh's data axes "
                        f"({' x '.join(axes)} = {split} devices); use a batch that is a multiple of {split} "
                        f"({multiples}, ...) or a mesh with fewer data devices.")


def check_mesh_fits(mesh: Mesh | None, models: Mapping[str, Any], batch: int | None = None) -> None:
    """MeshError when an axis of more than one device cannot split what it is meant to: the batch (data axes),
    or a parameter dimension named with the axis that is larger than the axis but not a multiple of it (it
    would silently stay replicated: e.g. 6 heads over tp=4). Dimensions smaller than the axis (one KV head of a
    multi-query model over tp=2) stay replicated by design."""
    if mesh is None:
        return
    if batch is not None:
        check_batch_fits(mesh, batch)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    for role, model in models.items():
        if model is None:
            continue
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            for dim, axis in zip(tuple(variable.shape), _mesh_axes(variable)):
                size = sizes.get(axis, 1) if isinstance(axis, str) else 1
                if size > 1 and dim > size and dim % size:
                    fits = [d for d in range(2, dim + 1) if dim % d == 0][:6]
                    raise MeshError(f"mesh axis {axis}={size} does not divide dimension {dim} of the {role}'s "
                                    f"{'.'.join(map(str, path))} (shape {tuple(variable.shape)}), which it shards; "
                                    f"use {axis} = 1 or a divisor of {dim} ({', '.join(map(str, fits))}).")


def batch_spec(mesh: Mesh | AbstractMesh | None, batch: int, leading: int = 0) -> PartitionSpec:
    """Batch axis split over the data axes of the mesh that divide it (in order), leaving the rest replicated;
    `leading` extra unsharded leading dims (e.g. micro-batches)."""
    if mesh is None:
        return PartitionSpec()
    used, size = [], 1
    for axis in DATA_AXES:
        if axis in mesh.axis_names:
            axis_size = dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]
            if batch % (size * axis_size) == 0:
                used.append(axis)
                size *= axis_size
    data = tuple(used) if len(used) > 1 else (used[0] if used else None)
    return PartitionSpec(*([None] * leading), data)


@functools.lru_cache(maxsize=64)
def rows_stay_on_their_process(mesh: Mesh, rows: int) -> bool:
    """Whether `mesh`'s data axes split a global batch of `rows` so that every device holds only rows of its own
    process's share (process p: rows [p * share, (p + 1) * share), share = rows / process_count), as `put_batch`
    needs. The same answer on every process (it reads the whole mesh). Cached: put_batch asks for every array of
    every step, the answer walks every device of the mesh, and the process count is fixed once JAX started."""
    processes = jax.process_count()
    if rows % processes or rows % data_split(mesh)[1]:
        return False
    share = rows // processes
    # keyed by jax.Device, an alias of a compiled class that a type checker cannot see
    indices: Mapping[Any, Any] = NamedSharding(mesh, batch_spec(mesh, rows)).devices_indices_map((rows,))
    for device, index in indices.items():
        start, stop, _ = index[0].indices(rows)
        if not device.process_index * share <= start < stop <= (device.process_index + 1) * share:
            return False
    return True


def _check_rows_per_process(sharding: NamedSharding, local_shape: tuple[int, ...], leading: int) -> None:
    """On multi-host, this process's devices must hold its own rows of the global batch: a mesh whose data axes
    do not split the processes (e.g. tp only) would replicate the rows, and each process would silently train on
    its own rows as if they were everyone's."""
    rows = local_shape[leading]
    total = rows * jax.process_count()
    if rows_stay_on_their_process(sharding.mesh, total):
        return
    held = set()
    for index in NamedSharding(sharding.mesh, batch_spec(sharding.mesh, total)).addressable_devices_indices_map(
            (total,)).values():
        held.update(range(*index[0].indices(total)))
    raise MeshError(f"mesh {format_mesh_spec(dict(sharding.mesh.shape))}: this process's devices hold {len(held)} "
                    f"rows of a {total}-row global batch but it has {rows} of its own; on multi-host the batch "
                    "must be split over a data axis (fsdp/dp) that spans the processes and divides the batch, e.g. "
                    "--mesh fsdp=<devices>.")


def put_batch(batch: dict[str, Any], mesh: Mesh | None, leading: int = 0) -> dict[str, jax.Array]:
    """Arrays of a (global) batch onto the mesh, split over the data axes. On multi-host each process passes its
    own rows and the global array is assembled with `make_array_from_process_local_data`."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if mesh is None:
            out[key] = jax.device_put(value)
            continue
        check_batch_fits(mesh, value.shape[leading] * jax.process_count())
        sharding = NamedSharding(mesh, batch_spec(mesh, value.shape[leading] * jax.process_count(), leading))
        if jax.process_count() > 1:
            _check_rows_per_process(sharding, value.shape, leading)
            out[key] = jax.make_array_from_process_local_data(sharding, value)
        else:
            out[key] = jax.device_put(value, sharding)
    return out


__all__ = ["MeshError", "make_mesh", "parse_mesh_spec", "format_mesh_spec", "sizes_using", "check_mesh_fits",
           "check_batch_fits", "shard_model", "model_on_mesh", "replicated", "batch_spec", "put_batch",
           "initialize_distributed", "DATA_AXES", "rows_stay_on_their_process"]
