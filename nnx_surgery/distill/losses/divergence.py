"""Logit distillation: forward KL, reverse KL, generalised JSD and hard-label CE, fused and chunked.

Definitions, per supervised position (student logits s, teacher logits t, both float32 after the models' soft-cap,
temperature tau, p = softmax(t / tau), q = softmax(s / tau)):

    kl          KL(p || q) = sum_v p (log p - log q)                      (forward, "mean-seeking")
    reverse_kl  KL(q || p)                                               ("mode-seeking")
    jsd         beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q   (beta = 0.5: symmetric JSD)
                the generalised JSD(beta) of GKD (Agarwal et al. 2024) and TRL's GKDTrainer; beta = 0 is forward KL
                KL(p || q) and beta = 1 reverse KL KL(q || p): the limits of JSD(beta) / beta as beta -> 0 and of
                JSD(beta) / (1 - beta) as beta -> 1 (JSD(beta) itself is ~ beta KL(p || q) near 0, so the end
                points are not continuous in scale, as in TRL)
    ce          -log softmax(s)[label]                                   (temperature 1, hard labels)

    loss = tau^2 (w_kl kl + w_rkl reverse_kl + w_jsd jsd) + w_ce ce

The tau^2 factor (Hinton et al.) keeps the soft-target gradients the same size when tau changes, so a temperature
schedule (e.g. 3 -> 1) does not also rescale the learning rate. Positions are weighted by `weights` (B, T), already
divided by the number of supervised tokens of the whole optimizer step, so the sum over positions is the mean.
With `top_k`, the teacher is its top k (`distill.losses.topk_teacher`: made here from its logits, or read from a teacher
cache, the same loss code either way): renormalised over those k (or with a residual bucket, `top_k_mode`), and
the student keeps its full-vocabulary log-probabilities, so mass outside the teacher's top-k is penalised.

`fused_logit_loss` is the fast path: a `jax.custom_vjp` that walks the sequence in blocks and, inside each block,
in chunks. Per block (`block` rows, default `chunk`): the teacher's logits in one matmul (they need no gradient,
and large matmuls run faster than chunk-sized ones on CPU), then per chunk the student's logits, the
loss and its gradient with respect to the student logits (nothing is recomputed in a backward pass), and per block
again the two backward matmuls d(hidden) = dz @ head and d(head) += dz^T @ hidden (accumulated in float32). So
(B, T, V) logits of either model never exist: the peak is one block of teacher logits and of dz, a few chunks of
student logits, plus the (V, D) head gradient. `block` trades that memory for matmul efficiency: on a GPU with
large chunks leave it at `chunk`. For forward KL and CE the loss's gradient is written in closed form
(`distill.losses.logit_grad`, when a block holds several chunks), otherwise it is autodiff of `token_objective`.
`reference_logit_loss` is the plain version on full logits, kept for tests and debugging.

The fused loss needs the student's logits in the form `f(hidden @ head.T)` with `f` element-wise (the soft-cap of
every Gemma): it differentiates the matmul itself and `f` through `logits_fn` applied to a (..., 1) hidden and a
(1, 1) unit head (`elementwise_part`).

Metrics are sums like the loss. Always: `student_ce` and each active term (`term/<name>`); `kl` (temperature 1)
when it equals the loss's KL term. With `diagnostics` also `teacher_ce`, `logit_corr` and `kl` in every case:
full-vocabulary passes that the evaluation step makes, and the train step skips unless asked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from .logit_grad import closed_form, head_gradient, hidden_gradient
from .topk_teacher import TopK, check_mode, from_logits, topk_terms

LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]  # (hidden (..., D), head (V, D)) -> float32 logits (..., V)
DIAGNOSTICS = ("kl", "teacher_ce", "logit_corr")


@dataclasses.dataclass(frozen=True)
class LogitLossSettings:
    """Static settings of the fused logit loss (each changes the compiled program): which kinds are on (their
    weights and the temperature are traced values), top-k, and the chunking that bounds its memory."""

    kl: bool = True
    reverse_kl: bool = False
    jsd: bool = False
    ce: bool = False
    jsd_beta: float = 0.5
    top_k: int | None = None
    chunk: int = 32  # rows (batch x sequence positions) per chunk; the sequence is cut in chunk // batch positions
    unit_temperature: bool = False  # the temperature is 1 for the whole run: reuse log-probs for the CE
    teacher: bool = True  # False: no teacher at all (plain cross-entropy training), no teacher metrics
    diagnostics: bool = False  # also teacher_ce, logit_corr and the temperature-1 kl (extra vocabulary passes)
    block: int | None = None  # rows per teacher-logits / head-gradient block (a multiple of chunk); None: chunk
    vocab_slice: int | None = None  # about this many vocabulary rows per head-gradient matmul; None: all at once
    top_k_mode: str = "renormalised"  # or "residual": the top k plus a bucket for the rest (distill.losses.topk_teacher)

    def __post_init__(self):
        if not self.teacher and (self.kl or self.reverse_kl or self.jsd or self.top_k):
            raise ValueError("without a teacher only the hard-label ce term is possible; set kl/reverse_kl/jsd "
                             "weights to 0 and top_k to None, or pass a teacher.")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta={self.jsd_beta} must lie in [0, 1] (0.5 is the symmetric JSD, 0 forward KL, "
                             "1 reverse KL).")
        if self.top_k is not None and self.jsd and self.jsd_beta == 1.0:
            raise ValueError("jsd with jsd_beta=1 is reverse KL, infinite with top_k (the truncated teacher has zero "
                             "mass where the student has some); lower jsd_beta or drop top_k.")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be a positive number of teacher logits, or None.")
        if self.top_k is not None and self.reverse_kl:
            raise ValueError("reverse_kl with top_k is infinite (the truncated teacher has zero mass where the student "
                             "has some); use kl or jsd with top_k, or drop top_k.")
        check_mode(self.top_k_mode)
        if self.chunk < 1:
            raise ValueError(f"chunk={self.chunk} must be at least 1 row.")
        if self.block is not None and self.block < self.chunk:
            raise ValueError(f"block={self.block} rows is smaller than chunk={self.chunk}; a block holds whole "
                             "chunks: raise it, or set None (one chunk per block).")


def _kl_is_the_term(spec: LogitLossSettings) -> bool:
    """The temperature-1 KL metric is the loss's own KL term (no extra work to report it)."""
    return spec.kl and spec.unit_temperature and spec.top_k is None


def metric_names(spec: LogitLossSettings) -> tuple[str, ...]:
    """Metric sums returned with the loss (weighted means when weights sum to one)."""
    terms = tuple(f"term/{name}" for name in ("kl", "reverse_kl", "jsd", "ce") if getattr(spec, name))
    if not spec.teacher:
        return ("student_ce",) + terms
    if spec.diagnostics:
        return ("student_ce",) + DIAGNOSTICS + terms
    return ("student_ce",) + ("kl",) * _kl_is_the_term(spec) + terms


def closed_form_applies(spec: LogitLossSettings, chunks_per_block: int) -> bool:
    """The fused loss computes dz in closed form (`distill.losses.logit_grad`) for forward KL and/or CE terms without
    top-k or diagnostics, when a block holds several chunks (each chunk's dz is then written into the block's
    buffer): on CPU that is faster than autodiff of `token_objective`. With one chunk per block (the GPU setting)
    XLA would compute dz twice from materialised p and q (once per consumer matmul), which is slower, so that case
    stays on autodiff, as do the other objectives."""
    return chunks_per_block > 1 and not (spec.reverse_kl or spec.jsd or spec.top_k is not None or spec.diagnostics)


def _xlogy_diff(p: jax.Array, log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """sum_v p (log p - log q), with 0 log 0 = 0 (and no NaN from -inf log p where p = 0)."""
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def _generalised_jsd(p, log_p, q, log_q, beta: float) -> jax.Array:
    """JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q; its normalised limits at the
    end points: KL(p || q) at beta = 0, KL(q || p) at beta = 1 (module docstring)."""
    if beta == 0.0:
        return _xlogy_diff(p, log_p, log_q)
    if beta == 1.0:
        return _xlogy_diff(q, log_q, log_p)
    log_m = jnp.logaddexp(math.log(beta) + log_p, math.log(1.0 - beta) + log_q)
    return beta * _xlogy_diff(p, log_p, log_m) + (1.0 - beta) * _xlogy_diff(q, log_q, log_m)


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


def _full_terms(t: jax.Array, log_q: jax.Array, tau, spec: LogitLossSettings) -> tuple[dict, jax.Array]:
    """The soft terms against the teacher's full distribution softmax(t / tau), and its log-probabilities."""
    log_p = jax.nn.log_softmax(t / tau, axis=-1)
    p, terms = jnp.exp(log_p), {}
    if spec.kl:
        terms["kl"] = _xlogy_diff(p, log_p, log_q)
    if spec.reverse_kl or spec.jsd:
        q = jnp.exp(log_q)
    if spec.reverse_kl:
        terms["reverse_kl"] = _xlogy_diff(q, log_q, log_p)
    if spec.jsd:
        terms["jsd"] = _generalised_jsd(p, log_p, q, log_q, spec.jsd_beta)
    return terms, log_p


def token_objective(s: jax.Array, t: jax.Array | TopK | None, labels: jax.Array, weights: jax.Array, coeffs: dict,
                    spec: LogitLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted sum over positions of the loss, and metric sums. s, t: (..., V) float32; labels, weights: (...).

    Metrics: `term/<name>` is each active logit term at the current temperature (before its weight and tau^2);
    `student_ce` the next-token cross-entropy; `kl` is KL(teacher || student) at temperature 1 over the full
    vocabulary, comparable across a temperature schedule and with top-k (reported when it is the loss's KL term,
    or with `spec.diagnostics`); with `spec.diagnostics` also `teacher_ce` and `logit_corr` (Pearson correlation
    of the two logit vectors). Without a teacher (`t` None) only the CE and its metric. `t` may be the teacher's
    `TopK` (a cached teacher, with `spec.top_k`): then no diagnostics."""
    if t is None:
        labels = labels[..., None].astype(jnp.int32)
        student_ce = -jnp.take_along_axis(jax.nn.log_softmax(s.astype(jnp.float32), axis=-1), labels, axis=-1)[..., 0]
        weights = weights.astype(jnp.float32)
        per_token = coeffs["ce"] * student_ce if spec.ce else jnp.zeros_like(student_ce)
        metric_sums = {"student_ce": jax.lax.stop_gradient(jnp.sum(weights * student_ce))}
        if spec.ce:
            metric_sums["term/ce"] = metric_sums["student_ce"]
        return jnp.sum(weights * per_token), metric_sums
    s = s.astype(jnp.float32)
    tau = coeffs["temperature"]
    log_q = jax.nn.log_softmax(s / tau, axis=-1)
    log_p = None
    if spec.top_k is not None:  # the teacher as its top k, from its logits or from a cache
        top = t if isinstance(t, TopK) else from_logits(t, spec.top_k)
        terms = topk_terms(top, log_q, tau, kl=spec.kl, jsd=spec.jsd, jsd_beta=spec.jsd_beta, mode=spec.top_k_mode)
    elif isinstance(t, TopK):
        raise ValueError("a cached teacher's top k needs the loss's top_k (LogitLossSettings.top_k).")
    else:
        terms, log_p = _full_terms(jax.lax.stop_gradient(t.astype(jnp.float32)), log_q, tau, spec)
    soft = sum((coeffs[name] * value for name, value in terms.items()), jnp.zeros(s.shape[:-1], jnp.float32))
    per_token = tau * tau * soft
    labels = labels[..., None].astype(jnp.int32)
    log_q1 = log_q if spec.unit_temperature else (jax.nn.log_softmax(s, axis=-1) if spec.diagnostics else None)
    if log_q1 is not None:
        student_ce = -jnp.take_along_axis(log_q1, labels, axis=-1)[..., 0]
    else:  # one reduction over the vocabulary instead of temperature-1 log-probabilities
        student_ce = jax.nn.logsumexp(s, axis=-1) - jnp.take_along_axis(s, labels, axis=-1)[..., 0]
    if spec.ce:
        terms["ce"] = student_ce
        per_token = per_token + coeffs["ce"] * student_ce
    metrics = {"student_ce": student_ce, **{f"term/{name}": value for name, value in terms.items()}}
    if _kl_is_the_term(spec):
        metrics["kl"] = terms["kl"]
    if spec.diagnostics:  # needs the full teacher logits (no cached teacher: refused by DistillConfig)
        if isinstance(t, TopK):
            raise ValueError("the logit diagnostics need the teacher's full logits, not a cached top k.")
        t = jax.lax.stop_gradient(t.astype(jnp.float32))
        log_p1 = log_p if spec.unit_temperature and log_p is not None else jax.nn.log_softmax(t, axis=-1)
        if "kl" not in metrics:
            assert log_q1 is not None  # computed above whenever spec.diagnostics is on
            metrics["kl"] = _xlogy_diff(jnp.exp(log_p1), log_p1, log_q1)
        metrics["teacher_ce"] = -jnp.take_along_axis(log_p1, labels, axis=-1)[..., 0]
        metrics["logit_corr"] = _logit_correlation(s, t)
    weights = weights.astype(jnp.float32)
    metric_sums = {name: jax.lax.stop_gradient(jnp.sum(weights * value)) for name, value in metrics.items()}
    return jnp.sum(weights * per_token), metric_sums


def reference_logit_loss(student_logits: jax.Array, teacher_logits: jax.Array | TopK | None, labels: jax.Array,
                         weights: jax.Array, coeffs: dict, spec: LogitLossSettings):
    """The unchunked loss on full (B, T, V) logits; differentiated by plain autodiff."""
    return token_objective(student_logits, teacher_logits, labels, weights, coeffs, spec)


def row_blocks(x: jax.Array, rows: int) -> jax.Array:
    """(N, ...) -> (ceil(N / rows), rows, ...), padding N with zeros: rows of a flattened batch for `lax.map`."""
    pad = -x.shape[0] % rows
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, rows, *x.shape[1:])


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


def _head_matmul(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """hidden @ head.T with float32 results, the matmul of `DistillModel.logits_from_hidden`."""
    return jnp.einsum("...D,VD->...V", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)


def elementwise_part(logits_fn: LogitsFn) -> Callable[[jax.Array], jax.Array]:
    """f of `logits_fn(h, head) = f(h @ head.T)`: the logits of a one-channel hidden state `z` and a unit head."""
    def f(z: jax.Array) -> jax.Array:
        return logits_fn(z[..., None], jnp.ones((1, 1), z.dtype))[..., 0]
    return f


def chunk_positions(batch: int, length: int, spec: LogitLossSettings) -> tuple[int, int]:
    """(positions per chunk, positions per block): rows are batch x positions; a block holds whole chunks and at
    most the (chunk-padded) sequence."""
    chunk = max(1, min(length, spec.chunk // batch))
    per_block = max(1, (spec.block or spec.chunk) // batch // chunk)
    return chunk, chunk * min(per_block, -(-length // chunk))


def _scan_blocks(h_s, head_s, h_t, head_t, labels, weights, coeffs, *, student_logits: LogitsFn,
                 teacher_logits: LogitsFn, spec: LogitLossSettings, grad_hidden: bool, grad_head: bool):
    """One pass over the sequence: loss, metric sums and (optionally) d(hidden_s), d(head_s) for d(loss) = 1.
    `head_s` is already in the compute dtype of `h_s`; d(head_s) comes back in float32, or, when one block covers
    the sequence, as the pair (dz, hidden) whose `head_gradient` it is: the backward pass makes that matmul
    after the student trunk's backward has freed its activations, so the (V, D) gradient never coexists with
    them (and with multiple blocks there is an accumulator anyway). One function on purpose: the chunk and block
    bodies share the buffers and settings of this pass, and split apart they would pass them all around."""
    batch, length = h_s.shape[:2]
    chunk, block = chunk_positions(batch, length, spec)
    per_block = block // chunk
    cached = isinstance(h_t, TopK)  # a cached teacher: its top k per position instead of hidden states
    xs = (_chunked(h_s, block), jax.tree.map(lambda a: _chunked(a, block), h_t), _chunked(labels, block),
          _chunked(weights, block))
    zero_metrics = {name: jnp.zeros((), jnp.float32) for name in metric_names(spec)}
    activation = elementwise_part(student_logits)
    backward = grad_hidden or grad_head
    use_closed_form = closed_form_applies(spec, per_block)

    def chunk_step(hs, t_logits, lab, w):
        """Loss and metric sums of one chunk, and dz = d(loss)/d(student matmul output) when differentiating."""
        def objective(z):
            return token_objective(activation(z), t_logits, lab, w, coeffs, spec)

        z = _head_matmul(hs, head_s)
        if use_closed_form:
            return closed_form(z, t_logits, lab, w, coeffs, activation=activation, kl=spec.kl, ce=spec.ce,
                               unit_temperature=spec.unit_temperature, report_kl=_kl_is_the_term(spec),
                               gradient=backward)
        if not backward:
            return (*objective(z), None)
        loss, objective_vjp, metrics = jax.vjp(objective, z, has_aux=True)
        return loss, metrics, objective_vjp(jnp.ones((), loss.dtype))[0]

    def block_body(carry, x):
        loss_acc, metrics_acc, d_head = carry
        hs, ht, lab, w = x  # (B, block, ...)
        t_logits = ht if ht is None or cached else jax.lax.stop_gradient(teacher_logits(ht, head_t))  # one matmul
        if per_block == 1:
            loss, metrics, dz = chunk_step(hs, t_logits, lab, w)
        else:
            # Chunk i's dz overwrites chunk i's teacher logits, in place: one (B, block, V) buffer for both.
            cut = lambda a, i: jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1), a)
            buffer = None if cached else t_logits
            if backward and buffer is None:
                buffer = jnp.zeros((batch, block, head_s.shape[0]), jnp.float32)

            def inner(state, i):
                sums, buffer = state
                teacher_chunk = cut(t_logits if ht is None or cached else buffer, i)
                loss, metrics, dz = chunk_step(cut(hs, i), teacher_chunk, cut(lab, i), cut(w, i))
                if backward:
                    buffer = jax.lax.dynamic_update_slice_in_dim(buffer, dz, i * chunk, axis=1)
                return (jax.tree.map(jnp.add, sums, (loss, metrics)), buffer), None

            zero = (jnp.zeros((), jnp.float32), zero_metrics)
            ((loss, metrics), dz), _ = jax.lax.scan(inner, (zero, buffer), jnp.arange(per_block))
        d_hidden = None
        if backward:  # both gradient matmuls take dz in the compute dtype (a no-op in float32)
            dz = dz.astype(hs.dtype)
        if grad_hidden:  # dz @ head, one matmul per block
            d_hidden = hidden_gradient(dz, head_s)
        if grad_head:  # dz^T @ hidden over the whole block
            if d_head is None:  # the only block: leave the matmul to the backward pass
                d_head = (dz, hs)
            else:
                d_head = d_head + head_gradient(dz, hs, spec.vocab_slice)
        return (loss_acc + loss, jax.tree.map(jnp.add, metrics_acc, metrics), d_head), d_hidden

    n_blocks = xs[0].shape[0]
    carry: tuple[jax.Array, dict[str, jax.Array], jax.Array | None]
    carry = (jnp.zeros((), jnp.float32), zero_metrics, None)
    if n_blocks == 1:  # its head gradient is the total: no (V, D) accumulator; d_head is (dz, hidden) instead
        (loss, metrics, d_head), d_hidden = block_body(carry, jax.tree.map(lambda a: a[0], xs))
        d_hidden = None if d_hidden is None else d_hidden[None]
    else:
        if grad_head:
            carry = carry[:2] + (jnp.zeros(head_s.shape, jnp.float32),)
        (loss, metrics, d_head), d_hidden = jax.lax.scan(block_body, carry, xs)
    if grad_hidden:
        d_hidden = _unchunked(d_hidden, length)
    return loss, metrics, d_hidden, d_head


def fused_logit_loss(h_s: jax.Array, head_s: jax.Array, h_t: jax.Array | TopK | None, head_t: jax.Array | None,
                     labels: jax.Array, weights: jax.Array, coeffs: dict, *, student_logits: LogitsFn,
                     teacher_logits: LogitsFn | None,
                     spec: LogitLossSettings) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Chunked logit loss with a fused gradient. h_s (B, T, D_s), head_s (V, D_s), h_t (B, T, D_t), head_t (V, D_t),
    labels / weights (B, T). Returns (loss, metric sums); only h_s and head_s receive gradients. h_t and head_t are
    None without a teacher (spec.teacher False); for a cached teacher h_t is its `TopK` (B, T, k) and head_t None.
    `head_s` may be in a wider dtype than `h_s` (float32 master weights with bfloat16 compute): it is cast to
    `h_s.dtype` once, and its gradient is accumulated and returned in its own dtype, so no (V, D) cast of the
    gradient is needed."""
    kwargs = dict(student_logits=student_logits, teacher_logits=teacher_logits, spec=spec)
    head_dtype = head_s.dtype

    @jax.custom_vjp
    def loss_fn(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        loss, metrics, _, _ = _scan_blocks(h_s, head_s.astype(h_s.dtype), h_t, head_t, labels, weights, coeffs,
                                           grad_hidden=False, grad_head=False, **kwargs)
        return loss, metrics

    def loss_fwd(h_s, head_s, h_t, head_t, labels, weights, coeffs):
        # With symbolic_zeros, each argument says whether it is being differentiated: a frozen head costs no
        # (V, D) gradient matmul.
        values = jax.tree.map(lambda a: a.value, (h_s, head_s, h_t, head_t, labels, weights, coeffs),
                              is_leaf=lambda a: hasattr(a, "perturbed"))
        hidden, head = values[0], values[1]
        loss, metrics, d_hidden, d_head = _scan_blocks(hidden, head.astype(hidden.dtype), *values[2:],
                                                       grad_hidden=h_s.perturbed, grad_head=head_s.perturbed,
                                                       **kwargs)
        if d_head is not None and not isinstance(d_head, tuple):
            d_head = d_head.astype(head.dtype)
        return (loss, metrics), (d_hidden, d_head)

    def loss_bwd(residuals, cotangents):
        d_hidden, d_head = residuals
        if isinstance(d_head, tuple):  # deferred from the forward pass (_scan_blocks)
            d_head = head_gradient(*d_head, spec.vocab_slice).astype(head_dtype)
        g = cotangents[0]
        scale = (lambda d: None if d is None else (d * g.astype(d.dtype)))
        return scale(d_hidden), scale(d_head), None, None, None, None, None

    loss_fn.defvjp(loss_fwd, loss_bwd, symbolic_zeros=True)
    return loss_fn(h_s, head_s, h_t, head_t, labels, weights, coeffs)


__all__ = ["LogitLossSettings", "fused_logit_loss", "reference_logit_loss", "token_objective",
           "metric_names", "elementwise_part", "chunk_positions", "row_blocks"]
