"""Distilling into a student with a trimmed vocabulary: the teacher, seen in the student's token ids.

A surgery plan with `kept_vocab` makes a student whose token i is the teacher's token `kept_vocab[i]`.
`DistillConfig(vocab_map=...)`, or a `plan` that has `kept_vocab`, tells the run so, and the run wraps the teacher
in `TeacherInStudentVocabulary`:

    input   the batch's student ids mapped to teacher ids (the data is tokenised by the student's tokenizer, whose
            ids for text made of kept pieces are the teacher's ids, renumbered)
    head    the teacher's LM head restricted to the kept rows: its logits are the teacher's logits gathered at the
            kept ids before any softmax, so every logit loss compares the student with the teacher's distribution
            restricted to the kept pieces and renormalised
    labels  student ids: the CE terms and metrics are over the student's vocabulary

The wrapper is a DistillModel like any other, so the train step, the evaluation and on-policy scoring need no other
change, and `distill` still never imports the surgery.
"""
from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


class TokenMap(nnx.Variable):
    """The teacher token id of each student token id (int32; never trained)."""


class TeacherInStudentVocabulary(nnx.Module):
    """`teacher` (a DistillModel) with inputs, head and logits in the student's vocabulary (module docstring)."""

    def __init__(self, teacher: Any, teacher_ids: Any):
        self.teacher = teacher
        self.teacher_ids = TokenMap(jnp.asarray(checked_vocab_map(teacher_ids, vocab_rows(teacher))))
        self.config = getattr(teacher, "config", None)  # depth and attention sizes (layer map, FLOPs)

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 capture: Iterable[str] = (), return_logits: bool = True, inputs_embeds: jax.Array | None = None):
        if inputs_embeds is not None:
            raise ValueError("the teacher of a trimmed student embeds its own (mapped) token ids; inputs_embeds is "
                             "only for the student.")
        given = {"positions": positions, "attention_mask": attention_mask, "segment_ids": segment_ids}
        out = self.teacher(self.teacher_ids[...][input_ids], **{k: v for k, v in given.items() if v is not None},
                           capture=capture, return_logits=False)
        if return_logits:
            out.logits = self.logits_from_hidden(out.final_hidden)
        return out

    def head_matrix(self) -> jax.Array:
        return self.teacher.head_matrix()[self.teacher_ids[...]]

    def unused_head_parameters(self) -> int:
        """The teacher's head rows of pieces the student does not have, times the width: weights this wrapper's
        forward never multiplies (`distill.loop.metrics.step_flops` leaves them out)."""
        width = getattr(self.config, "hidden_size", None) or self.teacher.head_matrix().shape[1]
        return (vocab_rows(self.teacher) - int(self.teacher_ids[...].shape[0])) * int(width)

    def logits_from_hidden(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        return self.teacher.logits_from_hidden(hidden, self.head_matrix() if head is None else head)

    def shardings(self, mesh) -> nnx.State:
        """The teacher's own shardings (replicated when it has none), the token map replicated."""
        replicated = NamedSharding(mesh, PartitionSpec())
        inner = self.teacher.shardings(mesh) if callable(getattr(self.teacher, "shardings", None)) else \
            jax.tree.map(lambda _: replicated, nnx.state(self.teacher))
        return nnx.State({"teacher": inner, "teacher_ids": replicated})


def vocab_rows(model: Any) -> int:
    """The rows of `model`'s LM head: its config's vocab_size when it has one (an abstract model's weights cannot
    be read, only their shapes), else the head matrix's."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if size is not None else int(model.head_matrix().shape[0])


def checked_vocab_map(teacher_ids: Any, teacher_vocab: int | None = None) -> np.ndarray:
    """`teacher_ids` as int32, or a ValueError saying what is wrong with it (with `teacher_vocab`, also an id
    outside the teacher's vocabulary)."""
    ids = np.asarray(teacher_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"vocab_map must be a non-empty list of teacher token ids, one per student token; got "
                         f"an array of shape {ids.shape} and dtype {ids.dtype}.")
    if ids.min() < 0:
        raise ValueError(f"vocab_map holds the negative token id {int(ids.min())}; token ids start at 0.")
    if teacher_vocab is not None and ids.max() >= teacher_vocab:
        raise ValueError(f"vocab_map holds teacher token id {int(ids.max())}, outside the teacher's vocabulary "
                         f"[0, {teacher_vocab}); it was made for another teacher.")
    if len(np.unique(ids)) != ids.size:
        raise ValueError("vocab_map lists a teacher token id more than once; each student token is one teacher "
                         "token (use the plan's kept_vocab).")
    return ids.astype(np.int32)


def vocab_map_of(config: Any) -> tuple[int, ...] | None:
    """The run's vocab_map: `config.vocab_map`, else the plan's `kept_vocab` (None: one vocabulary)."""
    plan = config.plan
    planned = plan.get("kept_vocab") if isinstance(plan, dict) else getattr(plan, "kept_vocab", None)
    if config.vocab_map is not None and planned is not None and list(config.vocab_map) != list(planned):
        raise ValueError("DistillConfig.vocab_map differs from the plan's kept_vocab; give one of them (the plan "
                         "saved with the student is the map its tokenizer was made with).")
    return config.vocab_map if config.vocab_map is not None else planned


def in_student_vocabulary(teacher: Any, student: Any, config: Any) -> Any:
    """The teacher the run distils from: wrapped when the student's vocabulary is a subset of the teacher's."""
    teacher_ids = vocab_map_of(config) if teacher is not None else None
    if teacher_ids is None:
        return teacher
    student_vocab = vocab_rows(student)
    if len(teacher_ids) != student_vocab:
        raise ValueError(f"vocab_map has {len(teacher_ids)} teacher token ids but the student's vocabulary has "
                         f"{student_vocab} rows; use the kept_vocab of the plan this student was made with.")
    return TeacherInStudentVocabulary(teacher, teacher_ids)


__all__ = ["TeacherInStudentVocabulary", "TokenMap", "checked_vocab_map", "in_student_vocabulary", "vocab_map_of"]
