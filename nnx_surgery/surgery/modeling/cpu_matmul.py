"""A projection's bfloat16 matmul as XLA:CPU runs it fast: float32 results, and no operand contracted on its
first axis.

XLA:CPU hands a bfloat16 x bfloat16 product to a fast library only when the product's result is float32 and
neither operand is contracted over its first axis (bench/cpu_bf16_matmul.py; 2.5-5x float32 on a CPU with
bfloat16 matrix units). An einsum of two bfloat16 operands has a bfloat16 result, and autodiff's weight gradient
contracts the token axis of both operands: both run at float32's rate or below, so bfloat16 compute bought nothing
on a CPU. `projection_matmul` is the same product with its own gradient: the forward and the input gradient with
float32 results, the weight gradient on a copy of the output gradient transposed in memory. Results are rounded
to bfloat16 as before; only the accumulation order differs.

`on_cpu_target` decides per trace: the platform of the mesh being traced for (`jax.set_mesh`: a TPU slice's
devices when `--aot` compiles for one on this CPU), else this process's backend. TPU and GPU compilers handle
these products natively, and the transposed copy would cost them memory, so they keep the plain einsum.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_NT = (((1,), (1,)), ((), ()))  # x (M, I) . w (O, I) -> (M, O)
_NN = (((1,), (0,)), ((), ()))


def on_cpu_target(dtype) -> bool:
    """True for bfloat16 operands traced for a CPU (see the module docstring)."""
    if dtype != jnp.bfloat16:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return (device.platform if device is not None else jax.default_backend()) == "cpu"


def projection_product(x: jax.Array, matrix: jax.Array) -> jax.Array:
    """x (..., I) @ matrix (O, I).T, a projection's product: `projection_matmul` for bfloat16 on a CPU target,
    else the einsum."""
    if not on_cpu_target(x.dtype):
        return jnp.einsum("...I,OI->...O", x, matrix)
    return projection_matmul(x.reshape(-1, x.shape[-1]), matrix).reshape(*x.shape[:-1], matrix.shape[0])


def transposed_copy(a: jax.Array) -> jax.Array:
    """`a.T` materialised: through a trailing axis of 1, which XLA does not fold back into the next product's
    dimension numbers (a plain transpose, even behind an optimization barrier, is folded)."""
    rows, cols = a.shape
    return jnp.reshape(jnp.swapaxes(a.reshape(rows, cols, 1), 0, 1), (cols, rows))


@jax.custom_vjp
def projection_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (M, I) @ w (O, I).T -> (M, O), in x's dtype, accumulated in float32."""
    return lax.dot_general(x, w, _NT, preferred_element_type=jnp.float32).astype(x.dtype)


def _forward(x, w):
    return projection_matmul(x, w), (x, w)


def _backward(saved, grad):
    x, w = saved
    grad = grad.astype(x.dtype)
    d_x = lax.dot_general(grad, w, _NN, preferred_element_type=jnp.float32).astype(x.dtype)
    d_w = lax.dot_general(transposed_copy(grad), x, _NN, preferred_element_type=jnp.float32).astype(w.dtype)
    return d_x, d_w


projection_matmul.defvjp(_forward, _backward)
