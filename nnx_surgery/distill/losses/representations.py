"""Intermediate-representation losses: attention transfer on true attention maps, and feature matching.

Both take per-layer tensors captured from the forwards (`attention_probs`: (B, N, T, S) probabilities,
`residual`: embeddings then each layer's (B, T, D) output) and a `Correspondence` (interface.py). Positions are
weighted by `query_weights` (B, T): 1 for real tokens, divided by the real-token count of the optimizer step, so a
sum over positions is a mean. Each loss is the mean over mapped layer pairs.

Attention transfer compares probability rows: KL(teacher row || student row) summed over keys, averaged over heads.
When the head counts differ, heads are grouped: with `head_map` the teacher heads the student kept are compared one
to one; otherwise both sides are averaged over consecutive head groups, G = gcd(N_teacher, N_student) groups
(consecutive query heads share a KV head in Gemma's layout, so a group is a set of whole GQA groups when the KV
counts allow). An average of probability rows is a probability row, so the KL stays well defined.

Feature matching compares layer outputs. A width-pruned student is compared on the teacher channels it kept
(`kept_hidden`); a student of another width needs a learned (D_s, D_t) projection per pair (`init_projections`),
trained with the student and discarded afterwards. Kinds: "mse" (mean over channels), "nmse" (squared error over
the teacher's squared norm, per token: scale-free, useful for Gemma's large residual stream), "cosine"
(1 - cosine similarity; zero vectors give distance 1, not NaN), and "pooled".

"pooled" is Tunix's feature pooling (its `reduce_array_to_target_shape` with VALID padding): no learned
parameters and no channel correspondence; the teacher's D_t channels are average-pooled down to the student's D_s
with stride s = D_t // D_s and window w = D_t - (D_s - 1) * s, so student channel k is compared with the mean of
teacher channels [k s, k s + w). When D_s divides D_t that is the mean of each contiguous group of D_t / D_s
channels; otherwise neighbouring windows overlap (D_t = 10, D_s = 4: [0, 4), [2, 6), [4, 8), [6, 10)). The
distance is Tunix's default, the cosine distance. It ignores `kept_hidden` (pooling replaces channel selection)
and cannot be combined with learned projections.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import einops
import jax
import jax.numpy as jnp

from ..interface import Correspondence
from .term_types import LossTerm, TermInputs, TermOption, captured_pair

FEATURE_KINDS = ("mse", "nmse", "cosine", "pooled")
_TINY = 1e-12


def group_heads(probs: jax.Array, groups: int) -> jax.Array:
    """(B, N, T, S) -> (B, groups, T, S): mean over consecutive blocks of N / groups heads."""
    return einops.reduce(probs, "B (G n) T S -> B G T S", "mean", G=groups)


def match_heads(teacher: jax.Array, student: jax.Array,
                teacher_heads: Sequence[int] | None = None) -> tuple[jax.Array, jax.Array]:
    """Bring teacher and student maps to the same head axis (see module docstring)."""
    if teacher_heads is not None:
        if len(teacher_heads) != student.shape[1]:
            raise ValueError(f"head_map lists {len(teacher_heads)} teacher heads for a student layer with "
                             f"{student.shape[1]} heads; list one teacher head per student head.")
        teacher = teacher[:, jnp.asarray(teacher_heads)]
    groups = math.gcd(teacher.shape[1], student.shape[1])
    return group_heads(teacher, groups), group_heads(student, groups)


def _row_kl(teacher_probs: jax.Array, student_probs: jax.Array) -> jax.Array:
    """KL per (head, query) row of one example: (G, T, S) -> (G, T). Masked keys have p = 0 on both sides."""
    p = teacher_probs.astype(jnp.float32)
    log_q = jnp.log(jnp.maximum(student_probs.astype(jnp.float32), _TINY))
    log_p = jnp.log(jnp.maximum(p, _TINY))
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def attention_transfer_loss(teacher_probs: Sequence[jax.Array], student_probs: Sequence[jax.Array],
                            correspondence: Correspondence, query_weights: jax.Array) -> jax.Array:
    """Mean over mapped layers of the weighted mean over queries of the head-averaged row KL."""
    pairs = correspondence.layer_map
    if not pairs:
        raise ValueError("attention transfer needs at least one (teacher_layer, student_layer) pair in layer_map.")
    head_map = correspondence.head_map or (None,) * len(pairs)
    total = jnp.zeros((), jnp.float32)
    for (teacher_layer, student_layer), heads in zip(pairs, head_map):
        teacher, student = match_heads(jax.lax.stop_gradient(teacher_probs[teacher_layer]),
                                       student_probs[student_layer], heads)
        per_example = jax.vmap(lambda t, s, w: jnp.sum(_row_kl(t, s).mean(axis=0) * w))
        total = total + jnp.sum(per_example(teacher, student, query_weights))
    return total / len(pairs)


def pooling_windows(teacher_width: int, student_width: int) -> tuple[int, int]:
    """(stride, window) of Tunix's VALID average pooling from `teacher_width` channels to `student_width`."""
    if not 1 <= student_width <= teacher_width:
        raise ValueError(f"pooled features need a student no wider than the teacher (student {student_width}, "
                         f"teacher {teacher_width} channels); use the feature term's kind 'nmse' with feature_projection.")
    stride = teacher_width // student_width
    return stride, teacher_width - (student_width - 1) * stride


def pool_features(teacher: jax.Array, student_width: int) -> jax.Array:
    """(..., D_t) -> (..., D_s): channel k is the mean of teacher channels [k s, k s + w) (`pooling_windows`)."""
    stride, window = pooling_windows(teacher.shape[-1], student_width)
    if stride == window:  # D_s divides D_t: contiguous, non-overlapping groups
        return einops.reduce(teacher, "... (D g) -> ... D", "mean", D=student_width)
    ones = (1,) * (teacher.ndim - 1)
    total = jax.lax.reduce_window(teacher, jnp.zeros((), teacher.dtype), jax.lax.add, ones + (window,),
                                  ones + (stride,), "VALID")
    return total / window


def feature_distance(student: jax.Array, teacher: jax.Array, kind: str) -> jax.Array:
    """Per-position distance between (..., D) feature vectors ("pooled": the cosine distance, Tunix's default)."""
    student, teacher = student.astype(jnp.float32), teacher.astype(jnp.float32)
    if kind == "pooled":
        kind = "cosine"
    if kind == "mse":
        return jnp.mean(jnp.square(student - teacher), axis=-1)
    if kind == "nmse":
        return jnp.sum(jnp.square(student - teacher), axis=-1) / (jnp.sum(jnp.square(teacher), axis=-1) + 1e-6)
    if kind == "cosine":
        dot = jnp.sum(student * teacher, axis=-1)
        norms = jnp.sqrt(jnp.sum(student * student, axis=-1) * jnp.sum(teacher * teacher, axis=-1))
        return 1.0 - dot / jnp.maximum(norms, _TINY)
    raise ValueError(f"feature loss kind {kind!r} unknown; choose from {FEATURE_KINDS}.")


def feature_loss(teacher_residual: Sequence[jax.Array], student_residual: Sequence[jax.Array],
                 correspondence: Correspondence, query_weights: jax.Array, kind: str = "nmse",
                 projections: Mapping[str, jax.Array] | None = None) -> jax.Array:
    """Mean over mapped pairs of the weighted per-position distance between layer outputs. `residual[l + 1]` is
    the output of decoder layer l. `projections[str(student_layer)]` (D_s, D_t) maps student features into
    teacher space when given. Kind "pooled" pools the teacher's channels to the student's width instead."""
    pairs = correspondence.layer_map
    if not pairs:
        raise ValueError("feature matching needs at least one (teacher_layer, student_layer) pair in layer_map.")
    if kind == "pooled" and projections is not None:
        raise ValueError("the feature term's kind 'pooled' averages teacher channels down to the student's width and takes no "
                         "learned projection; turn feature_projection off, or use kind 'nmse'.")
    kept = None if correspondence.kept_hidden is None else jnp.asarray(correspondence.kept_hidden)
    total = jnp.zeros((), jnp.float32)
    for teacher_layer, student_layer in pairs:
        teacher = jax.lax.stop_gradient(teacher_residual[teacher_layer + 1])
        student = student_residual[student_layer + 1]
        if kind == "pooled":
            teacher = pool_features(teacher.astype(jnp.float32), student.shape[-1])
        elif kept is not None and correspondence.kept_hidden != tuple(range(teacher.shape[-1])):
            teacher = jnp.take(teacher, kept, axis=-1)
        if projections is not None:
            weight = projections[str(student_layer)]
            student = jnp.einsum("BTd,dD->BTD", student.astype(jnp.float32), weight.astype(jnp.float32))
        if student.shape[-1] != teacher.shape[-1]:
            raise ValueError(f"feature matching: student layer {student_layer} has width {student.shape[-1]} but "
                             f"teacher layer {teacher_layer} gives {teacher.shape[-1]} channels; pass the plan's "
                             "kept_hidden, or enable feature_projection for a student not derived by a plan.")
        total = total + jnp.sum(feature_distance(student, teacher, kind) * query_weights)
    return total / len(pairs)


def init_projections(correspondence: Correspondence, student_width: int, teacher_width: int,
                     seed: int = 0) -> dict[str, jax.Array]:
    """One learned (D_s, D_t) projection per mapped student layer, orthogonal initialisation (scale preserving)."""
    init = jax.nn.initializers.orthogonal()
    keys = jax.random.split(jax.random.key(seed), max(1, len(correspondence.layer_map)))
    return {str(s): init(key, (student_width, teacher_width), jnp.float32)
            for key, (_, s) in zip(keys, correspondence.layer_map)}


def _attention_term(inputs: TermInputs) -> jax.Array:
    teacher, student = captured_pair(inputs, "attention_probs")
    return attention_transfer_loss(teacher, student, inputs.correspondence, inputs.query_weights)


def _feature_term(inputs: TermInputs) -> jax.Array:
    teacher, student = captured_pair(inputs, "residual")
    return feature_loss(teacher, student, inputs.correspondence, inputs.query_weights, inputs.options["kind"],
                        inputs.projections)


# Loss terms (distill.losses.term_registry registers them): attention-map transfer, and layer-output matching of the kind its
# option `kind` says ("nmse" by default; `loss_options={"feature": {"kind": ...}}`).
ATTENTION = LossTerm(name="attention", compute=_attention_term, captures=("attention_probs",), uses_layer_map=True,
                     flag="attention-map transfer on mapped layers and kept heads (0: off)")
FEATURE = LossTerm(name="feature", compute=_feature_term, captures=("residual",), uses_layer_map=True,
                   uses_projections=True,
                   options=(TermOption("kind", "nmse", choices=FEATURE_KINDS,
                                       flag="how features compare: nmse (scale-free), mse, cosine, pooled (teacher "
                                            "width averaged down to the student's)"),),
                   flag="feature loss on mapped layer outputs (0: off); guides a depth-cut student layer by layer")

__all__ = ["attention_transfer_loss", "feature_loss", "feature_distance", "group_heads", "match_heads",
           "pool_features", "pooling_windows",
           "init_projections", "FEATURE_KINDS", "ATTENTION", "FEATURE"]
