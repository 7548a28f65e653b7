"""The splash attention kernel (surgery.modeling.splash), interpreted on the CPU, against the XLA path of the same
model: logits and gradients of packed rows with padding, sliding-window and global layers, attention soft-cap and
grouped key/value heads; and where it does not apply, the XLA path unchanged."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_surgery.surgery.modeling.causal_lm import create_model
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.positions import segment_positions
from nnx_surgery.surgery.modeling import splash

LENGTH = 256


def _config(model_type: str) -> ModelConfig:
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128)
    if model_type == "gemma2":  # soft-capped attention, sliding window on every other layer
        return ModelConfig.from_hf_dict(dict(model_type="gemma2", query_pre_attn_scalar=128, sliding_window=40,
                                             attn_logit_softcapping=20.0, final_logit_softcapping=15.0, **common))
    return ModelConfig.from_hf_dict(dict(model_type="gemma3_text", query_pre_attn_scalar=128, sliding_window=40,
                                         layer_types=["sliding_attention", "full_attention"], **common))


def _packed_rows(rows: int = 2):
    """Rows of three documents each, the last row ending in padding (segment 0)."""
    rng = np.random.default_rng(0)
    segments = np.zeros((rows, LENGTH), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(20, LENGTH - 30), 2, replace=False))
        segments[r] = 1 + (np.arange(LENGTH) >= cuts[0]) + (np.arange(LENGTH) >= cuts[1])
    segments[-1, -25:] = 0
    ids = rng.integers(3, 96, size=(rows, LENGTH)).astype(np.int32)
    segments = jnp.asarray(segments)
    return jnp.asarray(ids), segments, segment_positions(segments)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_splash_matches_the_xla_path_in_value_and_gradient(model_type):
    model = create_model(_config(model_type), seed=1)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, nnx.state(model, nnx.Param)))
    ids, segments, positions = _packed_rows()
    real = np.asarray(segments) > 0
    graph, state = nnx.split(model)

    def loss(state, kernel):
        out = nnx.merge(graph, state)(ids, positions=positions, segment_ids=segments, attention_kernel=kernel)
        logits = out.logits.astype(jnp.float32)
        return jnp.sum(jnp.where(real[..., None], jax.nn.log_softmax(logits), 0.0)[..., :7]), logits

    (value_x, logits_x), grad_x = jax.value_and_grad(loss, has_aux=True)(state, "xla")
    (value_s, logits_s), grad_s = jax.value_and_grad(loss, has_aux=True)(state, "splash_interpret")
    np.testing.assert_allclose(np.asarray(logits_s)[real], np.asarray(logits_x)[real], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(float(value_s), float(value_x), rtol=1e-5)
    for (path, gx), gs in zip(jax.tree_util.tree_leaves_with_path(grad_x), jax.tree.leaves(grad_s)):
        scale = float(jnp.max(jnp.abs(gx))) + 1e-6
        assert float(jnp.max(jnp.abs(gs - gx))) <= 1e-3 * scale, jax.tree_util.keystr(path)


def test_the_kernel_applies_only_where_its_masks_are_the_dense_ones():
    model = create_model(_config("gemma3_text"), seed=2)
    ids, segments, positions = _packed_rows()
    dense = model(ids, positions=positions, segment_ids=segments).logits
    for kwargs in (dict(positions=positions), dict(capture=("attention_probs",), positions=positions,
                                                    segment_ids=segments)):
        # positions without documents may be anything (left padding): the dense path; so with probabilities asked
        out = model(ids, attention_kernel="splash", **kwargs)
        reference = model(ids, **kwargs)
        np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(reference.logits))
    assert not splash.applies(LENGTH - 8, 128) and not splash.applies(LENGTH, 96) and splash.applies(LENGTH, 256)
    with pytest.raises(ValueError, match="attention_kernel='flash' unknown"):
        model(ids, segment_ids=segments, attention_kernel="flash")
    assert dense.shape == (2, LENGTH, 96)


def test_a_kernel_made_in_one_trace_serves_the_next():
    """The kernel for a shape is made once (its mask tables as concrete arrays): a second jitted function of the
    same shape reuses it without leaking the first trace's values, and its gradient traces too."""
    q = jnp.ones((1, 128, 2, 128), jnp.float32)
    k = jnp.ones((1, 128, 1, 128), jnp.float32)
    mask = splash.SegmentMask(jnp.ones((1, 128), jnp.int32), None, True)
    attend = lambda q: splash.splash_attention(q, k, k, mask, scale=0.1, softcap=None, interpret=True)
    first = jax.jit(attend)(q)
    second = jax.jit(lambda q: 2.0 * attend(q))(q)
    np.testing.assert_allclose(np.asarray(second), 2.0 * np.asarray(first))
    assert np.isfinite(float(jax.jit(jax.grad(lambda q: attend(q).sum()))(q).sum()))


MESH_RUN = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, {here!r})
import test_splash as t
from nnx_surgery.surgery.modeling.causal_lm import create_model
mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
model = create_model(t._config("gemma3_text"), seed=4)
ids, segments, positions = t._packed_rows(rows=4)
out = {{}}
with jax.set_mesh(mesh):
    for kernel in ("xla", "splash_interpret"):
        f = jax.jit(lambda ids, s, p: model(ids, positions=p, segment_ids=s, attention_kernel=kernel).logits)
        out[kernel] = np.asarray(f(ids, segments, positions))
real = np.asarray(segments) > 0
print(json.dumps(float(np.max(np.abs(out["xla"] - out["splash_interpret"])[real]))))
"""


def test_each_device_attends_its_own_rows_on_a_mesh():
    """On a mesh of two host devices splitting the batch (fsdp=2), the kernel runs per device (`jax.shard_map`
    over the data axes) and gives the XLA path's logits."""
    here = os.path.dirname(os.path.abspath(__file__))
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    done = subprocess.run([sys.executable, "-c", MESH_RUN.format(here=here)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "XLA_FLAGS": flags})
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) <= 2e-4
