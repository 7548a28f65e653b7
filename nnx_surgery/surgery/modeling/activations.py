"""Where activations live on a mesh: the residual stream split over the batch by the mesh's data axes.

Parameters are placed by the rules table (sharding.py: "embed" over fsdp). Left to itself, XLA's sharding
propagation lets the parameters decide the activations too: the embedding lookup of a table split over its hidden
axis comes out split over the hidden axis, so every device then holds and computes every row of the batch (a
tensor-parallel layout over fsdp), and so do the layers after it and the logit loss. Pinning the residual stream
(after the embedding and after each layer) to batch rows over the data axes keeps the FSDP layout: each device
computes its own rows and gathers the weights of one layer at a time. Without a mesh in context it is the identity.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

DATA_AXES = ("data", "fsdp")  # mesh axes that split the batch (as distill.mesh.DATA_AXES)


def row_axes(mesh, rows: int) -> tuple[list[str], int]:
    """(the data axes of `mesh` that split `rows` rows, in order, and how many parts they make together)."""
    sizes, used, split = dict(zip(mesh.axis_names, mesh.axis_sizes)), [], 1
    for axis in DATA_AXES:
        if sizes.get(axis, 1) > 1 and rows % (split * sizes[axis]) == 0:
            used.append(axis)
            split *= sizes[axis]
    return used, split


def batch_sharded(x: jax.Array) -> jax.Array:
    """`x` (B, ...) constrained to rows split over the data axes of the mesh in context that divide B."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    used, _ = row_axes(mesh, x.shape[0])
    if not used:
        return x
    spec = PartitionSpec(tuple(used) if len(used) > 1 else used[0], *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


__all__ = ["batch_sharded", "row_axes", "DATA_AXES"]
