"""The teacher as its top k: the input of the logit loss's top-k path, made online from the teacher's logits
(`from_logits`) or read from a teacher cache (`distill.inputs.topk_cache`), and the soft terms computed from it
(`topk_terms`). Both sources go through `topk_terms`, so a run from an unquantised cache computes what the
online top-k run computes.

`TopK` holds, per position, the teacher's k most likely ids, their log-probabilities at temperature 1 (the full
vocabulary's log-softmax, not renormalised) and the residual log(1 - sum of their probabilities). At temperature
tau the renormalised top k is lp / tau - logsumexp(lp / tau), which equals softmax(t / tau) over the top-k logits
t: the cache needs no logits, only their log-probabilities.

Two ways to compare it with the student's full-vocabulary distribution q (`LogitLossSettings.top_k_mode`):

    renormalised  p renormalised over the teacher's top k; KL(p || q) sums over those k ids with the student's
                  full-vocabulary log q, so the student's mass outside them is penalised only through log q's
                  normaliser. The online top-k path has always done this; it needs no residual.
    residual      the k ids plus one bucket for everything else: the teacher's bucket holds exp(residual), the
                  student's 1 - sum of q over the k ids, so the student is told how much mass the tail should
                  keep, not to drive it to zero. At temperature tau != 1 the bucket is treated as one more
                  category with log-probability `residual` (the tail's own temperature scaling is not cached).

The default is `renormalised`: with it an exact cache equals the online top-k run, and it is the closer of the two
to the full-vocabulary KL, in loss and in gradient, at every k measured when the teacher is as peaked as a trained
LM (bench/teacher_cache_topk_mode.py: a tiny teacher and its one-layer-shorter student; the table is in the
docs, CHANGELOG). The bucket's gradient is the closer one only for a flat teacher whose top k hold a small share of
the mass, where a top-k cache loses most of the distribution either way.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

TOP_K_MODES = ("renormalised", "residual")
CACHE_KEYS = ("topk_ids", "topk_logprobs", "residual")  # the batch keys a cached teacher's batches carry


class TopK(NamedTuple):
    """The teacher's top k per position: ids (..., k) int32, log-probabilities (..., k) float32 at temperature 1,
    most likely first, residual (...) float32 = log(1 - their total probability)."""

    ids: jax.Array
    logprobs: jax.Array
    residual: jax.Array


def from_logits(t: jax.Array, k: int) -> TopK:
    """The top k of float32 teacher logits (..., V) at temperature 1 (exactly k: of tied logits the lower ids)."""
    t = jax.lax.stop_gradient(t.astype(jnp.float32))
    values, ids = jax.lax.top_k(t, k)
    logprobs = values - jax.nn.logsumexp(t, axis=-1, keepdims=True)
    return TopK(ids.astype(jnp.int32), logprobs, residual_of(logprobs))


def residual_of(logprobs: jax.Array) -> jax.Array:
    """log(1 - sum exp(logprobs)) over the last axis; -inf when they hold all the mass."""
    return jnp.log1p(-jnp.clip(jnp.sum(jnp.exp(logprobs), axis=-1), 0.0, 1.0))


def from_batch(batch, k: int | None = None) -> TopK:
    """The cached top k of a batch (`TeacherCache.batches`' keys), cut to its first `k` (they are sorted: the
    first k of a cached k' >= k are the top k) with the residual recomputed for them."""
    ids, logprobs, residual = (batch[key] for key in CACHE_KEYS)
    if k is not None and k < ids.shape[-1]:
        ids, logprobs = ids[..., :k], logprobs[..., :k]
        residual = residual_of(logprobs)
    return TopK(ids.astype(jnp.int32), logprobs.astype(jnp.float32), residual.astype(jnp.float32))


def _xlogy_diff(p, log_p, log_q):
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def _log1m_exp(log_x: jax.Array) -> jax.Array:
    """log(1 - exp(log_x)) for log_x <= 0, clamped away from log 0."""
    return jnp.log(jnp.maximum(-jnp.expm1(jnp.minimum(log_x, 0.0)), 1e-30))


def _pair(top: TopK, log_q: jax.Array, tau, mode: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p, log q on the same categories, log of the student's mass outside them): the k ids renormalised, or
    the k ids and the residual bucket (last category)."""
    log_q_k = jnp.take_along_axis(log_q, top.ids, axis=-1)
    log_q_rest = _log1m_exp(jax.nn.logsumexp(log_q_k, axis=-1))
    if mode == "renormalised":
        return jax.nn.log_softmax(top.logprobs / tau, axis=-1), log_q_k, log_q_rest
    teacher = jnp.concatenate([top.logprobs, top.residual[..., None]], axis=-1)
    student = jnp.concatenate([log_q_k, log_q_rest[..., None]], axis=-1)
    return jax.nn.log_softmax(teacher / tau, axis=-1), student, jnp.full_like(log_q_rest, -jnp.inf)


def topk_terms(top: TopK, log_q: jax.Array, tau, *, kl: bool, jsd: bool, jsd_beta: float,
               mode: str = "renormalised") -> dict[str, jax.Array]:
    """Per-position forward KL(p || q) and generalised JSD(beta) of the teacher's top k `top` against the
    student's full-vocabulary log-probabilities `log_q` (..., V) at temperature tau (module docstring). JSD's
    mixture m = beta p + (1 - beta) q; where p is 0 (outside the categories) q log(q / m) = -q log(1 - beta),
    summed in closed form from the student's outside mass."""
    log_p, log_q_c, log_q_rest = _pair(top, log_q, tau, mode)
    p = jnp.exp(log_p)
    out = {}
    if kl:
        out["kl"] = _xlogy_diff(p, log_p, log_q_c)
    if jsd:
        if jsd_beta == 0.0:
            out["jsd"] = _xlogy_diff(p, log_p, log_q_c)
        else:  # jsd_beta == 1 with a top k is refused by LogitLossSettings
            log_m = jnp.logaddexp(math.log(jsd_beta) + log_p, math.log(1.0 - jsd_beta) + log_q_c)
            outside = -jnp.exp(log_q_rest) * math.log(1.0 - jsd_beta)
            out["jsd"] = (jsd_beta * _xlogy_diff(p, log_p, log_m)
                          + (1.0 - jsd_beta) * (_xlogy_diff(jnp.exp(log_q_c), log_q_c, log_m) + outside))
    return out


def check_mode(mode: str) -> str:
    if mode not in TOP_K_MODES:
        raise ValueError(f"top_k_mode={mode!r}: choose {' or '.join(TOP_K_MODES)} (distill.losses.topk_teacher).")
    return mode


__all__ = ["TopK", "TOP_K_MODES", "CACHE_KEYS", "from_logits", "from_batch", "residual_of", "topk_terms",
           "check_mode"]
