"""A student with a trimmed vocabulary in the recipe (`--student layers=18,mlp=512,vocab=16384`, or vocab=0.0625).

The plan chooses the kept pieces from the calibration rows, which are in the teacher's ids (the pieces are the
teacher's). Once the plan fixes them:

  * the student's tokenizer (the teacher's tokenizer.json and configs restricted to the kept pieces and renumbered,
    `surgery.vocab_files`) is written into the run folder, `student_tokenizer/`, atomically;
  * the corpus is tokenised again with it for everything that trains the student: text made of kept pieces
    tokenises exactly as the teacher tokenised it (renumbered), other text falls back to smaller pieces and bytes.
    The distillation's phase plan carries `kept_vocab`, so `distill.run` lets the teacher read the student's ids
    mapped to its own and teach its distribution restricted to the kept pieces, renormalised. The control (the same
    pruned, trimmed student with plain CE) trains on the same student-tokenised pipeline;
  * evaluation: each model is scored on the same held-out passages in its own tokens, trimmed students against the
    teacher restricted to their pieces (`distill.heldout_vocab`), and compared with the teacher per byte.

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
from nnx_surgery import surgery
from nnx_surgery.recipes.tiny_teacher import wait_for_process_0
from nnx_surgery.surgery.atomic import atomic_folder
from nnx_surgery.surgery.vocab_files import trimmed_tokenizer_files

FOLDER = "student_tokenizer"


def write_student_tokenizer(args, plan: surgery.Plan, out: str) -> str | None:
    """The trimmed student's tokenizer folder in the run folder (None when the plan keeps every piece). Written
    by process 0, the run folder being shared storage on multi-host; every process returns after it is there."""
    if plan.kept_vocab is None:
        return None
    folder = os.path.join(out, FOLDER)
    if jax.process_index() == 0:
        files = trimmed_tokenizer_files(args.teacher_folder, plan)  # built (and checked) before anything is written
        with atomic_folder(folder, overwrite=True) as scratch:
            for name, write in files.items():
                write(os.path.join(scratch, name))
    wait_for_process_0(f"student tokenizer {folder}")
    return folder


def student_batches(args, plan: surgery.Plan, out: str, data: distill.TokenBatches,
                    load: Callable[[str], distill.TokenBatches]) -> distill.TokenBatches:
    """The batches the student trains on after the final cut: `data` (teacher tokens) when the plan keeps the
    whole vocabulary, else the corpus tokenised again by `load(student tokenizer folder)`. Sets
    `args.student_tokenizer` (None without trimming): the phases save it with the student's weights."""
    args.student_tokenizer = write_student_tokenizer(args, plan, out)
    if args.student_tokenizer is None:
        return data
    distill.data.check_vocabulary(args.student_tokenizer, len(plan.kept_vocab))
    trimmed = load(args.student_tokenizer)
    teacher_rows, student_rows = data.num_rows, trimmed.num_rows
    print(f"[vocab] the student keeps {len(plan.kept_vocab):,} of the teacher's {args.teacher_config.vocab_size:,} "
          f"pieces; its tokenizer ({args.student_tokenizer}) makes {student_rows:,} training rows of the corpus "
          f"where the teacher's made {teacher_rows:,}", flush=True)
    return trimmed


def vocabularies(args, rows: list[tuple[str, Any, int]], plan: surgery.Plan) -> dict[str, distill.Vocabulary]:
    """The rows (name, model, tokens) whose model has the plan's trimmed vocabulary, with its tokenizer and map."""
    if plan.kept_vocab is None:
        return {}
    return {name: distill.Vocabulary(args.student_tokenizer, plan.kept_vocab) for name, model, _ in rows
            if model.config.vocab_size == len(plan.kept_vocab) != args.teacher_config.vocab_size}


def phase_source(args, phase: str) -> str:
    """The tokenizer files saved with a phase's model: the student's once it has a trimmed vocabulary."""
    trimmed = getattr(args, "student_tokenizer", None)
    return trimmed if trimmed and phase in ("stage_b", "control") else args.teacher_folder


__all__ = ["write_student_tokenizer", "student_batches", "vocabularies", "phase_source", "FOLDER"]
