"""Logit distillation: forward KL, reverse KL, generalised JSD and hard-label CE, fused and chunked.

Definitions, per supervised position (student logits s, teacher logits t, both float32 after the models' soft-cap,
temperature tau, p = softmax(t / tau), q = softmax(s / tau)):

    kl          KL(p || q) = sum_v p (log p - log q)                      (forward, "mean-seeking")
    reverse_kl  KL(q || p)                                               ("mode-seeking")
    jsd         beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q   (beta = 0.5: symmetric JSD)
    ce          -log softmax(s)[label]                                   (temperature 1, hard labels)

    loss = tau^2 (w_kl kl + w_rkl reverse_kl + w_jsd jsd) + w_ce ce

The tau^2 factor (Hinton et al.) keeps the soft-target gradients the same size when tau changes, so a temperature
schedule (e.g. 3 -> 1) does not also rescale the learning rate. Positions are weighted by `weights` (B, T), already
divided by the number of supervised tokens of the whole optimizer step, so the sum over positions is the mean.
With `top_k`, the teacher distribution is renormalised over its top-k logits (ties at the k-th value included)
and the student keeps its full-vocabulary log-probabilities, so mass outside the teacher's top-k is penalised.

`fused_logit_loss` is the fast path: a `jax.custom_vjp` that walks the sequence in chunks, computes teacher and
student logits of one chunk from final hidden states and head matrices, the loss, and in the same pass the gradient
with respect to the student logits, back-propagated at once into d(hidden) and d(head) (accumulated over chunks in
float32). Nothing is recomputed in the backward pass, and (B, T, V) logits of either model never exist: the peak
is one chunk of logits per model, plus the (V, D) head gradient. `reference_logit_loss` is the plain version on
full logits, kept for tests and debugging.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]  # (hidden (..., D), head (V, D)) -> float32 logits (..., V)
BASE_METRICS = ("kl", "student_ce", "teacher_ce", "logit_corr")


@dataclasses.dataclass(frozen=True)
class LogitLossSpec:
    """Static choices (each changes the compiled program). Weights and temperature are traced values."""

    kl: bool = True
    reverse_kl: bool = False
    jsd: bool = False
    ce: bool = False
    jsd_beta: float = 0.5
    top_k: int | None = None
    chunk: int = 32  # rows (batch x sequence positions) per chunk; the sequence is cut in chunk // batch positions
    unit_temperature: bool = False  # the temperature is 1 for the whole run: reuse log-probs for the CE
    teacher: bool = True  # False: no teacher at all (plain cross-entropy training), no teacher metrics

    def __post_init__(self):
        if not self.teacher and (self.kl or self.reverse_kl or self.jsd or self.top_k):
            raise ValueError("without a teacher only the hard-label ce term is possible; set kl/reverse_kl/jsd "
                             "weights to 0 and top_k to None, or pass a teacher.")
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"jsd_beta={self.jsd_beta} must lie strictly between 0 and 1 (0.5 is the symmetric JSD);"
                             " use the kl / reverse_kl terms for the end points.")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be a positive number of teacher logits, or None.")
        if self.top_k is not None and self.reverse_kl:
            raise ValueError("reverse_kl with top_k is infinite (the truncated teacher has zero mass where the student "
                             "has some); use kl or jsd with top_k, or drop top_k.")
        if self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} must be at least 1 row.")


def metric_names(spec: LogitLossSpec) -> tuple[str, ...]:
    """Metric sums returned with the loss (weighted means when weights sum to one)."""
    terms = [name for name in ("kl", "reverse_kl", "jsd", "ce") if getattr(spec, name)]
    return (BASE_METRICS if spec.teacher else ("student_ce",)) + tuple(f"term/{name}" for name in terms)


def _xlogy_diff(p: jax.Array, log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """sum_v p (log p - log q), with 0 log 0 = 0 (and no NaN from -inf log p where p = 0)."""
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def _keep_top_k(logits: jax.Array, k: int) -> jax.Array:
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


def _logit_correlation(s: jax.Array, t: jax.Array) -> jax.Array:
    """Pearson correlation over the vocabulary, from raw moments of max-shifted logits: one fused pass over the
    (rows, V) block (the shift keeps the moments well conditioned in float32)."""
    s = s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    t = t - jnp.max(t, axis=-1, keepdims=True)
    n = s.shape[-1]
    sum_s, sum_t = jnp.sum(s, axis=-1), jnp.sum(t, axis=-1)
    covariance = jnp.sum(s * t, axis=-1) - sum_s * sum_t / n
    var_s = jnp.sum(s * s, axis=-1) - sum_s * sum_s / n
    var_t = jnp.sum(t * t, axis=-1) - sum_t * sum_t / n
    return covariance * jax.lax.rsqrt(jnp.maximum(var_s * var_t, 1e-30))


def token_objective(s: jax.Array, t: jax.Array, labels: jax.Array, weights: jax.Array, coeffs: dict,
                    spec: LogitLossSpec) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted sum over positions of the loss, and metric sums. s, t: (..., V) float32; labels, weights: (...).

    Metrics: `term/<name>` is each active logit term at the current temperature (before its weight and tau^2);
    `kl` is KL(teacher || student) at temperature 1 over the full vocabulary, comparable across a temperature
    schedule and with top-k; `student_ce`, `teacher_ce` are next-token cross-entropies; `logit_corr` is the
    Pearson correlation of the two logit vectors. Without a teacher (`t` None) only the CE and its metric."""
    if t is None:
        labels = labels[..., None].astype(jnp.int32)
        student_ce = -jnp.take_along_axis(jax.nn.log_softmax(s.astype(jnp.float32), axis=-1), labels, axis=-1)[..., 0]
        weights = weights.astype(jnp.float32)
        per_token = coeffs["ce"] * student_ce if spec.ce else jnp.zeros_like(student_ce)
        metric_sums = {"student_ce": jax.lax.stop_gradient(jnp.sum(weights * student_ce))}
        if spec.ce:
            metric_sums["term/ce"] = metric_sums["student_ce"]
        return jnp.sum(weights * per_token), metric_sums
    s, t = s.astype(jnp.float32), jax.lax.stop_gradient(t.astype(jnp.float32))
    tau = coeffs["temperature"]
    log_q = jax.nn.log_softmax(s / tau, axis=-1)
    t_scaled = t / tau if spec.top_k is None else _keep_top_k(t / tau, spec.top_k)
    log_p = jax.nn.log_softmax(t_scaled, axis=-1)
    p = jnp.exp(log_p)
    terms = {}
    if spec.kl:
        terms["kl"] = _xlogy_diff(p, log_p, log_q)
    if spec.reverse_kl or spec.jsd:
        q = jnp.exp(log_q)
    if spec.reverse_kl:
        terms["reverse_kl"] = _xlogy_diff(q, log_q, log_p)
    if spec.jsd:
        beta = spec.jsd_beta
        log_m = jnp.logaddexp(math.log(beta) + log_p, math.log(1.0 - beta) + log_q)
        terms["jsd"] = beta * _xlogy_diff(p, log_p, log_m) + (1.0 - beta) * _xlogy_diff(q, log_q, log_m)
    soft = sum((coeffs[name] * value for name, value in terms.items()), jnp.zeros(s.shape[:-1], jnp.float32))
    per_token = tau * tau * soft
    same_as_unit = spec.unit_temperature and spec.top_k is None
    log_q1 = log_q if spec.unit_temperature else jax.nn.log_softmax(s, axis=-1)
    log_p1 = log_p if same_as_unit else jax.nn.log_softmax(t, axis=-1)
    kl1 = terms["kl"] if same_as_unit and spec.kl else _xlogy_diff(jnp.exp(log_p1), log_p1, log_q1)
    labels = labels[..., None].astype(jnp.int32)
    student_ce = -jnp.take_along_axis(log_q1, labels, axis=-1)[..., 0]
    if spec.ce:
        terms["ce"] = student_ce
        per_token = per_token + coeffs["ce"] * student_ce
    teacher_ce = -jnp.take_along_axis(log_p1, labels, axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    metrics = {"kl": kl1, "student_ce": student_ce, "teacher_ce": teacher_ce, "logit_corr": _logit_correlation(s, t),
               **{f"term/{name}": value for name, value in terms.items()}}
    metric_sums = {name: jax.lax.stop_gradient(jnp.sum(weights * value)) for name, value in metrics.items()}
    return jnp.sum(weights * per_token), metric_sums


def reference_logit_loss(student_logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array,
                         weights: jax.Array, coeffs: dict, spec: LogitLossSpec):
    """The unchunked loss on full (B, T, V) logits; differentiated by plain autodiff."""
    return token_objective(student_logits, teacher_logits, labels, weights, coeffs, spec)


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
    """(B, T, ...) -> (T / chunk, B, chunk, ...), padding T with zeros to a multiple of `chunk`."""
    batch, length = x.shape[:2]
    pad = -length % chunk
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(batch, (length + pad) // chunk, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unchunked(x: jax.Array, length: int) -> jax.Array:
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _scan_chunks(h_s, head_s, h_t, head_t, labels, weights, coeffs, *, student_logits: LogitsFn,
                 teacher_logits: LogitsFn, spec: LogitLossSpec, grad_hidden: bool, grad_head: bool):
    """One pass over the sequence: loss, metric sums and (optionally) d(hidden_s), d(head_s) for d(loss) = 1."""
    batch, length = h_s.shape[:2]
    chunk = max(1, min(length, spec.chunk // batch))
    h_t_chunks = None if h_t is None else _chunked(h_t, chunk)
    xs = (_chunked(h_s, chunk), h_t_chunks, _chunked(labels, chunk), _chunked(weights, chunk))
    zero_metrics = {name: jnp.zeros((), jnp.float32) for name in metric_names(spec)}
    d_head0 = jnp.zeros(head_s.shape, jnp.float32) if grad_head else None

    def body(carry, x):
        loss_acc, metrics_acc, d_head = carry
        hs, ht, lab, w = x
        t_logits = None if ht is None else jax.lax.stop_gradient(teacher_logits(ht, head_t))

        def objective(s_logits):
            return token_objective(s_logits, t_logits, lab, w, coeffs, spec)

        d_hidden = None
        if grad_hidden or grad_head:
            s_logits, head_vjp = jax.vjp(student_logits, hs, head_s)
            loss, objective_vjp, metrics = jax.vjp(objective, s_logits, has_aux=True)
            (d_logits,) = objective_vjp(jnp.ones((), loss.dtype))
            d_hs, d_head_chunk = head_vjp(d_logits)
            d_hidden = d_hs if grad_hidden else None
            if grad_head:
                d_head = d_head + d_head_chunk.astype(jnp.float32)
        else:
            loss, metrics = objective(student_logits(hs, head_s))
        metrics_acc = jax.tree.map(jnp.add, metrics_acc, metrics)
        return (loss_acc + loss, metrics_acc, d_head), d_hidden

    (loss, metrics, d_head), d_hidden = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zero_metrics, d_head0), xs)
    if grad_hidden:
        d_hidden = _unchunked(d_hidden, length)
    return loss, metrics, d_hidden, d_head


def fused_logit_loss(h_s: jax.Array, head_s: jax.Array, h_t: jax.Array, head_t: jax.Array, labels: jax.Array,
                     weights: jax.Array, coeffs: dict, *, student_logits: LogitsFn, teacher_logits: LogitsFn,
                     spec: LogitLossSpec) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Chunked logit loss with a fused gradient. h_s (B, T, D_s), head_s (V, D_s), h_t (B, T, D_t), head_t (V, D_t),
    labels / weights (B, T). Returns (loss, metric sums); only h_s and head_s receive gradients. h_t and head_t are
    None without a teacher (spec.teacher False)."""
    kwargs = dict(student_logits=student_logits, teacher_logits=teacher_logits, spec=spec)

    @jax.custom_vjp
    def loss_fn(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        loss, metrics, _, _ = _scan_chunks(h_s, head_s, h_t, head_t, labels, weights, coeffs,
                                           grad_hidden=False, grad_head=False, **kwargs)
        return loss, metrics

    def loss_fwd(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        # With symbolic_zeros, each argument says whether it is being differentiated: a frozen head costs no
        # (V, D) gradient matmul.
        values = jax.tree.map(lambda a: a.value, (h_s, head_s, h_t, head_t, labels, weights, coeffs),
                              is_leaf=lambda a: hasattr(a, "perturbed"))
        loss, metrics, d_hidden, d_head = _scan_chunks(*values, grad_hidden=h_s.perturbed,
                                                       grad_head=head_s.perturbed, **kwargs)
        if d_head is not None:
            d_head = d_head.astype(head_s.value.dtype)
        return (loss, metrics), (d_hidden, d_head)

    def loss_bwd(residuals, cotangents):
        d_hidden, d_head = residuals
        g = cotangents[0]
        scale = (lambda d: None if d is None else (d * g.astype(d.dtype)))
        return scale(d_hidden), scale(d_head), None, None, None, None, None

    loss_fn.defvjp(loss_fwd, loss_bwd, symbolic_zeros=True)
    return loss_fn(h_s, head_s, h_t, head_t, labels, weights, coeffs)


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


__all__ = ["LogitLossSpec", "fused_logit_loss", "reference_logit_loss", "token_objective", "labels_and_weights",
           "metric_names"]
