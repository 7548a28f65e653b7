"""Placement on a mesh follows the model: `model.shardings(mesh)` when it has one, replicated otherwise, and the
mesh check reads each parameter's `mesh_axes` (else `out_sharding`)."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from nnx_surgery.distill.mesh import MeshError, check_mesh_fits, make_mesh, shard_model


class Plain(nnx.Module):
    """A model with no `shardings` method."""

    def __init__(self):
        self.weight = nnx.Param(jnp.ones((6, 4)))
        self.bias = nnx.Param(jnp.zeros((4,)))


class Partial(Plain):
    """A model whose `shardings` forgets a parameter."""

    def shardings(self, mesh):
        return nnx.State({"weight": NamedSharding(mesh, PartitionSpec())})


def test_a_model_without_shardings_is_replicated_and_a_partial_answer_is_refused():
    mesh = make_mesh("fsdp=1")
    model = shard_model(Plain(), mesh)
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert leaf.sharding == NamedSharding(mesh, PartitionSpec())
    with pytest.raises(MeshError, match=r"Partial.shardings\(mesh\) gives no sharding for bias"):
        shard_model(Partial(), mesh)


def test_mesh_check_reads_mesh_axes_then_out_sharding():
    tp4 = AbstractMesh((4,), ("tp",), axis_types=(AxisType.Auto,))

    class Tagged(nnx.Module):
        def __init__(self, out_sharding=None, **meta):
            self.weight = nnx.Param(jnp.ones((6, 8)), **meta)
            if out_sharding is not None:  # as Flax's eager sharding records it (set afterwards: no mesh here)
                self.weight.set_metadata("out_sharding", out_sharding)

    with pytest.raises(MeshError, match=r"tp=4 does not divide dimension 6 of the student's weight"):
        check_mesh_fits(tp4, {"student": Tagged(axes=("heads", "embed"), mesh_axes=("tp", None))})
    with pytest.raises(MeshError, match="dimension 6"):
        check_mesh_fits(tp4, {"student": Tagged(out_sharding=("tp", None))})
    # logical names alone say nothing about the mesh; mesh_axes wins over out_sharding
    check_mesh_fits(tp4, {"student": Tagged(axes=("tp", "embed"))})
    check_mesh_fits(tp4, {"student": Tagged(mesh_axes=(None, "tp"), out_sharding=("tp", None))})
