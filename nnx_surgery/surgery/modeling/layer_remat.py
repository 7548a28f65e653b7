"""Per-layer rematerialisation of the decoder stack (`CausalLM.__call__(..., remat=)`).

A `jax.checkpoint` around the whole forward (what a train step can do without knowing the model's layers) saves
only its inputs, but its backward pass recomputes the whole forward and then holds every layer's activations at
once: the peak is that of no remat. Checkpointing each layer on its own saves the residual stream between layers
(one (B, T, D) array per layer); the backward pass recomputes one layer at a time, so only one layer's activations
are live besides the saved stream.

Policies (`REMAT_POLICIES`):

    "layers"       each layer saves nothing inside it (`nothing_saveable`): one extra forward in the backward pass
    "layers_dots"  each layer saves its matmul outputs without batch dimensions (the projections, not the
                   attention scores; `dots_with_no_batch_dims_saveable`): less recomputation, more memory

The layer is split into graphdef and state outside the checkpointed function and merged inside it: `nnx.remat`
on a module merged inside a traced step raises a TraceContextError. Captured intermediates (attention
probabilities, MLP activations, ...) are outputs of the checkpointed function, so they come out as without remat
(and, being outputs, are kept for whatever consumes them).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

REMAT_POLICIES = {"layers": jax.checkpoint_policies.nothing_saveable,
                  "layers_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def check_remat(remat: str | None, cache) -> None:
    """ValueError for an unknown policy, or a policy with a KV cache (decoding has no backward pass)."""
    if remat is None:
        return
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} unknown; choose from None or {sorted(REMAT_POLICIES)}.")
    if cache is not None:
        raise ValueError("remat= cannot be combined with cache=; rematerialisation only helps a backward pass.")


def checkpointed_layer(layer: nnx.Module, x: jax.Array, positions: jax.Array, mask: jax.Array | None,
                       captured: dict | None, remat: str) -> jax.Array:
    """`layer(x, positions, mask, captured)` under `jax.checkpoint` with the policy `remat`; the intermediates
    the layer appends to `captured` are returned by the checkpointed function and appended here."""
    graph, state = nnx.split(layer)
    names = tuple(captured) if captured is not None else ()

    def body(state, x, positions, mask):
        inner = {name: [] for name in names} if names else None
        out = nnx.merge(graph, state)(x, positions, mask, inner)
        return out, {name: tuple(values) for name, values in (inner or {}).items()}

    out, values = _recomputed_late(jax.checkpoint(body, policy=REMAT_POLICIES[remat]))(state, x, positions, mask)
    for name, items in values.items():
        captured[name].extend(items)
    return out


def _recomputed_late(checkpointed: Callable[..., Any]) -> Callable[..., Any]:
    """`checkpointed` whose backward pass starts only once the layer's output cotangent exists.

    XLA:CPU drops the optimization barriers that `jax.checkpoint` puts around the recomputation and then merges
    the recomputed values with the forward's (CSE), or schedules the recomputation before the backward pass: the
    activations stay alive and the remat saves nothing. Here the saved activations (the residuals that are not
    the layer's weights) get a zero made from the cotangent added, so neither can happen on any backend; the
    weights are left as they are (no copy)."""
    activations: list[bool] = []  # per residual leaf, filled when the forward rule is traced

    @jax.custom_vjp
    def run(state, x, positions, mask):
        return checkpointed(state, x, positions, mask)

    def forward(state, x, positions, mask):
        out, pullback = jax.vjp(checkpointed, state, x, positions, mask)
        weights = {id(leaf) for leaf in jax.tree.leaves(state)}
        activations[:] = [id(leaf) not in weights and jnp.issubdtype(leaf.dtype, jnp.floating)
                          for leaf in jax.tree.leaves(pullback)]
        return out, pullback

    def backward(pullback, cotangent):
        zero = 0.0 * jax.tree.leaves(cotangent)[0].reshape(-1)[0].astype(jnp.float32)
        leaves, tree = jax.tree.flatten(pullback)
        leaves = [leaf + zero.astype(leaf.dtype) if tied else leaf for leaf, tied in zip(leaves, activations)]
        return jax.tree.unflatten(tree, leaves)(cotangent)

    run.defvjp(forward, backward)
    return run


__all__ = ["REMAT_POLICIES", "check_remat", "checkpointed_layer"]
