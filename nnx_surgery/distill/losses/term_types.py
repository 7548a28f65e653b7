"""What a loss term is: a name, the model intermediates it needs, and a function of the two models' outputs.

A term computes one scalar from a `TermInputs`: the teacher's and the student's outputs of one micro-batch
(final hidden states, LM heads, the requested captures), the next-token labels and weights, the position
weights, the teacher -> student `Correspondence`, learned projections and the step's traced hyperparameters. The
step adds `weight * value` to the loss and reports the value as the metric `loss/<name>`. Registered terms
(`distill.losses.term_registry`) define the loss weights a `LossWeights` accepts, the hyperparameters of the step and its static
flags, so a new loss is one `LossTerm` in its own module plus its registration:

    def my_loss(inputs: TermInputs) -> jax.Array:
        teacher, student = inputs.teacher.captured["residual"], inputs.student.captured["residual"]
        ... inputs.options["margin"] ...
    MY_LOSS = LossTerm(name="mine", compute=my_loss, captures=("residual",), uses_layer_map=True,
                       options=(TermOption("margin", 0.1),), flag="my loss on layer outputs (0: off)")

A term owns its options (`TermOption`: static values compiled into the step, set per run with
`DistillConfig.loss_options={"mine": {"margin": 0.2}}`), reads them from `TermInputs.options`, and may say which
guard fallback switches it on (`fallbacks`) and what recipe flag weights it (`flag`).

Values are sums over positions of weights that were already divided by the step's token counts (all
micro-batches), so a term that sums `query_weights * per_position` is a mean and accumulates exactly over
micro-batches.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from ..interface import Correspondence


@dataclasses.dataclass(frozen=True)
class ModelSide:
    """One model's part of a micro-batch in the step.

    `hidden` (B, T, D): final hidden states (input of the LM head); `head` (V, D): the LM head matrix (the
    student's in its float32 master dtype); `captured`: the intermediates named by the active terms' `captures`
    (e.g. "residual": embeddings then each layer's (B, T, D) output; "attention_probs": per layer (B, N, T, S));
    `model`: the merged module in the compute dtype (for `logits_from_hidden`, `head_matrix`). A cached teacher
    (`DistillConfig.teacher_cache`) has no hidden states, head, captures or model, only `topk` (a
    `distill.losses.topk_teacher.TopK` of the micro-batch), which the logit term reads instead."""

    hidden: jax.Array | None
    head: jax.Array | None
    captured: Mapping[str, Any]
    model: Any
    topk: Any = None

    def required_hidden(self) -> jax.Array:
        """`hidden`, which every side but a cached teacher's has."""
        if self.hidden is None:
            raise ValueError("this loss needs the model's final hidden states; a cached teacher has none.")
        return self.hidden

    def required_head(self) -> jax.Array:
        """`head`, which every side but a cached teacher's has."""
        if self.head is None:
            raise ValueError("this loss needs the model's LM head; a cached teacher has none.")
        return self.head


@dataclasses.dataclass(frozen=True)
class TermInputs:
    """Everything a loss term may read for one micro-batch (traced values, except `settings`).

    `labels`, `token_weights` (B, T): next-token targets and their weights over the step's supervised-token count;
    `query_weights` (B, T): 1 / (real positions of the step) at real positions, else 0; `projections`: learned
    (D_s, D_t) matrices per mapped student layer, or None; `hyper`: the step's traced hyperparameters (loss
    weights by name, temperature, ...); `settings`: the step's static `StepSettings`; `options`: the values of
    the options of the term being computed (its `TermOption`s, as the run set them)."""

    teacher: ModelSide | None
    student: ModelSide
    labels: jax.Array
    token_weights: jax.Array
    query_weights: jax.Array
    correspondence: Correspondence
    projections: Mapping[str, jax.Array] | None
    hyper: Mapping[str, jax.Array]
    settings: Any
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TermOption:
    """A static option of a loss term: its value is compiled into the step (a change is a new compilation).

    `choices`: the values it takes (None: any hashable value); `flag`: the help of a command-line flag
    `--<term>-<option>` that sets `DistillConfig.loss_options[<term>][<option>]` (empty: no flag)."""

    name: str
    default: Any
    choices: tuple[Any, ...] | None = None
    flag: str = ""

    def check(self, value: Any, term: str) -> Any:
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"loss term {term!r}: option {self.name}={value!r}; choose from "
                             f"{self.choices}.")
        return value


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One loss: `compute(inputs) -> scalar`, weighted by the loss weight called `name`.

    `captures`: model intermediates the term reads from `ModelSide.captured` (requested from both forwards);
    `uses_layer_map`: it needs the teacher -> student layer correspondence (a plan, or an explicit one);
    `uses_projections`: it maps student features through the learned projections when they exist
    (`DistillConfig.feature_projection`); `weights`: the loss-weight names it owns (default: its name);
    `teacher_free`: those of its weights that work without a teacher; `options`: its static options
    (`TermOption`), given to `compute` as `TermInputs.options`; `fallbacks`: guard policy -> the weights of this
    term it switches on (a run listing the policy compiles those weights in and moves them as traced values,
    and the term is then computed only while its weight is non-zero, so switching never recompiles); `flag`: the
    help of the recipe's `--<name>-weight` flag (empty: no flag)."""

    name: str
    compute: Callable[[TermInputs], jax.Array] | None = None
    captures: tuple[str, ...] = ()
    uses_layer_map: bool = False
    uses_projections: bool = False
    weights: tuple[str, ...] = ()
    teacher_free: tuple[str, ...] = ()
    options: tuple[TermOption, ...] = ()
    fallbacks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)
    flag: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"loss term name {self.name!r} must be an identifier (it becomes a LossWeights "
                             "keyword and the metric 'loss/<name>').")
        object.__setattr__(self, "captures", tuple(self.captures))
        object.__setattr__(self, "weights", tuple(self.weights) or (self.name,))
        object.__setattr__(self, "teacher_free", tuple(self.teacher_free))
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "fallbacks", {policy: tuple(names) for policy, names in self.fallbacks.items()})

    def option_values(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every option's value: `given`'s where it has one, else the default; unknown names and values outside
        an option's choices are a ValueError."""
        given = dict(given or {})
        unknown = sorted(set(given) - {option.name for option in self.options})
        if unknown:
            raise ValueError(f"loss term {self.name!r} has no option(s) {unknown}; its options: "
                             f"{', '.join(option.name for option in self.options) or 'none'}.")
        return {option.name: option.check(given.get(option.name, option.default), self.name)
                for option in self.options}

    def resolved(self, options: Mapping[str, Any]) -> "LossTerm":
        """The term as `options` make it: a term whose captures or layer-map needs depend on an option returns a
        copy with them set (the step and the run's preparation read the resolved term)."""
        return self

    def active(self, weights: Mapping[str, float]) -> bool:
        """Whether `weights` gives this term a non-zero weight (then the step computes and trains it)."""
        return any(weights[name] != 0 for name in self.weights)

    def contribution(self, inputs: TermInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(weight x value, metrics) for one micro-batch. A term a fallback switches is computed only while its
        traced weight is non-zero (`lax.cond`): compiled in on standby, it costs nothing while off and its metric
        reads 0."""
        if self.compute is None:
            raise NotImplementedError(f"loss term {self.name!r} has no compute function.")
        weight = inputs.hyper[self.name]
        if self.fallbacks:
            value = jax.lax.cond(weight != 0, lambda: jnp.asarray(self.compute(inputs), jnp.float32),
                                 lambda: jnp.zeros((), jnp.float32))
        else:
            value = jnp.asarray(self.compute(inputs), jnp.float32)
        return weight * value, {f"loss/{self.name}": value}


def captured_pair(inputs: TermInputs, capture: str) -> tuple[Any, Any]:
    """(teacher, student) values of one capture; a clear error when the term runs without a teacher."""
    if inputs.teacher is None:
        raise ValueError(f"a loss term on {capture!r} compares the student with a teacher; pass a teacher or set "
                         "its weight to 0.")
    return inputs.teacher.captured[capture], inputs.student.captured[capture]


__all__ = ["LossTerm", "TermOption", "TermInputs", "ModelSide", "captured_pair"]
