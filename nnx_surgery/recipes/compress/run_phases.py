"""The compress recipe's phases, in the order `compress.main` runs them. Each takes the run's settings
(`run_settings.RunSettings`) and the earlier phases' outputs and returns its own, a small frozen record:

    load_teacher_and_data(run)                          -> Loaded(teacher, data, mesh, calibration)
    correct_teacher(run, loaded)                        -> the corrected teacher (--teacher-correction)
    choose_student(run, loaded, teacher)                -> Chosen(run for the winner, search summary, scores)
    stage_a(run, loaded, teacher, scored)               -> StageA(plan, student, history, steps)
    final_cut(run, loaded, teacher, first, scored)      -> Cut(plan, student, pruned, data, lineage, tokenizer)
    distil(run, loaded, teacher, first, cut)            -> Trained(model, history, evals, steps)
    train_control(run, loaded, teacher, first, cut, distilled) -> Trained, or None with --control none
    pairing(run, first, cut, distilled, control)        -> how the control pairs with the distillation

A phase an earlier run finished (its folder in OUT/phases/) is read back instead of trained (`train`). The plan
made from the teacher after a search (stage A's, else the final cut's) reuses the teacher's calibration scores the
search measured (`Chosen.teacher_scores`) instead of a second calibration pass: the same plan, one pass fewer.

The control is paired with the distillation: it reads the same batches in the same order (the data position is
reset to the distillation's recorded start, so a resumed run pairs too) and, when it retrains the pruned student of
a one-shot cut, starts from bit-identical weights (checked). Each phase's history.json keeps its start (data
position, weights digest) and each step's batch digest; `pairing` compares them for results.json.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery.distill.inputs.source_reads import reads_line
from nnx_surgery.recipes.inputs import corpus
from nnx_surgery.recipes.compress import (compile_cache, phase_configs, search_phase, student_refit,
                                          teacher_caching, vocabulary)
from nnx_surgery.refusals import RecipeError
from nnx_surgery.recipes.compress.run_settings import RunSettings, for_student


class Interrupted(SystemExit):
    """--halt-after reached: the run stops like an interrupted job; rerun with --resume."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    teacher: Any
    data: distill.TokenBatches  # in the teacher's tokens
    mesh: Any
    calibration: Any  # the importance passes' rows (teacher tokens)


@dataclasses.dataclass(frozen=True)
class Chosen:
    run: RunSettings  # the settings for the student the run distils (the search's winner)
    search: dict | None  # the search's summary for results.json
    teacher_scores: surgery.TeacherScores | None = None  # the search's measurements of the teacher (calibration)


@dataclasses.dataclass(frozen=True)
class StageA:
    plan: surgery.Plan | None  # None: one-shot compression
    student: Any  # the distilled stage-A student, or the teacher itself
    history: list
    steps: int
    data_start: dict | None = None  # the data position stage A started from
    refit: student_refit.Refit | None = None  # the stage-A cut's refitted MLPs


@dataclasses.dataclass(frozen=True)
class Cut:
    plan: surgery.Plan
    student: Any  # the final cut of the stage-A student
    pruned: Any  # the same surgery on the raw teacher: the "before distillation" row
    data: distill.TokenBatches  # in the student's tokens
    lineage: dict  # teacher layer -> student layer, teacher channels and pieces kept
    tokenizer: str | None  # the trimmed student's tokenizer folder
    refit: student_refit.Refit | None = None  # the refitted MLPs (the control starts from them too)
    ahead: Any = None  # the distillation's step compiling since the refit started (compile_cache.ahead_of)


@dataclasses.dataclass(frozen=True)
class Trained:
    model: Any
    history: list
    evals: list
    steps: int
    data_start: dict | None = None  # the data position the phase started from (None: an older run's phase)
    start_weights: str | None = None  # distill.weights_digest of the model it started from


def load_teacher_and_data(run: RunSettings) -> Loaded:
    """The teacher in the run's precision on the mesh, its batches, and the calibration rows."""
    training = run.config.training
    mesh = distill.make_mesh(training.mesh, devices=training.mesh_devices) if training.mesh else None
    teacher = surgery.load_pretrained(run.teacher.folder, dtype=run.teacher.dtype, mesh=mesh)
    distill.check_vocabulary(run.teacher.folder, run.teacher.config.vocab_size)
    data = corpus.load_data(run.data)
    calibration = data.calibration_ids(run.config.surgery.calibration_samples, seed=run.config.run.seed)
    return Loaded(teacher, data, mesh, calibration)


def correct_teacher(run: RunSettings, loaded: Loaded):
    """Teacher correction (Minitron): the teacher fine-tuned with plain CE on the distillation corpus for
    --teacher-correction steps before it is pruned and teaches. It trains on its own copy of the batches, so the
    student's batches are those of a run without correction; it is saved in phases/teacher_correction (a
    resumed run reloads it)."""
    config, dtype = run.config, run.teacher.dtype
    print(f"[teacher correction] {config.teacher.correction} steps of plain CE on the corpus, learning rate "
          f"{config.teacher.correction_lr:g}", flush=True)
    # trained from the stored weights in float32; `train` gives it back in the run's precision, to teach in
    trainee = loaded.teacher if dtype == "float32" else surgery.load_pretrained(run.teacher.folder, dtype="float32",
                                                                                mesh=loaded.mesh)
    phase = run.phase_config("teacher_correction", [run.stages.teacher_correction])
    return train(run, "teacher_correction", None, trainee, copy.deepcopy(loaded.data), phase, loaded.mesh).model


def choose_student(run: RunSettings, loaded: Loaded, teacher) -> Chosen:
    """With --student params=...: each shape within the budget distilled briefly; the winner is the student."""
    spec, search, scores = search_phase.choose_student_spec(run, teacher, loaded.data, loaded.calibration, loaded.mesh)
    return Chosen(for_student(run, spec) if search else run, search, scores)


def stage_a(run: RunSettings, loaded: Loaded, teacher, scored: surgery.TeacherScores | None = None) -> StageA:
    """Staged compression: depth and MLP width cut from the teacher (plan_stage_a.json), then distilled.
    `scored`: the teacher's calibration scores, when the search measured them."""
    if run.student.stage_a_spec is None:
        return StageA(None, teacher, [], 0)
    plan = surgery.plan_student(teacher, run.student.stage_a_spec, calibration=loaded.calibration,
                                source=run.teacher.source, revision=run.config.teacher.revision,
                                seed=run.config.run.seed, scored=reused(scored))
    student = make_student(run, teacher, plan, "stage_a", loaded.mesh)
    print(surgery.format_report(plan))
    refit = student_refit.refit_student(run, teacher, plan, student, loaded.data)
    config = run.phase_config("stage_a", [run.stages.stage_a], plan, loaded.data)
    trained = train(run, "stage_a", teacher, student, loaded.data, config, loaded.mesh)
    return StageA(plan, trained.model, trained.history, config.total_steps, trained.data_start, refit)


def reused(scored: surgery.TeacherScores | None) -> surgery.TeacherScores | None:
    if scored is not None:
        print("[surgery] planned from the teacher's calibration scores the search measured (no second pass)",
              flush=True)
    return scored


def final_cut(run: RunSettings, loaded: Loaded, teacher, first: StageA,
              scored: surgery.TeacherScores | None = None) -> Cut:
    """The final plan, made on the stage-A student (or the teacher), and the student it cuts; with a trimmed
    vocabulary the student's tokenizer and the corpus in its tokens. `scored`: the teacher's calibration scores,
    when the search measured them (used when the plan is made from the teacher itself)."""
    spec, config = run.student.spec, run.config
    # A trimmed vocabulary keeps the pieces the training corpus uses most, counted over every training row (a few
    # calibration rows see too few of the pieces the student will meet).
    data = loaded.data
    vocab_rows = data.calibration_ids(data.num_rows, seed=config.run.seed) if spec.vocab_size is not None else None
    plan = surgery.plan_student(first.student, spec, calibration=loaded.calibration, vocab_calibration=vocab_rows,
                                seed=config.run.seed, measure_compensation=True,
                                scored=None if first.plan else reused(scored),
                                source=f"stage-A student of {run.teacher.source}" if first.plan else run.teacher.source,
                                revision=None if first.plan else config.teacher.revision, tokenizer=run.teacher.folder)
    data, tokenizer = vocabulary.student_batches(run.teacher.folder, plan, run.folder, data,
                                                 lambda folder: corpus.load_data(run.data, folder))
    pruned = pruned_student(teacher, first.plan, plan)
    student = make_student(run, first.student, plan, "stage_b", loaded.mesh)
    print(surgery.format_report(plan))
    lineage = composed_map(first.plan, plan)
    ahead = compile_cache.ahead_of(run, "stage_b", teacher, student, data,  # while the refit runs on the device
                                   lambda: run.phase_config("stage_b", run.stages.stage_b, lineage, data))
    refit = student_refit.refit_student(run, first.student, plan, student, data)
    return Cut(plan, student, pruned, data, lineage, tokenizer, refit, ahead)


def distil(run: RunSettings, loaded: Loaded, teacher, first: StageA, cut: Cut) -> Trained:
    """After a KV merge, a K/V warm-up with the rest frozen; then the main stages (one stage from the loss flags,
    --schedule, or the config file's stages). `steps` counts stage A's too."""
    config = run.phase_config("stage_b", run.stages.stage_b, cut.lineage, cut.data)
    compile_cache.waited(cut.ahead, "stage_b", "the refit")
    trained = train(run, "stage_b", teacher, cut.student, cut.data, config, loaded.mesh,
                    source=cut.tokenizer or run.teacher.folder)
    return dataclasses.replace(trained, steps=first.steps + config.total_steps)


def train_control(run: RunSettings, loaded: Loaded, teacher, first: StageA, cut: Cut, distilled: Trained,
                  ahead: distill.CompileAhead | None = None) -> Trained | None:
    """The control on the distillation's steps (stage A's included) and batches: the same pruned student
    retrained with plain CE, or the shape from scratch. A one-shot cut's pruned-CE control is made as the
    distilled student was and must start from its very weights (RecipeError otherwise, before it trains).
    `ahead`: its programs compiling since the distillation started (compile_cache.control_ahead), waited for."""
    config = run.config
    if config.student.control == "none":
        return None
    compile_cache.waited(ahead, "control", "the distillation")
    same_start = starts_alike(run, first)
    if same_start:
        control = make_student(run, first.student, cut.plan, "stage_b", loaded.mesh)
        student_refit.restore(control, cut.refit)
    elif config.student.control == "pruned-ce":
        control = pruned_student(teacher, first.plan, cut.plan)
    else:
        control = surgery.create_model(cut.pruned.config, dtype=run.teacher.dtype, seed=config.run.seed + 1,
                                       mesh=loaded.mesh)
    start_weights = distill.weights_digest(control)
    if same_start and distilled.start_weights not in (None, start_weights):
        raise RecipeError(f"the control would start from weights {start_weights} but the distilled student "
                          f"started from {distilled.start_weights}: they must be the same pruned student. Rerun "
                          "without --resume (or with --overwrite) so both are cut again.")
    start = paired_start(first, cut, distilled)
    if start is None:
        print("[control] the distillation's start position is not recorded (a run folder from an older version):"
              " the control continues the data stream where it stopped", flush=True)
    else:
        cut.data.restore(start)  # the distillation's batches, in its order
    phase = run.phase_config("control", [phase_configs.control_stage(config, distilled.steps)])
    return train(run, "control", None, control, cut.data, phase, loaded.mesh,
                 source=cut.tokenizer or run.teacher.folder, start_weights=start_weights)


def starts_alike(run: RunSettings, first: StageA) -> bool:
    """Whether the control must start from the distilled student's very weights: a pruned-CE control of a one-shot
    cut (after staged compression the distillation starts from stage A's cut of the teacher, and a scratch
    control from new weights)."""
    return run.config.student.control == "pruned-ce" and first.plan is None


def continues_stage_a(first: StageA, cut: Cut) -> bool:
    """Whether stage B read on in stage A's data stream (no trimmed vocabulary: the same teacher-token rows), so
    the distillation's batches are stage A's then stage B's."""
    return first.plan is not None and first.data_start is not None and \
        first.data_start.get("fingerprint") == cut.data.fingerprint


def paired_start(first: StageA, cut: Cut, distilled: Trained) -> dict | None:
    """The data position the control starts from: where the distillation started reading `cut.data` (stage A's
    start when stage B continued its stream, else stage B's)."""
    return first.data_start if continues_stage_a(first, cut) else distilled.data_start


def corpus_reads(run: RunSettings, loaded: Loaded, first: StageA, cut: Cut, distilled: Trained) -> dict:
    """How many times the distilled student's training (stage A's included) read each source of its text: the
    corpus and each general-prose source (TokenBatches.source_reads; the control reads the same rows). Printed in
    one line, and results.json's `corpus_reads`."""
    per_step = run.config.data.batch_size * run.config.distill.grad_accum  # rows
    stage_b = distilled.steps - first.steps
    if continues_stage_a(first, cut):  # one stream: stage A's rows, then stage B's
        counted = cut.data.source_reads(first.data_start, distilled.steps * per_step)
    else:
        counted = cut.data.source_reads(distilled.data_start, stage_b * per_step)
        if first.plan is not None and first.steps:  # stage A read the same text in the teacher's tokens: its
            earlier = loaded.data.source_reads(first.data_start, first.steps * per_step)  # reads add up
            for name, value in earlier.items():
                mine = counted.setdefault(name, dict(value, reads=0.0, tokens_read=0))
                mine["reads"] = round(mine["reads"] + value["reads"], 3)
                mine["tokens_read"] += value["tokens_read"]  # each phase's in its own tokens
    print(f"[data] the distillation read each source of its text (the control the same rows): "
          f"{reads_line(counted)}", flush=True)
    return counted


def pairing(run: RunSettings, first: StageA, cut: Cut, distilled: Trained, control: Trained | None) -> dict:
    """results.json's record of how the control pairs with the distillation: each phase's batch digests (one per
    step) and start weights, whether the control read the distillation's batches in the same order (stage A's
    included when stage B continued its stream; with a trimmed vocabulary stage A read the teacher's tokens) and
    whether both started from the same weights (`same_start`; None where they differ by design, `starts_alike`)."""
    staged_stream = continues_stage_a(first, cut)
    distilled_batches = ([r.get("batch_digest") for r in first.history] if staged_stream else []) + \
        [r.get("batch_digest") for r in distilled.history]
    record: dict[str, Any]  # results.json's JSON record
    record = {"distillation": {"phases": ["stage_a", "stage_b"] if staged_stream else ["stage_b"],
                               "start_weights": distilled.start_weights, "batch_digests": distilled_batches,
                               "batch_sequence": distill.sequence_digest([str(d) for d in distilled_batches])}}
    if control is None:
        return record
    control_batches = [r.get("batch_digest") for r in control.history]
    record["control"] = {"start_weights": control.start_weights, "batch_digests": control_batches,
                         "batch_sequence": distill.sequence_digest([str(d) for d in control_batches])}
    complete = None not in distilled_batches + control_batches
    record["batches"] = distill.compare_sequences(distilled_batches, control_batches) if complete else \
        {"same": False, "agreeing_steps": 0, "steps": [len(distilled_batches), len(control_batches)],
         "why": "a phase's steps have no batch digest (trained by an older version)"}
    record["same_start"] = (control.start_weights is not None and control.start_weights == distilled.start_weights
                            ) if starts_alike(run, first) else None
    return record


def train(run: RunSettings, phase: str, teacher, student, data, config, mesh, source: str | None = None,
          start_weights: str | None = None) -> Trained:
    """Distil one phase and save it in OUT/phases/PHASE (with the tokenizer files of `source`, default the
    teacher's), or reload it when an earlier run finished it. `steps` is the phase's own; the phase's start (data
    position, `start_weights` = the student's weights digest) is saved with it.

    The model it returns, and the folder, are in the run's precision (`run.teacher.dtype`, `in_precision`): the
    float32 master weights live only in training and the checkpoints, and a phase reloaded by a resumed run is the
    model the finished run held (so the evaluation and the next phases see the same weights and compile the same
    programs either way)."""
    dtype = run.teacher.dtype
    done = os.path.join(run.folder, "phases", phase)
    if os.path.exists(os.path.join(done, "history.json")):
        print(f"[{phase}] finished in an earlier run: loading {done}")
        with open(os.path.join(done, "history.json")) as f:
            logged = json.load(f)
        history, evals = (logged["train"], logged["eval"]) if isinstance(logged, dict) else (logged, [])
        if isinstance(logged, dict) and logged.get("data_state") is not None:
            data.restore(logged["data_state"])  # the next phase continues where this one stopped
        model = surgery.load_pretrained(done, dtype=dtype, mesh=mesh)
        start = logged.get("start", {}) if isinstance(logged, dict) else {}
        return Trained(model, history, evals, config.total_steps, start.get("data"), start.get("weights"))
    start = {"data": data.state(), "weights": start_weights or distill.weights_digest(student)}
    # on-policy distillation samples the student's continuations with generate's jitted KV-cache loop
    sampler = surgery.make_sampler() if teacher is not None and config.on_policy.fraction else None
    cached = teacher_caching.for_phase(run, phase, teacher, data, config, mesh)  # --teacher-cache
    if cached:
        config = dataclasses.replace(config, teacher_cache=cached)
    result = distill.run(None if cached else teacher, student, data, config, sampler=sampler)
    if cached:  # the cache's stream read the rows: the data continues where it stopped, as after a teacher run
        data.restore(result.data_state)
    if result.steps < config.total_steps:
        raise Interrupted(f"[{phase}] stopped after step {result.steps} as asked (--halt-after); "
                          "rerun with --resume to continue.")
    history, evals = result.full_history, result.full_evals  # across resumes
    in_precision(result.student, dtype)  # a float32 trainee (the teacher correction's) given back as it teaches
    surgery.save_pretrained(result.student, done, source=source or run.teacher.folder, overwrite=True,
                            extra_files={"history.json": {"train": history, "eval": evals, "start": start,
                                                          "data_state": result.data_state}})
    return Trained(result.student, history, evals, config.total_steps, start["data"], start["weights"])


def pruned_student(teacher, plan_a, plan):
    """The student before any distillation: the same surgery on the raw teacher. With staged compression the
    stage-B plan was made on the distilled stage-A student, so it is applied to the undistilled stage-A cut on
    purpose (same shapes, other weights: the plan's weight fingerprint is not checked)."""
    if plan_a is None:
        return surgery.apply_plan(teacher, plan)
    return surgery.apply_plan(surgery.apply_plan(teacher, plan_a), plan, check_weights=False)


def make_student(run: RunSettings, source_model, plan, phase: str, mesh):
    """Apply `plan` in memory, or with --from-disk (when the source is the teacher itself) write the student with
    prune_checkpoint, which reads only the kept slices of the teacher's files, and load it. Either way the
    student is in the run's precision, as the teacher it is cut from (`in_precision`)."""
    if run.config.surgery.from_disk and source_model is not None and plan.teacher_config == run.teacher.config:
        folder = os.path.join(run.folder, "surgery", phase)
        surgery.prune_checkpoint(run.teacher.folder, plan, folder, dtype=run.teacher.dtype, overwrite=True)
        return surgery.load_pretrained(folder, dtype=run.teacher.dtype, mesh=mesh)
    return surgery.apply_plan(source_model, plan)


def in_precision(model, dtype: str):
    """`model` with its floating parameters cast, in place, to `dtype` (the run's precision) where they differ.

    The rule for every model folder a run writes (the phases', the student's, --from-disk's cuts): the dtype the
    run loads the teacher in (`--precision`: float32 for fp32, bfloat16 for bf16), which is the pruned student's,
    as Hugging Face's save_pretrained writes a model in the dtype it was loaded in. A student then reaches the
    evaluation in the dtype of the pruned row, and its programs are the pruned student's."""
    state = nnx.state(model, nnx.Param)
    wanted = jnp.dtype(dtype)
    nnx.update(model, jax.tree.map(lambda x: x.astype(wanted) if jnp.issubdtype(x.dtype, jnp.floating)
                                   and x.dtype != wanted else x, state))
    return model


def composed_map(plan_a, plan_b) -> dict:
    """Teacher -> final-student layer and channel correspondence through both stages (plans are data), and the
    kept pieces of a trimmed vocabulary (stage A keeps every piece, so the final plan's ids are the teacher's)."""
    if plan_a is None:
        return {"kept_layers": plan_b.kept_layers, "kept_hidden": plan_b.kept_hidden,
                "kept_vocab": plan_b.kept_vocab}
    return {"kept_layers": [plan_a.kept_layers[i] for i in plan_b.kept_layers],
            "kept_hidden": [plan_a.kept_hidden[i] for i in plan_b.kept_hidden], "kept_vocab": plan_b.kept_vocab}


__all__ = ["Interrupted", "Loaded", "Chosen", "StageA", "Cut", "Trained", "load_teacher_and_data",
           "correct_teacher", "choose_student", "stage_a", "final_cut", "distil", "train_control", "train",
           "paired_start", "pairing",
           "pruned_student", "make_student", "in_precision", "composed_map"]
