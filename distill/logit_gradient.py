"""Closed-form loss and gradient of the common logit objective: forward KL and/or hard-label CE, no top-k.

For a chunk of student pre-activation logits z (the head matmul's output), s = f(z) (f element-wise: the soft-cap),
u = s / tau, teacher v = t / tau, q = softmax(u), p = softmax(v), per row:

    KL(p || q) = sum_v p (v - u) - logsumexp(v) + logsumexp(u)          (sum p = 1)
    CE         = logsumexp(s) - s[label]
    d/ds [tau^2 w_kl KL + w_ce CE] = tau w_kl (q - p) + w_ce (softmax(s) - onehot(label))
    dz         = weight * d/ds * f'(z)

Differentiating `token_objective` with `jax.vjp` gives the same numbers, but through log-softmax's backward, with
log-probabilities of both models materialised: about twice as many passes over the (rows, V) float32 blocks.
Here the row statistics come from reductions over the logits and dz from one element-wise pass (on the 2-core
CPU: 2.3x faster per 32 x 262144 chunk, 1.7x with Gemma 2's soft-cap). `distill.logit_loss` uses this when
the loss has only these terms (`closed_form_applies`); everything else goes through autodiff.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def closed_form(z: jax.Array, t: jax.Array | None, labels: jax.Array, weights: jax.Array, coeffs: dict, *,
                activation: Callable[[jax.Array], jax.Array], kl: bool, ce: bool, unit_temperature: bool,
                report_kl: bool, gradient: bool) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
    """(loss, metric sums, dz or None) for z (..., V) float32, t (..., V) or None (no teacher: CE only), labels
    and weights (...). Metric names as `logit_loss.metric_names`: `student_ce`, `kl` (when `report_kl`),
    `term/kl`, `term/ce`."""
    s = activation(z)
    tau = coeffs["temperature"] if t is not None else 1.0
    u = s / tau
    lse_u = jax.nn.logsumexp(u, axis=-1, keepdims=True)
    lse_s = lse_u if unit_temperature or t is None else jax.nn.logsumexp(s, axis=-1, keepdims=True)
    student_ce = lse_s[..., 0] - jnp.take_along_axis(s, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    metrics = {"student_ce": student_ce}
    per_token = jnp.zeros_like(student_ce)
    if kl:
        v = jax.lax.stop_gradient(t.astype(jnp.float32)) / tau
        lse_v = jax.nn.logsumexp(v, axis=-1, keepdims=True)
        p = jnp.exp(v - lse_v)
        divergence = jnp.sum(p * (v - u), axis=-1) - lse_v[..., 0] + lse_u[..., 0]
        per_token = per_token + tau * tau * coeffs["kl"] * divergence
        metrics["term/kl"] = divergence
        if report_kl:
            metrics["kl"] = divergence
    if ce:
        per_token = per_token + coeffs["ce"] * student_ce
        metrics["term/ce"] = student_ce
    loss = jnp.sum(weights * per_token)
    sums = {name: jax.lax.stop_gradient(jnp.sum(weights * value)) for name, value in metrics.items()}
    if not gradient:
        return loss, sums, None
    q = jnp.exp(u - lse_u)
    d_s = tau * coeffs["kl"] * (q - p) if kl else jnp.zeros_like(s)
    if ce:
        soft = q if lse_s is lse_u else jnp.exp(s - lse_s)
        onehot = jnp.arange(s.shape[-1]) == labels[..., None]
        d_s = d_s + coeffs["ce"] * (soft - onehot)
    slope = jax.jvp(activation, (z,), (jnp.ones_like(z),))[1]  # f'(z): 1 - tanh^2 for the soft-cap
    return loss, sums, jax.lax.optimization_barrier(weights[..., None] * d_s * slope)


__all__ = ["closed_form"]
