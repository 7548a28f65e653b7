"""The jitted distillation step: teacher and student forwards, all losses, gradient accumulation, AdamW update.

Functional style (research/hf_nnx.md §5.2): models are split once into graphdef + states; the step is a pure
`jax.jit` function of arrays, so dispatch costs no graph traversal. Arguments:

    params   {"student": trainable nnx.State, "proj": {layer: (D_s, D_t)}}   float32 master weights (donated)
    opt      optax state of `params` only (frozen parameters have none)      (donated)
    frozen   the rest of the student (not differentiated, no gradient computed for it)
    teacher  the teacher's state, any dtype, never differentiated
    batch    {"input_ids", ["loss_mask"], ["attention_mask"], ["positions", "segment_ids"]}, each (A, B, T) for
             A accumulated micro-batches; packed documents (segment_ids) attend and are scored each on its own
    hyper    traced scalars: lr, weight_decay, temperature and the loss weights (no recompile when they change)

Losses are normalised by the supervised-token count of the whole step (all micro-batches), so accumulating A
micro-batches gives the same update as one batch A times larger. A non-finite loss or gradient leaves params and
optimizer state unchanged inside the step (`finite` = 0 in the metrics); the trainer then rolls back.

Memory: every (V, D) float32 array is 0.6 GiB for a 262k vocabulary, so the step avoids holding two of them where
one does (measured with bench/diag_step.py at 270M: XLA's temporaries 1.87 -> 1.24 GiB with logit_loss.py's
blocks). A tied, trainable input embedding is looked up outside the differentiated function (the student runs on
`inputs_embeds`) and its gradient is scatter-added in place into the head gradient of the fused loss
(`fold_embedding`), instead of autodiff building a second (V, D) scatter buffer and adding the two. The Adam
moments are computed first and pinned with an optimization barrier, and the parameter update reads the new
moments: otherwise XLA computes the update and the in-place moment update in separate fusions that both read the
old moment, and copies it (the embedding's moment: 1.87 -> 1.59 GiB). The gradient norm is summed in row blocks
(`_sum_of_squares`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .interface import Correspondence, forward_inputs, next_token_targets
from .logit_loss import LogitLossSpec, fused_logit_loss, reference_logit_loss
from .losses import attention_transfer_loss, feature_loss

HYPER_KEYS = ("lr", "weight_decay", "temperature", "kl", "reverse_kl", "jsd", "ce", "attention", "feature")


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about a stage's step (a change means a new compilation)."""

    logit: LogitLossSpec
    attention: bool = False
    feature: bool = False
    correspondence: Correspondence = Correspondence()
    feature_kind: str = "nmse"
    logit_impl: str = "fused"
    compute_dtype: Any = jnp.float32
    remat: str | None = None
    clip_norm: float | None = 1.0
    decay_matrices_only: bool = True
    fold_embedding: bool = True  # tied + trainable embedding: fold the lookup gradient into the head gradient

    @property
    def logit_terms(self) -> bool:
        return self.logit.kl or self.logit.reverse_kl or self.logit.jsd or self.logit.ce


@dataclasses.dataclass(frozen=True)
class AdamSettings:
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def transform(self) -> optax.GradientTransformation:
        """Adam moments only: clipping, decoupled weight decay and the learning rate are applied in the step
        with traced values, so schedules and stage changes never recompile."""
        return optax.scale_by_adam(b1=self.b1, b2=self.b2, eps=self.eps)

    def direction(self, state: optax.ScaleByAdamState) -> Any:
        """The Adam update of `transform()` (bias-corrected mu / (sqrt(nu) + eps)) from an already updated state,
        so the step can compute the new moments first (see the module docstring)."""
        mu = optax.tree.bias_correction(state.mu, self.b1, state.count)
        nu = optax.tree.bias_correction(state.nu, self.b2, state.count)
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + self.eps), mu, nu)


def _cast(tree: Any, dtype) -> Any:
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
    return jax.tree.map(cast, tree)


def _captures(spec: StepSpec) -> tuple[str, ...]:
    return ("residual",) * spec.feature + ("attention_probs",) * spec.attention


def _normalisers(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Supervised tokens and real positions over all micro-batches (each at least 1)."""
    _, weights, real = next_token_targets({k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()})
    return {"tokens": jnp.maximum(weights.sum(), 1.0), "positions": jnp.maximum(real.sum(), 1.0)}


def make_loss_fn(student_graph, teacher_graph, spec: StepSpec) -> Callable:
    """loss(params, frozen, teacher, micro_batch, norms, hyper) -> (total, metric sums) for one micro-batch."""
    captures = _captures(spec)

    def student_forward(trainable, frozen, input_ids, inputs, inputs_embeds):
        student = nnx.merge(student_graph, trainable, frozen)
        embeds = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        out = student(input_ids, **inputs, capture=captures, return_logits=False, **embeds)
        residual = out.residual if spec.feature else None
        probs = out.attention_probs if spec.attention else None
        return out.final_hidden, residual, probs

    if spec.remat == "dots":
        student_forward = jax.checkpoint(student_forward,
                                         policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    elif spec.remat == "full":
        student_forward = jax.checkpoint(student_forward, policy=jax.checkpoint_policies.nothing_saveable)

    def loss_fn(params, frozen, teacher_state, batch, norms, hyper, inputs_embeds=None):
        """`inputs_embeds`: the student's scaled embedding lookup, made by the caller (to differentiate it
        separately, see `fold_embedding`); None: the student embeds `input_ids` itself."""
        master_head = nnx.merge(student_graph, params["student"], frozen).head_matrix()
        trainable = _cast(params["student"], spec.compute_dtype)
        frozen = _cast(frozen, spec.compute_dtype)
        teacher = None if teacher_graph is None else nnx.merge(teacher_graph, teacher_state)
        student = nnx.merge(student_graph, trainable, frozen)
        input_ids = batch["input_ids"]
        labels, weights, real = next_token_targets(batch)  # packed documents: no target crosses a boundary
        weights = weights / norms["tokens"]
        query_weights = real / norms["positions"]

        t_out = t_hidden = t_head = None
        if teacher is not None:  # no teacher: plain cross-entropy training (spec.logit.teacher is False)
            t_out = teacher(input_ids, **forward_inputs(teacher, batch), capture=captures, return_logits=False)
            t_hidden = jax.lax.stop_gradient(t_out.final_hidden)
            t_head = jax.lax.stop_gradient(teacher.head_matrix())
        s_hidden, s_residual, s_probs = student_forward(trainable, frozen, input_ids, forward_inputs(student, batch),
                                                        inputs_embeds)
        # the fused loss takes the master-dtype head (cast once inside, gradient kept in the master dtype)
        s_head = student.head_matrix() if spec.logit_impl == "reference" else master_head

        coeffs = {k: hyper[k] for k in ("temperature", "kl", "reverse_kl", "jsd", "ce")}
        if spec.logit.unit_temperature:
            coeffs["temperature"] = 1.0
        terms = {}
        if not spec.logit_terms:  # logit metrics only: no gradient work in the fused loss
            s_hidden, s_head = jax.lax.stop_gradient(s_hidden), jax.lax.stop_gradient(s_head)
        if spec.logit_impl == "reference":
            t_logits = None if teacher is None else teacher.logits_from_hidden(t_hidden, t_head)
            logit_loss, sums = reference_logit_loss(student.logits_from_hidden(s_hidden, s_head), t_logits,
                                                    labels, weights, coeffs, spec.logit)
        else:
            logit_loss, sums = fused_logit_loss(s_hidden, s_head, t_hidden, t_head, labels, weights, coeffs,
                                                student_logits=student.logits_from_hidden,
                                                teacher_logits=None if teacher is None else teacher.logits_from_hidden,
                                                spec=spec.logit)
        total = logit_loss if spec.logit_terms else jnp.zeros((), jnp.float32)
        terms["loss/logit"] = logit_loss
        if spec.attention:
            terms["loss/attention"] = attention_transfer_loss(t_out.attention_probs, s_probs, spec.correspondence,
                                                              query_weights)
            total = total + hyper["attention"] * terms["loss/attention"]
        if spec.feature:
            projections = params["proj"] if params.get("proj") else None
            terms["loss/feature"] = feature_loss(t_out.residual, s_residual, spec.correspondence, query_weights,
                                                 spec.feature_kind, projections)
            total = total + hyper["feature"] * terms["loss/feature"]
        metrics = {**{k: jax.lax.stop_gradient(v) for k, v in terms.items()}, **sums}
        return total, metrics

    return loss_fn


def build_train_step(student_graph, teacher_graph, spec: StepSpec, adam: AdamSettings,
                     out_shardings: Any = None, compiler_options: dict | None = None) -> Callable:
    """The jitted step `(params, opt, frozen, teacher, batch, hyper) -> (params, opt, metrics)`.

    Memoised on its (hashable) arguments, so reruns, rollbacks and resumes of the same structure in one process
    reuse the compiled program. `out_shardings` pins the output placement to the inputs' (None on one device).
    `compiler_options` go to XLA (e.g. {"xla_backend_optimization_level": 0} compiles tiny test models 2x faster)."""
    key = None if out_shardings is None else (jax.tree.structure(out_shardings), tuple(jax.tree.leaves(out_shardings)))
    return _train_step(student_graph, teacher_graph, spec, adam, key, _options_key(compiler_options))


def _options_key(options: dict | None) -> tuple | None:
    return None if not options else tuple(sorted(options.items()))


def _sum_of_squares(x: jax.Array, rows: int = 1 << 15) -> jax.Array:
    """sum(x**2) in float32. XLA:CPU materialises `square(x)` before handing it to its reduction kernel, a
    second (V, D) buffer for the embedding's gradient: large leaves are reduced in row blocks."""
    x = x.astype(jnp.float32)
    if x.ndim < 2 or x.shape[0] <= rows or x.shape[0] % rows:
        return jnp.sum(jnp.square(x))
    blocks = x.reshape(x.shape[0] // rows, rows, *x.shape[1:])
    return jnp.sum(jax.lax.map(lambda b: jnp.sum(jnp.square(b)), blocks))


def _global_norm(tree: Any) -> jax.Array:
    """optax.global_norm, without a full-size temporary per leaf (`_sum_of_squares`)."""
    return jnp.sqrt(sum(_sum_of_squares(x) for x in jax.tree.leaves(tree)))


def _embedding_fold(student_graph, params, frozen, spec: StepSpec) -> bool:
    """Fold the lookup gradient into the head gradient: a tied, trainable embedding of a model that embeds with
    `embed(ids)` (rows scaled by sqrt(hidden_size) in the table's dtype, as Gemma does) and accepts
    `inputs_embeds`. Decided at trace time from the structure of the trainable state."""
    if not spec.fold_embedding or spec.logit_impl != "fused" or "embed_tokens" not in params["student"]:
        return False
    student = nnx.merge(student_graph, params["student"], frozen)
    config = getattr(student, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False)) and callable(getattr(student, "embed", None))


def _add_lookup_gradient(grads: Any, d_embeds: jax.Array, input_ids: jax.Array) -> Any:
    """grads["student"]["embed_tokens"][ids] += d_embeds * sqrt(D), in place in the head gradient (float32). The
    scale is rounded to the compute dtype first, as `Gemma.embed` does, so the result equals autodiff's."""
    scale = jnp.asarray(math.sqrt(d_embeds.shape[-1]), d_embeds.dtype)
    rows = (d_embeds * scale).reshape(-1, d_embeds.shape[-1])

    def fold(path, g):
        keys = tuple(getattr(k, "key", None) for k in path[:2])
        if keys != ("student", "embed_tokens"):
            return g
        return g.at[input_ids.reshape(-1)].add(rows.astype(g.dtype))

    return jax.tree_util.tree_map_with_path(fold, grads)


def make_grad_fn(student_graph, teacher_graph, spec: StepSpec) -> Callable:
    """grads(params, frozen, teacher, micro_batch, norms, hyper) -> ((loss, metric sums), float32 gradients of
    `params`) for one micro-batch, with the embedding fold when it applies (`_embedding_fold`)."""
    loss_fn = make_loss_fn(student_graph, teacher_graph, spec)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    grad_fold_fn = jax.value_and_grad(loss_fn, argnums=(0, 6), has_aux=True)

    def grads(params, frozen, teacher_state, batch, norms, hyper):
        if _embedding_fold(student_graph, params, frozen, spec):
            embedder = nnx.merge(student_graph, _cast(params["student"], spec.compute_dtype),
                                 _cast(frozen, spec.compute_dtype))
            ids = batch["input_ids"]
            (loss, metrics), (grads, d_embeds) = grad_fold_fn(params, frozen, teacher_state, batch, norms, hyper,
                                                              embedder.embed(ids))
            grads = _add_lookup_gradient(grads, d_embeds, ids)
        else:
            (loss, metrics), grads = grad_fn(params, frozen, teacher_state, batch, norms, hyper)
        return (loss, metrics), jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    return grads


@functools.lru_cache(maxsize=16)
def _train_step(student_graph, teacher_graph, spec: StepSpec, adam_settings: AdamSettings, shardings_key,
                options_key):
    adam = adam_settings.transform()
    grad_fn = make_grad_fn(student_graph, teacher_graph, spec)

    def step(params, opt_state, frozen, teacher_state, batch, hyper):
        norms = _normalisers(batch)

        def micro_step(micro_batch):
            (loss, metrics), grads = grad_fn(params, frozen, teacher_state, micro_batch, norms, hyper)
            return grads, {"loss": loss, **metrics}

        def accumulate(carry, micro_batch):
            grads, metrics = micro_step(micro_batch)
            return jax.tree.map(jnp.add, carry, (grads, metrics)), None

        grads, metrics = micro_step(jax.tree.map(lambda x: x[0], batch))
        if batch["input_ids"].shape[0] > 1:  # gradient accumulation: the other micro-batches, summed in float32
            rest = jax.tree.map(lambda x: x[1:], batch)
            (grads, metrics), _ = jax.lax.scan(accumulate, (grads, metrics), rest)

        grad_norm = _global_norm(grads)
        if spec.clip_norm is not None:
            scale = jnp.minimum(1.0, spec.clip_norm / jnp.maximum(grad_norm, 1e-12))
            grads = jax.tree.map(lambda g: g * scale, grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        _, new_opt = adam.update(grads, opt_state, params)
        # new moments first, then the update from them: no copy of the old moments (module docstring)
        new_opt = jax.lax.optimization_barrier(keep(new_opt, opt_state))
        updates = adam_settings.direction(new_opt)
        decay = jax.tree.map(lambda p: float(p.ndim >= 2 or not spec.decay_matrices_only), params)
        new_params = jax.tree.map(
            lambda p, u, d: (p - hyper["lr"] * (u + hyper["weight_decay"] * d * p)).astype(p.dtype),
            params, updates, decay)
        metrics = {**metrics, "grad_norm": grad_norm, "finite": finite.astype(jnp.float32),
                   "supervised_tokens": norms["tokens"]}
        return keep(new_params, params), new_opt, metrics

    options = dict(options_key) if options_key else None
    if shardings_key is None:
        return jax.jit(step, donate_argnums=(0, 1), compiler_options=options)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=jax.tree.unflatten(*shardings_key),
                   compiler_options=options)


def build_eval_step(student_graph, teacher_graph, chunk: int = 32, compiler_options: dict | None = None) -> Callable:
    """`(student_state, teacher_state, batch (B, T)) -> metrics` on one held-out batch, from the whole student state
    (so one compilation serves every stage): KL(teacher || student) at temperature 1 (also reported as `loss`),
    student and teacher cross-entropy and logit correlation; without a teacher, the student's cross-entropy
    (`loss`). No gradient work."""
    return _eval_step(student_graph, teacher_graph, chunk, _options_key(compiler_options))


@functools.lru_cache(maxsize=16)
def _eval_step(student_graph, teacher_graph, chunk: int, options_key) -> Callable:
    has_teacher = teacher_graph is not None
    spec = StepSpec(logit=LogitLossSpec(kl=has_teacher, ce=not has_teacher, chunk=chunk, unit_temperature=True,
                                        teacher=has_teacher, diagnostics=True))
    loss_fn = make_loss_fn(student_graph, teacher_graph, spec)
    hyper = {"temperature": 1.0, "kl": 1.0, "reverse_kl": 0.0, "jsd": 0.0, "ce": 1.0}

    @functools.partial(jax.jit, compiler_options=dict(options_key) if options_key else None)
    def evaluate(student_state, teacher_state, batch):
        norms = _normalisers(jax.tree.map(lambda x: x[None], batch))
        loss, metrics = loss_fn({"student": student_state}, nnx.State({}), teacher_state, batch, norms, hyper)
        metrics = {k: v for k, v in metrics.items() if not k.startswith(("term/", "loss/"))}
        return {"loss": loss, **metrics, "supervised_tokens": norms["tokens"]}

    return evaluate


def hyper_values(stage, step_in_stage: int, default_weight_decay: float, lr_scale: float = 1.0) -> dict[str, Any]:
    """Host-side schedule values for one step, as float32 scalars."""
    weights = stage.weights.as_dict()
    values = {"lr": stage.learning_rate_at(step_in_stage) * lr_scale,
              "weight_decay": default_weight_decay if stage.weight_decay is None else stage.weight_decay,
              "temperature": stage.temperature_at(step_in_stage), **weights}
    return {k: jnp.asarray(values[k], jnp.float32) for k in HYPER_KEYS}


__all__ = ["StepSpec", "AdamSettings", "build_train_step", "build_eval_step", "make_loss_fn", "make_grad_fn",
           "hyper_values", "HYPER_KEYS"]
