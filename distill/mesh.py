"""Device meshes for distillation: parsing "fsdp=4,tp=2", placing models and batches, multi-host start.

Meshes always use Auto axis types (GSPMD propagation): jax 0.10's `jax.make_mesh` defaults to Explicit axes, under
which the models' row-parallel matmuls fail (research/hf_nnx.md §5.1). Parameters are placed by their logical
`axes` metadata (the surgery's Gemma names them "fsdp" / "tp"); an axis the mesh lacks, or one that does not divide
the dimension, is left unsharded. Batches are split over the data axes ("data", "fsdp") that divide the batch.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger("distill")
DATA_AXES = ("data", "fsdp")


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """"fsdp=4,tp=2" or {"fsdp": 4, "tp": 2} -> ordered {axis: size}."""
    if isinstance(spec, Mapping):
        return {str(k): int(v) for k, v in spec.items()}
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.partition("=")
        if not name or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"mesh spec {spec!r}: each part must look like 'axis=size' with size >= 1, "
                             f"e.g. 'fsdp=4,tp=2'; got {part!r}.")
        sizes[name.strip()] = int(size)
    if not sizes:
        raise ValueError(f"mesh spec {spec!r} names no axis; e.g. 'fsdp=8' or 'fsdp=4,tp=2'.")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | Mesh, devices: list | None = None) -> Mesh:
    """A mesh with Auto axes over the first prod(sizes) devices (all processes' devices on multi-host)."""
    if isinstance(spec, Mesh):
        return spec
    sizes = parse_mesh_spec(spec)
    devices = list(devices if devices is not None else jax.devices())
    needed = int(np.prod(list(sizes.values())))
    if needed > len(devices):
        raise ValueError(f"mesh {sizes} needs {needed} devices but {len(devices)} are available; on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before importing jax.")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes.keys()), axis_types=(AxisType.Auto,) * len(sizes),
                         devices=devices[:needed])


def fitted_spec(shape: tuple[int, ...], axes: tuple[str | None, ...] | None, mesh: Mesh) -> PartitionSpec:
    """PartitionSpec from logical axes, dropping axes the mesh lacks or that do not divide the dimension."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    axes = tuple(axes) if axes is not None else (None,) * len(shape)
    return PartitionSpec(*(a if a in sizes and dim % sizes[a] == 0 else None for dim, a in zip(shape, axes)))


def variable_sharding(variable: nnx.Variable, mesh: Mesh) -> NamedSharding:
    meta = variable.get_metadata()
    axes = meta.get("axes") or meta.get("out_sharding") or meta.get("sharding_names")
    return NamedSharding(mesh, fitted_spec(tuple(variable.shape), axes, mesh))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place every variable of `model` on `mesh` by its `axes` metadata (in place; returns the model)."""
    state = nnx.state(model)

    def place(variable):
        if isinstance(variable, nnx.Variable) and hasattr(variable.get_value(), "shape"):
            variable.set_value(jax.device_put(variable.get_value(), variable_sharding(variable, mesh)))
        return variable

    jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return model


def model_on_mesh(model: nnx.Module, mesh: Mesh) -> bool:
    leaves = jax.tree.leaves(nnx.state(model))
    return bool(leaves) and all(isinstance(getattr(leaf, "sharding", None), NamedSharding)
                                and leaf.sharding.mesh.shape == mesh.shape for leaf in leaves)


def batch_spec(mesh: Mesh | None, batch: int, leading: int = 0) -> PartitionSpec:
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


def put_batch(batch: dict[str, Any], mesh: Mesh | None, leading: int = 0) -> dict[str, jax.Array]:
    """Arrays of a (global) batch onto the mesh, split over the data axes. On multi-host each process passes its
    own rows and the global array is assembled with `make_array_from_process_local_data`."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if mesh is None:
            out[key] = jax.device_put(value)
            continue
        sharding = NamedSharding(mesh, batch_spec(mesh, value.shape[leading] * jax.process_count(), leading))
        if jax.process_count() > 1:
            out[key] = jax.make_array_from_process_local_data(sharding, value)
        else:
            out[key] = jax.device_put(value, sharding)
    return out


def initialize_distributed(**kwargs: Any) -> bool:
    """`jax.distributed.initialize` when launched multi-host (a coordinator address in the environment or given);
    a no-op on one host. Call before anything touches devices. Returns whether it initialised."""
    markers = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
               "TPU_WORKER_HOSTNAMES")
    if not kwargs and not any(os.environ.get(m) for m in markers):
        return False
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialised: process %d of %d", jax.process_index(), jax.process_count())
    return True


__all__ = ["make_mesh", "parse_mesh_spec", "shard_model", "model_on_mesh", "batch_spec", "put_batch",
           "fitted_spec", "variable_sharding", "initialize_distributed", "DATA_AXES"]
