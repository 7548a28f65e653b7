"""The fused logit loss's gradients: dz in closed form for the common objective (forward KL and/or hard-label CE,
no top-k), and the two matmuls that take dz back to the student's hidden states and head.

For a chunk of student pre-activation logits z (the head matmul's output), s = f(z) (f element-wise: the soft-cap),
u = s / tau, teacher v = t / tau, q = softmax(u), p = softmax(v), per row:

    KL(p || q) = sum_v p (v - u) - logsumexp(v) + logsumexp(u)          (sum p = 1)
    CE         = logsumexp(s) - s[label]
    d/ds [tau^2 w_kl KL + w_ce CE] = tau w_kl (q - p) + w_ce (softmax(s) - onehot(label))
    dz         = weight * d/ds * f'(z)

Differentiating `token_objective` with `jax.vjp` gives the same numbers, but through log-softmax's backward, with
log-probabilities of both models materialised: about twice as many passes over the (rows, V) float32 blocks.
Here the row statistics come from reductions over the logits and dz from one element-wise pass, fewer passes
over the largest arrays of the step. `distill.losses.divergence` uses this when
the loss has only these terms and a block holds several chunks (`closed_form_applies` says why); everything else
goes through autodiff.
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
    unit = unit_temperature or t is None  # u is s: its log-sum-exp and softmax serve the CE too
    lse_s = lse_u if unit else jax.nn.logsumexp(s, axis=-1, keepdims=True)
    student_ce = lse_s[..., 0] - jnp.take_along_axis(s, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    metrics = {"student_ce": student_ce}
    per_token = jnp.zeros_like(student_ce)
    if kl:
        if t is None:
            raise ValueError("the closed-form KL gradient needs the teacher's logits.")
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
        soft = q if unit else jnp.exp(s - lse_s)
        onehot = jnp.arange(s.shape[-1]) == labels[..., None]
        d_s = d_s + coeffs["ce"] * (soft - onehot)
    slope = jax.jvp(activation, (z,), (jnp.ones_like(z),))[1]  # f'(z): 1 - tanh^2 for the soft-cap
    return loss, sums, jax.lax.optimization_barrier(weights[..., None] * d_s * slope)


def hidden_gradient(dz: jax.Array, head: jax.Array) -> jax.Array:
    """dz @ head in the compute dtype of `head` (float32 accumulation), returned in that dtype: the gradient of
    the head matmul (`logit_loss._head_matmul`) with respect to its hidden states."""
    return jnp.einsum("...V,VD->...D", dz.astype(head.dtype), head,
                      preferred_element_type=jnp.float32).astype(head.dtype)


def head_gradient(dz: jax.Array, hidden: jax.Array, vocab_slice: int | None) -> jax.Array:
    """dz^T @ hidden, (V, D) float32: the gradient of the head matmul (`logit_loss._head_matmul`) with respect to a
    head in `hidden.dtype`.
    Both operands are in the compute dtype (`dz` is cast), accumulated in float32: with bfloat16 compute this is a
    bfloat16 matmul, not a float32 one on upcast operands (what autodiff of the float32-output forward matmul
    makes; on a GPU that runs at TF32 rate at best, over twice the bytes). With `vocab_slice` it is made about
    `vocab_slice` vocabulary rows at a time: XLA:CPU copies dz transposed for this matmul, a (block, V) buffer at
    once, a (block, vocab_slice) one per slice."""
    dz = dz.astype(hidden.dtype)
    rows = lambda dz_part: jnp.einsum("...V,...D->VD", dz_part, hidden, preferred_element_type=jnp.float32)
    vocab = dz.shape[-1]
    size = _divisor_near(vocab, vocab_slice) if vocab_slice else vocab
    if size == vocab:
        return rows(dz)

    def one(i, out):
        part = rows(jax.lax.dynamic_slice_in_dim(dz, i * size, size, axis=-1))
        return jax.lax.dynamic_update_slice_in_dim(out, part, i * size, axis=0)

    # Every row is overwritten. The initial value depends on dz so that XLA cannot schedule this (V, D) buffer's
    # allocation early (a constant broadcast is scheduled first, and would be live through the whole loss).
    start = jnp.broadcast_to(jnp.zeros((), jnp.float32) * dz.reshape(-1)[0], (vocab, hidden.shape[-1]))
    return jax.lax.fori_loop(0, vocab // size, one, start)


def _divisor_near(total: int, wanted: int) -> int:
    """The largest divisor of `total` in [wanted / 2, wanted] (256000 -> 32000 for 32768), else `total`."""
    for size in range(min(wanted, total), max(1, wanted // 2) - 1, -1):
        if total % size == 0:
            return size
    return total


__all__ = ["closed_form", "hidden_gradient", "head_gradient"]
