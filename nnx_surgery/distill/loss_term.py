"""What a loss term is: a name, the model intermediates it needs, and a function of the two models' outputs.

A term computes one scalar from a `TermInputs`: the teacher's and the student's outputs of one micro-batch
(final hidden states, LM heads, the requested captures), the next-token labels and weights, the position
weights, the teacher -> student `Correspondence`, learned projections and the step's traced hyperparameters. The
step adds `weight * value` to the loss and reports the value as the metric `loss/<name>`. Registered terms
(`distill.terms`) define the loss weights a `LossWeights` accepts, the hyperparameters of the step and its static
flags, so a new loss is one `LossTerm` in its own module plus its registration:

    def my_loss(inputs: TermInputs) -> jax.Array:
        teacher, student = inputs.teacher.captured["residual"], inputs.student.captured["residual"]
        ...
    MY_LOSS = LossTerm(name="mine", compute=my_loss, captures=("residual",), uses_layer_map=True)

Values are sums over positions of weights that were already divided by the step's token counts (all
micro-batches), so a term that sums `query_weights * per_position` is a mean and accumulates exactly over
micro-batches.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from .interface import Correspondence


@dataclasses.dataclass(frozen=True)
class ModelSide:
    """One model's part of a micro-batch in the step.

    `hidden` (B, T, D): final hidden states (input of the LM head); `head` (V, D): the LM head matrix (the
    student's in its float32 master dtype); `captured`: the intermediates named by the active terms' `captures`
    (e.g. "residual": embeddings then each layer's (B, T, D) output; "attention_probs": per layer (B, N, T, S));
    `model`: the merged module in the compute dtype (for `logits_from_hidden`, `head_matrix`)."""

    hidden: jax.Array
    head: jax.Array
    captured: Mapping[str, Any]
    model: Any


@dataclasses.dataclass(frozen=True)
class TermInputs:
    """Everything a loss term may read for one micro-batch (traced values, except `settings`).

    `labels`, `token_weights` (B, T): next-token targets and their weights over the step's supervised-token count;
    `query_weights` (B, T): 1 / (real positions of the step) at real positions, else 0; `projections`: learned
    (D_s, D_t) matrices per mapped student layer, or None; `hyper`: the step's traced hyperparameters (loss
    weights by name, temperature, ...); `settings`: the step's static `StepSettings`."""

    teacher: ModelSide | None
    student: ModelSide
    labels: jax.Array
    token_weights: jax.Array
    query_weights: jax.Array
    correspondence: Correspondence
    projections: Mapping[str, jax.Array] | None
    hyper: Mapping[str, jax.Array]
    settings: Any


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One loss: `compute(inputs) -> scalar`, weighted by the loss weight called `name`.

    `captures`: model intermediates the term reads from `ModelSide.captured` (requested from both forwards);
    `uses_layer_map`: it needs the teacher -> student layer correspondence (a plan, or an explicit one);
    `uses_projections`: it maps student features through the learned projections when they exist
    (`DistillConfig.feature_projection`); `weights`: the loss-weight names it owns (default: its name);
    `teacher_free`: those of its weights that work without a teacher."""

    name: str
    compute: Callable[[TermInputs], jax.Array] | None = None
    captures: tuple[str, ...] = ()
    uses_layer_map: bool = False
    uses_projections: bool = False
    weights: tuple[str, ...] = ()
    teacher_free: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"loss term name {self.name!r} must be an identifier (it becomes a LossWeights "
                             "keyword and the metric 'loss/<name>').")
        object.__setattr__(self, "captures", tuple(self.captures))
        object.__setattr__(self, "weights", tuple(self.weights) or (self.name,))
        object.__setattr__(self, "teacher_free", tuple(self.teacher_free))

    @property
    def always_computed(self) -> bool:
        """Computed (for its metrics) even when its weights are all 0."""
        return False

    def active(self, weights: Mapping[str, float]) -> bool:
        """Whether `weights` gives this term a non-zero weight (then the step computes and trains it)."""
        return any(weights[name] != 0 for name in self.weights)

    def contribution(self, inputs: TermInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(weight x value, metrics) for one micro-batch."""
        if self.compute is None:
            raise NotImplementedError(f"loss term {self.name!r} has no compute function.")
        value = jnp.asarray(self.compute(inputs), jnp.float32)
        return inputs.hyper[self.name] * value, {f"loss/{self.name}": value}


def captured_pair(inputs: TermInputs, capture: str) -> tuple[Any, Any]:
    """(teacher, student) values of one capture; a clear error when the term runs without a teacher."""
    if inputs.teacher is None:
        raise ValueError(f"a loss term on {capture!r} compares the student with a teacher; pass a teacher or set "
                         "its weight to 0.")
    return inputs.teacher.captured[capture], inputs.student.captured[capture]


__all__ = ["LossTerm", "TermInputs", "ModelSide", "captured_pair"]
