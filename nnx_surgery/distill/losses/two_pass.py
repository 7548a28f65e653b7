"""The logit loss in two passes over slices of the vocabulary (`logit_impl="two_pass"`): no (rows, V) block of
logits and no (V, D) float32 head-gradient accumulator ever exist.

The fused loss (`distill.losses.divergence`) walks the rows: per block of rows it makes the full-vocabulary logits of both
models, and it sums d(head) over the blocks in a (V, D) float32 buffer. At a large vocabulary and hidden size that
buffer, and the per-block logits, dominate the loss's memory (4096 x 128,256 is 2 GiB in float32). Here the walk
is over the vocabulary instead, for forward KL and/or hard-label CE (the terms with a closed-form gradient,
`distill.losses.logit_grad`):

    pass 1 (forward), per slice of `vocab_slice` vocabulary rows: both models' logits of every row for that slice,
        folded into per-row running statistics (an online log-sum-exp, as in flash attention): the student's and
        the teacher's log-sum-exp at the temperature, the teacher-weighted sum of (v - u), the student's
        temperature-1 log-sum-exp and its logit at the label. The loss per row follows from those:
            KL = sum_v p (v - u) - lse(v) + lse(u),   CE = lse(s) - s[label]
    pass 2 (backward), per slice again: the logits recomputed, dz = w (tau (q - p) + (softmax(s) - onehot)) f'(z)
        from the row statistics, d(head)[slice] = dz^T @ hidden written straight into the gradient (in the head's
        own dtype), d(hidden) += dz @ head[slice] (a (rows, D) float32 accumulator).

The cost: the two models' logits are made twice (about 1.5x the loss's matmul FLOPs of the fused path, which makes
each logit once and takes both gradients in the same pass). The memory: one (rows, slice) buffer per live
intermediate and the (rows, D) accumulator. Use it where memory, not FLOPs, is the limit (a large vocabulary on a
small-memory chip); `bench/fused_loss_memory.py liger` compiles both at Liger-Kernel's benchmark shape.

Slices are cut at `min(j * slice, V - slice)`, so the last one overlaps the one before it instead of padding the
head (which would copy it): its columns already covered are masked out of the statistics and keep their
gradient rows.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .divergence import LogitLossSettings, LogitsFn, elementwise_part, metric_names

DEFAULT_SLICE_ELEMENTS = 1 << 23  # rows x slice per float32 buffer (32 MiB) when no slice width is asked for


def two_pass_applies(spec: LogitLossSettings, cached_teacher: bool) -> bool:
    """The settings this loss computes: forward KL and/or CE against a teacher's hidden states (or no teacher),
    without top-k, reverse KL, JSD or the full-vocabulary diagnostics (the evaluation step's; it takes the fused
    path)."""
    return not (cached_teacher or spec.top_k is not None or spec.reverse_kl or spec.jsd or spec.diagnostics)


def _slice_width(vocab: int, rows: int, wanted: int | None) -> int:
    return max(1, min(vocab, wanted or max(128, DEFAULT_SLICE_ELEMENTS // max(rows, 1))))


def _head_slice(head: jax.Array, start: jax.Array, width: int, dtype) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(head, start, width, axis=0).astype(dtype)


def _slices(vocab: int, width: int) -> tuple[int, Callable]:
    """(number of slices, j -> (start, valid (width,) bool)): slice j covers columns [j*width, (j+1)*width) of
    the vocabulary, the last one shifted back to end at `vocab` with its already covered columns not valid."""
    count = -(-vocab // width)

    def where(j):
        start = jnp.minimum(j * width, vocab - width)
        return start, start + jnp.arange(width) >= j * width
    return count, where


def _online(m, total, x, valid, extra=None, extra_sum=None):
    """Fold a slice's values x (rows, width) into a running max `m` and sum of exp(x - m) (and of
    exp(x - m) * extra, when given)."""
    m_new = jnp.maximum(m, jnp.max(jnp.where(valid, x, -jnp.inf), axis=-1))
    e = jnp.where(valid, jnp.exp(x - m_new[:, None]), 0.0)
    rescale = jnp.exp(m - m_new)
    total = total * rescale + jnp.sum(e, axis=-1)
    if extra is None:
        return m_new, total, None
    return m_new, total, extra_sum * rescale + jnp.sum(jnp.where(valid, e * extra, 0.0), axis=-1)


def _logits(h_s, head_s, h_t, head_t, start, width, student_logits, teacher_logits):
    """(z, s, t) of every row for one slice: the student's matmul output z, its logits s = f(z) and the teacher's
    logits (None without a teacher), float32."""
    z = jnp.einsum("nD,VD->nV", h_s, _head_slice(head_s, start, width, h_s.dtype),
                   preferred_element_type=jnp.float32)
    s = elementwise_part(student_logits)(z)
    t = None if h_t is None else jax.lax.stop_gradient(
        teacher_logits(h_t, _head_slice(head_t, start, width, head_t.dtype)).astype(jnp.float32))
    return z, s, t


def _statistics(rows, labels, tau, spec, logits_of, width, vocab):
    """Pass 1: per-row lse(u), lse(v), sum_v p (v - u), lse(s) and s[label] (u = s / tau, v = t / tau)."""
    count, where = _slices(vocab, width)
    minus_inf, zero = jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)
    unit = spec.unit_temperature or not spec.kl

    def body(j, carry):
        (m_u, s_u), (m_v, s_v, a), (m_s, s_s), label_s = carry
        start, valid = where(j)
        _, s, t = logits_of(start)
        u = s / tau
        m_u, s_u, _ = _online(m_u, s_u, u, valid)
        if spec.kl:
            v = t / tau
            m_v, s_v, a = _online(m_v, s_v, v, valid, jnp.where(valid, v - u, 0.0), a)
        if not unit:
            m_s, s_s, _ = _online(m_s, s_s, s, valid)
        here = (labels >= start) & (labels < start + width)
        picked = jnp.take_along_axis(s, jnp.clip(labels - start, 0, width - 1)[:, None], axis=-1)[:, 0]
        label_s = jnp.where(here, picked, label_s)
        return (m_u, s_u), (m_v, s_v, a), (m_s, s_s), label_s

    init = ((minus_inf, zero), (minus_inf, zero, zero), (minus_inf, zero), zero)
    (m_u, s_u), (m_v, s_v, a), (m_s, s_s), label_s = jax.lax.fori_loop(0, count, body, init)
    lse_u = m_u + jnp.log(s_u)
    stats = {"lse_u": lse_u, "lse_s": lse_u if unit else m_s + jnp.log(s_s), "label_s": label_s}
    if spec.kl:
        stats["lse_v"], stats["p_v_minus_u"] = m_v + jnp.log(s_v), a / s_v
    return stats


def loss_from_statistics(stats, weights, coeffs, tau, spec):
    """The loss and metric sums of `logit_gradient.closed_form`, from the row statistics."""
    student_ce = stats["lse_s"] - stats["label_s"]
    metrics, per_token = {"student_ce": student_ce}, jnp.zeros_like(student_ce)
    if spec.kl:
        divergence = stats["p_v_minus_u"] - stats["lse_v"] + stats["lse_u"]
        per_token = per_token + tau * tau * coeffs["kl"] * divergence
        metrics["term/kl"] = divergence
        if "kl" in metric_names(spec):
            metrics["kl"] = divergence
    if spec.ce:
        per_token = per_token + coeffs["ce"] * student_ce
        metrics["term/ce"] = student_ce
    sums = {name: jax.lax.stop_gradient(jnp.sum(weights * value)) for name, value in metrics.items()}
    return jnp.sum(weights * per_token), sums


def _gradients(h_s, head_s, labels, weights, coeffs, tau, stats, spec, logits_of, width, vocab, *,
               grad_hidden: bool, head_dtype):
    """Pass 2: d(hidden) (rows, D) in h_s's dtype and d(head) (V, D) in `head_dtype` (None where not asked for),
    for d(loss) = `weights`' scale (the cotangent is folded into the weights by the caller)."""
    count, where = _slices(vocab, width)
    activation = elementwise_part(logits_of.student_logits)

    def body(j, carry):
        d_hidden, d_head = carry
        start, valid = where(j)
        z, s, t = logits_of(start)
        d_s = jnp.zeros_like(s)
        if spec.kl:
            q = jnp.exp(s / tau - stats["lse_u"][:, None])
            p = jnp.exp(t / tau - stats["lse_v"][:, None])
            d_s = d_s + tau * coeffs["kl"] * (q - p)
        if spec.ce:  # softmax(s) at temperature 1
            soft = jnp.exp(s - stats["lse_s"][:, None])
            onehot = start + jnp.arange(width) == labels[:, None]
            d_s = d_s + coeffs["ce"] * (soft - onehot)
        slope = jax.jvp(activation, (z,), (jnp.ones_like(z),))[1]
        dz = jnp.where(valid, weights[:, None] * d_s * slope, 0.0).astype(h_s.dtype)
        if d_hidden is not None:
            d_hidden = d_hidden + jnp.einsum("nV,VD->nD", dz, _head_slice(head_s, start, width, h_s.dtype),
                                             preferred_element_type=jnp.float32)
        if d_head is not None:
            part = jnp.einsum("nV,nD->VD", dz, h_s, preferred_element_type=jnp.float32).astype(head_dtype)
            kept = jax.lax.dynamic_slice_in_dim(d_head, start, width, axis=0)
            d_head = jax.lax.dynamic_update_slice_in_dim(d_head, jnp.where(valid[:, None], part, kept), start, 0)
        return d_hidden, d_head

    d_hidden = jnp.zeros(h_s.shape, jnp.float32) if grad_hidden else None
    d_head = None if head_dtype is None else jnp.zeros(head_s.shape, head_dtype)
    d_hidden, d_head = jax.lax.fori_loop(0, count, body, (d_hidden, d_head))
    return (None if d_hidden is None else d_hidden.astype(h_s.dtype)), d_head


class _LogitsOf:
    """Slice start -> (z, s, t) for fixed inputs, carrying the logits functions for pass 2's activation."""

    def __init__(self, h_s, head_s, h_t, head_t, width, student_logits, teacher_logits):
        self.args = (h_s, head_s, h_t, head_t)
        self.width, self.student_logits, self.teacher_logits = width, student_logits, teacher_logits

    def __call__(self, start):
        return _logits(*self.args, start, self.width, self.student_logits, self.teacher_logits)


def two_pass_logit_loss(h_s: jax.Array, head_s: jax.Array, h_t: jax.Array | None, head_t: jax.Array | None,
                        labels: jax.Array, weights: jax.Array, coeffs: dict, *, student_logits: LogitsFn,
                        teacher_logits: LogitsFn | None,
                        spec: LogitLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`fused_logit_loss`'s loss, metrics and gradients (for h_s and head_s) in two passes over the vocabulary.
    Shapes as there: h_s (B, T, D_s), head_s (V, D_s), h_t (B, T, D_t) or None, head_t (V, D_t) or None, labels
    and weights (B, T). `spec.vocab_slice` is the slice width (None: about 8M elements per (rows, slice) buffer).
    Settings outside `two_pass_applies` are refused."""
    if not two_pass_applies(spec, cached_teacher=False) or (spec.kl and h_t is None):
        raise ValueError("logit_impl='two_pass' computes forward KL and/or CE against a teacher's hidden states; "
                         "top_k, reverse_kl, jsd, diagnostics and a teacher cache need logit_impl='fused'.")
    batch, length = h_s.shape[:2]
    flat = lambda x: None if x is None else x.reshape(batch * length, *x.shape[2:])
    vocab, head_dtype = head_s.shape[0], head_s.dtype
    width = _slice_width(vocab, batch * length, spec.vocab_slice)
    shapes = dict(spec=spec, width=width, vocab=vocab)

    def forward(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        tau = coeffs["temperature"] if spec.kl else 1.0
        logits_of = _LogitsOf(flat(h_s), head_s, flat(h_t), head_t, width, student_logits, teacher_logits)
        stats = _statistics(batch * length, flat(labels), tau, logits_of=logits_of, **shapes)
        loss, sums = loss_from_statistics(stats, flat(weights).astype(jnp.float32), coeffs, tau, spec)
        return (loss, sums), stats

    def gradients(args, stats, cotangent, grad_hidden: bool, grad_head: bool):
        h_s, head_s, h_t, head_t, labels, weights, coeffs = args
        tau = coeffs["temperature"] if spec.kl else 1.0
        scaled = weights.reshape(-1).astype(jnp.float32) * cotangent.astype(jnp.float32)
        logits_of = _LogitsOf(flat(h_s), head_s, flat(h_t), head_t, width, student_logits, teacher_logits)
        d_hidden, d_head = _gradients(flat(h_s), head_s, flat(labels), scaled, coeffs, tau, stats, spec, logits_of,
                                      width, vocab, grad_hidden=grad_hidden,
                                      head_dtype=head_dtype if grad_head else None)
        return (None if d_hidden is None else d_hidden.reshape(h_s.shape)), d_head

    return statistics_loss(forward, gradients)(h_s, head_s, h_t, head_t, labels, weights, coeffs)


def statistics_loss(forward: Callable, gradients: Callable) -> Callable:
    """The `jax.custom_vjp` of a two-pass loss over (h_s, head_s, h_t, head_t, labels, weights, coeffs):
    `forward(*args) -> ((loss, metric sums), stats)` and `gradients(args, stats, cotangent, grad_hidden,
    grad_head) -> (d_hidden, d_head)` (None where not asked for: a frozen head costs no gradient pass)."""
    @jax.custom_vjp
    def loss_fn(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        return forward(h_s, head_s, h_t, head_t, labels, weights, coeffs)[0]

    def loss_fwd(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        args = jax.tree.map(lambda a: a.value, (h_s, head_s, h_t, head_t, labels, weights, coeffs),
                            is_leaf=lambda a: hasattr(a, "perturbed"))
        out, stats = forward(*args)
        # which gradients are wanted rides in the residuals' structure (None: not wanted)
        wanted = (jnp.zeros(()) if h_s.perturbed else None, jnp.zeros(()) if head_s.perturbed else None)
        return out, (args, stats, wanted)

    def loss_bwd(residuals, cotangents):
        args, stats, (want_hidden, want_head) = residuals
        d_hidden, d_head = gradients(args, stats, cotangents[0], want_hidden is not None, want_head is not None)
        return d_hidden, d_head, None, None, None, None, None

    loss_fn.defvjp(loss_fwd, loss_bwd, symbolic_zeros=True)
    return loss_fn


__all__ = ["two_pass_logit_loss", "two_pass_applies", "loss_from_statistics", "statistics_loss"]
