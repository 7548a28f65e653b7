"""The logit loss as one loss term: forward KL, reverse KL, JSD and hard-label CE are its kinds, each with its own
weight ("kl", "reverse_kl", "jsd", "ce"), computed together by the fused chunked loss of `logit_loss.py` (or its
full-logits reference with `logit_impl="reference"`).

It is always computed, also when all its weights are 0 (e.g. a stage of feature matching only): it gives the
student's cross-entropy and the KL metrics. Then no gradient flows through it.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from .logit_loss import fused_logit_loss, reference_logit_loss
from .loss_term import LossTerm, TermInputs

KINDS = ("kl", "reverse_kl", "jsd", "ce")


@dataclasses.dataclass(frozen=True)
class LogitTerm(LossTerm):
    """The fused logit loss; its static settings are `StepSettings.logit` (a `LogitLossSettings`)."""

    name: str = "logit"
    weights: tuple[str, ...] = KINDS
    teacher_free: tuple[str, ...] = ("ce",)

    @property
    def always_computed(self) -> bool:
        return True

    def kinds(self, weights: Mapping[str, float]) -> dict[str, bool]:
        """The `LogitLossSettings` switches of `weights`: a kind is on when its weight is not 0."""
        return {kind: weights[kind] != 0 for kind in KINDS}

    def contribution(self, inputs: TermInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
        settings, teacher, student = inputs.settings, inputs.teacher, inputs.student
        spec = settings.logit
        trained = any(getattr(spec, kind) for kind in KINDS)
        coeffs = {key: inputs.hyper[key] for key in ("temperature", *KINDS)}
        if spec.unit_temperature:
            coeffs["temperature"] = 1.0
        # the fused loss takes the master-dtype head (cast once inside, gradient kept in the master dtype)
        s_hidden = student.hidden
        s_head = student.model.head_matrix() if settings.logit_impl == "reference" else student.head
        if not trained:  # logit metrics only: no gradient work in the fused loss
            s_hidden, s_head = jax.lax.stop_gradient(s_hidden), jax.lax.stop_gradient(s_head)
        if settings.logit_impl == "reference":
            t_logits = None if teacher is None else teacher.model.logits_from_hidden(teacher.hidden, teacher.head)
            loss, sums = reference_logit_loss(student.model.logits_from_hidden(s_hidden, s_head), t_logits,
                                              inputs.labels, inputs.token_weights, coeffs, spec)
        else:
            loss, sums = fused_logit_loss(
                s_hidden, s_head, None if teacher is None else teacher.hidden,
                None if teacher is None else teacher.head, inputs.labels, inputs.token_weights, coeffs,
                student_logits=student.model.logits_from_hidden,
                teacher_logits=None if teacher is None else teacher.model.logits_from_hidden, spec=spec)
        total = loss if trained else jnp.zeros((), jnp.float32)
        return total, {"loss/logit": loss, **sums}


LOGIT = LogitTerm()

__all__ = ["LOGIT", "LogitTerm", "KINDS"]
