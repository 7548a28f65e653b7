"""The jitted distillation step: teacher and student forwards, all losses, gradient accumulation, AdamW update.

Functional style: models are split once into graphdef + states and the step is a pure `jax.jit` function of
arrays, so a call costs no Python graph traversal of the modules. Arguments:

    params   {"student": trainable nnx.State, "proj": {layer: (D_s, D_t)}}   float32 master weights (donated)
    opt      optax state of `params` only (frozen parameters have none)      (donated)
    frozen   the rest of the student (not differentiated, no gradient computed for it)
    teacher  the teacher's state, any dtype, never differentiated
    batch    {"input_ids", ["loss_mask"], ["attention_mask"], ["positions", "segment_ids"]}, each (A, B, T) for
             A accumulated micro-batches; packed documents (segment_ids) attend and are scored each on its own
    hyper    traced scalars: lr, weight_decay, temperature and the loss weights by name (`terms.hyper_keys()`;
             no recompile when they change)

The loss is the sum of the active loss terms (`distill.losses.term_registry`; the logit term is always computed for its
metrics), each given its own options (`TermInputs.options`). Losses are normalised by the supervised-token count
of the whole step (all micro-batches), so accumulating A micro-batches gives the same update as one batch A times
larger. A non-finite loss or gradient leaves params and optimizer state unchanged inside the step (`finite` = 0 in
the metrics); the trainer then rolls back.

Memory: every (V, D) float32 array is 0.6 GiB for a 262k vocabulary, so the step avoids holding two of them where
one does. A tied, trainable input embedding is looked up outside the differentiated function (the student runs on
`inputs_embeds`) and its gradient is scatter-added in place into the head gradient of the fused (or two-pass)
loss (`fold_embedding`), instead of autodiff building a second (V, D) scatter buffer and adding the two. The Adam
moments are computed first and pinned with an optimization barrier, and the parameter update reads the new
moments: otherwise XLA computes the update and the in-place moment update in separate fusions that both read the
old moment, and copies it. The gradient norm is summed in row blocks (`_sum_of_squares`).
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

from ..losses import term_registry as terms
from ..interface import Correspondence, forward_inputs, kernel_inputs, next_token_targets
from ..losses.divergence import LogitLossSettings
from ..losses.logit_term import LOGIT
from ..losses.term_types import LossTerm, ModelSide, TermInputs
from ..losses.topk_teacher import from_batch


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Everything static about a stage's step (a change means a new compilation).

    `logit`: the logit term's kinds and chunking (that term is always computed); `terms`: the other loss terms
    the step computes, by registered name (`distill.losses.term_registry`), usually those with a non-zero weight; `options`:
    term name -> {option: value} for the terms' `TermOption`s (a mapping, kept as sorted pairs so the settings
    stay hashable; options not given take their defaults)."""

    logit: LogitLossSettings
    terms: tuple[str, ...] = ()
    correspondence: Correspondence = Correspondence()
    options: Any = ()
    logit_impl: str = "fused"
    compute_dtype: Any = jnp.float32
    remat: str | None = None  # None, "dots" / "full" (the whole student forward) or a LAYER_REMAT value (per layer)
    clip_norm: float | None = 1.0
    decay_matrices_only: bool = True
    fold_embedding: bool = True  # tied + trainable embedding: fold the lookup gradient into the head gradient
    cached_teacher: bool = False  # no teacher model: its top k come in the batch (distill.loop.cache_replay)
    attention_kernel: str = "xla"  # "splash" on TPUs: both models' attention through the Pallas kernel

    def __post_init__(self):
        object.__setattr__(self, "terms", tuple(self.terms))
        for name in self.terms:
            if name == LOGIT.name:
                raise ValueError("StepSettings.terms: the logit term is always computed; its kinds are set by "
                                 "`logit` (LogitLossSettings), not listed in `terms`.")
            terms.term(name)  # a clear error for an unregistered name
        options = dict(self.options)
        for name, values in options.items():
            terms.term(name).option_values(values)  # unknown options and values outside their choices
        object.__setattr__(self, "options", tuple(sorted((name, tuple(sorted(dict(values).items())))
                                                         for name, values in options.items())))

    def options_of(self, term: LossTerm) -> dict[str, Any]:
        """The values of `term`'s options in this step (defaults where not given)."""
        return term.option_values(dict(dict(self.options).get(term.name, ())))

    @property
    def loss_terms(self) -> tuple[LossTerm, ...]:
        """The terms the step computes, in the order it adds them: the logit term, then `terms`, each as its
        options make it (`LossTerm.resolved`)."""
        return tuple(term.resolved(self.options_of(term)) for term in (LOGIT, *map(terms.term, self.terms)))

    @property
    def captures(self) -> tuple[str, ...]:
        """The model intermediates the terms read, each requested once."""
        return tuple(dict.fromkeys(name for term in self.loss_terms for name in term.captures))


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


def token_counts(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Supervised tokens and real positions over all micro-batches (each at least 1): the divisors of every
    loss term, so that sums over positions are means over the whole step."""
    _, weights, real = next_token_targets({k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()})
    return {"tokens": jnp.maximum(weights.sum(), 1.0), "positions": jnp.maximum(real.sum(), 1.0)}


LAYER_REMAT = ("layers", "layers_dots")  # passed to the student's call: the model checkpoints each of its layers


def _rematerialised(forward: Callable, remat: str | None) -> Callable:
    """The student forward under the step's remat: "dots" / "full" wrap the whole forward in one checkpoint
    (its backward recomputes the whole forward, then holds every layer's activations at once); `LAYER_REMAT`
    values are not wrapped here but passed to the model as `remat=` (`make_loss_fn`)."""
    if remat == "dots":
        return jax.checkpoint(forward, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if remat == "full":
        return jax.checkpoint(forward, policy=jax.checkpoint_policies.nothing_saveable)
    return forward


def make_loss_fn(student_graph, teacher_graph, settings: StepSettings) -> Callable:
    """loss(params, frozen, teacher, micro_batch, counts, hyper) -> (total, metric sums) for one micro-batch."""
    captures = settings.captures

    def student_forward(trainable, frozen, input_ids, inputs, inputs_embeds):
        student = nnx.merge(student_graph, trainable, frozen)
        embeds = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        layered = {"remat": settings.remat} if settings.remat in LAYER_REMAT else {}
        out = student(input_ids, **inputs, capture=captures, return_logits=False, **embeds, **layered,
                      **kernel_inputs(student, settings.attention_kernel))
        return out.final_hidden, {name: getattr(out, name) for name in captures}

    student_forward = _rematerialised(student_forward, settings.remat)

    def loss_fn(params, frozen, teacher_state, batch, counts, hyper, inputs_embeds=None):
        """`inputs_embeds`: the student's scaled embedding lookup, made by the caller (to differentiate it
        separately, see `fold_embedding`); None: the student embeds `input_ids` itself."""
        master_head = nnx.merge(student_graph, params["student"], frozen).head_matrix()
        trainable = _cast(params["student"], settings.compute_dtype)
        frozen = _cast(frozen, settings.compute_dtype)
        teacher = None if teacher_graph is None else nnx.merge(teacher_graph, teacher_state)
        student = nnx.merge(student_graph, trainable, frozen)
        input_ids = batch["input_ids"]
        labels, weights, real = next_token_targets(batch)  # packed documents: no target crosses a boundary

        teacher_side = None
        if teacher is not None:  # no teacher: plain cross-entropy training (settings.logit.teacher is False)
            t_out = teacher(input_ids, **forward_inputs(teacher, batch), capture=captures, return_logits=False,
                            **kernel_inputs(teacher, settings.attention_kernel))
            teacher_side = ModelSide(hidden=jax.lax.stop_gradient(t_out.final_hidden),
                                     head=jax.lax.stop_gradient(teacher.head_matrix()),
                                     captured={name: getattr(t_out, name) for name in captures}, model=teacher)
        elif settings.cached_teacher:  # the teacher's top k read from a cache, in the batch
            teacher_side = ModelSide(hidden=None, head=None, captured={}, model=None,
                                     topk=from_batch(batch, settings.logit.top_k))
        s_hidden, s_captured = student_forward(trainable, frozen, input_ids, forward_inputs(student, batch),
                                               inputs_embeds)
        inputs = TermInputs(teacher=teacher_side,
                            student=ModelSide(hidden=s_hidden, head=master_head, captured=s_captured, model=student),
                            labels=labels, token_weights=weights / counts["tokens"],
                            query_weights=real / counts["positions"], correspondence=settings.correspondence,
                            projections=params["proj"] if params.get("proj") else None, hyper=hyper,
                            settings=settings)
        total, metrics = jnp.zeros((), jnp.float32), {}
        for term in settings.loss_terms:
            contribution, term_metrics = term.contribution(dataclasses.replace(inputs,
                                                                               options=settings.options_of(term)))
            total = total + contribution
            metrics.update(term_metrics)
        return total, {name: jax.lax.stop_gradient(value) for name, value in metrics.items()}

    return loss_fn


def build_train_step(student_graph, teacher_graph, settings: StepSettings, adam: AdamSettings,
                     out_shardings: Any = None, compiler_options: dict | None = None) -> Callable:
    """The jitted step `(params, opt, frozen, teacher, batch, hyper) -> (params, opt, metrics)`.

    Memoised on its (hashable) arguments, so reruns, rollbacks and resumes of the same structure in one process
    reuse the compiled program. `out_shardings` pins the output placement to the inputs' (None on one device).
    `compiler_options` go to XLA (e.g. {"xla_backend_optimization_level": 0} compiles tiny test models faster)."""
    key = None if out_shardings is None else (jax.tree.structure(out_shardings), tuple(jax.tree.leaves(out_shardings)))
    return _train_step(student_graph, teacher_graph, settings, adam, key, _options_key(compiler_options))


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


def _embedding_fold(student_graph, params, frozen, settings: StepSettings) -> bool:
    """Fold the lookup gradient into the head gradient: a tied, trainable embedding of a model that embeds with
    `embed(ids)` (rows scaled by `_embedding_scale`) and accepts `inputs_embeds`. Decided at trace time from the
    structure of the trainable state."""
    if not settings.fold_embedding or settings.logit_impl == "reference" or "embed_tokens" not in params["student"]:
        return False
    student = nnx.merge(student_graph, params["student"], frozen)
    config = getattr(student, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False)) and callable(getattr(student, "embed", None))


def _embedding_scale(student_graph, params, frozen, width: int) -> float:
    """The factor `embed(ids)` multiplies rows by: sqrt(hidden_size) for models whose config says
    `scales_embeddings` (Gemma; the default when the config does not say), else 1 (Llama-style models)."""
    config = getattr(nnx.merge(student_graph, params["student"], frozen), "config", None)
    return math.sqrt(width) if getattr(config, "scales_embeddings", True) else 1.0


def _add_lookup_gradient(grads: Any, d_embeds: jax.Array, input_ids: jax.Array, scale: float) -> Any:
    """grads["student"]["embed_tokens"][ids] += d_embeds * scale, in place in the head gradient (float32). The
    scale is rounded to the compute dtype first, as `Gemma.embed` does, so the result equals autodiff's."""
    rows = (d_embeds * jnp.asarray(scale, d_embeds.dtype)).reshape(-1, d_embeds.shape[-1])

    def fold(path, g):
        keys = tuple(getattr(k, "key", None) for k in path[:2])
        if keys != ("student", "embed_tokens"):
            return g
        return g.at[input_ids.reshape(-1)].add(rows.astype(g.dtype))

    return jax.tree_util.tree_map_with_path(fold, grads)


def make_grad_fn(student_graph, teacher_graph, settings: StepSettings) -> Callable:
    """grads(params, frozen, teacher, micro_batch, counts, hyper) -> ((loss, metric sums), float32 gradients of
    `params`) for one micro-batch, with the embedding fold when it applies (`_embedding_fold`)."""
    loss_fn = make_loss_fn(student_graph, teacher_graph, settings)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    grad_fold_fn = jax.value_and_grad(loss_fn, argnums=(0, 6), has_aux=True)

    def grads(params, frozen, teacher_state, batch, counts, hyper):
        if _embedding_fold(student_graph, params, frozen, settings):
            embedder = nnx.merge(student_graph, _cast(params["student"], settings.compute_dtype),
                                 _cast(frozen, settings.compute_dtype))
            ids = batch["input_ids"]
            (loss, metrics), (grads, d_embeds) = grad_fold_fn(params, frozen, teacher_state, batch, counts, hyper,
                                                              embedder.embed(ids))
            scale = _embedding_scale(student_graph, params, frozen, d_embeds.shape[-1])
            grads = _add_lookup_gradient(grads, d_embeds, ids, scale)
        else:
            (loss, metrics), grads = grad_fn(params, frozen, teacher_state, batch, counts, hyper)
        return (loss, metrics), jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    return grads


@functools.lru_cache(maxsize=16)
def _train_step(student_graph, teacher_graph, settings: StepSettings, adam_settings: AdamSettings, shardings_key,
                options_key):
    adam = adam_settings.transform()
    grad_fn = make_grad_fn(student_graph, teacher_graph, settings)

    def step(params, opt_state, frozen, teacher_state, batch, hyper):
        counts = token_counts(batch)

        def micro_step(micro_batch):
            (loss, metrics), grads = grad_fn(params, frozen, teacher_state, micro_batch, counts, hyper)
            return grads, {"loss": loss, **metrics}

        def accumulate(carry, micro_batch):
            grads, metrics = micro_step(micro_batch)
            return jax.tree.map(jnp.add, carry, (grads, metrics)), None

        grads, metrics = micro_step(jax.tree.map(lambda x: x[0], batch))
        if batch["input_ids"].shape[0] > 1:  # gradient accumulation: the other micro-batches, summed in float32
            rest = jax.tree.map(lambda x: x[1:], batch)
            (grads, metrics), _ = jax.lax.scan(accumulate, (grads, metrics), rest)

        grad_norm = _global_norm(grads)
        if settings.clip_norm is not None:
            scale = jnp.minimum(1.0, settings.clip_norm / jnp.maximum(grad_norm, 1e-12))
            grads = jax.tree.map(lambda g: g * scale, grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        _, new_opt = adam.update(grads, opt_state, params)
        # new moments first, then the update from them: no copy of the old moments (module docstring)
        new_opt = jax.lax.optimization_barrier(keep(new_opt, opt_state))
        updates = adam_settings.direction(new_opt)
        decay = jax.tree.map(lambda p: float(p.ndim >= 2 or not settings.decay_matrices_only), params)
        new_params = jax.tree.map(
            lambda p, u, d: (p - hyper["lr"] * (u + hyper["weight_decay"] * d * p)).astype(p.dtype),
            params, updates, decay)
        metrics = {**metrics, "grad_norm": grad_norm, "finite": finite.astype(jnp.float32),
                   "supervised_tokens": counts["tokens"]}
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
    # The evaluation's loss: KL(teacher || student) at temperature 1, or the student's CE without a teacher.
    weights = {name: 0.0 for name in terms.weight_names()}
    weights.update({"kl": 1.0} if teacher_graph is not None else {"ce": 1.0})
    settings = StepSettings(logit=LogitLossSettings(**LOGIT.kinds(weights), chunk=chunk, unit_temperature=True,
                                                    teacher=teacher_graph is not None, diagnostics=True))
    loss_fn = make_loss_fn(student_graph, teacher_graph, settings)
    hyper = {"temperature": 1.0, **weights}

    @functools.partial(jax.jit, compiler_options=dict(options_key) if options_key else None)
    def evaluate(student_state, teacher_state, batch):
        counts = token_counts(jax.tree.map(lambda x: x[None], batch))
        loss, metrics = loss_fn({"student": student_state}, nnx.State({}), teacher_state, batch, counts, hyper)
        metrics = {k: v for k, v in metrics.items() if not k.startswith(("term/", "loss/"))}
        return {"loss": loss, **metrics, "supervised_tokens": counts["tokens"]}

    return evaluate


def hyper_values(stage, step_in_stage: int, default_weight_decay: float, lr_scale: float = 1.0) -> dict[str, Any]:
    """Host-side schedule values for one step, as float32 scalars: every key of `terms.hyper_keys()`. Loss
    weights that ramp within the stage are taken at this step; they are traced, so moving them never recompiles
    (the stage's set of computed terms is fixed by its weights' non-zero ends)."""
    values = {"lr": stage.learning_rate_at(step_in_stage) * lr_scale,
              "weight_decay": default_weight_decay if stage.weight_decay is None else stage.weight_decay,
              "temperature": stage.temperature_at(step_in_stage), **stage.weights_at(step_in_stage)}
    return {k: jnp.asarray(values[k], jnp.float32) for k in terms.hyper_keys()}


__all__ = ["StepSettings", "AdamSettings", "build_train_step", "build_eval_step", "make_loss_fn", "make_grad_fn",
           "hyper_values", "token_counts"]
