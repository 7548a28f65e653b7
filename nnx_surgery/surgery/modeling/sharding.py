"""Where parameters live on a mesh: logical axis names, one rules table, one helper (as MaxText does it).

Parameters name their axes logically (`("vocab", "embed")`, `("heads", "head_dim", "embed")`, see schema.py);
`RULES` maps each logical axis to a mesh axis: "fsdp" shards the hidden side, "tp" shards heads, MLP width and
vocabulary. A mesh axis the mesh lacks, or one that does not divide the dimension, leaves it unsharded (one KV
head over tp=2 stays replicated). Everything that places parameters (creation under a mesh, streaming loads,
the surgery, `distill`'s `shard_model` through `model.shardings(mesh)`) goes through `fitted_spec`.
"""
from __future__ import annotations

from typing import Mapping

import jax
from flax import nnx

RULES: Mapping[str, str | None] = {"vocab": "tp", "embed": "fsdp", "mlp": "tp", "heads": "tp", "kv_heads": "tp",
                                   "head_dim": None}


def mesh_axes(logical: tuple[str | None, ...], rules: Mapping[str, str | None] = RULES) -> tuple[str | None, ...]:
    """The mesh axis each logical axis maps to (None: replicated)."""
    return tuple(rules.get(axis) if axis is not None else None for axis in logical)


def fitted_spec(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh=None) -> tuple[str | None, ...]:
    """Mesh axis names for a tensor (`axes` already mesh axes), dropping axes the mesh lacks or that do not divide
    the dimension. `mesh` defaults to the abstract mesh in context."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if mesh is not None and not mesh.empty else {}
    return tuple(a if a in sizes and dim % sizes[a] == 0 else None for dim, a in zip(shape, axes))


def variable_mesh_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    meta = variable.get_metadata()
    axes = meta.get("mesh_axes")
    if axes is None:
        axes = meta.get("out_sharding") or (None,) * len(variable.shape)
    return tuple(axes)


def parameter_sharding(variable: nnx.Variable, mesh) -> jax.sharding.Sharding:
    """Where one parameter lives: a NamedSharding from its mesh axes on `mesh`, else the default device."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    spec = fitted_spec(tuple(variable.shape), variable_mesh_axes(variable), mesh)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def model_shardings(model: nnx.Module, mesh) -> nnx.State:
    """`nnx.state(model)` with a NamedSharding in place of every array: the one answer to "where does each
    parameter go on `mesh`" (variables without mesh axes are replicated)."""
    def sharding(variable):
        if isinstance(variable, nnx.Variable) and hasattr(variable.get_value(), "shape"):
            return parameter_sharding(variable, mesh)
        return variable
    return jax.tree.map(sharding, nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))


__all__ = ["RULES", "mesh_axes", "fitted_spec", "parameter_sharding", "model_shardings", "variable_mesh_axes"]
