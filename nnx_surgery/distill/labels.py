"""Next-token labels and position weights of a batch: what every loss term scores, and where (the last position,
padding and the prompt of a masked row score nothing)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def labels_and_weights(input_ids: jax.Array, loss_mask: jax.Array | None,
                       attention_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Next-token labels and position weights (B, T): weight[b, t] scores the prediction made at position t of
    token t + 1; the last position, padding (attention_mask 0 at t or t + 1) and loss_mask 0 get weight 0."""
    labels = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)
    has_next = jnp.arange(input_ids.shape[1]) < input_ids.shape[1] - 1
    weights = jnp.broadcast_to(has_next, input_ids.shape).astype(jnp.float32)
    if loss_mask is not None:
        weights = weights * loss_mask.astype(jnp.float32)
    if attention_mask is not None:
        real = attention_mask.astype(jnp.float32)
        real_next = jnp.concatenate([real[:, 1:], jnp.zeros_like(real[:, :1])], axis=1)
        weights = weights * real * real_next
    return labels, weights


__all__ = ["labels_and_weights"]
