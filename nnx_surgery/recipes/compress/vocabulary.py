"""A student with a trimmed vocabulary in the recipe (`--student layers=18,mlp=512,vocab=16384`, or vocab=0.0625).

The plan chooses the kept pieces from the calibration rows, which are in the teacher's ids (the pieces are the
teacher's). Once the plan fixes them:

  * the student's tokenizer (the teacher's tokenizer.json and configs restricted to the kept pieces and renumbered,
    `surgery.storage.tokenizer_files`) is written into the run folder, `student_tokenizer/`, atomically;
  * the corpus is tokenised again with it for everything that trains the student: text made of kept pieces
    tokenises exactly as the teacher tokenised it (renumbered), other text falls back to smaller pieces and bytes.
    The distillation's phase plan carries `kept_vocab`, so `distill.run` lets the teacher read the student's ids
    mapped to its own and teach its distribution restricted to the kept pieces, renormalised. The control (the same
    pruned, trimmed student with plain CE) trains on the same student-tokenised pipeline;
  * evaluation: each model is scored on the same held-out passages in its own tokens, trimmed students against the
    teacher restricted to their pieces (`evaluation.cross_vocab`), and compared with the teacher per byte.

Staged compression keeps the teacher's vocabulary in stage A (its spec has no vocab) and trims in the final plan,
made on the stage-A student, whose ids are still the teacher's. Stage B's batches then start their own stream: rows
of another tokenisation cannot continue stage A's position in the teacher-tokenised one (a shorter run may see
some of stage A's text again).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax

from nnx_surgery import distill
from nnx_surgery import evaluation
from nnx_surgery import surgery
from nnx_surgery.recipes.inputs.tiny_teacher import wait_for_process_0
from nnx_surgery.surgery.storage.atomic import atomic_folder
from nnx_surgery.surgery.pruning.tokenizer_files import trimmed_tokenizer_files

FOLDER = "student_tokenizer"


def write_student_tokenizer(teacher_folder: str, plan: surgery.Plan, out: str) -> str | None:
    """The trimmed student's tokenizer folder in the run folder (None when the plan keeps every piece). Written
    by process 0, the run folder being shared storage on multi-host; every process returns after it is there."""
    if plan.kept_vocab is None:
        return None
    folder = os.path.join(out, FOLDER)
    if jax.process_index() == 0:
        files = trimmed_tokenizer_files(teacher_folder, plan)  # built (and checked) before anything is written
        with atomic_folder(folder, overwrite=True) as scratch:
            for name, write in files.items():
                write(os.path.join(scratch, name))
    wait_for_process_0(f"student tokenizer {folder}")
    return folder


def student_batches(teacher_folder: str, plan: surgery.Plan, out: str, data: distill.TokenBatches,
                    load: Callable[[str], distill.TokenBatches]) -> tuple[distill.TokenBatches, str | None]:
    """(the batches the student trains on after the final cut, its tokenizer folder): `data` (teacher tokens) and
    None when the plan keeps the whole vocabulary, else the corpus tokenised again by `load(student tokenizer
    folder)` and that folder (the phases save it with the student's weights)."""
    tokenizer = write_student_tokenizer(teacher_folder, plan, out)
    kept_vocab = plan.kept_vocab
    if tokenizer is None or kept_vocab is None:  # None together: the plan keeps the whole vocabulary
        return data, None
    distill.check_vocabulary(tokenizer, len(kept_vocab))
    trimmed = load(tokenizer)
    teacher_rows, student_rows = data.num_rows, trimmed.num_rows
    print(f"[vocab] the student keeps {len(kept_vocab):,} of the teacher's {plan.teacher_config.vocab_size:,} "
          f"pieces; its tokenizer ({tokenizer}) makes {student_rows:,} training rows of the corpus "
          f"where the teacher's made {teacher_rows:,}", flush=True)
    return trimmed, tokenizer


def vocabularies(rows: list[tuple[str, Any, int]], plan: surgery.Plan, tokenizer: str | None,
                 teacher_vocab_size: int) -> dict[str, evaluation.Vocabulary]:
    """The rows (name, model, tokens) whose model has the plan's trimmed vocabulary, with its `tokenizer` (the
    student's folder) and map."""
    if plan.kept_vocab is None:
        return {}
    kept_vocab = tuple(plan.kept_vocab)
    return {name: evaluation.Vocabulary(tokenizer, kept_vocab) for name, model, _ in rows
            if model.config.vocab_size == len(kept_vocab) != teacher_vocab_size}


__all__ = ["write_student_tokenizer", "student_batches", "vocabularies", "FOLDER"]
