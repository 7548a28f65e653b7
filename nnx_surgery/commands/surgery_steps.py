"""`nnx-surgery plan` and `nnx-surgery prune`: surgery.plan_student, then Plan.save; surgery.prune_checkpoint."""
from __future__ import annotations

import argparse
import os

from nnx_surgery import distill, surgery
from nnx_surgery.commands import shape_line, text_batches
from nnx_surgery.model_inputs import teacher_source
from nnx_surgery.paths import empty_folder, input_paths, new_file
from nnx_surgery import model_inputs
from nnx_surgery import refusals


def plan(args: argparse.Namespace) -> str:
    """Plan a student of shape --student for TEACHER from calibration rows of the data (or data-free from the
    weights on disk with --calibration-samples 0) and write it to --output."""
    teacher = teacher_source(args.teacher, "TEACHER", args.revision)
    config = surgery.ModelConfig.from_file(teacher)
    spec = model_inputs.student_spec(args.student, config, tokenizer=teacher)
    out = new_file(args.output, "--output", args.overwrite, inside="plan.json",
                   inputs=input_paths(args.teacher, teacher, args.data))
    calibration = None
    if args.calibration_samples:
        distill.check_vocabulary(teacher, config.vocab_size)
        data, description = text_batches(args, teacher)
        calibration = data.calibration_ids(args.calibration_samples, seed=args.seed)
        print(f"[plan] {len(calibration)} calibration rows of {args.seq_len} tokens from {description}", flush=True)
    elif spec.vocab_size is not None:
        raise refusals.RecipeError(f"--calibration-samples 0 with --student {args.student!r}: a trimmed vocabulary's "
                              "pieces are chosen by their counts in calibration data; give --calibration-samples.")
    made = surgery.plan_student(teacher, spec, calibration=calibration, seed=args.seed, tokenizer=teacher)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    path = made.save(out)
    print(f"teacher: {shape_line(made.teacher_config)}")
    print(f"student: {shape_line(made.student)} "
          f"({made.student.num_parameters() / made.teacher_config.num_parameters():.0%} of the teacher)")
    print(f"kept teacher layers {made.kept_layers}; methods: "
          + ", ".join(f"{k} {v}" for k, v in made.methods.items()))
    print(f"plan: {path}  (next: nnx-surgery prune {args.teacher} {path} STUDENT_FOLDER)")
    return path


def prune(args: argparse.Namespace) -> str:
    """Write the student PLAN.json describes, cut from TEACHER's files, into OUTPUT (with the trimmed tokenizer
    when the plan keeps part of the vocabulary)."""
    teacher = teacher_source(args.teacher, "TEACHER")
    if not os.path.exists(args.plan):
        raise refusals.RecipeError(f"PLAN.json {args.plan}: no such file; make one with `nnx-surgery plan`.")
    out = empty_folder(args.output, "OUTPUT", args.overwrite, inputs=input_paths(args.teacher, teacher, args.plan))
    chosen = surgery.Plan.load(args.plan)
    folder = surgery.prune_checkpoint(teacher, chosen, out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"student: {shape_line(chosen.student)}")
    print(f"written: {folder}  (loads in transformers; next: nnx-surgery distill {args.teacher} {folder} "
          "--output DISTILLED)")
    return folder
