"""Positions in attention: RoPE (every kind transformers' configs name that the toolkit supports), attention
masks (causal, sliding window, padding, packed documents) and the logit soft-cap."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if not cap else jnp.tanh(x / cap) * cap


def apply_rope(x: jax.Array, positions: jax.Array, rope) -> jax.Array:
    """Rotate-half RoPE on (B, T, heads, H); cos/sin made in float32, then cast to the activation dtype."""
    inv_freq = rope_frequencies(rope, x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, H/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


def rope_frequencies(rope, head_dim: int) -> jax.Array:
    """(H/2,) float32 inverse frequencies of `rope` (config_values.Rope), as transformers computes each kind."""
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between the two.
    context = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = context / rope.low_freq_factor, context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(medium, blended, scaled)


def attention_mask(query_positions: jax.Array, key_positions: jax.Array, window: int | None,
                   key_mask: jax.Array | None = None, query_segments: jax.Array | None = None,
                   key_segments: jax.Array | None = None) -> jax.Array:
    """(B, T, S) bool: causal, within the sliding window (which counts the token itself), not padding, and with
    segment ids in the query's own non-zero segment."""
    query, key = query_positions[:, :, None], key_positions[:, None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    if key_mask is not None:
        allowed &= key_mask[:, None, :]
    if query_segments is not None:
        keys = key_segments[:, None, :]
        allowed &= (query_segments[:, :, None] == keys) & (keys != 0)
    return allowed


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions counted from 0 at the start of each segment (a run of equal ids) of every row."""
    index = jnp.arange(segment_ids.shape[1])
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
