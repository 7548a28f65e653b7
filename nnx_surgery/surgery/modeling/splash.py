"""Attention through the Pallas splash kernel on TPU: the (B, heads, T, S) scores are never written to memory.

The XLA path of `Attention` materialises each layer's float32 scores and bfloat16 probabilities; a train step keeps
the probabilities of every student layer for its backward pass. For the Gemma 3 270M pair at 8 x 2048 tokens that
is most of the step's temporaries (XLA's memory report of the TPU program: one (8, 2048, 2048, 4) buffer per layer
and several more per layer in flight), and reading and writing them is most of the attention's time. The splash
kernel (the one MaxText trains with) streams key/value blocks through VMEM with an online softmax, skips the
blocks its mask rules out, and recomputes what its backward kernels need.

Its masks are by index, so it applies where the dense mask is a function of the index: causal (and the sliding
window, which counts the token itself) within documents, as `CausalLM` builds it from `segment_ids` with positions
counted from 0 in each document (packed training rows), or from plain positions 0..T-1. Padding is segment 0:
a padded query sees padded keys, whose outputs no loss reads (the XLA path gives them no key; real tokens see the
same keys either way). `SegmentMask` carries the segment ids in place of the (B, T, S) mask; the model falls back
to the XLA path wherever the kernel does not apply (`applies`).

Scores are q k^T with q scaled first (Gemma's scale 1/sqrt(256) is a power of two, exact in bfloat16), then the
model's attention soft-cap, which the kernel applies as tanh(s / cap) * cap like the XLA path.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .activations import row_axes

KERNELS = ("xla", "splash", "splash_interpret")  # `CausalLM.__call__(attention_kernel=)`; the last for CPU tests
BLOCK = 512  # rows of queries / keys per kernel block (MaxText's default on v5e); smaller sequences use one block
ALIGN = 128  # the kernel's sequence blocks and head dimension are multiples of the TPU's 128 lanes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
    """What the splash kernel needs instead of a (B, T, S) mask: each token's document (0: padding) and the
    layer's sliding window (None: causal over the whole document)."""

    segment_ids: jax.Array
    window: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    interpret: bool = dataclasses.field(metadata=dict(static=True), default=False)  # off a TPU, for tests


def applies(length: int, head_dim: int) -> bool:
    """Whether the kernel's blocks tile this attention (a sequence and head dimension of whole 128-lane tiles)."""
    return length % ALIGN == 0 and head_dim % ALIGN == 0


def _kernel(length: int, heads: int, window: int | None, softcap: float | None, interpret: bool):
    """The splash kernel for one attention shape, made in the trace that calls it: its mask's block tables become
    that trace's constants, so a kernel kept across traces would leak one trace's values into the next, and
    making them concrete instead (`jax.ensure_compile_time_eval`) fails under a mesh of compile-only devices
    (`--aot`). The tables are built in numpy, a few milliseconds per layer per trace."""
    return _make_kernel(length, heads, window, softcap, interpret)


def _make_kernel(length: int, heads: int, window: int | None, softcap: float | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (length, length)
    one = masks.CausalMask(shape) if window is None else masks.LocalMask(shape, (window - 1, 0), 0)
    block = min(BLOCK, length)
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return kernel.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


def _attend(q, k, v, segment_ids, *, window, softcap, interpret):
    """q (B, N, T, H) already scaled, k / v (B, K, S, H), segment_ids (B, T) -> (B, N, T, H)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    run = _kernel(q.shape[2], q.shape[1], window, softcap, interpret)
    return jax.vmap(lambda q, k, v, ids: run(q, k, v, segment_ids=SegmentIds(q=ids, kv=ids)))(q, k, v, segment_ids)


def _batch_axes(rows: int):
    """The mesh in context and the data axes its batch is split over; None when another axis is larger than 1
    (heads or sequence split across devices: the XLA path partitions those)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return mesh, ()
    used, split = row_axes(mesh, rows)
    if split != mesh.size:
        return None
    return mesh, tuple(used)


def splash_available(rows: int) -> bool:
    """Whether the mesh in context lets each device run the kernel on its own rows."""
    return _batch_axes(rows) is not None


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: SegmentMask, *, scale: float,
                     softcap: float | None, interpret: bool = False) -> jax.Array:
    """Attention of q (B, T, N, H) over k, v (B, S, K, H) (N a multiple of K) under `mask`: (B, T, N, H) in q's
    dtype. Each device attends its own rows (`jax.shard_map` over the data axes of the mesh in context)."""
    q = (q * jnp.asarray(scale, q.dtype)).transpose(0, 2, 1, 3)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    segments = mask.segment_ids.astype(jnp.int32)
    attend = functools.partial(_attend, window=mask.window, softcap=softcap, interpret=interpret)
    mesh, axes = _batch_axes(q.shape[0])
    if axes:
        rows = PartitionSpec(axes if len(axes) > 1 else axes[0])
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(rows, rows, rows, rows), out_specs=rows,
                               check_vma=False)  # a Pallas call states no varying axes of its own
    return attend(q, k, v, segments).transpose(0, 2, 1, 3).astype(v.dtype)


__all__ = ["KERNELS", "SegmentMask", "applies", "splash_attention", "splash_available"]
