"""Fingerprints that let two training phases be checked to be paired: the same starting weights and the same
batches in the same order (a distillation and the control it is compared with).

`batch_digest` names a step's data batch; the training loop logs it in every step record (`batch_digest`).
`weights_digest` names a model's parameters bit for bit; it is computed on the devices, so a model sharded over a
mesh (several hosts included) is never gathered to one host. `sequence_digest` names a whole batch sequence, and
`compare_sequences` says how far two of them agree.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def batch_digest(stacked: dict[str, np.ndarray]) -> str:
    """A step's data batch as the data stream gave it: 16 hex digits of BLAKE2b over its token ids and loss mask
    when it has one (with their dtypes and shapes; on a multi-host mesh, this process's rows)."""
    digest = hashlib.blake2b(digest_size=8)
    for key in ("input_ids", "loss_mask"):
        if key not in stacked:  # a user's batches may carry no mask
            continue
        array = np.ascontiguousarray(stacked[key])
        digest.update(f"{key}{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _mixed_bits(leaf: jax.Array) -> jax.Array:
    """Each element's bits (as uint32), mixed with its index by a bijection per index (xor, odd multiply,
    xor-shift), so any changed element changes its mixed value and the sums below detect it (two sums with other
    constants: an accidental cancellation in both has odds of about 2^-64)."""
    size = jnp.dtype(leaf.dtype).itemsize
    if size == 8:
        bits = jax.lax.bitcast_convert_type(leaf, jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(leaf, _UNSIGNED[size]).astype(jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)  # the flat index, built per axis: no reshape of a sharded array
    for axis, stride in enumerate(np.cumprod((1,) + bits.shape[::-1])[-2::-1] if bits.ndim else ()):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
    mixed = (bits ^ (index * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
    return mixed ^ (mixed >> 13)


@jax.jit
def _leaf_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    sums = []
    for leaf in leaves:
        mixed = _mixed_bits(leaf)
        sums.append(jnp.stack([jnp.sum(mixed, dtype=jnp.uint32),
                               jnp.sum(mixed * jnp.uint32(0xC2B2AE35) + (mixed >> 7), dtype=jnp.uint32)]))
    return sums


def weights_digest(model: Any) -> str:
    """16 hex digits naming every parameter of an NNX model bit for bit, with its path, shape and dtype: equal for
    two models exactly when they hold the same parameters (up to a chance of about 2^-64)."""
    state = nnx.state(model, nnx.Param)
    named = sorted(((jax.tree_util.keystr(path), leaf) for path, leaf in
                    jax.tree_util.tree_flatten_with_path(state)[0]), key=lambda item: item[0])
    sums = jax.device_get(_leaf_sums([leaf for _, leaf in named]))
    digest = hashlib.blake2b(digest_size=8)
    for (path, leaf), pair in zip(named, sums):
        digest.update(f"{path}|{leaf.shape}|{leaf.dtype}|{int(pair[0])}|{int(pair[1])};".encode())
    return digest.hexdigest()


def sequence_digest(digests: Sequence[str]) -> str:
    """One digest for a sequence of batch digests (order matters)."""
    return hashlib.blake2b(",".join(digests).encode(), digest_size=8).hexdigest()


def compare_sequences(a: Sequence[str], b: Sequence[str]) -> dict[str, Any]:
    """How two batch sequences agree: `same` (the same batches in the same order, of equal length), the number of
    leading steps that agree, and both lengths."""
    leading = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"same": len(a) == len(b) and leading == len(a), "agreeing_steps": leading, "steps": [len(a), len(b)]}


__all__ = ["batch_digest", "weights_digest", "sequence_digest", "compare_sequences"]
