"""The logit loss as Pallas kernels on a TPU: `two_pass.py`'s two passes over the vocabulary, with each
(rows, vocabulary) tile of logits made, used and dropped in the core's own memory (VMEM).

The XLA losses (`divergence.py`, `two_pass.py`) write every (rows, slice) block of logits, probabilities and dz to
HBM between the matmul and the reductions, and read it back several times; at a 262k vocabulary and a 640-wide
hidden state those passes, not the matmuls, take most of the loss's time on a v5e chip. Here, per tile of
`rows` x `vocab` (grid over row blocks and vocabulary blocks):

    statistics  both models' logits of the tile, folded into per-row running log-sum-exps (as in flash attention)
                and the teacher-weighted sum of (v - u), the student's logit at the label: the row statistics of
                `two_pass._statistics`, from which `two_pass.loss_from_statistics` makes the loss and metrics.
    d(hidden)   the logits again, dz = w (tau w_kl (q - p) + w_ce (softmax(s) - onehot)) f'(z), accumulated as
                dz @ head over the vocabulary blocks of a row block.
    d(head)     the same dz, transposed (vocabulary rows in sublanes), accumulated as dz^T @ hidden over the row
                blocks of a vocabulary block, in float32, written once in the head's dtype.

So HBM holds only the inputs, the (rows, 8) statistics and the two gradients: the loss's temporaries do not grow
with rows x vocabulary. The cost is the matmuls: the logits are made three times (the XLA fused loss makes
them once), 8 matmuls of rows x D x V against 4.

Scope: forward KL and/or hard-label CE against a teacher's hidden states (or CE alone), as `two_pass`; the
soft-cap of each model known as a number (`logit_softcap`); vocabulary a multiple of 128; one device (a mesh
of more takes the XLA loss). Off a TPU the kernels run in Pallas' interpreter (tests).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .divergence import LogitLossSettings
from .two_pass import loss_from_statistics, statistics_loss

ROW_BLOCK = 512  # rows per tile (a multiple of 128: the d(head) kernel puts rows in lanes)
VOCAB_BLOCKS = (1024, 512, 256, 128)  # vocabulary rows per tile: the first that divides the vocabulary
VMEM_LIMIT = 64 * 1024 * 1024  # a tile's inputs (double-buffered) and its (rows, vocab) float32 intermediates
STATISTICS = ("lse_u", "lse_v", "p_v_minus_u", "lse_s", "label_s")  # columns of the statistics array
UNKNOWN = object()  # `logit_softcap` of a model whose soft-cap cannot be read


def logit_softcap(model: Any) -> Any:
    """The final soft-cap of `model`'s `logits_from_hidden` (a float, or None for none), read from
    `model.config.final_logit_softcapping`; `UNKNOWN` when the model does not say."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "final_logit_softcapping"):
        return UNKNOWN
    cap = config.final_logit_softcapping
    return float(cap) if cap else None


def model_caps(student: Any, teacher: Any | None) -> tuple[Any, Any]:
    """(student's, teacher's) soft-caps for the kernels; the teacher's None where no teacher model computes logits
    (none, or a cached teacher's top k)."""
    return logit_softcap(student), None if teacher is None else logit_softcap(teacher)


def kernel_applies(spec: LogitLossSettings, cached_teacher: bool, vocab: int, caps: tuple[Any, Any],
                   devices: int | None = None) -> bool:
    """Whether the kernels compute this loss: two_pass's objectives, a vocabulary of whole 128-lane tiles, both
    soft-caps known, and one device (`devices`: the mesh's size; None: the mesh in context)."""
    if devices is None:
        mesh = jax.sharding.get_abstract_mesh()
        devices = 1 if mesh is None or mesh.empty else mesh.size
    single = devices == 1
    objectives = not (cached_teacher or spec.top_k is not None or spec.reverse_kl or spec.jsd or spec.diagnostics)
    return objectives and single and vocab % 128 == 0 and UNKNOWN not in caps


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The static shape of one loss: tile sizes, which terms, each model's soft-cap, interpreter or chip."""

    rows: int
    vocab: int
    kl: bool
    ce: bool
    unit: bool  # temperature 1: the student's lse at the temperature is its CE's lse
    cap_s: float | None
    cap_t: float | None
    interpret: bool


def _capped(z: jax.Array, cap: float | None) -> jax.Array:
    return z if cap is None else jnp.tanh(z / cap) * cap


def _nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a (m, k) @ b (n, k)^T -> (m, n) float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _fold(m_ref, l_ref, x, extra=None, extra_ref=None):
    """Fold tile values x (rows, vocab) into running max / sum-of-exp refs (rows, 1), and sum of exp * extra."""
    m_old = m_ref[...]
    m_new = jnp.maximum(m_old, jnp.max(x, axis=1, keepdims=True))
    e = jnp.exp(x - m_new)
    rescale = jnp.exp(m_old - m_new)
    l_ref[...] = l_ref[...] * rescale + jnp.sum(e, axis=1, keepdims=True)
    m_ref[...] = m_new
    if extra is not None:
        extra_ref[...] = extra_ref[...] * rescale + jnp.sum(e * extra, axis=1, keepdims=True)


def _statistics_kernel(tiles: Tiles, scalars, hs, ws, *refs):
    """Grid (row block i, vocabulary block j): fold tile (i, j) into row block i's running statistics."""
    ht, wt, labels, out, m_u, l_u, m_v, l_v, a, m_s, l_s, picked = refs if tiles.kl else (None, None, *refs)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _start():
        for ref in (m_u, m_v, m_s):
            ref[...] = jnp.full(ref.shape, -jnp.inf, jnp.float32)
        for ref in (l_u, l_v, a, l_s, picked):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    s = _capped(_nt(hs[...], ws[...]), tiles.cap_s)
    u = s * scalars[0]
    _fold(m_u, l_u, u)
    if tiles.kl:
        v = _capped(_nt(ht[...], wt[...]), tiles.cap_t) * scalars[0]
        _fold(m_v, l_v, v, v - u, a)
    if not tiles.unit:
        _fold(m_s, l_s, s)
    column = j * tiles.vocab + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    picked[...] += jnp.sum(jnp.where(column == labels[...], s, 0.0), axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        lse_u = m_u[...] + jnp.log(l_u[...])
        columns = [lse_u, m_v[...] + jnp.log(l_v[...]), a[...] / l_v[...],
                   lse_u if tiles.unit else m_s[...] + jnp.log(l_s[...]), picked[...]]
        for k, value in enumerate(columns):
            out[:, k:k + 1] = value if tiles.kl or k not in (1, 2) else jnp.zeros_like(value)


def _dz(tiles: Tiles, scalars, z, t, stats, onehot, weights):
    """dz of a tile: z, t (and onehot) shaped alike, `stats` the row statistics broadcast against them (a dict of
    arrays with a size-1 vocabulary axis), `weights` likewise. Scalars: 1/tau, tau w_kl, w_ce."""
    s = _capped(z, tiles.cap_s)
    d_s = jnp.zeros_like(s)
    if tiles.kl:
        q = jnp.exp(s * scalars[0] - stats["lse_u"])
        p = jnp.exp(_capped(t, tiles.cap_t) * scalars[0] - stats["lse_v"])
        d_s = d_s + scalars[1] * (q - p)
    if tiles.ce:
        d_s = d_s + scalars[2] * (jnp.exp(s - stats["lse_s"]) - onehot.astype(jnp.float32))
    if tiles.cap_s is not None:
        d_s = d_s * (1.0 - jnp.square(jnp.tanh(z / tiles.cap_s)))
    return weights * d_s


def _hidden_kernel(tiles: Tiles, scalars, hs, ws, *refs):
    """Grid (row block i, vocabulary block j): d(hidden)[i] += dz(i, j) @ head[j]."""
    ht, wt, labels, weights, stats, out, acc = refs if tiles.kl else (None, None, *refs)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _start():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    z = _nt(hs[...], ws[...])
    t = _nt(ht[...], wt[...]) if tiles.kl else None
    column = j * tiles.vocab + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    row_stats = {name: stats[:, k:k + 1] for k, name in enumerate(STATISTICS)}
    dz = _dz(tiles, scalars, z, t, row_stats, column == labels[...], weights[...])
    acc[...] += jnp.dot(dz.astype(ws.dtype), ws[...], preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        out[...] = acc[...].astype(out.dtype)


def _head_kernel(tiles: Tiles, scalars, hs, ws, *refs):
    """Grid (vocabulary block j, row block i), transposed tiles (vocabulary in sublanes, rows in lanes):
    d(head)[j] += dz(i, j)^T @ hidden[i]."""
    ht, wt, labels, weights, stats, out, acc = refs if tiles.kl else (None, None, *refs)
    i, j = pl.program_id(1), pl.program_id(0)

    @pl.when(i == 0)
    def _start():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    z = _nt(ws[...], hs[...])  # (vocab, rows)
    t = _nt(wt[...], ht[...]) if tiles.kl else None
    row = j * tiles.vocab + jax.lax.broadcasted_iota(jnp.int32, z.shape, 0)
    row_stats = {name: stats[k:k + 1, :] for k, name in enumerate(STATISTICS)}
    dz = _dz(tiles, scalars, z, t, row_stats, row == labels[...], weights[...])
    acc[...] += jnp.dot(dz.astype(hs.dtype), hs[...], preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        out[...] = acc[...].astype(out.dtype)


def _call(kernel, tiles: Tiles, grid, in_specs, out_spec, out_shape, scratch, flops: int, transcendentals: int,
          operands: tuple) -> jax.Array:
    """The kernel over `grid` applied to `operands` (the SMEM scalars first). Its cost for XLA's scheduler: the
    given FLOPs and transcendentals, and each operand and the output read or written once."""
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    moved = sum(x.size * x.dtype.itemsize for x in (*operands, out_shape))
    return pl.pallas_call(
        functools.partial(kernel, tiles), grid=grid, in_specs=[smem, *in_specs], out_specs=out_spec,
        out_shape=out_shape, scratch_shapes=scratch, compiler_params=params, interpret=tiles.interpret,
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=moved))(*operands)


def _row_major_specs(tiles: Tiles, hs, ht, by_row, by_vocab):
    """BlockSpecs of hidden states and heads for a grid whose index maps are (i, j) -> blocks (`by_row` /
    `by_vocab` turn the grid position into the row block and the vocabulary block)."""
    specs = [pl.BlockSpec((tiles.rows, hs.shape[1]), lambda *g: (by_row(*g), 0)),
             pl.BlockSpec((tiles.vocab, hs.shape[1]), lambda *g: (by_vocab(*g), 0))]
    if tiles.kl:
        specs += [pl.BlockSpec((tiles.rows, ht.shape[1]), lambda *g: (by_row(*g), 0)),
                  pl.BlockSpec((tiles.vocab, ht.shape[1]), lambda *g: (by_vocab(*g), 0))]
    return specs


def _matmul_flops(tiles: Tiles, rows: int, vocab: int, hs, ht) -> int:
    return 2 * rows * vocab * (hs.shape[1] + (ht.shape[1] if tiles.kl else 0))


def kernel_statistics(tiles: Tiles, scalars, hs, ws, ht, wt, labels) -> jax.Array:
    """(rows, 8) float32: the STATISTICS columns of every row. hs (N, D_s), ws (V, D_s), ht (N, D_t), wt (V, D_t)
    (None without KL), labels (N,) int32; N a multiple of `tiles.rows`, V of `tiles.vocab`."""
    rows, vocab = hs.shape[0], ws.shape[0]
    grid = (rows // tiles.rows, vocab // tiles.vocab)
    by_row, by_vocab = (lambda i, j: i), (lambda i, j: j)
    specs = _row_major_specs(tiles, hs, ht, by_row, by_vocab)
    specs.append(pl.BlockSpec((tiles.rows, 1), lambda i, j: (i, 0)))
    column = pltpu.VMEM((tiles.rows, 1), jnp.float32)
    inputs = (hs, ws, ht, wt) if tiles.kl else (hs, ws)
    return _call(_statistics_kernel, tiles, grid, specs, pl.BlockSpec((tiles.rows, 8), lambda i, j: (i, 0)),
                 jax.ShapeDtypeStruct((rows, 8), jnp.float32), [column] * 8,
                 _matmul_flops(tiles, rows, vocab, hs, ht), rows * vocab * (1 + tiles.kl + (not tiles.unit)),
                 (scalars, *inputs, labels[:, None]))


def kernel_hidden_gradient(tiles: Tiles, scalars, hs, ws, ht, wt, labels, weights, stats) -> jax.Array:
    """d(loss)/d(hs) (N, D_s) in hs's dtype, for per-row loss weights `weights` (N,) float32."""
    rows, vocab = hs.shape[0], ws.shape[0]
    grid = (rows // tiles.rows, vocab // tiles.vocab)
    specs = _row_major_specs(tiles, hs, ht, lambda i, j: i, lambda i, j: j)
    specs += [pl.BlockSpec((tiles.rows, 1), lambda i, j: (i, 0)), pl.BlockSpec((tiles.rows, 1), lambda i, j: (i, 0)),
              pl.BlockSpec((tiles.rows, 8), lambda i, j: (i, 0))]
    inputs = (hs, ws, ht, wt) if tiles.kl else (hs, ws)
    width = hs.shape[1]
    return _call(_hidden_kernel, tiles, grid, specs, pl.BlockSpec((tiles.rows, width), lambda i, j: (i, 0)),
                 jax.ShapeDtypeStruct(hs.shape, hs.dtype), [pltpu.VMEM((tiles.rows, width), jnp.float32)],
                 _matmul_flops(tiles, rows, vocab, hs, ht) + 2 * rows * vocab * width, 2 * rows * vocab,
                 (scalars, *inputs, labels[:, None], weights[:, None], stats))


def kernel_head_gradient(tiles: Tiles, scalars, hs, ws, ht, wt, labels, weights, stats, dtype) -> jax.Array:
    """d(loss)/d(head) (V, D_s) in `dtype`, accumulated in float32."""
    rows, vocab = hs.shape[0], ws.shape[0]
    grid = (vocab // tiles.vocab, rows // tiles.rows)
    specs = _row_major_specs(tiles, hs, ht, lambda j, i: i, lambda j, i: j)
    specs += [pl.BlockSpec((1, tiles.rows), lambda j, i: (0, i)), pl.BlockSpec((1, tiles.rows), lambda j, i: (0, i)),
              pl.BlockSpec((8, tiles.rows), lambda j, i: (0, i))]
    inputs = (hs, ws, ht, wt) if tiles.kl else (hs, ws)
    width = hs.shape[1]
    return _call(_head_kernel, tiles, grid, specs, pl.BlockSpec((tiles.vocab, width), lambda j, i: (j, 0)),
                 jax.ShapeDtypeStruct(ws.shape, dtype), [pltpu.VMEM((tiles.vocab, width), jnp.float32)],
                 _matmul_flops(tiles, rows, vocab, hs, ht) + 2 * rows * vocab * width, 2 * rows * vocab,
                 (scalars, *inputs, labels[None, :], weights[None, :], stats.T))


def _tiles(spec: LogitLossSettings, rows: int, vocab: int, caps, interpret: bool, row_block: int) -> Tiles:
    vocab_block = next(size for size in VOCAB_BLOCKS if vocab % size == 0)
    row_block = min(row_block, -(-rows // 128) * 128)
    return Tiles(rows=row_block, vocab=vocab_block, kl=spec.kl, ce=spec.ce,
                 unit=spec.unit_temperature or not spec.kl, cap_s=caps[0], cap_t=caps[1], interpret=interpret)


def kernel_logit_loss(h_s: jax.Array, head_s: jax.Array, h_t: jax.Array | None, head_t: jax.Array | None,
                      labels: jax.Array, weights: jax.Array, coeffs: dict, *, caps: tuple[Any, Any],
                      spec: LogitLossSettings, interpret: bool | None = None,
                      row_block: int = ROW_BLOCK) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`fused_logit_loss`'s loss, metric sums and gradients (for h_s and head_s), by the kernels. Shapes as
    there: h_s (B, T, D_s), head_s (V, D_s), h_t (B, T, D_t) or None, head_t (V, D_t) or None, labels and weights
    (B, T). `caps`: the student's and the teacher's soft-caps (`logit_softcap`). `interpret`: run the kernels in
    Pallas' interpreter (default: off a TPU)."""
    if spec.kl and h_t is None:
        raise ValueError("the logit kernels' KL needs the teacher's hidden states and head.")
    batch, length = h_s.shape[:2]
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    tiles = _tiles(spec, batch * length, head_s.shape[0], caps, interpret, row_block)
    padded = -(batch * length) % tiles.rows
    flat = lambda x: None if x is None else jnp.pad(x.reshape(batch * length, *x.shape[2:]),
                                                    [(0, padded)] + [(0, 0)] * (x.ndim - 2))
    head_dtype = head_s.dtype

    def operands(h_s, head_s, h_t, head_t, labels):
        teacher = (flat(h_t), head_t.astype(h_t.dtype)) if spec.kl else (None, None)
        return (flat(h_s), head_s.astype(h_s.dtype), *teacher, flat(labels).astype(jnp.int32))

    def scalars(coeffs):
        tau = jnp.asarray(coeffs["temperature"] if spec.kl else 1.0, jnp.float32)
        w_kl = jnp.asarray(coeffs["kl"] if spec.kl else 0.0, jnp.float32)
        w_ce = jnp.asarray(coeffs["ce"] if spec.ce else 0.0, jnp.float32)
        return tau, jnp.stack([1.0 / tau, tau * w_kl, w_ce])

    def forward(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        tau, values = scalars(coeffs)
        columns = kernel_statistics(tiles, values, *operands(h_s, head_s, h_t, head_t, labels))[:batch * length]
        stats = {name: columns[:, k] for k, name in enumerate(STATISTICS)}
        flat_weights = weights.reshape(-1).astype(jnp.float32)
        return loss_from_statistics(stats, flat_weights, coeffs, tau, spec), columns

    def gradients(args, columns, cotangent, grad_hidden: bool, grad_head: bool):
        h_s, head_s, h_t, head_t, labels, weights, coeffs = args
        _, values = scalars(coeffs)
        scaled = jnp.pad(weights.reshape(-1).astype(jnp.float32) * cotangent.astype(jnp.float32), (0, padded))
        stats = jnp.pad(columns, [(0, padded), (0, 0)])
        hs, ws, ht, wt, rows_labels = operands(h_s, head_s, h_t, head_t, labels)
        d_hidden = d_head = None
        if grad_hidden:
            d_hidden = kernel_hidden_gradient(tiles, values, hs, ws, ht, wt, rows_labels, scaled, stats)
            d_hidden = d_hidden[:batch * length].reshape(h_s.shape)
        if grad_head:
            d_head = kernel_head_gradient(tiles, values, hs, ws, ht, wt, rows_labels, scaled, stats, head_dtype)
        return d_hidden, d_head

    return statistics_loss(forward, gradients)(h_s, head_s, h_t, head_t, labels, weights, coeffs)


__all__ = ["kernel_logit_loss", "kernel_applies", "logit_softcap", "model_caps", "Tiles", "kernel_statistics",
           "kernel_hidden_gradient", "kernel_head_gradient", "UNKNOWN", "ROW_BLOCK"]
