"""distill.fingerprints: the digests that show two phases paired (same weights, same batches, same order)."""
from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery import distill
from recipe_env import with_host_devices


class Tiny(nnx.Module):
    def __init__(self, seed: int = 0, dtype=jnp.float32):
        rngs = nnx.Rngs(seed)
        self.first = nnx.Linear(6, 8, rngs=rngs, param_dtype=dtype)
        self.second = nnx.Linear(8, 3, rngs=rngs, param_dtype=dtype)


def test_weights_digest_is_equal_for_equal_weights_and_changes_with_any_one_bit():
    model, again = Tiny(), Tiny()
    digest = distill.weights_digest(model)
    assert len(digest) == 16 and digest == distill.weights_digest(again)
    assert distill.weights_digest(Tiny(seed=1)) != digest
    kernel = np.asarray(model.second.kernel[...])
    for index in [(0, 0), (7, 2), (3, 1)]:  # the lowest bit of one element, anywhere
        flipped = kernel.copy()
        flipped.view(np.uint32)[index] ^= 1
        model.second.kernel[...] = jnp.asarray(flipped)
        assert distill.weights_digest(model) != digest, index
    model.second.kernel[...] = jnp.asarray(kernel)
    assert distill.weights_digest(model) == digest
    # two elements swapped: the same values elsewhere are not the same weights
    swapped = kernel.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    model.second.kernel[...] = jnp.asarray(swapped)
    assert distill.weights_digest(model) != digest


def test_weights_digest_names_dtype_and_path_too():
    assert distill.weights_digest(Tiny(dtype=jnp.bfloat16)) != distill.weights_digest(Tiny())
    bf16 = Tiny(dtype=jnp.bfloat16)
    digest = distill.weights_digest(bf16)
    bits = np.asarray(bf16.first.bias[...]).view(np.uint16).copy()
    bits[5] ^= 1
    bf16.first.bias[...] = jnp.asarray(bits.view(jnp.bfloat16))
    assert distill.weights_digest(bf16) != digest


def test_weights_digest_of_a_sharded_model_is_the_unsharded_ones():
    """Computed on the devices: a model sharded over a mesh gives the digest of the same weights on one device."""
    script = """
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from nnx_surgery import distill
model = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
whole = distill.weights_digest(model)
mesh = Mesh(jax.devices(), ("fsdp",))
state = nnx.state(model)
sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp") if x.ndim else P())), state)
nnx.update(model, sharded)
assert len(model.kernel[...].sharding.device_set) == 4
print(whole, distill.weights_digest(model))
"""
    env = {**os.environ, "XLA_FLAGS": with_host_devices(4), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, sharded = proc.stdout.split()
    assert whole == sharded


def test_batch_digest_names_ids_and_mask_in_order():
    ids = np.arange(24, dtype=np.int32).reshape(1, 4, 6)
    mask = np.ones((1, 4, 6), np.float32)
    digest = distill.batch_digest({"input_ids": ids, "loss_mask": mask})
    assert digest == distill.batch_digest({"input_ids": ids.copy(), "loss_mask": mask.copy(), "positions": ids})
    assert digest != distill.batch_digest({"input_ids": ids[:, ::-1], "loss_mask": mask})  # rows reordered
    other = mask.copy()
    other[0, 1, 2] = 0
    assert digest != distill.batch_digest({"input_ids": ids, "loss_mask": other})
    assert distill.batch_digest({"input_ids": ids}) != digest  # a batch without a mask is still named


def test_compare_sequences_counts_the_leading_agreement():
    assert distill.compare_sequences(["a", "b"], ["a", "b"]) == {"same": True, "agreeing_steps": 2, "steps": [2, 2]}
    assert distill.compare_sequences(["a", "b", "c"], ["a", "x", "c"])["agreeing_steps"] == 1
    shorter = distill.compare_sequences(["a", "b"], ["a", "b", "c"])
    assert not shorter["same"] and shorter["agreeing_steps"] == 2
    assert distill.sequence_digest(["a", "b"]) != distill.sequence_digest(["b", "a"])

