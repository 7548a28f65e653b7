"""Auxiliary MSE loss between student and teacher (weight key "mse"): the loss the `switch_to_mse` fallback turns
on after a divergence, an ordinary term otherwise (a stage may weight it like any other).

Its options (`loss_options={"mse": {...}}`): `on`, what it compares (default "logits"), and `chunk`, the rows per logits block. On logits it is the mean over supervised
positions of the mean over the vocabulary of the squared difference of the two models' logits, each centred on
its mean over the vocabulary first: a softmax does not see a constant shift, so only the shape of the logits is
matched. Logits are made in row chunks (rematerialised in the backward pass), so no (B, T, V) array exists. On
features it is the plain MSE between mapped layer outputs (`losses.feature_loss` with kind "mse": the layer map,
kept channels and learned projections apply as for the feature loss); only then does it ask the models for their
layer outputs.

Its fallback role is declared on the term (`fallbacks`): a run whose guard lists `switch_to_mse` compiles the
term into every step and the fallback moves its traced weight, so switching it on and off never recompiles; the
term computes only while that weight is non-zero (`LossTerm.contribution`), and its metric `loss/mse` is 0 while
it is off.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from .term_types import LossTerm, TermInputs, TermOption, captured_pair
from .divergence import row_blocks
from .representations import feature_loss

MSE_ON = ("logits", "features")
ROW_CHUNK = 128  # rows (positions) per logits block


def _centred(logits: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    return logits - jnp.mean(logits, axis=-1, keepdims=True)


def logit_mse(inputs: TermInputs, chunk: int = ROW_CHUNK) -> jax.Array:
    """Sum over positions of token_weight x mean over V of (centred student - centred teacher logits)^2."""
    teacher, student = inputs.teacher, inputs.student
    if teacher is None:
        raise ValueError("the MSE loss compares the student's logits with a teacher's; pass a teacher or drop "
                         "'switch_to_mse' from GuardConfig.policies.")
    student_hidden, teacher_hidden = student.required_hidden(), teacher.required_hidden()
    s_hidden = student_hidden.reshape(-1, student_hidden.shape[-1])
    t_hidden = jax.lax.stop_gradient(teacher_hidden).reshape(-1, teacher_hidden.shape[-1])
    weights = inputs.token_weights.reshape(-1).astype(jnp.float32)
    chunk = min(chunk, s_hidden.shape[0])
    blocks = [row_blocks(x, chunk) for x in (s_hidden, t_hidden, weights)]

    @jax.checkpoint
    def block(args):
        s, t, w = args
        s_logits = _centred(student.model.logits_from_hidden(s, student.head))
        t_logits = jax.lax.stop_gradient(_centred(teacher.model.logits_from_hidden(t, teacher.head)))
        return jnp.sum(w * jnp.mean(jnp.square(s_logits - t_logits), axis=-1))

    return jnp.sum(jax.lax.map(block, tuple(blocks)))


def feature_mse(inputs: TermInputs) -> jax.Array:
    """Mean over mapped layer pairs of the weighted mean over real positions of the MSE over channels."""
    teacher, student = captured_pair(inputs, "residual")
    return feature_loss(teacher, student, inputs.correspondence, inputs.query_weights, "mse", inputs.projections)


def mse_value(inputs: TermInputs) -> jax.Array:
    """The MSE on logits or features, as the term's options say (`on`, default "logits"; `chunk`)."""
    if inputs.options.get("on", "logits") == "features":
        return feature_mse(inputs)
    return logit_mse(inputs, inputs.options.get("chunk", ROW_CHUNK))


@dataclasses.dataclass(frozen=True)
class MseTerm(LossTerm):
    """The MSE term: on features it needs the layer outputs, the layer map and the projections (`resolved`)."""

    def resolved(self, options: Mapping[str, Any]) -> LossTerm:
        if options.get("on") != "features":
            return self
        return dataclasses.replace(self, captures=("residual",), uses_layer_map=True, uses_projections=True)


MSE = MseTerm(name="mse", compute=mse_value,
              options=(TermOption("on", "logits", choices=MSE_ON),
                       TermOption("chunk", ROW_CHUNK)),
              fallbacks={"switch_to_mse": ("mse",)})

__all__ = ["MSE", "MseTerm", "MSE_ON", "ROW_CHUNK", "logit_mse", "feature_mse", "mse_value"]
