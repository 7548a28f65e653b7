"""Cosine loss on hidden states: 1 - cos(teacher, student) between corresponding layer outputs.

It compares directions only, so it combines with the NMSE feature loss (which also matches magnitudes) rather
than replacing it: `LossWeights(kl=1.0, feature=1.0, cosine=0.5)`. Pairs come from the correspondence's layer map,
a width-pruned student is compared on the teacher channels it kept (`kept_hidden`), learned projections apply
when `feature_projection` is on, and positions are weighted by `query_weights`, so padding does not count
(`losses.feature_loss` does all of that; zero vectors give distance 1, not NaN).
"""
from __future__ import annotations

import jax

from .term_types import LossTerm, TermInputs, captured_pair
from .representations import feature_loss


def cosine_distance(inputs: TermInputs) -> jax.Array:
    """Mean over mapped layer pairs of the mean over real positions of 1 - cosine similarity."""
    teacher, student = captured_pair(inputs, "residual")
    return feature_loss(teacher, student, inputs.correspondence, inputs.query_weights, "cosine", inputs.projections)


COSINE = LossTerm(name="cosine", compute=cosine_distance, captures=("residual",), uses_layer_map=True,
                  uses_projections=True, flag="cosine loss (1 - cos) on mapped layer outputs (0: off)")

__all__ = ["COSINE", "cosine_distance"]
