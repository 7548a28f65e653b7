"""The projections' bfloat16 matmul on a CPU (surgery/modeling/cpu_matmul.py): the same product and gradients as
the plain einsum, on every CPU trace in bfloat16 and on no other (float32, or a mesh of TPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType

from nnx_surgery.surgery.modeling import cpu_matmul
from nnx_surgery.surgery.modeling.causal_lm import create_model
from nnx_surgery.surgery.modeling.cpu_matmul import on_cpu_target, projection_matmul, transposed_copy

from distill_fixtures import tiny_config

BF16 = jnp.bfloat16


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_product_and_gradients_match_autodiff_of_the_float32_product():
    """Forward and both gradients against autodiff of the float32 product of the same bfloat16 values: equal up
    to bfloat16 rounding of the result (the accumulation is float32 in both)."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (24, 40)).astype(BF16)
    w = jax.random.normal(kw, (56, 40)).astype(BF16)
    cotangent = jax.random.normal(kg, (24, 56)).astype(BF16)
    reference = lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32).T
    out, pullback = jax.vjp(projection_matmul, x, w)
    want, want_pullback = jax.vjp(reference, x, w)
    assert out.dtype == BF16 and out.shape == (24, 56)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want.astype(BF16), np.float32))
    for got, expected in zip(pullback(cotangent), want_pullback(cotangent.astype(jnp.float32))):
        assert got.dtype == BF16
        assert _relative(got, expected) < 1e-2
    np.testing.assert_array_equal(transposed_copy(x), x.T)


def test_used_for_bfloat16_on_this_cpu_only():
    assert on_cpu_target(BF16) and not on_cpu_target(jnp.float32)
    tpu = AbstractMesh((1,), ("fsdp",), axis_types=(AxisType.Auto,),
                       abstract_device=AbstractDevice("TPU v5 lite", 1, "tpu"))
    with jax.sharding.use_abstract_mesh(tpu):  # what --aot traces under for a TPU slice
        assert not on_cpu_target(BF16)
    cpu = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(cpu):
        assert on_cpu_target(BF16)


def _model_loss_and_grads(model, ids):
    graph, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graph, params)(ids).logits
        return jnp.mean(logits.astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss)(params), str(jax.make_jaxpr(loss)(params))


def test_a_bfloat16_model_trains_the_same_through_it(monkeypatch):
    """A tiny Gemma 2 in bfloat16: loss and gradients through the CPU matmul against the plain einsum (both
    round to bfloat16 at the same places; only the accumulation order differs)."""
    model = create_model(tiny_config(2), seed=0)
    nnx.update(model, jax.tree.map(lambda x: x.astype(BF16), nnx.state(model, nnx.Param)))
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, tiny_config(2).vocab_size)
    (loss, grads), program = _model_loss_and_grads(model, ids)
    assert program.count("custom_vjp_call") == 2 * 7  # seven projections in each of the two layers
    monkeypatch.setattr(cpu_matmul, "on_cpu_target", lambda dtype: False)
    (plain_loss, plain_grads), plain_program = _model_loss_and_grads(model, ids)
    assert "custom_vjp_call" not in plain_program
    assert float(loss) == pytest.approx(float(plain_loss), rel=1e-2)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        if np.any(np.asarray(want, np.float32)):
            assert _relative(got, want) < 5e-2
