"""Auxiliary MSE loss between student and teacher: the `switch_to_mse` fallback's loss (weight key "mse").

On logits (default) it is the mean over supervised positions of the mean over the vocabulary of the squared
difference of the two models' logits, each centred on its mean over the vocabulary first: a softmax does not see a
constant shift, so only the shape of the logits is matched. Logits are made in row chunks (rematerialised in the
backward pass), so no (B, T, V) array exists. On features (`GuardConfig.mse_on="features"`) it is the plain MSE
between mapped layer outputs (`losses.feature_loss` with kind "mse": the layer map, kept channels and learned
projections apply as for the feature loss).

Its weight is 0 unless the fallback turns it on. A run whose guard lists `switch_to_mse` compiles the term into
every step (`StepRunner.step_settings`) and the term computes only when its traced weight is non-zero
(`lax.cond`), so switching it on and off never recompiles and costs nothing while it is off. Its metric
`loss/mse` is 0 while it is off.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .loss_term import LossTerm, TermInputs, captured_pair
from .logit_loss import row_blocks
from .losses import feature_loss

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
    s_hidden = student.hidden.reshape(-1, student.hidden.shape[-1])
    t_hidden = jax.lax.stop_gradient(teacher.hidden).reshape(-1, teacher.hidden.shape[-1])
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
    """The MSE on logits or features, as the step's settings say (`mse_on`, default "logits")."""
    on = getattr(inputs.settings, "mse_on", "logits")
    if on not in MSE_ON:
        raise ValueError(f"mse_on={on!r}: use one of {MSE_ON}.")
    return feature_mse(inputs) if on == "features" else logit_mse(inputs)


@dataclasses.dataclass(frozen=True)
class MseTerm(LossTerm):
    """The MSE term: computed only while its traced weight is non-zero (no recompile to switch it)."""

    name: str = "mse"

    def contribution(self, inputs: TermInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
        weight = inputs.hyper[self.name]
        value = jax.lax.cond(weight != 0, lambda: mse_value(inputs).astype(jnp.float32),
                             lambda: jnp.zeros((), jnp.float32))
        return weight * value, {f"loss/{self.name}": value}


# Its captures are added by the step settings when mse_on="features" (StepRunner.step_settings), so a logits MSE
# asks the models for nothing more.
MSE = MseTerm(compute=mse_value, uses_layer_map=False, uses_projections=False)

__all__ = ["MSE", "MseTerm", "MSE_ON", "logit_mse", "feature_mse", "mse_value"]
