"""The KV cache of generation: preallocated buffers per layer, as a pytree.

The cache is a pytree (`KVCache`), so it goes through `jax.jit`, `lax.while_loop` and donation like any state.
Prompts of a batch are left padded to one length, so every row writes the same slot at each step: one scalar
`end` indexes the buffers, while positions (for RoPE and the masks) are kept per row and per slot.

Layout per layer: full-attention layers hold `max_len` slots; sliding-window layers hold a ring of
`min(window, max_len)` slots, the most a query can see (the window counts the query itself), written at slot
`index % ring`. A single new token is written first and then attends to its buffer (the slot it overwrites is one
window behind it); a chunk of several tokens attends to the ring as it was plus its own keys, and then its last
ring-full of keys is written, since its earlier queries still need the keys it would overwrite. The first pass
over a new cache (`fresh`, known when tracing) attends to its own keys only, not to the empty slots.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

@dataclasses.dataclass
class KVCache:
    """Preallocated keys and values of every layer, and where their tokens sit.

    `keys[i]`, `values[i]`: (B, S_i, K, H), S_i = `max_len` for full layers, `min(window, max_len)` for sliding ones.
    `slot_positions[attention type]`: (B, S) int32 position of the token in each slot; -1 for padding or empty.
    `end`: () int32, slots written so far (the same in every row). `next_position`: (B,) int32, the position the
    next real token of each row gets. `max_len` (static): tokens the cache can hold per row, padding included.
    `fresh` (static): nothing written yet.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    slot_positions: dict[str, jax.Array]
    end: jax.Array
    next_position: jax.Array
    max_len: int = 0
    fresh: bool = True

    @classmethod
    def create(cls, layers: Sequence[tuple[int | None, str, int, int]], batch: int, max_len: int,
               dtype) -> "KVCache":
        """`layers`: (sliding window or None, attention type, KV heads, head_dim) of each layer."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1 (got batch={batch}, max_len={max_len}).")
        sizes = [max_len if window is None else min(window, max_len) for window, _, _, _ in layers]
        keys = tuple(jnp.zeros((batch, size, k, h), dtype) for size, (_, _, k, h) in zip(sizes, layers))
        slot_positions = {kind: jnp.full((batch, size), -1, jnp.int32) for size, (_, kind, _, _) in zip(sizes, layers)}
        return cls(keys=keys, values=tuple(jnp.zeros_like(k) for k in keys), slot_positions=slot_positions,
                   end=jnp.zeros((), jnp.int32), next_position=jnp.zeros((batch,), jnp.int32), max_len=max_len)

    def begin(self, length: int, attention_mask: jax.Array | None, positions: jax.Array | None) -> "CacheStep":
        """Start a forward pass over `length` new tokens per row (see `CacheStep`)."""
        batch = self.next_position.shape[0]
        valid = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:  # as transformers' generate: real tokens count on, padding sits at 0
            positions = self.next_position[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
            positions = jnp.maximum(positions, 0)
        new = jnp.where(valid, positions, -1).astype(jnp.int32)
        written = {kind: self._write(old, new) for kind, old in self.slot_positions.items()}
        attended = {kind: self._attended(old, written[kind], new) for kind, old in self.slot_positions.items()}
        return CacheStep(self, positions, attended, written, self.next_position + valid.sum(1, dtype=jnp.int32),
                         length)

    def _attend_after_write(self, buffer: jax.Array, length: int) -> bool:
        """A buffer that cannot wrap, or one new token: write first, then attend to the buffer alone."""
        return length == 1 or buffer.shape[1] >= self.max_len

    def _attended(self, old: jax.Array, written: jax.Array, new: jax.Array) -> jax.Array:
        """What the new tokens attend to: themselves (fresh cache), the written buffer, or the old one and them."""
        if self.fresh:
            return new
        if self._attend_after_write(old, new.shape[1]):
            return written
        return jnp.concatenate([old, new.astype(old.dtype)], axis=1)

    def _write(self, buffer: jax.Array, new: jax.Array) -> jax.Array:
        """`new` (B, T, ...) into slots `end + t` (modulo the buffer length: a ring wraps)."""
        size, length = buffer.shape[1], new.shape[1]
        new = new.astype(buffer.dtype)
        if self._attend_after_write(buffer, length):
            return jax.lax.dynamic_update_slice_in_dim(buffer, new, self.end % size, axis=1)
        keep = min(length, size)  # a chunk longer than the ring leaves only its last `size` tokens
        slots = (self.end + jnp.arange(length - keep, length)) % size
        return buffer.at[:, slots].set(new[:, length - keep:])


jax.tree_util.register_dataclass(KVCache, data_fields=["keys", "values", "slot_positions", "end", "next_position"],
                                 meta_fields=["max_len", "fresh"])


class CacheStep:
    """One forward pass's view of a cache: new tokens' `positions` (B, T), and per attention type the positions of
    the keys they attend to (`key_positions`, -1 where none). `layer(i)` is the function layer i's attention calls
    with its new keys and values; it returns those to attend to and records the written buffers. `finish()` gives
    the updated cache."""

    def __init__(self, cache: KVCache, positions, key_positions, slot_positions, next_position, length: int):
        self.cache, self.positions, self.key_positions = cache, positions, key_positions
        self.slot_positions, self.next_position, self.length = slot_positions, next_position, length
        self.keys, self.values = list(cache.keys), list(cache.values)

    def layer(self, i: int) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        def update(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
            old_k, old_v = self.cache.keys[i], self.cache.values[i]
            self.keys[i], self.values[i] = self.cache._write(old_k, k), self.cache._write(old_v, v)
            return self.cache._attended(old_k, self.keys[i], k), self.cache._attended(old_v, self.values[i], v)
        return update

    def finish(self) -> KVCache:
        return dataclasses.replace(self.cache, keys=tuple(self.keys), values=tuple(self.values),
                                   slot_positions=self.slot_positions, end=self.cache.end + self.length,
                                   next_position=self.next_position, fresh=False)


__all__ = ["KVCache", "CacheStep"]
